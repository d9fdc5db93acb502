"""Packed rows for the learner (``--pack-sequences``): each group's prompt once, its completions after it, no padding.

The learner's batch stays the padded (N, L) one of ``align.learner.sequence_batch``; packing changes only how the
policy (or the reference) is run over it. A completion's prompt is everything before its first scored position
(``mask``): the prompt of a GRPO completion, or an episode's first prompt (its later environment tokens are
context inside the completion). Rows whose prompts are the same tokens share one copy of it: a **segment** is one
prompt followed by the own tokens of its completions (``align.attention.Segment``), and a packed row is a run of
segments.

- Positions: a prompt's tokens are 0..P-1 and every completion's continue from P, whatever its offset in the row.
- Attention (``align.attention``): the prompt causally to itself; a completion to its prompt and causally to
  itself, never to a sibling or another segment.
- Scored positions: completion j's first token is predicted by the prompt's last position, the same hidden state
  for all G completions of the segment; ``Packed.source`` gathers it once per completion, so the gradient reaching
  the prompt's activations is the sum over the G completions, exactly as when each completion had its own copy.
- Rows (``plan``): with ``--micro-batch-tokens B``, groups are split into segments of at most B tokens (a group
  whose completions do not fit beside one copy of its prompt gets one copy per segment), then packed
  first-fit-decreasing into rows of at most B tokens; without it, every ``--micro-batch-size`` consecutive rows are
  one packed row. One packed row is one forward/backward (a micro-batch); the loss of each is divided by the
  whole batch's normalisers (``align.grpo.normalisers``), so the gradient is the whole-batch gradient.

The result equals the padded path's up to float summation order: ``tests/test_packing.py`` compares the loss and
every parameter's gradient in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from align.attention import PackedLayout, Segment


@dataclass
class PackedRow:
    """The plan of one packed row: ``groups`` = (prompt length, batch rows sharing that prompt) per segment, in row
    order; ``rows`` = every batch row it scores, in that order; ``tokens`` = the row's length."""

    groups: list[tuple[int, list[int]]]
    tokens: int

    @property
    def rows(self) -> list[int]:
        return [r for _, members in self.groups for r in members]


@dataclass
class Packed:
    """One packed row's tensors: ids / positions (1, T); ``source`` (M,) the row position whose hidden state
    predicts each scored token, ``targets`` (M,) that token, ``dest`` (M,) its flat index in the (rows, L) output."""

    ids: Tensor
    positions: Tensor
    layout: PackedLayout
    source: Tensor
    targets: Tensor
    dest: Tensor
    shape: tuple[int, int]
    routes: Tensor | None = None  # (1, T, Lm, k): a MoE batch's recorded experts at the row's positions


def prompt_lengths(mask: Tensor) -> list[int]:
    """Each row's prompt length: its first scored position + 1 (0 for a row with nothing scored)."""
    first = mask.int().argmax(1) + 1  # (N,)
    return torch.where(mask.any(1), first, 0).tolist()


def plan(inputs: Tensor, mask: Tensor, lengths: Sequence[int], budget: int, size: int) -> list[PackedRow]:
    """The packed rows of the rows with ``lengths[i] > 0`` (``align.learner.row_lengths``; see the module docstring).

    ``budget`` > 0: rows of at most ``budget`` tokens, first-fit-decreasing; 0: ``size`` consecutive rows each."""
    rows = [i for i, n in enumerate(lengths) if n > 0]
    plen = prompt_lengths(mask)
    if not budget:
        return [_one_row(inputs, plen, lengths, rows[s : s + size]) for s in range(0, len(rows), size)]
    units: list[tuple[int, list[int], int]] = []  # (prompt length, rows, tokens): segments of <= budget tokens
    for p, members in _groups(inputs, plen, rows):
        own = sorted(members, key=lambda r: -(lengths[r] - p))  # stable: equal lengths keep their order
        if lengths[own[0]] > budget:  # a segment of one completion costs its padded row's length
            raise ValueError(
                f"--micro-batch-tokens {budget} is smaller than one prompt and its longest completion "
                f"({lengths[own[0]]} tokens); raise it to at least the longest prompt + --max-tokens"
            )
        segs: list[list] = []
        for r in own:
            n = lengths[r] - p
            seg = next((s for s in segs if s[2] + n <= budget), None)
            if seg is None:
                segs.append([p, [r], p + n])
            else:
                seg[1].append(r)
                seg[2] += n
        units += [tuple(s) for s in segs]
    units.sort(key=lambda u: -u[2])
    out: list[PackedRow] = []
    for p, members, n in units:
        row = next((r for r in out if r.tokens + n <= budget), None)
        if row is None:
            out.append(PackedRow([(p, members)], n))
        else:
            row.groups.append((p, members))
            row.tokens += n
    return out


def _groups(inputs: Tensor, plen: Sequence[int], rows: Sequence[int]) -> list[tuple[int, list[int]]]:
    """The rows grouped by prompt (the same length and tokens), in order of first appearance."""
    host = inputs.cpu()
    groups: dict[tuple[int, bytes], list[int]] = {}
    for r in rows:
        groups.setdefault((plen[r], host[r, : plen[r]].numpy().tobytes()), []).append(r)
    return [(p, members) for (p, _), members in groups.items()]


def _one_row(inputs: Tensor, plen: Sequence[int], lengths: Sequence[int], rows: Sequence[int]) -> PackedRow:
    groups = _groups(inputs, plen, rows)
    return PackedRow(groups, sum(p + sum(lengths[r] - p for r in members) for p, members in groups))


FLEX_BLOCK = 128  # FlexAttention's block size: the shortest flex row


def build(
    inputs: Tensor,
    targets: Tensor,
    mask: Tensor,
    row: PackedRow,
    backend: str = "auto",
    pad_to: int = 0,
    routes: Tensor | None = None,
) -> Packed:
    """The tensors of ``row`` on ``inputs``' device, from the padded (N, L) batch. The output layout (rows, L) is
    ``row.rows`` by the longest of them. ``backend``: the packed attention backend, auto = flex on CUDA, else sdpa.
    A flex row is padded (one segment of padding, attending only to itself and never scored) to ``pad_to`` tokens
    (the ``--micro-batch-tokens`` budget: every row has one shape, so the compiled kernel is built once) or, without
    a budget, to the next power of two (a handful of shapes, each compiled once), at least ``FLEX_BLOCK``; an sdpa row
    is never padded. ``routes`` (N, L, Lm, k): a MoE batch's recorded experts, laid out like the ids (-1: none)."""
    dev, host = inputs.device, mask.cpu()
    if backend == "auto":
        backend = "flex" if dev.type == "cuda" else "sdpa"
    ids, pos, segments, source, dest_rows, dest_t, rts = [], [], [], [], [], [], []
    at, L = 0, 0
    for p, members in row.groups:
        ids.append(inputs[members[0], :p])
        rts.append(None if routes is None else routes[members[0], :p])
        pos.append(torch.arange(p))
        seg = Segment(at, p)
        c = at + p
        for r in members:
            t = host[r].nonzero().squeeze(-1)  # (m,) scored positions, all >= p - 1
            n = int(t[-1]) + 1 - p  # the completion's own tokens in the row: positions p .. p + n - 1
            ids.append(inputs[r, p : p + n])
            rts.append(None if routes is None else routes[r, p : p + n])
            pos.append(torch.arange(p, p + n))
            seg.completions.append((c, n))
            source.append(torch.where(t < p, at + t, c + t - p))  # the prompt's last position for t = p - 1
            dest_rows.append(torch.full_like(t, len(dest_rows)))
            dest_t.append(t)
            c += n
            L = max(L, p + n)
        segments.append(seg)
        at = c
    if backend == "flex" and (pad := max(pad_to or 1 << (at - 1).bit_length(), FLEX_BLOCK) - at) > 0:
        ids.append(torch.zeros(pad, dtype=inputs.dtype, device=dev))
        rts.append(None if routes is None else torch.full((pad, *routes.shape[2:]), -1, dtype=routes.dtype, device=dev))
        pos.append(torch.arange(pad))
        segments.append(Segment(at, pad))
        at += pad
    layout = PackedLayout(segments, at, backend)
    t_all, r_all = torch.cat(dest_t), torch.cat(dest_rows)
    src = torch.cat(source).to(dev)
    flat = torch.tensor(row.rows)[r_all]  # batch row of each scored token
    return Packed(
        ids=torch.cat(ids)[None],  # (1, T)
        positions=torch.cat(pos).to(dev)[None],  # (1, T)
        layout=layout,
        source=src,  # (M,)
        targets=targets[flat.to(dev), t_all.to(dev)],  # (M,)
        dest=(r_all * L + t_all).to(dev),  # (M,)
        shape=(len(dest_rows), L),
        routes=None if routes is None else torch.cat(rts)[None],
    )
