"""Multi-turn environments: an episode is a conversation between the policy and an environment, trained
token-in/token-out (the trainer learns from exactly the token ids the sampler produced).

The environment API (one instance per episode; a group has G episodes of one data row)::

    class MyEnv:
        def __init__(self, **row): ...                  # every column of the data row
        def reset(self) -> list[dict] | str: ...        # the first messages (chat) or a plain prompt
        def step(self, completion: str) -> Step: ...    # the policy's answer -> what the environment says back

An environment may set ``tools`` (a list of JSON schemas, passed to the chat template's ``tools=``), and
``concurrent = True`` (its instances are thread-safe: their steps run at once in this process).

Optional lifecycle hooks on the class (``align.envs.sampler`` calls each one that exists; none is required)::

    @staticmethod
    def check_rows(rows: list[tuple[str, dict]]) -> None: ...    # (where, row) pairs, before the model loads
    @classmethod
    def open(cls, cfg, tokenizer) -> type: ...                    # start what every episode shares (a verifier
                                                                  # pool); returns the class the episodes run
    @classmethod
    def close(cls) -> None: ...                                   # (on what open returned) stop what open started
    @classmethod
    def draws(cls, rows: list[dict], cursor) -> Any: ...          # which rows a step samples (default: the data
                                                                  # cursor's; --env lean: its correction queue)
    @staticmethod
    def metrics(episodes: list) -> dict[str, float]: ...          # the environment's own per-step metrics

``cfg`` is the run's ``TrainConfig`` (read, never imported here). A class with ``open`` runs in this process
(``--env-workers`` is refused for it: a worker process would load it unopened). ``draws`` returns an object with
``begin(t)``, ``next_prompts(k) -> indices``, ``row(i) -> dict`` and ``add(groups, t)`` (``align.envs.sampler.Rows``
is the default).

Built-in environments are rows of ``align.tasks.ENVIRONMENTS`` (name -> ``module:Class``; the table sits on the
tasks' floor because it names their environments): ``--env lean`` is resolved there to ``align.lean.env:LeanEnv``
before the same loader as ``--env path/file.py:Class`` (``align.envs.runner.load_env_class``) imports it, in this
process or a worker. Adding one is a file and a row there.

``Step(observation, reward, done)``: ``observation`` is the environment's next messages (a list of
``{"role", "content"}`` dicts, rendered through the chat template as a suffix of the conversation) or a plain
string (tokenized and appended as is), or None (nothing to say: only with ``done``); ``reward`` is this turn's
reward (None: no reward for this turn); ``done`` ends the episode; ``info`` (optional) counts what the trainer logs:
``{"tool_calls": int, "tool_errors": int}``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

__all__ = ["EnvError", "Step", "check_env_class", "check_observation", "check_step"]


class Step(NamedTuple):
    """What an environment returns for one policy turn."""

    observation: list[dict] | str | None = None
    reward: float | None = None
    done: bool = False
    info: dict | None = None


class EnvError(RuntimeError):
    """An environment call raised, timed out or returned the wrong type (the episode becomes unscorable)."""


def check_env_class(cls: Any, flag: str = "--env") -> None:
    """``cls`` must be a class with callable ``reset`` and ``step``; raises ``InputError`` naming ``flag``."""
    from align.data import InputError

    if not isinstance(cls, type):
        raise InputError(f"{flag}: {cls!r} is a {type(cls).__name__}, not a class with reset() and step()")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise InputError(
            f"{flag}: class {cls.__name__} has no {' or '.join(missing)}() method; an environment "
            "defines reset(self) -> messages | str and step(self, completion) -> align.envs.Step"
        )


def check_observation(obs: Any, what: str) -> list[dict] | str:
    """A reset() result or a Step's observation: a str, or a non-empty list of {"role", "content"} dicts whose
    content is a string or a list of content parts (null only beside ``tool_calls``), as a data row's messages."""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, list) and obs and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in obs):
        for i, m in enumerate(obs):
            content = m.get("content", ...)
            if not (isinstance(content, (str, list)) or (content is None and m.get("tool_calls"))):
                kind = "no content" if content is ... else f"{_brief(content)} as its content"
                raise EnvError(
                    f"{what}: message {i} ({m['role']}) has {kind}; a message's 'content' must be a string (or a "
                    "list of content parts)"
                )
        return obs
    raise EnvError(f"{what} must be a str or a non-empty list of {{'role', 'content'}} dicts, got {_brief(obs)}")


def check_step(out: Any, what: str = "step()") -> Step:
    """``out`` as a ``Step`` (a ``Step`` or a 3-tuple / dict of its fields); ``EnvError`` naming the wrong type."""
    if isinstance(out, dict) and set(out) <= set(Step._fields):
        out = Step(**out)
    elif isinstance(out, tuple) and not isinstance(out, Step) and len(out) in (3, 4):
        out = Step(*out)
    if not isinstance(out, Step):
        raise EnvError(f"{what} must return align.envs.Step(observation, reward, done), got {_brief(out)}")
    obs, reward, done, info = out
    if not isinstance(done, bool):
        raise EnvError(f"{what}: Step.done must be a bool, got {_brief(done)}")
    if obs is None:
        if not done:
            raise EnvError(f"{what}: Step.observation is None but done is False (the policy has nothing to answer)")
    else:
        obs = check_observation(obs, f"{what}: Step.observation")
    if reward is not None:
        from align.rewards import FLOAT32_MAX

        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise EnvError(f"{what}: Step.reward must be a number or None, got {_brief(reward)}")
        try:
            reward = float(reward)
        except OverflowError:  # an int past float's range
            reward = math.inf
        if not math.isnan(reward) and not abs(reward) <= FLOAT32_MAX:  # a step's rewards become float32 tensors
            raise EnvError(f"{what}: Step.reward {reward!r} is beyond float32 (|reward| <= {FLOAT32_MAX:.4g})")
    if info is not None and not (
        isinstance(info, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in info.values())
    ):
        raise EnvError(f"{what}: Step.info must be a dict of int counts or None, got {_brief(info)}")
    return Step(obs, reward, done, info)


def _brief(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r[:80]}{'...' if len(r) > 80 else ''}"
