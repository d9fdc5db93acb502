"""Tiny random-weight Hugging Face checkpoints written to a directory (transformers is test-only; no downloads).

``make_tiny_qwen2(path, seed=0, **overrides)`` writes a Qwen2 checkpoint that vLLM's CPU build and
``align.model.load_pretrained`` both load: hidden 128, 4 heads, 2 kv heads (head_dim 32: vLLM's CPU
attention needs head_dim in {32, 64, 80, ...}), 2 layers, vocab 512. ``model_type="llama"`` /
``"qwen3"`` give the same shape in those families. Weights use ``initializer_range=0.2`` so the logits
are peaked (a std-0.02 random model is near-uniform and makes comparisons weak).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# align's own ModelConfig (no transformers) of the small Qwen2 shape the learner and chat-turn tests train on CPU;
# a test adds vocab_size and what else it needs.
SMALL = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "qkv_bias": True,
}
MARKER = ".complete"  # align.model's commit marker
VLLM_TIMEOUT_S = 300.0  # a vLLM CPU engine start + first generate (inductor compile) on 2 shared cores


def make_tiny_model(
    path: str | os.PathLike,
    model_type: str = "qwen2",
    seed: int = 0,
    dtype: str = "float32",
    commit: bool = True,
    **overrides: object,
) -> Path:
    """Write a random-weight HF checkpoint of ``model_type`` ('qwen2' | 'llama' | 'qwen3') to ``path``.

    ``overrides`` replace entries of ``TINY`` (config fields). ``commit`` writes the ``.complete``
    marker last, as a trainer snapshot would have it. Returns ``path``."""
    import torch
    import transformers

    classes = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    if model_type not in classes:
        raise ValueError(f"model_type {model_type!r} not supported; expected one of {sorted(classes)}")
    config_cls, model_cls = classes[model_type]
    fields = {**TINY, **overrides}
    if model_type == "qwen3":
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).to(getattr(torch, dtype)).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if commit:
        (path / MARKER).write_text(json.dumps({"format": "hf-test", "seed": seed}))
    return path


def make_tiny_qwen2(path: str | os.PathLike, seed: int = 0, **overrides: object) -> Path:
    """A tiny Qwen2 checkpoint (see module docstring); ``model_type=`` picks another family."""
    return make_tiny_model(path, seed=seed, **{"model_type": "qwen2", **overrides})  # type: ignore[arg-type]


def load_hf(path: str | os.PathLike):
    """The transformers model of a checkpoint directory, fp32, eval mode (the reference in comparisons)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def exact_eval_set(prompts: list[list[int]], expected: list[list[int]], max_tokens: int, step: int):
    """An eval set that scores a prompt 1 exactly when its greedy completion is ``expected`` (the greedy continuation
    of the step-``step`` weights, made by the test), else 0: a point of any other weights scores lower."""
    from align.eval import EvalSet
    from align.rollout.protocol import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    score = lambda i, toks: float(toks == expected[i])
    return EvalSet(prompts=prompts, score=score, sampling=greedy, name=f"exact_step_{step}")


def teacher_forced_logprobs(
    hf_model, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    """``log_softmax(logits / T)`` of each completion token given the prompt and the tokens before it."""
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()  # (len(completion), V)
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def greedy_ids(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by plain argmax decoding (no stop token)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def require_rollout_venv() -> Path:
    """The rollout venv (``.venv-rollout``, or ``$ALIGN_ROLLOUT_VENV``); skip without it, or fail under
    ``ALIGN_REQUIRE_ROLLOUT=1`` (set by scripts/test.sh, so CI never counts a skipped real-vLLM test)."""
    import pytest

    venv = Path(os.environ.get("ALIGN_ROLLOUT_VENV", Path(__file__).resolve().parents[1] / ".venv-rollout"))
    if (venv / ".align-stamp").exists() and (venv / "bin" / "python").exists():
        return venv
    msg = f"{venv} missing or incomplete; build it with `bash scripts/setup_rollout_venv.sh`"
    if os.environ.get("ALIGN_REQUIRE_ROLLOUT") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


class CarryLog:
    """What ``record_carries`` saw: ``resumed``, per row cut with tokens and continued by a later call, ``(kept,
    newer)``: its tokens and their versions came back unchanged as the continuation's first ones, and the
    continuation sampled under newer weights; ``spans``, per step, the fraction of its completions holding tokens of
    more than one version (what ``rollout/partial_frac`` must report)."""

    def __init__(self):
        self.resumed: list[tuple[bool, bool]] = []
        self.spans: dict[int, float] = {}


def record_carries(monkeypatch) -> CarryLog:
    """Patches ``Carry.draw`` and ``Carry._take`` to log each carried row's continuation (``CarryLog``). On a real
    worker whether a cut lands mid-generation, and whether a carried row finishes before the run ends, is timing;
    what is asserted regardless: every continuation keeps its row's tokens, and the metric counts what was trained."""
    from align.rollout.cut import versions_of
    from align.rollout.partial import Carry

    log = CarryLog()
    real_draw, real_take = Carry.draw, Carry._take

    def take(self, pool, need, complete):
        for (i, old), (j, new) in zip(self.__dict__.pop("before", []), pool):  # carried groups lead the pool
            for a, b in zip(old, new):
                if a is not None and b is not a and a.finish_reason == "cut" and a.token_ids:
                    k = len(a.token_ids)
                    kept = i == j and b.token_ids[:k] == a.token_ids and versions_of(b)[:k] == versions_of(a)
                    log.resumed.append((kept, max(versions_of(b)) > max(versions_of(a))))
        return real_take(self, pool, need, complete)

    def draw(self, t, *args, **kw):
        self.before = list(self.groups)
        rows, out = real_draw(self, t, *args, **kw)
        log.spans[t] = sum(len(set(versions_of(c))) > 1 for c in out) / max(1, len(out))
        return rows, out

    monkeypatch.setattr(Carry, "_take", take)
    monkeypatch.setattr(Carry, "draw", draw)
    return log
