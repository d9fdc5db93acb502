"""Eval epochs pinned to one policy version (seed 002) in the shared-engine posture with --max-async-steps K >= 1:
the lease (the watcher's policy lock) held across the epoch, drain -> cohort -> refill, a queued second eval step,
release on failure and shutdown, fail-fast configs, and the pinned records against the blocking eval of the same
weights. The engine here is a fake where the order of events matters (its requests are served one by one while the
producer would like to update the weights); the native sampler and the real vLLM worker run in
tests/test_pipeline.py and tests/test_pipeline_spool.py."""

from __future__ import annotations

import threading
import time

import pytest

from align.eval import pinned
from align.eval.config import EvalConfig, EvalSet
from align.rewards import Scores
from align.rollout import engines, pipeline
from align.rollout.groups import Groups
from align.rollout.protocol import Completion, SamplingParams

SERVE_S = 0.08  # the fake engine serves one eval request this long: long enough for the producer to want an update
EVAL_REQUESTS = 4
JOIN_S = 10.0


class FakeEngine:
    """Stamps each completion with the version loaded WHEN THE REQUEST IS SERVED (as an engine updated mid-cohort
    would), so a weight update during a cohort shows up as a mixed version ratio."""

    reports_version = True
    client = None

    def __init__(self, fail_eval: bool = False) -> None:
        self.version, self.lock, self.fail_eval = 0, threading.RLock(), fail_eval
        self.loads: list[int] = []

    def publish(self, version, policy):
        return 0.0

    def use(self, version):
        self.version = version
        self.loads.append(version)

    def submit(self, prompts, params, permits):
        if self.fail_eval:
            raise RuntimeError("eval engine failure")
        return list(range(len(prompts)))

    def wait(self, handles):
        out = []
        for i in handles:
            time.sleep(SERVE_S)
            out.append(Completion(i, 0, [1], [0.0], "stop", weights_version=self.version))
        return out

    def close(self):
        pass


def collect(t, version, client):
    time.sleep(0.01)
    return Groups([0], [Completion(0, 0, [1], [0.0], "stop", weights_version=version)], ["x"], Scores([1.0], {}))


def make(K=1, last=8, interval=2, engine=None, pin=True):
    engine = engine or FakeEngine()
    pipe = pipeline.RolloutPipeline(K, collect, engine=engine, last_step=last, cursor={}, pinned=pin)
    eval_set = EvalSet([[1]] * EVAL_REQUESTS, lambda i, ids: 1.0, SamplingParams(n=1), name="fake")
    ev = pinned.PinnedEvaluator(EvalConfig(eval_interval=interval), pipe, eval_set, None, timeout_s=60)
    return pipe, ev, engine


def drive(pipe, ev, last=8) -> list[dict]:
    """The training loop's calls: baseline, then next -> (train) -> publish -> evaluator.step, then drain."""
    recs = ev.baseline("unused")
    for t in range(1, last + 1):
        pipe.next(t)
        time.sleep(0.01)
        pipe.publish(t, None)
        recs += ev.step(t, t == last)
    return recs + ev.drain()


@pytest.mark.parametrize("K", [1, 2])
def test_every_eval_point_is_pinned_to_its_version(K):
    pipe, ev, _engine = make(K=K)
    try:
        recs = drive(pipe, ev)
    finally:
        pipe.close()
    assert [r["step"] for r in recs] == [0, 2, 4, 6, 8]
    for r in recs:
        assert r["eval/weight_version"] == r["step"] and r["eval/mixed_version_ratio"] == 0.0


def test_without_the_lease_an_update_lands_mid_cohort():
    """Negative control: the same run with the lease off (no pin, no drain) mixes versions inside a cohort."""
    pipe, ev, _engine = make(K=1, pin=False)
    try:
        recs = drive(pipe, ev)
    finally:
        pipe.close()
    assert max(r["eval/mixed_version_ratio"] for r in recs) > 0


def test_lease_held_across_the_epoch_and_drain_cohort_refill_order():
    pipe, ev, engine = make(K=2, last=7, interval=3)  # step 7 (version 4) is the first batch newer than the pin
    try:
        drive(pipe, ev, last=7)
    finally:
        pipe.close()
    ev3 = [i for i, e in enumerate(pipe.events) if e[1] == 3 and e[0] in ("lease", "drained", "cohort", "released")]
    _lease, drained, cohort, released = ev3
    assert [pipe.events[i][0] for i in ev3] == ["lease", "drained", "cohort", "released"]
    # every train batch of an older version started before the drain; the batch of the pinned version (step 6 with
    # K = 2) started only after the complete cohort was dispatched, and during the eval tail (refill)
    train = {e[1]: (i, e[2]) for i, e in enumerate(pipe.events) if e[0] == "train"}
    assert all(i < drained for t, (i, v) in train.items() if v < 3)
    assert cohort < train[6][0] < released and train[6][1] == 3
    # after the drain the engine loads the pinned version and nothing loads another one until the release
    assert all(e[2] == 3 for e in pipe.events[cohort : released + 1])
    # the first batch of a newer version starts only after the release, and the engine loads version 4 after 3
    assert train[7][1] == 4 and train[7][0] > released
    assert engine.loads.index(4) > engine.loads.index(3)


def test_a_second_due_step_while_an_epoch_is_active_is_queued():
    pipe, ev, _engine = make(K=1, last=4, interval=1)
    try:
        recs = drive(pipe, ev, last=4)
    finally:
        pipe.close()
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    order = [(e[0], e[1]) for e in pipe.events if e[0] in ("lease", "released")]
    assert order == [(w, s) for s in range(5) for w in ("lease", "released")]  # one epoch at a time, in order


def lock_is_free(lock) -> bool:
    got = []

    def probe():
        got.append(lock.acquire(blocking=False))
        if got[0]:
            lock.release()

    th = threading.Thread(target=probe)
    th.start()
    th.join(JOIN_S)
    return got[0]


def test_the_lease_is_released_on_failure():
    engine = FakeEngine(fail_eval=True)
    pipe, ev, _ = make(engine=engine)
    try:
        with pytest.raises(RuntimeError, match="eval engine failure"):
            drive(pipe, ev)
        assert lock_is_free(engine.lock)
    finally:
        pipe.close()


def test_the_lease_is_released_on_shutdown():
    pipe, _ev, engine = make(K=1)
    pipe.request_eval(0)
    deadline = time.monotonic() + JOIN_S
    while not any(e[0] == "cohort" for e in pipe.events):  # the epoch is in its tail, holding the lease
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not lock_is_free(engine.lock)
    pipe.close()
    assert lock_is_free(engine.lock)


def test_fail_fast_configs():
    with pytest.raises(ValueError, match="has no prompts"):
        EvalSet([], lambda i, ids: 1.0, SamplingParams(n=1))
    pipe = pipeline.RolloutPipeline(1, collect, engine=FakeEngine(), last_step=2, cursor={})
    try:
        eval_set = EvalSet([[1]], lambda i, ids: 1.0, SamplingParams(n=8))
        with pytest.raises(ValueError, match="could never dispatch its cohort"):
            pinned.PinnedEvaluator(EvalConfig(eval_interval=1), pipe, eval_set, 4, timeout_s=60)
    finally:
        pipe.close()


def test_pinned_eval_measures_what_the_blocking_eval_measures(tmp_path, monkeypatch, char_model):
    """The native engine's pinned eval of version N equals the trainer's blocking eval of the live weights after
    step N (same sampler, seed and scoring): only where eval runs changed, not what it measures."""
    from helpers_train import PROMPTS, TOK, a_reward, cfg_for, records

    from align.train import train

    kinds = []

    def run(out) -> list[dict]:
        cfg = cfg_for(out, checkpoint_every=0, max_async_steps=1)
        cfg.eval.eval_interval = 2
        train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward, eval_prompts=PROMPTS[:4])
        evals = [r for r in records(out) if "eval/step" in r]
        kinds.append({r["eval/train_blocked_seconds"] > 0 for r in evals})  # blocking eval: > 0; pinned: 0
        return [{k: v for k, v in r.items() if k.startswith("eval/pass") or k == "step"} for r in evals]

    pinned_recs = run(tmp_path / "pinned")
    monkeypatch.setattr(pinned, "pinned_evaluator", lambda pipe, evaluator, eval_set, cfg: evaluator)
    blocking = run(tmp_path / "blocking")
    assert [r["step"] for r in pinned_recs] == [0, 2, 4]
    assert kinds == [{False}, {True}]  # the first run evaluated on the engine, the second in the loop
    assert pinned_recs == blocking
    assert pinned_recs[0] != pinned_recs[-1]  # negative control: the points differ, so equal records are not vacuous


# ------------------------------------------------------------------------------------------------ shared permits

PERMITS = 6  # --max-inflight-requests of the permit test (completions)
TRAIN_N, TRAIN_PROMPTS = 2, 2  # one train request of 2 groups (4 completions)
EVAL_PROMPTS = 7  # eval n = 1: requests of 6 and 1 completions; the eval tail (1) leaves room for 4 train ones
TRAIN_SERVE_S = 0.03


class CountingEngine(FakeEngine):
    """A fake engine (no real engine reports its outstanding requests) that counts the completions outstanding at it,
    train and eval together, and records the high-water mark, whether train and eval ever overlapped, and the size
    of every request. ``submit`` splits a cohort into whole-group requests the way ``SpoolEngine.submit`` does and
    puts them all in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.outstanding = {"train": 0, "eval": 0}
        self.max_outstanding, self.overlapped, self.requests = 0, False, []
        self._count = threading.Lock()
        self.client = self.TrainClient(self)

    def _add(self, kind, n):
        with self._count:
            self.outstanding[kind] += n
            total = sum(self.outstanding.values())
            self.max_outstanding = max(self.max_outstanding, total)
            self.overlapped |= all(self.outstanding.values())
            if n > 0:
                self.requests.append((kind, n))

    class TrainClient:
        def __init__(self, engine):
            self.engine = engine

        def generate(self, prompts, params, **kw):
            n = len(prompts) * params.n
            self.engine._add("train", n)
            time.sleep(TRAIN_SERVE_S)
            self.engine._add("train", -n)
            v = self.engine.version
            return [
                Completion(i, j, [1], [0.0], "stop", weights_version=v)
                for i in range(len(prompts))
                for j in range(params.n)
            ]

    def submit(self, prompts, params, permits):
        per = len(prompts) if permits is None else max(1, permits // params.n)
        reqs = [prompts[f : f + per] for f in range(0, len(prompts), per)]
        for r in reqs:
            self._add("eval", len(r) * params.n)
        return [(r, params.n) for r in reqs]

    def wait(self, handles):
        out = []
        for r, n in handles:
            time.sleep(SERVE_S)
            out += [
                Completion(len(out) + i, 0, [1], [0.0], "stop", weights_version=self.version) for i in range(len(r))
            ]
            self._add("eval", -len(r) * n)
        return out


def collect_with_permits(t, version, client):
    comps = engines.generate_groups(client, [[1]] * TRAIN_PROMPTS, SamplingParams(n=TRAIN_N, seed=t), PERMITS)
    return Groups(list(range(TRAIN_PROMPTS)), comps, ["x"] * len(comps), Scores([1.0] * len(comps), {}))


def test_one_permit_pool_bounds_train_and_eval_together():
    """--max-inflight-requests bounds train + eval completions outstanding at the engine, also while the eval tail
    overlaps refilled train requests; no request splits a group."""
    engine = CountingEngine()
    pipe = pipeline.RolloutPipeline(
        1, collect_with_permits, engine=engine, last_step=8, cursor={}, max_inflight_requests=PERMITS
    )
    eval_set = EvalSet([[1]] * EVAL_PROMPTS, lambda i, ids: 1.0, SamplingParams(n=1), name="fake")
    ev = pinned.PinnedEvaluator(EvalConfig(eval_interval=2), pipe, eval_set, PERMITS, timeout_s=60)
    try:
        recs = drive(pipe, ev)
    finally:
        pipe.close()
    assert [r["step"] for r in recs] == [0, 2, 4, 6, 8]
    assert all(r["eval/mixed_version_ratio"] == 0.0 for r in recs)
    assert engine.overlapped  # train refilled during an eval tail: the bound below is not vacuous
    assert engine.max_outstanding <= PERMITS
    assert all(n % TRAIN_N == 0 for kind, n in engine.requests if kind == "train")  # whole groups only
    assert sorted({n for kind, n in engine.requests if kind == "eval"}) == [1, 6]  # the cohort in 2 requests
