"""vLLM engine arguments on a CPU, for the rollout worker and lean_gen's engine (stdlib only).

After a partial (chunked) prefill vLLM's CPU model runner rewinds a seeded request's generator by CUDA's Philox
offset, which a CPU ``torch.Generator`` lacks: the engine core died ("CPU Generator does not use offset",
EngineDeadError) on the first seeded prompt longer than a step's token budget (2048 by default), e.g. a cut request
resumed as prompt + thousands of ids, or a Lean correction round's prompt. On a CPU chunked prefill is off and a
step's budget covers ``max_model_len``, so a prompt is never split across steps; a GPU keeps vLLM's defaults.
"""

from __future__ import annotations


def engine_kwargs(max_model_len: int, cuda: bool) -> dict:
    """What a ``vllm.LLM(...)`` call adds on this device: nothing with CUDA, else the two settings above."""
    return {} if cuda else {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}
