"""One training step's peak memory and time, plain logits vs the fused lm_head path, side by side in one run;
and (``--train``) a short GRPO run of the same shape reporting peak memory and step time.

Step mode (default): the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14/2 heads, tied embeddings, V = 151936) with
random weights, ``--batch`` x ``--seq`` tokens, one forward + backward of sum(logprobs) + sum(entropy), no optimizer:
  plain  ``model(inputs)`` -> (B, L, V) logits -> ``align.kernels.token_logprobs`` (what align.train did before)
  fused  ``align.learner.token_logprobs``: final hidden states -> ``linear_token_logprobs`` (no (B, L, V) logits)
Memory beyond weights and gradients ("extra"): every path runs alone in a fresh subprocess;
  CUDA: max_memory_allocated during the step - allocated before it - the gradients' bytes
  CPU:  peak resident set (VmHWM, reset through /proc/self/clear_refs before the step) - RSS before - gradients,
        in a child started with glibc's MALLOC_MMAP_THRESHOLD_=65536 (unless set): glibc otherwise raises its mmap
        threshold up to 32 MB as blocks are freed and keeps freed blocks below it in the heap, so the high-water
        RSS counts that fragmentation (24 layers + checkpointing: fused 2599 MB instead of 609); with the fixed
        threshold freed tensors go back to the OS and the peak follows the live tensors, as CUDA's does
Time: one more subprocess runs the paths round-robin (so they share the machine's load), median of --reps after a
warm-up round. Targets (issue 13): fused extra <= 1/3 of plain extra, fused time <= 1.1x plain.

Train mode (``--train``, used by scripts/gpu_check.sh): ``align.train.train`` for --steps steps of the same shape
(random weights saved to a temporary HF dir, fixed-length completions: no stop token), prints the peak memory of
the run and each step's time from metrics.jsonl.

    python3 benchmarks/bench_train_step.py --device cuda                       # full shape, 8 x 512, bf16-mixed
    .venv/bin/python benchmarks/bench_train_step.py --device cpu --layers 2    # what fits a small CPU box
    python3 benchmarks/bench_train_step.py --train --device cuda --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

from common import numeric_flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MB = 2**20
QWEN25_05B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
              "qkv_bias": True, "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True}  # fmt: skip
PATHS = ("plain", "fused")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def build(args):
    import torch

    from align.device import resolve
    from align.model import ModelConfig, Transformer, rope_inv_freq

    place = resolve(args.device, args.precision)
    if args.linear_rows:
        from align import kernels

        kernels.LINEAR_ROWS = args.linear_rows
    cfg = ModelConfig(**{**QWEN25_05B, "num_hidden_layers": args.layers})
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=place.device)
    model.lm_head.weight = model.model.embed_tokens.weight  # to_empty made two tensors of the tied one
    model = model.init_weights(seed=0).to(place.param_dtype)
    model.inv_freq = rope_inv_freq(cfg).to(place.device)  # a buffer: to_empty left it uninitialised
    model.gradient_checkpointing = args.gradient_checkpointing
    model.train()
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(place.device)  # (B, L)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(place.device)  # (B, L)
    return place, model, inputs, targets


def make_step(path: str, place, model, inputs, targets):
    import torch

    from align import kernels, learner

    def step() -> None:
        model.zero_grad(set_to_none=True)  # as a step's first micro-batch: backward allocates the grads
        if path == "plain":
            with place.autocast():
                logits = model(inputs)  # (B, L, V)
            lp, ent = kernels.token_logprobs(logits, targets)
        else:
            lp, ent = learner.token_logprobs(model, inputs, targets, 1.0, place=place)
        (lp.sum() + ent.sum()).backward()
        if place.device.type == "cuda":
            torch.cuda.synchronize(place.device)

    return step


def step_extra_bytes(place, step, grad_bytes: int) -> int:
    """Peak memory one call of ``step`` adds beyond what was live before it and the gradients it creates: CUDA's
    allocator peak, or on the CPU the RSS high-water mark (VmHWM, reset first)."""
    import torch

    if place.device.type == "cuda":
        torch.cuda.synchronize(place.device)
        before = torch.cuda.memory_allocated(place.device)
        torch.cuda.reset_peak_memory_stats(place.device)
        step()
        return torch.cuda.max_memory_allocated(place.device) - before - grad_bytes
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    step()
    return (_status_kb("VmHWM") - before) * 1024 - grad_bytes


def child_memory(args) -> dict:

    place, model, inputs, targets = build(args)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    extra = step_extra_bytes(place, make_step(args.child, place, model, inputs, targets), grad_bytes)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"extra_mb": extra / MB, "weights_mb": weights / MB, "grads_mb": grad_bytes / MB}


def child_time(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    place, model, inputs, targets = build(args)
    steps = {path: make_step(path, place, model, inputs, targets) for path in PATHS}
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(args.reps + 1):  # the first round warms up (Triton compiles, allocator grows)
        for path in PATHS:
            t0 = time.perf_counter()
            steps[path]()
            times[path].append(time.perf_counter() - t0)
    return {path: statistics.median(t[1:]) for path, t in times.items()}


class ByteTokenizer:
    """Text <-> ids for a random-weight model: one id per byte, offset past the special ids."""

    eos_token_id = None  # no stop token: every completion runs to --max-tokens

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:  # any id of the 151936 prints (the reward hashes the text)
        return "".join(chr(32 + i % 95) for i in ids)


def train_run(args) -> None:
    import torch

    from align.device import resolve
    from align.model import ModelConfig, Transformer, save_pretrained
    from align.train import TrainConfig, train

    place = resolve(args.device, args.precision)
    cfg = ModelConfig(**{**QWEN25_05B, "num_hidden_layers": args.layers, "eos_token_id": None})
    with tempfile.TemporaryDirectory(prefix="align-bench-") as tmp:
        save_pretrained(Transformer(cfg).init_weights(seed=0).to(torch.bfloat16), os.path.join(tmp, "model"))
        prompts = [{"prompt": f"Question {i}: " + "lorem ipsum " * (args.prompt_tokens // 12)} for i in range(64)]
        c = TrainConfig(out=os.path.join(tmp, "run"), steps=args.steps, prompts_per_step=args.batch // args.group,
                        group_size=args.group, max_tokens=args.max_tokens, device=args.device,
                        precision=args.precision, micro_batch_tokens=args.micro_batch_tokens, warmup_steps=0,
                        checkpoint_every=0, gradient_checkpointing=args.gradient_checkpointing,
                        threads=args.threads)  # fmt: skip
        c.eval.eval_interval = 0
        if place.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(place.device)
        t0 = time.perf_counter()
        train(c, model=os.path.join(tmp, "model"), tokenizer=ByteTokenizer(), prompts=prompts,
              reward=lambda p, comp, **_: (zlib.crc32(comp.encode()) % 7) / 7)  # fmt: skip
        wall = time.perf_counter() - t0
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            recs = [json.loads(x) for x in f]
    peak = torch.cuda.max_memory_allocated(place.device) / 2**30 if place.device.type == "cuda" else None
    peak_s = f"{peak:.2f} GiB (torch.cuda.max_memory_allocated)" if peak is not None else \
        f"{_status_kb('VmHWM') / 2**20:.2f} GiB (process peak RSS)"  # fmt: skip
    print(f"train | {cfg.num_params() / 1e6:.0f}M params ({args.layers} layers) | {place.device} {place.precision} | "
          f"{args.batch // args.group} prompts x G {args.group}, {args.prompt_tokens}+{args.max_tokens} tokens | "
          f"peak memory {peak_s} | wall {wall:.1f}s")  # fmt: skip
    for r in recs:
        print(f"  step {r['step']}: step_time {r['step_time']:.2f}s (rollout {r['rollout_time']:.2f}s) "
              f"loss {r['loss']:.4f} grad_norm {r['grad_norm']:.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--layers", type=int, default=24, help="decoder layers (24 = Qwen2.5-0.5B)")
    p.add_argument("--batch", type=int, default=8, help="sequences (step mode) / completions per step (--train)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (step mode)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--train", action="store_true", help="run align.train for --steps steps instead")
    numeric_flags(p, steps=3, group=4, prompt_tokens=64, max_tokens=128, micro_batch_tokens=4096)
    p.add_argument("--linear-rows", type=int, default=0, help="override align.kernels.LINEAR_ROWS (fused path)")
    p.add_argument("--no-time", action="store_true", help="memory only")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.train:
        return train_run(args)
    if args.child:
        print(json.dumps(child_time(args) if args.child == "time" else child_memory(args)))
        return

    def run_child(what: str) -> dict:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            what,
            *(argv if argv is not None else sys.argv[1:]),
        ]
        env = dict(os.environ)
        if what != "time":  # memory: the RSS peak of live tensors, not of glibc's heap fragmentation (docstring)
            env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    from align.device import resolve

    place = resolve(args.device, args.precision)
    load = f" | load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus" if place.device.type == "cpu" else ""
    print(f"Qwen2.5-0.5B shape, {args.layers} layers, V {QWEN25_05B['vocab_size']} | {args.batch} x {args.seq} tokens | "
          f"{place.device} {place.precision} | checkpointing {args.gradient_checkpointing} | "
          f"LINEAR_ROWS {args.linear_rows or 'default'}{load}")  # fmt: skip
    mem = {path: run_child(path) for path in PATHS}
    t = {path: float("nan") for path in PATHS} if args.no_time else run_child("time")
    print(f"weights {mem['plain']['weights_mb']:.0f} MB, grads {mem['plain']['grads_mb']:.0f} MB")
    print(f"{'path':>6} {'extra MB':>9} {'vs plain':>9} {'step s':>8} {'vs plain':>9}")
    for path in PATHS:
        print(f"{path:>6} {mem[path]['extra_mb']:>9.0f} {mem[path]['extra_mb'] / mem['plain']['extra_mb']:>9.2f} "
              f"{t[path]:>8.3f} {t[path] / t['plain']:>9.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
