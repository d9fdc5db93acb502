"""Benchmark: Lean verification throughput of a pool of N REPL processes (``LeanVerifier``), N = 1, 2, 4, 8.

    .venv/bin/python benchmarks/bench_lean.py                 # median 2 s per proof: a few minutes
    .venv/bin/python benchmarks/bench_lean.py --scale 0.05    # every latency x 0.05: a quick run

There is no Lean here: the REPLs are ``extras/vllm_rollout/lean_repl_standin.py`` (the real wire format over
recorded replies) with a log-normal latency per proof (``--median`` 2 s, ``--sigma`` 1.0: p90 ~7 s, p99 ~20 s,
the long tail of Mathlib proofs), drawn from the proof text so every N gets exactly the same work. The stand-ins
sleep instead of computing, so this measures the pool (dispatch, restarts, the straggler tail), not Lean's CPU:
on a real machine N is bounded by cores and memory (a Mathlib REPL holds several GB).

Per N it prints wall time, proofs/s, the speed-up over N = 1 and the ideal speed-up for this work list
(``sum / max(sum / N, longest)``: no pool can beat its longest proof).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STANDIN = ROOT / "extras" / "vllm_rollout" / "lean_repl_standin.py"
STMT = "theorem bench_t (x : ℕ) (h : x = 2) : x + x = 4 := by sorry"


def latencies(n: int, median: float, sigma: float, seed: int) -> list[float]:
    """The same draws as the stand-in's (per proof text); only for the ideal bound printed beside the figures."""
    import hashlib

    out = []
    for i in range(n):
        text = proof_text(i)
        digest = hashlib.sha256(f"{seed}\x00{text}".encode()).digest()
        out.append(random.Random(digest).lognormvariate(math.log(median), sigma))
    return out


def proof_text(i: int) -> str:
    """What the REPL receives for proof ``i`` (the stand-in's latency key): ``compile_view`` of its full code."""
    from align.lean import goedel

    return goedel.compile_view(goedel.goedel_full_code(STMT, completion(i)))


def completion(i: int) -> str:
    return "```lean4\n" + STMT.replace(":= by sorry", f":= by\n  subst h\n  norm_num [bench_{i}]") + "\n```"


def main(argv: list[str] | None = None) -> int:
    from align.lean.config import LeanConfig
    from align.lean.verify import LeanVerifier

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--proofs", type=int, default=64)
    p.add_argument("--pools", type=int, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--median", type=float, default=2.0, help="median seconds per proof")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal shape (the tail)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every latency (0.05: a quick run)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        replies = Path(d) / "replies.json"
        replies.write_text(json.dumps({"rules": [{"match": "norm_num", "reply": {"env": 1}}], "default": {"env": 1}}))
        cmd = (
            f"{sys.executable} {STANDIN} --replies {replies} --latency-median {args.median} "
            f"--latency-sigma {args.sigma} --scale {args.scale} --seed {args.seed}"
        )
        items = [(STMT, completion(i)) for i in range(args.proofs)]
        lat = [args.scale * x for x in latencies(args.proofs, args.median, args.sigma, args.seed)]
        total, longest = sum(lat), max(lat)
        print(
            f"{args.proofs} proofs, latency median {args.median * args.scale:.3f} s, mean {total / len(lat):.3f} s, "
            f"max {longest:.3f} s (sum {total:.1f} s)"
        )
        print(f"{'N':>3} {'wall_s':>8} {'proofs/s':>9} {'speed-up':>9} {'ideal':>6}")
        base = None
        for n in args.pools:
            v = LeanVerifier(LeanConfig(repl=cmd, workers=n, timeout_s=max(60.0, 10 * longest), max_uses=0))
            try:
                t0 = time.perf_counter()
                out = v.verify(items)
                wall = time.perf_counter() - t0
            finally:
                v.close()
            bad = [x for x in out if not x.ok]
            if bad:
                raise SystemExit(f"N={n}: {len(bad)} proofs not accepted, e.g. {bad[0]}")
            base = base or wall
            ideal = total / max(total / n, longest)
            print(f"{n:>3} {wall:>8.2f} {args.proofs / wall:>9.2f} {base / wall:>9.2f} {ideal:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
