"""Evaluate snapshots on a backend the user owns: ``CheckpointEvalFn``, ``EvalSkip``, ``retarget_args``. stdlib only.

Point ``--eval-function-path`` at a ``CheckpointEvalFn`` subclass (``package.module:ClassName`` or
``path/to/file.py:ClassName``). It is built once, ``cls(config, eval_set)``, on the dispatcher's side; each eval
point then calls ``evaluate_checkpoint(checkpoint_dir, input)`` with a committed HF snapshot of the policy at
``input.step``. Return a metrics dict (keys ``eval/...``); raise ``EvalSkip(reason)`` to skip the point with
attribution (``eval/skipped_{reason}``); anything else raised is reported as ``crashed``.
``evaluate_checkpoint`` may be a plain method (run on a worker thread) or ``async def`` (run on the dispatcher loop).
"""

from __future__ import annotations

import abc
import copy
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from align.eval.config import EvalConfig, EvalSet
from align.rollout.protocol import SamplingParams


class EvalSkip(Exception):
    """Skip this eval point with an attributable reason; it is logged as ``eval/skipped_{reason}`` at its step."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if not reason or not reason.replace("_", "").isalnum():
            raise ValueError(f"EvalSkip reason must be a non-empty identifier like 'pin_violation', got {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class EvalInput:
    """What one eval point hands to the eval function.

    ``step``: the optimizer step whose weights the snapshot holds; ``weight_version == step`` is the version the
    backend must report back (the pin). ``generate_state``: the pinned fleet (``None`` for a ``CheckpointEvalFn``).
    ``sampling``: the eval set's sampling params with ``--eval-n`` etc. applied.
    """

    step: int
    weight_version: int
    hf_dir: str
    eval_set: EvalSet
    sampling: SamplingParams
    config: EvalConfig
    generate_state: Any = None
    export_time_seconds: float | None = None
    base_model: str | None = None  # LoRA: hf_dir is a PEFT adapter dir on this base model (else None)


def adapter_base_model(path: str) -> str | None:
    """``base_model_name_or_path`` when ``path`` is a PEFT adapter dir (LoRA training), else None."""
    import json

    cfg = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg):
        return None
    with open(cfg) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"adapter snapshot {path} names no base_model_name_or_path: it cannot be served")
    return base


class CheckpointEvalFn(abc.ABC):
    """User contract for snapshot eval on an external backend (an OpenAI-compatible server, a scoring service).

    The constructor prepares the backend; keep it fast (start servers lazily, on the first point) so that
    training start is not delayed. ``dispose()`` is called once after the last point settled.
    """

    def __init__(self, config: EvalConfig, eval_set: EvalSet) -> None:
        self.config = config
        self.eval_set = eval_set

    @abc.abstractmethod
    def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> dict[str, float]:
        """Evaluate the committed HF snapshot at ``checkpoint_dir`` (the weights at ``input.step``)."""

    def __call__(self, input: EvalInput):
        if input.hf_dir is None:
            raise ValueError("CheckpointEvalFn needs an HF snapshot dir; no snapshot was dispatched")
        return self.evaluate_checkpoint(input.hf_dir, input)

    def dispose(self) -> None:
        """Release the backend (stop servers). Default: nothing."""


def _import_target(path: str) -> Any:
    if ":" not in path:
        raise ValueError(
            f"--eval-function-path {path!r} must be 'package.module:ClassName' or 'path/to/file.py:ClassName'"
        )
    where, _, name = path.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise ValueError(f"--eval-function-path: file {where!r} does not exist")
        mod_name = "_align_eval_fn_" + os.path.splitext(os.path.basename(where))[0]
        spec = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # dataclasses / pickling look the module up by name
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"--eval-function-path: {where!r} has no attribute {name!r}")
    return getattr(module, name)


def load_eval_fn(path: str, config: EvalConfig, eval_set: EvalSet) -> CheckpointEvalFn:
    """Load and build the ``CheckpointEvalFn`` subclass named by ``--eval-function-path``."""
    cls = _import_target(path)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointEvalFn)):
        raise TypeError(
            f"--eval-function-path {path!r} is {cls!r}, not a subclass of align.eval.CheckpointEvalFn; "
            "subclass it and implement evaluate_checkpoint(checkpoint_dir, input)"
        )
    return cls(config, eval_set)


def retarget_args(args: Any, router_ip: str, router_port: int, engine_gpu_counts: Sequence[int]) -> Any:
    """A shallow copy of ``args`` pointed at another OpenAI-compatible endpoint (a vLLM server or router).

    Sets ``router_ip``, ``router_port``, ``rollout_num_gpus = sum(engine_gpu_counts)``,
    ``rollout_num_engines = len(engine_gpu_counts)`` and ``rollout_num_gpus_per_engine = max(...)``; a client built
    from the copy (e.g. ``examples/eval/external_vllm_eval_fn.py::OpenAICompletionsGenerate.from_args``) sizes its
    concurrency from them. ``args`` itself is unchanged.
    """
    counts = [int(c) for c in engine_gpu_counts]
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"engine_gpu_counts must be a non-empty list of counts >= 0, got {engine_gpu_counts!r}")
    out = copy.copy(args)
    for name, value in (
        ("router_ip", router_ip),
        ("router_port", int(router_port)),
        ("rollout_num_gpus", sum(counts)),
        ("rollout_num_engines", len(counts)),
        ("rollout_num_gpus_per_engine", max(counts)),
    ):
        setattr(out, name, value)
    return out
