"""Attention for ``align.model``: RoPE, the KV cache, and the attention call over a plain row, a cached step, or a
packed row of shared-prefix segments.

``attend(q, k, v, how)`` is the one call the model's ``Attention`` layer makes after its projections:
- ``how`` None: causal attention over the row (training, uncached forwards);
- a (B, 1, T, S) bool tensor: the KV cache's mask (sampling; ``cache_mask``);
- a ``PackedLayout``: one row (B = 1) of segments, each a prompt followed by completions that share it
  (``align.packing`` builds it for the learner). The prompt attends causally to itself; each completion attends to
  its prompt and causally to itself, never to a sibling or another segment.

Packed backends (all pure torch), picked per layout:
- ``"sdpa"`` (the CPU path, and a CUDA fallback): per segment, one causal SDPA call over the prompt, then one call
  for all of its completions, each padded to the segment's longest completion, whose queries see
  [the prompt's keys; their own keys] with a causal offset. The blocks a completion may not see (its siblings,
  other segments) are never computed, and no (T, T) mask over the row exists; the only padding is within a segment's
  completions and below. A segment with a single completion is one causal sequence, and such segments of similar
  length (SFT rows, groups of G = 1; ``LENGTH_SLACK``) share one causal call, right-padded to the longest of them
  (causal: no real query sees a pad slot; the projections and the MLP still run unpadded), the outputs put back in
  row order by one index.
- ``"flex"`` (CUDA): ``torch.nn.attention.flex_attention`` with a block mask from per-token segment / sibling ids,
  compiled once; FlexAttention skips the fully masked blocks. Chosen for CUDA because it is one kernel per layer
  over the whole row whatever the number of segments (the per-segment calls launch ~2 kernels per segment and
  layer); CPU FlexAttention has no backward in torch 2.13, so it is the forward-only path there (tests).

Shapes: B batch, H query heads, K kv heads, T tokens of the row, S cached length, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from align import fused_cpu

PACKED_BACKENDS = ("sdpa", "flex")
LENGTH_SLACK = 1.25  # sdpa: one-sequence segments share a causal call when the longest is <= 1.25x the shortest


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos/sin (B, 1, T, D) in x's dtype, ``sin`` with its first half negated (``Transformer.rope``).
    Rotate-half convention (HF): ``x * cos + cat(-x2, x1) * sin`` = ``x * cos + cat(x2, x1) * sin_signed``, the
    same floats (a negation is exact) without a negated copy of x. fp32 on the CPU: one fused pass each way
    (``align.fused_cpu``) where it builds."""
    if (fused := fused_cpu.rope(x, cos, sin)) is not None:
        return fused
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


class KVCache:
    """Per-layer key/value buffers for B rows and up to S positions, with one shared write index.

    Rows are left-padded so every row writes at the same index; ``valid[b, s]`` is False for padding.
    The sampler owns the cache; the model only reads and writes the slots it is given.

    Two ways to index it: by ``length`` (a Python int: the new tokens go at ``length``, attention reads the first
    ``length + T`` slots), or, when ``slot`` is set, by ``slot`` (a (T,) long tensor on the cache's device: the new
    tokens go there and attention reads every slot, ``valid`` masking the rest). The second keeps every shape and
    address fixed from step to step, so one decode step can be captured in a CUDA graph and replayed
    (``align.rollout.graph_decode``).
    """

    def __init__(self, cfg: Any, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)  # (L, B, K, S, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # (B, S)
        self.length = 0
        self.slot: torch.Tensor | None = None  # (T,) write positions: the static (CUDA graph) indexing

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (compaction when rows finish, or expansion to n samples per prompt)."""
        S = self.length
        self.k = self.k[:, rows, :, :].contiguous() if S else self.k[:, rows]
        self.v = self.v[:, rows, :, :].contiguous() if S else self.v[:, rows]
        self.valid = self.valid[rows]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store T new keys / values (B, K, T, D) of ``layer``; returns the keys and values to attend over."""
        if self.slot is not None:  # static: fixed shapes and addresses, the position a device tensor
            self.k[layer].index_copy_(2, self.slot, k.to(self.k.dtype))  # autocast: RoPE's fp32 k, a bf16 cache
            self.v[layer].index_copy_(2, self.slot, v.to(self.v.dtype))
            return self.k[layer], self.v[layer]  # (B, K, S_max, D)
        s0, T = self.length, k.shape[2]
        self.k[layer, :, :, s0 : s0 + T] = k
        self.v[layer, :, :, s0 : s0 + T] = v
        return self.k[layer, :, :, : s0 + T], self.v[layer, :, :, : s0 + T]  # (B, K, S, D)


def cache_mask(cache: KVCache, T: int) -> torch.Tensor:
    """The mask of T new tokens written at ``cache.length`` (or at ``cache.slot``): every valid cached slot at or
    before each of them."""
    if cache.slot is not None:  # static: every slot of the buffer; the caller marks the new ones valid first
        mask = cache.valid[:, None, None, :]  # (B, 1, 1, S_max)
        if T > 1:
            key_idx = torch.arange(cache.max_len, device=mask.device)
            mask = mask & (key_idx[None, :] <= cache.slot[:, None])[None, None]  # (B, 1, T, S_max)
        return mask
    s0 = cache.length
    S = s0 + T
    mask = cache.valid[:, None, None, :S]  # (B, 1, 1, S): one new token (decode) sees every valid slot
    if T > 1:
        key_idx = torch.arange(S, device=mask.device)
        query_idx = torch.arange(s0, S, device=mask.device)
        mask = mask & (key_idx[None, :] <= query_idx[:, None])[None, None]  # (B, 1, T, S)
    return mask


# ------------------------------------------------------------------------------------------------ packed rows


@dataclass
class Segment:
    """One prompt and the completions that share it, in packed-row coordinates: the prompt's tokens are
    ``[start, start + prompt)``, completion j's own tokens ``[completions[j][0], + completions[j][1])`` (length 0 for
    a one-token completion: its only scored position is the prompt's last). Completions follow the prompt
    contiguously, in order."""

    start: int
    prompt: int
    completions: list[tuple[int, int]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.prompt + sum(n for _, n in self.completions)


@dataclass(eq=False)
class PackedLayout:
    """The segments of one packed row, covering ``[0, length)`` in order, and the attention backend that runs it.
    Index tensors are built once per device and shared by every layer (and the backward)."""

    segments: list[Segment]
    length: int
    backend: str = "sdpa"
    _built: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in PACKED_BACKENDS:
            raise ValueError(f"packed attention backend {self.backend!r}; expected one of {PACKED_BACKENDS}")
        at = 0
        for s in self.segments:  # the segments tile [0, length) in order, each completion right after the last
            assert s.start == at and s.prompt > 0, (s, at)
            at += s.prompt
            for c, n in s.completions:
                assert c == at and n >= 0, (s, at)
                at += n
        assert at == self.length, f"segments cover {at} of {self.length} tokens"

    def ids(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token segment ids and sibling ids (0 = a prompt token, j + 1 = completion j's), int32 (T,) each."""
        seg, sib = [], []
        for i, s in enumerate(self.segments):
            seg += [i] * (s.end - s.start)
            sib += [0] * s.prompt
            for j, (_, n) in enumerate(s.completions):
                sib += [j + 1] * n
        as_int = {"dtype": torch.int32, "device": device}
        return torch.tensor(seg, **as_int), torch.tensor(sib, **as_int)

    def group_plans(self, device: torch.device) -> list[tuple | None]:
        """Per segment, the padded-completions plan of the sdpa backend, or None when the segment is one causal
        sequence (at most one completion with tokens): (gather index (g * Lc,), mask (g, 1, Lc, P + Lc), unpad index
        (sum of lengths,), g, Lc)."""
        key = ("plans", str(device))
        if key not in self._built:
            self._built[key] = [_group_plan(s, device) for s in self.segments]
        return self._built[key]

    def sdpa_calls(self, device: torch.device) -> tuple[list[tuple], torch.Tensor | None]:
        """The sdpa backend's calls, and the permutation of their concatenated outputs back to row order (None: they
        are in row order). ("bucket", gather (n * L,), unpad (sum of lengths,), n, L): one-sequence segments of
        similar length (the longest at most ``LENGTH_SLACK`` x the shortest), one causal call right-padded to the
        longest (causal: no real query sees a pad slot); ("segment", segment, its ``group_plans`` entry): the
        others, one by one."""
        key = ("calls", str(device))
        if key not in self._built:
            plans = self.group_plans(device)
            calls: list[tuple] = []
            covered: list[torch.Tensor] = []  # the row positions of each call's output, in its order
            buckets: list[list[Segment]] = []  # longest first; a bucket's first segment is its longest
            for s in sorted((s for s, p in zip(self.segments, plans) if p is None), key=lambda s: s.start - s.end):
                if buckets and (s.end - s.start) * LENGTH_SLACK >= buckets[-1][0].end - buckets[-1][0].start:
                    buckets[-1].append(s)
                else:
                    buckets.append([s])
            for b in buckets:
                calls.append(("bucket", *_bucket(b, device)) if len(b) > 1 else ("segment", b[0], None))
                covered += [torch.arange(s.start, s.end) for s in b]
            for s, p in zip(self.segments, plans):
                if p is not None:
                    calls.append(("segment", s, p))
                    covered.append(torch.arange(s.start, s.end))
            pos = torch.cat(covered)  # (T,)
            order = None if torch.equal(pos, torch.arange(self.length)) else torch.argsort(pos).to(device)
            self._built[key] = calls, order
        return self._built[key]

    def sdpa_gather(self, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """The row positions every ``sdpa_calls`` call reads, in call order, and the piece sizes: a bucket's
        padded sequences; a segment's prompt (its whole sequence when it has no plan), then its padded
        completions."""
        key = ("gather", str(device))
        if key not in self._built:
            calls, _ = self.sdpa_calls(device)
            pieces: list[torch.Tensor] = []
            for kind, *call in calls:
                if kind == "bucket":
                    pieces.append(call[0])
                    continue
                s, plan = call
                end = s.end if plan is None else s.start + s.prompt
                pieces.append(torch.arange(s.start, end, device=device))
                if plan is not None:
                    pieces.append(plan[0])
            self._built[key] = torch.cat(pieces), [len(p) for p in pieces]
        return self._built[key]

    def block_mask(self, device: torch.device) -> Any:
        """FlexAttention's block mask of this row: same segment, causal, and the key a prompt token or a token of
        the query's own completion."""
        key = ("block_mask", str(device))
        if key not in self._built:
            from torch.nn.attention.flex_attention import create_block_mask

            seg, sib = self.ids(device)

            def mask_mod(b, h, q_idx, kv_idx):
                same = (seg[q_idx] == seg[kv_idx]) & (kv_idx <= q_idx)
                return same & ((sib[kv_idx] == 0) | (sib[kv_idx] == sib[q_idx]))

            self._built[key] = create_block_mask(mask_mod, None, None, self.length, self.length, device=device)
        return self._built[key]


def _group_plan(s: Segment, device: torch.device) -> tuple | None:
    comps = [(c, n) for c, n in s.completions if n > 0]
    if len(comps) <= 1:
        return None
    g, Lc, P = len(comps), max(n for _, n in comps), s.prompt
    slot = torch.arange(Lc)
    gather = torch.cat([c + torch.clamp(slot, max=n - 1) for c, n in comps])  # (g * Lc,): pad slots repeat a token
    own = slot[None, :] <= slot[:, None]  # (Lc, Lc) causal within the completion
    lengths = torch.tensor([n for _, n in comps])
    mask = torch.cat(
        (torch.ones(g, Lc, P, dtype=torch.bool), own[None] & (slot[None, None, :] < lengths[:, None, None])), dim=2
    )[:, None]  # (g, 1, Lc, P + Lc): the whole prompt, then its own earlier tokens (pad keys hidden)
    unpad = torch.cat([j * Lc + torch.arange(n) for j, (_, n) in enumerate(comps)])  # (sum n,)
    return gather.to(device), mask.to(device), unpad.to(device), g, Lc


def _bucket(segments: list[Segment], device: torch.device) -> tuple:
    """(gather (n * L,), unpad (sum of lengths,), n, L) of one-sequence segments, each right-padded to L tokens."""
    lengths = [s.end - s.start for s in segments]
    L, slot = max(lengths), torch.arange(max(lengths))
    gather = torch.cat([s.start + torch.clamp(slot, max=n - 1) for s, n in zip(segments, lengths)])  # pads repeat
    unpad = torch.cat([j * L + torch.arange(n) for j, n in enumerate(lengths)])
    return gather.to(device), unpad.to(device), len(segments), L


_FLEX: dict = {}


def _flex_attention() -> Any:
    """``flex_attention``, compiled once on CUDA (eager elsewhere: CPU tests run its forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "cuda" not in _FLEX:
        _FLEX["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["cuda"]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Attention of one packed row: q (1, H, T, D), k / v (1, K, T, D) -> (1, H, T, D) (see the module docstring).

    The sdpa backend takes every call's tokens out of q, k and v with one gather each (``sdpa_gather``), split into
    the calls' pieces: backward is then one concatenation and one scatter per tensor and layer, not a full-size
    zero-filled gradient per piece (a slice's or an index_select's backward) summed piece by piece."""
    gqa = q.shape[1] != k.shape[1]
    if layout.backend == "flex":
        if q.device.type == "cuda":
            return _flex_attention()(q, k, v, block_mask=layout.block_mask(q.device), enable_gqa=gqa)
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=layout.block_mask(q.device), enable_gqa=gqa)
    parts = []
    calls, order = layout.sdpa_calls(q.device)
    index, sizes = layout.sdpa_gather(q.device)
    qs, ks, vs = (t.squeeze(0).index_select(1, index).split(sizes, dim=1) for t in (q, k, v))  # pieces (X, n, D)
    pieces = iter(zip(qs, ks, vs))

    def padded(n: int, L: int) -> tuple[torch.Tensor, ...]:  # the next piece as n sequences of L tokens each
        return tuple(t.unflatten(1, (n, L)).transpose(0, 1) for t in next(pieces))  # (n, H or K, L, D)

    for kind, *call in calls:
        if kind == "bucket":  # one-sequence segments of similar length (SFT rows): one causal call
            _, unpad, n, L = call
            out = F.scaled_dot_product_attention(*padded(n, L), is_causal=True, enable_gqa=gqa)  # (n, H, L, D)
            parts.append(out.transpose(0, 1).flatten(1, 2).index_select(1, unpad))  # (H, sum of lengths, D)
            continue
        _, plan = call
        qp, kp, vp = (t[None] for t in next(pieces))  # (1, H or K, P, D): the prompt, or the whole sequence
        parts.append(F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=gqa)[0])
        if plan is None:
            continue
        _, mask, unpad, g, Lc = plan
        queries, kc, vc = padded(g, Lc)  # (g, H or K, Lc, D): the completions, each padded to Lc
        keys = torch.cat((kp.expand(g, -1, -1, -1), kc), dim=2)  # (g, K, P + Lc, D)
        values = torch.cat((vp.expand(g, -1, -1, -1), vc), dim=2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=gqa)  # (g, H, Lc, D)
        parts.append(out.transpose(0, 1).flatten(1, 2).index_select(1, unpad))  # (H, sum n, D)
    out = torch.cat(parts, dim=1)  # (H, T, D) in call order
    return (out if order is None else out.index_select(1, order))[None]  # (1, H, T, D) in row order


def sliding_window(
    how: torch.Tensor | PackedLayout | None, T: int, window: int, device: torch.device
) -> torch.Tensor | PackedLayout | None:
    """``how`` limited to the last ``window`` keys of each query (Mixtral; HF keeps key s for query q when
    ``s > q - window``): unchanged while no query reaches that far. A packed row longer than the window per
    sequence is refused (its layout has no band)."""
    if isinstance(how, PackedLayout):
        longest = max(s.prompt + max((n for _, n in s.completions), default=0) for s in how.segments)
        if longest > window:
            raise ValueError(
                f"a packed sequence of {longest} tokens exceeds the model's sliding_window={window}: "
                "run with --no-pack-sequences"
            )
        return how
    S = T if how is None else how.shape[-1]
    if S <= window:
        return how
    q = torch.arange(S - T, S, device=device)[:, None]
    s = torch.arange(S, device=device)[None, :]
    band = (s <= q) & (s > q - window)  # (T, S)
    return band[None, None] if how is None else how & band


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: torch.Tensor | PackedLayout | None) -> torch.Tensor:
    """Scaled dot-product attention (scale 1/sqrt(D)) of q (B, H, T, D) over k / v (B, K, S, D): causal when
    ``how`` is None, under the (B, 1, T, S) bool mask ``how``, or over a ``PackedLayout``'s segments."""
    if isinstance(how, PackedLayout):
        return packed_attention(q, k, v, how)
    gqa = q.shape[1] != k.shape[1]
    if how is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=how, enable_gqa=gqa)
