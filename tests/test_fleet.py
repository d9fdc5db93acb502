"""The rollout fleet for real: 2 vLLM CPU engines as actors of a local Ray cluster (logical GPUs declared, so
the placement group is exercised) behind one spool (extras/vllm_rollout/fleet.py).

One fleet serves the module (engine starts are the cost on 2 shared cores): a GRPO run of a few steps attaches
to it, one engine actor is SIGKILLed before step 2's rollouts and the run completes (every completion stamped
with the synced version, the heartbeat reports the death and the restart); then, with the restart budget spent,
both engines are killed while a request is in flight and the trainer's client raises WorkerDiedError with the
log tail, well within its timeout. Before the kills, the same fleet serves ``cut`` (protocol minor 2, each engine
cutting its own prompts, checked against the uncut run) and a short ``--partial-rollouts`` run that trains a carried
row.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers_models import record_carries, require_rollout_venv

from align.rollout import client as client_mod
from align.rollout.client import WorkerDiedError, make_rollout_client, spawn_worker
from align.rollout.protocol import SamplingParams, generate_request, pid_alive

pytestmark = [pytest.mark.rollout, pytest.mark.slow]

READY_TIMEOUT_S = 900.0  # two engines start side by side on 2 shared cores (measured ~100-130 s, cold cache)
CALL_TIMEOUT_S = 600.0  # a restart during a sync is waited for (~60 s measured)
DEATH_TIMEOUT_S = 120.0  # all engines killed -> WorkerDiedError well within the client's timeout
MISMATCH_TOL = 1e-3  # as tests/test_train_spool.py: fp32 vLLM CPU vs align, on-policy at T=1


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, reverse_model):
    require_rollout_venv()
    from align.tasks import reverse

    root = tmp_path_factory.mktemp("fleet")
    tok = reverse.tokenizer()
    base = reverse_model
    handle = spawn_worker(
        root / "spool",
        model=base,
        engines=2,
        engine_restarts=1,
        in_process=True,
        eval_engines=1,
        eval_spool=root / "eval_spool",
        dtype="float32",
        max_model_len=reverse.model_config(tok).max_position_embeddings,
        ready_timeout_s=READY_TIMEOUT_S,
        log_path=root / "fleet.log",
    )
    try:
        yield {
            "root": root,
            "handle": handle,
            "base": base,
            "tok": tok,
            "spool": root / "spool",
            "eval_spool": root / "eval_spool",
        }
    finally:
        handle.shutdown(grace_s=30)
        assert not handle.group_alive(), "a fleet process survived teardown"


def _nice(pid: int) -> int:
    """A process's niceness, field 19 of /proc/PID/stat (after the parenthesised name, which may hold spaces)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


class HeartbeatLog:
    """Polls the fleet's heartbeat in a thread and keeps every distinct engine-state picture seen."""

    def __init__(self, spool) -> None:
        self.client = make_rollout_client("spool", spool=spool)
        self.seen: list[list[tuple]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            hb = self.client.spool.read_heartbeat() or {}
            picture = [(e["index"], e["state"], e.get("pid")) for e in hb.get("engines", [])]
            if picture and (not self.seen or self.seen[-1] != picture):
                self.seen.append(picture)

    def stop(self) -> list[list[tuple]]:
        self._stop.set()
        self._t.join()
        return self.seen


def test_eval_fleet_on_ray_is_pinned_per_point(fleet):
    """One eval engine in the bundle appended after the rollout region, behind its own router (the eval spool),
    pinned per eval point by align.eval.fleet.EvalFleet as today; training syncs never reach it."""
    from align.eval.checkpoint_eval import EvalSkip
    from align.eval.fleet import EvalFleet, FleetEngine
    from align.model import Transformer, save_pretrained
    from align.tasks import reverse

    cfg = reverse.model_config(fleet["tok"])
    snaps = [save_pretrained(Transformer(cfg).init_weights(seed=s), fleet["root"] / f"eval_v{s}") for s in (1, 2)]
    client = make_rollout_client("spool", spool=fleet["eval_spool"], timeout_s=CALL_TIMEOUT_S)
    deadline = time.monotonic() + READY_TIMEOUT_S  # the eval engine starts after the rollout engines
    while (client.spool.read_heartbeat() or {}).get("state") != "ready" and time.monotonic() < deadline:
        time.sleep(0.5)
    hb = client.spool.read_heartbeat()
    assert hb["state"] == "ready" and [e["bundles"] for e in hb["engines"]] == [[2]]  # after rollout's [0], [1]
    rollout_gpus = {g for e in fleet["handle"].spool.read_heartbeat()["engines"] for g in e["gpu_ids"]}
    assert len(hb["engines"][0]["gpu_ids"]) == 1 and not set(hb["engines"][0]["gpu_ids"]) & rollout_gpus
    evf = EvalFleet([FleetEngine(client, name="ray-eval")])
    prompts, params = [[3, 4, 5], [6, 7]], SamplingParams(n=2, max_tokens=4, seed=0)
    outs = {}
    for version, snap in zip((101, 102), snaps):
        state = evf.pin(str(snap), version)
        out = state.generate(prompts, params)
        assert {c.weights_version for c in out} == {version}
        outs[version] = [c.token_ids for c in out]
    assert outs[101] != outs[102]  # the pins loaded different weights
    rollout_versions = {e["version"] for e in fleet["handle"].spool.read_heartbeat()["engines"]}
    assert not rollout_versions & {101, 102}  # the rollout engines never saw the eval snapshots
    partial = fleet["root"] / "eval_partial"
    save_pretrained(Transformer(cfg).init_weights(seed=3), partial)
    for marker in (".complete", "STABLE"):
        (partial / marker).unlink(missing_ok=True)
    with pytest.raises(EvalSkip) as skip:
        evf.pin(str(partial), 103)
    assert skip.value.reason == "pin_violation"
    assert {e["version"] for e in client.spool.read_heartbeat()["engines"]} == {102}


def test_eval_router_runs_on_its_runner_actor_and_never_blocks_rollout(fleet):
    """The eval router is a driver-owned actor (its own process): while the eval engine serves a long eval request,
    a training weight sync and a rollout generate on the rollout spool are answered, before the eval is."""
    from align.model import Transformer, save_pretrained
    from align.rollout.protocol import generate_request
    from align.tasks import reverse

    driver = fleet["handle"].pid
    eval_client = make_rollout_client("spool", spool=fleet["eval_spool"], timeout_s=CALL_TIMEOUT_S)
    roll = make_rollout_client("spool", spool=fleet["spool"], timeout_s=CALL_TIMEOUT_S, worker=fleet["handle"])
    eval_hb = eval_client.spool.read_heartbeat()
    assert eval_hb["region"] == "eval" and roll.spool.read_heartbeat()["pid"] == driver
    assert eval_hb["pid"] != driver and pid_alive(eval_hb["pid"])  # written by the EvalRunner actor's process
    # every Ray worker of the fleet (engines, the runner actor) at the driver's niceness: RAY_worker_niceness=0 (Ray's
    # default renices them to 15, and loaded cores starved the engines; without it this reads driver + 15)
    deadline = time.monotonic() + READY_TIMEOUT_S  # run alone, the eval engine may still be starting
    while time.monotonic() < deadline:
        engines = [e for c in (eval_client, roll) for e in (c.spool.read_heartbeat() or {}).get("engines", [])]
        if len(engines) == 3 and all(e["state"] == "ready" and "pid" in e for e in engines):
            break
        time.sleep(0.5)
    eval_hb = eval_client.spool.read_heartbeat()
    actors = [eval_hb["pid"], *(e["pid"] for e in engines)]
    assert len(actors) == 4 and {_nice(p) for p in actors} == {_nice(driver)}, [_nice(p) for p in [driver, *actors]]
    eval_versions = {e["version"] for e in eval_hb["engines"]}
    cfg = reverse.model_config(fleet["tok"])
    snaps = [save_pretrained(Transformer(cfg).init_weights(seed=s), fleet["root"] / f"v{s}") for s in (7, 8)]
    small = ([[3, 4, 5], [6, 7]], SamplingParams(n=2, max_tokens=4, seed=0))

    def rollout_sync_and_generate(snap, version) -> float:
        t = time.monotonic()
        roll.sync_weights(snap, version)
        assert {c.weights_version for c in roll.generate(*small)} == {version}
        return time.monotonic() - t

    rollout_sync_and_generate(snaps[0], 7)  # warm-up: a fresh engine's first calls take seconds
    idle_s = rollout_sync_and_generate(snaps[1], 8)  # control: the eval engine idle
    # the eval engine: 384 prompts x 4 samples x 28 tokens (max_model_len is 32), many times the rollout calls
    big = generate_request([[5, 6, 7]] * 384, SamplingParams(n=4, max_tokens=28, seed=3))
    t0 = time.monotonic()
    eval_client.spool.submit(big)
    while eval_client.spool.request_state(big.id) != "claimed" and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    assert eval_client.spool.request_state(big.id) == "claimed"
    t_claimed = time.monotonic()
    busy_s = rollout_sync_and_generate(snaps[0], 9)
    eval_state = eval_client.spool.request_state(big.id)
    body = eval_client.wait(big.id, expect="completions")
    eval_s = time.monotonic() - t_claimed
    print(
        f"\nrollout sync + generate: {idle_s:.2f} s with the eval engine idle, {busy_s:.2f} s while it served an "
        f"eval request of {eval_s:.2f} s"
    )
    assert eval_state == "claimed", f"the eval ({eval_s:.1f} s) was answered before the rollout calls ({busy_s:.1f} s)"
    assert len(body["completions"]) == 384 * 4
    assert {e["version"] for e in roll.spool.read_heartbeat()["engines"]} == {9}
    assert {e["version"] for e in eval_client.spool.read_heartbeat()["engines"]} == eval_versions  # not synced


CUT_LONG = 28  # max_tokens of the request that is cut (max_model_len is 32, the prompt 3 tokens)
LOGPROB_TOL = 1e-4  # the same engine and seed: the cut rows' logprobs are the uncut run's (~0 measured)


def _cut_across_the_engines(client, prompts: list[list[int]], params: SamplingParams) -> list:
    """A short request S, then (S claimed) the long one L, more rows than an engine runs at once (vLLM queues the
    rest); L is cut once S is answered, so L has run some steps on the other engine. A machine too slow or too fast for
    a row to be caught mid-flight: again, three times at most."""
    short, seen = SamplingParams(max_tokens=2, seed=2), []
    for attempt in range(3):
        s, long = generate_request([[5, 6]], short), generate_request(prompts, params)
        client.spool.submit(s)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while client.spool.request_state(s.id) == "pending" and time.monotonic() < deadline:
            time.sleep(0.01)  # S claimed alone: an engine call of its own, answered as soon as S is done
        client.spool.submit(long)
        client.generate([[5, 6]], short, request_id=s.id)
        got = client.cut({long.id: (prompts, params)})[long.id]
        if any(c.finish_reason == "cut" and c.token_ids for c in got):
            print(f"\ncut on attempt {attempt + 1}")
            return got
        seen.append(sorted({(c.finish_reason, len(c.token_ids)) for c in got}))
    pytest.fail(f"no row of the long request was caught mid-flight, three times: {seen}")


def test_a_cut_on_the_fleet_returns_each_rows_tokens_so_far(fleet):
    """Protocol minor 2 on the fleet (extras/vllm_rollout/fleet_cut.py): each engine cuts its own prompts of the
    request; reference: the uncut run of a cut prompt alone (a prompt's seed is the request's and its global index,
    ``first_prompt_index``: the same samples on any engine and in any request)."""
    client = make_rollout_client("spool", spool=fleet["spool"], timeout_s=CALL_TIMEOUT_S, worker=fleet["handle"])
    assert client.spool.read_heartbeat()["minor"] == 2  # score and cut; not sleep (3) nor routes (4)
    n = 16  # L: 128 prompts x 16 rows of 28 tokens, 1024 rows per engine, seconds of work: a cut arrives mid-flight
    prompts, params = [[5, 6, 7], [7, 6, 5]] * 64, SamplingParams(n=n, max_tokens=CUT_LONG, seed=21)
    t0 = time.perf_counter()
    got = _cut_across_the_engines(client, prompts, params)
    ks = [len(c.token_ids) for c in got]
    print(
        f"cut after {sorted(collections.Counter(ks).items())} (tokens, rows) of {CUT_LONG}; engines "
        f"{client.last_timings['engines']}; {time.perf_counter() - t0:.1f} s"
    )
    assert all((c.finish_reason, len(c.token_ids) < CUT_LONG) in (("cut", True), ("length", False)) for c in got)
    assert set(client.last_timings["engines"]) == {"0", "1"}  # the request spread over both engines
    caught = sorted({c.prompt_index for c in got if c.finish_reason == "cut" and c.token_ids})
    mine = [caught[0], *[i for i in caught if i % 2 != caught[0] % 2][:1]]  # one of each engine's where it has one
    worst = 0.0
    for i in mine:
        ref = client.generate([prompts[i]], params, first_prompt_index=i)
        rows = got[i * n : (i + 1) * n]
        for c, u in zip(rows, ref):
            k = len(c.token_ids)
            assert (c.prompt_index, c.sample_index) == (i, u.sample_index) and c.token_ids == u.token_ids[:k]
            worst = max([worst, *(abs(a - b) for a, b in zip(c.logprobs, u.logprobs))])
            assert c.sampled_logprobs == c.logprobs
    print(f"cut rows of prompts {mine} vs their uncut run's first k logprobs: max |diff| = {worst:.2e}")
    assert worst < LOGPROB_TOL
    other = client.generate([prompts[mine[0]]], dataclasses.replace(params, seed=22), first_prompt_index=mine[0])
    rows = got[mine[0] * n : (mine[0] + 1) * n]
    assert any(c.token_ids and c.token_ids != o.token_ids[: len(c.token_ids)] for c, o in zip(rows, other))  # seed 22


def test_an_engine_call_answers_each_request_as_it_finishes(fleet):
    """An engine call streams its answers (fleet_engine.EngineActor.generate): a one-token request claimed with a long
    one is answered after its own step while the long one's rows still run (a cut then catches them mid-flight), so
    ``--partial-rollouts`` sees a group complete when it is. Before, an engine call answered all its prompts at its
    end: the short request waited for the long one's rows on its engine. (Were the two claimed apart, the short one is
    a call of its own and this passes either way; submitted back to back they are claimed together nearly always.)"""
    client = make_rollout_client("spool", spool=fleet["spool"], timeout_s=CALL_TIMEOUT_S, worker=fleet["handle"])
    short_params, params = SamplingParams(max_tokens=1, seed=3), SamplingParams(n=16, max_tokens=CUT_LONG, seed=23)
    prompts = [[5, 6, 7], [7, 6, 5]] * 64  # 1024 rows of 28 tokens per engine: seconds of work
    short, long = generate_request([[5, 6]], short_params), generate_request(prompts, params)
    client.spool.submit(short)
    client.spool.submit(long)
    assert len(client.generate([[5, 6]], short_params, request_id=short.id)[0].token_ids) == 1
    state = client.spool.request_state(long.id)
    got = client.cut({long.id: (prompts, params)})[long.id]
    caught = collections.Counter(len(c.token_ids) for c in got if c.finish_reason == "cut")
    print(f"long request when the short one was answered: {state}; cut rows (tokens, rows): {sorted(caught.items())}")
    assert state == "claimed" and sum(n for k, n in caught.items() if k > 0) > 0, (state, caught)


def test_a_request_claimed_while_a_call_runs_joins_the_engine_at_its_next_step(fleet):
    """Continuous batching across calls (fleet_cut.EngineLoop): a one-token request routed to an engine behind a long
    one's call (a call of its own) is answered after its own step, long before the long one. Before, an engine served
    its calls one after another: the short request waited for the whole long call (as a multi-turn episode's next turn
    waited for every call before it). Both engine actors are stopped while the three requests are claimed and routed
    (the least outstanding work: long A to engine 0, long B to engine 1, the short one behind A), then resumed together,
    so where each runs and what runs beside it does not depend on how late this process looks."""
    client = make_rollout_client("spool", spool=fleet["spool"], timeout_s=CALL_TIMEOUT_S, worker=fleet["handle"])
    pids = [e["pid"] for e in client.spool.read_heartbeat()["engines"]]
    short_params = SamplingParams(max_tokens=1, seed=4)
    a = generate_request([[5, 6, 7]], SamplingParams(n=240, max_tokens=CUT_LONG, seed=24))  # 240 rows: vLLM runs 256
    b = generate_request([[7, 6, 5]], SamplingParams(n=250, max_tokens=CUT_LONG, seed=25))
    short = generate_request([[5, 6]], short_params)
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        for msg in (a, b, short):  # each claimed (and routed) before the next is written
            client.spool.submit(msg)
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while client.spool.request_state(msg.id) == "pending" and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    done = {}  # when each was answered, by the fleet's own figures (how late this process looks cannot change them)
    for msg in (short, a, b):
        t = client.wait(msg.id, expect="completions")["timings"]
        done[msg.id] = (msg.created + t["queue_s"] + t["generate_s"], t["engines"])
    t0 = min(d[0] for d in done.values())
    print("answered (s after the first, engines):", [(round(d[0] - t0, 3), d[1]) for d in done.values()])
    assert done[a.id][1] == {"0": 1} and done[b.id][1] == {"1": 1} and done[short.id][1] == {"0": 1}  # the routing
    assert done[short.id][0] < done[a.id][0], "the short request waited for the long call before it on its engine"


def test_partial_rollouts_on_the_fleet_train_a_carried_row(fleet, monkeypatch):
    """`--partial-rollouts --max-async-steps 1` on the fleet: each step's call stops once its groups are complete,
    the engines cut the other rows, and a carried row finishes under newer weights on whichever engine."""
    from align.rollout import cut as cut_lib
    from align.tasks import reverse
    from align.train import TrainConfig, train

    cuts: list[int] = []
    real = cut_lib.cut_requests
    monkeypatch.setattr(cut_lib, "cut_requests", lambda client, ids: cuts.append(len(ids)) or real(client, ids))
    carries = record_carries(monkeypatch)
    run = fleet["root"] / "partial_run"
    cfg = TrainConfig(
        out=str(run),
        steps=5,
        prompts_per_step=4,
        group_size=4,
        max_tokens=24,
        lr=1e-2,
        rollout="spool",
        spawn_worker=False,
        spool=str(fleet["spool"]),
        rollout_num_engines=2,
        rollout_timeout_s=CALL_TIMEOUT_S,
        checkpoint_every=0,
        max_async_steps=1,
        partial_rollouts=True,
    )
    cfg.eval.eval_interval = 0
    summary = train(
        cfg,
        model=str(fleet["base"]),
        tokenizer=fleet["tok"],
        prompts=reverse.prompts(32, "train"),
        reward=lambda prompt, completion, **_: completion.count("a") / 6,
    )
    assert summary["steps"] == 5
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(cuts) > 0  # the fleet was asked to cut rows still running
    lags = [r["rollout/token_lag_max"] for r in recs]
    assert lags[0] == 0 and all(1 <= lag <= 1 + 24 for lag in lags[1:]), lags
    assert all(kept for kept, _ in carries.resumed), carries.resumed  # a cut row continues from its own tokens
    assert [r["rollout/partial_frac"] for r in recs] == [carries.spans[t] for t in range(1, 6)]
    print(
        f"rows cut mid-generation and continued: {len(carries.resumed)}, under newer weights: "
        f"{sum(newer for _, newer in carries.resumed)}; trained spanning versions: {carries.spans}"
    )
    if any(carries.spans.values()):  # a carried row finished on newer weights (timing: a starved trainer sees none)
        assert max(lags) >= 2, lags


def test_grpo_on_two_engines_survives_an_engine_kill(fleet, monkeypatch):
    from align.tasks import reverse
    from align.train import TrainConfig, train

    hb0 = fleet["handle"].spool.read_heartbeat()
    assert hb0["state"] == "ready" and [e["state"] for e in hb0["engines"]] == ["ready", "ready"]
    gpus = [g for e in hb0["engines"] for g in e["gpu_ids"]]
    assert len(gpus) == 2 and len(set(gpus)) == 2  # one logical GPU per engine's bundle, distinct
    binds = [e["cpu_bind"] for e in hb0["engines"]]  # CPU build: one core each (vLLM's default: the same core)
    assert None not in binds and len(set(binds)) == 2, binds
    victim = hb0["engines"][0]["pid"]
    calls: list[dict] = []
    real_generate = client_mod.SpoolClient.generate

    def spy_generate(self, prompts, params, request_id=None):
        if len(calls) == 1:  # before step 2's rollouts: kill engine 0's actor process
            os.kill(victim, signal.SIGKILL)
        out = real_generate(self, prompts, params, request_id)
        calls.append({"versions": {c.weights_version for c in out}, "engines": self.last_timings["engines"]})
        return out

    monkeypatch.setattr(client_mod.SpoolClient, "generate", spy_generate)
    beats = HeartbeatLog(fleet["spool"])
    run = fleet["root"] / "run"
    cfg = TrainConfig(
        out=str(run),
        steps=4,
        prompts_per_step=4,
        group_size=4,
        max_tokens=6,
        lr=1e-2,
        rollout="spool",
        spawn_worker=False,
        spool=str(fleet["spool"]),
        rollout_num_engines=2,
        rollout_timeout_s=CALL_TIMEOUT_S,
        checkpoint_every=0,
    )
    cfg.eval.eval_interval = 0
    try:
        summary = train(
            cfg,
            model=str(fleet["base"]),
            tokenizer=fleet["tok"],
            prompts=reverse.prompts(16, "train"),
            reward=lambda prompt, completion, **_: completion.count("a") / 6,
        )
    finally:
        seen = beats.stop()
    assert summary["steps"] == 4
    # every completion of step s was produced by the weights synced after step s - 1 (version s - 1)
    assert [c["versions"] for c in calls] == [{0}, {1}, {2}, {3}]
    assert calls[0]["engines"] == {"0": 2, "1": 2}  # least outstanding work: 4 prompts split 2 / 2
    assert "0" not in calls[1]["engines"]  # the killed engine's prompts were served by engine 1
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mismatch_abs_max"] < MISMATCH_TOL for r in recs), [r["mismatch_abs_max"] for r in recs]
    # the heartbeat showed the death, then the restarted engine (a new actor process)
    assert any(state in ("restarting", "dead") for pic in seen for i, state, _ in pic if i == 0), seen
    hb = fleet["handle"].spool.read_heartbeat()
    assert [d["pid"] for d in hb["engine_deaths"]] == [victim]
    assert [e["state"] for e in hb["engines"]] == ["ready", "ready"] and hb["engine_restarts_left"] == 0
    assert hb["engines"][0]["pid"] != victim and hb["engines"][0]["restarts"] == 1
    assert {e["version"] for e in hb["engines"]} == {4}


def test_all_engines_dead_raises_worker_died_with_the_log_tail(fleet):
    hb = fleet["handle"].spool.read_heartbeat()
    if hb.get("engine_restarts_left") != 0:
        pytest.skip("needs the previous test to have spent the fleet's restart budget")
    client = make_rollout_client("spool", spool=fleet["spool"], timeout_s=CALL_TIMEOUT_S, worker=fleet["handle"])
    result: list = []

    rid = "kill-all-request"

    def request() -> None:
        try:  # 256 prompts x 4 samples x 28 tokens: many seconds of work for both engines (max_model_len is 32)
            result.append(client.generate([[5, 6, 7]] * 256, SamplingParams(n=4, max_tokens=28, seed=1), rid))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            result.append(e)

    t = threading.Thread(target=request, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while client.spool.request_state(rid) != "claimed" and time.monotonic() < deadline:
        time.sleep(0.01)  # claimed = routed to the engines (the driver dispatches at once)
    assert client.spool.request_state(rid) == "claimed" and not result, result
    engines = fleet["handle"].spool.read_heartbeat()["engines"]
    t0 = time.monotonic()
    pids = [e["pid"] for e in engines]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t.join(DEATH_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert not t.is_alive(), f"the client hung for {DEATH_TIMEOUT_S} s after every engine was killed"
    err = result[0]
    assert isinstance(err, WorkerDiedError), err
    assert "all 2 engines are dead" in str(err) and "last lines" in str(err), str(err)[-2000:]
    assert elapsed < DEATH_TIMEOUT_S < CALL_TIMEOUT_S
    assert not any(pid_alive(p) for p in pids)
    print(f"\nall engines killed -> WorkerDiedError after {elapsed:.1f} s")
