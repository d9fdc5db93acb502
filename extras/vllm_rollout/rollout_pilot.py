"""End-to-end pilot of the vLLM rollout worker: start it on a model, drive a synthetic load through the spool,
print throughput, latency and weight-sync time.

Runs under ``.venv-rollout`` and, like the worker, imports only ``align.rollout.protocol`` from align:

    .venv-rollout/bin/python extras/vllm_rollout/rollout_pilot.py --model <hf dir> \\
        --requests 16 --prompts-per-request 8 --n 4 --prompt-len 64 --max-tokens 128 --sync-every 4

Load: ``--concurrency`` generate requests in flight (random token prompts, seeded); after every
``--sync-every`` answered requests a ``sync_weights`` command to ``--sync-to`` (default: the model itself,
through a committed symlink copy) is queued behind them, as a trainer would after an optimizer step.
Output: one ``key value | ...`` summary line (and ``--json`` for the full record).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from align.rollout import protocol as P

WORKER = Path(__file__).resolve().parent / "rollout_worker.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--spool", default=None, help="spool directory (default: a fresh temp dir)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompts-per-request", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="completions per prompt (the GRPO group size)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=2, help="generate requests in flight")
    ap.add_argument("--sync-every", type=int, default=4, help="answered requests between weight syncs (0: never)")
    ap.add_argument("--sync-to", default=None, help="committed snapshot to sync to (default: the model)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw")
    ap.add_argument("--in-process", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=0 (faster start on CPU)")
    ap.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES for the worker")
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "rollout"))
    ap.add_argument("--timeout-s", type=float, default=900.0, help="limit for startup and for each answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the full result record here")
    return ap.parse_args(argv)


def committed_alias(model: Path, where: Path) -> Path:
    """A committed snapshot directory of symlinks to ``model``'s files (so the pilot can sync to the same weights)."""
    if P.snapshot_marker(model) is not None:
        return model
    alias = where / "snapshot"
    alias.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not (alias / f.name).exists():
            (alias / f.name).symlink_to(f.resolve())
    (alias / ".complete").write_text('{"format": "pilot-alias"}')
    return alias


class Pilot:
    def __init__(self, args: argparse.Namespace, spool_dir: Path) -> None:
        self.args, self.spool = args, P.Spool(spool_dir).ensure()
        self.proc: subprocess.Popen | None = None
        self.log_path = spool_dir / "worker.log"

    def start(self) -> float:
        a = self.args
        cmd = [sys.executable, str(WORKER), "--spool", str(self.spool.root), "--model", str(Path(a.model).resolve())]
        cmd += ["--max-model-len", str(a.max_model_len), "--dtype", a.dtype, "--logprobs-mode", a.logprobs_mode]
        cmd += ["--log-path", str(self.log_path)]
        env = P.worker_env(gpu=a.gpu, cache_dir=a.cache_dir, in_process=a.in_process)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while True:
            hb = self.spool.read_heartbeat()
            if hb and hb.get("pid") == self.proc.pid and hb.get("state") == "ready":
                return time.perf_counter() - t0
            self.check_alive()
            if time.perf_counter() - t0 > a.timeout_s:
                raise RuntimeError(f"worker not ready within {a.timeout_s:.0f} s; log {self.log_path}")
            time.sleep(0.1)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"worker exited with code {self.proc.returncode}; log {self.log_path}:\n{tail}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.spool.submit(P.shutdown_request())
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # reap the engine core children too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
                time.sleep(2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def run_load(self) -> dict:
        a = self.args
        rng = random.Random(a.seed)
        vocab = int(json.loads((Path(a.model) / "config.json").read_text())["vocab_size"])
        sync_to = committed_alias(Path(a.model).resolve(), self.spool.root)
        base = P.SamplingParams(n=a.n, temperature=a.temperature, max_tokens=a.max_tokens)
        inflight: dict[str, tuple[str, float]] = {}  # id -> (kind, submitted at)
        latencies, tokens, syncs, queue = [], 0, [], []
        submitted = answered = version = 0
        t0 = time.perf_counter()
        while answered < a.requests or inflight:
            while submitted < a.requests and sum(k == "generate" for k, _ in inflight.values()) < a.concurrency:
                prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts_per_request)]
                msg = P.generate_request(prompts, dataclasses.replace(base, seed=a.seed + submitted))
                self.spool.submit(msg)
                inflight[msg.id] = ("generate", time.perf_counter())
                submitted += 1
            for rid, (kind, sent) in list(inflight.items()):
                reply = self.spool.take_response(rid)
                if reply is None:
                    continue
                del inflight[rid]
                if reply.kind == "error":
                    raise RuntimeError(f"worker error on {rid}: {reply.body}")
                if kind == "generate":
                    answered += 1
                    latencies.append(time.perf_counter() - sent)
                    tokens += reply.body["timings"]["completion_tokens"]
                    queue.append(reply.body["timings"]["queue_s"])
                    if a.sync_every and answered % a.sync_every == 0 and answered < a.requests:
                        version += 1
                        sync = P.sync_request(sync_to, version)
                        self.spool.submit(sync)
                        inflight[sync.id] = ("sync", time.perf_counter())
                else:
                    syncs.append({"seconds": reply.body["seconds"], "method": reply.body["method"]})
            self.check_alive()
            if inflight and time.perf_counter() - min(s for _, s in inflight.values()) > a.timeout_s:
                raise RuntimeError(f"no answer within {a.timeout_s:.0f} s; log {self.log_path}")
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        q = statistics.quantiles(latencies, n=10, method="inclusive") if len(latencies) > 1 else latencies * 9
        sync_s = [s["seconds"] for s in syncs]
        return {
            "requests": answered, "completions": answered * a.prompts_per_request * a.n, "completion_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "latency_p50_s": statistics.median(latencies),
            "latency_p90_s": q[8], "latency_max_s": max(latencies), "queue_mean_s": statistics.fmean(queue),
            "syncs": len(syncs), "sync_mean_s": statistics.fmean(sync_s) if sync_s else None,
            "sync_max_s": max(sync_s) if sync_s else None, "sync_methods": sorted({s["method"] for s in syncs}),
        }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    P.check_hf_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="align-pilot-") as tmp:
        spool = Path(args.spool) if args.spool else Path(tmp) / "spool"
        pilot = Pilot(args, spool)
        try:
            startup = pilot.start()
            result = {"startup_s": startup, **pilot.run_load()}
        finally:
            pilot.stop()
    result["config"] = vars(args)
    line = " | ".join(
        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items() if k != "config"
    )
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
