"""The Lean driver's engine half: the model's tokenizer, prompt rendering, the vLLM engine and its generation loop.

``lean_gen.py`` (the CLI, stdlib only at import) calls these; vLLM, transformers and torch are imported inside the
functions, so importing this module is stdlib only too, and they run in ``.venv-rollout``. A missing package or an
unreachable model is a ``SetupError`` (one line on stderr, exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lean_records import PROMPT_FIT, SetupError, Stop, token_budget
from vllm_cpu import engine_kwargs

RUN_HINT = "run lean_gen.py with .venv-rollout/bin/python (vllm + transformers) and pass a local --model snapshot dir"


def load_tokenizer(args: argparse.Namespace):
    """The model's tokenizer; a missing transformers or an unreachable model is a SetupError (one line)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise SetupError(f"cannot import transformers ({exc.name or exc}) in {sys.executable}: {RUN_HINT}") from None
    name = args.tokenizer or args.model
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        where = "a local directory" if os.path.isdir(name) else "not a local directory (needs the hub)"
        raise SetupError(f"cannot load the tokenizer of {name!r} ({where}): {first}; {RUN_HINT}") from None


def prepare(
    items: list[dict], tokenizer, args: argparse.Namespace, max_model_len: int
) -> tuple[list[dict], list[dict]]:
    """Render each prompt with the model's chat template, tokenize, and size its token budget."""
    ready, skips = [], []
    for it in items:
        text = tokenizer.apply_chat_template(it["messages"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text)
        budget = token_budget(
            args.cap_tokens, max_model_len, len(ids), it["ancestor_tokens"], args.trajectory_cap_tokens
        )
        if budget is None:
            over = len(ids) > max_model_len * PROMPT_FIT
            skips.append(
                {
                    "sample_id": it["sample_id"],
                    "problem_id": it["problem_id"],
                    "parent_id": it["parent_id"],
                    "reason": "prompt_too_long" if over else "trajectory_budget_exhausted",
                    "prompt_tokens": len(ids),
                    "ancestor_tokens": it["ancestor_tokens"],
                }
            )
            continue
        ready.append({**it, "prompt_text": text, "prompt_ids": ids, "budget": budget})
    return ready, skips


def versions() -> dict:
    """Versions of python, vllm, torch and transformers (None: not installed), for the session record."""
    out = {"python": sys.version.split()[0]}
    for mod in ("vllm", "torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def _gpu_mem_used_mib() -> int | None:
    """GPU memory in use (MiB, all GPUs) by nvidia-smi; None without it or when it fails."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return sum(int(x) for x in r.stdout.split()) if r.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def build_engine(args: argparse.Namespace, max_model_len: int, adapter: dict | None):
    """The ``vllm.LLM`` of the flags (prefix caching on; LoRA enabled for an un-merged ``adapter``; on a CPU
    ``vllm_cpu.engine_kwargs``: every sample here is seeded and a correction prompt can pass 2048 tokens)."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise SetupError(f"cannot import vllm ({exc.name or exc}) in {sys.executable}: {RUN_HINT}") from None

    kw = dict(  # noqa: C408 - reads as the LLM(...) call it feeds
        model=args.model,
        tokenizer=args.tokenizer or args.model,
        tensor_parallel_size=args.tp,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=True,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        trust_remote_code=args.trust_remote_code,
        enforce_eager=args.enforce_eager,
        dtype=args.dtype,
    )
    if adapter:
        kw.update(enable_lora=True, max_loras=1, max_lora_rank=adapter["max_lora_rank"])
    import torch

    kw.update(engine_kwargs(max_model_len, torch.cuda.is_available()))
    return LLM(**kw)


def generate(llm, todo: list[dict], args: argparse.Namespace, out_f, stop: Stop, make) -> dict:
    """Step the engine with a refill window; write each finished sample at once. Returns session stats."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    engine = llm.llm_engine
    lora = LoRARequest(args.lora_name, 1, args.lora_adapter) if args.lora_adapter else None
    window = args.refill_window or 2 * args.max_num_seqs
    queue, in_flight = list(reversed(todo)), {}
    stats = {
        "new_samples": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "finish_counts": {},
        "max_running": 0,
        "peak_gpu_mem_mib": None,
    }
    last_probe = 0.0
    while (queue or in_flight) and stop.signum is None:
        while queue and len(in_flight) < window:
            it = queue.pop()
            sp = SamplingParams(
                n=1,
                temperature=args.temperature,
                top_p=args.top_p,
                max_tokens=it["budget"]["max_tokens"],
                seed=it["seed"],
            )
            engine.add_request(it["sample_id"], {"prompt_token_ids": it["prompt_ids"]}, sp, lora_request=lora)
            in_flight[it["sample_id"]] = it
        stats["max_running"] = max(stats["max_running"], len(in_flight))
        for o in engine.step():
            if not o.finished:
                continue
            it = in_flight.pop(o.request_id)
            c = o.outputs[0]
            rec = make(it, list(c.token_ids), c.text, c.finish_reason)
            out_f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            out_f.flush()
            stats["new_samples"] += 1
            stats["prompt_tokens"] += len(it["prompt_ids"])
            stats["completion_tokens"] += len(c.token_ids)
            fc = stats["finish_counts"]
            fc[str(c.finish_reason)] = fc.get(str(c.finish_reason), 0) + 1
        if time.monotonic() - last_probe > 5:
            last_probe = time.monotonic()
            mem = _gpu_mem_used_mib()
            if mem is not None:
                stats["peak_gpu_mem_mib"] = max(stats["peak_gpu_mem_mib"] or 0, mem)
    if in_flight:
        engine.abort_request(list(in_flight))
    os.fsync(out_f.fileno())
    return stats
