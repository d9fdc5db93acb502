"""The rollout data contract and the spool file protocol. stdlib only, by contract.

This module is imported by the vLLM rollout worker in its own venv (``.venv-rollout``),
so it must import with torch absent (``tests/test_dependency_firewall.py`` checks it).

``SamplingParams`` and ``Completion`` are the one definition shared by every rollout
backend (the native sampler and the spool/vLLM worker).

Logprob basis: ``Completion.logprobs[i]`` is ``log_softmax(logits / T)[token_i]`` over the
full vocabulary (the training basis, what the GRPO loss recomputes teacher-forced).
``Completion.sampled_logprobs[i]`` is the log-probability of token_i under the distribution
actually sampled from (after top-k / top-p renormalisation); it equals ``logprobs`` when
no truncation is active, and is ``None`` when the backend cannot provide it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**d)


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]  # ends with the stop token when finish_reason == "stop"
    logprobs: list[float]  # training basis: log_softmax(logits / T) of each token
    finish_reason: str  # "stop" | "length"
    sampled_logprobs: list[float] | None = None  # under the truncated (top-k/top-p) distribution
    weights_version: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Completion":
        return cls(**d)
