"""Training on tool-call episodes (``train(..., tools=[fn])``, align/envs/tools.py): the policy's completion holds a
Hermes / Qwen ``<tool_call>``, the tool runs, its result comes back as environment tokens (mask False, logprob 0)
and the episode record counts the call.

A random-weight model never writes a well-formed call, so the policy is steered by a supervised warm start (the
built-in tasks' ``align.tasks.warm.supervised``) on the two turns of one conversation: the call after the first
prompt, the answer after the tool's result. Sampling stays the real T=1 sampler: the test reads what it produced.
The chat template is a short ChatML with a tools line (the real templates' ``tools=`` renders are
tests/test_chat_templates.py's; here a short prompt keeps the warm start to seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_tokenizer import ANSWER, QUESTION, warm_tool_model

from align.envs.config import EnvConfig
from align.envs.tools import load_tools, make_tool_env, parse_tool_calls
from align.run.config import TrainConfig


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def answered_five(prompt: str, completion: str, **_) -> float:
    return float("5" in completion)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> tuple[Path, list[int], list[int], list[int]]:
    """(the warm-started model dir with its tokenizer, the first prompt's ids, the suffix ids of the tool's result
    "5", those of a wrong result "6")."""
    return warm_tool_model(tmp_path_factory, make_tool_env(load_tools(None, [add])).tools, "tool")


def test_a_tool_call_turn_trains_with_the_result_as_masked_environment_tokens(tmp_path, tool_model, monkeypatch):
    from align.envs.sampler import Episodes
    from align.train import train

    model_dir, first, suffix, wrong = tool_model
    seen: list = []  # every episode the trainer ran (a spy on the real method)
    real = Episodes.episodes
    monkeypatch.setattr(Episodes, "episodes", lambda self, *a: seen.extend(eps := real(self, *a)) or eps)
    c = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=2, max_tokens=80, lr=1e-3,
                    envs=EnvConfig(max_turns=2))  # fmt: skip
    c.eval.eval_interval, c.log.log_completions_every = 0, 1
    train(c, model=str(model_dir), prompts=[{"prompt": QUESTION}] * 4, tools=[add], reward=answered_five)

    called = [e for e in seen if e.tool_calls]
    assert called, [e.messages for e in seen]
    for e in called:
        assert e.prompt_ids == first
        call_msg, tool_msg = e.messages[1], e.messages[2]
        assert parse_tool_calls(call_msg["content"]) == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
        assert tool_msg == {"role": "tool", "name": "add", "content": "5"} and e.tool_errors == 0
        n = e.turns[0]["policy_tokens"]
        env = slice(n, n + len(suffix))  # the tool's result, right after the call's stop token
        assert e.token_ids[env] == suffix and e.turns[0]["env_tokens"] == len(suffix)
        assert e.token_ids[env] != wrong  # negative control: another result is other tokens
        assert e.mask[env] == [False] * len(suffix) and e.logprobs[env] == [0.0] * len(suffix)
        assert all(e.mask[:n]) and all(e.mask[env.stop :]) and sum(e.mask) == e.policy_tokens
        assert len(e.turns) == 2 and e.mask.count(False) == len(suffix)
    assert all(e.mask == [True] * len(e.token_ids) for e in seen if not e.tool_calls)  # no call: no env tokens

    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 2 and sum(r["env/tool_calls_mean"] for r in steps) > 0
    assert sum(r["env/tool_calls_mean"] for r in steps) * 4 == len(called)  # 4 episodes a step, one call each
    logged = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    episodes = [ep for rec in logged for ep in rec["episodes"]]
    assert sum(ep["tool_calls"] for ep in episodes) == len(called)
    assert all(ep["tool_errors"] == 0 for ep in episodes)
    assert any(ep["messages"][-1] == {"role": "assistant", "content": ANSWER} for ep in episodes)
