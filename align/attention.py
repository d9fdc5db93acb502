"""Attention for ``align.model``: RoPE, the KV cache, and the attention call over a plain row, a cached step, or a
packed row of shared-prefix segments.

``attend(q, k, v, how)`` is the one call the model's ``Attention`` layer makes after its projections:
- ``how`` None: causal attention over the row (training, uncached forwards);
- a (B, 1, T, S) bool tensor: the KV cache's mask (sampling; ``cache_mask``);
- a ``PackedLayout``: one row (B = 1) of segments, each a prompt followed by completions that share it
  (``align.packing`` builds it for the learner). The prompt attends causally to itself; each completion attends to
  its prompt and causally to itself, never to a sibling or another segment.

Packed backends (all pure torch), picked per layout:
- ``"sdpa"`` (the CPU path, and a CUDA fallback): the row's pieces in a few SDPA calls. A one-sequence piece (a
  prompt, or a segment with a single completion: SFT rows, groups of G = 1) is causal to itself; such pieces of
  similar length (the longest at most ``LENGTH_SLACK`` x the shortest) share one causal call, right-padded to the
  longest (causal: no real query sees a pad slot). A completion of a segment with several is its own query
  sequence over [its prompt's keys; its own keys, causal]; completions, longest first, share one masked call while
  its padded query x key area stays within ``LENGTH_SLACK`` squared of their real one (each padded to the call's
  longest completion and longest prompt, the pad keys masked). The blocks a token may not see (siblings, other
  segments) are never computed and no (T, T) mask over the row exists; the projections and the MLP run unpadded;
  the outputs go back to row order by one index. Calls, not segments: a step of 8 groups of 4 long-tailed
  completions is ~7 calls where one prompt call and one completions call per group was 16 (fwd + bwd 1.5x faster
  on the 1 x 16 partial-rollout bench's shape, 1.2x on 2 x 256 and 4 x 512: docs/performance.md).
- ``"flex"`` (CUDA): ``torch.nn.attention.flex_attention`` with a block mask from per-token segment / sibling ids,
  compiled once; FlexAttention skips the fully masked blocks. Chosen for CUDA because it is one kernel per layer
  over the whole row whatever the number of segments (sdpa launches several kernels per call and layer and
  computes its padding); CPU FlexAttention has no backward in torch 2.13: the forward-only path there (tests).

Shapes: B batch, H query heads, K kv heads, T tokens of the row, S cached length, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from align import fused_cpu

PACKED_BACKENDS = ("sdpa", "flex")
LENGTH_SLACK = 1.25  # sdpa: pieces share a call while the longest is <= 1.25x the shortest (area: 1.25^2 x the real)


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

    def sdpa_calls(self, device: torch.device) -> tuple[list[tuple], torch.Tensor | None]:
        """The sdpa backend's calls, and the permutation of their concatenated outputs back to row order (None: they
        are in row order). Each call is (mask, unpad, n, Lq, Lk): n query sequences of Lq slots over n key sequences
        of Lk slots; mask None = causal (Lq = Lk), else (n, 1, Lq, Lk) bool; ``unpad`` (the real queries,) picks the
        real queries out of the (n * Lq) slots. The pieces (``_pieces``) are bucketed so each call pads little:
        one-sequence pieces by length (the longest at most ``LENGTH_SLACK`` x the shortest), prefixed completions by
        area (the padded query x key area at most ``LENGTH_SLACK`` squared x the real one)."""
        return self._plan(device)[0]

    def sdpa_gather(self, device: torch.device) -> tuple[torch.Tensor, list[int], torch.Tensor, list[int]]:
        """The row positions every ``sdpa_calls`` call reads, in call order: (query index, each call's query slots,
        key index, each call's key slots); a pad slot repeats a real token of its sequence (masked or causal-hidden)."""
        return self._plan(device)[1]

    def _plan(self, device: torch.device) -> tuple:
        key = ("sdpa", str(device))
        if key not in self._built:
            causal, prefixed = _pieces(self.segments)
            calls, covered, qi, ki = [], [], [], []
            for bucket in _buckets(causal, lambda b, x: b[0][1] <= LENGTH_SLACK * x[1]):
                starts, lens = (torch.tensor(c) for c in zip(*bucket))
                index, real = _slots(starts, lens)
                calls.append(
                    (None, real.flatten().nonzero().squeeze(1).to(device), len(bucket), int(lens[0]), int(lens[0]))
                )
                covered.append(index[real])
                qi.append(index.flatten())
                ki.append(index.flatten())
            for bucket in _buckets(prefixed, _fits):
                ps, P, cs, n = (torch.tensor(c) for c in zip(*bucket))
                q, real = _slots(cs, n)  # (g, Lc): each completion's own tokens
                prompt, seen = _slots(ps, P)  # (g, Pk): its prompt's
                Lc, Pk = q.shape[1], prompt.shape[1]
                own = torch.ones(Lc, Lc, dtype=torch.bool).tril()[None] & real[:, None, :]  # (g, Lc, Lc)
                mask = torch.cat((seen[:, None, :].expand(-1, Lc, -1), own), dim=2)[:, None]  # (g, 1, Lc, Pk + Lc)
                calls.append(
                    (mask.to(device), real.flatten().nonzero().squeeze(1).to(device), len(bucket), Lc, Pk + Lc)
                )
                covered.append(q[real])
                qi.append(q.flatten())
                ki.append(torch.cat((prompt, q), dim=1).flatten())
            pos = torch.cat(covered)  # (T,): the row position of each call's real queries, in call order
            order = None if torch.equal(pos, torch.arange(self.length)) else torch.argsort(pos).to(device)
            gather = (torch.cat(qi).to(device), [len(x) for x in qi], torch.cat(ki).to(device), [len(x) for x in ki])
            self._built[key] = (calls, order), gather
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


def _pieces(segments: list[Segment]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int]]]:
    """The sdpa backend's pieces of a row: one-sequence ones (start, length), each a prompt or a segment with at most
    one completion with tokens (then one causal sequence), and prefixed ones (prompt start, prompt length, start,
    length), each a completion of a segment with several, which attends to its prompt and causally to itself."""
    causal, prefixed = [], []
    for s in segments:
        comps = [(c, n) for c, n in s.completions if n > 0]
        causal.append((s.start, s.end - s.start if len(comps) <= 1 else s.prompt))
        if len(comps) > 1:
            prefixed += [(s.start, s.prompt, c, n) for c, n in comps]
    return causal, prefixed


def _fits(bucket: list[tuple[int, int, int, int]], x: tuple[int, int, int, int]) -> bool:
    """Whether prefixed piece ``x`` joins ``bucket`` (longest first): the padded query x key area stays within
    ``LENGTH_SLACK`` squared of the real one (a one-sequence bucket's bound)."""
    members = [*bucket, x]
    Lc, Pk = bucket[0][3], max(p for _, p, _, _ in members)
    return len(members) * Lc * (Pk + Lc) <= LENGTH_SLACK**2 * sum(n * (p + n) for _, p, _, n in members)


def _buckets(pieces: list, fits: Any) -> list[list]:
    """The pieces longest first (their last field), greedily in buckets: one joins the last bucket while ``fits``."""
    out: list[list] = []
    for x in sorted(pieces, key=lambda x: -x[-1]):
        if out and fits(out[-1], x):
            out[-1].append(x)
        else:
            out.append([x])
    return out


def _slots(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences in a row, right-padded to the longest: (n, L) row positions (a pad slot repeats the sequence's
    last token) and (n, L) bool, True on the real slots."""
    slot = torch.arange(int(lengths.max()))[None]
    return starts[:, None] + torch.minimum(slot, lengths[:, None] - 1), slot < lengths[:, None]


_FLEX: dict = {}


def _flex_attention() -> Any:
    """``flex_attention``, compiled once on CUDA (eager elsewhere: CPU tests run its forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "cuda" not in _FLEX:
        _FLEX["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["cuda"]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Attention of one packed row: q (1, H, T, D), k / v (1, K, T, D) -> (1, H, T, D) (see the module docstring).

    The sdpa backend takes every call's queries out of q, and its keys out of k and v, with one gather each
    (``sdpa_gather``), split into the calls' pieces: backward is then one concatenation and one scatter per tensor
    and layer, not a full-size zero-filled gradient per piece (a slice's or an index_select's backward) summed."""
    gqa = q.shape[1] != k.shape[1]
    if layout.backend == "flex":
        if q.device.type == "cuda":
            return _flex_attention()(q, k, v, block_mask=layout.block_mask(q.device), enable_gqa=gqa)
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=layout.block_mask(q.device), enable_gqa=gqa)
    calls, order = layout.sdpa_calls(q.device)
    qi, q_sizes, ki, k_sizes = layout.sdpa_gather(q.device)
    qs = q.squeeze(0).index_select(1, qi).split(q_sizes, dim=1)  # pieces (H, n * Lq, D)
    ks, vs = (t.squeeze(0).index_select(1, ki).split(k_sizes, dim=1) for t in (k, v))  # pieces (K, n * Lk, D)
    parts = []
    for (mask, unpad, n, Lq, Lk), qp, kp, vp in zip(calls, qs, ks, vs):
        qp = qp.unflatten(1, (n, Lq)).transpose(0, 1)  # (n, H, Lq, D)
        kp, vp = (t.unflatten(1, (n, Lk)).transpose(0, 1) for t in (kp, vp))  # (n, K, Lk, D)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        parts.append(out.transpose(0, 1).flatten(1, 2).index_select(1, unpad))  # (H, real queries, D)
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
