"""Partial rollouts on the spool (protocol minor 2, ``align/rollout/cut.py``): ``stitch`` against a plain loop, and
the real vLLM CPU worker (one start for the module) cutting a request mid-flight, the continuation under newer
weights, a cut of an answered request, and a worker below minor 2 refused before anything is sent.

References: the uncut run of the same request (same seeds) for the cut rows; transformers teacher-forced
``log_softmax`` under each weights version for the two segments of a resumed completion.
"""

from __future__ import annotations

import time

import pytest
from helpers_models import require_rollout_venv

from align.rollout import cut as C
from align.rollout import protocol as P
from align.rollout.protocol import Completion, SamplingParams
from align.rollout.spool import Spool

LOGPROB_TOL = 1e-4  # fp32 vLLM CPU vs fp32 transformers (measured ~1e-5 on the tiny model)
MAX_MODEL_LEN = 16384  # the tiny model's context, raised so a request can run long
READY_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 180.0
LONG = 100  # max_tokens of the uncut reference and of a cut row resumed
ROWS_LEN = 256  # the greedy rows of test_generate_until_...: long enough for the cut to find them running
BLOCK = 128  # vLLM's KV block on CPU: the prefix cache holds full blocks only
PROMPTS = [[(7 * i) % 500 + 3 for i in range(BLOCK + 12)], [300, 2, 44, 45, 46, 47]]  # the first fills a block
BIG = MAX_MODEL_LEN - len(PROMPTS[0])  # max_tokens of a request that is cut: ~50 s of engine steps, never outrun


def _loop_stitch(done: Completion, rest: Completion) -> dict:
    """The reference: one token at a time."""
    out = {"token_ids": [], "logprobs": [], "sampled": [], "versions": []}
    for seg in (done, rest):
        for k, t in enumerate(seg.token_ids):
            out["token_ids"].append(t)
            out["logprobs"].append(seg.logprobs[k])
            out["sampled"].append(seg.sampled_logprobs[k])
            out["versions"].append(seg.weights_version if seg.token_versions is None else seg.token_versions[k])
    return out


def test_stitch_is_the_plain_loop():
    done = Completion(1, 0, [4, 5, 6], [-0.1, -0.2, -0.3], "cut", [-0.1, -0.2, -0.3], weights_version=3)
    rest = Completion(0, 0, [7, 8], [-0.4, -0.5], "stop", [-0.4, -0.5], weights_version=4)
    s = C.stitch(done, rest)
    ref = _loop_stitch(done, rest)
    assert (s.token_ids, s.logprobs, s.sampled_logprobs, s.token_versions) == (
        ref["token_ids"], ref["logprobs"], ref["sampled"], ref["versions"]
    )  # fmt: skip
    assert s.token_versions == [3, 3, 3, 4, 4]  # control: the loop is not trivially the concatenation of one
    assert (s.prompt_index, s.sample_index, s.finish_reason, s.weights_version) == (1, 0, "stop", 3)
    again = C.stitch(dataclasses_replace(s, finish_reason="cut"), rest)  # a second cut: versions carried per token
    assert again.token_versions == [3, 3, 3, 4, 4, 4, 4] == _loop_stitch(dataclasses_replace(s), rest)["versions"]
    empty = Completion(1, 0, [], [], "cut", [], weights_version=3)  # cut before its first token
    assert C.stitch(empty, rest).token_versions is None and C.stitch(empty, rest).weights_version == 4  # uniform
    assert C.stitch(dataclasses_replace(done, weights_version=4), rest).token_versions is None
    with pytest.raises(ValueError, match="not 'cut'"):
        C.stitch(rest, rest)
    with pytest.raises(ValueError, match="back in time"):
        C.stitch(dataclasses_replace(done, weights_version=5), rest)
    with pytest.raises(ValueError, match="two logprob bases"):
        C.stitch(done, dataclasses_replace(rest, sampled_logprobs=None))
    prompt, left = C.continuation_prompt([1, 2], done, SamplingParams(max_tokens=10))
    assert (prompt, left) == ([1, 2, 4, 5, 6], 7)


def dataclasses_replace(c: Completion, **kw) -> Completion:
    import dataclasses

    return dataclasses.replace(c, **kw)


def test_cut_rows_pass_the_completions_check_and_others_do_not():
    params = SamplingParams(n=1, max_tokens=4)
    body = {"logprob_basis": "raw", "completions": [Completion(0, 0, [], [], "cut", [], 1).to_dict()]}
    assert P.check_completions(body, [[1]], params, "x")[0].finish_reason == "cut"
    body["completions"][0]["finish_reason"] = "length"  # control: no tokens is a defect for a finished row
    with pytest.raises(P.ProtocolError, match=r"0 token ids, expected 1\.\.max_tokens"):
        P.check_completions(body, [[1]], params, "x")
    assert C.cut_request(["a", "b"]).kind == "cut"
    with pytest.raises(ValueError, match="names a request twice"):
        C.cut_request(["a", "a"])
    with pytest.raises(ValueError, match="list of generate request ids"):  # never a path out of requests/
        C.cut_request(["../secret"])


# ---------------------------------------------------------------------------------------------
# The real vLLM CPU worker


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from helpers_models import load_hf, make_tiny_qwen2

    from align.rollout.client import make_rollout_client, spawn_worker

    require_rollout_venv()
    root = tmp_path_factory.mktemp("cut")
    tiny = {"max_position_embeddings": MAX_MODEL_LEN}
    m1, m2 = make_tiny_qwen2(root / "v1", seed=0, **tiny), make_tiny_qwen2(root / "v2", seed=1, **tiny)
    h = spawn_worker(root / "spool", model=m1, log_path=root / "worker.log", max_model_len=MAX_MODEL_LEN,
                     dtype="float32", weights_version=1, ready_timeout_s=READY_TIMEOUT_S)  # fmt: skip
    try:
        client = make_rollout_client("spool", spool=root / "spool", timeout_s=CALL_TIMEOUT_S, worker=h)
        yield {"client": client, "handle": h, "v1": m1, "v2": m2, "hf1": load_hf(m1), "hf2": load_hf(m2)}
    finally:
        h.shutdown(grace_s=5)


def _cut_mid_flight(client, params: SamplingParams) -> tuple[P.Message, list[Completion]]:
    """A long request cut while it generates: submitted with a short one behind it, cut once the short one is
    answered (so the long one has run some steps). Its ``max_tokens`` (BIG) is ~50 s of engine steps, so a test
    process starved on a loaded machine still cuts it mid-flight (at 100 tokens it was outrun six times in a row)."""
    long = P.generate_request(PROMPTS, params)
    client.spool.submit(long)
    client.generate([[7, 8]], SamplingParams(max_tokens=8, seed=2))  # answered after ~8 engine steps
    got = client.cut({long.id: (PROMPTS, params)})[long.id]
    assert all(c.finish_reason == "cut" and c.token_ids for c in got), [
        (c.finish_reason, len(c.token_ids)) for c in got
    ]
    return long, got


@pytest.mark.rollout
def test_cut_returns_the_rows_so_far_and_the_continuation_runs_on_the_new_weights(worker):
    from helpers_models import teacher_forced_logprobs

    client = worker["client"]
    assert client.weights_version in (None, 1)
    params = SamplingParams(n=2, max_tokens=BIG, seed=21)
    uncut = client.generate(PROMPTS, dataclasses_replace(params, max_tokens=LONG))  # seeded: the same first tokens
    other = client.generate(PROMPTS, SamplingParams(n=2, max_tokens=LONG, seed=22))
    long, rows = _cut_mid_flight(client, params)
    ks = [len(c.token_ids) for c in rows]
    print(f"\ncut after {ks} of {BIG} tokens; timings {client.last_timings}")
    assert all(0 < k < BIG for k in ks)
    resume = dataclasses_replace(params, max_tokens=max(LONG, max(ks) + 10))  # each row resumed to this length
    worst = 0.0
    for c, u, o in zip(rows, uncut, other):
        k = min(len(c.token_ids), LONG)  # compared with the uncut reference's first k tokens
        assert (c.prompt_index, c.sample_index, c.weights_version) == (u.prompt_index, u.sample_index, 1)
        assert c.token_ids[:k] == u.token_ids[:k]  # the uncut run's first k tokens (same seed)
        assert c.token_ids[:k] != o.token_ids[:k]  # control: another seed samples others
        worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, u.logprobs)))
        assert c.sampled_logprobs == c.logprobs  # T = 1, no truncation: the same basis as a finished answer
    print(f"cut rows vs the uncut run's first k logprobs: max |diff| = {worst:.2e}")
    assert worst < LOGPROB_TOL
    assert client.spool.request_state(long.id) == "done"  # answered once, taken

    # the continuation, first under the same weights: its prefix comes from the cache
    assert rows[0].prompt_index == 0
    prompt, left = C.continuation_prompt(PROMPTS[0], rows[0], resume)
    client.generate([prompt], SamplingParams(max_tokens=left, seed=5))
    cached_same = client.last_timings["cached_prompt_tokens"]

    # then on v2: every cut row resumed as prompt + ids so far
    assert client.sync_weights(worker["v2"], 2) > 0
    prompts, rests, cached_new = [], [], []
    for c in rows:
        p, left = C.continuation_prompt(PROMPTS[c.prompt_index], c, resume)
        prompts.append(p)
        (rest,) = client.generate([p], SamplingParams(max_tokens=left, seed=6 + len(rests)))
        rests.append(rest)
        cached_new.append(client.last_timings["cached_prompt_tokens"])
    print(f"continuation prompt tokens from the prefix cache: {cached_same} on v1; on v2, row by row {cached_new}")
    assert cached_same >= BLOCK  # the prefix cache serves a continuation under the same weights ...
    assert cached_new[0] == 0  # ... and is reset by the sync: nothing computed under v1 is served on v2
    assert rests[0].weights_version == 2
    new_worst, old_best, first_worst = 0.0, float("inf"), 0.0
    for c, p, rest in zip(rows, prompts, rests):
        s = C.stitch(c, rest)
        k = len(c.token_ids)
        assert s.token_versions == [1] * k + [2] * len(rest.token_ids) and s.finish_reason == "length"
        assert len(s.token_ids) == resume.max_tokens
        ref_new = teacher_forced_logprobs(worker["hf2"], p, rest.token_ids)
        ref_old = teacher_forced_logprobs(worker["hf1"], p, rest.token_ids)
        ref_first = teacher_forced_logprobs(worker["hf1"], PROMPTS[c.prompt_index], c.token_ids)
        new_worst = max(new_worst, max(abs(a - b) for a, b in zip(s.logprobs[k:], ref_new)))
        old_best = min(old_best, max(abs(a - b) for a, b in zip(s.logprobs[k:], ref_old)))
        first_worst = max(first_worst, max(abs(a - b) for a, b in zip(s.logprobs[:k], ref_first)))
    print(f"resumed segment vs v2 teacher-forced: {new_worst:.2e} (vs v1: {old_best:.2e}); cut segment vs v1: "
          f"{first_worst:.2e}")  # fmt: skip
    assert new_worst < LOGPROB_TOL and first_worst < LOGPROB_TOL
    assert old_best > 100 * LOGPROB_TOL  # negative control: the old weights' logprobs are far off
    assert client.sync_weights(worker["v1"], 3) > 0  # back, for the other tests


@pytest.mark.rollout
def test_cutting_an_answered_request_is_harmless(worker):
    client = worker["client"]
    params = SamplingParams(n=1, max_tokens=6, seed=3)
    msg = P.generate_request(PROMPTS, params)
    client.spool.submit(msg)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while client.spool.request_state(msg.id) != "answered":  # answered, not taken
        assert time.monotonic() < deadline, "the worker never answered the request"
        time.sleep(0.02)
    assert C.cut_requests(client, [msg.id, "r-never-sent"]) == {msg.id: "untouched", "r-never-sent": "untouched"}
    got = client.cut({msg.id: (PROMPTS, params)})[msg.id]  # its answer, as it was given
    assert [c.finish_reason for c in got] == ["length", "length"] and all(len(c.token_ids) == 6 for c in got)
    assert client.cut({msg.id: (PROMPTS, params)}) == {}  # taken: nothing more to collect
    assert client.generate(PROMPTS[:1], SamplingParams(max_tokens=3))[0].finish_reason == "length"  # still serving


@pytest.mark.rollout
def test_a_queued_request_is_cut_before_it_starts_behind_a_pending_sync(worker):
    """A cut is served between two engine steps, even while a sync waits for the drain: a generate queued behind
    that sync is answered with every row cut before its first token. (The long request asks for BIG tokens, ~50 s of
    engine steps: the cut arrives while it runs, however loaded the machine.)"""
    client = worker["client"]
    sp = client.spool
    long_params, queued_params = SamplingParams(n=2, max_tokens=BIG, seed=4), SamplingParams(n=2, max_tokens=8)
    long = P.generate_request(PROMPTS, long_params)
    sync = P.sync_request(worker["v1"], 4)
    queued = P.generate_request(PROMPTS, queued_params)
    for msg in (long, sync, queued):
        sp.submit(msg)
    got = client.cut({long.id: (PROMPTS, long_params), queued.id: (PROMPTS, queued_params)})
    assert client.wait(sync.id, expect="synced")["version"] == 4
    assert {c.finish_reason for c in got[long.id]} == {"cut"}
    assert [c.token_ids for c in got[queued.id]] == [[]] * 4 and {c.finish_reason for c in got[queued.id]} == {"cut"}
    before = got[long.id][0].weights_version  # stamped with the weights before the sync, as the long one
    assert all(c.logprobs == [] and c.weights_version == before != 4 for c in got[queued.id])


def test_a_worker_below_minor_2_is_refused_before_sending(tmp_path):
    from align.rollout.client import WorkerDiedError, make_rollout_client
    from align.rollout.teacher_logprobs import WorkerTooOldError

    spool = Spool(tmp_path / "old").ensure()
    spool.write_heartbeat("ready", minor=1)  # a minor-1 worker's heartbeat (score, no cut; the Ray fleet today)
    client = make_rollout_client("spool", spool=spool.root, timeout_s=0.5)
    with pytest.raises(WorkerTooOldError, match=r"1\.1; cutting requests in flight .* needs 1\.2 or newer"):
        client.cut({"r-any": (PROMPTS, SamplingParams())})
    with pytest.raises(WorkerTooOldError, match="needs 1\\.2"):
        client.generate_until(PROMPTS, SamplingParams(), 1)
    assert spool.pending() == []  # nothing was sent
    spool.write_heartbeat("ready")  # control: this checkout's minor; the cut is sent (and, with no worker, unanswered)
    with pytest.raises(WorkerDiedError, match="no answer"):
        client.cut({"r-any": (PROMPTS, SamplingParams())})
    assert [Spool(spool.root).read(p).kind for p in spool.pending()] == ["cut"]


TIE = 1e-3  # greedy under another batch composition: two tokens within this logprob of each other are a tie


def _agrees(got: Completion, ref: Completion, upto: int | None = None) -> bool:
    """``got``'s tokens are ``ref``'s first ones (all of them: ``upto`` None), or the two part at a near tie of their
    greedy logprobs (vLLM's CPU GEMMs round differently for another batch composition, which concurrent requests
    under load change) and are not compared past it."""
    n = len(got.token_ids) if upto is None else upto
    for k in range(n):
        if k >= len(ref.token_ids):
            return False
        if got.token_ids[k] != ref.token_ids[k]:
            return abs(got.logprobs[k] - ref.logprobs[k]) < TIE
    return upto is not None or n <= len(ref.token_ids)


@pytest.mark.rollout
def test_generate_until_cuts_the_rest_and_a_second_call_finishes_them(worker):
    """``SpoolClient.generate_until`` (the partial-rollouts call): greedy, one group stops at its 4th token; the call
    returns once one group is complete, the rows still running cut as prefixes of the uncut run; a second call with
    them carried finishes every row exactly as the uncut run (same weights: one version, ``token_versions`` None)."""
    client = worker["client"]
    groups = [PROMPTS[1], [5, 17, 99, 123], [7, 8, 9]]
    longest = ROWS_LEN - max(len(g) for g in groups) - 1  # rows long enough for the cut to find them running
    ref = client.generate(groups, SamplingParams(n=2, temperature=0.0, max_tokens=longest))
    stop = ref[0].token_ids[3]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=longest, stop_token_ids=[stop])
    expected = [c.token_ids[: c.token_ids.index(stop) + 1] if stop in c.token_ids else c.token_ids for c in ref]
    first = client.generate_until(groups, params, 1, None)
    assert [(c.prompt_index, c.sample_index) for c in first] == [(g, j) for g in range(3) for j in range(2)]
    for c, r in zip(first, ref):
        assert _agrees(c, r), (c.token_ids, r.token_ids)  # cut or not, a prefix of the uncut run (up to a near tie)
    exact = [c.token_ids == e[: len(c.token_ids)] for c, e in zip(first, expected)]
    assert sum(exact) >= len(first) - 1, exact  # a tie is rare: at most one row parts from the uncut run
    for c, e, same in zip(first, expected, exact):
        assert c.finish_reason == "cut" or c.token_ids == e or not same
    complete = [g for g in range(3) if all(c.finish_reason != "cut" for c in first[2 * g : 2 * g + 2])]
    print(f"\ngenerate_until(need=1): groups {complete} complete, rows cut after {[len(c.token_ids) for c in first]}")
    assert complete  # at least the one it waited for
    if len(complete) == 3:  # an idle engine ran every row to its end before the cut was served: nothing to carry
        assert all(_agrees(c, r) for c, r in zip(first, ref))
        with pytest.raises(ValueError, match="complete already"):
            client.generate_until(groups, params, 3, first)
        return
    second = client.generate_until(groups, params, 3, first)
    assert "cut" not in {c.finish_reason for c in second}
    finished = [c.token_ids == e for c, e in zip(second, expected)]
    assert sum(finished) >= len(second) - 1, finished  # every row as the uncut run's, but for a near tie
    assert all(same or _agrees(c, r) for c, r, same in zip(second, ref, finished))
    wrong = dataclasses_replace(second[0], token_ids=[t + 1 for t in second[0].token_ids])
    assert not _agrees(dataclasses_replace(wrong, logprobs=[lp - 1.0 for lp in wrong.logprobs]), ref[0])  # control
    assert _agrees(wrong, ref[0])  # the same tokens off at equal logprobs: a tie, by the rule above
    assert all(c.token_versions is None and c.weights_version == client.weights_version for c in second)
    with pytest.raises(ValueError, match="complete already"):
        client.generate_until(groups, params, 3, second)


@pytest.mark.rollout
def test_generate_until_cuts_every_request_still_out_once_stop_says_so(worker):
    """``stop`` (--partial-cut publish), asked between polls: once true the requests still out are cut though no
    group is complete; every row a prefix of the uncut run. Control: a stop that never says so waits for the rows."""
    client = worker["client"]
    groups = [[5, 17, 99, 123], [7, 8, 9]]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=ROWS_LEN - 5)
    ref = client.generate(groups, params)
    asked: list[int] = []
    got = client.generate_until(groups, params, 2, None, stop=lambda: asked.append(1) or True)
    print(f"\nstop at once: rows cut after {[len(c.token_ids) for c in got]} of {[len(c.token_ids) for c in ref]}")
    assert asked and all(_agrees(c, r) for c, r in zip(got, ref))
    assert all(c.finish_reason == "cut" or len(c.token_ids) == len(r.token_ids) for c, r in zip(got, ref))
    full = client.generate_until(groups, params, 2, None, stop=lambda: False)
    assert [c.finish_reason for c in full] == [r.finish_reason for r in ref]  # nothing cut


@pytest.mark.rollout
def test_a_seeded_prompt_longer_than_a_steps_token_budget_is_served(worker):
    """A resumed row is prompt + every id so far: thousands of tokens, over vLLM's per-step budget (2048). Under
    chunked prefill vLLM's CPU runner rewound the seeded request's generator by a CUDA-only offset and the engine
    core died ("CPU Generator does not use offset"); the worker turns chunked prefill off on a CPU. Run last: on the
    old worker it kills the module's engine."""
    long = [(7 * i) % 500 + 3 for i in range(5000)]
    (c,) = worker["client"].generate([long], SamplingParams(max_tokens=3, seed=11))
    assert len(c.token_ids) == 3 and len(c.logprobs) == 3
