"""A full GRPO step of align next to TRL's GRPOTrainer: same model, prompts, group size and completion length.

One step = generation + reward + advantages + loss forward/backward + optimizer step, fp32, one process, on the CPU,
no reference model (KL off), one update per batch, fixed-length completions (no stop token: both generate exactly
--max-tokens tokens per completion), temperature 1. The model is a random-weight Qwen2 checkpoint written once by
``align.model.save_pretrained`` and loaded by both (transformers reads it as Qwen2ForCausalLM). Prompts are the same
text, one token per character on both sides (align: a byte tokenizer; TRL: a character-level ``tokenizers`` model
with the same ids), all of one length so neither side pads. The reward hashes the completion text.

Each side runs in its own subprocess, align with the core venv and its DEFAULT ``--threads`` (unless --threads),
TRL with torch's default thread count; the sides alternate for --rounds rounds so they share the machine's drift.
Time per step: align's ``step_time`` from metrics.jsonl; TRL's from a TrainerCallback (``on_step_begin`` to
``on_step_end``: TRL generates inside its training step). The first step of each run is a warm-up and not counted;
a figure is the median of the other steps over all rounds. Each round's pair is also printed as a ratio, in wall time
and in process CPU time (all threads: on a shared machine the robust one), with the median of the rounds. The align
child imports ``align`` before torch, as ``python -m align.train`` does (OpenMP's wait policy, docs/performance.md);
TRL runs in the caller's environment.

TRL is a benchmark-only dependency, never a test or core one. Install it in a throwaway venv, with the CPU build of
the core venv's torch (the local wheel; the pin keeps pip from pulling a CUDA build)::

    python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl transformers

then, from the repository root::

    .venv/bin/python benchmarks/bench_vs_trl.py                      # both shapes, 4 prompts x G 4 x 64 tokens
    .venv/bin/python benchmarks/bench_vs_trl.py --shape small --threads 2 --trl-python /tmp/trl-venv/bin/python
    .venv/bin/python benchmarks/bench_vs_trl.py --shape small --also /tmp/base   # + another tree's align, paired
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

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ENV = dict(os.environ)  # the caller's environment, for TRL: ``import align`` (below) sets OpenMP's wait policy
TRL_INSTALL = "python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl transformers"
SHAPES = {
    # ~0.1M parameters: where per-step overheads (Python, small kernels, thread wake-ups) dominate
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True},
    # 31M: bench_sampler.py's small shape, where the matmuls dominate
    "small": {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False},
}  # fmt: skip
PAD, EOS, UNK, OFFSET = 0, 1, 2, 3  # special ids; a character c is id ord(c) + OFFSET on both sides


def prompts(n: int, length: int) -> list[str]:
    """``n`` ASCII prompts of exactly ``length`` characters (= tokens)."""
    return [(f"Question {i}: " + "lorem ipsum dolor sit amet " * length)[:length] for i in range(n)]


def reward(completion: str) -> float:
    return (zlib.crc32(completion.encode()) % 7) / 7


# ------------------------------------------------------------------------------------------------ align side


class ByteTokenizer:
    """One id per ASCII character (``ord(c) + OFFSET``); no stop token: every completion runs to --max-tokens."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) + OFFSET for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 95) for i in ids)


PARTS = {  # --profile: what align's step spends its time on, by the function that does it (module, attribute)
    "generate (sampler, packing included)": ("align.rollout.native", "generate"),
    "  of which weight packing": ("align.rollout.native.PackedLinear", "__init__"),
    "loss forward (logprob recompute)": ("align.learner", "micro_batch_logprobs"),
    "backward": ("torch.autograd", "backward"),
    "grad norm": ("align.learner", "grad_norm"),
    "optimizer step": ("torch.optim.AdamW", "step"),
}


def timed_parts() -> dict[str, list[float]]:
    """Wrap every function of ``PARTS`` with a timer; returns the per-part lists of seconds, appended per call."""
    import importlib

    spent: dict[str, list[float]] = {name: [] for name in PARTS}
    for name, (where, attr) in PARTS.items():
        mod, _, cls = where.rpartition(".") if where.endswith(("PackedLinear", "AdamW")) else (where, "", "")
        owner = getattr(importlib.import_module(mod), cls) if cls else importlib.import_module(mod)
        fn = getattr(owner, attr)

        def wrapped(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_name].append(time.perf_counter() - t)

        setattr(owner, attr, wrapped)
    return spent


def cpu_per_step() -> list[float]:
    """Process CPU seconds (all threads; ``time.process_time``) of each align step, from the sampler's call to the
    end of the optimizer step, appended per step: robust to a shared machine's load, where wall time is not."""
    import importlib

    steps: list[float] = []
    native, optim = importlib.import_module("align.rollout.native"), importlib.import_module("torch.optim")
    gen, step = native.generate, optim.AdamW.step
    t0 = [0.0]

    def generate(*a, **k):
        t0[0] = time.process_time()
        return gen(*a, **k)

    def adamw_step(*a, **k):
        try:
            return step(*a, **k)
        finally:
            steps.append(time.process_time() - t0[0])

    native.generate, optim.AdamW.step = generate, adamw_step
    return steps


def align_child(args) -> dict:
    sys.path.insert(0, ROOT)
    __import__("align")  # first, as ``python -m align.train`` does: its OpenMP default precedes torch's load
    import torch

    from align.train import TrainConfig, train

    spent = timed_parts() if args.profile else {}
    cpu = cpu_per_step()

    out = tempfile.mkdtemp(prefix="align-vs-trl-")
    c = TrainConfig(out=out, steps=args.steps, prompts_per_step=args.prompts, group_size=args.group,
                    max_tokens=args.max_tokens, device="cpu", precision="fp32", warmup_steps=0, checkpoint_every=0,
                    keep_checkpoints=1, lr=1e-6, **({"threads": args.threads} if args.threads else {}))  # fmt: skip
    c.eval.eval_interval = 0
    texts = prompts(args.prompts, args.prompt_tokens)
    # the data order is shuffled per epoch: with exactly --prompts prompts every step sees the same four
    train(c, model=args.model, tokenizer=ByteTokenizer(), prompts=[{"prompt": t} for t in texts],
          reward=lambda p, comp, **_: reward(comp))  # fmt: skip
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    lengths = {r["completion_len_mean"] for r in recs}
    assert lengths == {float(args.max_tokens)}, f"completions were not all {args.max_tokens} tokens: {lengths}"
    import shutil

    shutil.rmtree(out)
    from align.rollout import cpu_kernel

    try:  # the learner's fp32 GEMMs (align.cpu_linear; a tree without it: MKL)
        from align.cpu_linear import backend

        gemm = backend()
    except ImportError:
        gemm = "mkl"
    # every step makes the same calls: drop the first step's share (the warm-up), the rest per step
    parts = {k: sum(v[len(v) // args.steps :]) / (args.steps - 1) for k, v in spent.items()}
    return {
        "parts": parts,
        "step_s": [r["step_time"] for r in recs],
        "cpu_s": cpu,
        "threads": torch.get_num_threads(),
        "kernel": cpu_kernel.describe() + f"; learner GEMM: {gemm}"
        f"; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
    }


# ------------------------------------------------------------------------------------------------ TRL side


def trl_tokenizer():
    """A character-level fast tokenizer with align's ids (id = ord(c) + OFFSET), pad 0 and eos 1."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK, **{chr(b): b + OFFSET for b in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def trl_child(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    tok = trl_tokenizer()
    texts = prompts(args.prompts, args.prompt_tokens)
    assert all(len(tok(t)["input_ids"]) == args.prompt_tokens for t in texts)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    lengths: list[int] = []

    def reward_fn(completions, completion_ids, **_):
        lengths.extend(len(ids) for ids in completion_ids)
        return [reward(c) for c in completions]

    n = args.prompts * args.group
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), max_steps=args.steps, per_device_train_batch_size=n,
        gradient_accumulation_steps=1, num_generations=args.group, max_completion_length=args.max_tokens,
        generation_kwargs={"min_new_tokens": args.max_tokens},  # no early stop: fixed-length completions
        temperature=1.0, beta=0.0, num_iterations=1, learning_rate=1e-6, use_cpu=True, bf16=False, fp16=False,
        report_to="none", save_strategy="no", logging_steps=10**6, seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )  # fmt: skip
    # the same prompts every step (TRL shuffles its sampler: a dataset of the P prompts repeated for every step)
    data = Dataset.from_list([{"prompt": t} for t in texts] * (args.steps + 1))
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=data, processing_class=tok)
    times: list[float] = []
    cpu: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)
            cpu.append(time.process_time() - self.c0)

    trainer.add_callback(Timer())
    trainer.train()
    assert set(lengths) == {args.max_tokens}, f"completions were not all {args.max_tokens} tokens: {set(lengths)}"
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    return {"step_s": times, "cpu_s": cpu, "threads": torch.get_num_threads(), "omp": policy}


# ------------------------------------------------------------------------------------------------ driver


def save_model(shape: str, path: str) -> int:
    sys.path.insert(0, ROOT)
    from align.model import ModelConfig, Transformer, save_pretrained

    cfg = ModelConfig(model_type="qwen2", qkv_bias=True, eos_token_id=None, **SHAPES[shape])
    save_pretrained(Transformer(cfg).init_weights(seed=0), path)
    return cfg.num_params()


def profile(args, argv: list[str] | None) -> None:
    """--profile: align's step alone (no TRL), --rounds runs, the median per part over them."""
    own = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--profile"]
    print(f"{args.prompts} prompts x G {args.group}, {args.prompt_tokens}+{args.max_tokens} tokens, fp32, CPU, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        with tempfile.TemporaryDirectory(prefix="align-profile-model-") as tmp:
            save_model(shape, tmp)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "align", "--model", tmp, "--profile", *own]
            runs = []
            for _ in range(args.rounds):
                r = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
                line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                if r.returncode or not line:
                    sys.exit(f"align run failed (exit {r.returncode}):\n{r.stderr[-5000:]}")
                runs.append(json.loads(line[-1][len("RESULT ") :]))
        step = statistics.median(t for r in runs for t in r["step_s"][1:])
        print(f"\n## {shape}: {runs[0]['kernel']}, {runs[0]['threads']} threads, step {step:.3f} s (median)")
        accounted = 0.0
        for name in PARTS:
            s = statistics.median(r["parts"][name] for r in runs)
            accounted += s if not name.startswith(" ") else 0.0
            print(f"{name:<40}{s:>8.3f} s{s / step:>7.0%}")
        print(
            f"{'the rest (reward, batch, logging, ...)':<40}{step - accounted:>8.3f} s{(step - accounted) / step:>7.0%}"
        )


def paired(align_steps: list[float], trl_steps: list[float]) -> float:
    """One round's align/TRL ratio: the medians of its timed steps (the first of each run is a warm-up)."""
    return statistics.median(align_steps[1:]) / statistics.median(trl_steps[1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    numeric_flags(p, prompts=4, group=4, max_tokens=64, prompt_tokens=32)
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is a warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="align/TRL runs per shape, alternating")
    p.add_argument("--threads", type=int, default=0, help="align --threads (0: align's default)")
    p.add_argument("--trl-threads", type=int, default=0, help="TRL's torch threads (0: torch's default)")
    p.add_argument("--trl-python", default="/tmp/trl-venv/bin/python", help="a python with trl installed")
    p.add_argument("--verbose", action="store_true", help="print every step's time")
    p.add_argument("--profile", action="store_true", help="align only: where its step goes (generation, loss ...)")
    p.add_argument("--also", default="", help="another checkout's root (e.g. main's, `git worktree add`): its align "
                   "runs as a third side in every round, its step paired with this tree's and TRL's")  # fmt: skip
    p.add_argument("--child", choices=["align", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = align_child(args) if args.child == "align" else trl_child(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.profile:
        return profile(args, argv)
    if not os.path.exists(args.trl_python):
        sys.exit(f"no {args.trl_python}: TRL is a benchmark-only dependency; install it with\n  {TRL_INSTALL}\n"
                 "or pass --trl-python PATH")  # fmt: skip

    given = argv if argv is not None else sys.argv[1:]
    given = [a for i, a in enumerate(given) if a != "--also" and (i == 0 or given[i - 1] != "--also")]
    given = [a for a in given if not a.startswith("--also=")]

    def run(side: str, model: str) -> dict:
        root = os.path.abspath(args.also) if side == "also" else ROOT
        py = args.trl_python if side == "trl" else sys.executable
        own = ["--child", "trl" if side == "trl" else "align", "--model", model]
        cmd = [py, os.path.join(root, "benchmarks", "bench_vs_trl.py"), *own, *given]
        env = dict(ENV) if side == "trl" else {**ENV, "PYTHONPATH": root}
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=root)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not line:
            sys.exit(f"{side} run failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        return json.loads(line[-1][len("RESULT ") :])

    print(f"{args.prompts} prompts x G {args.group}, {args.prompt_tokens}+{args.max_tokens} tokens (fixed length), "
          f"fp32, CPU, {args.steps - 1} timed steps x {args.rounds} rounds | {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'shape':>6} {'params':>7} {'align thr':>9} {'TRL thr':>7} {'align s/step':>12} {'TRL s/step':>10} "
          f"{'align/TRL':>9}")  # fmt: skip
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        with tempfile.TemporaryDirectory(prefix="align-vs-trl-model-") as tmp:
            n = save_model(shape, tmp)
            res: dict[str, list[dict]] = {"align": [], "trl": [], **({"also": []} if args.also else {})}
            for _ in range(args.rounds):
                for side, runs in res.items():
                    runs.append(run(side, tmp))
        med = {side: statistics.median(t for r in rs for t in r["step_s"][1:]) for side, rs in res.items()}
        print(f"{shape:>6} align's {res['align'][0]['kernel']}; TRL's OMP_WAIT_POLICY={res['trl'][0]['omp']}")
        print(f"{shape:>6} {n / 1e6:>6.2f}M {res['align'][0]['threads']:>9} {res['trl'][0]['threads']:>7} "
              f"{med['align']:>12.3f} {med['trl']:>10.3f} {med['align'] / med['trl']:>8.2f}x", flush=True)  # fmt: skip
        duos = [("align", "trl", "align/TRL")] + ([("also", "trl", "--also/TRL"), ("align", "also", "align/--also")]
                                                   if args.also else [])  # fmt: skip
        for key, what in (("step_s", "wall"), ("cpu_s", "process CPU")):  # each round's pair, then their median
            for a_side, b_side, name in duos:
                pairs = [paired(a[key], t[key]) for a, t in zip(res[a_side], res[b_side])]
                print(f"{shape:>6} {name} per round ({what} s/step, median of the round's steps): "
                      + ", ".join(f"{r:.2f}x" for r in pairs) + f"; median {statistics.median(pairs):.2f}x")  # fmt: skip
        if args.also:
            also = statistics.median(t for r in res["also"] for t in r["step_s"][1:])
            print(f"{shape:>6} --also {args.also}: {also:.3f} s/step (median)")
        if args.verbose:
            for side, rs in res.items():
                print(
                    f"         {side} steps (s): " + " | ".join(" ".join(f"{t:.3f}" for t in r["step_s"]) for r in rs)
                )


if __name__ == "__main__":
    main()
