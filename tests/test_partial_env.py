"""Partial rollouts on environment tasks (--partial-rollouts with an environment, align.envs.partial): an episode
carried across a publish at a turn boundary keeps each turn's version and logprobs (a loop reference: each policy
token teacher-forced under the weights of the version stamped on it, environment tokens masked, with negative
controls that stamp the wrong version); a short run reports partial episodes; the carry survives a checkpoint
(kill -9 resume replays the environments); bad combinations are refused by name."""

from __future__ import annotations

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


def episode_carry(max_token_staleness):
    """An in-process ``EnvRunner`` of ``turn_envs.Rounds`` and an ``EpisodeCarry`` on it (G = 2, ``--stale-policy
    drop``), and a ``next_prompts`` that hands out a short row (1 turn), then long ones (3 and 4 turns)."""
    from align.chat import TurnRenderer
    from align.envs.episodes import EpisodeRunner
    from align.envs.partial import EpisodeCarry
    from align.envs.runner import EnvRunner

    tok = reverse.tokenizer()
    envs = EnvRunner(None, turn_envs.Rounds, 0, 5.0)
    decode = lambda ids: tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids)
    runner = EpisodeRunner(envs, TurnRenderer(tok), decode, EnvConfig(max_turns=4), max_tokens=6, context=64)
    order = [0, 3, 1, 5, 2, 4]

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
        for turn in ep.turns:  # a turn's tokens share its version; the environment's reply is masked, logprob 0
            n, m = turn["policy_tokens"], turn["env_tokens"]
            assert stamps[at : at + n + m] == [turn["weights_version"]] * (n + m)
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


def test_the_learner_corrects_a_spanning_episode_token_by_token(versions, spanned):
    """The learner's behaviour logprobs and mask are the episode's: trained on version 1's weights, rho = pi / mu is
    1 on the turns version 1 sampled, off on version 0's; the environment's tokens are out of the loss."""
    from align.learner import sequence_batch

    _, v1 = versions
    _, _, (_, eps) = spanned
    ep = next(e for e in eps if len(set(versions_of(e))) > 1)
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


# ------------------------------------------------------------------------------------------------ runs


def run(out: Path, model_dir: str, **kw) -> list[dict]:
    from align.run.config import TrainConfig
    from align.train import train

    base = {"steps": 4, "prompts_per_step": 2, "group_size": 2, "max_tokens": 10, "checkpoint_every": 1}
    c = TrainConfig(out=str(out), **{**base, "keep_checkpoints": 10, "max_async_steps": 1, **kw})
    c.envs = EnvConfig(max_turns=4)
    c.eval.eval_interval = 0
    train(c, model=model_dir, tokenizer=reverse.tokenizer(), prompts=ROWS, env=turn_envs.Rounds)
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


def test_a_resumed_partial_episode_run_replays_the_carried_environments(tmp_path, partial_run):
    """kill -9 after checkpoint 1 (the disk as it was): the rerun replays the carried episodes' environments and logs
    exactly the uninterrupted run; a carried episode whose environment answers otherwise is dropped (controls)."""
    full, model_dir, recs = partial_run
    state = torch.load(full / "run" / "checkpoints" / "step_1" / "trainer_state.pt", weights_only=True)
    assert state["carry"] and all(len(ep["turns"]) >= 1 for g in state["carry"] for ep in g["episodes"])

    def rerun(name, edit=None):
        out = tmp_path / name
        shutil.copytree(full / "run", out)
        for p in (out / "checkpoints").iterdir():
            if p.name != "step_1":
                shutil.rmtree(p)
        if edit is not None:
            path = out / "checkpoints" / "step_1" / "trainer_state.pt"
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
