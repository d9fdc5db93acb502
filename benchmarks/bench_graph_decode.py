"""Native sampler decode on CUDA: CUDA-graph decode vs the eager loop vs transformers.generate, one run, one GPU.

    python3 benchmarks/bench_graph_decode.py                    # Qwen2.5-0.5B shape, bf16, batch 1 4 16
    python3 benchmarks/bench_graph_decode.py --batch 8 --new 256

A random-weight Qwen2.5-0.5B-shaped checkpoint is written here (no download) and loaded by both sides in bf16.
Each engine generates exactly ``--new`` tokens per row at T=1 (no stop) from ``--prompt-tokens``-token prompts;
every repeat runs the three back to back (order rotated) and a ratio is the median over repeats of the paired time
ratio. The graph engine's first call (the capture) is the warm-up, not timed. Needs CUDA; run by
scripts/gpu_check.sh. Target (issue 43): graph >= 2x eager at batch 1-16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import QWEN25_05B, hf_sample

from align.model import ModelConfig, Transformer, load_pretrained, save_pretrained
from align.rollout import graph_decode
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams

QWEN05 = QWEN25_05B


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench(batch: int, ours, hf, cfg: ModelConfig, plen: int, new: int, repeats: int) -> dict[str, float]:
    prompts = torch.randint(3, cfg.vocab_size, (batch, plen), generator=torch.Generator().manual_seed(batch))
    params = SamplingParams(temperature=1.0, max_tokens=new, seed=0)

    def native(graphs: bool):
        outs = generate(ours, prompts.tolist(), params, cuda_graphs=graphs)
        assert all(len(c.token_ids) == new for c in outs)

    def hf_once():
        hf_sample(hf, prompts.cuda(), new)

    engines = {"graph": lambda: native(True), "eager": lambda: native(False), "transformers": hf_once}
    for fn in engines.values():  # warm-up (the graph's capture happens here)
        fn()
    assert graph_decode.captured(ours), "the graph engine fell back to eager (see the log)"
    times: dict[str, list[float]] = {k: [] for k in engines}
    order = list(engines)
    for r in range(repeats):
        for key in order[r % 3 :] + order[: r % 3]:
            times[key].append(timed(engines[key]))
    tokens = batch * new
    row = {k: tokens / statistics.median(ts) for k, ts in times.items()}
    row["graph/eager"] = statistics.median(e / g for g, e in zip(times["graph"], times["eager"]))
    row["graph/transformers"] = statistics.median(h / g for g, h in zip(times["graph"], times["transformers"]))
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_graph_decode: needs a CUDA GPU (CUDA graphs); the CPU sampler is benchmarks/bench_sampler.py")
    import transformers

    cfg = ModelConfig(
        model_type="qwen2", qkv_bias=True, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, **QWEN05
    )
    path = save_pretrained(Transformer(cfg).init_weights(seed=0).to(torch.bfloat16), Path(tempfile.mkdtemp()) / "m")
    ours = load_pretrained(path).to("cuda", torch.bfloat16).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    print(f"{torch.cuda.get_device_name(0)} | torch {torch.__version__} | transformers {transformers.__version__}")
    print(f"Qwen2.5-0.5B shape, bf16, {args.prompt_tokens}-token prompts, {args.new} new tokens, T=1; tok/s median")
    print(f"{'batch':>5}{'graph':>10}{'eager':>10}{'transformers':>14}{'graph/eager':>13}{'graph/transformers':>20}")
    for b in args.batch:
        r = bench(b, ours, hf, cfg, args.prompt_tokens, args.new, args.repeats)
        print(
            f"{b:>5}{r['graph']:>10.0f}{r['eager']:>10.0f}{r['transformers']:>14.0f}"
            f"{r['graph/eager']:>12.2f}x{r['graph/transformers']:>19.2f}x"
        )
    print(f"ratios: median over {args.repeats} repeats of the paired time ratio; target graph >= 2x eager at 1-16")


if __name__ == "__main__":
    main()
