"""Eval inside align.train's loop: the step-0 baseline, snapshot contents, metric names, errors, kills and signals.

The eval backend here is a CheckpointEvalFn written by the test (the contract users implement): it records what it
was given, or hangs. The model is a tiny random one (CPU, seconds); the kill / signal tests run the real CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from helpers_train import PROMPTS, TOK, a_reward, build_char_model, records, run_cli, train_steps, wait_for

from align.eval import EvalConfig
from align.train import TrainConfig, main, train

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SIGNAL_EXIT_BOUND_S = 60.0  # SIGTERM -> exit, with the stop grace (10 s) and a checkpoint, on a loaded machine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """The char model as a base model comes from a hub: tokenizer files beside the weights (so not the shared,
    read-only ``char_model``)."""
    path = Path(build_char_model(tmp_path_factory.mktemp("tiny") / "m"))
    for name in TOKENIZER_FILES:
        (path / name).write_text(json.dumps({"file": name}))
    return str(path)


def recording_eval_fn(tmp_path: Path, body: str) -> str:
    """A CheckpointEvalFn in a file; ``body`` is the method body of evaluate_checkpoint(self, d, inp)."""
    src = tmp_path / "my_eval.py"
    src.write_text(
        textwrap.dedent(
            """
            import json, os, threading, time
            from align.eval import CheckpointEvalFn

            LOG = {log!r}

            class MyEval(CheckpointEvalFn):
                def evaluate_checkpoint(self, d, inp):
            {body}
            """
        ).format(log=str(tmp_path / "calls.jsonl"), body=textwrap.indent(textwrap.dedent(body), " " * 8))
    )
    return f"{src}:MyEval"


def test_snapshot_eval_in_train_baseline_tokenizer_and_metric_names(tmp_path, tiny_model):
    fn_path = recording_eval_fn(
        tmp_path,
        """
        with open(LOG, "a") as f:
            f.write(json.dumps({"step": inp.step, "dir": d, "files": sorted(os.listdir(d))}) + "\\n")
        return {"step": 99, "loss": 5.0, "pass@1": 0.5}
        """,
    )
    ev = EvalConfig(eval_interval=2, eval_hf_dir=str(tmp_path / "eval_hf"), eval_function_path=fn_path)
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=4, prompts_per_step=4, group_size=4, max_tokens=4,
                      checkpoint_every=0, micro_batch_size=8, save_hf=str(tmp_path / "final_hf"), eval=ev)  # fmt: skip
    train(cfg, model=tiny_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward, eval_prompts=PROMPTS[:2])
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # the baseline went through the evaluator: the CheckpointEvalFn got the base checkpoint itself as step 0
    assert [(c["step"], c["dir"]) for c in calls] == [
        (0, tiny_model), (2, str(tmp_path / "eval_hf" / "step_2")), (4, str(tmp_path / "eval_hf" / "step_4"))
    ]  # fmt: skip
    for c in calls[1:]:  # every exported snapshot carries the base model's tokenizer files
        assert set(TOKENIZER_FILES) <= set(c["files"]), c
    assert set(TOKENIZER_FILES) <= set(os.listdir(tmp_path / "final_hf"))  # and so does the --save-hf export
    evals = [r for r in records(cfg.out) if "eval/step" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]  # the function's "step": 99 cannot move a record
    for r in evals:
        assert r["eval/loss"] == 5.0 and r["eval/pass@1"] == 0.5
    train_recs = [r for r in records(cfg.out) if "reward_mean" in r]
    assert all(r["loss"] != 5.0 for r in train_recs) and all("eval/loss" not in r for r in train_recs)


def test_drain_failure_under_ci_test_does_not_hide_the_training_error(tmp_path, tiny_model):
    fn_path = recording_eval_fn(
        tmp_path,
        """
        if inp.step > 0:
            time.sleep(1.0)
            raise RuntimeError("eval backend down")
        return {"pass@1": 1.0}
        """,
    )
    ev = EvalConfig(eval_interval=1, eval_hf_dir=str(tmp_path / "eval_hf"), eval_function_path=fn_path, ci_test=True,
                    eval_max_in_flight=4)  # fmt: skip
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=3, prompts_per_step=4, group_size=4, max_tokens=4,
                      checkpoint_every=0, micro_batch_size=8, eval=ev)  # fmt: skip

    calls = {"n": 0}

    def broken(prompt, completion, **_):  # fine for step 1 (4 prompts x 4), broken from step 2 on
        calls["n"] += 1
        if calls["n"] > 16:
            raise ZeroDivisionError("the reward is broken")
        return a_reward(prompt, completion)

    with pytest.raises(RuntimeError, match="raised on every completion") as err:
        train(cfg, model=tiny_model, tokenizer=TOK, prompts=PROMPTS, reward=broken, eval_prompts=PROMPTS[:2])
    assert any("CI eval 1 skipped: crashed" in n for n in getattr(err.value, "__notes__", [])), err.value


@pytest.mark.slow
def test_baseline_is_written_once_across_kills(tmp_path, builtin_model):
    out = tmp_path / "run"
    args = ["--out", str(out), "--model", builtin_model, "--steps", "6", "--prompts-per-step", "4", "--group-size",
            "4", "--max-tokens", "6", "--checkpoint-every", "0", "--eval-interval", "3", "--eval-prompts", "8"]  # fmt: skip
    metrics = out / "metrics.jsonl"
    for _ in range(2):  # killed after a step, before any checkpoint: each rerun starts over (a rerun of a rerun too)
        before = metrics.stat().st_ino if metrics.exists() else None
        proc = run_cli(args)
        # this run's own step: the file was rewritten (atomically: a new inode) at its start, then a step appended
        wait_for(lambda b=before: metrics.exists() and metrics.stat().st_ino != b and train_steps(out) >= 1, proc)
        proc.kill()
        proc.wait()
    assert main(args) == 0  # the last rerun, in this process: only the killed runs need their own
    baselines = [r for r in records(out) if r["step"] == 0]
    assert len(baselines) == 1, baselines  # used to be one copy per kill
    assert [r["step"] for r in records(out) if "eval/step" in r] == [0, 3, 6]


@pytest.mark.slow
def test_sigterm_with_a_hung_eval_function_checkpoints_and_exits(tmp_path, builtin_model):
    fn_path = recording_eval_fn(tmp_path, "threading.Event().wait()  # a backend that never answers")
    out = tmp_path / "run"
    args = ["--out", str(out), "--model", builtin_model, "--steps", "50", "--prompts-per-step", "4", "--group-size",
            "4", "--max-tokens", "6", "--checkpoint-every", "0", "--eval-interval", "1", "--eval-prompts", "4",
            "--eval-hf-dir", str(tmp_path / "eval_hf"), "--eval-function-path", fn_path]  # fmt: skip
    proc = run_cli(args)
    # baseline and point 1 hang in flight (--eval-max-in-flight 2): step 2's point waits in backpressure
    wait_for(lambda: train_steps(out) >= 2, proc)
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        log = proc.communicate(timeout=SIGNAL_EXIT_BOUND_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("SIGTERM did not reach the checkpoint-and-exit path") from None
    assert proc.returncode == 143, log[-3000:]
    assert time.monotonic() - t0 < SIGNAL_EXIT_BOUND_S
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_2"], log[-3000:]
    skipped = {r["step"] for r in records(out) if "eval/skipped_interrupted" in r}
    assert skipped == {0, 1, 2}, records(out)  # every point the stop gave up on is attributed at its step
    shutil.rmtree(tmp_path / "eval_hf", ignore_errors=True)


def test_eval_timeout_turns_a_hung_point_into_a_skip_and_training_goes_on(tmp_path, tiny_model):
    fn_path = recording_eval_fn(
        tmp_path,
        """
        if inp.step == 2:
            time.sleep(4.5)  # hangs past --eval-timeout-s (finite, so the old code finishes and fails)
        return {"pass@1": 1.0}
        """,
    )
    ev = EvalConfig(eval_interval=2, eval_hf_dir=str(tmp_path / "eval_hf"), eval_function_path=fn_path,
                    eval_timeout_s=3.0, eval_max_in_flight=1)  # fmt: skip
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=6, prompts_per_step=4, group_size=4, max_tokens=4,
                      checkpoint_every=0, micro_batch_size=8, eval=ev)  # fmt: skip
    summary = train(cfg, model=tiny_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward, eval_prompts=PROMPTS[:2])
    assert summary["steps"] == 6
    evals = {r["step"]: r for r in records(cfg.out) if "eval/step" in r}
    assert evals[2].get("eval/skipped_timeout") == 1, evals
    # point 4 first waits for the abandoned call (never two calls at once), then runs normally
    assert [evals[s]["eval/pass@1"] for s in (0, 4, 6)] == [1.0] * 3, evals


def correct(prompt: str, completion: str, **_) -> float:
    """Correctness that depends on the prompt only, so the expected pass@1 is known: 1 of PROMPTS[:4]."""
    return float(prompt.startswith("a"))


def fmt(prompt: str, completion: str, **_) -> float:
    """A shaping reward any completion earns (e.g. a format bonus)."""
    return 0.5


def test_pass_at_k_counts_the_named_reward_not_shaping(tmp_path, tiny_model):
    def run(name: str, pass_reward: str | None) -> dict:
        cfg = TrainConfig(out=str(tmp_path / name), steps=1, prompts_per_step=4, group_size=2, max_tokens=4,
                          checkpoint_every=0, micro_batch_size=8, eval=EvalConfig(eval_interval=1, eval_n=2))  # fmt: skip
        cfg.eval.eval_pass_reward = pass_reward  # --eval-pass-reward
        train(cfg, model=tiny_model, tokenizer=TOK, prompts=PROMPTS, reward=[correct, fmt], eval_prompts=PROMPTS[:4])
        return records(tmp_path / name)[-1]

    expected = sum(correct(p["prompt"], "") for p in PROMPTS[:4]) / 4  # 0.25
    m = run("named", "correct")
    assert m["eval/pass@1"] == expected and m["eval/pass@2"] == expected
    assert m["eval/avg@2"] == pytest.approx(expected + 0.5)  # avg@n stays the mean total (weighted sum)
    # control: the weighted sum > 0 (the old rule, now --eval-pass-reward total) counts every completion
    m = run("total", "total")
    assert m["eval/pass@1"] == 1.0 and m["eval/avg@2"] == pytest.approx(expected + 0.5)
    # several rewards and no choice: refused by name before the model loads (a single reward is the default)
    with pytest.raises(ValueError, match="--eval-pass-reward NAME.*correct"):
        run("unset", None)
    with pytest.raises(ValueError, match="'nope' names no reward; choose one of correct, fmt"):
        run("unknown", "nope")
    assert not (tmp_path / "unset" / "config.json").exists()
