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
import shutil
import types
from pathlib import Path

import pytest
from helpers_tokenizer import ANSWER, CALL, QUESTION, TEMPLATE, make_bpe_tokenizer

from align.chat import TurnRenderer
from align.data import load_tokenizer
from align.envs.config import EnvConfig
from align.envs.tools import load_tools, make_tool_env, parse_tool_calls
from align.model import ModelConfig
from align.run.config import TrainConfig

WARM_STEPS = 150  # the two targets memorised (loss ~1e-3 per token): most T=1 samples are the call, then the answer


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
    from align.tasks.warm import supervised

    tok_dir = make_bpe_tokenizer(tmp_path_factory.mktemp("tok"))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    tok = load_tokenizer(str(tok_dir), str(tok_dir))
    stop = tok.encode("<|im_end|>")
    renderer = TurnRenderer(tok, tools=make_tool_env(load_tools(None, [add])).tools)
    first = renderer.first([{"role": "user", "content": QUESTION}])
    call, answer = tok.encode(CALL) + stop, tok.encode(ANSWER) + stop
    suffix, wrong = (renderer.suffix([{"role": "tool", "name": "add", "content": r}]) for r in ("5", "6"))

    def example(prompt: list[int], target: list[int]) -> tuple[list[int], list[int]]:
        return prompt + target, [-100] * (len(prompt) - 1) + target + [-100]

    batch = [example(first, call), example(first + call + suffix, answer)]
    cfg = ModelConfig(model_type="qwen2", vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True,
                      max_position_embeddings=256, eos_token_id=stop[0], pad_token_id=0)  # fmt: skip
    with_tokenizer = types.SimpleNamespace(save=lambda p: shutil.copytree(tok_dir, p, dirs_exist_ok=True))
    path = supervised(tmp_path_factory.mktemp("tool") / "m", with_tokenizer, cfg, lambda rng: batch,
                      steps=WARM_STEPS, lr=1e-2, seed=0, log=None)  # fmt: skip
    return path, first, suffix, wrong


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
