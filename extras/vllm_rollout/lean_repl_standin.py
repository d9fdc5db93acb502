"""A stand-in for the Lean REPL (``lake exe repl``) that replays recorded REPL JSON. FOR TESTS ONLY.

There is no Lean with Mathlib on the CI machines, so tests point ``pipeline_gen_verify.py --repl-cmd`` at
this script. It speaks the REPL's wire format (one JSON command per blank-line-terminated block on stdin;
pretty-printed JSON reply followed by an empty line on stdout) but does not check anything: each reply is
the first rule of ``--replies FILE`` whose regex matches the command text (``re.search``), else ``default``.
Replies should be recorded from the real REPL (tests/lean_fixtures/repl_recorded.json).

* a command without ``env`` is the import command: reply ``{"env": <new>}``;
* ``#print axioms NAME`` without a matching rule: reply the standard-axioms info message;
* ``"env"`` in a reply is replaced by a fresh environment number, as the REPL does.

replies file: ``{"rules": [{"match": REGEX, "reply": {...}}], "default": {...}}``
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def serve(rules: list[dict], default: dict, stdin=sys.stdin, stdout=sys.stdout) -> None:
    env = -1
    block: list[str] = []
    for line in stdin:
        if line.strip():
            block.append(line)
            continue
        if not block:
            continue
        cmd = json.loads("".join(block))
        block = []
        text = cmd.get("cmd", "")
        env += 1
        if "env" not in cmd:
            reply: dict = {"env": env}
        else:
            reply = next((r["reply"] for r in rules if re.search(r["match"], text)), None)
            if reply is None and text.startswith("#print axioms"):
                name = text.split()[-1]
                reply = {
                    "messages": [
                        {
                            "severity": "info",
                            "pos": {"line": 1, "column": 0},
                            "endPos": {"line": 1, "column": 13},
                            "data": f"'{name}' depends on axioms: [propext, Classical.choice, Quot.sound]",
                        }
                    ],
                    "env": 0,
                }
            reply = dict(default if reply is None else reply)
            if "env" in reply:
                reply["env"] = env
        stdout.write(json.dumps(reply, ensure_ascii=False, indent=1) + "\n\n")
        stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="replay recorded Lean REPL JSON (tests only)")
    p.add_argument("--replies", required=True)
    a = p.parse_args(argv)
    with open(a.replies, encoding="utf-8") as f:
        spec = json.load(f)
    serve(spec.get("rules", []), spec["default"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
