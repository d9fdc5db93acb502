"""The built-in agent task (align/tasks/agent.py): the multiturn task played by a stdlib agent program through the
gateway. What the gateway captures is what the multiturn environment path trains, token for token; and
``python -m align.train --task agent`` runs with no files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from align.run.config import TrainConfig
from align.tasks import agent, multiturn

LOGPROB_TOL = 1e-5  # the same sampler on the same ids; concurrent generates may sum in another order (~1e-7)


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> Path:
    """A briefly warm-started model of the task (its answers mostly wrong: most episodes take both turns)."""
    return agent.warm_start(tmp_path_factory.mktemp("agent_task") / "m", steps=30, batch=16, log=None)


def _config(out: Path, task: str, model: Path) -> TrainConfig:
    c = TrainConfig(out=str(out), task=task, model=str(model), steps=1, prompts_per_step=4, group_size=2, seed=5)
    c.eval_prompts, c.eval.eval_n, c.eval.eval_interval = 8, 2, 1  # 16 held-out episodes at steps 0 and 1
    c.envs.gateway_max_connections = 4  # fewer than the held-out episodes (agents beyond it once got 503s)
    return c


def _evals(out: Path) -> list[dict]:
    """The eval points of a run's metrics.jsonl (their pass@k, avg@n, first-turn pass@1)."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ("eval/pass@", "eval/avg@", "eval/first_turn")
    return [{k: v for k, v in r.items() if k.startswith(keys)} for r in recs if "eval/step" in r]


def test_the_template_renders_the_environments_token_sequence():
    from align.chat import TurnRenderer

    tok = agent.tokenizer()
    r = TurnRenderer(tok)
    convo = [{"role": "user", "content": "ca?d="}, {"role": "assistant", "content": "dfac"}]
    assert r.first(convo[:1]) == multiturn.tokenizer().encode("ca?d=")  # what the environment's reset() encodes to
    assert r.suffix([{"role": "user", "content": "|b="}]) == tok.encode("|b=", add_bos=False)
    ids = tok.encode("ca?d=dfac") + [tok.eos_token_id] + tok.encode("|b=", add_bos=False)
    assert r.check_append_only([*convo, {"role": "user", "content": "|b="}], ids) is None
    assert r.check_append_only([*convo, {"role": "user", "content": "|c="}], ids) is not None  # control
    with pytest.raises(ValueError, match="'<' is not in the tokenizer's alphabet"):
        tok.encode("ca<d=")  # a stray '<' is no special token


def test_the_gateway_captures_what_the_multiturn_environment_trains(tmp_path, warm_model, monkeypatch):
    """One step of --task multiturn and one of --task agent from the same model and seed, each with its held-out eval
    before and after: every episode's ids, mask, logprobs and reward are equal, trained and held out, and so are the
    eval metrics. The environment path runs per episode (its spool-client path, on the same native sampler: each
    turn one generate seeded by the episode's place and turn, as the gateway seeds each request) and the gateway one
    generate per request (--gateway-batch-ms 0), so both draw the same tokens (their logprobs equal up to float
    summation order). The held-out set (16 episodes) runs more agents than the gateway serves connections (4): the
    agents beyond them once got 503s and their episodes scored 0 (a 200 x 4 eval against 512 connections)."""
    import align.envs.episodes
    from align.envs.sampler import Episodes
    from align.train import train

    seen: dict[str, list] = {"multiturn": [], "agent": []}
    real = Episodes.episodes

    def capture(task: str):
        return lambda self, *a: seen[task].extend(eps := real(self, *a)) or eps

    monkeypatch.setattr(align.envs.episodes, "_native_model", lambda client: (None, False))
    monkeypatch.setattr(Episodes, "episodes", capture("multiturn"))
    train(_config(tmp_path / "env", "multiturn", warm_model))
    monkeypatch.setattr(Episodes, "episodes", capture("agent"))
    monkeypatch.delitem(agent.TRAIN_DEFAULTS, "envs.gateway_batch_ms")  # one generate per request: seeded draws
    train(_config(tmp_path / "agent", "agent", warm_model))

    env, gw = seen["multiturn"], seen["agent"]
    assert len(env) == len(gw) == 16 + 8 + 16 and all(e.error is None for e in env + gw)  # eval, train, eval
    evals = {task: _evals(tmp_path / name) for task, name in (("multiturn", "env"), ("agent", "agent"))}
    assert (
        len(evals["agent"]) == 2
        and [{k: v for k, v in m.items() if "first_turn" not in k} for m in evals["multiturn"]] == evals["agent"]
    ), evals
    # the environment's turns carry rewards; an agent's requests do not: no first-turn figure (it read a false 0)
    assert all("eval/first_turn_pass@1" in m for m in evals["multiturn"]), evals
    two = [e for e in gw if len(e.turns) == 2]
    assert two, "no episode reached the feedback"
    for a, b in zip(env, gw):
        assert (a.prompt_ids, a.token_ids, a.mask) == (b.prompt_ids, b.token_ids, b.mask)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_TOL and a.env_reward == b.env_reward
        assert [t["policy_tokens"] for t in a.turns] == [t["policy_tokens"] for t in b.turns]
    tok = agent.tokenizer()
    for a, b in zip(env, gw):  # the masked tokens are the environment's feedback naming the hidden letter, only those
        if len(b.turns) == 2:
            n, fb = b.turns[0]["policy_tokens"], a.messages[2]["content"]
            assert a.messages[2]["role"] == "environment" and fb[0] + fb[2] == "|=" and fb[1] in multiturn.LETTERS
            assert b.token_ids[n : n + 3] == tok.encode(fb, add_bos=False) and b.mask.count(False) == 3
            assert b.messages[2] == {"role": "user", "content": fb}  # the agent sent it
    # controls: the comparisons can fail (the episodes are not all alike; their logprobs differ beyond the tolerance)
    assert any((a.token_ids, a.mask) != (b.token_ids, b.mask) for a, b in zip(env, gw[1:] + gw[:1]))
    assert any(abs(x - y) > LOGPROB_TOL for a, b in zip(env, gw[1:] + gw[:1]) for x, y in zip(a.logprobs, b.logprobs))


@pytest.mark.e2e
def test_the_documented_command_runs_the_agent_task(tmp_path, warm_model, monkeypatch):
    """``python -m align.train --task agent`` (a few steps): the agents run through the gateway, every one scored, the
    held-out episodes evaluated. The task batches the agents' requests (``--gateway-batch-ms 500``) and the run is
    deterministic: the same command with a 1 ms window (other batches: checked) gives the same losses, gradient norms,
    rewards and held-out scores, exactly."""
    from align.gateway.agents import Batcher
    from align.train import main

    batches: list[list[int]] = []
    close = Batcher.close
    monkeypatch.setattr(Batcher, "close", lambda self: batches.append(self.batches) or close(self))
    runs = []
    for extra in ([], ["--gateway-batch-ms", "1"]):
        batches.clear()
        out = tmp_path / f"run{len(runs)}"
        argv = ["--task", "agent", "--model", str(warm_model), "--out", str(out), "--steps", "2"]
        argv += ["--prompts-per-step", "4", "--group-size", "4", "--eval-prompts", "8", "--eval-interval", "2"]
        assert main(argv + extra) == 0
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in recs if "loss" in r]
        assert len(steps) == 2
        for r in steps:
            assert r["agent/errors"] == 0 and r["agent/branches_mean"] == 1 and r["unscorable"] == 0
            assert 1 <= r["agent/requests_mean"] <= multiturn.DEFAULT_MAX_TURNS
        assert [r["eval/step"] for r in recs if "eval/step" in r] == [0, 2]
        keys = ("loss", "grad_norm", "reward_mean", "num_tokens", "eval/pass@1", "eval/pass@4")
        runs.append(([{k: r[k] for k in keys if k in r} for r in recs], [list(b) for b in batches]))
    (a, batched_a), (b, batched_b) = runs
    assert batched_a != batched_b  # the windows made other batches (a draw per batch would change the tokens)
    assert a == b
