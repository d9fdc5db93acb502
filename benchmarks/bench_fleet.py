"""Rollout fleet (extras/vllm_rollout/fleet.py, Ray) vs the plain vLLM worker on the tiny model, side by side.

    .venv/bin/python benchmarks/bench_fleet.py [--rounds 5] [--requests 8] [--latency-requests 20] [--episodes 8]

The plain worker (1 engine) stays up for the whole run; first a fleet of 1 engine, then a fleet of 2 engines
runs beside it (vLLM CPU build, in-process engines; peak ~7 GB with the second pair). Every round measures
both servers back to back (order alternating), so load on this shared machine hits them alike; figures are
medians over rounds of the paired differences / ratios:
- routing overhead: sequential tiny requests (1 prompt, 1 token); the fleet's extra ms per request over the
  plain worker is the cost of the driver + Ray hop (target <= 5 ms);
- throughput: ``--requests`` requests (4 prompts x n=2 x 32 tokens) submitted at once, requests/s;
- turns: ``--episodes`` threads, each ``--turns`` requests (1 prompt x n=2 x 32 tokens) one after another, as
  multi-turn episodes or agents submit: requests arrive while others run (the plain worker admits them between
  two engine steps; so does a fleet engine, ``fleet_cut.EngineLoop``), turns/s.
On a 2-core CPU two engines get one core each (the fleet spreads vLLM's OpenMP binding); the plain worker runs
in the environment of the fleet's engine 0 (same core, one OpenMP thread: see ``spawn_plain``), so a pair
differs only by the routing. On a GPU machine each engine has its own GPU(s).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import numeric_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from align.model import Transformer, save_pretrained
from align.rollout.client import DEFAULT_VENV, REPO_ROOT, WORKER_SCRIPT, WorkerHandle, make_rollout_client, spawn_worker
from align.rollout.protocol import SamplingParams, generate_request, worker_env
from align.rollout.spool import Spool
from align.tasks import reverse

MAX_MODEL_LEN = 128  # the tiny reverse-task Qwen2 shape (3 layers, hidden 128) with room for 4 + 32 tokens
TINY = SamplingParams(n=1, max_tokens=1, temperature=0.0)
WORK = SamplingParams(n=2, max_tokens=32, seed=1)


def latency_ms(client, k: int) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        client.generate([[5, 6, 7]], TINY)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def requests_per_s(client, k: int) -> float:
    msgs = [generate_request([[5 + i, 6, 7, 8] for i in range(4)], WORK) for _ in range(k)]
    t0 = time.perf_counter()
    for m in msgs:
        client.spool.submit(m)
    for m in msgs:
        client.wait(m.id, expect="completions")
    return k / (time.perf_counter() - t0)


def turns_per_s(client, episodes: int, turns: int) -> float:
    def episode(i: int) -> None:
        for t in range(turns):
            client.generate([[5 + i % 4, 6, 7, 8 + t % 3]], WORK)  # ids < 12: the tiny vocabulary

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(episodes) as ex:
        list(ex.map(episode, range(episodes)))
    return episodes * turns / (time.perf_counter() - t0)


def spawn_plain(spool: Path, model: Path) -> WorkerHandle:
    """The plain worker, started as spawn_worker does, but in the environment of a fleet's engine actor: one
    OpenMP thread (Ray sets OMP_NUM_THREADS=1 in actors, and worker_env defaults a CPU worker to it: without it a
    1-token request took 147 ms instead of 43 ms here) and bound to the core of the fleet's engine 0."""
    sp = Spool(spool).ensure()
    env = worker_env(None, cache_dir=REPO_ROOT / ".cache" / "rollout", in_process=True)
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(min(os.sched_getaffinity(0))))
    cmd = [str(DEFAULT_VENV / "bin" / "python"), str(WORKER_SCRIPT), "--spool", str(sp.root), "--model", str(model),
           "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"]  # fmt: skip
    with open(spool.parent / "plain.log", "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    handle = WorkerHandle(proc, sp, spool.parent / "plain.log")
    handle.wait_ready(900)
    return handle


def paired(plain, fleet, args: argparse.Namespace) -> dict:
    for c in (plain, fleet):
        for _ in range(3):  # warm-up (the first generate compiles)
            c.generate([[5, 6, 7]], TINY)
    rows = []
    for r in range(args.rounds):
        order = [("plain", plain), ("fleet", fleet)][:: 1 if r % 2 == 0 else -1]
        row = {}
        for name, c in order:
            row[name] = (
                latency_ms(c, args.latency_requests),
                requests_per_s(c, args.requests),
                turns_per_s(c, args.episodes, args.turns),
            )
        rows.append(row)
    return {
        "plain_latency_ms": statistics.median(r["plain"][0] for r in rows),
        "fleet_latency_ms": statistics.median(r["fleet"][0] for r in rows),
        "overhead_ms": statistics.median(r["fleet"][0] - r["plain"][0] for r in rows),
        "plain_req_s": statistics.median(r["plain"][1] for r in rows),
        "fleet_req_s": statistics.median(r["fleet"][1] for r in rows),
        "fleet_over_plain": statistics.median(r["fleet"][1] / r["plain"][1] for r in rows),
        "plain_turns_s": statistics.median(r["plain"][2] for r in rows),
        "fleet_turns_s": statistics.median(r["fleet"][2] for r in rows),
        "turns_over_plain": statistics.median(r["fleet"][2] / r["plain"][2] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    numeric_flags(ap, rounds=5, requests=8, latency_requests=20, episodes=8, turns=4)
    args = ap.parse_args()
    tok = reverse.tokenizer()
    cfg = dataclasses.replace(reverse.model_config(tok), max_position_embeddings=MAX_MODEL_LEN)
    kw = {"in_process": True, "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "ready_timeout_s": 900}
    with tempfile.TemporaryDirectory(prefix="bench_fleet_") as d:
        model = save_pretrained(Transformer(cfg).init_weights(seed=0), Path(d) / "model")
        plain_h = spawn_plain(Path(d) / "plain", model)
        plain = make_rollout_client("spool", spool=Path(d) / "plain", timeout_s=900, worker=plain_h)
        res = {}
        try:
            for engines in (1, 2):
                spool = Path(d) / f"fleet{engines}"
                h = spawn_worker(spool, model=model, engines=engines, use_fleet=True, **kw)
                try:
                    fleet = make_rollout_client("spool", spool=spool, timeout_s=900, worker=h)
                    res[engines] = paired(plain, fleet, args)
                finally:
                    h.shutdown(grace_s=30)
                print(f"fleet of {engines} engine(s) vs plain worker | "
                      + " | ".join(f"{k} {v:.2f}" for k, v in res[engines].items()), flush=True)  # fmt: skip
        finally:
            plain_h.shutdown(grace_s=30)
    print(f"routing overhead per request (fleet of 1 - plain, paired median): {res[1]['overhead_ms']:.2f} ms "
          f"(target <= 5 ms)")  # fmt: skip
    print(f"requests/s vs the plain worker: fleet of 1 engine {res[1]['fleet_over_plain']:.2f}x, fleet of 2 engines "
          f"{res[2]['fleet_over_plain']:.2f}x (2 engines / 1 engine: "
          f"{res[2]['fleet_over_plain'] / res[1]['fleet_over_plain']:.2f}x)")  # fmt: skip
    print(f"turns/s ({args.episodes} episodes x {args.turns} turns) vs the plain worker: fleet of 1 engine "
          f"{res[1]['turns_over_plain']:.2f}x, fleet of 2 engines {res[2]['turns_over_plain']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
