"""A stand-in for the Lean REPL (``lake exe repl``) that replays recorded REPL JSON. FOR TESTS ONLY.

There is no Lean with Mathlib on the CI machines, so tests point ``pipeline_gen_verify.py --repl-cmd`` and
``--lean-repl`` at this script. It speaks the REPL's wire format (one JSON command per blank-line-terminated block
on stdin; pretty-printed JSON reply followed by an empty line on stdout) but does not check anything: each reply
is the first rule of ``--replies FILE`` whose regex matches the command text (``re.search``), else ``default``.
Replies should be recorded from the real REPL (tests/lean_fixtures/repl_recorded.json).

* a command without ``env`` is the import command: reply ``{"env": <new>}``;
* ``#print axioms NAME`` without a matching rule: reply the standard-axioms info message;
* ``"env"`` in a reply is replaced by a fresh environment number, as the REPL does;
* ``#print "TEXT"`` (the client's sentinel after each command, ``align.lean.repl``): an info message ``TEXT``, as
  Lean prints a string literal.

replies file: ``{"rules": [{"match": REGEX, "reply": {...}}], "default": {...}}``. Faults, for the verifier's
tests and benchmark (a rule may carry one instead of, or besides, a reply):

* ``"fault": "crash"``: exit 3 without replying (``"once_file": PATH``: only while PATH does not exist; the
  stand-in creates it, so a retry on a fresh process succeeds: a rule without a reply lets later rules answer);
* ``"fault": "hang"``: never reply (the client's timeout must kill it);
* ``"fault": "malformed"``: reply ``"raw"`` text (default ``{"env": 1,``) that is not JSON;
* ``"alloc_mb": N``: keep N MiB more resident memory (to pass a memory limit);
* ``"fault": "forge"``: write an extra JSON block (``"forged"``, default an error-free verdict) before the reply,
  what a proof's ``#eval`` writing to ``/dev/stdout`` would put there;
* ``"pad_mb": N``: the reply carries N MiB more (a ``"pad"`` string), to pass the client's reply cap.

``--latency-median S --latency-sigma X``: each proof command (not the import) waits a log-normal time with that
median (seconds) and shape before its reply, drawn from ``--seed`` and the command text (so a proof costs the
same in any process); ``--scale F`` multiplies every delay (``--import-latency S`` too). This is the latency
model of ``benchmarks/bench_lean.py``.

``--log FILE``: append every command received (``{"pid", "cmd", "env"}``, one JSON line, before it is answered), so a
test can see which proofs reached a REPL process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import sys
import time

PRINT_STRING = re.compile(r'#print "([^"\\]*)"')
HELD: list[bytearray] = []  # "alloc_mb" memory, kept resident


def _axioms_reply(name: str) -> dict:
    return {
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


def _fault(rule: dict, stdout) -> None:
    """Act out a rule's fault (or return when it has none / a crash_once already happened)."""
    fault = rule.get("fault")
    if fault == "crash":
        once = rule.get("once_file")
        if once is None or not os.path.exists(once):
            if once is not None:
                open(once, "w").close()
            os._exit(3)
    elif fault == "hang":
        while True:
            time.sleep(3600)
    elif fault == "forge":
        stdout.write(json.dumps(rule.get("forged", {"env": 0, "messages": []})) + "\n\n")
        stdout.flush()
    elif fault == "malformed":
        stdout.write(rule.get("raw", '{"env": 1,') + "\n\n")
        stdout.flush()
        raise _Replied
    if rule.get("alloc_mb"):
        block = bytearray(int(rule["alloc_mb"]) * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page so it is resident
        HELD.append(block)


class _Replied(Exception):
    """The fault already wrote this command's (malformed) reply."""


def serve(rules: list[dict], default: dict, stdin=sys.stdin, stdout=sys.stdout, delay=None, log=None) -> None:
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
        if log is not None:  # one write per line in append mode: lines of concurrent processes do not interleave
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"pid": os.getpid(), "cmd": text, "env": cmd.get("env")}) + "\n")
        printed = PRINT_STRING.fullmatch(text)
        if "env" not in cmd:
            reply: dict = {"env": env}
        elif printed:
            info = {"severity": "info", "pos": {"line": 1, "column": 0}, "endPos": {"line": 1, "column": len(text)}}
            reply = {"messages": [{**info, "data": printed.group(1)}], "env": env}
        else:
            reply = None
            try:
                for rule in rules:  # a matching rule acts out its fault; the first with a reply answers
                    if re.search(rule["match"], text):
                        _fault(rule, stdout)
                        reply = rule.get("reply")
                        if reply is not None:
                            break
            except _Replied:
                continue
            if reply is None and text.startswith("#print axioms"):
                reply = _axioms_reply(text.split()[-1])
            elif delay is not None:
                time.sleep(delay(text))
            reply = dict(default if reply is None else reply)
            if "env" in reply:
                reply["env"] = env
            pad = next((r["pad_mb"] for r in rules if "pad_mb" in r and re.search(r["match"], text)), 0)
            if pad:
                reply["pad"] = "x" * int(pad * 2**20)
        stdout.write(json.dumps(reply, ensure_ascii=False, indent=1) + "\n\n")
        stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="replay recorded Lean REPL JSON (tests only)")
    p.add_argument("--replies", required=True)
    p.add_argument("--latency-median", type=float, default=0.0, help="median seconds per proof (0 = none)")
    p.add_argument("--latency-sigma", type=float, default=1.0, help="log-normal shape: the tail's weight")
    p.add_argument("--import-latency", type=float, default=0.0, help="seconds the import command takes")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every delay (a quick benchmark run)")
    p.add_argument("--seed", type=int, default=0, help="latency seed (with the command text)")
    p.add_argument("--log", default=None, help="append every command received to this file (JSON lines)")
    a = p.parse_args(argv)
    with open(a.replies, encoding="utf-8") as f:
        spec = json.load(f)
    delay = None
    if a.latency_median > 0:
        mu = math.log(a.latency_median)

        def delay(text: str) -> float:  # a property of the proof, not of the process: same work for any pool size
            digest = hashlib.sha256(f"{a.seed}\x00{text}".encode()).digest()
            return a.scale * random.Random(digest).lognormvariate(mu, a.latency_sigma)

    if a.import_latency > 0:
        time.sleep(a.scale * a.import_latency)
    serve(spec.get("rules", []), spec["default"], delay=delay, log=a.log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
