"""Asynchronous rollouts (--max-async-steps K): steps/s of the GRPO loop for K = 0, 1, 2, side by side in one run.

    .venv/bin/python benchmarks/bench_async.py [--steps 8] [--hidden 256] [--layers 4]

The trainer (this process, one torch thread, pinned to the first core) and a vLLM CPU spool worker (its own
process, one OpenMP thread bound to the second core with VLLM_CPU_OMP_THREADS_BIND) run side by side; the worker
stays up for all runs (one engine start). Each run trains a fresh copy of the same random-weight model on the
reverse task for ``--steps`` steps with the same prompts and seeds; only K differs. Printed per K: steps/s over the
steps after the first (compile/warm-up excluded), the trainer's wait fraction (time blocked on rollouts / loop
time), mean generation and training seconds per step, and the speedup over K = 0. The model shape is chosen so
that generating a batch and training on it take comparable time (tune with --hidden / --layers / --max-tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import numeric_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from align.model import Transformer, save_pretrained
from align.rollout.client import DEFAULT_VENV, REPO_ROOT, WORKER_SCRIPT, WorkerHandle
from align.rollout.protocol import worker_env
from align.rollout.spool import Spool
from align.tasks import reverse
from align.train import TrainConfig, train


def spawn(spool: Path, model: Path, core: int, max_len: int) -> WorkerHandle:
    """The worker on one core: one OpenMP thread (worker_env drops OMP_NUM_THREADS), bound to ``core``."""
    sp = Spool(spool).ensure()
    env = worker_env(None, cache_dir=REPO_ROOT / ".cache" / "rollout", in_process=True)
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core))
    cmd = [str(DEFAULT_VENV / "bin" / "python"), str(WORKER_SCRIPT), "--spool", str(sp.root), "--model", str(model),
           "--max-model-len", str(max_len), "--dtype", "float32"]  # fmt: skip
    log = spool.parent / "worker.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO_ROOT)
        )
    handle = WorkerHandle(proc, sp, log)
    handle.wait_ready(900)
    return handle


def run(K: int, args: argparse.Namespace, model: Path, spool: Path, tmp: Path) -> dict:
    tok = reverse.tokenizer()
    cfg = TrainConfig(
        out=str(tmp / f"k{K}"),
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        max_tokens=args.max_tokens,
        lr=1e-3,
        warmup_steps=0,
        rollout="spool",
        spool=str(spool),
        spawn_worker=False,
        checkpoint_every=0,
        max_async_steps=K,
        threads=1,
    )
    cfg.eval.eval_interval = 0
    t0 = time.monotonic()
    train(
        cfg,
        model=str(model),
        tokenizer=tok,
        prompts=reverse.prompts(256, "train"),
        reward=lambda prompt, completion, **_: float(completion == prompt[:-1][::-1]),
    )
    wall = time.monotonic() - t0
    recs = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()][1:]
    loop = sum(r["step_time"] for r in recs)
    wait = sum(r.get("async/trainer_wait_s", r["rollout_time"]) for r in recs)
    return {
        "K": K,
        "steps_per_s": len(recs) / loop,
        "wait_frac": wait / loop,
        "train_s": (loop - wait) / len(recs),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    numeric_flags(ap, steps=8, prompts=8, group=8, max_tokens=12, hidden=256, layers=4)
    ap.add_argument("--ks", default="0,1,2")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("bench_async needs 2 cores (one for the trainer, one for the worker)")
    tok = reverse.tokenizer()
    mcfg = reverse.model_config(tok)
    mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_hidden_layers = args.hidden, 2 * args.hidden, args.layers
    mcfg.num_attention_heads, mcfg.head_dim = args.hidden // 32, 32
    with tempfile.TemporaryDirectory(prefix="bench_async_") as d:
        tmp = Path(d)
        model = save_pretrained(Transformer(mcfg).init_weights(seed=0), tmp / "model")
        tok.save(model)
        worker = spawn(tmp / "spool", model, cores[1], mcfg.max_position_embeddings)
        try:
            os.sched_setaffinity(0, {cores[0]})  # after the spawn: the worker keeps its own core
            torch.set_num_threads(1)
            rows = [run(int(k), args, model, tmp / "spool", tmp) for k in args.ks.split(",")]
        finally:
            worker.shutdown(grace_s=5)
    base = next((r for r in rows if r["K"] == 0), rows[0])["steps_per_s"]
    print(
        f"model: hidden {args.hidden}, layers {args.layers}; batch {args.prompts}x{args.group}, {args.max_tokens} tokens"
    )
    print("K | steps/s | speedup vs K=0 | trainer wait fraction | train s/step")
    for r in rows:
        print(
            f"{r['K']} | {r['steps_per_s']:.3f} | {r['steps_per_s'] / base:.2f}x | {r['wait_frac']:.2f} | "
            f"{r['train_s']:.3f}"
        )


if __name__ == "__main__":
    main()
