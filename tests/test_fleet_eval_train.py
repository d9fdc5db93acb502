"""``align.train --eval-num-gpus 1`` with the Ray rollout fleet (``--rollout spool --rollout-ray``), for real: a local
Ray cluster with logical GPUs, vLLM's CPU build in the engine actors, the tiny model.

The eval engine is an actor in the bundle appended after the rollout engine's, behind the fleet's eval router (run by
the driver's EvalRunner actor), reached through the eval spool: no spool-worker eval fleet is started. Every eval
point pins it (load, version read-back, probe). The eval engine actor is SIGKILLed before the second eval point: the
heartbeat shows the death, that point restarts the engine on its snapshot and produces its record (``--ci-test``:
any skipped point would fail the run).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest
from helpers_models import require_rollout_venv

from align.rollout.spool import Spool

pytestmark = [pytest.mark.rollout, pytest.mark.slow]

TIMEOUT_S = 900.0  # engine starts on 2 shared cores (~30-60 s each, more under load)
DEATH_SEEN_S = 60.0  # the router pings its engines every --heartbeat-s (1 s)


def test_train_evals_on_the_ray_fleet_and_a_dead_eval_engine_restarts_at_the_next_point(
    tmp_path, monkeypatch, reverse_model
):
    require_rollout_venv()
    from align.eval.config import EvalConfig
    from align.eval.fleet import EvalFleet
    from align.rollout import client as client_mod
    from align.tasks import reverse
    from align.train import TrainConfig, train

    tok = reverse.tokenizer()
    base = reverse_model
    run = tmp_path / "run"
    eval_spool = Spool(run / "eval_spool")
    spawned: list[dict] = []
    real_spawn = client_mod.spawn_worker

    def spy_spawn(*args, **kw):
        spawned.append(kw)
        return real_spawn(*args, **kw)

    pins: list[dict] = []
    real_pin = EvalFleet.pin

    def spy_pin(self, checkpoint_dir, version):
        if len(pins) == 1:  # before the second eval point: kill the eval engine's actor process
            (engine,) = eval_spool.read_heartbeat()["engines"]
            os.kill(engine["pid"], signal.SIGKILL)
            deadline = time.monotonic() + DEATH_SEEN_S
            while eval_spool.read_heartbeat()["engines"][0]["state"] != "dead" and time.monotonic() < deadline:
                time.sleep(0.2)
            pins.append({"killed": engine["pid"], "seen": eval_spool.read_heartbeat()["engines"][0]["state"]})
        state = real_pin(self, checkpoint_dir, version)
        pins.append({"version": version, "hb": eval_spool.read_heartbeat()})
        return state

    monkeypatch.setattr(client_mod, "spawn_worker", spy_spawn)
    monkeypatch.setattr(EvalFleet, "pin", spy_pin)
    ev = EvalConfig(eval_interval=2, eval_num_gpus=1, eval_hf_dir=str(tmp_path / "eval_hf"), eval_n=2, ci_test=True,
                    eval_timeout_s=TIMEOUT_S)  # fmt: skip
    cfg = TrainConfig(out=str(run), steps=4, prompts_per_step=4, group_size=4, max_tokens=6, lr=1e-2,
                      rollout="spool", rollout_ray=True, rollout_in_process=True, rollout_timeout_s=TIMEOUT_S,
                      checkpoint_every=0, eval=ev)  # fmt: skip
    summary = train(cfg, model=str(base), tokenizer=tok, prompts=reverse.prompts(16, "train"),
                    eval_prompts=reverse.prompts(4, "eval"),
                    reward=lambda prompt, completion, **_: completion.count("a") / 6)  # fmt: skip
    assert summary["steps"] == 4
    assert len(spawned) == 1 and spawned[0]["eval_engines"] == 1 and spawned[0]["use_fleet"] is True
    assert not glob.glob(str(tmp_path / "eval_hf" / "fleet-*"))  # no spool-worker eval fleet was started
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "eval/pass@1" in r] == [0, 2, 4]
    assert not [r for r in recs if any(k.startswith("eval/skipped") for k in r)]
    first, killed, second, third = pins
    assert [p["version"] for p in (first, second, third)] == [0, 2, 4]
    e0, e2 = first["hb"]["engines"][0], second["hb"]["engines"][0]
    assert e0["bundles"] == [1] and e0["version"] == 0 and e0["restarts"] == 0  # appended after rollout's [0]
    # started on the base model (caller-owned), not on the run's first rollout snapshot, which the run deletes
    # after the first sync (seen: the eval engine, starting later than the rollout one, found it gone)
    assert first["hb"]["model"] == str(base.resolve())
    assert killed["seen"] == "dead" and killed["killed"] == e0["pid"]  # the heartbeat showed the death
    assert e2["state"] == "ready" and e2["version"] == 2 and e2["restarts"] == 1 and e2["pid"] != e0["pid"]
    assert third["hb"]["engines"][0]["version"] == 4
    assert [d["pid"] for d in third["hb"]["engine_deaths"]] == [e0["pid"]]
    roll = Spool(run / "spool").read_heartbeat()
    assert roll["region"] == "rollout" and {e["version"] for e in roll["engines"]} == {4}  # never an eval version
    assert first["hb"]["pid"] != roll["pid"]  # the eval router is the runner actor, not the fleet driver
