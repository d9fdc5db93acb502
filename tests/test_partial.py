"""Partial rollouts (--partial-rollouts, align.rollout.partial): exactness of cut-and-resume against teacher-forced
recomputation under each version's saved weights, bit-identity when nothing is cut, the carry (staleness, checkpoint
and resume), the per-token metrics, bad input. Native sampler on the char task's model (vocab 8, <eos> = 2)."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
from helpers_train import PROMPTS, TIMING_KEYS, TOK, a_reward, cfg_for, records

from align.model import load_pretrained
from align.rewards import Scores
from align.rollout.client import NativeClient
from align.rollout.cut import versions_of
from align.rollout.groups import Groups
from align.rollout.native import generate
from align.rollout.partial import Carry
from align.rollout.protocol import Completion, SamplingParams
from align.train import TrainConfig, train

LOGPROB_ATOL = 1e-4  # cached decode vs one full forward (fp32)
ENCODED = [TOK.encode(p["prompt"]) for p in PROMPTS[:4]]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=14, seed=5, stop_token_ids=[TOK.eos_token_id])


@pytest.fixture(scope="module")
def versions(char_model):
    """Version 0 (the saved weights) and version 1 (every weight moved by seeded noise): two sets of weights."""
    v0 = load_pretrained(char_model)
    v1 = copy.deepcopy(v0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return v0, v1


def client(model, version):
    c = NativeClient(model)
    c.weights_version = version
    return c


@torch.no_grad()
def teacher_forced(model, prompt, ids, T=1.0):
    """log_softmax(logits / T) of each of ``ids`` after ``prompt``, one full forward (no cache)."""
    logits = model(torch.tensor([prompt + ids]))[0, len(prompt) - 1 : -1] / T
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def stamped_error(c, models, stamps):
    """Largest |logprob - teacher-forced logprob under the model each token is stamped with|."""
    return span_error(ENCODED[c.prompt_index], c, models, stamps)


def span_error(prompt, c, models, stamps):
    ref = torch.stack([teacher_forced(models[v], prompt, c.token_ids)[i] for i, v in enumerate(stamps)])
    return float((torch.tensor(c.logprobs) - ref).abs().max())


def test_uncut_call_is_bit_identical_to_generate(versions):
    v0, _ = versions
    want = generate(v0, ENCODED, PARAMS)
    got = client(v0, 0).generate_until(ENCODED, PARAMS, len(ENCODED), None)
    assert got == want  # token ids, logprobs, sampled logprobs, finish reasons: every bit
    assert all(c.token_versions is None and c.weights_version == 0 for c in got)
    # negative control: needing fewer groups than the call holds cuts rows, so the outputs differ
    assert client(v0, 0).generate_until(ENCODED, PARAMS, 1, None) != want


@pytest.fixture(scope="module")
def resumed(versions):
    """A call on version 0 that completes 1 group (the rest cut), resumed by a call on version 1 to the end."""
    v0, v1 = versions
    first = client(v0, 0).generate_until(ENCODED, PARAMS, 1, None)
    second = client(v1, 1).generate_until(ENCODED, PARAMS.__class__(**{**PARAMS.__dict__, "seed": 6}), 4, first)
    return first, second


def test_a_cut_row_resumes_under_the_new_version_token_by_token(versions, resumed):
    v0, v1 = versions
    first, second = resumed
    cut = [c for c in first if c.finish_reason == "cut"]
    assert cut and len(cut) < len(first)  # the call stopped at a token boundary with rows still running
    done = {c.prompt_index for c in first if c.finish_reason != "cut"}
    assert any(all(c.finish_reason != "cut" for c in first if c.prompt_index == p) for p in done)
    assert all(c.finish_reason in ("stop", "length") for c in second)
    resumed = 0
    for a, b in zip(first, second):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        if a.finish_reason != "cut":
            assert b == a  # a finished row comes back unchanged
            continue
        j = len(a.token_ids)
        assert b.token_ids[:j] == a.token_ids and b.logprobs[:j] == a.logprobs and b.weights_version == 0
        assert len(b.token_ids) <= PARAMS.max_tokens
        if len(b.token_ids) == j:
            continue
        resumed += 1
        stamps = versions_of(b)
        assert stamps == [0] * j + [1] * (len(b.token_ids) - j)
        assert stamped_error(b, (v0, v1), stamps) < LOGPROB_ATOL
        # negative controls: one model for both segments, or the boundary stamped one token late, fails the check
        assert stamped_error(b, (v0, v1), [0] * len(stamps)) > 100 * LOGPROB_ATOL
        assert stamped_error(b, (v0, v1), [1] * len(stamps)) > 100 * LOGPROB_ATOL
        assert stamped_error(b, (v0, v1), [0] * (j + 1) + [1] * (len(stamps) - j - 1)) > 100 * LOGPROB_ATOL
    assert resumed >= 2


def test_a_resumed_call_prefills_rows_of_like_length_together(versions, resumed, monkeypatch):
    """A resumed call holding carried rows (prompt + ids) and fresh prompts prefills them in buckets of like length:
    each row padded to less than twice its own length, not to the longest carried row's; every token it samples
    is still exact under the new version (teacher-forced), and not under the old one (the control)."""
    from align.rollout import native

    v0, v1 = versions
    first, _ = resumed
    calls: list[list[int]] = []
    real = native.prefill

    def recording(model, prompts, max_len, dtype):
        calls.append([len(p) for p in prompts])
        return real(model, prompts, max_len, dtype)

    monkeypatch.setattr(native, "prefill", recording)
    prompts = ENCODED + ENCODED[:2]  # the 4 carried groups and 2 fresh ones
    again = PARAMS.__class__(**{**PARAMS.__dict__, "seed": 6})
    got = client(v1, 1).generate_until(prompts, again, len(prompts), [*first, *[None] * (2 * PARAMS.n)])
    rows = [n for c in calls for n in c]
    assert len(rows) == sum(a.finish_reason == "cut" for a in first) + 2 * PARAMS.n  # each running row once
    assert len(calls) >= 2 and all(max(c) < 2 * n for c in calls for n in c)  # padded to < 2x its own length
    assert len(rows) * max(rows) > sum(len(c) * max(c) for c in calls)  # one prefill at the longest pads more
    checked = 0
    for r, c in enumerate(got):
        j = len(first[r].token_ids) if r < len(first) else 0
        if len(c.token_ids) == j:
            continue
        lps = torch.tensor(c.logprobs[j:])
        assert (lps - teacher_forced(v1, prompts[c.prompt_index], c.token_ids)[j:]).abs().max() < LOGPROB_ATOL
        assert (lps - teacher_forced(v0, prompts[c.prompt_index], c.token_ids)[j:]).abs().max() > 100 * LOGPROB_ATOL
        checked += 1
    assert checked >= 2 * PARAMS.n


def test_the_loss_corrects_a_spanning_completion_token_by_token(versions, resumed):
    """The learner's behaviour logprobs are the stitched per-token ones: trained on version 1's weights, rho =
    pi / mu is 1 on the tokens version 1 sampled and differs from 1 on those version 0 sampled."""
    from align.learner import sequence_batch

    _, v1 = versions
    first, second = resumed
    spans = [(a, b) for a, b in zip(first, second) if a.finish_reason == "cut" and len(b.token_ids) > len(a.token_ids)]
    _, _, mask, full, sampled = sequence_batch(ENCODED, [b for _, b in spans], PARAMS.n, "cpu")
    for row, (a, b) in enumerate(spans):
        mu = full[row][mask[row]]
        assert torch.equal(mu, sampled[row][mask[row]])  # no truncation: the two bases agree
        log_rho = teacher_forced(v1, ENCODED[b.prompt_index], b.token_ids) - mu
        j = len(a.token_ids)
        assert log_rho[j:].abs().max() < LOGPROB_ATOL
        assert log_rho[:j].abs().max() > 100 * LOGPROB_ATOL  # negative control: the old segment is off-policy


# ------------------------------------------------------------------------------------------------ keep


@torch.no_grad()
def hand_keep(old, new, prompt, ids, j, seed, draw, total, budget, forced=None):
    """The plain-loop reference of --partial-prefill keep: a row cut at token j (its ids[:j] sampled) has its cache
    built by ``old`` over prompt + ids[:j-1] (every token fed before the cut), then ``new`` feeds ids[j-1] on that
    cache and decodes tokens >= j on it (inverse-CDF sampling with the call's uniforms: ``total`` per step, the row's
    at ``draw``; stop at <eos> or ``budget`` tokens; ``forced``: take these tokens instead, teacher-forced). Returns
    (tokens, logprobs) of tokens >= j."""
    from align.attention import KVCache

    seq = prompt + ids[: j - 1]
    cache = KVCache(old.config, 1, len(prompt) + len(ids) + budget + 1, torch.float32, "cpu")
    cache.valid[:, : len(seq)] = True
    old(torch.tensor([seq]), positions=torch.arange(len(seq))[None], cache=cache)
    cache.length = len(seq)
    g = torch.Generator().manual_seed(seed)
    tok, toks, lps = ids[j - 1], [], []
    while len(toks) < (budget if forced is None else len(forced)):
        cache.valid[:, cache.length] = True
        logits = new(torch.tensor([[tok]]), positions=torch.tensor([[cache.length]]), cache=cache)[0, -1]
        cache.length += 1
        logp = logits.log_softmax(-1)
        u = torch.rand(total, generator=g)[draw]
        cdf = logp.exp().cumsum(-1)
        tok = int(torch.searchsorted(cdf, (u * cdf[-1])[None], right=True).clamp(max=len(cdf) - 1))
        tok = forced[len(toks)] if forced is not None else tok
        toks.append(tok)
        lps.append(float(logp[tok]))
        if tok == TOK.eos_token_id:
            break
    return toks, torch.tensor(lps)


@pytest.fixture(scope="module")
def kept(versions):
    """One client on one model: a call on version 0 (1 group complete, the rest cut), the trainer publishes version
    1 (the weights change in place), the next call resumes with --partial-prefill keep; and the same with recompute."""
    v0, v1 = versions
    again = PARAMS.__class__(**{**PARAMS.__dict__, "seed": 6})
    out = {}
    for mode in ("keep", "recompute"):
        c = client(copy.deepcopy(v0), 0)
        first = c.generate_until(ENCODED, PARAMS, 1, None, prefill=mode)
        c.model.load_state_dict(v1.state_dict())
        c.sync_weights(None, 1)
        out[mode] = (first, c.generate_until(ENCODED, again, 4, first, prefill=mode), c)
    return out


def test_keep_continues_on_the_old_cache_like_a_plain_loop(versions, kept):
    v0, v1 = versions
    first, second, c = kept["keep"]
    assert first == kept["recompute"][0]  # the cut call itself is the same in both modes, bit for bit
    assert c.kept == {}  # every kept cache was taken by the resume (nothing was cut again)
    R, checked = len(first), 0
    for r, (a, b) in enumerate(zip(first, second)):
        if a.finish_reason != "cut":
            assert b == a
            continue
        j, prompt = len(a.token_ids), ENCODED[a.prompt_index]
        assert b.token_ids[:j] == a.token_ids and b.logprobs[:j] == a.logprobs
        assert versions_of(b) == [0] * j + [1] * (len(b.token_ids) - j)
        toks, lps = hand_keep(v0, v1, prompt, b.token_ids, j, 6, r, R, PARAMS.max_tokens - j)
        assert toks == b.token_ids[j:]
        assert (torch.tensor(b.logprobs[j:]) - lps).abs().max() < LOGPROB_ATOL
        # negative controls: the cut boundary one token late (old weights' cache over ids[:j]), a cache built by the
        # new weights (recompute), or every token stamped with the new version (teacher-forced under v1) all differ
        if len(b.token_ids) > j + 1:
            late = hand_keep(v0, v1, prompt, b.token_ids, j + 1, 6, r, R, 0, forced=b.token_ids[j + 1 :])[1]
            assert (torch.tensor(b.logprobs[j + 1 :]) - late).abs().max() > 100 * LOGPROB_ATOL
        fresh = teacher_forced(v1, prompt, b.token_ids)[j:]
        assert (torch.tensor(b.logprobs[j:]) - fresh).abs().max() > 100 * LOGPROB_ATOL
        assert stamped_error(b, (v0, v1), versions_of(b)) > 100 * LOGPROB_ATOL  # the approximation, measured
        checked += 1
    assert checked >= 2


def test_recompute_differs_from_keep_after_the_cut(kept):
    """The same cut rows resumed with recompute: the first resumed token's logprob differs where both drew the
    same token (same uniforms, another cache); and recompute is exact under the stamped versions."""
    (_, keep, _), (_, rec, _) = kept["keep"], kept["recompute"]
    first = kept["keep"][0]
    same = [(a, k, q) for a, k, q in zip(first, keep, rec) if a.finish_reason == "cut"]
    compared = 0
    for a, k, q in same:
        j = len(a.token_ids)
        if len(k.token_ids) > j and len(q.token_ids) > j and k.token_ids[j] == q.token_ids[j]:
            assert abs(k.logprobs[j] - q.logprobs[j]) > 100 * LOGPROB_ATOL
            compared += 1
    assert compared >= 1


def test_keep_without_a_cut_or_a_cache_is_recompute_bit_for_bit(versions, kept):
    """No cut (every group in one call): keep == recompute == generate. A cut row whose cache is not in the store
    (a new client, as after a restart) resumes by recompute, bit for bit."""
    v0, v1 = versions
    want = generate(v0, ENCODED, PARAMS)
    assert client(v0, 0).generate_until(ENCODED, PARAMS, 4, None, prefill="keep") == want
    first, rec, _ = kept["recompute"]
    again = PARAMS.__class__(**{**PARAMS.__dict__, "seed": 6})
    assert client(v1, 1).generate_until(ENCODED, again, 4, first, prefill="keep") == rec
    assert kept["keep"][1] != rec  # negative control: with the caches kept, the resumed rows differ


def test_the_carry_drops_stale_groups_and_refills_from_fresh_prompts(versions):
    v0, v1 = versions
    carry = Carry(3, 1, "drop")
    drawn: list[int] = []

    def next_prompts(k):
        drawn.extend(range(len(drawn), len(drawn) + k))
        return drawn[-k:] if k else []

    rows, comps = carry.draw(1, 2, next_prompts, ENCODED.__getitem__, PARAMS, client(v0, 0))
    assert len(rows) == 2 and len(comps) == 6 and drawn == [0, 1, 2, 3]  # a pool of 2 x 2 groups
    assert all(c.finish_reason != "cut" for c in comps)
    held = carry.state()
    assert len(held) == 2 and any(c["finish_reason"] == "cut" for g in held for c in g["completions"])
    json.dumps(held)  # plain data
    # step 2 on version 1: lag of the carried tokens is 1 <= S, nothing dropped; step 3 (lag 2 > S): dropped
    again = Carry(3, 1, "drop", held)
    again.draw(2, 2, next_prompts, lambda i: ENCODED[i % 4], PARAMS, client(v1, 1))
    assert again.dropped == 0
    late = Carry(3, 1, "drop", held)
    before = len(drawn)
    late.draw(3, 2, next_prompts, lambda i: ENCODED[i % 4], PARAMS, client(v1, 2))
    assert late.dropped == 6 and len(drawn) - before == 4  # both carried groups gone, the pool refilled fresh


def test_a_stop_cuts_the_running_rows_where_it_says(versions):
    """``stop`` (--partial-cut publish) is asked after every token; once it says so every row still running is cut
    there though no group is complete, each row a prefix of the uncut call's (same weights, same seed)."""
    v0, _ = versions
    want = generate(v0, ENCODED, PARAMS)
    asked: list[int] = []
    got = client(v0, 0).generate_until(
        ENCODED, PARAMS, len(ENCODED), None, stop=lambda: asked.append(1) or len(asked) >= 4
    )
    cut = [c for c in got if c.finish_reason == "cut"]
    assert len(asked) == 4 and cut and all(len(c.token_ids) == 4 for c in cut)
    for c, w in zip(got, want):
        assert c == w or (c.token_ids, c.logprobs) == (w.token_ids[:4], w.logprobs[:4]) and c.finish_reason == "cut"
    assert client(v0, 0).generate_until(ENCODED, PARAMS, len(ENCODED), None, stop=lambda: False) == want  # control


def test_a_fill_decodes_the_carried_rows_on_the_version_held_until_the_stop(versions):
    """``Carry.fill`` (what the producer does while it waits for a publish): the carried rows still running go on
    under the last call's weights, stamped with its version, until ``stop()``; the next call resumes them under the
    new weights, and each token's logprob is its own version's teacher-forced one (negative control: one model)."""
    v0, v1 = versions
    carry = Carry(3, None, "drop", cut="publish")
    assert carry.fill(lambda: False) == 0  # nothing drawn yet: nothing to decode
    drawn: list[int] = []

    def next_prompts(k):
        drawn.extend(range(len(drawn), len(drawn) + k))
        return drawn[-k:] if k else []

    carry.draw(1, 1, next_prompts, ENCODED.__getitem__, PARAMS, client(v0, 0))
    before = {(i, c.sample_index): c for i, cs in carry.groups for c in cs}
    asked: list[int] = []
    n = carry.fill(lambda: asked.append(1) or len(asked) >= 3)  # asked once before the call, then per token
    after = {(i, c.sample_index): c for i, cs in carry.groups for c in cs}
    grew = {k: len(after[k].token_ids) - len(c.token_ids) for k, c in before.items()}
    assert n == sum(grew.values()) > 0 and len(drawn) == 2  # no fresh prompt: the cursor did not move
    for k, c in before.items():
        assert after[k].token_ids[: len(c.token_ids)] == c.token_ids
        if c.finish_reason != "cut":
            assert grew[k] == 0 and after[k] == c
        else:
            assert 1 <= grew[k] <= 2 and (grew[k] == 2 or after[k].finish_reason != "cut")
            assert versions_of(after[k]) == [0] * len(after[k].token_ids)
    rows, comps = carry.draw(2, 1, next_prompts, ENCODED.__getitem__, PARAMS, client(v1, 1))
    held = [(ENCODED[i], c) for i, cs in carry.groups for c in cs] + [(ENCODED[rows[c.prompt_index]], c) for c in comps]
    spans = 0
    for prompt, c in held:
        stamps = versions_of(c)
        if len(set(stamps)) < 2:
            continue
        spans += 1
        assert span_error(prompt, c, (v0, v1), stamps) < LOGPROB_ATOL
        assert span_error(prompt, c, (v0, v1), [1] * len(stamps)) > 100 * LOGPROB_ATOL
    assert spans >= 1


def test_the_pool_factor_sets_how_many_groups_a_call_holds(versions):
    """--partial-pool-factor F: a call with nothing carried holds F x the groups the step needs (default 2)."""
    for kw, want in (({}, 2), ({"pool_factor": 3}, 3)):
        drawn: list[int] = []
        seen: list[int] = []

        def next_prompts(k, drawn=drawn):
            drawn.extend(range(len(drawn), len(drawn) + k))
            return drawn[-k:]

        def prompt_of(i, seen=seen):
            seen.append(i)
            return ENCODED[i]

        rows, comps = Carry(3, None, "drop", **kw).draw(1, 1, next_prompts, prompt_of, PARAMS, client(versions[0], 0))
        assert drawn == list(range(want)) and sorted(set(seen)) == drawn  # the call held F groups
        assert len(rows) == 1 and len(comps) == 3 and all(c.finish_reason != "cut" for c in comps)


def test_mask_policy_makes_stale_completions_unscorable():
    old = Completion(0, 0, [3, 4], [-1.0, -1.0], "stop", token_versions=[0, 1])
    new = Completion(0, 1, [3], [-1.0], "stop", weights_version=2)
    g = Groups([0], [old, new], ["", ""], Scores([0.5, 1.0], {"r": [0.5, 1.0]}), 0, 1, 1, 2)
    carry = Carry(2, 1, "mask")
    carry.mask_stale(4, g)  # step 4: lags 3 and 2 for `old` (> 1), 1 for `new`
    assert math.isnan(g.scores.totals[0]) and math.isnan(g.scores.terms["r"][0])
    assert g.scores.totals[1] == 1.0 and carry.dropped == 1
    Carry(2, 3, "mask").mask_stale(4, g)  # negative control: S = 3 masks nothing more
    assert g.scores.totals[1] == 1.0


# ------------------------------------------------------------------------------------------------ runs


def run(out, model, **kw) -> list[dict]:
    cfg = cfg_for(
        out, **{"steps": 6, "checkpoint_every": 2, "keep_checkpoints": 10, "max_tokens": 12, "group_size": 2, **kw}
    )
    cfg.log.log_completions_every = 1
    train(cfg, model=model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    timed = {"async/trainer_wait_s", "async/generator_idle_s", "async/inflight"}  # timings, not records
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and k not in timed} for r in records(out)]


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory, char_model):
    out = tmp_path_factory.mktemp("partial")
    return out, run(out, char_model, max_async_steps=1, partial_rollouts=True)


def test_a_partial_run_trains_on_tokens_of_several_versions(partial_run):
    _, recs = partial_run
    assert len(recs) == 6
    assert max(r["rollout/partial_frac"] for r in recs) > 0  # some completions span two versions
    assert max(r["rollout/token_lag_max"] for r in recs) >= 2  # carried tokens are older than K = 1
    assert all(r["rollout/token_lag_mean"] >= min(r["step"] - 1, 1) for r in recs)


def test_without_the_flag_nothing_partial_is_logged_or_stored(tmp_path, char_model):
    recs = run(tmp_path / "plain", char_model, max_async_steps=1, steps=2)
    assert not any(k.startswith("rollout/") and ("lag" in k or "partial" in k) for r in recs for k in r)
    state = torch.load(tmp_path / "plain" / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True)
    assert "carry" not in state


def test_max_token_staleness_bounds_every_token(tmp_path, char_model):
    recs = run(tmp_path / "s", char_model, max_async_steps=1, partial_rollouts=True, max_token_staleness=1)
    assert all(r["rollout/token_lag_max"] <= 1 for r in recs)
    assert sum(r["rollout/dropped_stale"] for r in recs) > 0


def test_resume_continues_from_the_carried_groups(tmp_path, char_model, partial_run):
    """A kill -9 after checkpoint 2 (the disk as it was): the rerun logs exactly the uninterrupted run; without the
    checkpoint's carried groups it does not."""
    full, recs = partial_run
    state_path = full / "checkpoints" / "step_2" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)
    assert any(c["finish_reason"] == "cut" for g in state["carry"] for c in g["completions"])

    def rerun(name, edit=None):
        out = tmp_path / name
        shutil.copytree(full, out)
        for p in (out / "checkpoints").iterdir():
            if p.name != "step_2":
                shutil.rmtree(p)
        if edit is not None:
            s = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True)
            edit(s)
            torch.save(s, out / "checkpoints" / "step_2" / "trainer_state.pt")
        return run(out, char_model, max_async_steps=1, partial_rollouts=True)

    assert rerun("resumed") == recs
    assert rerun("lost", lambda s: s.update(carry=[]))[2:] != recs[2:]  # negative control


def test_publish_cut_decodes_the_carried_rows_while_the_trainer_steps(tmp_path, char_model, monkeypatch):
    """--partial-cut publish in a run whose optimizer step takes 0.3 s longer: the producer, done with the next
    batch, decodes its carried rows instead of waiting (rollout/fill_tokens); every trained token is from the step's
    version or older (the pipeline's check) and the run trains to the end. Control: the groups cut logs no fill."""
    import time

    from align.run.policy import Learner

    update = Learner.update
    monkeypatch.setattr(Learner, "update", lambda self, batch: time.sleep(0.3) or update(self, batch))
    recs = run(tmp_path / "p", char_model, max_async_steps=1, partial_rollouts=True, partial_cut="publish", steps=4)
    assert len(recs) == 4 and sum(r["rollout/fill_tokens"] for r in recs) > 0
    assert max(r["rollout/token_lag_max"] for r in recs) >= 2  # carried (and filled) tokens are older than K = 1
    control = run(tmp_path / "g", char_model, max_async_steps=1, partial_rollouts=True, steps=1)
    assert "rollout/fill_tokens" not in control[0]


def test_a_fill_holds_the_eval_lease_and_yields_to_a_queued_eval():
    """The pipeline's fill (--partial-cut publish) runs under the engine's lock, the eval lease, so an eval epoch
    cannot switch the weights under it; it stops once an eval is queued or the next step may start, and does not
    start while an eval holds the lease. A stand-in carry records what the fill sees."""
    import threading
    from types import SimpleNamespace

    from align.rollout.pipeline import RolloutPipeline

    engine = SimpleNamespace(lock=threading.RLock(), client=None, version=0)
    seen: list[tuple] = []

    def elsewhere(fn):  # run fn on another thread (an eval thread's view of the lock)
        out: list = []
        th = threading.Thread(target=lambda: out.append(fn()))
        th.start()
        th.join()
        return out[0]

    def try_lease():
        if engine.lock.acquire(blocking=False):
            engine.lock.release()
            return True
        return False

    class Stand:
        cut = "publish"

        def fill(self, stop):
            seen.append((elsewhere(try_lease), stop()))
            pipe.eval_queue.append(1)  # an eval epoch is queued mid-fill
            seen.append((elsewhere(try_lease), stop()))
            return 5

    pipe = RolloutPipeline(1, lambda *a: None, engine=engine, last_step=9, carry=Stand())
    pipe._fill(3)  # step 3 needs version 1, not published yet
    assert seen == [(False, False), (False, True)] and pipe.fill_tokens == 5
    assert elsewhere(try_lease)  # released after the fill
    pipe.eval_queue.clear()
    elsewhere(lambda: engine.lock.acquire())  # an eval thread holds the lease (acquired there, never released)
    pipe._fill(3)
    assert len(seen) == 2 and pipe.fill_tokens == 5  # no fill under an eval's lease


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"partial_rollouts": True}, "add --max-async-steps 1"),
        ({"max_token_staleness": -1}, "--max-token-staleness must be an int >= 0"),
        ({"partial_rollouts": True, "max_async_steps": 2, "max_token_staleness": 1}, "below --max-async-steps 2"),
        ({"stale_policy": "keep"}, "--stale-policy must be one of"),
        ({"partial_prefill": "nope"}, "--partial-prefill must be one of"),
        ({"partial_pool_factor": 1}, "--partial-pool-factor must be an int >= 2"),
        ({"partial_cut": "publish", "max_async_steps": 1}, "add --partial-rollouts"),
        ({"partial_cut": "now"}, "--partial-cut must be one of"),
        (
            {"partial_rollouts": True, "max_async_steps": 1, "rollout": "spool", "partial_prefill": "keep"},
            "resumes a cut row only by recompute",
        ),
        ({"partial_rollouts": True, "max_async_steps": 1, "max_inflight_requests": 8}, "--max-inflight-requests"),
    ],
)
def test_bad_partial_settings_fail_before_the_model_loads(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


def test_the_ray_fleet_is_accepted_with_partial_rollouts():
    """Each engine of the fleet cuts its own requests (tests/test_fleet.py runs it); control: one refusal row above."""
    cfg = TrainConfig(partial_rollouts=True, max_async_steps=1, rollout="spool", rollout_num_engines=2)
    assert cfg.partial_rollouts and cfg.rollout_num_engines == 2
    with pytest.raises(ValueError, match="add --max-async-steps 1"):
        TrainConfig(partial_rollouts=True, rollout="spool", rollout_num_engines=2)


def test_the_pipeline_refuses_cut_or_future_tokens():
    from align.rollout.partial import check_versions

    ok = [Completion(0, 0, [3, 4], [-1.0, -1.0], "stop", token_versions=[1, 2], weights_version=1)]
    check_versions(3, 2, ok)  # older tokens are what partial rollouts are for
    with pytest.raises(RuntimeError, match="version\\(s\\) \\[3\\]"):
        check_versions(3, 2, [Completion(0, 0, [3], [-1.0], "stop", weights_version=3)])
    with pytest.raises(RuntimeError, match="1 cut completion"):
        check_versions(3, 2, [Completion(0, 0, [3], [-1.0], "cut", weights_version=2)])


def test_an_environment_task_off_the_native_sampler_is_refused_before_the_model_loads():
    from types import SimpleNamespace

    from align.data import InputError
    from align.envs.sampler import open_sampler

    cfg = TrainConfig(max_async_steps=1, partial_rollouts=True, rollout="spool")
    with pytest.raises(InputError, match="episodes on the native sampler .* not with --rollout spool"):
        open_sampler(cfg, SimpleNamespace(env=object()))  # the sampling seam refuses before opening anything
    open_sampler(cfg, SimpleNamespace(env=None))  # negative control: a single-turn task is fine
    cfg = TrainConfig(max_async_steps=1, partial_rollouts=True, partial_cut="publish")
    with pytest.raises(InputError, match="not with --partial-cut publish"):
        open_sampler(cfg, SimpleNamespace(env=object()))


@pytest.mark.parametrize("cut", ["groups", "publish"])
def test_pinned_eval_is_never_cut(tmp_path, char_model, monkeypatch, cut):
    """Eval epochs on the rollout engine (pinned to one version) go through generate, never generate_until: only the
    producer thread calls it. The run uses --partial-prefill keep (the carry passes it; the client holds the caches);
    with --partial-cut publish the producer's fills share the engine with the eval epochs."""
    import threading

    callers, modes, held = [], [], []
    real = NativeClient.generate_until

    def spy(self, *a, **kw):
        callers.append(threading.current_thread().name)
        modes.append(kw.get("prefill"))
        held.append(sum(len(v) for v in getattr(self, "kept", {}).values()))  # caches kept from the last call
        return real(self, *a, **kw)

    monkeypatch.setattr(NativeClient, "generate_until", spy)
    kw = {"steps": 4, "checkpoint_every": 0, "max_tokens": 12, "group_size": 2, "max_async_steps": 1}
    cfg = cfg_for(tmp_path / "e", partial_rollouts=True, partial_prefill="keep", partial_cut=cut, **kw)  # keep
    cfg.eval.eval_interval = 2
    train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward, eval_prompts=PROMPTS[:3])
    assert callers and set(callers) == {"align-rollout-producer"}
    assert set(modes) == {"keep"} and max(held) > 0  # the carry asked for keep; cut rows' caches were held
    evals = [r for r in records(tmp_path / "e") if "eval/weight_version" in r]
    assert [r["eval/weight_version"] for r in evals] == [0, 2, 4]
    assert all(r["eval/mixed_version_ratio"] == 0 for r in evals)
    steps = [r for r in records(tmp_path / "e") if "rollout/token_lag_max" in r]
    assert len(steps) == 4  # the train steps ran partial alongside


def test_bad_partial_flags_are_one_line_from_the_cli(tmp_path, capsys):
    from align.train import main

    with pytest.raises(SystemExit) as e:
        main(["--partial-rollouts", "--max-async-steps", "1", "--stale-policy", "later", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stale-policy must be one of ('drop', 'mask'), got 'later'" in err[0]
    assert not (tmp_path / "o").exists()  # nothing written


# ------------------------------------------------------------------------------------------------ LoRA


@pytest.fixture(scope="module")
def lora_versions(char_model):
    """Two LoRA policies on the same frozen base: version 0's adapter and version 1's (the adapter moved by seeded
    noise, as an optimizer step moves it; the base is untouched), and the bare base."""
    from align import lora

    base = load_pretrained(char_model)
    v0 = lora.apply_lora(copy.deepcopy(base), lora.LoraConfig(rank=4), seed=0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in v0.named_parameters():
            if "lora_B" in name:  # B starts at zero (the adapter is a no-op): give version 0 an adapter of its own
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    v1 = copy.deepcopy(v0)
    with torch.no_grad():
        for name, p in v1.named_parameters():
            if "lora_" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return base, v0, v1


def test_a_cut_row_resumes_under_the_new_adapter_token_by_token(lora_versions):
    """--partial-rollouts with LoRA, native sampler: a row cut under adapter version 0 and resumed under version 1
    has each token's logprob from the LoRA policy of the version it is stamped with (adapter included)."""
    base, v0, v1 = lora_versions
    first = client(v0, 0).generate_until(ENCODED, PARAMS, 1, None)
    second = client(v1, 1).generate_until(ENCODED, PARAMS.__class__(**{**PARAMS.__dict__, "seed": 6}), 4, first)
    spans = [(a, b) for a, b in zip(first, second) if a.finish_reason == "cut" and len(b.token_ids) > len(a.token_ids)]
    assert len(spans) >= 2
    for a, b in spans:
        j = len(a.token_ids)
        stamps = versions_of(b)
        assert stamps == [0] * j + [1] * (len(b.token_ids) - j)
        assert stamped_error(b, (v0, v1), stamps) < LOGPROB_ATOL
        # negative controls: the bare base (no adapter) for the new segment, or version 0's adapter throughout
        assert stamped_error(b, (v0, base), stamps) > 100 * LOGPROB_ATOL
        assert stamped_error(b, (v0, v1), [0] * len(stamps)) > 100 * LOGPROB_ATOL


def test_a_lora_run_with_partial_rollouts_carries_and_trains_the_adapter(tmp_path, char_model):
    """`--lora-rank 4 --partial-rollouts --max-async-steps 1`: groups are carried across versions, the adapter
    trains (the checkpoint holds the adapter and the carry), the base stays frozen."""
    from align.lora import LoraConfig

    recs = run(tmp_path / "l", char_model, max_async_steps=1, partial_rollouts=True, steps=4, lora=LoraConfig(rank=4))
    assert max(r["rollout/partial_frac"] for r in recs) > 0  # some completions span two adapter versions
    assert max(r["rollout/token_lag_max"] for r in recs) >= 2  # carried tokens
    ckpt = tmp_path / "l" / "checkpoints" / "step_4"
    assert (ckpt / "adapter").is_dir() and not (ckpt / "model.safetensors").exists()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert "carry" in state
    from safetensors.torch import load_file

    b = [v for k, v in load_file(next((ckpt / "adapter").glob("*.safetensors"))).items() if "lora_B" in k]
    assert b and max(float(t.abs().max()) for t in b) > 0  # negative of init: B starts at zero, training moved it
