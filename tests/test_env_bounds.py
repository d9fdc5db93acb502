"""Environment replies bounded by bytes (issue 42): a 20 MB observation is refused before tokenizing (the data
prompts' byte limit: context tokens x the tokenizer's longest token in bytes), and a worker reply past
``align.envs.runner.MAX_REPLY_BYTES`` fails its call in linear time; either way only that episode is affected.
Before: a 4 MB observation took 99 s and 1.8 GB, 20 MB never finished; worker replies were read into a growing
buffer searched again after every read."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers_learner import PARAMS, rev_model

from align.chat import TurnRenderer
from align.envs import runner as env_runner
from align.envs.config import EnvConfig
from align.envs.episodes import EpisodeRunner
from align.envs.runner import EnvRunner
from align.rollout.client import NativeClient
from align.tasks import reverse

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import big_envs

FAST_S = 30.0  # "fails fast": the whole run of a few episodes, model included (unbounded: minutes, or never)
ROWS = [{"prompt": "bigabc=", "answer": "cba"}, {"prompt": "hgfe=", "answer": "efgh"}]


def make_runner(env_cls: type, workers: int = 0, **env_kw) -> tuple[EpisodeRunner, EnvRunner]:
    """tests/test_envs.py's runner (the reverse task's tokenizer, context 32), over ``big_envs``."""
    tok = reverse.tokenizer()
    envs = EnvRunner(f"big_envs:{env_cls.__name__}" if workers else None, env_cls, workers, 30.0)
    decode = lambda ids: tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids)
    return EpisodeRunner(envs, TurnRenderer(tok), decode, EnvConfig(**env_kw), max_tokens=8, context=32), envs


@pytest.mark.parametrize("workers", [0, 1])
def test_a_20mb_observation_ends_only_its_episode_fast(workers):
    """In process: the big row's episode ends as length (it cannot fit), never tokenized. In a worker: the reply is
    over the cap, so the call fails naming it and the worker is replaced. Control: the small row's episodes run
    their turns and get rewards."""
    runner, envs = make_runner(big_envs.BigStep, workers=workers, max_turns=3)
    tokenized = []  # the size of every observation the renderer was asked to tokenize
    suffix = runner.renderer.suffix
    runner.renderer.suffix = lambda obs: tokenized.append(len(obs)) or suffix(obs)
    t0 = time.monotonic()
    with envs:
        eps = runner.run(NativeClient(rev_model()), ROWS, 2, PARAMS)
    assert time.monotonic() - t0 < FAST_S
    assert max(tokenized, default=0) < 1000 and (tokenized or workers)  # 20 MB never tokenized; '=' was
    big = [e for e in eps if e.prompt_index == 0]
    small = [e for e in eps if e.prompt_index == 1]
    failed_first = [e for e in big if e.env_reward != 1.0]
    assert failed_first, "the random model answers the big row wrong at least once"
    for e in failed_first:
        if workers:
            assert e.error and str(env_runner.MAX_REPLY_BYTES) in e.error and "bytes" in e.error, e.error
        else:
            assert (e.error, e.truncated, e.finish_reason) == (None, True, "length")
            assert sum(t["env_tokens"] for t in e.turns) == 0  # the observation was never tokenized into it
    if workers:  # documented: a replaced worker takes its other episodes with it; a run without the big row is clean
        assert all(e.error is None or "the worker was replaced" in e.error for e in small)
        runner, envs = make_runner(big_envs.BigStep, workers=workers, max_turns=3)
        with envs:
            small = runner.run(NativeClient(rev_model()), ROWS[1:], 2, PARAMS)
    assert all(e.error is None and e.env_reward is not None for e in small)


def test_a_20mb_first_prompt_is_that_episodes_error_fast():
    runner, envs = make_runner(big_envs.BigReset, max_turns=2)
    t0 = time.monotonic()
    with envs:
        eps = runner.run(NativeClient(rev_model()), ROWS, 2, PARAMS)
    assert time.monotonic() - t0 < FAST_S
    for e in eps:
        if e.prompt_index == 0:
            assert e.error and "20000000 bytes" in e.error and "context" in e.error, e.error
        else:  # control
            assert e.error is None and e.env_reward is not None
