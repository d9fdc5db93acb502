"""What the benchmarks share: their numeric flags declared as one call, each benchmark with its own defaults; the
best-of-N timer ``best_time``.

``numeric_flags(p, steps=8, max_tokens=12)`` is ``p.add_argument("--steps", type=int, default=8)`` and
``p.add_argument("--max-tokens", type=int, default=12)``: the flag is the keyword with dashes, its type the
default's. A flag with a help line, a choice or an action is written out with ``add_argument`` beside it.
``tests/test_docs.py`` reads these keywords as flags, as it reads ``add_argument``'s.
"""

from __future__ import annotations

import argparse
import time

# the Qwen2.5-0.5B shape (ModelConfig / Qwen2Config keywords): what the GPU benchmarks and bench_sampler time
QWEN25_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": True,
}


def numeric_flags(p: argparse.ArgumentParser, /, **defaults: float) -> None:
    """One ``--name`` flag per keyword (``max_tokens`` -> ``--max-tokens``), typed and defaulted by its value."""
    for name, default in defaults.items():
        if type(default) not in (int, float):
            raise TypeError(f"numeric_flags: {name}={default!r} is not an int or a float")
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)


def best_time(fn, repeats: int, clock=time.perf_counter) -> float:
    """Least time of ``fn()`` over ``repeats`` runs after one warm-up, in seconds of ``clock`` (wall time;
    ``time.process_time``: CPU time)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def hf_sample(hf, prompts, new: int) -> None:
    """transformers' ``generate`` as the peer of a native-sampler timing: ``prompts`` (B, P) ids on ``hf``'s device,
    sampled at T = 1 with no truncation, exactly ``new`` tokens per row."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )
    assert out.shape[1] == prompts.shape[1] + new
