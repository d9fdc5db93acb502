"""Rollout backends are rows of ``align.rollout.backends.BACKENDS``: a toy one (``tests/toy_backend.py``, one file)
registered as one row runs the real training loop, K = 0 and K = 1, with no other change to align."""

from __future__ import annotations

import json

import pytest
from helpers_train import PROMPTS, TIMING_KEYS, TOK, a_reward, cfg_for
from toy_backend import ToyBackend

from align.rollout.backends import BACKENDS
from align.train import TrainConfig, train

MATCH_TOL = 1e-4  # sampler vs trainer logprob of the same weights (fp32 CPU: ~1e-6); stale weights: far above


def run(out, model, **kw) -> list[dict]:
    train(cfg_for(out, steps=3, checkpoint_every=0, **kw), model=model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def untimed(recs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in recs]


def test_a_toy_backend_is_one_row(tmp_path, char_model, monkeypatch):
    toy = ToyBackend()
    monkeypatch.setitem(BACKENDS, "toy", toy)
    got = run(tmp_path / "toy", char_model, rollout="toy")
    assert [r["step"] for r in got] == [1, 2, 3]
    (opened,) = toy.opened
    assert opened.published == [1, 2, 3] and opened.closed  # its weight publication after every step, then close()
    assert max(r["mismatch_abs_max"] for r in got) < MATCH_TOL  # it sampled from the weights it was published
    # the same run as the in-process sampler reading the live policy: the same rollouts, rewards and updates
    assert untimed(got) == untimed(run(tmp_path / "native", char_model))


def test_negative_control_a_toy_that_misses_publication_samples_stale_weights(tmp_path, char_model, monkeypatch):
    monkeypatch.setitem(BACKENDS, "toy", ToyBackend(stale=True))
    got = run(tmp_path / "stale", char_model, rollout="toy")
    assert got[0]["mismatch_abs_max"] < MATCH_TOL  # step 1: the weights it opened on are the policy's
    assert got[-1]["mismatch_abs_max"] > MATCH_TOL  # later steps: sampled from the step-0 weights


def test_a_toy_backend_serves_async_rollouts(tmp_path, char_model, monkeypatch):
    toy = ToyBackend()
    monkeypatch.setitem(BACKENDS, "toy", toy)
    got = run(tmp_path / "toy_k1", char_model, rollout="toy", max_async_steps=1)
    assert [r["step"] for r in got] == [1, 2, 3] and toy.opened[0].closed


def test_a_backend_owns_its_config_rules(monkeypatch):
    monkeypatch.setitem(BACKENDS, "toy", ToyBackend())
    with pytest.raises(ValueError, match="--rollout toy has no spool"):
        TrainConfig(rollout="toy", spool="/tmp/x")
    with pytest.raises(ValueError, match=r"--rollout must be one of \('native', 'spool', 'toy'\), got 'nope'"):
        TrainConfig(rollout="nope")


def test_spawn_worker_takes_one_spec_and_keywords_override_it(tmp_path):
    """``spawn_worker(spool, spec, **fields)``: the spec's values are checked (before any process starts), a keyword
    replaces the spec's field, and the seed's keyword call ``spawn_worker(spool, gpu=3, log_path=...)`` still works."""
    from align.rollout.client import WorkerSpec, spawn_worker

    spec = WorkerSpec(engines=0, venv=tmp_path / "no-venv")
    with pytest.raises(ValueError, match="got 0, 1, 1"):
        spawn_worker(tmp_path / "spool", spec)
    with pytest.raises(RuntimeError, match="rollout venv missing"):  # engines=1 replaced the spec's 0
        spawn_worker(tmp_path / "spool", spec, engines=1)
    with pytest.raises(RuntimeError, match="rollout venv missing"):
        spawn_worker(tmp_path / "spool", gpu=3, log_path=tmp_path / "w.log", venv=tmp_path / "no-venv")
    assert spec.engines == 0  # the caller's spec is never modified
