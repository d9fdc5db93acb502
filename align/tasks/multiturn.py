"""The built-in multi-turn task: reverse a word with one letter hidden; the environment names the letter.

Prompt ``"<bos>ca?d="`` (the word ``cabd`` with one letter shown as ``?``); the answer is the reverse of the
whole word, ``"dbac<eos>"``. The first answer has to guess the hidden letter, so no policy can pass more than
``FIRST_TURN_CEILING`` = 1/8 of first turns: the hidden letter is uniform over the 8 letters and independent of
what the prompt shows (each split holds every masked word with all 8 fillings, so on any ``n`` divisible by 8 the
ceiling is exact, not just expected). A wrong answer gets the feedback ``"|b="`` (the hidden letter), after which
the answer can be exact. An episode of two turns is the token sequence::

    <bos> c a ? d =  d f a c <eos>  | b =  d b a c <eos>
    (reset)          (policy)       (env)  (policy)

The warm start is a short supervised run on both turns' formats, *biased* so that the warmed model mostly ignores
the feedback: ``REPEAT_FRACTION`` of its second-turn targets repeat the first answer. Every point of final success
beyond ``1/8 + 7/8 * (1 - REPEAT_FRACTION)`` (times the model's reversal accuracy) comes from the reward: GRPO has
to learn to read the environment's message.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from functools import partial

from align.char_tokenizer import CharTokenizer
from align.envs import Step
from align.model import ModelConfig
from align.tasks import reverse, warm

LETTERS = "abcdefgh"
ALPHABET = LETTERS + "=?|"
MIN_LEN, MAX_LEN = 3, 6
FIRST_TURN_CEILING = 1 / len(LETTERS)  # the hidden letter is uniform given the prompt
DEFAULT_MAX_TURNS = 2  # one guess, one answer after the feedback
REPEAT_FRACTION = 0.8  # the warm start's bias: this share of its second answers repeat the first
# what `python -m align.train --task multiturn` changes from TrainConfig's defaults (a flag you pass wins)
TRAIN_DEFAULTS = {"steps": 160, "envs.max_turns": DEFAULT_MAX_TURNS, "lr": 5e-4, "max_tokens": 10, "loss.eps_high": 0.2}
reward = None  # multi-turn: the environment (``Env``) rewards each turn
CONTEXT = 64  # max_position_embeddings: room for a few turns of a 6-letter word


def tokenizer() -> CharTokenizer:
    return CharTokenizer(ALPHABET)


def feedback(hidden: str) -> str:
    """The environment's message after a wrong answer: ``"|c="`` names the hidden letter ``c``."""
    return f"|{hidden}="


def _hidden_letter(prompt: str, answer: str) -> str:
    """The letter behind the ``?`` of ``prompt`` (the answer is the reversed word)."""
    return answer[::-1][prompt.index("?")]


def prompts(n: int, split: str, seed: int = 0) -> list[dict]:
    """``n`` rows {"prompt": "ca?d=", "answer": "dbac"}. ``split`` is "train" or "eval"; a masked word is in the
    eval split iff its hash bucket is 0 (of 8), so the splits never share a prompt. Each masked word comes as a
    block of 8 rows, one per hidden letter (in a seeded order), so the first-turn ceiling holds on the set."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"multiturn-{split}-{seed}")
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < n:
        word = [rng.choice(LETTERS) for _ in range(rng.randint(MIN_LEN, MAX_LEN))]
        word[rng.randrange(len(word))] = "?"
        masked = "".join(word)
        is_eval = sum(map(ord, masked)) * 2654435761 % 2**32 % 8 == 0
        if masked in seen or is_eval != (split == "eval"):
            continue
        seen.add(masked)
        for letter in rng.sample(LETTERS, len(LETTERS)):
            out.append({"prompt": masked + "=", "answer": masked.replace("?", letter)[::-1]})
    return out[:n]


class Env:
    """One episode: the prompt, then the hidden letter as feedback after each wrong answer.

    Reward 1.0 and done on the exact answer; else reward 0.0 with the feedback until turn ``max_turns``, whose
    wrong answer ends the episode (the trainer's ``--max-turns`` may end it sooner)."""

    def __init__(self, prompt: str, answer: str, max_turns: int = DEFAULT_MAX_TURNS, **_):
        if "?" not in prompt or len(prompt) != len(answer) + 1:
            raise ValueError(f"row {{'prompt': {prompt!r}, 'answer': {answer!r}}} is not a multiturn task row")
        self.prompt, self.answer, self.max_turns = prompt, answer, max_turns
        self.hidden = _hidden_letter(prompt, answer)
        self.turn = 0

    def reset(self) -> str:
        self.turn = 0
        return self.prompt

    def step(self, completion: str) -> Step:
        self.turn += 1
        if completion == self.answer:
            return Step(None, 1.0, True)
        if self.turn >= self.max_turns:
            return Step(None, 0.0, True)
        return Step(feedback(self.hidden), 0.0, False)


def model_config(tok: CharTokenizer) -> ModelConfig:
    """The reverse task's 3-layer, 128-wide Qwen2 shape with a longer context (episodes span turns)."""
    return dataclasses.replace(reverse.model_config(tok), max_position_embeddings=CONTEXT)


def _guess(masked: str, rng: random.Random, avoid: str | None = None) -> str:
    """A first answer: the reversed word with a random letter (not ``avoid``) in place of the ``?``."""
    letter = rng.choice([c for c in LETTERS if c != avoid])
    return masked.replace("?", letter)[::-1]


def _warm_example(row: dict, tok: CharTokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    """(ids, labels) of one supervised episode: half are first turns (a random guess), half two-turn episodes
    (a wrong guess, the feedback, then the first answer repeated with probability ``REPEAT_FRACTION``, else the
    exact answer). Labels are -100 on the prompt and the feedback: only the policy's tokens are learned."""
    masked, answer = row["prompt"][:-1], row["answer"]
    ids = tok.encode(row["prompt"])
    labels = [-100] * len(ids)
    if rng.random() < 0.5:
        turns = [(_guess(masked, rng), None)]
    else:
        hidden = _hidden_letter(row["prompt"], answer)
        first = _guess(masked, rng, avoid=hidden)
        second = first if rng.random() < REPEAT_FRACTION else answer
        turns = [(first, feedback(hidden)), (second, None)]
    for text, obs in turns:
        out = tok.encode(text, add_bos=False) + [tok.eos_token_id]
        ids, labels = ids + out, labels + out
        if obs is not None:
            env = tok.encode(obs, add_bos=False)
            ids, labels = ids + env, labels + [-100] * len(env)
    return ids, labels


def warm_example(row: dict, tok: CharTokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    """``_warm_example``'s pair as the warm start learns it (``align.tasks.warm``): label t, the token after t."""
    ids, labels = _warm_example(row, tok, rng)
    return ids, labels[1:]


# the steps, batch, lr, seed and log of align.tasks.warm.warm_start, on this module's warm_example
warm_start = partial(warm.warm_start, sys.modules[__name__])


def check_sizes(rows: list[dict], tok: CharTokenizer, max_tokens: int, max_turns: int = 1) -> None:
    """Before the warm start: the longest prompt, ``max_turns`` answers of ``max_tokens`` and the feedback
    between them fit the task model's context (a ``ValueError`` naming the flag to lower)."""
    context = model_config(tok).max_position_embeddings
    longest = warm.longest_prompt(rows, tok, max_tokens, context, "multiturn")
    per_turn = max_tokens + len(feedback(LETTERS[0]))
    episode = longest + max_turns * max_tokens + (max_turns - 1) * len(feedback(LETTERS[0]))
    if episode > context:
        raise ValueError(
            f"--max-turns {max_turns}: an episode of the multiturn task can reach {episode} tokens ({longest} of "
            f"prompt, {max_turns} answers of --max-tokens {max_tokens}, the feedback between them) and its model's "
            f"context is {context}; at --max-tokens {max_tokens}, --max-turns can be at most "
            f"{max(1, (context - longest + per_turn - max_tokens) // per_turn)}"
        )
