"""Partial rollouts on environment tasks (--partial-rollouts with an environment, align.envs.partial): an episode
carried across a publish keeps each turn's version and logprobs, and a turn cut inside goes on under the next
version, tokens < j from version v and >= j from v + 1 (a loop reference: each policy token teacher-forced under the
weights of the version stamped on it, environment tokens masked, with negative controls that stamp the wrong version
or move the boundary); short runs report partial episodes, single-turn ones included; the carry survives a
checkpoint, a turn cut inside included (kill -9 resume replays the environments); bad combinations are refused by
name."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers_learner import rev_model

from align.envs.config import EnvConfig
from align.rollout.client import NativeClient
from align.rollout.cut import versions_of
from align.rollout.protocol import SamplingParams
from align.tasks import reverse

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import turn_envs

TOL = 1e-4  # cached decode vs one full forward (fp32)
ROWS = reverse.prompts(64, "train")
PARAMS = SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=3, stop_token_ids=[reverse.tokenizer().eos_token_id])


def client(model, version):
    c = NativeClient(model)
    c.weights_version = version
    return c


@pytest.fixture(scope="module")
def versions():
    """Version 0 and version 1 (every weight moved by seeded noise) of the reverse task's shape."""
    v0 = rev_model()
    v1 = rev_model()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return v0, v1


def decode(ids: list[int]) -> str:
    tok = reverse.tokenizer()
    return tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids)


def episode_carry(max_token_staleness, env=turn_envs.Rounds, max_turns=4, max_tokens=6, order=None):
    """An in-process ``EnvRunner`` of ``env`` and an ``EpisodeCarry`` on it (G = 2, ``--stale-policy drop``), and a
    ``next_prompts`` that hands out ``order``'s rows (default: a short row (1 turn of Rounds), then long ones (3 and
    4 turns))."""
    from align.chat import TurnRenderer
    from align.envs.episodes import EpisodeRunner
    from align.envs.partial import EpisodeCarry
    from align.envs.runner import EnvRunner

    tok = reverse.tokenizer()
    envs = EnvRunner(None, env, 0, 5.0)
    cfg = EnvConfig(max_turns=max_turns)
    runner = EpisodeRunner(envs, TurnRenderer(tok), decode, cfg, max_tokens=max_tokens, context=64)
    order = list(order or [0, 3, 1, 5, 2, 4])

    def next_prompts(k):
        got, order[:] = order[:k], order[k:]
        return got

    return envs, EpisodeCarry(lambda: runner, 2, max_token_staleness, "drop"), next_prompts


@pytest.fixture(scope="module")
def spanned(versions):
    """Two draws of an ``EpisodeCarry`` (G = 2, need 1 of a pool of 2 x 1 groups at a time): the first on version 0,
    the second on version 1; what the second trains and the carry's state after the first."""
    envs, carry, next_prompts = episode_carry(None)
    with envs:
        first = carry.draw(1, 1, next_prompts, ROWS.__getitem__, PARAMS, client(versions[0], 0))
        held = carry.state()
        second = carry.draw(2, 1, next_prompts, ROWS.__getitem__, PARAMS, client(versions[1], 1))
    return first, held, second


def test_a_too_old_carried_group_is_dropped_and_its_environments_closed(versions):
    """``--max-token-staleness 0``: the group of row 3 carried (its environments open) from version 0 holds a token of
    lag 1 at step 2, so the second draw drops it (both episodes counted) and closes its environments; control: with
    no bound it is trained or carried on, nothing dropped."""
    for bound in (0, None):
        envs, carry, next_prompts = episode_carry(bound)
        with envs:
            assert carry.draw(1, 1, next_prompts, ROWS.__getitem__, PARAMS, client(versions[0], 0))[0] == [0]
            ((row, lives),) = carry.groups
            assert row == 3 and all(e.key in envs._envs for e in lives)
            rows, _ = carry.draw(2, 1, next_prompts, ROWS.__getitem__, PARAMS, client(versions[1], 1))
            kept = rows + [i for i, _ in carry.groups]
            if bound == 0:
                assert carry.dropped == 2 and 3 not in kept, (rows, carry.groups)
                assert not any(e.key in envs._envs for e in lives)
            else:
                assert carry.dropped == 0 and 3 in kept, (rows, carry.groups)
            carry.close()


CUT_PARAMS = dataclasses.replace(PARAMS, max_tokens=10, seed=4)  # single turns of 1-10 tokens: one is cut inside


@pytest.fixture(scope="module")
def cut_inside(versions):
    """One-turn episodes (``Feedback``, --max-turns 1), G = 2, need 1 of a pool of 2 x 1 groups: the first draw on
    version 0 stops when one group is complete, inside the other group's turns; the second, on version 1, finishes
    them. The carry's state between the two, and what the second trains."""
    envs, carry, next_prompts = episode_carry(None, turn_envs.Feedback, 1, 10, [0, 3, 1, 5])
    with envs:
        carry.draw(1, 1, next_prompts, ROWS.__getitem__, CUT_PARAMS, client(versions[0], 0))
        held = carry.state()
        second = carry.draw(2, 1, next_prompts, ROWS.__getitem__, CUT_PARAMS, client(versions[1], 1))
    return held, second, decode


def turn_error(ep, models, stamps) -> float:
    """Largest |logprob - teacher-forced logprob| of the policy's tokens, each under the model of its stamp."""
    full = torch.tensor([ep.prompt_ids + ep.token_ids])
    err = 0.0
    for j, (tok, m) in enumerate(zip(ep.token_ids, ep.mask)):
        if not m:
            continue
        with torch.no_grad():
            lp = models[stamps[j]](full)[0, len(ep.prompt_ids) + j - 1].float().log_softmax(-1)[tok]
        err = max(err, abs(float(lp) - ep.logprobs[j]))
    return err


def test_an_episode_spanning_a_publish_keeps_each_turns_version_and_logprobs(versions, spanned):
    first, held, (rows, eps) = spanned
    assert first[0] == [0] and len(held) == 1 and held[0]["row"] == 3  # the long row's group was carried
    assert rows == [3] and len(eps) == 2
    spans = 0
    for ep in eps:
        stamps = versions_of(ep)
        assert stamps == sorted(stamps) and set(stamps) <= {0, 1}
        assert len(ep.mask) == len(ep.token_ids) == len(ep.logprobs) == len(stamps)
        at = 0
        for turn in ep.turns:  # a turn ends on its version (a cut one began on an older one); the reply: masked, 0
            n, m = turn["policy_tokens"], turn["env_tokens"]
            assert stamps[at + n - 1 : at + n + m] == [turn["weights_version"]] * (m + 1)
            assert ep.mask[at : at + n] == [True] * n and ep.mask[at + n : at + n + m] == [False] * m
            assert all(lp == 0.0 for lp in ep.logprobs[at + n : at + n + m])
            at += n + m
        assert at == len(ep.token_ids)
        assert turn_error(ep, versions, stamps) < TOL
        if len(set(stamps)) > 1:
            spans += 1
            # negative controls: one model for every turn fails the loop reference
            assert turn_error(ep, versions, [0] * len(stamps)) > 100 * TOL
            assert turn_error(ep, versions, [1] * len(stamps)) > 100 * TOL
    assert spans >= 1


@pytest.mark.parametrize("where", ["spanned", "cut_inside"])
def test_the_learner_corrects_a_spanning_episode_token_by_token(request, versions, where):
    """The learner's behaviour logprobs and mask are the episode's: trained on version 1's weights, rho = pi / mu is
    1 on the tokens version 1 sampled, off on version 0's (a turn cut inside: within the turn); the environment's
    tokens are out of the loss."""
    from align.learner import sequence_batch

    _, v1 = versions
    eps = request.getfixturevalue(where)[-2 if where == "cut_inside" else -1][1]
    ep = next(e for e in eps if len(set(versions_of(e))) > 1)
    assert where == "spanned" or len(ep.turns) == 1  # both versions inside one turn
    inputs, targets, mask, full, _ = sequence_batch([[]], [ep], 1, "cpu")
    n0, k = len(ep.prompt_ids), len(ep.token_ids)
    assert mask[0][n0 - 1 :].tolist() == ep.mask and not mask[0][: n0 - 1].any()  # environment tokens: context
    with torch.no_grad():
        lp = v1(inputs)[0].float().log_softmax(-1)  # the learner's forward under version 1
    pi = lp.gather(-1, targets[0][:, None])[:, 0][n0 - 1 :]
    log_rho = pi - full[0][n0 - 1 :]
    assert log_rho.shape[0] == k
    stamps = torch.tensor(versions_of(ep))
    m = torch.tensor(ep.mask)
    assert log_rho[m & (stamps == 1)].abs().max() < TOL
    assert log_rho[m & (stamps == 0)].abs().max() > 100 * TOL  # negative control: the old turns are off-policy


def test_a_turn_cut_inside_goes_on_under_the_next_version_token_by_token(versions, cut_inside):
    """The first call stops at the token where one group completed: the other group's turns are cut there (kept on
    the carried episodes: ids, logprobs, version 0); the next call re-prefills them under version 1 and samples the
    rest of each turn, which the environment then steps as one answer. Tokens < j are version 0's, >= j version 1's
    (each teacher-forced under its stamp); controls: one version throughout, or the boundary one token late."""
    held, (rows, eps), decode = cut_inside
    assert len(held) == 1 and rows == [held[0]["row"]]
    full = 0
    for so_far, ep in zip(held[0]["episodes"], eps):
        (cut,) = so_far["turns"]  # carried inside its only turn
        j = cut["policy_tokens"]
        assert cut["finish_reason"] == "cut" and 0 < j < CUT_PARAMS.max_tokens and len(so_far["token_ids"]) == j
        assert len(ep.turns) == 1 and ep.turns[0]["finish_reason"] in ("stop", "length")
        stamps = versions_of(ep)
        k = len(ep.token_ids) - j
        assert k > 0 and stamps == [0] * j + [1] * k and all(ep.mask) and ep.turns[0]["policy_tokens"] == j + k
        assert j + k <= CUT_PARAMS.max_tokens  # the rest of the turn's budget, not a new one
        full += ep.turns[0]["finish_reason"] == "length"
        assert ep.token_ids[:j] == so_far["token_ids"] and ep.logprobs[:j] == so_far["logprobs"]  # kept as sampled
        said = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        assert said == [decode(ep.token_ids)] and ep.text == said[0]  # stepped as one answer
        assert turn_error(ep, versions, stamps) < TOL
        assert turn_error(ep, versions, [0] * (j + k)) > 100 * TOL  # negative controls
        assert turn_error(ep, versions, [1] * (j + k)) > 100 * TOL
        assert turn_error(ep, versions, [0] * (j + 1) + [1] * (k - 1)) > 100 * TOL or k == 1
    assert full  # a cut turn that ran to its budget


# ------------------------------------------------------------------------------------------------ runs


def run(out: Path, model_dir: str, env=turn_envs.Rounds, max_turns: int = 4, **kw) -> list[dict]:
    from align.run.config import TrainConfig
    from align.train import train

    base = {"steps": 4, "prompts_per_step": 2, "group_size": 2, "max_tokens": 10, "checkpoint_every": 1}
    c = TrainConfig(out=str(out), **{**base, "keep_checkpoints": 10, "max_async_steps": 1, **kw})
    c.envs = EnvConfig(max_turns=max_turns)
    c.eval.eval_interval = 0
    train(c, model=model_dir, tokenizer=reverse.tokenizer(), prompts=ROWS, env=env)
    keep = ("step", "loss", "reward_mean", "env/turns_mean", "env/env_tokens_mean")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in r if k in keep or k.startswith("rollout/")} for r in recs if "loss" in r]


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    from align.model import save_pretrained

    tmp = tmp_path_factory.mktemp("partial_env")
    model_dir = str(save_pretrained(rev_model(), tmp / "model"))
    return tmp, model_dir, run(tmp / "run", model_dir, partial_rollouts=True)


def test_a_partial_episode_run_trains_episodes_spanning_versions(partial_run):
    _, _, recs = partial_run
    assert len(recs) == 4 and all(r["loss"] == r["loss"] for r in recs)
    assert max(r["rollout/partial_frac"] for r in recs) > 0  # some episodes' turns come from two versions
    assert max(r["rollout/token_lag_max"] for r in recs) >= 2  # carried turns are older than K = 1
    assert any(r["env/env_tokens_mean"] > 0 for r in recs)


def test_a_run_of_single_turn_episodes_trains_turns_spanning_versions(partial_run):
    """--max-turns 1: every episode is one turn, so carrying at turn boundaries alone never spans two versions
    (``partial_frac`` 0 by construction); cut inside the turn, a long turn's tail comes from the next version."""
    tmp, model_dir, _ = partial_run
    recs = run(tmp / "one_turn", model_dir, turn_envs.Feedback, 1, steps=3, checkpoint_every=0, partial_rollouts=True)
    assert len(recs) == 3 and all(r["env/turns_mean"] == 1.0 and r["env/env_tokens_mean"] == 0 for r in recs)
    assert max(r["rollout/partial_frac"] for r in recs) > 0
    assert max(r["rollout/token_lag_max"] for r in recs) >= 2


def test_a_resumed_partial_episode_run_replays_the_carried_environments(tmp_path, partial_run):
    """kill -9 after checkpoint 1 (the disk as it was): the rerun replays the carried episodes' environments and logs
    exactly the uninterrupted run; a carried episode whose environment answers otherwise is dropped (controls)."""
    full, model_dir, recs = partial_run
    state = torch.load(full / "run" / "checkpoints" / "step_1" / "trainer_state.pt", weights_only=True)
    assert state["carry"] and all(len(ep["turns"]) >= 1 for g in state["carry"] for ep in g["episodes"])

    def rerun(name, edit=None, at="step_1"):
        out = tmp_path / name
        shutil.copytree(full / "run", out)
        for p in (out / "checkpoints").iterdir():
            if p.name != at:
                shutil.rmtree(p)
        if edit is not None:
            path = out / "checkpoints" / at / "trainer_state.pt"
            s = torch.load(path, weights_only=True)
            edit(s)
            torch.save(s, path)
        return run(out, model_dir, partial_rollouts=True)

    assert rerun("resumed") == recs

    running = [ep for g in state["carry"] for ep, done in zip(g["episodes"], g["done"]) if not done]
    assert any(not all(ep["mask"]) for ep in running)  # an episode carried mid-way (its environment is replayed)

    def other_env_tokens(s):  # the environment's recorded reply differs from what a replay renders
        ep = next(ep for g in s["carry"] for ep, d in zip(g["episodes"], g["done"]) if not d and not all(ep["mask"]))
        j = ep["mask"].index(False)
        ep["token_ids"][j] = (ep["token_ids"][j] + 1) % 8 + 3

    changed = rerun("changed", other_env_tokens)
    assert sum(r["rollout/dropped_stale"] for r in changed[1:]) >= 2 > sum(r["rollout/dropped_stale"] for r in recs)
    assert changed[1:] != recs[1:]

    # a checkpoint holding turns cut inside: the resumed run goes on from each one's ids so far
    inside = torch.load(full / "run" / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True)
    assert any(ep["turns"][-1]["finish_reason"] == "cut" for g in inside["carry"] for ep in g["episodes"])
    assert rerun("resumed_inside", at="step_2") == recs

    def forget_the_cut_turns(s):  # control: each cut turn's tokens dropped, so the turn is sampled anew
        for ep in (ep for g in s["carry"] for ep in g["episodes"] if ep["turns"][-1]["finish_reason"] == "cut"):
            j = len(ep["token_ids"]) - ep["turns"].pop()["policy_tokens"]
            for k in ("token_ids", "logprobs", "sampled_logprobs", "mask"):
                ep[k] = ep[k][:j]
            kept = (ep["token_versions"] or [])[:j]
            ep["token_versions"] = kept if len(set(kept)) > 1 else None  # as an episode of these tokens holds it
            ep["weights_version"] = ep["weights_version"] if j else 0

    forgot = rerun("forgot_inside", forget_the_cut_turns, "step_2")
    assert forgot[2:] != recs[2:] and [r["rollout/dropped_stale"] for r in forgot] == [
        r["rollout/dropped_stale"] for r in recs
    ]  # replayed and kept: only the cut turns' tokens differ


def test_partial_episodes_are_refused_where_they_are_not_carried():
    from types import SimpleNamespace

    from align.data import InputError
    from align.envs.sampler import open_sampler
    from align.train import TrainConfig

    env = SimpleNamespace(env=turn_envs.Rounds, env_spec=None)
    for kw, match in (
        ({"rollout": "spool"}, "not with --rollout spool"),
        ({"group_timeout_s": 5.0}, "not with --gr"),
        ({"partial_prefill": "keep"}, "not with --partial-prefill keep"),
    ):
        cfg = TrainConfig(max_async_steps=1, partial_rollouts=True, **kw)
        with pytest.raises(InputError, match=match):
            open_sampler(cfg, env)
    own = SimpleNamespace(env=type("Agent", (turn_envs.Rounds,), {"run_episodes": lambda *a: []}), env_spec=None)
    with pytest.raises(InputError, match="runs its own episodes"):
        open_sampler(TrainConfig(max_async_steps=1, partial_rollouts=True), own)
