"""TRL-shaped code carries over: batch rewards ``fn(prompts, completions, **kwargs) -> list``, conversational
prompts and completions, ``completion_ids``, ``async def`` rewards and tools awaited under the same timeouts, chat
rows in the Python API, and ``--tools`` + ``--reward`` on a ``messages`` column."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from align.rewards import RewardFn, RewardScorer, check_signature

ITEMS = [({"prompt": "2+2=", "answer": "4"}, "4"), ({"prompt": "2+3=", "answer": "5"}, "6")]
CHAT = [{"role": "user", "content": "2+2?"}]


def scorer(*fns, timeout_s: float = 5.0, workers: int = 1) -> RewardScorer:
    return RewardScorer([RewardFn(f.__name__, f, None) for f in fns], timeout_s=timeout_s, workers=workers)


def test_a_batch_reward_is_called_once_with_lists():
    calls = []

    def batch(prompts, completions, answer, **kwargs):
        calls.append((prompts, completions, answer, kwargs))
        return [float(c == a) for c, a in zip(completions, answer)]

    s = scorer(batch).score(ITEMS, ids=[[1, 2], [3]])
    assert s.totals == [1.0, 0.0]
    assert calls == [(["2+2=", "2+3="], ["4", "6"], ["4", "5"], {"completion_ids": [[1, 2], [3]]})]


def test_a_per_item_reward_is_not_batched():  # negative control for the detection: the classic shape, called per item
    calls = []

    def per_item(prompt, completion, answer, **_):
        calls.append(prompt)
        return float(completion == answer)

    assert scorer(per_item).score(ITEMS).totals == [1.0, 0.0] and calls == ["2+2=", "2+3="]


def test_a_chat_record_gives_message_lists():
    from align.reward_calls import CHAT_KEY

    got = {}

    def batch(prompts, completions, **kwargs):
        got.update(prompts=prompts, completions=completions, kwargs=kwargs)
        return [1.0] * len(prompts)

    rec = {"prompt": "<rendered>", "answer": "4", CHAT_KEY: CHAT}
    s = scorer(batch).score([(rec, "4"), (ITEMS[0][0], "5")])
    assert s.totals == [1.0, 1.0]
    assert got["prompts"] == [CHAT, "2+2="]
    assert got["completions"] == [[{"role": "assistant", "content": "4"}], "5"]
    assert got["kwargs"] == {"answer": ["4", "4"]}  # the hidden chat copy is no column


def test_the_hidden_chat_copy_never_reaches_a_per_item_reward():
    from align.reward_calls import CHAT_KEY

    def strict(prompt, completion, answer):  # no **fields: an extra key would raise
        return 1.0

    rec = {"prompt": "<rendered>", "answer": "4", CHAT_KEY: CHAT}
    check_signature("strict", strict, ["answer"])
    assert scorer(strict).score([(rec, "x")]).totals == [1.0]


@pytest.mark.parametrize("bad", [[1.0], [1.0, 2.0, 3.0], 1.0, None])
def test_a_batch_result_of_the_wrong_shape_makes_the_batch_unscorable(bad):
    def batch(prompts, completions, **kwargs):
        return bad

    s = scorer(batch).score(ITEMS)
    assert all(math.isnan(t) for t in s.totals) and s.failed == 2 and len(s.errors) == 2
    assert "per completion" in s.errors[0]


def test_none_in_a_batch_result_abstains():
    def batch(prompts, completions, **kwargs):
        return [None, 0.5]

    def other(prompt, completion, **_):
        return 1.0

    s = scorer(batch, other).score(ITEMS)
    assert s.totals == [1.0, 1.5] and s.failed == 0


def test_an_async_reward_is_awaited():
    async def areward(prompt, completion, answer, **_):
        await asyncio.sleep(0)
        return float(completion == answer)

    async def abatch(prompts, completions, **kwargs):
        return [2.0] * len(prompts)

    s = scorer(areward, abatch).score(ITEMS)
    assert s.totals == [3.0, 2.0] and s.errors == []


def test_an_async_reward_that_never_finishes_times_out_and_is_counted():
    async def hangs(prompt, completion, **_):
        await asyncio.Event().wait()

    s = scorer(hangs, timeout_s=0.3).score(ITEMS[:1])
    assert math.isnan(s.totals[0]) and s.timeouts == 1 and s.failed == 1


def test_an_async_reward_in_worker_processes_is_awaited(tmp_path):
    f = tmp_path / "arew.py"
    f.write_text(
        "import asyncio\n\nasync def r(prompt, completion, **_):\n    await asyncio.sleep(0)\n    return 2.0\n"
    )
    from align.rewards import load_rewards

    sc = RewardScorer(load_rewards([f"{f}:r"]), workers=2, timeout_s=30)
    try:
        s = sc.score(ITEMS)
    finally:
        sc.close()
    assert s.totals == [2.0, 2.0] and s.errors == []


def test_a_batch_reward_needing_a_missing_column_is_refused_at_load():
    from align.errors import InputError

    def batch(prompts, completions, solution):
        return []

    with pytest.raises(InputError, match="batch signature.*solution"):
        check_signature("batch", batch, ["answer"])
    check_signature("batch", batch, ["answer", "solution"])  # negative control: the column is there


def test_trls_quickstart_reward_shape_is_batched():
    # TRL's quickstart: def reward_len(completions, **kwargs) -> [-abs(20 - len(c)) for c in completions]
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    s = scorer(reward_len).score(ITEMS, ids=[[1], [2]])
    assert s.totals == [-19.0, -19.0] and s.errors == []


def test_an_async_tool_returns_its_value():
    from align.envs.tools import load_tools, make_tool_env

    async def mul(a: int, b: int) -> int:
        """Multiply.

        Args:
            a: first
            b: second
        """
        await asyncio.sleep(0)
        return a * b

    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: first
            b: second
        """
        return a + b

    env_cls = make_tool_env(load_tools(fns=[mul, add]), timeout_s=5)
    from align.envs.tools import _call_in_thread

    assert _call_in_thread(mul, {"a": 6, "b": 7}, 5) == 42
    assert _call_in_thread(add, {"a": 6, "b": 7}, 5) == 13  # negative control: a plain tool
    assert env_cls is not None


def test_an_async_tool_past_its_timeout_is_abandoned():
    from align.envs.tools import _Abandoned, _call_in_thread

    async def hangs() -> int:
        await asyncio.Event().wait()
        return 1

    with pytest.raises((_Abandoned, TimeoutError)):
        _call_in_thread(hangs, {}, 0.3)


# ------------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from helpers_models import make_tiny_qwen2
    from helpers_tokenizer import make_bpe_tokenizer

    d = tmp_path_factory.mktemp("trl")
    model = make_tiny_qwen2(d / "model", max_position_embeddings=1024)
    make_bpe_tokenizer(model, template="qwen2.5")
    return str(model)


ROWS = [{"messages": [{"role": "user", "content": f"What is {a} + 1?"}], "answer": str(a + 1)} for a in range(4)]


def test_python_train_takes_chat_rows_and_a_trl_reward(tmp_path, chat_model):
    from helpers_train import cfg_for

    from align.data import load_tokenizer
    from align.train import train

    seen = []

    def trl_reward(prompts, completions, answer, completion_ids, **kwargs):
        seen.append((prompts[0], completions[0], len(completion_ids)))
        return [float(len(c[0]["content"]) % 2) for c in completions]

    cfg = cfg_for(tmp_path / "run", steps=1, prompts_per_step=2, group_size=2, max_tokens=4)
    train(cfg, model=chat_model, tokenizer=load_tokenizer(chat_model), prompts=ROWS, reward=trl_reward)
    prompt, completion, n = seen[0]
    assert prompt in [r["messages"] for r in ROWS] and completion[0]["role"] == "assistant" and n == 4


def test_tools_with_a_reward_on_a_messages_column(tmp_path, chat_model):
    # was: KeyError 'prompt' at step 1 (the environment's rows keep their 'messages' column)
    from align.train import main

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tools = tmp_path / "tools.py"
    tools.write_text(
        'def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: x\n        b: y\n    """\n    return a + b\n'
    )
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def got_messages(prompt, completion, answer, **_):\n"
        "    assert isinstance(prompt, list) and prompt[0]['role'] == 'user'\n"
        "    return 1.0\n"
    )
    argv = ["--model", chat_model, "--out", str(tmp_path / "run"), "--train-data", str(data)]
    argv += ["--tools", f"{tools}:add", "--reward", f"{rewards}:got_messages", "--steps", "1"]
    argv += ["--prompts-per-step", "2", "--group-size", "2", "--max-tokens", "4", "--eval-interval", "0"]
    assert main(argv) == 0
    rec = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rec if "reward_mean" in r)
    assert step.get("reward_errors", 0) == 0 and step["reward/got_messages_mean"] == 1.0, step


def test_epochs_set_the_steps_from_the_data(tmp_path, chat_model, capsys):
    from helpers_train import cfg_for, train_steps

    from align.data import load_tokenizer
    from align.train import train

    def reward(prompts, completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]

    cfg = cfg_for(tmp_path / "run", steps=50, prompts_per_step=3, group_size=2, max_tokens=2, epochs=1.5)
    train(cfg, model=chat_model, tokenizer=load_tokenizer(chat_model), prompts=ROWS, reward=reward)
    assert train_steps(tmp_path / "run") == 2  # ceil(1.5 x 4 rows / 3 per step), not --steps 50
    assert "--epochs 1.5: 4 prompts / --prompts-per-step 3 -> --steps 2 (was 50)" in capsys.readouterr().out


THINKING = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_every_render():
    pytest.importorskip("jinja2")
    from align.chat import ChatTemplate
    from align.data import to_record, with_template_kwargs
    from align.run.cli import parse
    from align.train import CLI_PREFIXES, TrainConfig

    cfg = parse(TrainConfig, ["--chat-template-kwargs", '{"enable_thinking": false}'], CLI_PREFIXES)
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}

    class Tok:
        chat_template = ChatTemplate(THINKING)

    row = {"messages": [{"role": "user", "content": "hi"}]}
    plain = to_record(dict(row), "r:1", "prompt", Tok.chat_template)["prompt"]
    template = with_template_kwargs(Tok, cfg.data.chat_template_kwargs)
    off = to_record(dict(row), "r:1", "prompt", template)["prompt"]
    assert plain == "<user>hi<assistant>" and off == "<user>hi<assistant><think></think>"  # plain: negative control
    assert template.render(row["messages"], enable_thinking=True) == "<user>hi<assistant>"  # a render's own wins
