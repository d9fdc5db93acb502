"""Eval dispatcher, runner, fleet pin and CheckpointEvalFn, against the behaviour of miles' eval_dispatch.py (docs/eval.md).

Fast and CPU-only. The backends here are in-test fakes (an eval function that blocks on events, fake spool
clients with a version read-back) because these tests pin down ordering and bookkeeping, which a real engine
would only make slow; the real vLLM fleet is in test_eval_fleet.py, the real `vllm serve` in test_eval_external.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from argparse import Namespace
from itertools import combinations

import pytest

from align.atomic import COMMIT_MARKER as MARKER
from align.eval import (
    CheckpointEvalFn,
    EvalConfig,
    EvalFleet,
    EvalInput,
    EvalSet,
    EvalSkip,
    load_eval_fn,
    make_evaluator,
    pass_at_k,
    retarget_args,
)
from align.eval.dispatcher import EvalDispatcher, EvalRunner, export_snapshot, is_complete
from align.eval.fleet import FleetEngine
from align.eval.metrics import Scored, ks_for, score_completions, scored
from align.rollout.protocol import Completion, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT_S = 10.0  # generous bound for a thread handoff on a loaded 2-core machine
EXPORT_S = 0.05  # how long the fake export takes where a test measures it


def toy_set() -> EvalSet:
    # reward 1 when the completion's first token equals the prompt's first token
    prompts = [[5, 6], [7, 8], [9]]
    return EvalSet(prompts=prompts, score=lambda i, toks: float(toks[:1] == prompts[i][:1]), name="toy")


def cfg(tmp_path, **kw) -> EvalConfig:
    base = {"eval_interval": 1, "eval_function_path": "unused:Fn", "eval_hf_dir": str(tmp_path / "eval_hf")}
    base.update(kw)
    return EvalConfig(**base)


class Exporter:
    """export_fn fake: writes a one-file 'snapshot' holding the step it was called at; can fail or block."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_at: set[int] = set()
        self.gate: threading.Event | None = None
        self.delay_s = 0.0
        self.step = 0

    def __call__(self, path: str) -> None:
        self.calls.append(path)
        os.makedirs(path)
        with open(os.path.join(path, "model.safetensors"), "w") as f:
            f.write(str(self.step))
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        if self.step in self.fail_at:
            raise OSError(f"disk full at step {self.step}")


class FakeEvalFn:
    """An eval function: records calls; steps in `block` wait for their event; `raise_at` maps step -> exception."""

    def __init__(self) -> None:
        self.calls: list[EvalInput] = []
        self.block: dict[int, threading.Event] = {}
        self.raise_at: dict[int, BaseException] = {}
        self.running = 0
        self.max_running = 0
        self._mu = threading.Lock()

    def __call__(self, inp: EvalInput) -> dict:
        with self._mu:
            self.calls.append(inp)
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            if inp.step in self.block:
                assert self.block[inp.step].wait(WAIT_S), f"eval {inp.step} was never released"
            if inp.step in self.raise_at:
                raise self.raise_at[inp.step]
            with open(os.path.join(inp.hf_dir, "model.safetensors")) as f:
                measured = int(f.read())
            return {"eval/pass@1": 0.5, "eval/measured_step": measured}
        finally:
            with self._mu:
                self.running -= 1


def make(tmp_path, fn=None, **kw):
    c = cfg(tmp_path, **kw)
    fn = fn or FakeEvalFn()
    exporter = Exporter()
    d = EvalDispatcher(c, EvalRunner(c, toy_set(), eval_fn=fn), exporter)
    return d, fn, exporter


@pytest.fixture
def disp(tmp_path):
    made = []

    def factory(**kw):
        out = make(tmp_path, **kw)
        made.append(out[0])
        return out

    yield factory
    for d in made:
        for ev in getattr(d.runner.eval_fn, "block", {}).values():
            ev.set()
        try:
            d.close()
        except RuntimeError:
            pass  # ci_test failures already asserted by the test


def dispatch(d, exporter, step, **kw):
    exporter.step = step
    d.dispatch(step, **kw)


def skips(records):
    return [(r["step"], k[len("eval/skipped_") :]) for r in records for k in r if k.startswith("eval/skipped_")]


# ---- D3 1-11: dispatch, overflow, retention ----


def test_dispatch_exports_to_step_dir_and_fires(disp, tmp_path):
    d, fn, ex = disp()
    ex.delay_s = EXPORT_S
    dispatch(d, ex, 4)
    final = tmp_path / "eval_hf" / "step_4"
    assert final.is_dir() and (final / MARKER).is_file()  # committed by its marker
    records = d.drain()
    assert [c.step for c in fn.calls] == [4] and fn.calls[0].hf_dir == str(final)
    assert fn.calls[0].weight_version == 4 and fn.calls[0].export_time_seconds is not None
    (r,) = records
    assert r["step"] == 4 and r["eval/step"] == 4 and r["eval/measured_step"] == 4
    # the export's own time, as the eval function was told it
    assert EXPORT_S <= r["eval/export_time_seconds"] == fn.calls[0].export_time_seconds and "eval/duration_seconds" in r
    assert r["eval/train_blocked_seconds"] >= r["eval/export_time_seconds"]  # the loop paid the export, no eval
    assert not [p for p in os.listdir(tmp_path / "eval_hf") if p.startswith(".")]  # no temp dir left


def test_export_returns_only_after_the_snapshot_is_committed(disp, tmp_path):
    d, _fn, ex = disp()
    ex.gate = threading.Event()
    done = threading.Event()
    t = threading.Thread(target=lambda: (dispatch(d, ex, 1), done.set()), daemon=True)
    t.start()
    time.sleep(0.3)
    assert not done.is_set(), "dispatch returned before the export finished"
    assert not is_complete(str(tmp_path / "eval_hf" / "step_1"))
    ex.gate.set()
    assert done.wait(WAIT_S)
    assert is_complete(str(tmp_path / "eval_hf" / "step_1"))  # I1: committed by the time dispatch returns


def test_failed_export_leaves_nothing_and_skips_export_failed(disp, tmp_path):
    d, fn, ex = disp()
    ex.fail_at = {4}
    dispatch(d, ex, 4)
    assert os.listdir(tmp_path / "eval_hf") == []  # partial dir removed, nothing renamed into place
    assert fn.calls == [] and not d.pending
    assert skips(d.drain()) == [(4, "export_failed")]


def test_skip_policy_drops_busy_point_before_export(disp):
    d, fn, ex = disp(eval_max_in_flight=1, eval_overflow_policy="skip")
    fn.block[1] = threading.Event()
    dispatch(d, ex, 1)
    dispatch(d, ex, 2)
    assert len(ex.calls) == 1, "a busy point must be dropped before its export"
    fn.block[1].set()
    records = d.drain()
    assert skips(records) == [(2, "busy")]
    assert [c.step for c in fn.calls] == [1]


def test_force_overrides_skip_policy(disp):
    d, fn, ex = disp(eval_max_in_flight=1, eval_overflow_policy="skip")
    fn.block[1] = threading.Event()
    dispatch(d, ex, 1)
    threading.Timer(0.3, fn.block[1].set).start()
    dispatch(d, ex, 2, force=True)  # the final step: waits for the oldest instead of dropping
    records = d.drain()
    assert skips(records) == [] and [c.step for c in fn.calls] == [1, 2]


def test_backpressure_awaits_only_the_oldest(disp):
    d, fn, ex = disp(eval_max_in_flight=2)
    for s in (1, 2):
        fn.block[s] = threading.Event()
    dispatch(d, ex, 1)
    dispatch(d, ex, 2)
    done = threading.Event()
    t = threading.Thread(target=lambda: (dispatch(d, ex, 3), done.set()), daemon=True)
    t.start()
    time.sleep(0.3)
    assert not done.is_set() and len(ex.calls) == 2, "backpressure must wait before exporting"
    fn.block[1].set()  # only the oldest settles; point 2 still runs
    assert done.wait(WAIT_S)
    assert [p.step for p in d.pending] == [2, 3]  # bounded: never more than eval_max_in_flight
    fn.block[2].set()
    d.drain()
    assert [c.step for c in fn.calls] == [1, 2, 3]


def test_pending_never_exceeds_max_in_flight_and_evals_run_one_at_a_time(disp):
    d, fn, ex = disp(eval_max_in_flight=2)
    for s in range(1, 7):
        dispatch(d, ex, s)
        assert len(d.pending) <= 2
    d.drain()
    assert fn.max_running == 1  # I3: one eval at a time
    assert [c.step for c in fn.calls] == list(range(1, 7))  # in dispatch order


def test_save_hf_is_never_reused_as_eval_snapshot(tmp_path):
    # align has no "reuse mode": --save-hf checkpoints are never eval snapshots, and the trees must not overlap.
    c = cfg(tmp_path, eval_hf_dir=str(tmp_path / "ckpt" / "eval"))
    for bad in (str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / "eval"), str(tmp_path / "ckpt/eval/x/step_3")):
        with pytest.raises(ValueError, match="overlaps --save-hf"):
            c.check_save_hf(bad)
    c.check_save_hf(str(tmp_path / "save_hf" / "step_3"))  # disjoint: fine
    c.check_save_hf(None)


def test_save_hf_template_is_refused_because_train_never_fills_it(tmp_path):
    """--save-hf is exported once, at the final step: a '{step}' template used to pass and be written verbatim."""
    for c in (cfg(tmp_path), EvalConfig()):  # with and without an --eval-hf-dir
        with pytest.raises(ValueError, match=r"--save-hf .*step_\{step\}' is a template.*pass a plain directory"):
            c.check_save_hf(str(tmp_path / "save_hf" / "step_{step}"))
    cfg(tmp_path).check_save_hf(str(tmp_path / "save_hf" / "final"))  # control: a plain directory passes


def test_caller_supplied_dir_bypasses_marker_and_is_kept(disp, tmp_path):
    d, _fn, ex = disp(eval_keep_snapshots=0)
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_text("0")  # no marker: a caller-owned checkpoint
    d.dispatch(0, hf_dir=str(base))
    records = d.drain()
    assert ex.calls == [] and records[0]["step"] == 0 and skips(records) == []
    assert base.is_dir() and d.exported == []


def test_retention_ring_keeps_last_k(disp, tmp_path):
    d, _fn, ex = disp(eval_keep_snapshots=2)
    for s in (1, 2, 3):
        dispatch(d, ex, s)
    d.drain()
    assert sorted(os.listdir(tmp_path / "eval_hf")) == ["step_2", "step_3"]


def test_crashed_eval_still_retires_its_snapshot(disp, tmp_path):
    fn = FakeEvalFn()
    fn.raise_at[1] = ZeroDivisionError("bug in the eval fn")
    d, fn, ex = disp(fn=fn, eval_keep_snapshots=1)
    dispatch(d, ex, 1)
    assert skips(d.drain()) == [(1, "crashed")]
    assert d.exported == [str(tmp_path / "eval_hf" / "step_1")]  # retired exactly once
    dispatch(d, ex, 2)
    d.drain()
    assert os.listdir(tmp_path / "eval_hf") == ["step_2"]  # the crashed point's dir went with the next settle


def test_keep_zero_deletes_every_settled_snapshot(disp, tmp_path):
    d, _fn, ex = disp(eval_keep_snapshots=0)
    dispatch(d, ex, 1)
    d.drain()
    assert os.listdir(tmp_path / "eval_hf") == []


def test_never_deletes_what_it_did_not_export(disp, tmp_path):
    d, _fn, ex = disp(eval_keep_snapshots=0)
    root = tmp_path / "eval_hf"
    root.mkdir()
    (root / "notes").mkdir()  # a stranger's dir inside the staging root
    base = tmp_path / "base"
    base.mkdir()
    d.dispatch(0, hf_dir=str(base))
    dispatch(d, ex, 1)
    d.drain()
    assert base.is_dir() and (root / "notes").is_dir()
    assert d.exported == []  # the ring only ever held the one export, now deleted
    assert not (root / "step_1").exists()


def test_degraded_posture_blocks_in_process():
    calls = []
    c = EvalConfig(eval_interval=2)  # no fleet, no CheckpointEvalFn
    ev = make_evaluator(
        c, toy_set(), export_fn=None, blocking_eval_fn=lambda s: calls.append(s) or {"eval/pass@1": 1.0}
    )
    assert ev.posture == "blocking" and ev.dispatcher is None
    assert ev.step(1) == [] and calls == []
    (r,) = ev.step(2)
    assert calls == [2] and r["step"] == 2 and r["eval/pass@1"] == 1.0  # ran inline, before step() returned
    (r,) = ev.step(3, is_final=True)
    assert r["step"] == 3
    assert ev.drain() == [] and ev.drain() == []


def test_degraded_posture_needs_a_blocking_eval_fn():
    with pytest.raises(ValueError, match="no blocking_eval_fn"):
        make_evaluator(EvalConfig(eval_interval=2), toy_set(), export_fn=None, blocking_eval_fn=None)


def test_eval_off_does_nothing():
    ev = make_evaluator(EvalConfig(), toy_set(), export_fn=None, blocking_eval_fn=lambda s: 1 / 0)
    assert ev.posture == "off" and ev.step(1, is_final=True) == [] and ev.drain() == []


# ---- D3 12-14: runner ----


def test_runner_serializes_concurrent_points_fifo(disp):
    d, fn, ex = disp(eval_max_in_flight=3)
    for s in (1, 2, 3):
        fn.block[s] = threading.Event()
        dispatch(d, ex, s)
    time.sleep(0.3)
    assert [c.step for c in fn.calls] == [1], "point 2 must not start before point 1 settled"
    fn.block[3].set()
    fn.block[2].set()
    time.sleep(0.2)
    assert [c.step for c in fn.calls] == [1]
    fn.block[1].set()
    records = d.drain()
    assert [r["step"] for r in records] == [1, 2, 3]  # FIFO settle
    assert fn.max_running == 1


def test_missing_marker_skips_ckpt_missing(disp, tmp_path):
    d, fn, ex = disp(eval_max_in_flight=2, eval_keep_snapshots=5)
    fn.block[1] = threading.Event()
    dispatch(d, ex, 1)
    dispatch(d, ex, 2)
    os.remove(tmp_path / "eval_hf" / "step_2" / MARKER)  # the snapshot lost its commit before its eval ran
    fn.block[1].set()
    records = d.drain()
    assert skips(records) == [(2, "ckpt_missing")]
    assert [c.step for c in fn.calls] == [1]  # the eval fn never saw the uncommitted dir


def test_evalskip_reason_propagates(disp):
    fn = FakeEvalFn()
    fn.raise_at[1] = EvalSkip("server_down")
    d, fn, ex = disp(fn=fn)
    dispatch(d, ex, 1)
    dispatch(d, ex, 2)
    records = d.drain()
    assert skips(records) == [(1, "server_down")]
    assert [r["step"] for r in records if "eval/pass@1" in r] == [2]  # no metrics for the skipped point


def test_every_skip_is_reported_once_at_its_step(disp):
    fn = FakeEvalFn()
    fn.raise_at[3] = EvalSkip("pin_violation")
    d, fn, ex = disp(fn=fn, eval_max_in_flight=1, eval_overflow_policy="skip")
    fn.block[1] = threading.Event()
    ex.fail_at = {4}
    records = []
    dispatch(d, ex, 1)
    dispatch(d, ex, 2)  # busy
    fn.block[1].set()
    records += d.drain()
    dispatch(d, ex, 3)  # skipped by the backend
    records += d.drain()
    dispatch(d, ex, 4)  # export_failed
    records += d.drain() + d.poll() + d.drain()
    assert sorted(skips(records)) == [(2, "busy"), (3, "pin_violation"), (4, "export_failed")]
    assert [r["step"] for r in records if "eval/pass@1" in r] == [1]


# ---- D3 15-18: fleet and retarget ----


class FakeClient:
    """A spool client fake: sync_weights stores the version unless `stale`; generate stamps it on completions."""

    def __init__(self, stale: bool = False, broken: bool = False) -> None:
        self.version = -1
        self.stale, self.broken = stale, broken
        self.loads: list[tuple[str, int]] = []

    def sync_weights(self, snapshot_dir: str, version: int) -> float:
        self.loads.append((snapshot_dir, version))
        if not self.stale:
            self.version = version
        return 0.0

    def generate(self, prompts, params):
        if self.broken:
            raise RuntimeError("worker stopped answering")
        return [
            Completion(
                i, j, [p[0]] * params.max_tokens, [0.0] * params.max_tokens, "length", weights_version=self.version
            )
            for i, p in enumerate(prompts)
            for j in range(params.n)
        ]

    def close(self) -> None:
        pass


class FakeHandle:
    def __init__(self, alive: bool = True) -> None:
        self._alive = alive
        self.shut = False

    def alive(self) -> bool:
        return self._alive

    def shutdown(self) -> None:
        self.shut = True

    def log_tail(self, n: int) -> str:
        return "Killed"


def test_fleet_one_stale_engine_gives_pin_violation_after_2xN_loads():
    clients = [FakeClient(), FakeClient(stale=True)]
    fleet = EvalFleet([FleetEngine(c) for c in clients], probe_retry_s=0)
    with pytest.raises(EvalSkip) as e:
        fleet.pin("/snap/step_5", 5)
    assert e.value.reason == "pin_violation"
    assert sum(len(c.loads) for c in clients) == 4  # 2 engines x 2 attempts
    assert clients[0].loads == [("/snap/step_5", 5)] * 2


def test_fleet_pins_every_engine_and_builds_state_once():
    clients = [FakeClient(), FakeClient()]
    fleet = EvalFleet([FleetEngine(c) for c in clients], probe_retry_s=0)
    s1 = fleet.pin("/snap/step_5", 5)
    assert all(c.version == 5 for c in clients)
    s2 = fleet.pin("/snap/step_6", 6)
    assert s1 is s2  # built once, reused
    out = s2.generate([[10], [11], [12]], SamplingParams(n=2, max_tokens=1))
    assert [(c.prompt_index, c.sample_index, c.token_ids[0]) for c in out] == [
        (0, 0, 10), (0, 1, 10), (1, 0, 11), (1, 1, 11), (2, 0, 12), (2, 1, 12)
    ]  # fmt: skip
    assert {c.weights_version for c in out} == {6}


@pytest.mark.parametrize("how", ["dead_worker", "probe_fails"])
def test_fleet_unhealthy(how):
    if how == "dead_worker":
        engines = [FleetEngine(FakeClient(), FakeHandle()), FleetEngine(FakeClient(), FakeHandle(alive=False))]
    else:
        engines = [FleetEngine(FakeClient()), FleetEngine(_VersionOnly(FakeClient(broken=True)))]
    fleet = EvalFleet(engines, probe_retry_s=0)
    with pytest.raises(EvalSkip) as e:
        fleet.pin("/snap/step_1", 1)
    assert e.value.reason == "unhealthy"
    fleet.close()
    assert all(en.handle is None or en.handle.shut for en in engines)


class _VersionOnly:
    """A client whose version read-back works but whose generate (the health probe) does not."""

    def __init__(self, inner: FakeClient) -> None:
        self.inner = inner

    def sync_weights(self, d, v):
        return self.inner.sync_weights(d, v)

    def weights_version(self):
        return self.inner.version

    def generate(self, prompts, params):
        return self.inner.generate(prompts, params)


def test_fleet_pin_violation_surfaces_as_a_skip_through_the_dispatcher(tmp_path):
    c = EvalConfig(eval_interval=1, eval_num_gpus=2, eval_hf_dir=str(tmp_path / "eval_hf"))
    fleet = EvalFleet([FleetEngine(FakeClient()), FleetEngine(FakeClient(stale=True))], probe_retry_s=0)
    ex = Exporter()
    ev = make_evaluator(c, toy_set(), export_fn=ex, blocking_eval_fn=None, fleet=fleet)
    assert skips(ev.step(1) + ev.drain()) == [(1, "pin_violation")]


def test_fleet_eval_scores_the_eval_set_with_version_stamp(tmp_path):
    c = EvalConfig(eval_interval=2, eval_num_gpus=2, eval_hf_dir=str(tmp_path / "eval_hf"), eval_n=2)
    fleet = EvalFleet([FleetEngine(FakeClient()), FleetEngine(FakeClient())], probe_retry_s=0)
    ev = make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=None, fleet=fleet)
    records = [r for s in range(1, 5) for r in ev.step(s, is_final=s == 4)] + ev.drain()
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        # the fake echoes the prompt's first token, which the toy score rewards: every sample is correct
        assert r["eval/pass@1"] == 1.0 and r["eval/pass@2"] == 1.0 and r["eval/avg@2"] == 1.0
        assert r["eval/weight_version"] == r["step"] and r["eval/mixed_version_ratio"] == 0.0


def test_retarget_args_does_not_mutate_its_input():
    args = Namespace(router_ip="10.0.0.1", router_port=1, rollout_num_gpus=8, other="keep")
    out = retarget_args(args, "127.0.0.1", 8000, [2, 1, 1])
    assert (out.router_ip, out.router_port, out.rollout_num_gpus, out.rollout_num_engines) == ("127.0.0.1", 8000, 4, 3)
    assert out.rollout_num_gpus_per_engine == 2 and out.other == "keep"
    assert args == Namespace(router_ip="10.0.0.1", router_port=1, rollout_num_gpus=8, other="keep")
    c = EvalConfig()
    c2 = retarget_args(c, "h", 1, [1])
    assert not hasattr(c, "router_ip") and c2.router_ip == "h"


# ---- threading model ----


def test_drain_settles_everything_and_is_idempotent(disp):
    d, fn, ex = disp(eval_max_in_flight=2)
    fn.block[1] = threading.Event()
    dispatch(d, ex, 1)
    dispatch(d, ex, 2)
    threading.Timer(0.3, fn.block[1].set).start()
    records = d.drain()
    assert [r["step"] for r in records] == [1, 2] and not d.pending
    assert d.drain() == []
    d.close()
    d.close()
    assert d.drain() == []
    with pytest.raises(RuntimeError, match="after close"):
        d.dispatch(3)


def test_evaluator_drain_is_idempotent_and_terminal(tmp_path):
    c = cfg(tmp_path)
    ev = make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=None, eval_fn=_NoopFn(c, toy_set()))
    records = ev.step(1)
    records += ev.poll() + ev.drain()
    assert [r["step"] for r in records] == [1]  # each record exactly once, whichever call returned it
    assert ev.drain() == [] and ev.poll() == []
    with pytest.raises(RuntimeError, match="after drain"):
        ev.step(2)


class _NoopFn(CheckpointEvalFn):
    disposed = 0

    def evaluate_checkpoint(self, checkpoint_dir, input):
        return {"eval/pass@1": 1.0}

    def dispose(self):
        type(self).disposed += 1


def test_daemon_thread_does_not_block_exit(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, sys, threading
        sys.path.insert(0, {REPO!r})
        from align.eval import EvalConfig, EvalSet, make_evaluator
        cfg = EvalConfig(eval_interval=1, eval_function_path="x:Y", eval_hf_dir={str(tmp_path / "hf")!r})
        es = EvalSet(prompts=[[1]], score=lambda i, t: 1.0)
        def export(path):
            os.makedirs(path); open(os.path.join(path, "w"), "w").close()
        hang = threading.Event()
        ev = make_evaluator(cfg, es, export_fn=export, blocking_eval_fn=None, eval_fn=lambda inp: hang.wait())
        ev.step(1)
        print("dispatched", flush=True)
        # exit without drain(): an eval is hung in flight
        """
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "dispatched" in out.stdout and time.monotonic() - t0 < 30


def test_loop_errors_are_swallowed_outside_ci(disp):
    fn = FakeEvalFn()
    fn.raise_at[1] = RuntimeError("boom")
    d, fn, ex = disp(fn=fn)
    dispatch(d, ex, 1)
    dispatch(d, ex, 2)  # the training thread never sees the crash
    assert skips(d.drain()) == [(1, "crashed")]


@pytest.mark.parametrize("cause", ["crashed", "EvalSkip", "busy", "export_failed"])
def test_any_skip_raises_under_ci_test(disp, cause):
    fn = FakeEvalFn()
    if cause == "crashed":
        fn.raise_at[1] = RuntimeError("boom")
    elif cause == "EvalSkip":
        fn.raise_at[1] = EvalSkip("unhealthy")
    d, fn, ex = disp(fn=fn, ci_test=True, eval_max_in_flight=1, eval_overflow_policy="skip")
    if cause == "busy":
        fn.block[1] = threading.Event()
        dispatch(d, ex, 1)
        with pytest.raises(RuntimeError, match="CI eval 2 skipped: busy"):
            dispatch(d, ex, 2)
        fn.block[1].set()
        return
    if cause == "export_failed":
        ex.fail_at = {1}
        with pytest.raises(RuntimeError, match="CI eval 1 skipped: export_failed"):
            dispatch(d, ex, 1)
        return
    dispatch(d, ex, 1)
    reason = "crashed" if cause == "crashed" else "unhealthy"
    with pytest.raises(RuntimeError, match=f"CI eval 1 skipped: {reason}"):
        d.drain()


# ---- config, loading, metrics ----


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"eval_num_gpus": 1, "eval_interval": 1}, "requires --eval-hf-dir"),
        ({"eval_function_path": "m:C", "eval_hf_dir": "/x"}, "requires --eval-interval"),
        (
            {"eval_num_gpus": 1, "eval_function_path": "m:C", "eval_hf_dir": "/x", "eval_interval": 1},
            "mutually exclusive",
        ),
        ({"eval_overflow_policy": "drop"}, "eval-overflow-policy"),
        ({"eval_max_in_flight": 0}, "eval-max-in-flight"),
        ({"eval_keep_snapshots": -1}, "eval-keep-snapshots"),
        ({"eval_num_gpus": 3, "eval_num_gpus_per_engine": 2, "eval_hf_dir": "/x", "eval_interval": 1}, "must divide"),
        ({"eval_n": 0}, "eval-n"),
        ({"eval_hf_dir": "/x"}, "--eval-hf-dir '/x' requires --eval-interval"),  # seed 000: accepted and ignored before
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        EvalConfig(**kw)


def test_config_fields_all_have_help():
    for f in dataclasses.fields(EvalConfig):
        assert f.metadata.get("help"), f"EvalConfig.{f.name} has no help string"


def test_load_eval_fn_from_module_and_file(tmp_path):
    src = tmp_path / "my_eval.py"
    src.write_text(
        "from align.eval import CheckpointEvalFn\n"
        "class Mine(CheckpointEvalFn):\n"
        "    def evaluate_checkpoint(self, checkpoint_dir, input):\n"
        "        return {'eval/pass@1': 1.0}\n"
        "class NotOne:\n    pass\n"
    )
    c = cfg(tmp_path)
    fn = load_eval_fn(f"{src}:Mine", c, toy_set())
    assert isinstance(fn, CheckpointEvalFn) and fn.config is c
    with pytest.raises(TypeError, match="not a subclass"):
        load_eval_fn(f"{src}:NotOne", c, toy_set())
    with pytest.raises(ValueError, match="has no attribute"):
        load_eval_fn("align.eval.checkpoint_eval:Nope", c, toy_set())
    with pytest.raises(ValueError, match="must be"):
        load_eval_fn("no_colon", c, toy_set())


def test_async_checkpoint_eval_fn_runs_on_the_loop(tmp_path):
    class AsyncFn(CheckpointEvalFn):
        async def evaluate_checkpoint(self, checkpoint_dir, input):
            return {"eval/pass@1": float(is_complete(checkpoint_dir)), "eval/n_prompts": len(input.eval_set.prompts)}

    c = cfg(tmp_path)
    ev = make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=None, eval_fn=AsyncFn(c, toy_set()))
    (r,) = ev.step(1, is_final=True) + ev.drain()
    assert r["eval/pass@1"] == 1.0 and r["eval/n_prompts"] == 3


def test_export_snapshot_replaces_a_stale_dir_and_marks_it(tmp_path):
    from align.run.safety import EXPORT_MARKER, write_export_marker

    stale = tmp_path / "step_3"
    stale.mkdir()
    (stale / "old.safetensors").write_text("old")
    (stale / MARKER).write_text("")
    write_export_marker(stale, "run-a", 3)  # an earlier snapshot of this same run (a resumed run keeps its id)
    ex = Exporter()
    ex.step = 3
    out = export_snapshot(ex, str(tmp_path), 3, run_id="run-a")
    assert sorted(os.listdir(out)) == sorted([MARKER, EXPORT_MARKER, "model.safetensors"])
    assert json.loads((tmp_path / "step_3" / EXPORT_MARKER).read_text())["run_id"] == "run-a"


def test_export_snapshot_never_replaces_another_runs_step_dir(tmp_path):
    """Issue 30: an eval snapshot replaced another run's committed step_2 (and the ring then deleted it)."""
    from helpers_train import tree_digest

    from align.run.safety import write_export_marker

    theirs = tmp_path / "step_2"
    theirs.mkdir()
    (theirs / "model.safetensors").write_text("their checkpoint")
    (theirs / MARKER).write_text("")
    before = tree_digest(tmp_path)
    ex = Exporter()
    for owner in (None, "run-b"):  # no marker (a checkpoint), then a snapshot of another run
        if owner:
            write_export_marker(theirs, owner, 2)
            before = tree_digest(tmp_path)
        with pytest.raises(RuntimeError, match=r"step_2 exists and is not a snapshot of this run.*refusing"):
            export_snapshot(ex, str(tmp_path), 2, run_id="run-a")
        assert tree_digest(tmp_path) == before and ex.calls == []  # refused before any export work
    export_snapshot(ex, str(tmp_path), 2, run_id="run-b")  # control: the run that wrote it replaces it
    assert (theirs / "model.safetensors").read_text() == "0"


def test_retention_ring_never_deletes_a_step_dir_replaced_by_another_run(disp, tmp_path):
    from align.run.safety import write_export_marker

    d, _fn, ex = disp(eval_keep_snapshots=0)
    fn = d.runner.eval_fn
    fn.block[1] = threading.Event()
    dispatch(d, ex, 1)  # exported; its eval waits
    snap = tmp_path / "eval_hf" / "step_1"
    shutil.rmtree(snap)
    snap.mkdir()  # another run put its own step_1 there meanwhile
    (snap / "model.safetensors").write_text("1")
    write_export_marker(snap, "someone-else", 1)
    fn.block[1].set()
    d.drain()
    assert (snap / "model.safetensors").read_text() == "1"  # kept: not this run's
    dispatch(d, ex, 2)  # control: this run's own snapshot is deleted by keep 0
    d.drain()
    assert sorted(os.listdir(tmp_path / "eval_hf")) == ["step_1"]


def test_pass_at_k_matches_brute_force():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([1] * c + [0] * (n - c), k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert abs(pass_at_k(n, c, k) - brute) < 1e-12
    assert pass_at_k(4, 1, 1) != pytest.approx(0.5)  # negative control: the estimate does depend on c
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_score_completions_pass_and_avg():
    prompts = [[1], [2]]
    comps = [Completion(0, j, [t], [0.0], "length", weights_version=7) for j, t in enumerate([1, 0, 0, 0])]
    comps += [Completion(1, j, [2], [0.0], "length", weights_version=7) for j in range(4)]
    m = score_completions(prompts, comps, lambda i, toks: 1.0 if toks[0] == prompts[i][0] else None, 4)
    assert ks_for(4) == [1, 2, 4]
    assert m["eval/pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["eval/pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["eval/pass@4"] == 1.0 and m["eval/avg@4"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["eval/weight_version"] == 7 and m["eval/mixed_version_ratio"] == 0.0
    with pytest.raises(RuntimeError, match="expected n=4"):
        score_completions(prompts, comps[:-1], lambda i, t: 1.0, 4)


def test_score_completions_correctness_is_separate_from_the_reward():
    prompts = [[1], [2]]
    comps = [Completion(i, j, [j], [0.0], "length") for i in range(2) for j in range(2)]
    # a shaping term makes every total > 0; only prompt 0's first sample is correct; prompt 1's second unscorable
    terms = {(0, 0): (1.5, 1.0), (0, 1): (0.5, 0.0), (1, 0): (0.5, 0.0), (1, 1): (float("nan"), float("nan"))}
    m = score_completions(prompts, comps, lambda i, t: scored(*terms[i, t[0]][:1], {"ok": terms[i, t[0]][1]}, "ok"), 2)
    assert m["eval/pass@1"] == pytest.approx(0.25) and m["eval/pass@2"] == pytest.approx(0.5)
    assert m["eval/avg@2"] == pytest.approx((1.5 + 0.5 + 0.5 + 0.0) / 4)  # the unscorable one is reward 0, not NaN
    # control: the plain total as the score counts every scorable completion correct (shaping inflates pass@1)
    m = score_completions(prompts, comps, lambda i, t: terms[i, t[0]][0], 2)
    assert m["eval/pass@1"] == pytest.approx(0.75)
    assert scored(0.5, {"ok": 0.0}, "total") == Scored(0.5, True)


def test_import_is_stdlib_only():
    code = (
        f"import sys; sys.path.insert(0, {REPO!r}); import align.eval, align.eval.dispatcher, align.eval.evaluator, align.eval.fleet; "
        "bad = [m for m in ('torch', 'numpy', 'vllm', 'ray', 'transformers', 'requests') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- audit of align/eval against seed 000 (issue 20) and eval hangs (issue 19) ----


def test_eval_function_metrics_are_namespaced_under_eval(disp):
    class Clobber(FakeEvalFn):
        def __call__(self, inp):
            super().__call__(inp)
            return {"step": 99, "loss": 5.0, "eval/pass@1": 0.25}

    d, _fn, ex = disp(fn=Clobber())
    dispatch(d, ex, 3)
    (r,) = d.drain()
    assert r["step"] == 3 and r["eval/step"] == 3  # the user's "step" can no longer move the record
    assert r["eval/loss"] == 5.0 and r["eval/pass@1"] == 0.25 and "loss" not in r
    ev = make_evaluator(EvalConfig(eval_interval=1), toy_set(), export_fn=None, blocking_eval_fn=lambda s: {"step": 7})
    (b,) = ev.step(1)
    assert b["step"] == 1 and b["eval/step"] == 1  # the blocking path too


def test_hung_eval_function_times_out_and_training_goes_on(disp):
    fn = FakeEvalFn()
    fn.block[1] = threading.Event()
    d, fn, ex = disp(fn=fn, eval_timeout_s=0.5)
    t0 = time.monotonic()
    dispatch(d, ex, 1)
    dispatch(d, ex, 2)
    records = d.drain()  # used to wait for the hung call (here: until the fake gave up after WAIT_S, as 'crashed')
    assert time.monotonic() - t0 < WAIT_S / 2
    # point 2 waited for the abandoned call (never two calls into the eval function at once), within its own timeout
    assert skips(records) == [(1, "timeout"), (2, "timeout")] and [c.step for c in fn.calls] == [1]
    fn.block[1].set()  # the hung call returns at last: its late result is dropped, the next point runs normally
    dispatch(d, ex, 3)
    (r,) = d.drain()
    assert r["step"] == 3 and r["eval/measured_step"] == 3 and fn.max_running == 1


def test_stop_request_interrupts_backpressure_and_bounds_drain(tmp_path, monkeypatch):
    import align.eval.dispatcher as dispatcher_mod

    monkeypatch.setattr(dispatcher_mod, "STOP_GRACE_S", 0.5)
    stop = threading.Event()
    c = cfg(tmp_path, eval_max_in_flight=1, ci_test=True)
    fn = FakeEvalFn()
    fn.block[1] = threading.Event()
    d = EvalDispatcher(c, EvalRunner(c, toy_set(), eval_fn=fn), Exporter(), should_stop=stop.is_set)
    try:
        d.dispatch(1)
        threading.Timer(0.3, stop.set).start()  # a SIGTERM handler sets the run's stop flag
        t0 = time.monotonic()
        d.dispatch(2)  # backpressure on the hung point 1: gives up once stop is requested
        assert time.monotonic() - t0 < WAIT_S / 2
        records = d.drain()  # point 1 still hangs: abandoned after STOP_GRACE_S, no --ci-test failure for a stop
        assert sorted(skips(records)) == [(1, "interrupted"), (2, "interrupted")]
    finally:
        fn.block[1].set()
        d.close()


def test_drain_after_a_training_error_keeps_that_error_primary(tmp_path):
    c = cfg(tmp_path, ci_test=True)
    fn = FakeEvalFn()
    fn.raise_at[1] = RuntimeError("eval boom")
    fn.block[1] = threading.Event()  # the crash lands after step() returned (else step()'s poll would raise it)
    ev = make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=None, eval_fn=fn, run_id="run-a")
    ev.step(1)
    fn.block[1].set()
    training_error = ValueError("the training step failed")
    records = ev.drain(after_error=training_error)  # used to raise the CI failure, hiding the training error
    assert skips(records) == [(1, "crashed")]
    assert any("CI eval 1 skipped: crashed" in n for n in training_error.__notes__)
    fn.block[1] = threading.Event()
    ev2 = make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=None, eval_fn=fn, run_id="run-a")
    ev2.step(1)
    fn.block[1].set()
    with pytest.raises(RuntimeError, match="CI eval 1 skipped: crashed"):  # without a training error: raised
        ev2.drain()


def test_baseline_is_dispatched_once_on_the_caller_dir(tmp_path):
    c = cfg(tmp_path)
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_text("0")  # a caller-owned checkpoint, no marker
    fn = FakeEvalFn()
    ev = make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=lambda s: 1 / 0, eval_fn=fn)
    records = ev.baseline(str(base)) + ev.drain()  # snapshot posture: through the dispatcher, never blocking
    assert [(x.step, x.hf_dir) for x in fn.calls] == [(0, str(base))] and records[0]["step"] == 0
    assert base.is_dir()
    # written once: a rerun whose metrics already hold the step-0 record does not evaluate it again ...
    fn2 = FakeEvalFn()
    ev2 = make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=None, eval_fn=fn2)
    assert ev2.baseline(str(base), written=records) == [] and ev2.drain() == [] and fn2.calls == []
    # ... and a resumed run whose baseline never landed (killed while it ran) evaluates it now
    fn3 = FakeEvalFn()
    ev3 = make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=None, eval_fn=fn3)
    records3 = ev3.baseline(str(base), written=[{"step": 1, "loss": 0.0}], resumed=True)  # may already hold it
    assert [r["step"] for r in records3 + ev3.drain()] == [0] and [x.step for x in fn3.calls] == [0]
    # the blocking posture evaluates the live policy: only before the first step, never after a resume
    calls = []
    blocking = make_evaluator(EvalConfig(eval_interval=2), toy_set(), export_fn=None,
                              blocking_eval_fn=lambda s: calls.append(s) or {"eval/pass@1": 1.0})  # fmt: skip
    assert blocking.baseline(str(base), resumed=True) == [] and calls == []
    assert [r["step"] for r in blocking.baseline(str(base))] == [0] and calls == [0]


def test_startup_removes_only_our_leftovers_of_a_crashed_run(tmp_path):
    import fcntl

    root = tmp_path / "eval_hf"
    for d in (".step_3.partial-r1-1a2b3c4d", ".step_2.stale-r1-deadbeef", "fleet-old/engine_0", "fleet-live/engine_0",
              "step_4", "notes", ".step_x", ".step_5.partial-1a2b3c4d"):  # fmt: skip
        (root / d).mkdir(parents=True)
    (root / "fleet-old" / "engine_0.log").write_text("old log")
    (root / "fleet-old" / "engine_0" / "worker.lock").write_text("")
    (root / "step_4" / MARKER).write_text("{}")
    (root / ".step_9.partial-r1-0000abcd").write_text("a file, not ours")
    with open(root / "fleet-live" / "engine_0" / "worker.lock", "w") as live:  # a live worker of another run
        fcntl.flock(live.fileno(), fcntl.LOCK_EX)
        c = cfg(tmp_path)
        d = EvalDispatcher(c, EvalRunner(c, toy_set(), eval_fn=FakeEvalFn()), Exporter(), run_id="r1")
        d.close()
    kept = [".step_5.partial-1a2b3c4d", ".step_9.partial-r1-0000abcd", ".step_x", "fleet-live", "notes", "step_4"]
    assert sorted(os.listdir(root)) == kept  # .step_5: no run id, so no run can tell it is its own


def test_startup_removes_only_this_runs_temporaries_in_a_shared_eval_dir(tmp_path):
    """Two runs share --eval-hf-dir: a start of run A removes the temporaries a killed export of A left, never B's
    (B may be exporting right now: its ``.partial`` is the snapshot it is writing)."""
    root = tmp_path / "eval_hf"
    a, b = "a" * 32, "b" * 32
    ex = Exporter()
    export_snapshot(ex, str(root), 1, run_id=a)
    assert os.path.basename(ex.calls[0]).startswith(f".step_1.partial-{a}-")  # the export's temporary names its run
    mine = [f".step_3.partial-{a}-1a2b3c4d", f".step_2.stale-{a}-deadbeef"]
    theirs = [f".step_3.partial-{b}-1a2b3c4d", f".step_2.stale-{b}-deadbeef"]
    prefixed = f".step_4.partial-{a}-x-0123abcd"  # run "{a}-x": an id that starts with ours is not ours
    for d in mine + theirs + [prefixed]:
        (root / d).mkdir()
    c = cfg(tmp_path)
    EvalDispatcher(c, EvalRunner(c, toy_set(), eval_fn=FakeEvalFn()), Exporter(), run_id=a).close()
    assert sorted(os.listdir(root)) == sorted(theirs + [prefixed, "step_1"])
    EvalDispatcher(c, EvalRunner(c, toy_set(), eval_fn=FakeEvalFn()), Exporter(), run_id=b).close()
    assert sorted(os.listdir(root)) == [prefixed, "step_1"]  # control: B's start removes B's own


@pytest.mark.parametrize(
    "visible, kw, reserved, want",
    [
        ([], {"eval_num_gpus": 2}, (), None),  # no GPU: CPU workers
        (["0", "1", "2", "3"], {"eval_num_gpus": 2}, (), ["2", "3"]),  # default: the last visible GPUs
        (["4", "5"], {"eval_num_gpus": 1}, (), ["5"]),  # CUDA_VISIBLE_DEVICES=4,5: GPU 5, not GPU 1
        (["4", "5"], {"eval_num_gpus": 1, "eval_first_gpu": 0}, (), ["4"]),  # first GPU counts in the visible list
        (["4", "5", "6", "7"], {"eval_num_gpus": 4, "eval_num_gpus_per_engine": 2}, (), ["4,5", "6,7"]),
        (["0", "1", "2", "3"], {"eval_num_gpus": 2, "eval_num_gpus_per_engine": 2, "eval_first_gpu": 1}, (), ["1,2"]),
        (["GPU-a", "GPU-b"], {"eval_num_gpus": 1}, (), ["GPU-b"]),  # UUIDs pass through
        (["0", "1"], {"eval_num_gpus": 1}, (0,), ["1"]),  # --rollout-gpu 0 elsewhere: fine
        (["0", "1"], {"eval_num_gpus": 1}, (None,), ["1"]),  # no --rollout-gpu
        (["0", "1"], {"eval_num_gpus": 1}, (1,), "overlap GPU"),
        (["4", "5"], {"eval_num_gpus": 2}, (5,), "overlap GPU"),
        (["0", "1"], {"eval_num_gpus": 3}, (), "only 2 are visible"),
        (["0", "1"], {"eval_num_gpus": 1, "eval_first_gpu": 2}, (), "only 2 are visible"),
        (["0", "1", "2"], {"eval_num_gpus": 2, "eval_first_gpu": 2}, (), "only 3 are visible"),
    ],
)
def test_gpu_plan(visible, kw, reserved, want):
    from align.eval.fleet import gpu_plan

    c = EvalConfig(eval_interval=1, eval_hf_dir="/x", **kw)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            gpu_plan(c, visible, reserved)
    else:
        assert gpu_plan(c, visible, reserved) == want


def test_bad_gpu_plan_fails_at_startup_not_at_every_point(tmp_path, monkeypatch):
    import align.eval.fleet as fleet_mod

    monkeypatch.setattr(fleet_mod, "visible_gpus", lambda: ["4", "5"])
    c = EvalConfig(eval_interval=1, eval_num_gpus=1, eval_hf_dir=str(tmp_path / "eval_hf"))
    with pytest.raises(ValueError, match="overlap GPU"):
        make_evaluator(c, toy_set(), export_fn=Exporter(), blocking_eval_fn=None, reserved_gpus=[5])
    assert not (tmp_path / "eval_hf").exists() or not os.listdir(tmp_path / "eval_hf")  # no fleet-* dir leaked


HANG_S = 30.0  # how long the fake engine hangs; exit must not wait for it
EXIT_BOUND_S = 12.0  # generous bound for a Python start + exit on a loaded machine


def test_exit_does_not_wait_for_a_hung_fleet_engine(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {REPO!r})
        from align.eval import EvalConfig, EvalFleet, EvalSet, make_evaluator
        from align.eval.fleet import FleetEngine

        class Hung:
            version = -1
            def sync_weights(self, d, v):
                self.version = v
            def weights_version(self):
                return self.version
            def generate(self, prompts, params):
                sys.stdout.write("engine hung\\n")  # one write: two engines print at once
                time.sleep({HANG_S})

        cfg = EvalConfig(eval_interval=1, eval_num_gpus=2, eval_hf_dir={str(tmp_path / "hf")!r})
        es = EvalSet(prompts=[[1]], score=lambda i, t: 1.0)
        def export(path):
            os.makedirs(path); open(os.path.join(path, "w"), "w").close()
        fleet = EvalFleet([FleetEngine(Hung()), FleetEngine(Hung())], probe_retry_s=0)
        ev = make_evaluator(cfg, es, export_fn=export, blocking_eval_fn=None, fleet=fleet)
        ev.step(1)
        while not os.path.exists({str(tmp_path / "hf" / "step_1")!r}):
            time.sleep(0.05)
        time.sleep(1.0)
        print("exiting", flush=True)
        """
    )
    out = subprocess.Popen([sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, text=True)
    lines = []
    for line in out.stdout:
        lines.append(line)
        if line.startswith("exiting"):
            break
    t0 = time.monotonic()
    out.wait(timeout=HANG_S * 2)
    # the health probe was hanging in the fan-out threads at exit
    assert any(line.startswith("engine hung") for line in lines), lines
    assert time.monotonic() - t0 < EXIT_BOUND_S, "interpreter exit waited on a hung engine call"


def test_docs_flag_defaults_match_the_cli():
    """docs/eval.md's flag table states the defaults of `python -m align.train` (it used to say interval 0, n 1)."""
    import re

    from align.train import TrainConfig

    cli = TrainConfig().eval
    with open(os.path.join(REPO, "docs", "eval.md")) as f:
        text = f.read()
    rows = re.findall(r"^\| `--([a-z-]+)` \| `([^`]+)` \|", text, flags=re.MULTILINE)
    checked = 0
    for flag, default in rows:
        name = flag.replace("-", "_")
        if not hasattr(cli, name):
            continue
        value = getattr(cli, name)
        want = str(value).lower() if isinstance(value, bool) else str(value)
        assert default in (want, f"{value:g}" if isinstance(value, float) else want), (flag, default, value)
        checked += 1
    assert checked >= 8, rows  # the table was parsed (negative control against a silently empty match)
