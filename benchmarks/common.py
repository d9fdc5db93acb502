"""What the benchmarks share: their numeric flags declared as one call, each benchmark with its own defaults.

``numeric_flags(p, steps=8, max_tokens=12)`` is ``p.add_argument("--steps", type=int, default=8)`` and
``p.add_argument("--max-tokens", type=int, default=12)``: the flag is the keyword with dashes, its type the
default's. A flag with a help line, a choice or an action is written out with ``add_argument`` beside it.
``tests/test_docs.py`` reads these keywords as flags, as it reads ``add_argument``'s.
"""

from __future__ import annotations

import argparse


def numeric_flags(p: argparse.ArgumentParser, /, **defaults: float) -> None:
    """One ``--name`` flag per keyword (``max_tokens`` -> ``--max-tokens``), typed and defaulted by its value."""
    for name, default in defaults.items():
        if type(default) not in (int, float):
            raise TypeError(f"numeric_flags: {name}={default!r} is not an int or a float")
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
