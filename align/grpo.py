"""GRPO policy losses, KL estimators and off-policy (rho) correction, as small pure tensor functions.

Shapes: B sequences (completions) in this micro-batch, T completion tokens (padded). Per token,
``logprobs`` (B, T) is log pi_theta (with grad), ``old_logprobs`` log pi_old (the trainer's own
recompute before the update), ``behav_logprobs`` log mu (the sampler's), ``ref_logprobs`` log
pi_ref; ``mask`` (B, T) bool, True = the token counts. ``advantages`` is (B,), one per sequence, or (B, T), one
per token (on-policy distillation adds a per-token teacher term: ``align.advantages.add_teacher_signal``).
The ratio is r_t = pi_theta / pi_old = exp(logprobs - old_logprobs), A_i the advantage.

Surrogates (per token, a loss to minimise; ``eps_low``, ``eps_high`` asymmetric, DAPO clip-higher):

    ppo_clip  l_t = max(-r_t A, -clip(r_t, 1 - eps_low, 1 + eps_high) A)
              dual clip (Ye et al. 2020), A < 0 only:  l_t = min(l_t, -c A)   (c = dual_clip_c > 1)
    gspo      s_i = exp(mean_t (logprobs - old_logprobs))   sequence ratio (Zheng et al. 2025, GSPO)
              l_i = max(-s_i A, -clip(s_i, 1 - eps_low, 1 + eps_high) A), every token of i carries l_i
    cispo     l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log pi_theta   (MiniMax-M1, 2025)
              (sg = stop-gradient; for the paper's "no lower bound" set eps_low >= 1)
    sapo      l_t = -(4 / tau) sigmoid(tau (r_t - 1)) A,  tau = sapo_tau_pos if A > 0 else sapo_tau_neg
              (Gao et al. 2025, SAPO, arXiv 2511.20347; TRL loss_type="sapo": a soft gate instead of the hard
              clip, gradient 4 s (1 - s) r_t A, = r_t A on-policy, fading smoothly off-policy)

Normalisers. ``total_tokens`` = masked tokens and ``total_seqs`` = sequences with >= 1 masked
token, both of the WHOLE batch (all micro-batches, all ranks; see ``normalisers``). Every
micro-batch term below is a plain sum divided by those global constants, so summing
``policy_loss`` over micro-batches gives exactly the whole-batch loss and gradient:

    token_mean           (DAPO, default)  sum_{i,t} m l / total_tokens
    seq_mean_token_mean  (GRPO paper)     sum_i [sum_t m l / |o_i|] / total_seqs     |o_i| = sum_t m_{i,t}
    constant_norm        (Dr. GRPO)       sum_{i,t} m l / (total_seqs * max_len_norm)
    gspo                 seq_mean_token_mean of l_i  = sum_i l_i / total_seqs       (GSPO eq. 5)
    cispo                token_mean
    sapo                 seq_mean_token_mean (as TRL aggregates "sapo")
    bnpo                 sum_{i,t} m l / n_tok(mb) * n_seq(mb) / total_seqs  with n_tok, n_seq this call's own
                         TRL's loss_type="bnpo": each micro-batch ("local batch") a token mean, the micro-batches
                         then averaged (by their share of sequences: the plain mean for equal-size ones). The one
                         variant that depends on the micro-batch split, by TRL's definition.

``total_seqs`` counts only non-empty sequences by default (``seq_count="nonempty"``): a completion
masked out entirely (unscorable, filtered, truncated under ``mask_truncated``) changes it. The Dr.
GRPO paper (and TRL's "dr_grpo") divide by B * L with B every sequence of the batch, masked or not:
``seq_count="all"`` gives that form (``normalisers(mask, cfg)`` then counts every row); the two agree
when no completion is fully masked.

|o_i| and s_i need only the sequence's own tokens, which a micro-batch always holds whole.
The KL penalty and the entropy bonus use the variant's normaliser:
loss = pg + kl_coef * agg(kl_t) - entropy_coef * agg(entropy_t). DDP and FSDP average gradients
over ranks; multiply the loss by world_size there (or reduce by sum) to keep it exact.

KL to the reference (Schulman 2020, "Approximating KL divergence"; x = log pi_ref - log pi_theta),
estimating KL(pi_theta || pi_ref): k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x (GRPO's choice).
As a loss (tokens sampled from pi_theta, gradient through log pi_theta) they are not interchangeable:
E[grad k1] = E[grad log pi_theta] = 0, so k1 adds no KL gradient in expectation (only noise);
E[grad k2] = grad KL(pi_theta || pi_ref), the reverse KL the value estimates; E[grad k3] =
grad KL(pi_ref || pi_theta), the forward KL (unbiased value of one KL, gradient of the other).
``test_kl_estimator_expected_gradients`` checks all three by exact expectation over a vocabulary.

Off-policy correction (``use_rho_correction``). The sampler's mu is the behaviour policy; the
trainer's pi_old the proximal one (decoupled PPO, Hilton et al. 2022). Per token
rho_t = pi_old / mu = exp(old_logprobs - behav_logprobs); every per-token loss is multiplied by a
stop-gradient weight w (Yao et al. 2025 "Your efficient RL framework secretly brings you
off-policy RL training" for TIS; Liu, Li et al. 2025 "When speed kills stability" for MIS):

    token_tis    w_t = min(rho_t, rho_cap)
    seq_tis      w_i = min(prod_t rho_t, rho_cap)                       on all tokens of i
    geo_seq_tis  w_i = min(exp(mean_t log rho_t), rho_cap)              geometric mean
    token_mis    w_t = rho_t if rho_low <= rho_t <= rho_high else 0
    seq_mis      w_i = rho_i if rho_low <= rho_i <= rho_high else 0     rho_i = prod_t rho_t
    geo_seq_mis  as seq_mis with the geometric mean

Masked (w = 0) tokens stay in the normaliser: the estimator is an expectation over all samples
from mu. Pass as mu the logprob of the distribution actually sampled from (after temperature,
top-p, top-k) when the sampler reports it: under top-p the full-vocabulary logprob is not mu, and
a ratio built from it is biased (TRL issue 6789). The KL and entropy terms are not reweighted.
Mismatch statistics are reported whenever ``behav_logprobs`` is given, corrected or not.

Statistics are flat dicts of floats, mergeable over micro-batches and ranks with ``merge_stats``:
keys in ``SUM_STATS`` add up, keys ending in ``_max`` take the max, every other key is a mean over
this call's masked tokens, weighted by ``num_tokens``. Keys:

    sums         loss, pg_loss, kl_loss, entropy_loss (this call's terms), num_tokens, num_seqs
    clipping     clip_low_frac (A < 0, ratio < 1 - eps_low), clip_high_frac (A > 0, ratio > 1 + eps_high),
                 clip_dual_frac; ratio_mean, ratio_max (the ratio the variant clips: per token, or GSPO's
                 s_i on each token of i; CISPO counts its clipped weights regardless of the sign of A)
    given ref    kl (the chosen estimator, whatever kl_coef);  given entropy: entropy
    given behav  mismatch_abs_mean, mismatch_abs_max (|log pi_old - log mu|), mismatch_kl_k3
                 (k3 estimate of KL(mu || pi_old)), rho_mean, rho_max (per-token pi_old / mu)
    corrected    is_weight_mean, is_weight_max (applied w), rho_clipped_frac (*_tis) or rho_masked_frac (*_mis)

Advantage statistics (adv_mean / adv_std, num_zero_variance_groups, ...) come from
``compute_advantages`` (``align.advantages``), once per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from align.options import flag

__all__ = [
    "KL_ESTIMATORS",
    "LOSSES",
    "RHO_MODES",
    "SEQ_COUNTS",
    "LossConfig",
    "merge_stats",
    "normalisers",
    "policy_loss",
]

# ---------------------------------------------------------------------------------------------
# surrogates: (logprobs, old_logprobs, adv (B, 1), m (B, T) float, cfg) -> (loss_t (B, T), flags)
# flags: "ratio" (B, T) the ratio the variant clips; "clip_low", "clip_high", "clip_dual" (B, T) bool


def ppo_clip_surrogate(logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig):
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    return _clip_objective(ratio, adv, cfg)


def gspo_surrogate(logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig):
    n = m.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    seq_ratio = torch.exp(((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / n)  # (B, 1)
    return _clip_objective(seq_ratio.expand_as(logprobs), adv, cfg)


def cispo_surrogate(logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig):
    ratio = torch.exp(logprobs - old_logprobs).detach()  # (B, T)
    weight = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = -weight * adv * logprobs  # (B, T)
    flags = {"ratio": ratio, "clip_low": ratio < 1 - cfg.eps_low, "clip_high": ratio > 1 + cfg.eps_high}
    flags["clip_dual"] = torch.zeros_like(flags["clip_low"])
    return loss, flags


def sapo_surrogate(logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, m: Tensor, cfg: LossConfig):
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)  # (B, 1)
    loss = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv  # (B, T)
    r = ratio.detach()
    none = torch.zeros_like(r, dtype=torch.bool)  # no hard clip: nothing is cut
    return loss, {"ratio": r, "clip_low": none, "clip_high": none, "clip_dual": none}


def _clip_objective(ratio: Tensor, adv: Tensor, cfg: LossConfig):
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = torch.maximum(unclipped, clipped)
    r = ratio.detach()
    flags = {
        "ratio": r,
        "clip_low": (adv < 0) & (r < 1 - cfg.eps_low),  # gradient cut: ratio already low enough
        "clip_high": (adv > 0) & (r > 1 + cfg.eps_high),
        "clip_dual": torch.zeros_like(r, dtype=torch.bool),
    }
    if cfg.dual_clip_c is not None:
        dual = -adv * cfg.dual_clip_c  # (B, 1)
        flags["clip_dual"] = (adv < 0) & (loss > dual)
        loss = torch.where(adv < 0, torch.minimum(loss, dual), loss)
    return loss, flags


# ---------------------------------------------------------------------------------------------
# aggregators: (x (B, T), m (B, T) float, total_tokens, total_seqs, cfg) -> scalar


def token_mean_agg(x: Tensor, m: Tensor, total_tokens: float, total_seqs: float, cfg: LossConfig) -> Tensor:
    return (x * m).sum() / total_tokens


def seq_mean_token_mean_agg(x: Tensor, m: Tensor, total_tokens: float, total_seqs: float, cfg: LossConfig) -> Tensor:
    per_seq = (x * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    return per_seq.sum() / total_seqs


def constant_norm_agg(x: Tensor, m: Tensor, total_tokens: float, total_seqs: float, cfg: LossConfig) -> Tensor:
    return (x * m).sum() / (total_seqs * cfg.max_len_norm)


def local_token_mean_agg(x: Tensor, m: Tensor, total_tokens: float, total_seqs: float, cfg: LossConfig) -> Tensor:
    n_tok, n_seq = normalisers(m, cfg)  # this call's own
    return (x * m).sum() / max(n_tok, 1) * (n_seq / total_seqs)


@dataclass(frozen=True)
class LossVariant:
    surrogate: Callable
    aggregate: Callable


LOSSES: dict[str, LossVariant] = {
    "token_mean": LossVariant(ppo_clip_surrogate, token_mean_agg),
    "seq_mean_token_mean": LossVariant(ppo_clip_surrogate, seq_mean_token_mean_agg),
    "constant_norm": LossVariant(ppo_clip_surrogate, constant_norm_agg),
    "gspo": LossVariant(gspo_surrogate, seq_mean_token_mean_agg),
    "cispo": LossVariant(cispo_surrogate, token_mean_agg),
    "sapo": LossVariant(sapo_surrogate, seq_mean_token_mean_agg),
    "bnpo": LossVariant(ppo_clip_surrogate, local_token_mean_agg),
}

# ---------------------------------------------------------------------------------------------
# KL estimators of KL(pi_theta || pi_ref) per token, x = log pi_ref - log pi_theta


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (ref_logprobs - logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    x = ref_logprobs - logprobs
    return torch.exp(x) - 1 - x


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
SEQ_COUNTS = ("nonempty", "all")

# ---------------------------------------------------------------------------------------------
# rho modes: (log_rho (B, T) = old - behav, zero where masked; m (B, T) float; cfg)
#   -> (weight (B, T), modified (B, T) bool: truncated or masked)


def _seq_log_rho(log_rho: Tensor, m: Tensor, geometric: bool) -> Tensor:
    s = (log_rho * m).sum(-1, keepdim=True)  # (B, 1)
    return s / m.sum(-1, keepdim=True).clamp(min=1) if geometric else s


def _truncate(rho: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    return rho.clamp(max=cfg.rho_cap), rho > cfg.rho_cap


def _reject(rho: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    keep = (rho >= cfg.rho_low) & (rho <= cfg.rho_high)
    return torch.where(keep, rho, torch.zeros_like(rho)), ~keep


def _rho_weights(rule: Callable, level: str, log_rho: Tensor, m: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """``rule`` (``_truncate``: TIS, ``_reject``: MIS) applied to each token's ratio (``level`` "token"), or to its
    sequence's product ("seq") or geometric mean ("geo_seq"), broadcast over the sequence's tokens."""
    if level == "token":
        return rule(torch.exp(log_rho), cfg)
    w, mod = rule(torch.exp(_seq_log_rho(log_rho, m, geometric=level == "geo_seq")), cfg)
    return w.expand_as(log_rho), mod.expand_as(log_rho)


# token_tis, seq_tis, geo_seq_tis, token_mis, seq_mis, geo_seq_mis
RHO_MODES: dict[str, Callable[[Tensor, Tensor, LossConfig], tuple[Tensor, Tensor]]] = {
    f"{level}_{name}": partial(_rho_weights, rule, level)
    for name, rule in (("tis", _truncate), ("mis", _reject))
    for level in ("token", "seq", "geo_seq")
}

# ---------------------------------------------------------------------------------------------


@dataclass
class LossConfig:
    name: str = flag("token_mean", f"loss variant: {', '.join(LOSSES)}")
    eps_low: float = flag(0.2, "clip ratio below at 1 - eps_low")
    eps_high: float = flag(0.2, "clip ratio above at 1 + eps_high (DAPO clip-higher: 0.28)")
    dual_clip_c: float | None = flag(None, "dual clip for A < 0 (> 1, typically 3); None = off")
    kl_coef: float = flag(0.0, "0 = no KL term and no ref_logprobs needed")
    kl_estimator: str = flag("k3", "KL estimator: k1 (no gradient in expectation), k2, k3")
    entropy_coef: float = flag(0.0, "entropy bonus (subtracted from the loss); needs entropy=")
    max_len_norm: int | None = flag(None, "constant normaliser for 'constant_norm' (max completion tokens)")
    seq_count: str = flag("nonempty", "total_seqs counts 'nonempty' sequences or 'all' (B)")
    use_rho_correction: bool = flag(
        False, "reweight by pi_old / mu (needs behav_logprobs=); on by default with --rollout spool"
    )
    rho_mode: str = flag("token_tis", f"off-policy correction mode: {', '.join(RHO_MODES)}")
    rho_cap: float = flag(2.0, "truncation cap for the *_tis modes")
    rho_low: float = flag(0.5, "lower bound kept by the *_mis modes")
    rho_high: float = flag(2.0, "upper bound kept by the *_mis modes")
    sapo_tau_pos: float = flag(1.0, "--loss sapo: gate temperature for A > 0 (TRL's 1.0)")
    sapo_tau_neg: float = flag(1.05, "--loss sapo: gate temperature for A < 0 (TRL's 1.05)")

    def __post_init__(self) -> None:
        for key, table in (
            ("name", LOSSES),
            ("kl_estimator", KL_ESTIMATORS),
            ("rho_mode", RHO_MODES),
            ("seq_count", SEQ_COUNTS),
        ):
            value = getattr(self, key)
            if value not in table:
                raise ValueError(f"LossConfig.{key}={value!r} is unknown; valid: {', '.join(table)}")
        for key in ("eps_low", "eps_high", "kl_coef"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"LossConfig.{key}={value!r} must be a finite number >= 0")
        if not abs(self.entropy_coef) < float("inf"):
            raise ValueError(f"LossConfig.entropy_coef={self.entropy_coef!r} must be finite")
        if self.dual_clip_c is not None:
            if not self.dual_clip_c > 1:
                raise ValueError(f"LossConfig.dual_clip_c={self.dual_clip_c!r} must be > 1 (or None to disable)")
            if self.name in ("cispo", "sapo"):
                raise ValueError(f"LossConfig.dual_clip_c has no effect with name={self.name!r} (no clipped objective)")
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(
                f"LossConfig.sapo_tau_pos / sapo_tau_neg must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}"
            )
        if self.name == "constant_norm" and not (self.max_len_norm is not None and self.max_len_norm > 0):
            raise ValueError(f"LossConfig.max_len_norm={self.max_len_norm!r}: name='constant_norm' needs a value > 0")
        if not self.rho_cap > 0:
            raise ValueError(f"LossConfig.rho_cap={self.rho_cap!r} must be > 0")
        if not 0 <= self.rho_low < self.rho_high:
            raise ValueError(f"LossConfig.rho_low={self.rho_low!r}, rho_high={self.rho_high!r}: need 0 <= low < high")


def normalisers(mask: Tensor, cfg: LossConfig | None = None) -> tuple[int, int]:
    """(tokens, sequences) of one mask (B, T); sum them over micro-batches and ranks.

    Sequences are those with >= 1 token, or every row B when ``cfg.seq_count == "all"``. Fold ``valid``
    into ``mask`` first (``mask & valid[:, None]``) so masked-out completions leave the token count."""
    rows = mask.shape[0] if cfg is not None and cfg.seq_count == "all" else int(mask.any(-1).sum())
    return int(mask.sum()), rows


def policy_loss(
    cfg: LossConfig,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    behav_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    valid: Tensor | None = None,
    total_tokens: float,
    total_seqs: float,
) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the whole-batch loss (see the module docstring), and stats.

    ``old_logprobs``, ``behav_logprobs`` and ``ref_logprobs`` are treated as constants. Values at
    masked positions are ignored (may be padding, -inf or NaN) and receive zero gradient. The math
    runs in at least float32 (bf16 logprobs are upcast; the gradient flows back in their dtype).
    An all-masked micro-batch returns a zero loss (with a graph) and zero-weight stats.

    ``valid`` (B,) bool, ``compute_advantages``' second output for these rows: False rows are
    masked out here (``mask & valid[:, None]``), as they must be in ``total_tokens`` / ``total_seqs``
    (``normalisers(mask & valid[:, None])``). ``compute_advantages`` gives invalid completions
    advantage 0, which cannot be told apart from a zero-variance group: a caller that neither
    passes ``valid`` nor folds it into ``mask`` would keep them in the normaliser and in the KL and
    entropy terms. What is detectable is a NaN advantage (an unscorable reward carried through):
    it raises ``ValueError`` on any counted row, with or without ``valid``.
    """
    _check(cfg, logprobs, old_logprobs, advantages, mask, behav_logprobs, ref_logprobs, entropy)
    if valid is not None:
        if valid.shape != advantages.shape or valid.dtype != torch.bool:
            raise ValueError(f"valid must be a (B,) bool tensor, got {tuple(valid.shape)} {valid.dtype}")
        mask = mask & valid[:, None]  # (B, T)
    n_tok, n_seq = normalisers(mask, cfg)
    if not total_tokens > 0 or not total_seqs > 0:
        raise ValueError(
            f"total_tokens={total_tokens}, total_seqs={total_seqs}: the whole batch has no masked tokens "
            "(all completions invalid?); skip the step instead of calling policy_loss"
        )
    if n_tok > total_tokens or n_seq > total_seqs:
        raise ValueError(
            f"this micro-batch has {n_tok} tokens / {n_seq} sequences, more than total_tokens={total_tokens} / "
            f"total_seqs={total_seqs}: pass the whole batch's counts (sum of normalisers(mask) over micro-batches)"
        )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 ratios are too coarse to clip
    m = mask.to(dtype)  # (B, T)

    def clean(x: Tensor) -> Tensor:  # padding may hold -inf / NaN; where() gives it zero gradient
        x = x.to(dtype)
        return torch.where(mask, x, torch.zeros_like(x))

    lp, old = clean(logprobs), clean(old_logprobs.detach())
    row = mask.any(-1)  # (B,)
    a = advantages.detach().to(lp.dtype)
    adv = torch.where(row, a, 0.0)[:, None] if a.dim() == 1 else torch.where(mask, a, 0.0)  # (B, 1) or (B, T)
    if not torch.isfinite(adv).all():
        raise ValueError(
            "advantages are NaN/inf on sequences with masked tokens: pass valid= (compute_advantages' second "
            "output) or fold it into mask, so unscorable completions get no gradient"
        )

    variant = LOSSES[cfg.name]

    def agg(x: Tensor) -> Tensor:
        return variant.aggregate(x, m, total_tokens, total_seqs, cfg)

    loss_t, flags = variant.surrogate(lp, old, adv, m, cfg)  # (B, T)
    stats: dict[str, float] = {"num_tokens": float(n_tok), "num_seqs": float(n_seq)}
    if behav_logprobs is not None:
        log_rho = clean(old - behav_logprobs.detach())  # (B, T) log pi_old - log mu
        stats.update(_mismatch_stats(log_rho, mask, n_tok))
        if cfg.use_rho_correction:
            weight, modified = RHO_MODES[cfg.rho_mode](log_rho, m, cfg)  # (B, T)
            loss_t = loss_t * weight.detach()
            kind = "masked" if cfg.rho_mode.endswith("_mis") else "clipped"
            stats[f"rho_{kind}_frac"] = _tmean(modified.to(m.dtype), mask, n_tok)
            stats["is_weight_mean"] = _tmean(weight, mask, n_tok)
            stats["is_weight_max"] = _tmax(weight, mask)

    pg = agg(loss_t)
    loss = pg
    stats["pg_loss"] = float(pg.detach())
    stats["kl_loss"] = 0.0
    stats["entropy_loss"] = 0.0
    if ref_logprobs is not None:
        kl_t = KL_ESTIMATORS[cfg.kl_estimator](lp, clean(ref_logprobs.detach()))  # (B, T)
        stats["kl"] = _tmean(kl_t, mask, n_tok)
        if cfg.kl_coef > 0:
            kl_term = cfg.kl_coef * agg(kl_t)
            loss = loss + kl_term
            stats["kl_loss"] = float(kl_term.detach())
    if entropy is not None:
        ent = clean(entropy)
        stats["entropy"] = _tmean(ent, mask, n_tok)
        if cfg.entropy_coef != 0:
            ent_term = -cfg.entropy_coef * agg(ent)
            loss = loss + ent_term
            stats["entropy_loss"] = float(ent_term.detach())
    stats["loss"] = float(loss.detach())
    stats["ratio_mean"] = _tmean(flags["ratio"], mask, n_tok)
    stats["ratio_max"] = _tmax(flags["ratio"], mask)
    for k in ("clip_low", "clip_high", "clip_dual"):
        stats[f"{k}_frac"] = _tmean(flags[k].to(m.dtype), mask, n_tok)
    return loss, stats


def _mismatch_stats(log_rho: Tensor, mask: Tensor, n_tok: int) -> dict[str, float]:
    """|log pi_old - log mu| mean / max, k3 estimate of KL(mu || pi_old) (tokens are drawn from mu)."""
    rho = torch.exp(log_rho)
    return {
        "mismatch_abs_mean": _tmean(log_rho.abs(), mask, n_tok),
        "mismatch_abs_max": _tmax(log_rho.abs(), mask),
        "mismatch_kl_k3": _tmean(rho - 1 - log_rho, mask, n_tok),
        "rho_mean": _tmean(rho, mask, n_tok),
        "rho_max": _tmax(rho, mask),
    }


@torch.no_grad()
def _tmean(x: Tensor, mask: Tensor, n_tok: int) -> float:
    return float(torch.where(mask, x, 0.0).sum() / n_tok) if n_tok else 0.0


@torch.no_grad()
def _tmax(x: Tensor, mask: Tensor) -> float:
    return float(x[mask].max()) if mask.any() else 0.0


def _check(cfg, logprobs, old_logprobs, advantages, mask, behav_logprobs, ref_logprobs, entropy) -> None:
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    for name, t in (
        ("old_logprobs", old_logprobs),
        ("mask", mask),
        ("behav_logprobs", behav_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
    ):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} is neither (B,) = ({logprobs.shape[0]},) nor "
            f"(B, T) = {tuple(logprobs.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True = token counts), got {mask.dtype}")
    if cfg.use_rho_correction and behav_logprobs is None:
        raise ValueError("LossConfig.use_rho_correction=True needs behav_logprobs= (the sampler's logprobs)")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"LossConfig.kl_coef={cfg.kl_coef} > 0 needs ref_logprobs=")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"LossConfig.entropy_coef={cfg.entropy_coef} != 0 needs entropy=")


SUM_STATS = frozenset({"loss", "pg_loss", "kl_loss", "entropy_loss", "num_tokens", "num_seqs"})


def merge_stats(stats: Iterable[dict[str, float]]) -> dict[str, float]:
    """Merge ``policy_loss`` stats of micro-batches / ranks into whole-batch stats.

    Keys in ``SUM_STATS`` are summed, ``*_max`` keys take the max, all others are means weighted
    by each call's ``num_tokens``. A key missing from some calls is merged over those that have it.
    """
    stats = list(stats)
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for s in stats for k in s)
    for k in keys:
        have = [s for s in stats if k in s]
        if k in SUM_STATS:
            out[k] = sum(s[k] for s in have)
        elif k.endswith("_max"):
            out[k] = max(s[k] for s in have if s["num_tokens"] > 0) if any(s["num_tokens"] > 0 for s in have) else 0.0
        else:
            w = sum(s["num_tokens"] for s in have)
            out[k] = sum(s[k] * s["num_tokens"] for s in have) / w if w else 0.0
    return out
