"""The generated CLI's manners: flags grouped by config section, a short ``--help`` and a full ``--help-all``, and
one-line errors (an unknown flag names the closest ones, ``difflib``) instead of a page of usage.

A nested config section (``loss``, ``adv``, ``eval``, ...) is a group of its own; the top-level fields of a config
are grouped by ``TOP_SECTIONS`` (a field it does not name goes to ``run``), so a field that moves into a nested
section later simply joins that section's group.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from typing import Any, NoReturn

TOP_SECTIONS: dict[str, tuple[str, ...]] = {
    "sampling": (
        "prompts_per_step",
        "group_size",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "behaviour_logprobs",
        "chat_template_kwargs",
        "adv_refill",
        "max_refill_rounds",
    ),
    "optimizer": (
        "lr",
        "warmup_steps",
        "lr_schedule",
        "min_lr_ratio",
        "weight_decay",
        "adam_betas",
        "grad_clip",
        "max_nonfinite_steps",
        "micro_batch_size",
        "micro_batch_tokens",
        "pack_sequences",
        "updates_per_batch",
        "mini_batches",
        "gradient_checkpointing",
    ),
    "hardware": (
        "device",
        "precision",
        "dtype",
        "threads",
        "logprob_backend",
        "dist_timeout_s",
        "dp_replicate",
        "dp_shard",
    ),
    "rollout": (
        "rollout",
        "spool",
        "spawn_worker",
        "colocate",
        "ray_address",
        "sync_every",
        "max_async_steps",
        "max_inflight_requests",
        "partial_rollouts",
        "partial_pool_factor",
        "partial_prefill",
        "partial_cut",
        "max_token_staleness",
        "stale_policy",
    ),
    "checkpoint": ("checkpoint_every", "keep_checkpoints", "save_hf", "overwrite", "resume_from", "merge_lora"),
}
"""Top-level config fields -> their ``--help`` group; ``rollout_*`` fields join ``rollout`` by their prefix."""


def section_of(path: tuple[str, ...]) -> str:
    """The ``--help`` group of the config field at ``path``."""
    if len(path) > 1:
        return path[0]
    name = path[0]
    for section, names in TOP_SECTIONS.items():
        if name in names or name.startswith(section + "_"):
            return section
    return "run"


class Parser(argparse.ArgumentParser):
    """``argparse`` with one-line errors: ``prog: error: MESSAGE (--help lists the flags)``, exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name.startswith("align."):  # python -m align.sft: not "__main__.py: error"
            kwargs.setdefault("prog", spec.name.removesuffix(".__main__"))
        super().__init__(*args, allow_abbrev=False, add_help=False, **kwargs)
        self.add_argument(
            "-h", "--help", action=_ShortHelp, nargs=0, default=argparse.SUPPRESS, help="Flags by section, names only."
        )
        self.add_argument(
            "--help-all",
            action=_FullHelp,
            nargs=0,
            default=argparse.SUPPRESS,
            help="Every flag with its help and default.",
        )

    def error(self, message: str) -> NoReturn:
        hint = "" if message.startswith("--config") else " (--help lists the flags)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(unknown_message(extra, self.flag_names()))
        return ns

    def flag_names(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def format_short_help(self) -> str:
        """The usage line, the description, then each group's flag names wrapped (booleans as ``--x/--no-x``)."""
        run = f"python -m {self.prog}" if self.prog.startswith("align.") else self.prog
        out = [f"usage: {run} [--help] [--help-all] [--config FILE] [--FLAG VALUE ...]", ""]
        if self.description:
            out += [self.description, ""]
        out.append("--help-all shows every flag with its help and default; --config FILE reads flags from a file.")
        for group in self._action_groups:
            names = [
                "/".join(a.option_strings)
                if len(a.option_strings) > 1 and a.option_strings[0] != "-h"
                else a.option_strings[-1]
                for a in group._group_actions
                if a.option_strings
            ]
            if names:
                out += ["", f"{group.title}:"]
                out += textwrap.wrap(
                    ", ".join(names), 118, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False
                )
        return "\n".join(out) + "\n"


class _ShortHelp(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        sys.stdout.write(parser.format_short_help())
        parser.exit()


class _FullHelp(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        parser.print_help()
        parser.exit()


def unknown_message(extra: list[str], known: list[str]) -> str:
    """``unknown flag --grop (did you mean --group-size?)``: each unknown ``--flag`` with its closest known ones."""
    parts = []
    for arg in extra:
        if not arg.startswith("-"):
            continue
        flag = arg.split("=", 1)[0]
        close = [k for k in known if k.startswith(flag)][:3]  # a cut-short flag (abbreviations are not taken)
        close += [k for k in difflib.get_close_matches(flag, known, n=3, cutoff=0.6) if k not in close]
        close = close[:3]
        parts.append(f"unknown flag {flag}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    if not parts:
        return f"unexpected argument(s) {' '.join(extra)} (every value follows its --flag)"
    return "; ".join(parts)
