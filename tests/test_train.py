"""The training loop end to end: learning, run files, exact resume after kill -9, SIGTERM, bad input."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from helpers_train import PROMPTS, TOK, a_reward, cfg_for, cli_args, comparable, records, run_cli, wait_for_steps

from align.model import load_pretrained
from align.train import TrainConfig, main, train


def test_python_api_learns_and_leaves_run_files(tmp_path, char_model):
    cfg = cfg_for(tmp_path / "run", steps=12, checkpoint_every=5, keep_checkpoints=2)
    cfg.eval.eval_interval = 6
    summary = train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward, eval_prompts=PROMPTS[:4])
    recs = [r for r in records(tmp_path / "run") if "reward_mean" in r]
    assert [r["step"] for r in recs] == list(range(1, 13))
    first, last = sum(r["reward_mean"] for r in recs[:3]) / 3, sum(r["reward_mean"] for r in recs[-3:]) / 3
    assert last > first + 0.2, (first, last)  # 'a' starts at ~1/8 per position under a random init
    for k in ("loss", "entropy", "clip_low_frac", "mismatch_abs_mean", "completion_len_mean", "tokens_per_s", "lr"):
        assert k in recs[-1], k
    evals = [r for r in records(tmp_path / "run") if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 6, 12]
    assert summary["eval_start"] == evals[0]["eval/pass@1"] and summary["steps"] == 12
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["steps"] == 12
    assert (run / "plot.svg").read_text().startswith("<svg") and "reward_mean" in (run / "plot.svg").read_text()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_10", "step_12"]  # keep-last-2 of 5, 10, 12
    load_pretrained(run / "checkpoints" / "step_12" / "model", require_marker=True)


def test_micro_batch_size_does_not_change_the_gradient(char_model):
    from align.learner import backward_batch, sequence_batch
    from align.rollout.native import generate
    from align.rollout.protocol import SamplingParams

    policy = load_pretrained(char_model)
    prompts = [TOK.encode(p["prompt"]) for p in PROMPTS]
    comps = generate(policy, prompts, SamplingParams(n=3, max_tokens=4, seed=0, stop_token_ids=[TOK.eos_token_id]))
    inputs, targets, mask, _full_lp, sampled_lp = sequence_batch(prompts, comps, 3, "cpu")
    adv = torch.randn(len(comps), generator=torch.Generator().manual_seed(0))
    mask[2] = False  # an all-masked row inside some micro-batch

    def grads(mb, **loss_kw):
        cfg = cfg_for("unused", micro_batch_size=mb)
        for k, v in loss_kw.items():
            setattr(cfg.loss, k, v)
        policy.zero_grad(set_to_none=True)
        backward_batch(policy, None, cfg, inputs, targets, mask, adv, sampled_lp)
        return {k: p.grad.clone() for k, p in policy.named_parameters()}

    for loss in ("token_mean", "seq_mean_token_mean", "gspo"):
        whole = grads(len(comps), name=loss)
        for mb in (1, 5, 7):
            split = grads(mb, name=loss)
            for k in whole:
                torch.testing.assert_close(split[k], whole[k], atol=1e-7, rtol=1e-5)
    # negative control: a micro-batch-local normaliser (the common bug) gives a different gradient
    real = backward_batch
    whole = grads(len(comps), name="token_mean")
    local = {k: torch.zeros_like(v) for k, v in whole.items()}
    for s in range(0, len(comps), 5):
        sl = slice(s, s + 5)
        policy.zero_grad(set_to_none=True)
        real(
            policy,
            None,
            cfg_for("unused", micro_batch_size=5),
            inputs[sl],
            targets[sl],
            mask[sl],
            adv[sl],
            sampled_lp[sl],
        )
        for k, p in policy.named_parameters():
            local[k] += p.grad if p.grad is not None else 0
    assert max((local[k] - whole[k]).abs().max() for k in whole) > 1e-5


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, builtin_model) -> Path:
    out = tmp_path_factory.mktemp("full")
    assert main(cli_args(out, builtin_model)) == 0  # in this process: only the killed and signalled runs need their own
    return out


def test_kill_9_then_rerun_resumes_exactly(tmp_path, builtin_model, uninterrupted, capsys):
    out = tmp_path / "killed"
    proc = run_cli(cli_args(out, builtin_model))
    wait_for_steps(out, 5, proc)  # checkpoints exist at 2 and 4; step 5 or 6 may be mid-write
    proc.kill()
    proc.wait()
    assert main(cli_args(out, builtin_model)) == 0  # the rerun, in this process
    assert "resuming from" in capsys.readouterr().out
    assert comparable(out) == comparable(uninterrupted)
    # negative control: a different seed gives a different log, so the equality above is not vacuous
    other = tmp_path / "seed1"
    assert main(cli_args(other, builtin_model) + ["--seed", "1", "--steps", "2"]) == 0
    assert comparable(other)[1] != comparable(uninterrupted)[1]


ASYNC_TIMINGS = {"async/trainer_wait_s", "async/generator_idle_s", "async/inflight"}  # wall-clock, never compared


def test_kill_9_of_an_episode_run_then_rerun_logs_the_uninterrupted_run(tmp_path, builtin_model, capsys):
    """--env (tests/fixtures/turn_envs.py:Feedback, a second turn after a wrong answer) with --max-async-steps 1:
    kill -9 after step 3 of 10 (checkpoint 2 holds step 3's pending batch of episodes), rerun: the same metrics as the
    uninterrupted run, episodes with environment turns included."""
    from align.tasks import reverse

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in reverse.prompts(64, "train")))
    env = str(Path(__file__).parent / "fixtures" / "turn_envs.py") + ":Feedback"

    def args(out: Path, *extra: str) -> list[str]:
        return [*cli_args(out, builtin_model), "--train-data", str(rows), "--env", env, "--max-turns", "2",
                "--steps", "10", "--prompts-per-step", "4", "--eval-interval", "0", "--max-async-steps", "1", *extra]  # fmt: skip

    def logged(out: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in ASYNC_TIMINGS} for r in comparable(out)]

    straight = tmp_path / "straight"
    assert main(args(straight)) == 0  # in this process: only the killed run needs one of its own
    out = tmp_path / "killed"
    proc = run_cli(args(out))
    wait_for_steps(out, 3, proc)  # steps take ~0.1 s here: 7 more leave the poll ample time to kill mid-run
    proc.kill()
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    capsys.readouterr()
    assert main(args(out)) == 0  # the rerun, in this process
    assert "resuming from" in capsys.readouterr().out
    steps = [r for r in logged(straight) if "loss" in r]
    assert len(steps) == 10 and any(r["env/env_tokens_mean"] > 0 for r in steps)  # episodes had environment turns
    assert logged(out) == logged(straight)
    # negative control: another seed logs something else, so the equality above is not vacuous
    other = tmp_path / "seed1"
    assert main(args(other, "--seed", "1", "--steps", "1")) == 0
    assert logged(other)[0] != logged(straight)[0]


def test_signal_checkpoints_and_exits(tmp_path, builtin_model, uninterrupted):
    """SIGTERM (exit 143), then SIGINT to the resumed run (exit 130): each time the interrupted step finishes and is
    checkpointed (the only checkpoints: --checkpoint-every 0); the last rerun ends with the uninterrupted log."""
    out = tmp_path / "sig"
    done: list[int] = []  # the checkpointed steps so far
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        proc = run_cli(cli_args(out, builtin_model) + ["--checkpoint-every", "0"])
        wait_for_steps(out, (done[-1] if done else 2) + 1, proc)  # a step of this run
        proc.send_signal(sig)
        log = proc.communicate(timeout=300)[0]
        assert proc.returncode == code, log[-3000:]
        steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir())
        assert steps[:-1] == done and (done[-1] if done else 2) < steps[-1] < 8, (steps, done)  # one more: this stop's
        done = steps
    assert main(cli_args(out, builtin_model)) == 0  # the last rerun, in this process
    assert comparable(out) == comparable(uninterrupted)


def test_config_reload_with_override(tmp_path, char_model):
    out = tmp_path / "a"
    train(cfg_for(out, steps=1), model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    from align.run.cli import parse
    from align.train import CLI_PREFIXES

    cfg = parse(TrainConfig, ["--config", str(out / "config.json"), "--lr", "0.5", "--eps-high", "0.28"], CLI_PREFIXES)
    assert cfg.lr == 0.5 and cfg.loss.eps_high == 0.28 and cfg.steps == 1 and cfg.prompts_per_step == 4


def test_help_lists_every_flag_with_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--eval-hf-dir",
        "--eval-max-in-flight",
        "--eval-overflow-policy",
        "--ci-test",
        "--loss",
        "--eps-low",
        "--use-rho-correction",
        "--adv-scale",
        "--micro-batch-size",
        "--rollout",
        "--config",
    ):
        assert flag in text, flag
    from align.run.fields import _flags
    from align.train import CLI_PREFIXES

    missing = [flag for flag, _, f, _ in _flags(TrainConfig, CLI_PREFIXES) if not f.metadata.get("help")]
    assert missing == []


def test_bad_input(tmp_path, char_model, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--no-such-flag"])
    assert e.value.code == 2 and "unknown flag --no-such-flag" in capsys.readouterr().err  # one line (test_cli_help)
    with pytest.raises(SystemExit):
        main(["--rollout", "carrier-pigeon"])
    assert "rollout must be one of" in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not exist"):
        train(cfg_for(tmp_path / "x"), model=str(tmp_path / "nope"), tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    with pytest.raises(ValueError, match="does not fit the model's context"):
        train(cfg_for(tmp_path / "y", max_tokens=30), model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)


def test_checkpoint_shape_mismatch_is_named(tmp_path, char_model):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(char_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match its config.json"):
        train(cfg_for(tmp_path / "z"), model=str(bad), tokenizer=TOK, prompts=PROMPTS, reward=a_reward)


def test_reward_errors_are_counted_and_all_failing_stops(tmp_path, char_model):
    calls = {"n": 0}

    def flaky(prompt, completion, **_):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise KeyError("boom")
        return a_reward(prompt, completion)

    train(cfg_for(tmp_path / "f", steps=2), model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=flaky)
    recs = records(tmp_path / "f")
    assert all(r["reward_errors"] > 0 and r["unscorable"] == r["reward_errors"] for r in recs)
    assert all(math.isfinite(r["loss"]) for r in recs)

    def broken(prompt, completion, **_):
        raise ZeroDivisionError("always")

    with pytest.raises(RuntimeError, match="(?s)raised on every completion.*ZeroDivisionError: always"):
        train(cfg_for(tmp_path / "g", steps=2), model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=broken)
