"""The loss/backward part of a GRPO step: batch tensors on the device, fused token logprobs, micro-batches,
several updates per batch. ``align.train`` calls ``Learner.update(batch)`` (``align.run.parts``) once per step.

Key decisions
- No (N, V) logits: the model returns its final hidden states and ``align.kernels.linear_token_logprobs`` fuses the
  lm_head (a tied embedding is the same weight) with the log-softmax, LINEAR_ROWS tokens at a time. Under
  ``bf16-mixed`` the head runs in bf16 like the rest of the forward; the logprobs and the loss are float32.
- Micro-batches never change the result: every micro-batch's loss is divided by the normalisers of its whole
  (mini-)batch (``align.grpo.normalisers``). ``--micro-batch-tokens T`` sorts the rows by length (longest first)
  and packs at most T tokens per micro-batch counting padding (rows x its longest row); ``--micro-batch-size``
  takes consecutive rows. Each micro-batch is cut to its longest row; rows with no token to learn from are skipped.
- ``--pack-sequences`` (the default): each micro-batch is one packed row instead (``align.packing``): a group's
  prompt once, its completions after it, no padding; the logprobs come back in the padded (rows, L) layout, so the
  loss, the normalisers and the old / reference logprobs are the padded path's, and so are the gradients (up to
  float summation order: tests/test_packing.py). ``--no-pack-sequences`` runs the padded rows above.
- ``--updates-per-batch K`` x ``--mini-batches M`` optimizer steps per batch (PPO epochs, TRL ``num_iterations``):
  the M mini-batches are consecutive slices of the rows (ordered by prompt: whole groups when M divides the
  prompts), visited in order K times; each optimizer step is normalised by its own mini-batch's counts. With
  K * M > 1 the old logprobs are computed once, before the first update, so the ratio and the clipping act from
  the second update on; with K = M = 1 the old logprobs are the current ones, detached (no extra forward pass;
  the ratio is 1 and rho = pi_old / mu measures exactly the sampler-trainer mismatch). Reference logprobs (KL)
  are computed once per batch, before any update. A LoRA reference model (in LoRA runs: the policy itself) runs
  with its adapters off (``align.lora.adapters_disabled``): the frozen base, held once.
- On-policy distillation (``teacher``): the teacher's logprobs of the batch are computed once per batch, next to the
  reference ones, and ``align.advantages.add_teacher_signal`` turns the advantages into per-token ones (N, L) with
  the sampler's logprobs as the student's; every update of the batch then sees the same signal.

Shapes: N completions of the step, L padded row length (prompt + completion - 1), E hidden size, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from align import dist, heartbeat, moe, packing
from align.advantages import add_teacher_signal
from align.device import PRECISIONS, Placement, precision_from_legacy
from align.errors import InputError
from align.grpo import SUM_STATS, merge_stats, normalisers, policy_loss
from align.kernels import linear_token_logprobs
from align.lora import adapters_disabled

LOSS_SUMS = SUM_STATS - {"num_tokens", "num_seqs"}


class Batch(NamedTuple):
    """One step's teacher-forcing tensors, on the training device."""

    inputs: Tensor  # (N, L) int64
    targets: Tensor  # (N, L) int64
    mask: Tensor  # (N, L) bool, True = a completion token that counts
    advantages: Tensor  # (N,) float32
    behav: Tensor  # (N, L) float32, the sampler's logprobs (mu)
    routes: Tensor | None = None  # (N, L, Lm, k) int16: the experts the sampler used (MoE; align.moe.batch_routes)


class Update(NamedTuple):
    stats: dict[str, float]  # merged over micro-batches and optimizer steps (loss: mean per optimizer step)
    grad_norm: float  # mean over optimizer steps (0 when --grad-clip 0)
    per_update: list[dict[str, float]]  # the merged stats of each optimizer step, in order
    nonfinite: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm (no weight changed)


class NonFiniteError(RuntimeError):
    """The run skipped ``--max-nonfinite-steps`` optimizer steps for a non-finite loss or gradient norm."""


def sequence_batch(prompt_ids: list[list[int]], completions: list, G: int, device: torch.device | str) -> tuple:
    """Right-padded teacher-forcing tensors for the P*G completions, made on ``device``:
    inputs (N, L), targets (N, L), mask (N, L) over completion tokens, behaviour logprobs (N, L) x2 (full, sampled).

    An episode (``align.rollout.groups.Episode``) brings its own first prompt and a per-token ``mask``: its
    environment tokens are context (mask False, logprob 0) like the prompt."""
    firsts = [getattr(c, "prompt_ids", None) or prompt_ids[c.prompt_index] for c in completions]
    seqs = [p + c.token_ids for p, c in zip(firsts, completions)]
    L = max(len(s) for s in seqs) - 1
    inputs, targets, mask, full_lp, sampled_lp = [], [], [], [], []
    for s, first, c in zip(seqs, firsts, completions):
        p, k, pad = len(first), len(c.token_ids), L - len(s) + 1
        inputs.append(s[:-1] + [0] * pad)
        targets.append(s[1:] + [0] * pad)
        own = getattr(c, "mask", None)
        mask.append([False] * (p - 1) + (list(own) if own is not None else [True] * k) + [False] * pad)
        sampled = c.sampled_logprobs if c.sampled_logprobs is not None else c.logprobs
        full_lp.append([0.0] * (p - 1) + list(c.logprobs) + [0.0] * pad)
        sampled_lp.append([0.0] * (p - 1) + list(sampled) + [0.0] * pad)
    as_long = {"dtype": torch.long, "device": device}
    return (
        torch.tensor(inputs, **as_long),  # (N, L)
        torch.tensor(targets, **as_long),  # (N, L)
        torch.tensor(mask, dtype=torch.bool, device=device),  # (N, L)
        torch.tensor(full_lp, dtype=torch.float32, device=device),  # (N, L)
        torch.tensor(sampled_lp, dtype=torch.float32, device=device),  # (N, L)
    )


class StepBatch(NamedTuple):
    """One step's groups as the learner takes them: each group's prompt ids (``[]`` for an episode, which carries its
    own), the completions, and the (P, G) advantages and validity."""

    prompt_ids: list[list[int]]
    completions: list
    adv: Tensor
    valid: Tensor


def make_batch(step: StepBatch, cfg: Any, device: torch.device) -> Batch:
    """The step's ``Batch``: invalid completions (``valid`` False, (P, G)) are masked out; ``adv`` is (P, G)."""
    completions, adv, valid = step.completions, step.adv, step.valid
    inputs, targets, mask, full_lp, sampled_lp = sequence_batch(step.prompt_ids, completions, cfg.group_size, device)
    pi = torch.tensor([c.prompt_index for c in completions])
    si = torch.tensor([c.sample_index for c in completions])
    flat_valid = valid[pi, si].to(device)  # (N,)
    flat_adv = adv[pi, si].float().to(device)  # (N,)
    behav = sampled_lp if cfg.behaviour_logprobs == "sampled" else full_lp
    routes = moe.batch_routes(step.prompt_ids, completions, inputs.shape[1], device)
    return Batch(inputs, targets, mask & flat_valid[:, None], flat_adv, behav, routes)


def check_config(cfg: Any) -> None:
    """``TrainConfig.__post_init__``'s checks of the fields this module and ``align.device`` read (no device probe:
    ``align.device.resolve`` checks availability when the run starts). Folds the deprecated ``dtype`` into
    ``precision``."""
    cfg.precision = precision_from_legacy(cfg.precision, cfg.dtype)
    cfg.dtype = None
    if cfg.precision not in ("auto", *PRECISIONS):
        raise ValueError(f"--precision must be one of {('auto', *PRECISIONS)}, got {cfg.precision!r}")
    d = cfg.device
    if d not in ("auto", "cpu", "cuda") and not (d.startswith("cuda:") and d[5:].isdigit()):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {d!r}")
    if cfg.micro_batch_tokens < 0:
        raise ValueError(
            f"--micro-batch-tokens must be >= 0 (0 = use --micro-batch-size), got {cfg.micro_batch_tokens}"
        )
    if 0 < cfg.micro_batch_tokens < cfg.max_tokens:
        raise ValueError(
            f"--micro-batch-tokens {cfg.micro_batch_tokens} is smaller than --max-tokens {cfg.max_tokens}: "
            "a full-length completion could not fit; raise it to at least the longest prompt + --max-tokens"
        )
    n = cfg.prompts_per_step * cfg.group_size
    if cfg.mini_batches > n:
        raise ValueError(
            f"--mini-batches {cfg.mini_batches} exceeds the {n} completions of a step "
            "(--prompts-per-step x --group-size); lower it"
        )


# ------------------------------------------------------------------------------------------------ logprobs


def token_logprobs(
    model: torch.nn.Module,
    inputs: Tensor,
    targets: Tensor,
    temperature: float,
    *,
    place: Placement | None = None,
    backend: str = "auto",
    with_entropy: bool = True,
    mask: Tensor | None = None,
    routing: moe.Routing | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token logprobs (and entropy) of ``targets`` under ``softmax(logits / T)``, float32 (B, L), with the lm_head
    fused into the log-softmax: the (B, L, V) logits never exist. Differentiable w.r.t. every parameter, the
    (tied or not) lm_head included. Use under ``torch.no_grad()`` for old / reference logprobs.

    ``mask`` (B, L) bool: the positions that are scored (completion tokens); the head and the log-softmax run on
    those rows only (prompt and padding positions cost the decoder, not the (V, E) head) and the others are 0."""
    place = place or placement_of(model)
    with place.autocast():
        hidden = model(inputs, return_hidden=True, routing=routing)  # (B, L, E)
    if mask is None:
        return fused_head(model, hidden, targets, temperature, place, backend, with_entropy)
    idx = mask.reshape(-1).nonzero().squeeze(-1)  # (M,) the scored positions of the flattened (B * L)
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx), targets.reshape(-1)[idx]
    lp, ent = fused_head(model, hidden, targets, temperature, place, backend, with_entropy)
    return spread(lp, idx, mask.shape), spread(ent, idx, mask.shape) if ent is not None else None


def packed_token_logprobs(
    model: torch.nn.Module,
    inputs: Tensor,
    targets: Tensor,
    mask: Tensor,
    row: packing.PackedRow,
    temperature: float,
    *,
    place: Placement | None = None,
    backend: str = "auto",
    with_entropy: bool = True,
    pad_to: int = 0,
    routing: moe.Routing | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs(mask=mask)`` of the batch rows ``row.rows`` ((rows, L), L their longest), computed on one
    packed row (``align.packing``): each prompt once, its completions after it. The same values and gradients as
    the padded call, up to float summation order. ``pad_to``: ``packing.build``'s (CUDA rows: the token budget)."""
    place = place or placement_of(model)
    pk = packing.build(inputs, targets, mask, row, pad_to=pad_to, routes=routing.routes if routing else None)
    if routing is not None:
        routing.routes = pk.routes
    with place.autocast():
        hidden = model(pk.ids, positions=pk.positions, layout=pk.layout, return_hidden=True, routing=routing)
    hidden = hidden[0].index_select(0, pk.source)  # (M, E): a prompt's last state once for each of its completions
    lp, ent = fused_head(model, hidden, pk.targets, temperature, place, backend, with_entropy)
    return spread(lp, pk.dest, pk.shape), spread(ent, pk.dest, pk.shape) if ent is not None else None


def fused_head(
    model: torch.nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    place: Placement,
    backend: str,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """``linear_token_logprobs`` of final hidden states (..., E) through the model's (tied or not) lm_head; in
    bf16 under ``bf16-mixed``, like every other matmul of the forward."""
    weight = model.lm_head.weight  # (V, E); the embedding itself when tied
    if place.precision == "bf16-mixed":
        hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    return linear_token_logprobs(hidden, weight, targets, temperature, with_entropy=with_entropy, backend=backend)


def spread(x: Tensor, idx: Tensor, shape: tuple[int, ...] | torch.Size) -> Tensor:
    """(M,) values at the flat positions ``idx`` of a zero tensor of ``shape``."""
    n = math.prod(shape)
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_copy(0, idx, x).view(*shape)


def placement_of(model: torch.nn.Module) -> Placement:
    """The placement a model's weights imply (no autocast): for callers that pass none."""
    w = model.lm_head.weight
    return Placement(w.device, "bf16" if w.dtype == torch.bfloat16 else "fp32")


# ------------------------------------------------------------------------------------------------ micro-batches


def row_lengths(mask: Tensor) -> list[int]:
    """Tokens each row needs: up to its last masked position (0 for a row with nothing to learn from)."""
    L = mask.shape[1]
    last = torch.where(mask.any(1), L - mask.flip(1).int().argmax(1), 0)  # (N,)
    return last.tolist()


def micro_batches(lengths: Sequence[int], cfg: Any) -> list[list[int]]:
    """Row indices of each micro-batch (rows of length 0 are left out).

    ``cfg.micro_batch_tokens`` set: rows sorted longest first, packed while rows x longest row <= the budget.
    Otherwise ``cfg.micro_batch_size`` consecutive rows."""
    rows = [i for i, n in enumerate(lengths) if n > 0]
    budget = getattr(cfg, "micro_batch_tokens", None)
    if not budget:
        size = cfg.micro_batch_size
        return [rows[s : s + size] for s in range(0, len(rows), size)]
    rows.sort(key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    if rows and lengths[rows[0]] > budget:
        raise ValueError(
            f"--micro-batch-tokens {budget} is smaller than the longest sequence of this step "
            f"({lengths[rows[0]]} tokens); raise it to at least the longest prompt + --max-tokens"
        )
    out: list[list[int]] = []
    for i in rows:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def check_token_budget(cfg: Any, prompt_lengths: Sequence[int]) -> None:
    """Refuse, before the model loads, a ``--micro-batch-tokens`` budget smaller than the longest row a step can
    hold: a prompt plus a full-length completion (padded or packed, the same size: a packed segment of one
    completion is its padded row)."""
    budget = getattr(cfg, "micro_batch_tokens", None)
    if budget and prompt_lengths and max(prompt_lengths) + cfg.max_tokens - 1 > budget:
        longest = max(prompt_lengths) + cfg.max_tokens - 1
        raise InputError(
            f"--micro-batch-tokens {budget} is smaller than the longest sequence a step can hold "
            f"(longest prompt {max(prompt_lengths)} + --max-tokens {cfg.max_tokens} - 1 = {longest}); "
            f"raise it to >= {longest}"
        )


def _rows(t: Tensor, idx: list[int], L: int) -> Tensor:
    return t[torch.tensor(idx, device=t.device), :L] if t.dim() >= 2 else t[torch.tensor(idx, device=t.device)]


MicroBatch = list[int] | packing.PackedRow  # padded: batch rows; packed: one packed row (--pack-sequences)


def plan_micro_batches(inputs: Tensor, mask: Tensor, cfg: Any) -> list[MicroBatch]:
    """The micro-batches of the rows with something to learn from: packed rows (``align.packing.plan``) under
    ``cfg.pack_sequences``, else padded row lists (``micro_batches``)."""
    lengths = row_lengths(mask)
    if getattr(cfg, "pack_sequences", False):
        return packing.plan(inputs, mask, lengths, getattr(cfg, "micro_batch_tokens", 0), cfg.micro_batch_size)
    return micro_batches(lengths, cfg)


def micro_batch_logprobs(
    model: torch.nn.Module,
    inputs: Tensor,
    targets: Tensor,
    mask: Tensor,
    mb: MicroBatch,
    cfg: Any,
    place: Placement | None,
    with_entropy: bool = True,
    temperature: float | None = None,
    routing: moe.Routing | None = None,
) -> tuple:
    """(rows, L, logprobs (rows, L), entropy or None) of one micro-batch of the (N, L) batch tensors, L its
    longest row: by a packed row or by the padded rows, the same values either way. ``temperature``: None =
    ``cfg.temperature`` (the sampler's); ``nll_backward`` passes 1 (its ``cfg.temperature`` is the eval's)."""
    t = cfg.temperature if temperature is None else temperature
    kw = {"place": place, "backend": cfg.logprob_backend, "with_entropy": with_entropy, "routing": routing}
    if isinstance(mb, packing.PackedRow):
        budget = getattr(cfg, "micro_batch_tokens", 0)
        lp, ent = packed_token_logprobs(model, inputs, targets, mask, mb, t, pad_to=budget, **kw)
        return mb.rows, lp.shape[1], lp, ent
    L = max(row_lengths(_rows(mask, mb, mask.shape[1])))
    x, y, m = _rows(inputs, mb, L), _rows(targets, mb, L), _rows(mask, mb, L)  # (mb, L)
    if routing is not None:  # MoE: the batch's recorded experts (N, L, Lm, k) -> this micro-batch's
        routing.cut(lambda r: _rows(r, mb, L))
    return (mb, L, *token_logprobs(model, x, y, t, mask=m, **kw))


@torch.no_grad()
def batch_logprobs(
    model: torch.nn.Module, batch: Batch, cfg: Any, place: Placement | None = None, rows: Tensor | None = None
) -> Tensor:
    """Logprobs (N, L) of the batch's targets under ``model``, no graph, by the step's micro-batches (0 elsewhere).
    ``rows``: only these rows (torchrun: this rank's; every rank runs as many forwards as the busiest)."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)  # (N, L)
    sel = list(range(batch.mask.shape[0])) if rows is None else rows.tolist()
    sub = batch if rows is None else Batch(*(t if t is None else t[rows] for t in batch))
    mbs = plan_micro_batches(sub.inputs, sub.mask, cfg)
    mbs += [[]] * (dist.max_int(len(mbs)) - len(mbs))
    for mb in mbs:
        if not mb:  # padding forward (torchrun): FSDP's all-gathers need every rank
            _padding_forward(model, batch.inputs, cfg, place)
            continue
        kw = {"routing": moe.routing_for(model, cfg, sub.routes)}
        idx, L, lp, _ = micro_batch_logprobs(model, sub.inputs, sub.targets, sub.mask, mb, cfg, place, False, **kw)
        out[torch.tensor([sel[i] for i in idx], device=out.device), :L] = lp
    return out


def reference_logprobs(
    ref_model: torch.nn.Module, batch: Batch, cfg: Any, place: Placement | None = None, rows: Tensor | None = None
) -> Tensor:
    """``batch_logprobs`` of the KL reference: a LoRA model (the policy of a LoRA run) with its adapters off."""
    with adapters_disabled(ref_model):
        return batch_logprobs(ref_model, batch, cfg, place, rows)


def backward_batch(
    policy: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    cfg: Any,
    inputs: Tensor,
    targets: Tensor,
    mask: Tensor,
    advantages: Tensor,
    behav: Tensor,
    routes: Tensor | None = None,
    *,
    place: Placement | None = None,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> list[dict]:
    """Loss and backward over micro-batches, accumulating into ``.grad``; returns the per-micro-batch stats.

    The normalisers (token and sequence counts) are those of all the rows given, so the accumulated gradient is
    the whole-batch gradient whatever the micro-batching. ``old_logprobs`` (N, L): the policy's logprobs before
    the first update of this batch; None = the current ones, detached (one update per batch: ratio 1).
    ``ref_logprobs`` (N, L), else computed per micro-batch from ``ref_model`` when given. ``routes``: ``Batch.routes``.

    Under torchrun (``align.dist``) the rows are this rank's share: the normalisers are summed over ranks, every
    rank runs as many micro-batches as the busiest one (empty ones: a zero loss on one token, for FSDP's
    collectives) and the returned stats are the merged record of all ranks."""
    total_tokens, total_seqs = dist.reduce_counts(normalisers(mask, cfg.loss))
    stats: list[dict] = []
    if total_tokens == 0:
        return stats
    mbs = plan_micro_batches(inputs, mask, cfg)
    mbs += [[]] * (dist.max_int(len(mbs)) - len(mbs))
    for mb in mbs:
        if not mb:  # padding micro-batch (torchrun): same forward/backward collectives, no gradient
            (_padding_forward(policy, inputs, cfg, place).sum() * 0.0).backward()
            continue
        routing = moe.routing_for(policy, cfg, routes)
        idx, L, lp, ent = micro_batch_logprobs(policy, inputs, targets, mask, mb, cfg, place, routing=routing)
        m = _rows(mask, idx, L)  # (mb, L)
        ref = None
        if ref_logprobs is not None:
            ref = _rows(ref_logprobs, idx, L)
        elif ref_model is not None:
            with torch.no_grad(), adapters_disabled(ref_model):
                ref = micro_batch_logprobs(ref_model, inputs, targets, mask, mb, cfg, place, False)[2]
        old = lp.detach() if old_logprobs is None else _rows(old_logprobs, idx, L)
        loss, st = policy_loss(
            cfg.loss,
            lp,
            old,
            _rows(advantages, idx, L),
            m,
            behav_logprobs=_rows(behav, idx, L),
            ref_logprobs=ref,
            entropy=ent,
            total_tokens=total_tokens,
            total_seqs=total_seqs,
        )
        loss, st = moe.add_router_terms(loss, st, routing, cfg, float(m.sum()) / total_tokens)
        loss.backward()
        heartbeat.beat("learner")  # a micro-batch: progress for the watchdog (align.run.watchdog)
        stats.append(st)
    return dist.merge_rank_stats(stats, merge_stats)


def _padding_forward(model: torch.nn.Module, inputs: Tensor, cfg: Any, place: Placement | None) -> Tensor:
    """One token's logprob (torchrun: a rank with no row left runs the same collectives as the others)."""
    x = inputs[:1, :1]
    return token_logprobs(model, x, x, cfg.temperature, place=place, backend=cfg.logprob_backend, with_entropy=False)[0]


# ------------------------------------------------------------------------------------------------ the update


Teacher = Callable[[Batch, Any, Placement, Tensor | None], Tensor]
"""(batch, cfg, place, rows) -> the teacher's logprobs (N, L) of the batch's targets (``rows``: at least those)."""


def optimize(
    policy: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    opt: torch.optim.Optimizer,
    cfg: Any,
    place: Placement,
    batch: Batch,
    teacher: Teacher | None = None,
) -> Update:
    """``cfg.updates_per_batch`` x ``cfg.mini_batches`` optimizer steps on one batch (see the module docstring)."""
    K, M = getattr(cfg, "updates_per_batch", 1), getattr(cfg, "mini_batches", 1)
    minis = torch.arange(batch.inputs.shape[0], device=batch.inputs.device).tensor_split(M)
    minis = [rows[slice(*dist.share(len(rows)))] for rows in minis]  # torchrun: this rank's share of each
    mine = torch.cat(minis) if dist.active() else None  # torchrun: ref / old logprobs of this rank's rows only
    ref = reference_logprobs(ref_model, batch, cfg, place, mine) if ref_model is not None else None
    old = batch_logprobs(policy, batch, cfg, place, mine) if K * M > 1 else None
    distill: dict[str, float] = {}
    if teacher is not None:  # on-policy distillation: the teacher's per-token signal joins the advantages
        batch, distill = teacher_signal(batch, teacher(batch, cfg, place, mine), cfg.distill.teacher_coef, mine)
    per_update, norms, skipped, skipped_norms = [], [], [], []
    for _ in range(K):
        for rows in minis:
            opt.zero_grad(set_to_none=True)
            whole = M == 1 and len(rows) == batch.inputs.shape[0]
            b = batch if whole else Batch(*(t if t is None else t[rows] for t in batch))
            o = old if old is None or whole else old[rows]
            r = ref if ref is None or whole else ref[rows]
            stats = backward_batch(policy, ref_model, cfg, *b, place=place, old_logprobs=o, ref_logprobs=r)
            if not stats:  # nothing to learn from in these rows
                continue
            merged, norm = merge_stats(stats), grad_norm(policy, cfg.grad_clip)
            if not (math.isfinite(merged["loss"]) and math.isfinite(norm)):  # every rank sees the same loss and norm
                opt.zero_grad(set_to_none=True)  # skipped: no parameter or optimizer-state change
                skipped.append(merged)
                skipped_norms.append(norm)
                continue
            norms.append(norm)  # the pre-clip norm (no clipping: the norm itself)
            opt.step()
            per_update.append(merged)
    norms = norms if per_update else skipped_norms  # every step skipped: the record shows why
    return Update(
        {**summarise(per_update or skipped, K), **distill},
        sum(norms) / len(norms) if norms else 0.0,
        per_update,
        len(skipped),
    )


def teacher_signal(batch: Batch, teacher_lp: Tensor, coef: float, rows: Tensor | None) -> tuple[Batch, dict]:
    """The batch with per-token advantages (``add_teacher_signal``, the sampler's logprobs as the student's) and the
    signal's statistics over every rank's tokens (``rows``: this rank's under torchrun; the others' stay unused)."""
    mask = batch.mask
    if rows is not None:
        mask = mask & torch.zeros_like(mask).index_fill_(0, rows, True)  # (N, L)
    adv, st = add_teacher_signal(batch.advantages, mask, batch.behav, teacher_lp, coef)  # (N, L)
    merged = dist.merge_rank_stats([{**st, "num_tokens": float(mask.sum())}], merge_stats)
    return batch._replace(advantages=adv), {k: v for k, v in merged[0].items() if k != "num_tokens"}


def grad_norm(policy: torch.nn.Module, clip: float) -> float:
    """The global gradient norm (torchrun: over every rank's shards), clipped to ``clip`` when ``clip > 0``."""
    params = [p for p in policy.parameters() if p.grad is not None]
    if clip > 0:
        return dist.scalar(torch.nn.utils.clip_grad_norm_(params, clip))
    return dist.scalar(torch.nn.utils.get_total_norm([p.grad for p in params]))


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters that hold a NaN or inf (torchrun: in this rank's shards)."""
    return [
        n
        for n, p in model.named_parameters()
        if not bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
    ]


class NonFiniteSteps:
    """The run's count of optimizer steps skipped for a non-finite loss or gradient norm (``Update.nonfinite``),
    kept in each checkpoint; ``add`` raises ``NonFiniteError`` once it reaches ``limit`` (--max-nonfinite-steps).
    A skipped step changes no weight, so the last checkpoint stays the last good one."""

    def __init__(self, limit: int, count: int = 0) -> None:
        self.limit, self.count = limit, count

    def add(self, upd: Update, step: int) -> None:
        self.count += upd.nonfinite
        if upd.nonfinite and self.count >= self.limit:
            raise NonFiniteError(
                f"step {step}: {self.count} optimizer step(s) of this run were skipped because the loss or the "
                f"gradient norm was not finite (here loss {upd.stats.get('loss')}, grad norm {upd.grad_norm}); "
                f"--max-nonfinite-steps {self.limit} reached, stopping. No weight changed on a skipped step and no "
                "checkpoint was written after it: the last one in --out's checkpoints/ is intact. Lower --lr, check "
                "the reward scale, --lora-alpha and the model's weights, or raise --max-nonfinite-steps"
            )


def summarise(per_update: list[dict[str, float]], K: int) -> dict[str, float]:
    """One record for the step: loss terms averaged over optimizer steps, token/sequence counts of the batch (the
    K passes counted once), ``*_max`` the max, other statistics token-weighted means over all updates."""
    if not per_update:
        return {"loss": 0.0}
    if len(per_update) == 1:
        return dict(per_update[0])
    out = merge_stats(per_update)
    for k in LOSS_SUMS & out.keys():
        out[k] /= len(per_update)
    for k in ("num_tokens", "num_seqs"):
        out[k] /= K
    return out


# ------------------------------------------------------------------------------------------------ supervised (align.sft)


def nll_backward(
    policy: torch.nn.Module,
    cfg: Any,
    inputs: Tensor,
    targets: Tensor,
    mask: Tensor,
    *,
    place: Placement | None = None,
    backward: bool = True,
) -> dict[str, float]:
    """Mean token negative log-likelihood of ``targets`` over ``mask`` (True = a target token; (N, L) like the
    rest), the supervised loss of ``align.sft``: the fused logprobs at T = 1 by the step's micro-batches
    (``plan_micro_batches``: packed rows under ``cfg.pack_sequences``, a row's context before its first target
    being its prompt, so rows with the same context share one copy of it; else padded rows), every micro-batch
    divided by the target count of all the rows given (torchrun: summed over ranks, with the busiest rank's
    micro-batch count), so packing, micro-batching and data parallelism give the whole-batch loss and gradient.
    ``backward``: accumulate the gradient into ``.grad``; False (under ``torch.no_grad()``) measures the loss only.
    Returns {"loss", "num_tokens"} of the whole batch, every rank's rows included."""
    total, _ = dist.reduce_counts(normalisers(mask))
    if total == 0:
        return {"loss": 0.0, "num_tokens": 0}
    mbs = plan_micro_batches(inputs, mask, cfg)
    mbs += [[]] * (dist.max_int(len(mbs)) - len(mbs))
    stats = []
    for mb in mbs:
        if not mb:  # padding micro-batch (torchrun): the same forward/backward collectives, no gradient
            pad = torch.zeros(1, 1, dtype=torch.long, device=mask.device)  # (1, 1): this rank may hold no row at all
            lp, _ = token_logprobs(policy, pad, pad, 1.0, place=place, backend=cfg.logprob_backend, with_entropy=False)
            if backward:
                (lp.sum() * 0.0).backward()
            continue
        idx, L, lp, _ = micro_batch_logprobs(policy, inputs, targets, mask, mb, cfg, place, False, temperature=1.0)
        m = _rows(mask, idx, L)  # (mb, L)
        loss = -lp[m].sum() / total  # this micro-batch's share of the whole-batch mean
        if backward:
            loss.backward()
        stats.append({"loss": float(loss.detach()), "num_tokens": int(m.sum())})
    return merge_stats(dist.merge_rank_stats(stats, merge_stats))
