"""Benchmark: how much of the Lean verifier's time a GRPO step hides behind generation (``--env lean``).

    .venv/bin/python benchmarks/bench_lean_overlap.py                # generation median 20 s, proofs 2 s: minutes
    .venv/bin/python benchmarks/bench_lean_overlap.py --scale 0.05   # every latency x 0.05: a quick run

One step's episodes (``--prompts`` x ``--group-size``, one turn each) run on the trainer's spool path
(``align.envs.episodes.EpisodeRunner``: one thread per episode, the environment's step as soon as its completion is
back) with the real ``--env lean`` environment and ``LeanVerifier`` pool of ``--workers`` (default: the group size)
REPLs. There is no Lean and no GPU here, so both latencies are simulated, and say so: the REPLs are
``extras/vllm_rollout/lean_repl_standin.py`` with a log-normal delay per proof (median ``--proof-median`` 2 s,
sigma 1: the long tail of Mathlib proofs), and the "engine" is a client whose every completion arrives after a
log-normal time (median ``--gen-median`` 20 s, sigma ``--gen-sigma`` 0.5: a batch decoding completions of varied
lengths at once, as vLLM does), both drawn from seeds, so every variant gets the same work.

Three walls: ``gen`` (the step with instant proofs), ``verify`` (the step's proofs alone on the pool, all at once:
what a barrier design adds after generation) and ``step`` (generation and verification overlapped).
``hidden = (gen + verify - step) / verify``: 1 when no verification time is left after generation, 0 when it all
comes after it.
"""

from __future__ import annotations

import argparse
import dataclasses
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
STMT = "theorem bench_t (x : ℕ) (h : x = 2) : x + x = 4 := by\n"


def completion(key: int) -> str:
    """Episode ``key``'s answer: a distinct proof text (the stand-in draws its delay from the text)."""
    return f"```lean4\ntheorem bench_t (x : ℕ) (h : x = 2) : x + x = 4 := by\n  subst h\n  norm_num [bench_{key}]\n```"


class SimulatedEngine:
    """A rollout client (the spool path's ``generate``) whose completion of episode ``key`` arrives after a
    log-normal delay drawn from its seed; its one token id is ``key`` (``decode`` maps it to ``completion(key)``)."""

    def __init__(self, median: float, sigma: float, scale: float) -> None:
        self.median, self.sigma, self.scale = median, sigma, scale

    def generate(self, prompts: list, params) -> list:
        from align.rollout.protocol import Completion

        key = params.seed  # the runner's per-episode seed
        time.sleep(self.scale * random.Random(key).lognormvariate(math.log(self.median), self.sigma))
        return [Completion(0, 0, [key], [0.0], "stop", [0.0], 0)]


def run_step(verifier, engine, prompts: int, group: int, seed: int) -> tuple[float, list[str]]:
    """Wall time of one step's episodes on the spool path; the completions it verified."""
    from align.char_tokenizer import CharTokenizer
    from align.chat import TurnRenderer
    from align.envs.config import EnvConfig
    from align.envs.episodes import EpisodeRunner
    from align.envs.runner import EnvRunner
    from align.lean.env import LeanEnv
    from align.rollout.protocol import SamplingParams

    class BenchEnv(LeanEnv):  # a plain-string first prompt: the bench's tokenizer has no chat template
        def reset(self) -> str:
            return "p"

    tok = CharTokenizer("p")
    texts: list[str] = []

    def decode(ids: list[int]) -> str:
        texts.append(completion(ids[0]))
        return texts[-1]

    renderer = TurnRenderer(tok)
    rows = [{"name": f"p{i}", "formal_statement": STMT} for i in range(prompts)]
    with EnvRunner(None, BenchEnv.bind(verifier), 0, 0.0) as envs:
        runner = EpisodeRunner(envs, renderer, decode, EnvConfig(max_turns=1), 16, 1 << 20)
        t0 = time.perf_counter()
        eps = runner.run(engine, rows, group, dataclasses.replace(SamplingParams(n=group, max_tokens=16), seed=seed))
        wall = time.perf_counter() - t0
    bad = [e for e in eps if e.error or e.env_reward != 1.0]
    if bad:
        raise SystemExit(f"{len(bad)} episodes not verified, e.g. {bad[0].error or bad[0].turns}")
    return wall, texts


def main(argv: list[str] | None = None) -> int:
    from align.lean.config import LeanConfig
    from align.lean.verify import LeanVerifier

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="*", default=None, help="pool sizes (default: the group size)")
    p.add_argument("--gen-median", type=float, default=20.0, help="median seconds until a completion is back")
    p.add_argument("--gen-sigma", type=float, default=0.5)
    p.add_argument("--proof-median", type=float, default=2.0, help="median seconds per proof")
    p.add_argument("--proof-sigma", type=float, default=1.0)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every latency (0.05: a quick run)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    engine = SimulatedEngine(args.gen_median, args.gen_sigma, args.scale)
    print(f"{args.prompts} prompts x {args.group_size} episodes; generation median {args.gen_median * args.scale:.2f} "
          f"s (sigma {args.gen_sigma}), proofs median {args.proof_median * args.scale:.2f} s (sigma "
          f"{args.proof_sigma})")  # fmt: skip
    print(f"{'N':>3} {'gen_s':>7} {'verify_s':>9} {'step_s':>7} {'barrier_s':>10} {'hidden':>7}")
    with tempfile.TemporaryDirectory() as d:
        replies = Path(d) / "replies.json"
        replies.write_text(json.dumps({"rules": [], "default": {"env": 1}}))
        instant = f"{sys.executable} {STANDIN} --replies {replies}"
        slow = (f"{instant} --latency-median {args.proof_median} --latency-sigma {args.proof_sigma} "
                f"--scale {args.scale} --seed {args.seed}")  # fmt: skip
        for n in args.workers or [args.group_size]:
            walls = {}
            for name, cmd in (("gen", instant), ("step", slow)):
                v = LeanVerifier(LeanConfig(repl=cmd, workers=n, timeout_s=600.0, max_uses=0))
                try:
                    walls[name], texts = run_step(v, engine, args.prompts, args.group_size, args.seed)
                    if name == "step":  # the same proofs alone on a pool of n (fresh processes: no warm state)
                        v.close()
                        v = LeanVerifier(LeanConfig(repl=cmd, workers=n, timeout_s=600.0, max_uses=0))
                        t0 = time.perf_counter()
                        assert all(x.ok for x in v.verify([(STMT, t) for t in texts]))
                        walls["verify"] = time.perf_counter() - t0
                finally:
                    v.close()
            hidden = (walls["gen"] + walls["verify"] - walls["step"]) / walls["verify"]
            print(f"{n:>3} {walls['gen']:>7.2f} {walls['verify']:>9.2f} {walls['step']:>7.2f} "
                  f"{walls['gen'] + walls['verify']:>10.2f} {hidden:>7.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
