"""Group-relative advantages for GRPO, from the rewards of the G completions of each prompt.

Shapes: P prompts, G completions per prompt (one group each). ``rewards`` is (P, G) float with
NaN where a completion could not be scored.

For completion i of a group with scored rewards r_1..r_n (n <= G, unscored ones excluded):

    baseline  "mean" (GRPO):       b_i = mean_j r_j
              "rloo" (RLOO):       b_i = (sum_j r_j - r_i) / (n - 1)     leave-one-out
    scale     "group" (GRPO):      A_i = (r_i - b_i) / (std_group + eps)
              "batch" (TRL "batch"): A_i = (r_i - b_i) / (std_batch + eps)
              "none" (Dr. GRPO):   A_i =  r_i - b_i

``std_group`` is the unbiased (Bessel, ``torch.std``) std of the group's scored rewards, as in
TRL and verl; ``std_batch`` the unbiased std of all scored rewards of the call (under data
parallelism pass the gathered rewards, or each rank scales by its own share). The group std
enters once per group, so with ``scale="group"`` RLOO's n/(n-1) factor is not undone.

Decisions (each documented where a peer differs):

- Unscored completions (NaN) get advantage 0 and ``valid = False`` (the caller drops them from
  the loss mask) and are excluded from their group's baseline and std.
- A zero-variance group (all scored rewards equal, including a group with one scored
  completion) carries no signal: its advantages are exactly 0 (not (r - mean) / eps, which
  amplifies rounding), it is counted in ``num_zero_variance_groups`` and, with
  ``filter_zero_variance``, its completions are marked invalid (DAPO dynamic sampling keeps only
  groups with signal; here the batch keeps its shape and the loss mask drops them).
- ``mask_truncated`` (DAPO overlong filtering): truncated completions (finish reason
  ``length``) get no gradient. Their reward still enters the group statistics: it was measured.
- Soft overlong punishment (DAPO eq. 13), added to the reward before everything else, with
  L_max = ``max_tokens`` and L_cache = ``overlong_buffer``:
      R_len(y) = 0                               if |y| <= L_max - L_cache
                 (L_max - L_cache - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 -1                              if |y| > L_max
  scaled by ``overlong_penalty`` (verl's ``penalty_factor``).

References: Shao et al. 2024 (DeepSeekMath, GRPO); Ahmadian et al. 2024 (RLOO, "Back to
Basics"); Liu et al. 2025 (Dr. GRPO, "Understanding R1-Zero-Like Training"); Yu et al. 2025
(DAPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from align.options import flag

SCALES = ("group", "batch", "none")
BASELINES = ("mean", "rloo")


@dataclass
class AdvantageConfig:
    scale: str = flag("group", "'group' (GRPO) | 'batch' | 'none' (Dr. GRPO)")
    baseline: str = flag("mean", "'mean' (GRPO) | 'rloo' (leave-one-out)")
    eps: float = flag(1e-6, "added to the std (verl: 1e-6, TRL: 1e-4)")
    filter_zero_variance: bool = flag(False, "mark completions of zero-variance groups invalid")
    mask_truncated: bool = flag(False, "DAPO overlong filtering: truncated completions get no gradient")
    overlong_buffer: int = flag(0, "DAPO L_cache in tokens; 0 = no soft overlong penalty")
    overlong_penalty: float = flag(1.0, "scale of the soft overlong penalty (reward units)")

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"AdvantageConfig.scale={self.scale!r} is unknown; valid: {', '.join(SCALES)}")
        if self.baseline not in BASELINES:
            raise ValueError(f"AdvantageConfig.baseline={self.baseline!r} is unknown; valid: {', '.join(BASELINES)}")
        if not self.eps >= 0:
            raise ValueError(f"AdvantageConfig.eps={self.eps!r} must be >= 0")
        if self.overlong_buffer < 0:
            raise ValueError(f"AdvantageConfig.overlong_buffer={self.overlong_buffer!r} must be >= 0 (0 disables it)")
        if not self.overlong_penalty >= 0:
            raise ValueError(f"AdvantageConfig.overlong_penalty={self.overlong_penalty!r} must be >= 0")


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (eq. 13), in [-factor, 0], same shape as ``lengths``."""
    if buffer <= 0 or buffer > max_tokens:
        raise ValueError(f"overlong buffer={buffer} must be in [1, max_tokens={max_tokens}]")
    expected = max_tokens - buffer
    return ((expected - lengths.double()) / buffer).clamp(-1.0, 0.0) * factor


def compute_advantages(
    rewards: Tensor,
    cfg: AdvantageConfig,
    *,
    lengths: Tensor | None = None,
    truncated: Tensor | None = None,
    max_tokens: int | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Advantages (P, G), valid (P, G) bool (False = no gradient) and stats (floats).

    ``rewards`` (P, G) float, NaN = unscored. ``lengths`` (P, G) completion lengths in tokens
    (needed when ``cfg.overlong_buffer > 0``, with ``max_tokens``). ``truncated`` (P, G) bool,
    True where the finish reason is ``length`` (needed when ``cfg.mask_truncated``). Invalid
    completions have advantage 0. Computed in float64, returned in the dtype of ``rewards``.
    """
    if rewards.dim() != 2 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a (P, G) float tensor, got shape {tuple(rewards.shape)} {rewards.dtype}")
    if torch.isinf(rewards).any():
        raise ValueError("rewards contain +-inf; use NaN for completions that could not be scored")
    for name, t in (("lengths", lengths), ("truncated", truncated)):
        if t is not None and t.shape != rewards.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != rewards shape {tuple(rewards.shape)}")
    if truncated is not None and truncated.dtype != torch.bool:
        raise ValueError(f"truncated must be a bool tensor, got {truncated.dtype}")
    if cfg.mask_truncated and truncated is None:
        raise ValueError("AdvantageConfig.mask_truncated=True needs truncated= (finish_reason == 'length')")

    r = rewards.double()  # (P, G)
    scored = ~torch.isnan(r)  # (P, G)
    stats: dict[str, float] = {}
    if cfg.overlong_buffer > 0:
        if lengths is None or max_tokens is None:
            raise ValueError("AdvantageConfig.overlong_buffer > 0 needs lengths= and max_tokens=")
        pen = overlong_penalty(lengths, max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)  # (P, G)
        r = r + pen
        stats["overlong_penalty_mean"] = _mean(pen[scored])

    n = scored.sum(1)  # (P,)
    r0 = torch.where(scored, r, 0.0)  # (P, G) unscored -> 0 so sums skip them
    total = r0.sum(1)  # (P,)
    mean = total / n.clamp(min=1)  # (P,)
    if cfg.baseline == "mean":
        base = mean[:, None]  # (P, 1)
    else:
        base = (total[:, None] - r0) / (n - 1).clamp(min=1)[:, None]  # (P, G)
    adv = r0 - base  # (P, G)

    if cfg.scale == "group":
        var = ((r0 - mean[:, None]) ** 2 * scored).sum(1) / (n - 1).clamp(min=1)  # (P,)
        adv = adv / (var.sqrt()[:, None] + cfg.eps)
    elif cfg.scale == "batch":
        flat = r[scored]
        std = flat.std() if flat.numel() > 1 else flat.new_zeros(())
        adv = adv / (std + cfg.eps)

    hi = torch.where(scored, r, -torch.inf).amax(1)  # (P,)
    lo = torch.where(scored, r, torch.inf).amin(1)  # (P,)
    zero_var = (n >= 1) & (hi == lo)  # (P,)
    valid = scored & ~zero_var[:, None] if cfg.filter_zero_variance else scored.clone()
    if cfg.mask_truncated:
        valid &= ~truncated
    adv = torch.where(scored & ~zero_var[:, None] & valid, adv, 0.0)

    stats.update(
        num_groups=float(r.shape[0]),
        num_completions=float(r.numel()),
        num_unscored=float((~scored).sum()),
        num_empty_groups=float((n == 0).sum()),
        num_zero_variance_groups=float(zero_var.sum()),
        num_valid=float(valid.sum()),
        reward_mean=_mean(r[scored]),
        reward_std=_std(r[scored]),
        adv_mean=_mean(adv[valid]),
        adv_std=_std(adv[valid]),
        adv_abs_max=float(adv.abs().max()) if adv.numel() else 0.0,
    )
    if truncated is not None:
        stats["num_truncated"] = float(truncated.sum())
    return adv.to(rewards.dtype), valid, stats


def _mean(x: Tensor) -> float:
    return float(x.mean()) if x.numel() else 0.0


def _std(x: Tensor) -> float:
    return float(x.std(unbiased=False)) if x.numel() else 0.0


def add_teacher_signal(
    adv: Tensor, mask: Tensor, student_logprobs: Tensor, teacher_logprobs: Tensor, coef: float
) -> tuple[Tensor, dict[str, float]]:
    """On-policy distillation: per-token advantages (N, L) = ``adv`` (N,) + ``coef`` * -(log pi_student(y_t) -
    log pi_teacher(y_t)) on the masked tokens (0 elsewhere), and the signal's statistics over those tokens.

    The signal is the negated single-sample estimate of the per-token reverse KL(student || teacher) on the
    student's own samples (Agarwal et al. 2024, GKD with lambda = 1; Thinking Machines 2025, "On-policy
    distillation"). ``student_logprobs`` are the sampler's (mu, the distribution the tokens were drawn from),
    treated as constants: the signal is a fixed reward per token for the whole batch, like the reward advantage,
    and reaches the weights only through the policy loss's ratio (and rho correction). ``mask`` (N, L) bool;
    all inputs (N, L) except ``adv``."""
    s, t = student_logprobs.detach().float(), teacher_logprobs.detach().float()
    rkl = torch.where(mask, s - t, 0.0)  # (N, L)
    out = torch.where(mask, adv.float()[:, None] - coef * rkl, 0.0)  # (N, L)
    n = int(mask.sum())
    stats = {
        "distill/reverse_kl_mean": float(rkl.sum()) / n if n else 0.0,
        "distill/teacher_logprob_mean": float(torch.where(mask, t, 0.0).sum()) / n if n else 0.0,
        "distill/student_logprob_mean": float(torch.where(mask, s, 0.0).sum()) / n if n else 0.0,
    }
    return out, stats
