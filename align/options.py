"""How a setting carries its flag's help: one definition for every config section (``TrainConfig``'s, ``SFTConfig``'s
and the sections they nest), whose ``metadata["help"]`` ``align.run.fields`` reads to build the flags' ``--help``."""

from __future__ import annotations


def flag_help(text: str) -> dict[str, str]:
    """A dataclass field's ``metadata``: the ``--help`` text of its flag."""
    return {"help": text}
