"""Training on your own data from the Python API and the CLI: JSONL in, a BPE tokenizer with a chat template,
rewards from a file (one times out, one raises), completions.jsonl, exact resume."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from helpers_train import PROMPTS, TOK, a_reward, cfg_for, records

from align.train import TrainConfig, train


def test_python_api_without_eval_prompts_trains_under_the_default_eval_interval(tmp_path, char_model):
    # The module docstring's example: no eval_prompts, the default eval config (eval_interval=10).
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=2, max_tokens=3)
    assert cfg.eval.eval_interval > 0
    summary = train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS[:4], reward=a_reward)
    assert summary["steps"] == 2 and summary["eval_start"] is None
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]


# ------------------------------------------------------------------------------------------------ CLI end to end

REWARDS_PY = textwrap.dedent("""
    import time

    def graded(prompt, completion, answer, mode="ok", **fields):
        if mode == "hang":
            time.sleep(60)  # cut off by --reward-timeout-s: unscorable, counted, the run goes on
        if mode == "raise":
            raise ValueError("this row's reward always raises")
        return len(completion) % 3 / 2

    def short(prompt, completion, **fields):
        return float(len(completion) < 12)
""")
ROWS = [
    {"messages": [{"role": "user", "content": "What is 12 + 30?"}], "answer": "42"},
    {"prompt": "Reverse the word abcd:", "answer": "dcba"},
    {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count banana."}],
        "answer": "6",
        "mode": "hang",
    },
    {"prompt": "The capital of France is", "answer": "Paris", "mode": "raise"},
    {"messages": [{"role": "user", "content": "Think step by step."}], "answer": "ok"},
    {"prompt": "Hello, world!", "answer": "hi"},
]
TIMING = (
    "tokens_per_s",
    "rollout_time",
    "sync_time",
    "step_time",
    "eval/duration_seconds",
    "eval/train_blocked_seconds",
)


@pytest.fixture(scope="module")
def bpe_run_inputs(tmp_path_factory):
    from helpers_models import make_tiny_qwen2
    from helpers_tokenizer import make_bpe_tokenizer

    d = tmp_path_factory.mktemp("bpe")
    model = make_tiny_qwen2(d / "model", max_position_embeddings=128)
    make_bpe_tokenizer(model, template="qwen2.5")  # tokenizer.json + chat template beside the weights
    train_file = d / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    eval_file = d / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in (ROWS[0], ROWS[1])))
    rewards = d / "rewards.py"
    rewards.write_text(REWARDS_PY)
    return {"model": str(model), "train": str(train_file), "eval": str(eval_file), "rewards": str(rewards)}


def cli(inp, out, steps) -> list[str]:
    return [
        "--out",
        str(out),
        "--model",
        inp["model"],
        "--train-data",
        inp["train"],
        "--eval-data",
        inp["eval"],
        "--reward",
        inp["rewards"] + ":graded",
        "--reward",
        inp["rewards"] + ":short",
        "--reward-weights",
        "1",
        "0.5",
        "--eval-pass-reward",
        "graded",
        "--reward-workers",
        "2",
        "--reward-timeout-s",
        "1",
        "--steps",
        str(steps),
        "--prompts-per-step",
        "3",
        "--group-size",
        "2",
        "--max-tokens",
        "6",
        "--checkpoint-every",
        "2",
        "--eval-interval",
        "2",
        "--eval-n",
        "1",
        "--log-completions-every",
        "1",
        "--log-completions-groups",
        "2",
        "--lr",
        "1e-3",
    ]


def comparable(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in path.read_text().splitlines()]


def test_cli_trains_your_data_with_bpe_chat_template_file_rewards_and_resumes_exactly(tmp_path, bpe_run_inputs):
    from align.train import main

    inp = bpe_run_inputs
    full = tmp_path / "full"
    assert main([*cli(inp, full, 4), "--save-hf", str(tmp_path / "final")]) == 0
    recs = [r for r in records(full) if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert sum(r["reward_timeouts"] for r in recs) > 0 and sum(r["reward_errors"] for r in recs) > 0
    # one call per completion fails (graded's 'hang' / 'raise' rows; short never fails): that completion is unscorable
    assert all(r["unscorable"] == r["reward_timeouts"] + r["reward_errors"] for r in recs), recs
    assert all("reward/graded_mean" in r and "reward/short_mean" in r for r in recs)
    assert [r["step"] for r in records(full) if "eval/pass@1" in r] == [0, 2, 4]
    # completions.jsonl: 2 groups per step, readable
    samples = [json.loads(line) for line in (full / "completions.jsonl").read_text().splitlines()]
    assert [(s["step"], s["group"]) for s in samples] == [(st, g) for st in (1, 2, 3, 4) for g in (0, 1)]
    for s in samples:
        assert len(s["completions"]) == len(s["rewards"]) == len(s["advantages"]) == len(s["lengths"]) == 2
        assert set(s["reward_terms"]) == {"graded", "short"} and all(isinstance(c, str) for c in s["completions"])
    chat = [s for s in samples if s["prompt"].startswith("<|im_start|>")]
    assert chat and all(s["prompt"].endswith("<|im_start|>assistant\n") for s in chat)
    assert any(r is None for s in samples for r in s["rewards"])  # unscorable rows are visible as null
    # the trained checkpoint carries the tokenizer and template: it is the next run's --model
    final = tmp_path / "final"
    assert (final / "tokenizer.json").is_file() and (final / "tokenizer_config.json").is_file()
    # resume: stop at step 2, rerun to 4 -> the same metrics and samples as the uninterrupted run
    part = tmp_path / "part"
    assert main(cli(inp, part, 2)) == 0
    assert main(cli(inp, part, 4)) == 0
    assert comparable(part / "metrics.jsonl") == comparable(full / "metrics.jsonl")
    assert comparable(part / "completions.jsonl") == comparable(full / "completions.jsonl")
    # negative control: another seed changes the samples
    other = tmp_path / "seed1"
    assert main([*cli(inp, other, 1), "--seed", "1", "--eval-interval", "0"]) == 0
    assert comparable(other / "completions.jsonl")[0] != comparable(full / "completions.jsonl")[0]


def test_bad_input_is_one_message_before_the_model_loads(tmp_path, bpe_run_inputs, capsys, monkeypatch):
    import align.model
    from align.train import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(align.model, "load_pretrained", no_load)
    inp = bpe_run_inputs
    base = ["--out", str(tmp_path / "o"), "--model", inp["model"], "--max-tokens", "10"]  # the tiny model's context
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{"prompt": \n')
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    cases = [
        ([], "is not a model of the built-in 'reverse' task .* pass --train-data FILE.jsonl and --reward"),
        (
            ["--train-data", str(tmp_path / "missing.jsonl"), "--reward", "align.rewards:exact_match"],
            "--train-data .*missing.jsonl: no such file",
        ),
        (["--train-data", str(bad_json), "--reward", "align.rewards:exact_match"], "bad.jsonl:2: not valid JSON"),
        (["--train-data", inp["train"]], "pass prompts, tokenizer and reward together"),
        (["--train-data", inp["train"], "--reward", "nope_module_xyz:f"], "no module 'nope_module_xyz'"),
        (["--train-data", inp["train"], "--reward", inp["rewards"] + ":missing"], "has no attribute 'missing'"),
        (
            ["--train-data", inp["train"], "--reward", "align.rewards:exact_match", "--tokenizer", str(no_tok)],
            "--tokenizer .*no_tok: no tokenizer.json",
        ),
        (
            ["--train-data", inp["train"], "--reward", "align.rewards:exact_match", "--max-tokens", "120"],
            "train.jsonl:1: the prompt is \\d+ tokens; with --max-tokens 120 it does not fit",
        ),
        (
            ["--train-data", inp["train"], "--eval-data", inp["eval"], "--reward", inp["rewards"] + ":graded"]
            + ["--reward", inp["rewards"] + ":short"],
            "2 rewards are configured \\(graded, short\\): .* --eval-pass-reward NAME",
        ),
    ]
    import re

    for args, pattern in cases:
        assert main(base + args) == 2, args
        err = capsys.readouterr().err
        assert re.search(pattern, err), (args, err)
    with pytest.raises(SystemExit) as e:  # flag-level validation is argparse's one-line error
        main([*base, "--train-data", inp["train"], "--reward", "a:b", "--reward", "c:d", "--reward-weights", "1"])
    assert e.value.code == 2 and "--reward-weights has 1 value(s) for 2" in capsys.readouterr().err


def test_adv_refill_fills_the_step_with_groups_that_have_signal(tmp_path, char_model):
    def reward(prompt, completion, kind, **_):
        return completion.count("a") / 4 if kind == "var" else 0.0  # 'flat' prompts never teach anything

    prompts = [
        {"prompt": w + "=", "kind": "flat" if i % 2 else "var"}
        for i, w in enumerate(("ab", "cd", "bca", "dd", "abc", "cab", "dab", "bb"))
    ]

    def run(out, refill):
        # TrainConfig's own lr, not the small runs' 1e-2: the policy barely moves, so every step has var groups to find
        cfg = cfg_for(out, steps=3, prompts_per_step=2, lr=TrainConfig.lr, adv_refill=refill, max_refill_rounds=4)
        cfg.log.log_completions_every = 1
        train(cfg, model=char_model, tokenizer=TOK, prompts=prompts, reward=reward)
        samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        return records(out), samples

    recs, samples = run(tmp_path / "refill", True)
    assert all(r["signal_groups"] == 2 and 0 <= r["refill_rounds"] <= 4 for r in recs)
    assert sum(r["refill_prompts"] for r in recs) > 0
    assert all(len(set(s["rewards"])) > 1 for s in samples)
    # negative control: without refill the flat prompts take up slots in the batch
    recs, samples = run(tmp_path / "plain", False)
    assert "refill_rounds" not in recs[0]
    assert any(len(set(s["rewards"])) == 1 for s in samples)


def test_readme_worked_example_runs(tmp_path, monkeypatch):
    # README "Your own data, rewards and tokenizer": make_tiny.py, then the CLI on examples/own_data (2 steps)
    import importlib.util

    from align.data import HFTokenizer
    from align.model import load_pretrained
    from align.train import main

    ex = Path(__file__).resolve().parents[1] / "examples" / "own_data"
    spec = importlib.util.spec_from_file_location("make_tiny", ex / "make_tiny.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    make_tiny.main(str(tmp_path / "tiny_model"))
    args = [
        "--model",
        str(tmp_path / "tiny_model"),
        "--out",
        str(tmp_path / "own"),
        "--train-data",
        str(ex / "train.jsonl"),
        "--eval-data",
        str(ex / "eval.jsonl"),
        "--reward",
        f"{ex / 'rewards.py'}:answer_match",
        "--reward",
        f"{ex / 'rewards.py'}:short",
        "--reward-weights",
        "1",
        "0.5",
        "--eval-pass-reward",
        "answer_match",
        "--reward-workers",
        "2",
        "--reward-timeout-s",
        "10",
        "--steps",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-tokens",
        "12",
        "--lr",
        "3e-3",
        "--eval-interval",
        "0",
        "--log-completions-every",
        "1",
        "--save-hf",
        str(tmp_path / "own-final"),
    ]
    assert main(args) == 0
    final = tmp_path / "own-final"
    load_pretrained(final)
    assert HFTokenizer(final).render_chat([{"role": "user", "content": "1 + 1?"}]).endswith("assistant\n")
    rec = records(tmp_path / "own")[-1]
    assert rec["step"] == 2 and {"reward/answer_match_mean", "reward/short_mean"} <= set(rec)
