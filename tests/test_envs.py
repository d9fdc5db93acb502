"""Multi-turn episodes (align.envs.episodes, align.rollout.sessions, align.envs.sampler): the kept KV cache gives the
teacher-forced logprobs of the whole conversation; environment tokens are context in the loss (a loop reference
written here, gradients included, with a negative control that counts them); budgets, failures and the training
loop on the real environment runner (in process and in a worker process)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from helpers_learner import CPU, PARAMS, cfg, rev_model, tiny

from align import learner
from align.char_tokenizer import CharTokenizer
from align.chat import TurnRenderer
from align.data import InputError
from align.envs.config import EnvConfig
from align.envs.episodes import EpisodeRunner, env_stats, episode_scores
from align.envs.runner import EnvRunner
from align.rollout.client import NativeClient
from align.rollout.protocol import SamplingParams
from align.rollout.sessions import Session
from align.tasks import reverse

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import turn_envs


def teacher_forced(model, ids: list[int], k: int) -> list[float]:
    """log p of the last ``k`` tokens of ``ids`` from one full forward (the reference)."""
    with torch.no_grad():
        lp = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    n = len(ids)
    return [lp[n - k - 1 + i, ids[n - k + i]].item() for i in range(k)]


def test_kept_cache_turns_carry_the_teacher_forced_logprobs_of_the_whole_conversation():
    model = tiny(False, vocab=50).eval()
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, stop_token_ids=[7])
    s = Session(model, params)
    prompts = [[1, 2, 3], [4, 5, 6, 8, 9]]
    t1 = s.start(prompts, 2, [6, 6, 6, 6])
    history = {r: prompts[r // 2] + t1[r].token_ids for r in range(4)}
    for r in range(4):
        assert t1[r].logprobs == pytest.approx(teacher_forced(model, history[r], len(t1[r].token_ids)), abs=1e-5)
    # turn 2 for three rows (row 1 is done), suffixes of different lengths; turn 3 for two rows
    for rows, suffixes, budgets in (([0, 2, 3], [[10, 11], [12], [13, 14, 15]], [5, 4, 6]), ([3, 0], [[16], [17, 18]], [3, 4])):  # fmt: skip
        turns = s.next(rows, suffixes, budgets)
        for r, sx, t, m in zip(rows, suffixes, turns, budgets):
            before = history[r] + sx
            history[r] = before + t.token_ids
            assert 1 <= len(t.token_ids) <= m
            assert t.finish_reason == ("stop" if t.token_ids[-1] == 7 else "length")
            got = t.logprobs
            assert got == pytest.approx(teacher_forced(model, history[r], len(t.token_ids)), abs=1e-5)
            # negative control: the same tokens without the environment's suffix in the context score differently
            cut = history[r][: len(before) - len(sx)] + t.token_ids
            assert max(abs(a - b) for a, b in zip(got, teacher_forced(model, cut, len(t.token_ids)))) > 1e-3
    with pytest.raises(ValueError, match="not live"):
        s.next([1], [[3]], [2])


def make_runner(env_cls, workers: int = 0, timeout_s: float = 5.0, tok=None, **env_kw):
    tok = tok or reverse.tokenizer()
    spec = f"turn_envs:{env_cls.__name__}" if workers else None
    envs = EnvRunner(spec, env_cls, workers, timeout_s)
    ecfg = EnvConfig(**env_kw)
    decode = lambda ids: tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids)
    return EpisodeRunner(envs, TurnRenderer(tok), decode, ecfg, max_tokens=8, context=32), envs, tok


ROWS = [{"prompt": "abc=", "answer": "cba"}, {"prompt": "hgfe=", "answer": "efgh"}]


def test_episodes_lay_out_policy_and_environment_tokens_token_in_token_out():
    runner, envs, tok = make_runner(turn_envs.Feedback, max_turns=3)
    model = rev_model()
    with envs:
        eps = runner.run(NativeClient(model), ROWS, 3, PARAMS)
    assert [(e.prompt_index, e.sample_index) for e in eps] == [(p, g) for p in range(2) for g in range(3)]
    multi = 0
    for e in eps:
        assert e.prompt_ids == tok.encode(ROWS[e.prompt_index]["prompt"])
        assert len(e.mask) == len(e.token_ids) == len(e.logprobs) == len(e.sampled_logprobs)
        at = 0
        for turn in e.turns:  # each turn: its sampled ids (mask True), then the environment's ids (mask False)
            assert e.mask[at : at + turn["policy_tokens"]] == [True] * turn["policy_tokens"]
            at += turn["policy_tokens"]
            env_ids = e.token_ids[at : at + turn["env_tokens"]]
            assert e.mask[at : at + turn["env_tokens"]] == [False] * turn["env_tokens"]
            assert env_ids == (tok.encode(turn_envs.FEEDBACK, add_bos=False) if turn["env_tokens"] else [])
            assert all(lp == 0.0 for lp in e.logprobs[at : at + turn["env_tokens"]])
            at += turn["env_tokens"]
        assert at == len(e.token_ids) and 1 <= len(e.turns) <= 3
        multi += len(e.turns) > 1
        # the logprobs are those of the whole conversation, teacher-forced (the kept cache is exact)
        full = e.prompt_ids + e.token_ids
        ref = teacher_forced(model, full, len(e.token_ids))
        got = [lp for lp, m in zip(e.logprobs, e.mask) if m]
        assert got == pytest.approx([r for r, m in zip(ref, e.mask) if m], abs=1e-5)
        assert e.env_reward == (1.0 if e.text == ROWS[e.prompt_index]["answer"] else 0.0)
    assert multi >= 2  # the random model fails some first turns: the test sees real multi-turn episodes


def test_environment_tokens_are_context_in_the_loss_against_a_loop_reference():
    runner, envs, _ = make_runner(turn_envs.Feedback, max_turns=3)
    with envs:
        eps = runner.run(NativeClient(rev_model()), ROWS, 3, PARAMS)
    assert any(not all(e.mask) for e in eps)
    c = cfg(prompts_per_step=2, group_size=3, max_tokens=8, temperature=1.0)
    adv = torch.tensor([[1.0, -0.5, 0.25], [-1.0, 0.75, 0.5]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    model = rev_model(seed=1).train()
    b = learner.make_batch(learner.StepBatch([[0], [0]], eps, adv, valid), c, torch.device("cpu"))
    st = learner.backward_batch(model, None, c, *b, place=CPU)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    def reference(count_env: bool) -> tuple[float, dict]:
        """token_mean on-policy: -sum_i A_i sum_{t in policy tokens} ratio_t / (policy tokens), ratio = 1."""
        ref = rev_model(seed=1).train()
        terms, n = [], 0
        for e in eps:
            ids = e.prompt_ids + e.token_ids
            lp = ref(torch.tensor([ids[:-1]]))[0].float().log_softmax(-1)
            for t, m in enumerate(e.mask):
                if m or count_env:
                    pos = len(e.prompt_ids) - 1 + t
                    x = lp[pos, ids[pos + 1]]  # ratio exp(x - x.detach()) = 1, with the gradient of x
                    terms.append(-adv[e.prompt_index, e.sample_index] * torch.exp(x - x.detach()))
                    n += 1
        loss = torch.stack(terms).sum() / n
        loss.backward()
        return float(loss.detach()), {k: p.grad for k, p in ref.named_parameters()}

    want_loss, want = reference(count_env=False)
    from align.grpo import merge_stats

    assert merge_stats(st)["loss"] == pytest.approx(want_loss, rel=1e-5)
    for k, g in got.items():
        torch.testing.assert_close(g, want[k], rtol=1e-4, atol=1e-5)
    _, wrong = reference(count_env=True)  # negative control: counting the environment's tokens
    assert max((got[k] - wrong[k]).abs().max().item() for k in got) > 1e-4
    # the lengths the advantages and the stats see are the policy's tokens
    from align.rollout.groups import Groups

    scores = episode_scores(eps, [({}, e.text) for e in eps], None)
    lengths = Groups([0, 1], eps, [e.text for e in eps], scores).tensors(3).lengths
    assert lengths.flatten().tolist() == [float(sum(e.mask)) for e in eps]
    assert math.isfinite(want_loss)


def test_budgets_failures_and_timeouts_end_episodes_not_steps():
    model = rev_model()
    # --max-episode-tokens: every turn is clamped to what is left; an observation that does not fit ends as length
    runner, envs, _ = make_runner(turn_envs.Feedback, max_turns=6, max_episode_tokens=12)
    with envs:
        eps = runner.run(NativeClient(model), ROWS, 4, PARAMS)
    assert all(len(e.token_ids) <= 12 for e in eps)
    assert any(e.truncated and e.finish_reason == "length" for e in eps)
    # an environment that raises on some rows, and one that hangs: those episodes are unscorable, the rest go on
    runner, envs, _ = make_runner(turn_envs.Flaky, max_turns=3, timeout_s=1.0)
    with envs:
        eps = runner.run(NativeClient(model), [*ROWS, {"prompt": "raise=", "answer": "x"},
                                               {"prompt": "hang=", "answer": "x"}], 2, PARAMS)  # fmt: skip
    errs = [e for e in eps if e.error]
    assert {e.prompt_index for e in errs} == {2, 3}
    assert any("ZeroDivisionError" in e.error for e in errs if e.prompt_index == 2)
    assert all(e.timed_out for e in errs if e.prompt_index == 3)
    stats = env_stats(eps)
    assert stats["env/errors"] == 2 and stats["env/timeouts"] == 2
    scores = episode_scores(eps, [({}, e.text) for e in eps], None)
    assert [math.isnan(t) for t in scores.totals] == [e.error is not None for e in eps]
    assert scores.failed == 4 and scores.timeouts == 2


HOSTILE = {  # row prompt -> what its episodes' error says (None: a good row)
    "abc=": None,
    turn_envs.Hostile.WAYS["dict"]: "message 0 (user) has dict {'a': 1} as its content",
    turn_envs.Hostile.WAYS["none"]: "message 0 (user) has no content",
    turn_envs.Hostile.WAYS["empty"]: "an empty first prompt (0 tokens)",
    turn_envs.Hostile.WAYS["huge"]: "Step.reward 1e+39 is beyond float32",
    turn_envs.Hostile.WAYS["sum"]: "combine (--env-reward sum) to 6e+38, beyond float32",
}


class NoBos(CharTokenizer):
    """The reverse task's tokenizer without a BOS token, as Qwen's: an empty text encodes to no tokens."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return super().encode(text, add_bos=False)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_hostile_environment_fails_its_own_episodes_only(workers):
    """Issue 42: content a dict or missing, reset() "", a reward beyond float32 (or summed past it) each ended the run
    (InputError from the template, 'prompt 0 is empty', OverflowError); each now fails only its own episodes."""
    from align.rollout.groups import Groups

    runner, envs, _ = make_runner(
        turn_envs.Hostile, workers, tok=NoBos(reverse.ALPHABET), max_turns=3, env_reward="sum"
    )
    rows = [{"prompt": p, "answer": "cba"} for p in HOSTILE]
    with envs:
        eps = runner.run(NativeClient(rev_model()), rows, 2, PARAMS)
    for e in eps:
        want = HOSTILE[rows[e.prompt_index]["prompt"]]
        assert (e.error is None) if want is None else (want in (e.error or "")), (rows[e.prompt_index], e.error)
    assert env_stats(eps)["env/errors"] == 2 * (len(HOSTILE) - 1)
    scores = episode_scores(eps, [({}, e.text) for e in eps], None)
    assert [math.isnan(t) for t in scores.totals] == [e.error is not None for e in eps]
    assert scores.failed == 2 * (len(HOSTILE) - 1)
    tensors = Groups(list(range(len(rows))), eps, [e.text for e in eps], scores).tensors(2)  # float32: no overflow
    assert torch.isfinite(tensors.total[0]).all() and tensors.total[1:].isnan().all()
    # control: the same rows with --env-reward last: 'sum=' scores (3e38 fits), the others fail as before
    runner, envs, _ = make_runner(
        turn_envs.Hostile, workers, tok=NoBos(reverse.ALPHABET), max_turns=3, env_reward="last"
    )
    with envs:
        eps = runner.run(NativeClient(rev_model()), rows, 2, PARAMS)
    assert [e.env_reward for e in eps if e.prompt_index == 5] == [3e38, 3e38]
    assert {e.prompt_index for e in eps if e.error} == {1, 2, 3, 4}


def test_a_hostile_environment_never_ends_the_run(tmp_path):
    """The same end to end: train() runs its steps, the bad rows' episodes are counted as errors, and an environment
    reward plus a --reward that fit float32 each but not summed is one more unscorable episode."""
    import json

    from align.model import save_pretrained
    from align.run.config import TrainConfig
    from align.train import train

    def big_for_both(prompt: str, completion: str, **_) -> float | None:
        return 3e38 if prompt == turn_envs.Hostile.WAYS["both"] else None

    model_dir = str(save_pretrained(rev_model(), tmp_path / "model"))
    rows = [{"prompt": p, "answer": "cba"} for p in [*HOSTILE, turn_envs.Hostile.WAYS["both"]]]
    c = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=len(rows), group_size=2, max_tokens=8,
                    envs=EnvConfig(max_turns=3, env_reward="sum"))  # fmt: skip
    c.eval.eval_interval = 0
    s = train(c, model=model_dir, tokenizer=NoBos(reverse.ALPHABET), prompts=rows, env=turn_envs.Hostile,
              reward=big_for_both)  # fmt: skip
    assert s["steps"] == 2
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert [r["env/errors"] for r in steps] == [10, 10], steps  # five bad rows x G = 2
    assert [r["unscorable"] for r in steps] == [12, 12], steps  # and 'both=': env + --reward beyond float32


def test_an_env_spec_without_its_class_or_methods_is_refused_by_name(tmp_path):
    from align.envs.runner import load_env_class

    with pytest.raises(InputError, match="--env"):
        load_env_class("turn_envs", "--env")
    with pytest.raises(InputError, match="reset"):
        load_env_class("turn_envs:NoReset", "--env")
    with pytest.raises(ValueError, match="--max-turns"):
        EnvConfig(max_turns=0).check(8)
    with pytest.raises(ValueError, match="--max-episode-tokens 4 is below --max-tokens 8"):
        EnvConfig(max_episode_tokens=4).check(8)


def test_training_on_episodes_in_process_and_in_a_worker_gives_the_same_run(tmp_path):
    import json

    from align.model import save_pretrained
    from align.run.config import TrainConfig
    from align.train import train

    model_dir = str(save_pretrained(rev_model(), tmp_path / "model"))

    rows = reverse.prompts(64, "train")
    runs = []
    for workers in (0, 1):
        c = TrainConfig(out=str(tmp_path / f"run{workers}"), steps=2, prompts_per_step=2, group_size=3, max_tokens=8,
                        envs=EnvConfig(max_turns=3, env_workers=workers))  # fmt: skip
        c.eval.eval_interval = 0
        s = train(c, model=model_dir, tokenizer=reverse.tokenizer(), prompts=rows, env=turn_envs.Feedback)
        assert s["steps"] == 2
        recs = [json.loads(x) for x in (tmp_path / f"run{workers}" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in recs if "loss" in r]
        assert len(steps) == 2 and all("env/turns_mean" in r and "reward/env_mean" in r for r in steps)
        # completion_len_mean counts the policy's tokens; the environment's are env/env_tokens_mean (> 0 below)
        assert all(r["completion_len_mean"] == r["env/policy_tokens_mean"] for r in steps)
        runs.append([(r["loss"], r["env/turns_mean"], r["env/env_tokens_mean"], r["reward_mean"]) for r in steps])
    assert runs[0] == runs[1]
    assert any(r[2] > 0 for r in runs[0])  # some episodes had a second turn


def test_a_share_of_the_episodes_samples_what_the_whole_session_samples():
    """torchrun runs each rank's share of a step's episodes in its own Session: with the rows' global ids they draw
    what one process draws, turn after turn (each turn has its own stream)."""
    model = tiny(False, vocab=50).eval()
    params = SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=4, stop_token_ids=[7])
    prompts = [[1, 2], [3, 4, 5], [6], [8, 9, 10, 11]]

    def two_turns(rows: list[int], total: int | None, ids: list[int] | None) -> list[list[int]]:
        s = Session(model, params, total_rows=total)
        first = s.start([prompts[r] for r in rows], 1, [5] * len(rows), ids)
        second = s.next(ids or list(range(len(rows))), [[12, 13]] * len(rows), [5] * len(rows))
        return [a.token_ids + b.token_ids for a, b in zip(first, second)]

    whole = two_turns([0, 1, 2, 3], None, None)
    halves = two_turns([0, 1], 4, [0, 1]) + two_turns([2, 3], 4, [2, 3])
    assert halves == whole
    alone = two_turns([2, 3], None, None)  # negative control: the second half as a session of its own
    assert alone != whole[2:]


@pytest.mark.parametrize("K", [0, 1])
def test_a_resumed_episode_run_logs_what_the_uninterrupted_run_logs(tmp_path, K):
    """Checkpoint at step 2, resume to step 4 (K = 1: the pending batch of episodes is in the checkpoint): the same
    records as 4 steps in one go."""
    import json

    from align.model import save_pretrained
    from align.run.config import TrainConfig
    from align.train import train

    model_dir = str(save_pretrained(rev_model(), tmp_path / "model"))
    rows = reverse.prompts(64, "train")

    def run(name: str, steps: int) -> list[tuple]:
        c = TrainConfig(out=str(tmp_path / name), steps=steps, prompts_per_step=2, group_size=3, max_tokens=8,
                        checkpoint_every=2, max_async_steps=K, envs=EnvConfig(max_turns=3))  # fmt: skip
        c.eval.eval_interval = 0
        train(c, model=model_dir, tokenizer=reverse.tokenizer(), prompts=rows, env=turn_envs.Feedback)
        recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["env/env_tokens_mean"], r["reward_mean"]) for r in recs if "loss" in r]

    straight = run("straight", 4)
    run("resumed", 2)
    assert run("resumed", 4) == straight
    assert len(straight) == 4 and any(r[2] > 0 for r in straight)


def test_lora_trains_on_episodes_and_held_out_episodes_are_evaluated(tmp_path):
    import json

    from align.model import save_pretrained
    from align.run.config import TrainConfig
    from align.train import train

    model_dir = str(save_pretrained(rev_model(), tmp_path / "model"))
    c = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=3, max_tokens=8, lr=1e-2,
                    envs=EnvConfig(max_turns=3))  # fmt: skip
    c.lora.rank = 4
    c.eval.eval_interval, c.eval.eval_n = 1, 2
    dense = lambda prompt, completion, **_: len(completion) / 8
    train(c, model=model_dir, tokenizer=reverse.tokenizer(), prompts=reverse.prompts(64, "train"),
          env=turn_envs.Feedback, reward=dense, eval_prompts=reverse.prompts(4, "eval"))  # fmt: skip
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2] and all(r["grad_norm"] > 0 for r in recs if "loss" in r)
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "adapter" / "adapter_model.safetensors").is_file()
    assert all("reward/env_mean" in r and "reward/<lambda>_mean" in r for r in recs if "loss" in r)
    evals = [r for r in recs if "eval/pass@1" in r]  # steps 0, 1, 2: episodes of the held-out rows, G = eval_n
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(0 <= r["eval/first_turn_pass@1"] <= r["eval/pass@1"] <= 1 for r in evals)


def test_held_out_episodes_are_evaluated_pinned_to_each_version_with_async_rollouts(tmp_path):
    """``--max-async-steps 1``: each eval point runs the held-out episodes on the rollout engine under the eval lease,
    pinned to exactly its version (no training step blocked). Each record equals the reference: the same greedy
    episodes on align's native sampler from that step's checkpoint."""
    import json

    from helpers_train import native_episode_rewards

    from align.model import load_pretrained, save_pretrained
    from align.run.checkpoint import committed
    from align.run.config import TrainConfig
    from align.train import train

    model_dir = str(save_pretrained(rev_model(), tmp_path / "model"))
    rows, tok = reverse.prompts(6, "eval"), reverse.tokenizer()
    c = TrainConfig(out=str(tmp_path / "run"), steps=3, prompts_per_step=2, group_size=3, max_tokens=8, lr=3e-2,
                    checkpoint_every=1, keep_checkpoints=3, max_async_steps=1,
                    envs=EnvConfig(max_turns=3, env_reward="sum"))  # fmt: skip
    c.eval.eval_interval, c.eval.eval_n, c.eval.eval_temperature = 1, 1, 0.0
    train(c, model=model_dir, tokenizer=tok, prompts=reverse.prompts(64, "train"), env=turn_envs.Graded,
          eval_prompts=rows)  # fmt: skip
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in recs if "eval/step" in r}
    assert sorted(evals) == [0, 1, 2, 3], recs
    dirs = {0: Path(model_dir), **{s: d / "model" for s, d in committed(tmp_path / "run" / "checkpoints")}}
    refs = {s: sum(native_episode_rewards(load_pretrained(dirs[s]), tok, rows, turn_envs.Graded, 3, 8)) / len(rows)
            for s in evals}  # fmt: skip
    for s, r in evals.items():
        assert r["eval/weight_version"] == s and r["eval/mixed_version_ratio"] == 0.0, r
        assert r["eval/train_blocked_seconds"] == 0.0, r  # the pinned posture: on the engine, not in the loop
        assert r["eval/avg@1"] == pytest.approx(refs[s], abs=1e-6), (s, r, refs)
    assert len({round(v, 6) for v in refs.values()}) > 1, refs  # control: the fingerprint tells the versions apart


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env", "no_such_module:Env"], "no module 'no_such_module'"),
        (["--env", "tests/fixtures/turn_envs.py"], "--env"),
        (["--env", "tests/fixtures/turn_envs.py:NoReset"], "reset"),
        (["--env", "tests/fixtures/turn_envs.py:Feedback", "--max-turns", "0"], "--max-turns must be >= 1"),
        (["--env", "tests/fixtures/turn_envs.py:Feedback", "--max-episode-tokens", "3"], "below --max-tokens"),
        (["--env", "tests/fixtures/turn_envs.py:Feedback", "--train-data", ""], "--env needs --train-data"),
        (["--tools", "tests/fixtures/turn_envs.py:Feedback"], "--tools"),
    ],
)
def test_bad_environment_flags_fail_by_name_before_any_model_loads(tmp_path, monkeypatch, capsys, args, message):
    import align.model
    from align.train import main

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the flags were checked")

    monkeypatch.setattr(align.model, "load_pretrained", no_load)
    monkeypatch.chdir(Path(__file__).parents[1])
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "abc=", "answer": "cba"}\n')
    argv = ["--out", str(tmp_path / "run"), "--model", str(tmp_path / "no_model"), "--train-data", str(data), *args]
    try:
        rc = main(argv)
    except (SystemExit, ValueError) as e:  # argparse / config checks
        rc, err = 2, str(e) + capsys.readouterr().err
    else:
        err = capsys.readouterr().err
    assert rc == 2 and message in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval-function-path", "tests/fixtures/envs.py:f"], "a CheckpointEvalFn cannot drive"),
    ],
)
def test_an_eval_function_cannot_run_episodes_and_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, flags,
                                                                             message):  # fmt: skip
    import align.model
    from align.train import main

    monkeypatch.setattr(align.model, "load_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.chdir(Path(__file__).parents[1])
    (tmp_path / "tok").mkdir()
    reverse.tokenizer().save(tmp_path / "tok")  # the tokenizer loads before the environment path is opened
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "abc=", "answer": "cba"}\n')
    argv = ["--out", str(tmp_path / "run"), "--model", str(tmp_path / "tok"), "--train-data", str(data),
            "--eval-data", str(data), "--env", "tests/fixtures/turn_envs.py:Feedback", "--eval-interval", "1",
            "--eval-hf-dir", str(tmp_path / "snaps"), *flags]  # fmt: skip
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_dapo_refill_samples_more_rows_until_the_episode_groups_have_signal(tmp_path):
    import json

    from align.model import save_pretrained
    from align.run.config import TrainConfig
    from align.train import train

    model_dir = str(save_pretrained(rev_model(), tmp_path / "model"))
    c = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=3, max_tokens=8,
                    adv_refill=True, max_refill_rounds=2, envs=EnvConfig(max_turns=2))  # fmt: skip
    c.eval.eval_interval = 0
    train(
        c, model=model_dir, tokenizer=reverse.tokenizer(), prompts=reverse.prompts(64, "train"), env=turn_envs.Feedback
    )
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    # a random model never reverses a word: no group has signal, so every step uses all its refill rounds
    assert [(r["refill_rounds"], r["refill_prompts"], r["signal_groups"]) for r in recs] == [(2, 4, 0)] * 2


def test_a_new_environment_is_a_file_and_a_row_and_every_hook_runs_in_its_place(tmp_path, monkeypatch):
    """tests/fixtures/toy_env.py registered as the row "toy" of ``ENVIRONMENTS`` (the file + the row is all it takes)
    runs by name: ``check_rows`` before the model loads, ``open`` once before any episode (its state reaches every
    episode), ``draws`` picks each step's rows, ``metrics`` logs its counts, ``close`` once at the end; held-out
    episodes are evaluated. Controls: a bad row fails in ``check_rows`` before ``open`` and before the model loads; a
    name that is no row is refused naming the rows."""
    import json

    import align.model
    from align.model import save_pretrained
    from align.run.config import TrainConfig
    from align.tasks import ENVIRONMENTS
    from align.train import train

    log = tmp_path / "events.txt"
    monkeypatch.setenv("TOY_ENV_LOG", str(log))
    monkeypatch.setitem(ENVIRONMENTS, "toy", f"{FIXTURES / 'toy_env.py'}:Toy")
    model_dir = str(save_pretrained(rev_model(), tmp_path / "model"))
    rows, evals = reverse.prompts(6, "train"), reverse.prompts(2, "eval")

    def run(name: str, train_rows: list[dict]) -> dict:
        c = TrainConfig(out=str(tmp_path / name), steps=2, prompts_per_step=2, group_size=2, max_tokens=8,
                        envs=EnvConfig(env="toy", max_turns=2), checkpoint_every=0)  # fmt: skip
        c.eval.eval_interval, c.eval.eval_n = 2, 2
        return train(c, model=model_dir, tokenizer=reverse.tokenizer(), prompts=train_rows, eval_prompts=evals)

    run("run", rows)
    events = log.read_text().splitlines()
    assert events[:2] == ["check_rows 8", "open max_turns=2"] and events[-1] == "close hint=="
    assert [e for e in events if e.startswith(("begin", "add"))] == ["begin 1", "add 1 0 1", "begin 2", "add 2 2 3"]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 2 and all(r["toy/steps"] == 4 * r["env/turns_mean"] for r in steps), steps  # 4 episodes
    assert sorted(r["step"] for r in recs if "eval/pass@1" in r) == [0, 2]
    # controls: a row without 'answer' fails in check_rows, before open and before any model loads
    log.unlink()
    monkeypatch.setattr(align.model, "load_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(InputError, match=r"prompts\[3\]: a toy row needs an 'answer'"):
        run("bad", rows[:3] + [{"prompt": "abc="}])
    assert not log.exists()
    monkeypatch.delitem(ENVIRONMENTS, "toy")
    with pytest.raises(InputError, match=r"the name of a built-in environment \(agent, lean, multiturn, tools\)"):
        run("gone", rows)
