"""``EnvConfig``: the multi-turn settings of a run (``--env``, ``--max-turns``, ...), nested in ``TrainConfig``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from align.options import flag  # the one definition of a flag's help
from align.options import flag_help as _h

ENV_REWARDS = ("last", "sum")


@dataclass
class EnvConfig:
    env: str | None = flag(
        None,
        "Multi-turn environment class, 'path/file.py:Class' or 'module:Class' (needs --train-data), or a "
        "built-in by name (align.tasks.ENVIRONMENTS): 'tools' = the tool environment (with --tools); 'lean' = "
        "the Lean prover environment (Goedel prompts, the Lean verifier: --lean-repl / --lean-server); "
        "'multiturn' = the multiturn task's environment.",
    )
    max_turns: int = flag(4, "With --env: at most this many policy turns per episode.")
    max_episode_tokens: int = flag(
        0,
        "With --env: tokens per episode after the first prompt, the policy's and the environment's "
        "(0 = only the model's context bounds it).",
    )
    env_timeout_s: float = flag(60.0, "Max seconds per environment call (0 = no limit).")
    env_workers: int = flag(
        0,
        "0 = environments run in this process; N >= 1 = N worker processes (JSON lines, each episode "
        "sticky to one worker; a worker past --env-timeout-s is killed and replaced).",
    )
    env_reward: str = flag(
        "last",
        "How per-turn environment rewards combine: 'last' (the last turn's) or 'sum'; --reward "
        "functions, if given, score the final assistant message and add.",
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={
            **_h(
                "Tool functions for the built-in tool environment, 'path/file.py:fn' or 'module:fn' "
                "(repeat the flag for several; two tools may not share a name); 'python' = the built-in "
                "sandboxed python tool."
            ),
            "action": "extend",  # --tools a --tools b: both, as --reward
        },
    )

    agent: str | None = flag(
        None,
        "An agent program, 'path/file.py:fn' or 'module:fn': fn(base_url, api_key, model, **row) -> float | dict "
        "| None, run --group-size times per --train-data row against the OpenAI-compatible gateway "
        "(align.gateway; docs/agent.md); its return value is the reward.",
    )
    agent_workers: int = flag(
        0,
        "With --agent: threads (with --agent-processes: processes) running agents (0 = one per episode; at most "
        "--gateway-max-connections).",
    )
    agent_timeout_s: float = flag(600.0, "With --agent: seconds a step waits for its agents (0 = no limit).")
    agent_processes: bool = flag(
        False,
        "With --agent: run each agent run in a worker process of its own (loaded by its spec; the row and the "
        "result as JSON over pipes), killed with its process group past --agent-timeout-s; --agent-workers "
        "processes at once.",
    )
    gateway_max_body_mb: float = flag(8.0, "With --agent: the gateway's request body cap (MB).")
    gateway_batch_ms: float = flag(
        0.0,
        "With --agent: requests arriving within this many ms of each other go out as one generate, sooner once "
        "every running agent has one waiting; a request's draws do not depend on its batch (0 = one generate per "
        "request). The native "
        "sampler only: with --rollout spool each request goes to the worker as it arrives (it batches them).",
    )
    gateway_max_connections: int = flag(
        512, "With --agent: open connections the gateway serves at once; one more gets a 503 and is closed."
    )
    gateway_read_timeout_s: float = flag(
        30.0,
        "With --agent: seconds a request's headers and body have to arrive in full, from its first byte (a "
        "client that drips them is cut off).",
    )

    @property
    def enabled(self) -> bool:
        return self.env is not None or bool(self.tools) or self.agent is not None

    def check(self, max_tokens: int) -> None:
        """The values alone (the spec is loaded by ``align.envs.episodes.load``, before the model)."""
        if self.max_turns < 1:
            raise ValueError(f"--max-turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 0:
            raise ValueError(f"--max-episode-tokens must be >= 0 (0 = no limit), got {self.max_episode_tokens}")
        if 0 < self.max_episode_tokens < max_tokens:
            raise ValueError(
                f"--max-episode-tokens {self.max_episode_tokens} is below --max-tokens {max_tokens}: "
                "the first turn could not use its budget; raise it or lower --max-tokens"
            )
        if not (math.isfinite(self.env_timeout_s) and self.env_timeout_s >= 0):  # inf: OverflowError in every wait
            raise ValueError(f"--env-timeout-s must be a finite number >= 0 (0 = no limit), got {self.env_timeout_s}")
        if self.env_workers < 0:
            raise ValueError(f"--env-workers must be >= 0 (0 = in this process), got {self.env_workers}")
        if self.env_reward not in ENV_REWARDS:
            raise ValueError(f"--env-reward must be one of {ENV_REWARDS}, got {self.env_reward!r}")
        if self.agent is not None and (self.env not in (None, "agent") or self.tools):
            raise ValueError("--agent runs the agent through the gateway; it cannot be combined with --env / --tools")
        if self.agent_workers < 0 or not (math.isfinite(self.agent_timeout_s) and self.agent_timeout_s >= 0):
            raise ValueError(
                f"--agent-workers must be >= 0 and --agent-timeout-s finite >= 0, got "
                f"{self.agent_workers}, {self.agent_timeout_s}"
            )
        if not (math.isfinite(self.gateway_batch_ms) and self.gateway_batch_ms >= 0):
            raise ValueError(f"--gateway-batch-ms must be a finite number >= 0, got {self.gateway_batch_ms}")
        if self.gateway_max_connections < 1:
            raise ValueError(f"--gateway-max-connections must be >= 1, got {self.gateway_max_connections}")
        if not (math.isfinite(self.gateway_read_timeout_s) and self.gateway_read_timeout_s > 0):
            raise ValueError(f"--gateway-read-timeout-s must be a finite number > 0, got {self.gateway_read_timeout_s}")
        if not self.gateway_max_body_mb > 0:
            raise ValueError(f"--gateway-max-body-mb must be > 0, got {self.gateway_max_body_mb}")
        if self.tools and self.env not in (None, "tools"):
            raise ValueError(f"--tools runs the built-in tool environment; it cannot be combined with --env {self.env}")
