"""The native sampler: batched KV-cache generation with exact logprobs, in plain torch.

Key decisions
- Prompts of different lengths are left-padded so every row writes the KV cache at one shared
  index; ``KVCache.valid`` masks the padding and positions are per row (``index - pad``).
- The ``n`` samples of a prompt share one prefill: the prompt rows are prefilled once, then the
  cache is expanded to ``P * n`` rows.
- Finished rows stop costing compute: once a quarter of the live rows have finished, the cache
  and the row state are compacted to the rows still running.
- Sampling is by inverse CDF: one uniform per row and step, ``searchsorted(cumsum(q), u)``; no sort
  when top-k / top-p are off, and one random number per row instead of one per vocabulary entry
  (V = 152k made the per-entry noise ~7% of a 0.5B decode step). The uniforms are drawn for every
  original row each step, so a row's tokens do not depend on which other rows have finished.
- On CUDA the decode step runs as a CUDA graph over a static KV cache (``align.rollout.graph_decode``; no
  compaction there, eager where a shape cannot be captured); on a CPU, the packed weights below.

Logprobs (seed 003, "logprob basis"): ``Completion.logprobs`` is ``log_softmax(logits / T)`` of the
sampled token over the full vocabulary (the training basis, recomputed teacher-forced by the loss).
``Completion.sampled_logprobs`` is the log-probability under the distribution actually sampled from
(top-k, then top-p, renormalised); it equals ``logprobs`` when neither is active. Greedy
(``temperature == 0``) reports ``log_softmax(logits)`` and a sampled logprob of 0 (a point mass).

Shapes: P prompts, R live rows (P * n at most), S cache length, V vocab.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from align import heartbeat
from align.model import MLP, Attention, KVCache, Linear, Transformer
from align.moe import Routing, moe_layers
from align.rollout import cpu_decode, cpu_kernel, cpu_sample, graph_decode
from align.rollout.protocol import Completion, SamplingParams

COMPACT_FRACTION = 0.25  # compact the batch once this fraction of live rows has finished
_LOCKS_GUARD = threading.Lock()  # guards _LOCKS
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the RLock its packed_weights contexts hold
MKL_MAX_BYTES = 8 * 2**20  # fp32 weights below this use MKL's packed sgemm, larger ones oneDNN (PackedLinear)


def _mkl_packing_available(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear:
    """A prepacked copy of one or more linear layers sharing an input (q|k|v, gate|up), fused in one GEMM.

    Three layouts (``kind``), measured by ``benchmarks/bench_packing.py`` (decode-sized row counts, weights
    streamed from memory):
    - ``"avx512"`` / ``"avx2"``: fp32, at most ``cpu_kernel.MAX_ROWS`` rows, where ``cpu_kernel.load()`` works
      (AVX-512, or AVX2 + FMA, and a C++ compiler; ``cpu_kernel.choose()`` picks): our kernel; on AVX-512 a decode
      step's GEMMs take 5% (31M shape, 16 rows) to 15% (0.5B shape, 8 rows) less time than on the two library
      layouts, 83-89% of a plain memory read on the latter;
    - ``"mkl"``: other fp32 weights under ``MKL_MAX_BYTES``: MKL's packed sgemm (5-16% less time than
      oneDNN on 1-6 MB weights, ~9 us per call instead of ~30 us);
    - ``"onednn"``: larger weights, bf16, no MKL: oneDNN's blocked layout (3-12% less time from 17 MB up).
    MKL's packing is tied to the row count: fewer rows (after compaction) are zero-padded up to it. More
    rows than a layout takes (the prefill, compute-bound) run the original layers."""

    def __init__(self, linears: list[nn.Linear], rows: int):
        weights = [_effective_weight(m) for m in linears]
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.linears, self.rows, self.out_features = linears, rows, sum(w.shape[0] for w in weights)
        ops = _kernel_ops() if weights[0].dtype == torch.float32 and rows <= cpu_kernel.MAX_ROWS else None
        if ops is not None:  # packs the concatenation without making it
            self.kind, self.gemm, self.weight = ops.name.removeprefix("align_cpu_"), ops.linear, ops.pack(weights)
            return
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        nbytes = weight.numel() * weight.element_size()
        if _mkl_packing_available(weight.dtype) and nbytes < MKL_MAX_BYTES:
            self.kind = "mkl"
            self.weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            self.sizes = torch.empty(()).expand(weight.shape)  # _mkl_linear reads only the sizes when rows match
        else:
            self.kind = "onednn"
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        m = x.numel() // x.shape[-1]
        kernel = self.kind in cpu_kernel.KERNELS
        if m > (cpu_kernel.MAX_ROWS if kernel else self.rows):
            return torch.cat([_unpacked(lin, x) for lin in self.linears], dim=-1)
        x2 = x.reshape(m, x.shape[-1])
        if kernel:
            y = self.gemm(x2, self.weight, self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if m < self.rows:
            x2 = torch.cat([x2, x2.new_zeros(self.rows - m, x2.shape[-1])])
        y = torch.ops.mkl._mkl_linear(x2, self.weight, self.sizes, self.bias, self.rows)
        return y[:m].view(*x.shape[:-1], y.shape[-1])


def _effective_weight(m: nn.Linear) -> torch.Tensor:
    """The weight a layer computes with: a LoRA layer's ``W + scaling * B @ A`` (``align.lora``) as a new
    tensor, so the packed copy carries the adapter and the frozen weight is never written."""
    merged = getattr(m, "merged_weight", None)
    return merged() if merged is not None else m.weight.detach()


def _unpacked(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return m.unpacked(x) if isinstance(m, Linear) else F.linear(x, m.weight, m.bias)


def _kernel_ops():
    """The decode GEMM's ops (``align.rollout.cpu_kernel``: AVX-512 or AVX2, chosen once), or None; a seam for tests."""
    return cpu_kernel.load()


@contextlib.contextmanager
def packed_weights(model: nn.Module, rows: int) -> Iterator[bool]:
    """CPU inference: run the linear layers on prepacked copies of their weights (``PackedLinear``) for the
    duration, with q|k|v and gate|up fused into one GEMM each.

    Small-batch decode on a CPU streams every weight from memory once per token; the packed layouts stream
    1.5-2x faster than the (out, in) layout training needs (``bench_packing.py --step``: ``F.linear`` reaches
    37-40% of a plain memory read), and fusing removes the per-call cost of the small k/v projections.
    Costs one extra copy of the linear weights while active, made from the current weights on entry (so
    a sampler sharing the training model always sees the latest step). Re-entrant: inside an active
    context (same model) it reuses the copy, so wrapping several ``generate`` calls over unchanged weights
    packs once (packing the 0.5B shape takes ~1 s here). One thread at a time per model: a context holds the
    model's lock until it leaves, so two threads sampling one snapshot (an eval point and the producer) take turns,
    each on a copy packed for its own rows, and no thread's generation switches layers mid-way (the race that
    changed its numerics). Do not update the weights inside it.
    No-op (yields False) off the CPU (CUDA runs the model's own layers), under autograd or CPU autocast (bf16-mixed
    samples in bf16 like the trainer computes), without oneDNN, or for bf16 weights on a CPU without oneDNN's bf16
    support (no AVX-512: its packed bf16 GEMM raises there)."""
    w = model.lm_head.weight
    usable = (
        w.device.type == "cpu"
        and w.dtype in (torch.float32, torch.bfloat16)
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and torch.backends.mkldnn.is_available()
        and (w.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())  # oneDNN bf16: AVX-512 / AMX
    )
    if not usable:
        yield False
        return
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(model, threading.RLock())
    with lock:
        if getattr(model.lm_head, "packed", None) is not None:  # this thread's own context is open: reuse its copy
            yield True
            return
        _pack(model, rows)
        try:
            yield True
        finally:
            _unpack(model)


def _pack(model: nn.Module, rows: int) -> None:
    """Sets the packed copies ``packed_weights`` runs on (all or none: a failure undoes the rest). The fused decode
    attention (``cpu_decode``) wherever the kernel's library loads and the weights are fp32, whatever layout the GEMMs
    take: it attends each row over its own valid slots (the padding of a longer row costs a branch per slot, where the
    torch path's SDPA computes every padded slot), which a partial call's resumed rows next to fresh ones pay for."""
    fused = _kernel_ops() if model.lm_head.weight.dtype == torch.float32 else None
    try:
        for m in model.modules():
            if isinstance(m, Attention):
                m.qkv = PackedLinear([m.q_proj, m.k_proj, m.v_proj], rows)
                m.o_proj.packed = PackedLinear([m.o_proj], rows)
                if fused is not None and cpu_decode.fusable(m, model.config):  # any row count: per row, valid slots
                    m.decode = cpu_decode.FusedAttention(m, fused)
            elif isinstance(m, MLP):
                m.gate_up = PackedLinear([m.gate_proj, m.up_proj], rows)
                m.down_proj.packed = PackedLinear([m.down_proj], rows)
        model.lm_head.packed = PackedLinear([model.lm_head], rows)
    except BaseException:
        _unpack(model)
        raise


def _unpack(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, (Attention, MLP)):
            for attr in ("qkv", "gate_up", "decode"):
                m.__dict__.pop(attr, None)
        if isinstance(m, Linear):
            m.packed = None


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """The calling thread's torch intra-op threads (OpenMP, MKL) set to ``n`` for the duration, then put back (None,
    or the count it has: nothing changes). A thread that already ran a parallel op keeps its own count: the
    trainer's thread beside an async generation thread is not changed by it (``engines.NativeEngine``).
    ``torch.set_num_threads`` also sets the process-wide count a thread's first parallel op starts from; it is put
    back at once from a throwaway thread, so a thread started during the call (an eval point) starts from the run's
    count, not from whether a generation was running (that would make its floats depend on timing)."""
    old = torch.get_num_threads()  # also this thread's first-use setup, which would read the process-wide count
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    _set_process_threads(old)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _set_process_threads(n: int) -> None:
    """torch's process-wide intra-op count (the one a new thread starts from) set to ``n``, the caller's unchanged."""
    t = threading.Thread(target=torch.set_num_threads, args=(n,), name="align-threads")
    t.start()
    t.join()


def validate_prompts(prompts: list[list[int]], vocab_size: int, context: int) -> None:
    if not prompts:
        raise ValueError("generate() needs at least one prompt; got an empty list")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. a BOS token)")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
        if len(p) >= context:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens, which leaves no room in the model's context of {context} "
                "(max_position_embeddings); shorten the prompt"
            )


def penalise(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM's (CTRL's) repetition penalty on (R, V) logits: a token in ``seen`` (R, V) bool (the prompt and the
    completion so far) has its logit divided by ``penalty`` when > 0, multiplied when <= 0."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def truncate_logits(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask (R, V) logits below ``min_p`` times the top token's probability, then outside top-k, then outside the
    top-p nucleus (vLLM's order). Keeps >= 1 token."""
    if min_p > 0:
        probs = scaled.softmax(-1)  # (R, V)
        scaled = scaled.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # (R, 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        remove = probs.cumsum(-1) - probs > top_p  # tokens whose preceding mass already exceeds top_p
        remove[:, 0] = False
        scaled = scaled.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return scaled


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    row_id: torch.Tensor | None = None,
    total_rows: int | None = None,
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (R, V) -> (tokens (R,), logprobs (R,) in the training basis, sampled-distribution logprobs (R,)).

    The training basis is ``log_softmax(logits / T)`` of the model's own logits; the sampled distribution is that
    after the repetition penalty (``seen`` (R, V): the tokens each row has seen), min-p, top-k and top-p, so the
    third output is exactly the logprob of what was sampled from. The uniforms are drawn for all ``total_rows`` original rows and indexed by ``row_id``, so a row's
    tokens do not depend on which other rows are still running (compaction changes nothing)."""
    logits = logits.float()
    penalised = logits
    if seen is not None and params.repetition_penalty != 1.0:
        penalised = penalise(logits, seen, params.repetition_penalty)
    if params.temperature == 0:
        tok = penalised.argmax(-1)
        lp = logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)
        return tok, lp, torch.zeros_like(lp)
    truncated = params.processed
    if not truncated and penalised is logits and cpu_sample.usable(logits) and (ops := _kernel_ops()) is not None:
        # on a CPU with the decode kernel's library: the same draw in one op (align.rollout.cpu_sample)
        u = _uniforms(logits, generator, row_id, total_rows)
        tok, lp = ops.sample_rows(logits.contiguous(), u, float(params.temperature))
        return tok, lp, lp
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    logp = scaled.log_softmax(-1)  # (R, V) training basis
    if truncated:
        scaled_q = penalised / params.temperature if penalised is not logits else scaled
        logq = truncate_logits(scaled_q, params.top_k, params.top_p, params.min_p).log_softmax(-1)  # (R, V)
    else:
        logq = logp
    V = logq.shape[-1]
    u = _uniforms(logq, generator, row_id, total_rows)
    cdf = logq.exp().cumsum(-1)  # (R, V)
    # inverse CDF: the first token whose cumulative mass exceeds u; zero-mass tokens are never chosen
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=V - 1)
    lp = logp.gather(-1, tok[:, None]).squeeze(-1)
    slp = logq.gather(-1, tok[:, None]).squeeze(-1) if truncated else lp
    return tok, lp, slp


def _uniforms(
    logits: torch.Tensor, generator: torch.Generator | None, row_id: torch.Tensor | None, total_rows: int | None
) -> torch.Tensor:
    """(R,) uniforms of a step, one per live row: drawn for every original row (``total_rows``), indexed by row."""
    R = logits.shape[0]
    u = torch.rand(total_rows or R, device=logits.device, generator=generator)  # one uniform per original row
    if row_id is not None:
        return u[row_id]
    if u.shape[0] != R:
        raise ValueError(f"{R} rows of logits but {u.shape[0]} uniforms: pass row_id")
    return u


class Until(NamedTuple):
    """Stop a ``_generate`` call at a token boundary once ``need`` groups are complete (``--partial-rollouts``,
    ``align.rollout.partial``); every row still running comes back cut (``finish_reason == "cut"``). ``need``
    = every group: no row is cut (a call that only wants the per-row options below: the gateway's batches).

    ``groups``: the group of each row; ``budgets``: each row's token budget (None: ``max_tokens``); ``draw``: each
    row's index in the uniforms of a step, of ``total`` (None: the rows in order). ``start`` (``--partial-prefill
    keep``, ``align.rollout.partial``): ``start(cache_len, dtype) -> (cache, logits)`` replaces the prefill (one
    row per prompt, each right-aligned at the longest prompt's length, the next token's logits (R, V)); ``kept``:
    a dict the call fills with each cut row's cache, {row: (k, v)} (L, K, S_row, D), every token fed so far.
    ``stop`` (``--partial-cut publish``): asked after every token; True cuts the rows still running there too."""

    groups: list[int]
    need: int
    budgets: list[int] | None = None
    draw: list[int] | None = None
    total: int | None = None
    start: Callable[[int, torch.dtype], tuple[KVCache, torch.Tensor]] | None = None
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    stop: Callable[[], bool] | None = None


def generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    pack_weights: bool = True,
    rows: tuple[int, int] | None = None,
    cuda_graphs: bool = True,
) -> list[Completion]:
    """Sample ``params.n`` completions per prompt. Returns them ordered by (prompt_index, sample_index).

    A completion ends with ``finish_reason == "stop"`` (its last token is one of ``stop_token_ids``) or
    ``"length"`` (``max_tokens`` reached, or the model's context is full). On a CPU, ``pack_weights``
    runs the linear layers on a prepacked copy of the weights for the call (``packed_weights``: faster
    decode for one extra copy of the weights while sampling). To sample repeatedly from unchanged weights,
    enter ``packed_weights(model, rows)`` once around the calls; any row count stays correct (fewer rows
    are padded, more rows run the original layers), the fastest is ``rows == len(prompts) * n``.

    ``rows=(first, total)``: these prompts' ``len(prompts) * n`` rows are rows ``first, first + 1, ...`` of a
    larger call of ``total`` rows with the same seed (``align.dist``: one rank's share of a step); each decode step
    draws the uniforms of all ``total`` rows and keeps its own, so every row samples exactly what it samples in the
    one large call.

    On CUDA, ``cuda_graphs`` decodes through a static KV cache with the step captured once per (rows, cache length)
    shape and replayed (``align.rollout.graph_decode``: eager where a shape cannot be captured, said once); the
    same tokens and logprobs as the eager loop for a seed. No effect on a CPU."""
    packing = packed_weights(model, len(prompts) * params.n) if pack_weights else contextlib.nullcontext()
    with torch.inference_mode(), packing, heartbeat.working("sampler", engine="native", rows=len(prompts) * params.n):
        return _generate(model, prompts, params, rows, cuda_graphs=cuda_graphs)


def prefill(
    model: Transformer, prompts: list[list[int]], max_len: int, dtype: torch.dtype
) -> tuple[KVCache, torch.Tensor]:
    """The P prompts prefilled once, left-padded (each right-aligned at the longest, L): a cache of ``max_len``
    slots with ``length`` L, and the logits (P, V) of each prompt's next token."""
    device = model.lm_head.weight.device
    P, L = len(prompts), max(len(p) for p in prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    cache = KVCache(model.config, P, max_len, dtype, device)
    ids = torch.zeros(P, L, dtype=torch.long, device=device)  # (P, L)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p, device=device)
    pad = L - lens  # (P,)
    cache.valid[:, :L] = torch.arange(L, device=device)[None] >= pad[:, None]
    positions = (torch.arange(L, device=device)[None] - pad[:, None]).clamp(min=0)  # (P, L)
    hidden = model(ids, positions=positions, cache=cache, return_hidden=True)[:, -1:]  # (P, 1, E)
    logits = model.lm_head(hidden)[:, 0]  # (P, V): the head runs on the last position only
    cache.length = L
    return cache, logits


def _generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    rows_of: tuple[int, int] | None = None,
    until: Until | None = None,
    cuda_graphs: bool = True,
) -> list[Completion]:
    cfg = model.config
    context = cfg.max_position_embeddings
    validate_prompts(prompts, cfg.vocab_size, context)
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    if torch.is_autocast_enabled(device.type):  # bf16-mixed: the cache holds what the autocast matmuls make
        dtype = torch.get_autocast_dtype(device.type)
    P, n = len(prompts), params.n
    lens = torch.tensor([len(p) for p in prompts], device=device)
    L = int(lens.max())
    max_tokens = params.max_tokens if until is None or until.budgets is None else max(until.budgets)
    max_new = min(max_tokens, context - int(lens.min()))
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)

    if until is not None and until.start is not None:  # --partial-prefill keep: the caller's cache (n == 1)
        cache, logits = until.start(L + max_new, dtype)
    else:
        cache, logits = prefill(model, prompts, L + max_new, dtype)

    # Expand to P * n rows sharing the prefill.
    rows = torch.arange(P, device=device).repeat_interleave(n)  # (R,)
    cache.select(rows)
    logits = logits[rows]
    seen = None  # (R, V) the tokens each row has seen, for the repetition penalty
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(P, logits.shape[-1], dtype=torch.bool, device=device)  # (P, V)
        for i, p in enumerate(prompts):
            seen[i, torch.tensor(p, device=device)] = True
        seen = seen[rows]  # (R, V)
    R = P * n
    first, total = rows_of if rows_of is not None else (0, R)
    if not 0 <= first <= total - R:
        raise ValueError(f"rows={rows_of}: {R} rows starting at {first} do not fit in {total} rows")
    row_id = torch.arange(R, device=device)  # original row of each live row
    draw_base = row_id + first if rows_of is not None else None  # each row's row in the uniforms of a step
    if until is not None and until.draw is not None:
        draw_base, total = torch.tensor(until.draw, device=device), until.total
    draw_id = draw_base  # the live rows' rows in the uniforms (None: all R, in order)
    budget = None  # (R,) per-row token budgets: every row of an ``until`` call finishes explicitly
    if until is not None:
        budget = torch.tensor(until.budgets or [max_new] * R, device=device).clamp(max=max_new)
    left: dict[int, int] = {}  # --partial-rollouts: rows still running per group
    for g in until.groups if until is not None else ():
        left[g] = left.get(g, 0) + 1
    complete, cut = 0, torch.zeros(R, dtype=torch.bool, device=device)
    pos = lens[rows].clone()  # next position of each live row
    out_tok = torch.zeros(R, max_new, dtype=torch.long, device=device)
    out_lp = torch.zeros(R, max_new, device=device)
    out_slp = torch.zeros(R, max_new, device=device)
    length = torch.full((R,), max_new, dtype=torch.long, device=device)
    stopped = torch.zeros(R, dtype=torch.bool, device=device)
    stop_ids = torch.tensor(params.stop_token_ids, device=device) if params.stop_token_ids else None
    done = torch.zeros(R, dtype=torch.bool, device=device)  # per live row: finished, awaiting compaction
    n_moe = len(moe_layers(cfg))  # MoE: record the experts of every token fed back (align.moe.batch_routes)
    if n_moe:
        out_routes = torch.full((R, max_new, n_moe, cfg.num_experts_per_tok), -1, dtype=torch.int16, device=device)
    n_done, compacted = 0, False  # Python mirrors: no device sync for what the loop already knows
    static = graph_decode.decoder(model, R, L + max_new, dtype, device) if cuda_graphs and not n_moe else None
    if static is not None:  # CUDA graph: the prefill moves into the static cache; rows are never compacted
        static.load(cache)
        cache = static.cache
    full_from = context - 1 - L  # the first step at which the longest row has no position left

    for t in range(max_new):
        tok, lp, slp = sample_next(logits, params, generator, draw_id, total, seen)
        heartbeat.beat("sampler")  # a token per row: progress for the watchdog (align.run.watchdog)
        if seen is not None:
            seen[torch.arange(tok.shape[0], device=device), tok] = True
        # Rows already done (awaiting compaction) write past their length; the final slicing drops it.
        if compacted:
            out_tok[row_id, t], out_lp[row_id, t], out_slp[row_id, t] = tok, lp, slp
        else:
            out_tok[:, t], out_lp[:, t], out_slp[:, t] = tok, lp, slp
        newly = 0
        if stop_ids is not None or t >= full_from or budget is not None:  # else none can finish before max_tokens
            hit_stop = torch.isin(tok, stop_ids) if stop_ids is not None else torch.zeros_like(done)
            full = pos + 1 >= context  # no position left for another token
            if budget is not None:
                full |= budget[row_id] <= t + 1  # the row's own budget (a resumed row's rest of max_tokens)
            if n_done:
                hit_stop &= ~done
                full &= ~done
            finished = hit_stop | full
            newly = int(finished.sum())
            if newly:
                length[row_id[finished]] = t + 1
                stopped[row_id[hit_stop]] = True
                done |= finished
                n_done += newly
                if until is not None:
                    for r in row_id[finished].tolist():
                        left[until.groups[r]] -= 1
                        complete += left[until.groups[r]] == 0
        cut_now = until is not None and (complete >= until.need or (until.stop is not None and until.stop()))
        if cut_now and n_done < done.numel():  # cut the rows still running
            length[row_id[~done]] = t + 1
            cut[row_id[~done]] = True
            if until.kept is not None:  # --partial-prefill keep: each cut row's cache, the slots it has written
                for i in (~done).nonzero().squeeze(-1).tolist():
                    slots = cache.valid[i, : cache.length].nonzero().squeeze(-1)
                    until.kept[int(row_id[i])] = (cache.k[:, i, :, slots].clone(), cache.v[:, i, :, slots].clone())
            break
        if t == max_new - 1 or n_done == done.numel():
            break
        if newly and static is None and n_done >= max(1, int(COMPACT_FRACTION * done.numel())):
            keep = (~done).nonzero().squeeze(-1)
            cache.select(keep)
            tok, pos, row_id, done = tok[keep], pos[keep], row_id[keep], done[keep]
            seen = seen[keep] if seen is not None else None
            draw_id, n_done, compacted = row_id if draw_base is None else draw_base[row_id], 0, True
        cache.valid[:, cache.length] = True
        if n_moe:  # MoE: the experts each fed token used, per MoE layer
            routing = Routing()
            logits = model(tok[:, None], positions=pos[:, None], cache=cache, routing=routing)[:, -1]  # (R, V)
            out_routes[row_id if compacted else slice(None), t] = torch.stack(
                [routing.chosen[j] for j in range(n_moe)], 1
            ).to(torch.int16)  # (R live, Lm, k)
        elif static is not None:
            logits = static.step(tok, pos)  # (R, V), replayed
        else:
            logits = model(tok[:, None], positions=pos[:, None], cache=cache)[:, -1]  # (R, V)
        cache.length += 1
        pos = pos + 1

    completions = []
    lengths, stopped_l, cut_l = length.tolist(), stopped.tolist(), cut.tolist()
    toks, lps, slps = out_tok.tolist(), out_lp.tolist(), out_slp.tolist()
    for r in range(R):
        k = lengths[r]
        completions.append(
            Completion(
                prompt_index=r // n,
                sample_index=r % n,
                token_ids=toks[r][:k],
                logprobs=lps[r][:k],
                sampled_logprobs=slps[r][:k],
                finish_reason="cut" if cut_l[r] else "stop" if stopped_l[r] else "length",
                routes=out_routes[r, : max(k - 1, 0)].cpu() if n_moe else None,
            )
        )
    return completions
