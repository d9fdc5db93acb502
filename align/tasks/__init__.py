"""Built-in tasks with verifiable rewards: ``TASKS`` names each module (``--task NAME``), and every one has the members
and signatures of ``TaskModule`` (``load_task`` checks them), single-turn and multi-turn alike:

    TRAIN_DEFAULTS: dict                                  # TrainConfig fields the task changes ({"envs.max_turns": 2})
    tokenizer() -> tokenizer                              # an align.char_tokenizer.CharTokenizer
    prompts(n, split, seed=0) -> list[dict]               # "train" / "eval" rows; the splits never share a prompt
    reward: reward(prompt, completion, **row) | None      # a single-turn task's reward (None: the environment's)
    Env: type | None                                      # a multi-turn task's environment (align.envs API) or None
    model_config(tok) -> ModelConfig                      # the shape its warm start trains
    warm_start(path, *, steps, batch, lr, seed, log) -> Path    # the built-ins: align.tasks.warm.warm_start(module,
                                                          #   path, ...) on the module's warm_example(row, tok, rng)
    check_sizes(rows, tok, max_tokens, max_turns=1)       # before the warm start: what is sampled fits the context

Exactly one of ``reward`` and ``Env`` is set. Adding a task is a module and a row of ``TASKS``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

# name -> module: the built-in tasks (--task NAME)
TASKS: dict[str, str] = {
    "reverse": "align.tasks.reverse",  # single-turn: reverse a word (the embedded default)
    "reverse_moe": "align.tasks.reverse_moe",  # the reverse task on a tiny Qwen3-MoE (routing replay on)
    "multiturn": "align.tasks.multiturn",  # multi-turn: the hidden letter comes back as feedback
    "agent": "align.tasks.agent",  # multiturn played by an agent program through the gateway (--agent's path)
}


# name -> "module:Class": the built-in environments (``--env NAME``); a name never contains ':' or '/'
ENVIRONMENTS: dict[str, str] = {
    "agent": "align.gateway.agents:AgentEnv",  # --agent fn: an agent program through the OpenAI-compatible gateway
    "lean": "align.lean.env:LeanEnv",  # Goedel-Prover's prompt, one verified proof attempt per turn
    "multiturn": "align.tasks.multiturn:Env",  # the built-in multi-turn task's environment (rows: prompt, answer)
    "tools": "align.envs.tools:ToolEnv",  # the tool environment over --tools (also what --tools alone picks)
}


def env_spec(name: str, flag: str = "--env") -> str:
    """``name`` as ``module:Class``: a row of ``ENVIRONMENTS`` (``lean``), or ``module:Class`` / ``file.py:Class``
    as given; ``InputError`` naming ``flag`` for a bare name that is no row."""
    if ":" in name:
        return name
    if name not in ENVIRONMENTS:
        from align.errors import InputError

        raise InputError(
            f"{flag} {name!r}: expected 'module:Class' or 'path/to/file.py:Class', or the name of a built-in "
            f"environment ({', '.join(sorted(ENVIRONMENTS))})"
        )
    return ENVIRONMENTS[name]


class TaskModule(Protocol):
    """What a built-in task module holds (see the module docstring)."""

    TRAIN_DEFAULTS: dict[str, Any]
    reward: Callable[..., float] | None
    Env: type | None

    def tokenizer(self) -> Any: ...
    def prompts(self, n: int, split: str, seed: int = 0) -> list[dict]: ...
    def model_config(self, tok: Any) -> Any: ...
    def warm_start(
        self, path: str | Path, *, steps: int, batch: int, lr: float, seed: int, log: Callable | None
    ) -> Path: ...
    def check_sizes(self, rows: list[dict], tok: Any, max_tokens: int, max_turns: int = 1) -> None: ...


MEMBERS = ("TRAIN_DEFAULTS", "reward", "Env", "tokenizer", "prompts", "model_config", "warm_start", "check_sizes")


def check_task_module(mod: ModuleType) -> TaskModule:
    """``mod`` with every member of ``TaskModule`` and exactly one of ``reward`` / ``Env``; ``TypeError`` naming what
    is missing."""
    missing = [m for m in MEMBERS if not hasattr(mod, m)]
    if missing:
        raise TypeError(f"task module {mod.__name__} lacks {', '.join(missing)} (align.tasks.TaskModule)")
    if (mod.reward is None) == (mod.Env is None):
        raise TypeError(f"task module {mod.__name__} must set exactly one of reward and Env, not both or neither")
    return mod  # type: ignore[return-value]


def load_task(name: str) -> TaskModule:
    """The built-in task ``name`` (a row of ``TASKS``); ``ValueError`` naming the built-in ones."""
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; available: {', '.join(TASKS)}")
    return check_task_module(importlib.import_module(TASKS[name]))


def is_multi_turn(name: str) -> bool:
    """Whether the built-in task ``name`` runs episodes (its module sets ``Env``); False for a name that is no task."""
    return name in TASKS and load_task(name).Env is not None
