"""Peak memory and time of token logprobs + entropy, forward and backward, side by side in one run.

Variants: "plain" (log_softmax + gather + entropy, autograd), "torch" (align.kernels chunked torch path) and, on
CUDA, "triton" (align.kernels Triton kernel). Each measures loss = sum(logprobs) + sum(entropy); loss.backward(),
which is what training does. Memory: every (variant, V, dtype) runs one step alone in a fresh subprocess, so that
peaks do not leak into one another. Peak extra memory is measured beyond the logits that already exist and includes the logits' gradient
((N, V) in the logits' dtype, shown as "grad MB": no method can go below it):
  CPU:  peak resident set (VmHWM, reset through /proc/self/clear_refs just before the step) minus RSS before it
  CUDA: torch.cuda.max_memory_allocated minus memory allocated before the step
Time: one more subprocess per (V, dtype) runs the variants round-robin (so they share whatever load the machine has)
and reports the median of --reps steps each after a warm-up round; ratios are against "plain" in the same run.

    .venv/bin/python benchmarks/bench_logprobs.py                   # N=256, V in {32768, 151936}, fp32 and bf16
    .venv/bin/python benchmarks/bench_logprobs.py --n 1024 --vocab 151936 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MB = 2**20
BACKEND = {"plain": "reference", "torch": "torch", "triton": "triton"}


def _rss_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _setup(n: int, v: int, dtype_name: str, temperature: float, device: str):
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from align.kernels import token_logprobs

    def step(backend, logits, targets):
        logits.grad = None
        lp, ent = token_logprobs(logits, targets, temperature, backend=backend)
        (lp.sum() + ent.sum()).backward()
        if device == "cuda":
            torch.cuda.synchronize()

    torch.manual_seed(0)
    for backend in BACKEND.values():  # load code paths / compile kernels before measuring
        if backend != "triton" or device == "cuda":
            small = torch.randn(4, 64, device=device).to(getattr(torch, dtype_name)).requires_grad_()
            step(backend, small, torch.randint(0, 64, (4,), device=device))
    logits = (3 * torch.randn(n, v, device=device)).to(getattr(torch, dtype_name)).requires_grad_()  # (N, V)
    targets = torch.randint(0, v, (n,), device=device)  # (N,)
    return step, logits, targets


def child_memory(variant: str, n: int, v: int, dtype_name: str, temperature: float, device: str) -> dict:
    """Peak extra memory of one step, alone in this process."""
    import torch

    step, logits, targets = _setup(n, v, dtype_name, temperature, device)
    backend = BACKEND[variant]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(backend, logits, targets)
        peak = torch.cuda.max_memory_allocated() - before
    elif _reset_peak_rss():
        before = _rss_kb("VmRSS")
        step(backend, logits, targets)
        peak = (_rss_kb("VmHWM") - before) * 1024
    else:  # ru_maxrss of a fresh process: fine as long as the step is the biggest thing it ever did
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step(backend, logits, targets)
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"peak_mb": peak / MB, "grad_mb": logits.numel() * logits.element_size() / MB}


def child_time(
    variants: list[str], n: int, v: int, dtype_name: str, temperature: float, reps: int, device: str, threads: int
) -> dict:
    """Median step time of each variant, run round-robin in one process so that they share the machine's load."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    step, logits, targets = _setup(n, v, dtype_name, temperature, device)
    times = {variant: [] for variant in variants}
    for _ in range(reps + 1):  # the first round is a warm-up at full size
        for variant in variants:
            t0 = time.perf_counter()
            step(BACKEND[variant], logits, targets)
            times[variant].append(time.perf_counter() - t0)
    return {variant: statistics.median(t[1:]) for variant, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256, help="tokens (rows)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--threads", type=int, nargs="+", default=[1, 0], help="CPU timings at these thread counts (0: default)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    variants = ["plain", "torch"] + (["triton"] if device == "cuda" else [])
    if args.child == "time":
        v, dtype, threads = args.vocab[0], args.dtype[0], args.threads[0]
        print(json.dumps(child_time(variants, args.n, v, dtype, args.temperature, args.reps, device, threads)))
        return
    if args.child:
        print(json.dumps(child_memory(args.child, args.n, args.vocab[0], args.dtype[0], args.temperature, device)))
        return

    def run_child(what: str, v: int, dtype: str, threads: int = 0) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--n", str(args.n), "--vocab", str(v)]
        cmd += ["--dtype", dtype, "--temperature", str(args.temperature), "--reps", str(args.reps), "--device", device]
        cmd += ["--threads", str(threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    thread_counts = args.threads if device == "cpu" else [0]
    load = f" | load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus" if device == "cpu" else ""
    print(f"device {device} | N {args.n} | T {args.temperature} | reps {args.reps}{load}")
    print("step = forward + backward of sum(logprobs) + sum(entropy); peak = extra memory beyond the logits")
    names = [f"{t or torch.get_num_threads()}thr" for t in thread_counts] if device == "cpu" else [""]
    header = f"{'V':>7} {'dtype':>9} {'variant':>7} {'peak MB':>8} {'grad MB':>8} {'vs plain':>8}"
    header += "".join(f" {'time s ' + name:>12} {'vs plain':>8}" for name in names)
    print(header)
    print("-" * len(header))
    for v in args.vocab:
        for dtype in args.dtype:
            mem = {variant: run_child(variant, v, dtype) for variant in variants}
            times = [run_child("time", v, dtype, t) for t in thread_counts]
            for variant in variants:
                m = mem[variant]
                line = f"{v:>7} {dtype:>9} {variant:>7} {m['peak_mb']:>8.1f} {m['grad_mb']:>8.1f}"
                line += f" {m['peak_mb'] / mem['plain']['peak_mb']:>8.2f}"
                line += "".join(f" {t[variant]:>12.3f} {t[variant] / t['plain']:>8.2f}" for t in times)
                print(line, flush=True)


if __name__ == "__main__":
    main()
