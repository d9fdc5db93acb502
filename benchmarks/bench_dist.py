"""1 vs N torchrun ranks (FSDP2, ``align.dist``): training step time and per-rank training-state memory.

The 31M Qwen2 shape (hidden 512, 8 layers, V 8192, untied), random weights, fp32, AdamW; one step =
``align.learner.optimize`` on a fixed batch of --rows completions x --seq tokens (the rows split across ranks, the
normalisers all-reduced), sampling excluded. Per rank it reports the bytes of the local shards of parameters,
gradients and AdamW state (FSDP2: ~1/N of the whole; target <= 0.6 with 2 ranks) and the median step time.

    .venv/bin/python benchmarks/bench_dist.py                 # 1 and 2 gloo ranks on the CPU
    python3 benchmarks/bench_dist.py --ranks 1 2 4 --device cuda   # NCCL, one GPU per rank
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import numeric_flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MB = 2**20
SHAPE = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False}  # fmt: skip


def local_bytes(tensors) -> int:
    n = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        n += t.numel() * t.element_size()
    return n


def worker(args: argparse.Namespace) -> None:
    import torch

    from align import dist, learner
    from align.device import Placement, make_optimizer
    from align.model import ModelConfig, Transformer
    from align.train import TrainConfig

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(device=args.device, prompts_per_step=args.rows // 2, group_size=2, micro_batch_size=args.rows,
                      max_tokens=args.seq, grad_clip=1.0)  # fmt: skip
    cfg.eval.eval_interval = 0
    dist.setup(cfg)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    place = Placement(device, "fp32")
    model_cfg = ModelConfig(model_type="qwen2", qkv_bias=True, max_position_embeddings=1024, **SHAPE)
    policy = Transformer(model_cfg).init_weights(seed=0).to(device)
    policy = dist.shard(policy, "fp32")
    opt = make_optimizer(list(policy.parameters()), place, lr=1e-5, betas=[0.9, 0.99], weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    N, L = args.rows, args.seq
    inputs = torch.randint(3, SHAPE["vocab_size"], (N, L), generator=g)  # (N, L)
    targets = torch.randint(3, SHAPE["vocab_size"], (N, L), generator=g)  # (N, L)
    mask = torch.zeros(N, L, dtype=torch.bool)
    mask[:, L // 4 :] = True
    batch = learner.Batch(inputs.to(device), targets.to(device), mask.to(device),
                          torch.randn(N, generator=g).to(device), torch.zeros(N, L, device=device))  # fmt: skip
    times = []
    for i in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        learner.optimize(policy, None, opt, cfg, place, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step warms up (optimizer state allocated)
            times.append(time.perf_counter() - t0)
    params = local_bytes(policy.parameters())
    grads = local_bytes(p.grad for p in policy.parameters() if p.grad is not None)
    state = local_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    rec = {"ranks": dist.world(), "rank": dist.rank(), "params_MB": params / MB, "grads_MB": grads / MB,
           "adam_MB": state / MB, "state_MB": (params + grads + state) / MB,
           "step_s": statistics.median(times)}  # fmt: skip
    for r in dist.gather(rec):
        if dist.is_main():
            print("RESULT " + json.dumps(r), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    numeric_flags(ap, rows=8, seq=128, steps=3, threads=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    own = [a for a in sys.argv[1:] if a != "--worker"]
    results = {}
    for n in args.ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               os.path.abspath(__file__), "--worker", *own]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(f"{n} rank(s) failed:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
        recs = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        results[n] = recs
        for r in recs:
            print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
    base = max(r["state_MB"] for r in results[args.ranks[0]])
    for n, recs in results.items():
        worst = max(r["state_MB"] for r in recs)
        step = max(r["step_s"] for r in recs)
        print(f"{n} rank(s): per-rank params+grads+AdamW {worst:.1f} MB = {worst / base:.3f}x of {args.ranks[0]} "
              f"rank(s); step {step:.3f}s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
