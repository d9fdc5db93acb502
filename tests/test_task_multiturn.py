"""The built-in multi-turn task (align/tasks/multiturn.py): splits, the environment, the first-turn ceiling, the
warm start's episode format, the size checks."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from align.char_tokenizer import CharTokenizer
from align.envs import check_step
from align.model import load_pretrained
from align.tasks import multiturn as mt

ROW = {"prompt": "ca?d=", "answer": "dbac"}  # the word cabd, its b hidden


def test_splits_are_disjoint_and_every_masked_word_has_all_fillings():
    train, evals = mt.prompts(2000, "train", 0), mt.prompts(400, "eval", 0)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in evals})
    for rows in (train, evals):
        by_prompt: dict[str, list[str]] = {}
        for r in rows:
            assert r["prompt"].count("?") == 1 and r["prompt"].endswith("=")
            assert r["prompt"][:-1].replace("?", mt._hidden_letter(r["prompt"], r["answer"])) == r["answer"][::-1]
            by_prompt.setdefault(r["prompt"], []).append(mt._hidden_letter(r["prompt"], r["answer"]))
        assert all(sorted(h) == list(mt.LETTERS) for h in by_prompt.values())
    assert mt.prompts(64, "eval", 0) == evals[:64] and mt.prompts(64, "eval", 1) != evals[:64]
    with pytest.raises(ValueError, match="split"):
        mt.prompts(8, "test", 0)


def test_env_rewards_and_feedback():
    env = mt.Env(**ROW)
    assert env.reset() == "ca?d="
    wrong = check_step(env.step("dfac"))
    assert wrong == (mt.feedback("b"), 0.0, False, None) and wrong.observation == "|b="
    assert check_step(env.step("dbac")) == (None, 1.0, True, None)

    env = mt.Env(**ROW)
    env.reset()
    assert check_step(env.step("dbac")) == (None, 1.0, True, None)  # a lucky first guess ends the episode

    env = mt.Env(**ROW)  # DEFAULT_MAX_TURNS = 2: the second wrong answer ends it
    env.reset()
    assert env.step("cabd").done is False
    assert check_step(env.step("dbac<eos>")) == (None, 0.0, True, None)  # the eos is not part of the answer

    env = mt.Env(**ROW, max_turns=3)
    env.reset()
    assert [env.step("x").done for _ in range(3)] == [False, False, True]
    assert env.reset() == "ca?d=" and env.step("dbac").reward == 1.0  # reset starts the count again

    with pytest.raises(ValueError, match="not a multiturn task row"):
        mt.Env(prompt="cabd=", answer="dbac")


def best_prompt_only_policy(rows: list[dict]) -> tuple[float, dict[str, str]]:
    """The best first-turn success of a policy that sees only the prompt, exactly: per masked word, answering with
    its most frequent hidden letter (a stochastic policy mixes these counts, so it cannot do better); the policy."""
    letters: dict[str, Counter] = {}
    for r in rows:
        letters.setdefault(r["prompt"], Counter())[mt._hidden_letter(r["prompt"], r["answer"])] += 1
    wins = sum(c.most_common(1)[0][1] for c in letters.values())
    return wins / len(rows), {p: c.most_common(1)[0][0] for p, c in letters.items()}


def first_turn(rows: list[dict], guess: dict[str, str]) -> float:
    """First-turn success through the Env of the policy that answers each prompt with its letter from ``guess``."""
    won = 0.0
    for r in rows:
        env = mt.Env(**r)
        won += env.step(env.reset()[:-1].replace("?", guess[r["prompt"]])[::-1]).reward
    return won / len(rows)


def test_no_policy_that_sees_only_the_prompt_beats_the_first_turn_ceiling():
    for rows in (mt.prompts(200, "eval", 0), mt.prompts(4000, "train", 3)):
        ceiling, best = best_prompt_only_policy(rows)
        assert ceiling == mt.FIRST_TURN_CEILING == 1 / 8
        assert first_turn(rows, best) == ceiling
        # negative control: one row per masked word (the hidden letter is then a function of the prompt)
        one_each = list({r["prompt"]: r for r in rows}.values())
        ceiling, best = best_prompt_only_policy(one_each)
        assert ceiling == 1.0 and first_turn(one_each, best) == 1.0


def test_warm_start_examples_are_the_episodes_the_env_produces():
    """Each supervised example is the token sequence a trainer builds from the Env (prompt with BOS, answer + eos,
    feedback without BOS, answer + eos); labels cover only the policy's tokens; the second answer mostly repeats."""
    tok, rng = mt.tokenizer(), random.Random(0)
    rows = mt.prompts(400, "train", 0)
    kinds = Counter()
    for r in rows:
        ids, labels = mt._warm_example(r, tok, rng)
        env = mt.Env(**r)
        want = tok.encode(env.reset())
        answers = tok.decode(ids[len(want) :], skip_special_tokens=False).split("<eos>")
        assert answers[-1] == "" and ids[-1] == tok.eos_token_id
        first = answers[0]
        want += tok.encode(first, add_bos=False) + [tok.eos_token_id]
        policy = [False] * len(tok.encode(r["prompt"])) + [True] * (len(first) + 1)
        step = env.step(first)
        if len(answers) == 3:
            assert step.done is False, "a two-turn example starts with a wrong guess"
            obs = tok.encode(step.observation, add_bos=False)
            assert answers[1].startswith(step.observation)
            second = answers[1].removeprefix(step.observation)
            want += obs + tok.encode(second, add_bos=False) + [tok.eos_token_id]
            policy += [False] * len(obs) + [True] * (len(second) + 1)
            kinds["repeat" if second == first else "exact" if env.step(second).reward == 1.0 else "other"] += 1
        else:
            assert len(answers) == 2 and len(first) == len(r["answer"])
            kinds["one turn"] += 1
        assert ids == want
        assert [lab != -100 for lab in labels] == policy and [lab for lab in labels if lab != -100] == [
            t for t, p in zip(ids, policy) if p
        ]
    assert kinds["other"] == 0 and kinds["one turn"] > 150 and kinds["exact"] > 10
    assert kinds["repeat"] / (kinds["repeat"] + kinds["exact"]) == pytest.approx(mt.REPEAT_FRACTION, abs=0.08)


def test_warm_start_writes_a_loadable_model(tmp_path):
    path = mt.warm_start(tmp_path / "m", steps=3, batch=8, log=None)
    model = load_pretrained(path, require_marker=True)
    tok = CharTokenizer.load(path)
    assert tok.alphabet == mt.ALPHABET and model.config.max_position_embeddings == mt.CONTEXT
    episode = tok.encode("ca?d=dfac") + [tok.eos_token_id] + tok.encode("|b=dbac", add_bos=False)
    assert model(torch.tensor([episode])).shape == (1, len(episode), tok.vocab_size)
    # steps = 0: the seeded random weights, saved the same way (the weak end of a benchmark's starts)
    raw = load_pretrained(mt.warm_start(tmp_path / "raw", steps=0, batch=8, log=None), require_marker=True)
    assert any(not torch.equal(a, b) for a, b in zip(raw.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match="steps >= 0"):
        mt.warm_start(tmp_path / "neg", steps=-1, batch=8, log=None)


def test_check_sizes_names_the_flag():
    tok, rows = mt.tokenizer(), mt.prompts(64, "eval", 0) + [{"prompt": "abcde?=", "answer": "hedcba"}]
    mt.check_sizes(rows, tok, max_tokens=10, max_turns=mt.DEFAULT_MAX_TURNS)
    with pytest.raises(ValueError, match="--max-tokens 60: .* at most 56"):
        mt.check_sizes(rows, tok, max_tokens=60, max_turns=1)
    with pytest.raises(ValueError, match=r"--max-turns 5: .* at most (\d+)") as err:
        mt.check_sizes(rows, tok, max_tokens=10, max_turns=5)
    most = int(err.value.args[0].rsplit(" ", 1)[1])
    mt.check_sizes(rows, tok, max_tokens=10, max_turns=most)  # the bound it names fits, one more does not
    with pytest.raises(ValueError, match="--max-turns"):
        mt.check_sizes(rows, tok, max_tokens=10, max_turns=most + 1)


def test_every_built_in_task_has_the_task_module_members_and_one_signature():
    """``align.tasks.TASKS``: each module has every ``TaskModule`` member, exactly one of reward / Env, and the same
    ``check_sizes`` / ``warm_start`` parameters. Controls: a module missing a member, or setting both, is refused."""
    import inspect
    import types

    from align.tasks import MEMBERS, TASKS, check_task_module, load_task

    mods = [load_task(name) for name in TASKS]
    for fn in ("check_sizes", "warm_start", "prompts", "model_config", "tokenizer"):
        assert len({tuple(inspect.signature(getattr(m, fn)).parameters) for m in mods}) == 1, fn
    assert [m.Env is not None for m in mods] == [False, False, True, True]
    fake = types.ModuleType("fake_task")
    for name in MEMBERS:
        setattr(fake, name, getattr(mods[0], name))
    check_task_module(fake)
    fake.Env = mt.Env
    with pytest.raises(TypeError, match="exactly one of reward and Env"):
        check_task_module(fake)
    del fake.check_sizes
    with pytest.raises(TypeError, match="lacks check_sizes"):
        check_task_module(fake)
    with pytest.raises(
        ValueError, match="unknown built-in task 'nope'; available: reverse, reverse_moe, multiturn, agent"
    ):
        load_task("nope")


def test_the_warm_start_runs_under_threads(tmp_path):
    """``--threads`` holds for the built-in task's warm start (it ran on every CPU: under load, 2 threads on 2 busy
    cores took ~5x the CPU time per step). Control: the thread count before is another."""
    import torch

    from align.run.task import builtin_task
    from align.train import TrainConfig

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        builtin_task(TrainConfig(threads=1, warm_start_steps=0, out=str(tmp_path)))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
