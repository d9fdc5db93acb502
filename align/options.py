"""How a setting carries its flag's help: one definition for every config section (``TrainConfig``'s, ``SFTConfig``'s
and the sections they nest), whose ``metadata["help"]`` ``align.run.fields`` reads to build the flags' ``--help``.

``flag(4, "...")`` is the common field, ``field(default=4, metadata=flag_help("..."))``; a field with a
``default_factory`` or more metadata (an ``action``) writes ``field(...)`` with ``flag_help``."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def flag_help(text: str) -> dict[str, str]:
    """A dataclass field's ``metadata``: the ``--help`` text of its flag."""
    return {"help": text}


def flag(default: Any, help: str) -> Any:
    """A dataclass field with an immutable ``default`` and the ``--help`` text of its flag."""
    return field(default=default, metadata=flag_help(help))
