"""Decode-sized fp32 GEMMs on this CPU: which prepacked layout streams faster, and how close any gets to memory.

    .venv/bin/python benchmarks/bench_packing.py                 # the layout table
    .venv-rollout/bin/python benchmarks/bench_packing.py --step  # one decode step's GEMMs, with vLLM's kernel
    .venv/bin/python benchmarks/bench_packing.py --whole         # the 0.5B shape's whole decode step vs memory

Layout table: for the weight shapes of the two ``bench_sampler.py`` models at their decode row counts, each
layout runs a chain of distinct copies of the weight (~400 MB in all, so every call streams its weight from
memory as in a real decode step), best of 5, interleaved. ``align.rollout.native.MKL_MAX_BYTES`` (MKL below
it, oneDNN above) comes from this table.

``--step``: every GEMM of one decode step of each shape (all layers, fused q|k|v and gate|up, then the
vocabulary head), as ``align``'s sampler runs them (``PackedLinear``: the AVX-512 kernel of
``align.rollout.cpu_kernel`` where it builds; a row for each of its kernels this CPU runs: AVX-512 and AVX2 side by
side on an AVX-512 machine) and as it runs them without that kernel, with oneDNN for all, unpacked
``F.linear`` (what transformers runs), vLLM's own oneDNN matmul handler when ``vllm`` imports (run it with
``.venv-rollout``), and a plain streaming read of the same bytes (``sum``: the memory ceiling no kernel
beats). A second, identical copy of align's weights shows how much the placement of the weights in memory
alone moves the figure on this VM. Medians over interleaved repeats in a shuffled order.

``--whole``: the native sampler's whole decode step on the Qwen2.5-0.5B shape (8 rows, 32-token prompts: GEMMs,
attention, norms, sampling, Python), as ``generate`` runs it on packed weights: the time of 33 new tokens minus
the time of 1 (the prefill and the first token), per token, against a streaming read of every weight a step reads
(all layers and the tied vocabulary head), paired per repeat.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import QWEN25_05B, best_time

from align.rollout import cpu_kernel, native
from align.rollout.native import PackedLinear

CASES = [  # (rows, out_features, in_features): 31M shape at 16 rows, Qwen2.5-0.5B shape at 8 rows
    (16, 768, 512),
    (16, 512, 512),
    (16, 2816, 512),
    (16, 512, 1408),
    (16, 8192, 512),
    (8, 1152, 896),
    (8, 896, 896),
    (8, 9728, 896),
    (8, 896, 4864),
    (8, 151936, 896),
]


STEPS = {  # name: (rows, per-layer (out, in) of q|k|v, o, gate|up, down; layers; vocabulary head)
    "small (31M Qwen2 shape), 16 rows": (16, [(768, 512), (512, 512), (2816, 512), (512, 1408)], 8, (8192, 512)),
    "qwen2.5-0.5b shape, 8 rows": (8, [(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24, (151936, 896)),
}


def step_case(name: str, rows: int, shapes: list[tuple[int, int]], vllm_ops, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    linears = [nn.Linear(i, o, bias=False) for o, i in shapes]
    for lin in linears:
        nn.init.normal_(lin.weight, std=0.02, generator=gen)
    xs = [torch.randn(rows, i, generator=gen) for _, i in shapes]
    nbytes = sum(o * i * 4 for o, i in shapes)
    ours = [PackedLinear([lin], rows) for lin in linears]
    ours2 = [PackedLinear([lin], rows) for lin in linears]
    kernel_ops, native._kernel_ops = native._kernel_ops, lambda: None
    try:
        library = [PackedLinear([lin], rows) for lin in linears]  # what the sampler uses without the kernel
    finally:
        native._kernel_ops = kernel_ops
    kernels = {}  # every decode GEMM of align.rollout.cpu_kernel this CPU runs, side by side
    for kname in cpu_kernel.KERNELS:
        if cpu_kernel.load(kname) is not None:
            native._kernel_ops = lambda kname=kname: cpu_kernel.load(kname)
            try:
                kernels[kname] = [PackedLinear([lin], rows) for lin in linears]
            finally:
                native._kernel_ops = kernel_ops
    onednn = [torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), rows) for lin in linears]
    flat = [lin.weight.detach().reshape(-1).clone() for lin in linears]
    fns = {
        "streaming read (sum)": lambda: [f.sum() for f in flat],
        "align PackedLinear": lambda: [p(x) for p, x in zip(ours, xs)],
        "align, 2nd copy": lambda: [p(x) for p, x in zip(ours2, xs)],
        **{f"align, {k} kernel": lambda ps=ps: [p(x) for p, x in zip(ps, xs)] for k, ps in kernels.items()},
        "align, MKL/oneDNN only": lambda: [p(x) for p, x in zip(library, xs)],
        "oneDNN for all": lambda: [
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w, x in zip(onednn, xs)
        ],
        "F.linear (unpacked)": lambda: [F.linear(x, lin.weight) for lin, x in zip(linears, xs)],
    }
    if vllm_ops is not None:
        handlers = [vllm_ops.create_onednn_mm(lin.weight.detach().t(), 32) for lin in linears]
        fns["vLLM onednn_mm"] = lambda: [vllm_ops.onednn_mm(h, x, None) for h, x in zip(handlers, xs)]
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            keys = list(fns)
            random.shuffle(keys)
            for k in keys:
                t = time.perf_counter()
                fns[k]()
                times[k].append(time.perf_counter() - t)
    ceiling = statistics.median(times["streaming read (sum)"])
    print(
        f"\n## {name}: {len(shapes)} GEMMs, {nbytes / 1e6:.0f} MB of fp32 weights per step; "
        f"align layouts: {sorted({p.kind for p in ours})}, without the kernel: {sorted({p.kind for p in library})}"
    )
    print(f"{'kernel':<24}{'ms/step':>9}{'GB/s':>7}{'of ceiling':>12}")
    for k, ts in times.items():
        med = statistics.median(ts)
        print(f"{k:<24}{med * 1e3:>9.2f}{nbytes / med / 1e9:>7.1f}{ceiling / med:>12.0%}", flush=True)


def step_chain(repeats: int, shape: str) -> None:
    try:
        from vllm import _custom_ops as vllm_ops
    except ImportError:
        vllm_ops = None
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"vLLM kernel: {'yes' if vllm_ops else 'no (run with .venv-rollout/bin/python)'}\n{cpu_kernel.describe()}"
    )
    for name, (rows, layer, layers, head) in STEPS.items():
        if shape != "all" and not name.startswith(shape):
            continue
        step_case(name, rows, layer * layers + [head], vllm_ops, repeats)


def layout_case(m: int, n: int, k: int) -> None:
    copies = max(1, int(400e6 // (n * k * 4)))
    weights = [torch.randn(n, k) for _ in range(copies)]
    bias, x, sizes = torch.randn(n), torch.randn(m, k), torch.empty(()).expand(n, k)
    onednn, mkl = [], []
    for w in weights:  # alternate, so both layouts get alike memory (placement alone moves streaming up to 20% here)
        onednn.append(torch.ops.mkldnn._reorder_linear_weight(w, m))
        mkl.append(torch.ops.mkl._mkl_reorder_linear_weight(w, m))
    del weights
    t_dnn = t_mkl = float("inf")
    for _ in range(3):
        t_dnn = min(
            t_dnn,
            best_time(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "") for w in onednn], 5),
        )
        t_mkl = min(t_mkl, best_time(lambda: [torch.ops.mkl._mkl_linear(x, w, sizes, bias, m) for w in mkl], 5))
    gb = n * k * 4 * copies / 1e9
    print(
        f"{m:>4} {f'{n}x{k}':>12} {n * k * 4 / 1e6:>7.1f} {gb / t_dnn:>12.1f} {gb / t_mkl:>9.1f} {t_mkl / t_dnn:>16.2f}",
        flush=True,
    )


def whole_step(repeats: int) -> None:
    from align.model import ModelConfig, Transformer
    from align.rollout.protocol import SamplingParams

    cfg = ModelConfig(model_type="qwen2", qkv_bias=True, max_position_embeddings=1024, **QWEN25_05B)
    model = Transformer(cfg).init_weights(seed=0).eval()
    rows, plen, new = 8, 32, 33
    prompts = torch.randint(3, cfg.vocab_size, (rows, plen), generator=torch.Generator().manual_seed(0)).tolist()
    params = [p for n, p in model.named_parameters() if "embed_tokens" not in n or cfg.tie_word_embeddings]
    read = [p.detach().reshape(-1).clone() for p in params]  # the vocabulary head once, tied or not
    nbytes = sum(r.numel() * 4 for r in read)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n{cpu_kernel.describe()}")
    print(f"\n## qwen2.5-0.5b shape, {rows} rows, whole decode step: {nbytes / 1e6:.0f} MB of fp32 weights per step")
    ratios, steps, ceilings = [], [], []
    with torch.inference_mode(), native.packed_weights(model, rows):
        run = [
            lambda n=n: native.generate(model, prompts, SamplingParams(temperature=1.0, max_tokens=n, seed=0))
            for n in (1, new)
        ]
        run[0](), run[1]()
        for _ in range(repeats):
            t0 = time.perf_counter()
            run[0]()
            t1 = time.perf_counter()
            run[1]()
            t2 = time.perf_counter()
            [r.sum() for r in read]
            t3 = time.perf_counter()
            step = ((t2 - t1) - (t1 - t0)) / (new - 1)
            steps.append(step), ceilings.append(t3 - t2), ratios.append((t3 - t2) / step)
    print(f"{'':<28}{'ms/step':>9}{'GB/s':>7}")
    for name, ts in (("streaming read (sum)", ceilings), ("native decode step (whole)", steps)):
        med = statistics.median(ts)
        print(f"{name:<28}{med * 1e3:>9.2f}{nbytes / med / 1e9:>7.1f}")
    print(f"whole step of ceiling: {statistics.median(ratios):.0%} (median of {repeats} paired repeats)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", action="store_true", help="one decode step's GEMMs per shape, vs vLLM's kernel")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shape", choices=["small", "qwen2.5-0.5b", "all"], default="all", help="--step: which step")
    ap.add_argument("--whole", action="store_true", help="the 0.5B shape's whole decode step vs a streaming read")
    args = ap.parse_args()
    if args.whole:
        return whole_step(args.repeats)
    if args.step:
        return step_chain(args.repeats, args.shape)
    if not torch.backends.mkl.is_available():
        raise SystemExit("this torch build has no MKL: only the oneDNN layout is available")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'rows':>4} {'weight':>12} {'MB':>7} {'oneDNN GB/s':>12} {'MKL GB/s':>9} {'MKL/oneDNN time':>16}")
    for m, n, k in CASES:
        layout_case(m, n, k)


if __name__ == "__main__":
    main()
