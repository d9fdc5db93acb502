"""The rollout fleet on two nodes, simulated on this machine: a ``ray.cluster_utils.Cluster`` (tests/ray_cluster_driver.py,
run under ``.venv-rollout``) of a head node without GPUs, where the fleet driver connects, and two worker nodes of 2
logical GPUs each. The fleet's placement group spreads its two one-GPU engines over both nodes; one node's raylet is
killed, Ray re-reserves the lost bundle on the survivor's free GPU, the driver restarts the engine there, and the
same seeded requests get the same answers as before the loss (vLLM's CPU build in every engine).
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
READY_TIMEOUT_S = 900.0  # two engines start side by side on 2 shared cores
RESTART_TIMEOUT_S = 600.0  # node death noticed (Ray's health checks), bundle re-placed, engine restarted


def test_engines_on_both_nodes_restart_on_the_survivor_when_a_node_dies(tmp_path):
    venv = require_rollout_venv()
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
        handle = spawn_worker(tmp_path / "spool", model=base, engines=2, engine_restarts=1, in_process=True,
                              ray_address=info["address"], dtype="float32", max_model_len=cfg.max_position_embeddings,
                              ready_timeout_s=READY_TIMEOUT_S, log_path=tmp_path / "fleet.log")  # fmt: skip
        client = make_rollout_client("spool", spool=tmp_path / "spool", timeout_s=RESTART_TIMEOUT_S, worker=handle)
        hb = client.spool.read_heartbeat()
        placed = [node_name.get(e["node_id"]) for e in hb["engines"]]
        assert sorted(placed) == ["a", "b"], hb["engines"]  # one engine on each worker node, none on the head
        prompts = [[3, 4, 5], [6, 7], [8, 9, 10], [4, 5, 6, 7]]
        params = SamplingParams(n=2, max_tokens=6, seed=0)
        before = client.generate(prompts, params)
        assert client.last_timings["engines"] == {"0": 2, "1": 2}  # both nodes served
        other_seed = client.generate(prompts, SamplingParams(n=2, max_tokens=6, seed=1))
        assert [c.token_ids for c in other_seed] != [c.token_ids for c in before]  # control: answers depend on seed

        victim = placed.index("b")
        cluster.stdin.write("kill b\n")
        cluster.stdin.flush()
        assert json.loads(cluster.stdout.readline()) == {"killed": "b"}
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            hb = client.spool.read_heartbeat() or {}
            eng = hb.get("engines", [{}, {}])[victim]
            if eng.get("restarts") == 1 and eng.get("state") == "ready":
                break
            assert hb.get("state") != "failed", hb
            time.sleep(0.5)
        assert eng.get("restarts") == 1 and eng.get("state") == "ready", hb
        assert [d["index"] for d in hb["engine_deaths"]] == [victim]
        assert [node_name.get(e["node_id"]) for e in hb["engines"]] == ["a", "a"]  # restarted on the survivor
        after = client.generate(prompts, params)
        assert client.last_timings["engines"] == {"0": 2, "1": 2}  # the restarted engine serves again
        assert [c.token_ids for c in after] == [c.token_ids for c in before]
        assert {c.weights_version for c in after} == {0}
    finally:
        if handle is not None:
            handle.shutdown(grace_s=30)
        cluster.stdin.close()
        cluster.wait(timeout=120)
