"""The rollout fleet on two nodes, simulated on this machine: a ``ray.cluster_utils.Cluster`` (tests/ray_cluster_driver.py,
run under ``.venv-rollout``) of a head node without GPUs, where the fleet driver connects, and two worker nodes of 2
logical GPUs each. The fleet has one rollout engine and one eval engine (its own router on the eval spool); the
placement group spreads the two one-GPU bundles over both nodes. The eval engine's node's raylet is killed: the eval
heartbeat shows the engine dead, Ray re-reserves its bundle on the survivor's free GPU, the next eval point's weight
load (a ``sync_weights`` on the eval spool, as ``align.eval.fleet.EvalFleet`` pins it) restarts it there, and the same
seeded eval requests get the same answers as before the loss, while the rollout engine serves throughout (vLLM's CPU
build in every engine).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers_models import require_rollout_venv

from align.rollout.client import make_rollout_client, spawn_worker
from align.rollout.protocol import SamplingParams

pytestmark = [pytest.mark.rollout, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 900.0  # two engines start on 2 shared cores
RESTART_TIMEOUT_S = 600.0  # node death noticed (Ray's health checks), bundle re-placed, engine restarted


def test_eval_engine_restarts_on_the_survivor_when_its_node_dies_and_rollout_serves_on(tmp_path):
    venv = require_rollout_venv()
    from align.eval.fleet import wait_router_ready
    from align.model import Transformer, save_pretrained
    from align.tasks import reverse

    tok = reverse.tokenizer()
    cfg = reverse.model_config(tok)
    base = save_pretrained(Transformer(cfg).init_weights(seed=0), tmp_path / "base")
    cluster = subprocess.Popen([str(venv / "bin" / "python"), str(HERE / "ray_cluster_driver.py"), "2"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    handle = None
    try:
        info = json.loads(cluster.stdout.readline())
        node_name = {v: k for k, v in info["nodes"].items()}
        handle = spawn_worker(tmp_path / "spool", model=base, engines=1, engine_restarts=0, in_process=True,
                              ray_address=info["address"], eval_engines=1, eval_spool=tmp_path / "eval_spool",
                              dtype="float32", max_model_len=cfg.max_position_embeddings,
                              ready_timeout_s=READY_TIMEOUT_S, log_path=tmp_path / "fleet.log")  # fmt: skip
        rollout = make_rollout_client("spool", spool=tmp_path / "spool", timeout_s=RESTART_TIMEOUT_S, worker=handle)
        evals = make_rollout_client("spool", spool=tmp_path / "eval_spool", timeout_s=RESTART_TIMEOUT_S, worker=handle)
        wait_router_ready(evals.spool, READY_TIMEOUT_S, handle)
        (roll_engine,) = rollout.spool.read_heartbeat()["engines"]
        (eval_engine,) = evals.spool.read_heartbeat()["engines"]
        placed = {"rollout": node_name.get(roll_engine["node_id"]), "eval": node_name.get(eval_engine["node_id"])}
        assert sorted(placed.values()) == ["a", "b"], placed  # one engine on each worker node, none on the head
        assert eval_engine["bundles"] == [1] and eval_engine["state"] == "ready"  # appended after rollout's [0]
        prompts = [[3, 4, 5], [6, 7], [8, 9, 10], [4, 5, 6, 7]]
        params = SamplingParams(n=2, max_tokens=6, seed=0)
        roll_before = rollout.generate(prompts, params)
        eval_before = evals.generate(prompts, params)
        assert evals.last_timings["engines"] == {"0": 4}  # the eval router's one engine served every prompt
        eval_other_seed = evals.generate(prompts, SamplingParams(n=2, max_tokens=6, seed=1))
        assert [c.token_ids for c in eval_other_seed] != [c.token_ids for c in eval_before]  # control: seed matters

        cluster.stdin.write(f"kill {placed['eval']}\n")
        cluster.stdin.flush()
        assert json.loads(cluster.stdout.readline()) == {"killed": placed["eval"]}
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            hb = evals.spool.read_heartbeat() or {}
            if hb.get("engines", [{}])[0].get("state") == "dead":
                break
            assert hb.get("state") != "failed", hb
            time.sleep(0.5)
        assert hb.get("engines", [{}])[0].get("state") == "dead", hb  # the eval heartbeat shows it (health pings)
        assert [d["index"] for d in hb["engine_deaths"]] == [0]
        roll_during = rollout.generate(prompts, params)  # the rollout engine serves while the eval engine is down
        assert [c.token_ids for c in roll_during] == [c.token_ids for c in roll_before]

        evals.sync_weights(base, 1)  # the next eval point's load restarts the dead eval engine on the snapshot
        (eval_engine,) = evals.spool.read_heartbeat()["engines"]
        assert eval_engine["state"] == "ready" and eval_engine["restarts"] == 1 and eval_engine["version"] == 1
        assert node_name.get(eval_engine["node_id"]) == placed["rollout"]  # restarted on the survivor
        eval_after = evals.generate(prompts, params)
        assert [c.token_ids for c in eval_after] == [c.token_ids for c in eval_before]
        assert {c.weights_version for c in eval_after} == {1}  # served by the restarted, pinned engine
        roll_after = rollout.generate(prompts, params)
        assert [c.token_ids for c in roll_after] == [c.token_ids for c in roll_before]
        roll_hb = rollout.spool.read_heartbeat()
        assert roll_hb["engine_deaths"] == [] and roll_hb["engines"][0]["restarts"] == 0  # never touched
        assert {c.weights_version for c in roll_after} == {0}  # the eval load never reached the rollout engine
    finally:
        if handle is not None:
            handle.shutdown(grace_s=30)
        cluster.stdin.close()
        cluster.wait(timeout=120)
