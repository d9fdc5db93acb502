"""GRPO math vs plain-Python loops written from the papers' formulas, hand-computed cases,
micro-batch exactness, and the errors bad input must raise. Tensors are tiny on purpose."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from align.advantages import AdvantageConfig, compute_advantages
from align.grpo import (
    KL_ESTIMATORS,
    LOSSES,
    RHO_MODES,
    LossConfig,
    merge_stats,
    normalisers,
    policy_loss,
)

ATOL = 1e-5  # float32 values and grads vs the loop reference
RTOL = 1e-5
NAN = float("nan")


def close(a, b, atol=ATOL):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), RTOL, atol)


# ---------------------------------------------------------------------------------------------
# advantages


def ref_advantages(rows, scale, baseline, eps):
    """Plain-Python GRPO / RLOO / Dr. GRPO advantages; None = unscored (gets 0)."""
    scored_all = [r for row in rows for r in row if r is not None]
    batch_std = statistics.stdev(scored_all) if len(scored_all) > 1 else 0.0
    out = []
    for row in rows:
        s = [r for r in row if r is not None]
        n = len(s)
        zero_var = n >= 1 and max(s) == min(s)
        adv_row = []
        for r in row:
            if r is None or zero_var:
                adv_row.append(0.0)
                continue
            b = statistics.mean(s) if baseline == "mean" else (sum(s) - r) / (n - 1)
            a = r - b
            if scale == "group":
                a /= statistics.stdev(s) + eps
            elif scale == "batch":
                a /= batch_std + eps
            adv_row.append(a)
        out.append(adv_row)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["mean", "rloo"])
def test_advantages_match_loop(scale, baseline):
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(4, 5, generator=g, dtype=torch.float64)
    rewards[0, 1] = NAN
    rewards[1, :] = 0.5  # zero variance
    rewards[2, 1:] = NAN  # one scored completion: zero variance too
    rows = [[None if math.isnan(x) else x for x in row] for row in rewards.tolist()]
    adv, valid, stats = compute_advantages(rewards, AdvantageConfig(scale=scale, baseline=baseline))
    assert close(adv, ref_advantages(rows, scale, baseline, 1e-6))
    assert valid.tolist() == [[r is not None for r in row] for row in rows]
    assert stats["num_zero_variance_groups"] == 2 and stats["num_unscored"] == 5
    # negative control: treating NaN as a 0 reward changes the advantages
    rows_bad = [[0.0 if r is None else r for r in row] for row in rows]
    assert not close(adv, ref_advantages(rows_bad, scale, baseline, 1e-6))


def test_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, NAN]])
    adv, valid, _ = compute_advantages(r, AdvantageConfig(eps=0.0))
    # group 0: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.57735; +-0.5 / 0.57735 = +-0.86603
    assert close(adv[0], [0.86603, -0.86603, -0.86603, 0.86603])
    # group 1: scored [1, 0, 0], mean 1/3, std = sqrt((4/9 + 1/9 + 1/9) / 2) = 0.57735
    # (1 - 1/3) / 0.57735 = 1.1547; (0 - 1/3) / 0.57735 = -0.57735; NaN -> 0 and invalid
    assert close(adv[1], [1.1547, -0.57735, -0.57735, 0.0])
    assert valid[1].tolist() == [True, True, True, False]
    adv, _, _ = compute_advantages(r, AdvantageConfig(scale="none", baseline="rloo"))
    # RLOO group 1: r=1 -> 1 - (0 + 0) / 2 = 1; r=0 -> 0 - (1 + 0) / 2 = -0.5
    assert close(adv[1], [1.0, -0.5, -0.5, 0.0])
    # Dr. GRPO (mean baseline, no scaling): 1 - 0.5 = 0.5
    adv, _, _ = compute_advantages(r, AdvantageConfig(scale="none"))
    assert close(adv[0], [0.5, -0.5, -0.5, 0.5])


def test_zero_variance_filter_and_truncation():
    r = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    trunc = torch.tensor([[False, False], [True, False]])
    adv, valid, stats = compute_advantages(r, AdvantageConfig(), truncated=trunc)
    assert valid.all() and stats["num_zero_variance_groups"] == 1 and stats["num_truncated"] == 1
    assert adv[0].tolist() == [0.0, 0.0]  # exactly 0, not rounding noise / eps
    adv, valid, _ = compute_advantages(
        r, AdvantageConfig(filter_zero_variance=True, mask_truncated=True), truncated=trunc
    )
    assert valid.tolist() == [[False, False], [False, True]]
    # the truncated reward still sets the baseline: 0 - 0.5 over std 0.7071 = -0.7071
    assert close(adv[1], [0.0, -0.70711])


def test_batch_scale_and_empty_group_hand():
    # scale="batch": std of all scored rewards [1, 0, 1, 1]: mean 0.75, unbiased var (3 * 0.0625 + 0.5625) / 3
    # = 0.25 -> std 0.5; group 0: (1 - 0.5) / 0.5 = 1, (0 - 0.5) / 0.5 = -1; group 1 zero variance -> 0
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0], [NAN, NAN]])
    adv, valid, stats = compute_advantages(r, AdvantageConfig(scale="batch", eps=0.0))
    assert close(adv, [[1.0, -1.0], [0.0, 0.0], [0.0, 0.0]])
    assert valid.tolist() == [[True, True], [True, True], [False, False]]
    assert stats["num_empty_groups"] == 1 and stats["num_zero_variance_groups"] == 1 and stats["num_valid"] == 4


def test_overlong_penalty_hand_computed():
    # DAPO eq. 13, L_max = 10, L_cache = 4: expected length 6
    # len 6 -> 0; len 8 -> (6 - 8) / 4 = -0.5; len 10 -> -1; len 12 (beyond) -> -1; factor 2 doubles it
    r = torch.zeros(1, 4)
    lengths = torch.tensor([[6, 8, 10, 12]])
    cfg = AdvantageConfig(scale="none", overlong_buffer=4, overlong_penalty=2.0)
    adv, _, stats = compute_advantages(r, cfg, lengths=lengths, max_tokens=10)
    pen = [0.0, -1.0, -2.0, -2.0]
    mean = sum(pen) / 4
    assert close(adv[0], [p - mean for p in pen])
    assert close(stats["overlong_penalty_mean"], mean)


@pytest.mark.parametrize(
    "kwargs, call, match",
    [
        ({"scale": "std"}, {}, "scale='std' is unknown; valid: group, batch, none"),
        ({"baseline": "median"}, {}, "valid: mean, rloo"),
        ({"eps": -1.0}, {}, "eps"),
        ({"mask_truncated": True}, {}, "truncated="),
        ({"overlong_buffer": 4}, {}, "lengths= and max_tokens="),
        ({}, {"lengths": torch.zeros(3, 3)}, "lengths shape"),
    ],
)
def test_advantage_errors(kwargs, call, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(torch.zeros(2, 3), AdvantageConfig(**kwargs), **call)


def test_advantage_rejects_inf_and_bad_shape():
    with pytest.raises(ValueError, match="inf"):
        compute_advantages(torch.tensor([[1.0, float("inf")]]), AdvantageConfig())
    with pytest.raises(ValueError, match=r"\(P, G\)"):
        compute_advantages(torch.zeros(4), AdvantageConfig())


# ---------------------------------------------------------------------------------------------
# losses: plain-Python loop reference from the papers' formulas


def ref_policy_loss(cfg, lp, old, adv, mask, behav, ref, ent, total_tokens, total_seqs):
    """One scalar at a time; torch only for autograd through lp / ent."""
    el, eh = cfg.eps_low, cfg.eps_high
    total = 0.0
    for i in range(lp.shape[0]):
        toks = [t for t in range(lp.shape[1]) if mask[i, t]]
        if not toks:
            continue
        a = float(adv[i])
        w = {t: 1.0 for t in toks}
        if cfg.use_rho_correction:
            lr = {t: float(old[i, t]) - float(behav[i, t]) for t in toks}
            if cfg.rho_mode.startswith("token"):
                rho = {t: math.exp(lr[t]) for t in toks}
            else:
                s = sum(lr.values()) / (len(toks) if cfg.rho_mode.startswith("geo") else 1)
                rho = {t: math.exp(s) for t in toks}
            for t in toks:
                if cfg.rho_mode.endswith("tis"):
                    w[t] = min(rho[t], cfg.rho_cap)
                else:
                    w[t] = rho[t] if cfg.rho_low <= rho[t] <= cfg.rho_high else 0.0

        def clip_obj(r, a=a):  # PPO: max(-rA, -clip(r)A), dual clip min(., -cA) for A < 0
            loss = max(-a * r, -a * min(max(r, 1 - el), 1 + eh))
            if cfg.dual_clip_c is not None and a < 0:
                loss = min(loss, -a * cfg.dual_clip_c)
            return loss

        if cfg.name == "gspo":
            s_i = torch.exp(sum(lp[i, t] - old[i, t] for t in toks) / len(toks))
            per = {t: clip_obj(s_i) for t in toks}
        elif cfg.name == "cispo":
            per = {}
            for t in toks:
                r = math.exp(float(lp[i, t].detach()) - float(old[i, t]))
                per[t] = -min(max(r, 1 - el), 1 + eh) * a * lp[i, t]
        elif cfg.name == "sapo":  # TRL get_sapo_token_loss: sigmoid(tau (r - 1)) * 4 / tau, then * -A
            tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
            per = {t: -a * 4 / tau / (1 + torch.exp(-tau * (torch.exp(lp[i, t] - old[i, t]) - 1))) for t in toks}
        else:
            per = {t: clip_obj(torch.exp(lp[i, t] - old[i, t])) for t in toks}

        terms = []
        for t in toks:
            term = w[t] * per[t]
            if cfg.kl_coef:
                x = ref[i, t] - lp[i, t]
                kl = {"k1": -x, "k2": 0.5 * x * x, "k3": torch.exp(x) - 1 - x}[cfg.kl_estimator]
                term = term + cfg.kl_coef * kl
            if cfg.entropy_coef:
                term = term - cfg.entropy_coef * ent[i, t]
            terms.append(term)
        if cfg.name in ("token_mean", "cispo", "bnpo"):  # bnpo: one call is one local batch (its own tokens)
            total = total + sum(terms) / total_tokens
        elif cfg.name == "constant_norm":
            total = total + sum(terms) / (total_seqs * cfg.max_len_norm)
        else:  # seq_mean_token_mean, gspo, sapo
            total = total + sum(terms) / len(toks) / total_seqs
    return total


def make_batch(seed, B=4, T=5, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g) * 2 - 0.05).requires_grad_()
    old = lp.detach() + spread * torch.randn(B, T, generator=g)
    behav = old + 0.4 * torch.randn(B, T, generator=g)
    ref = lp.detach() + 0.3 * torch.randn(B, T, generator=g)
    ent = torch.rand(B, T, generator=g).requires_grad_()
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    mask[1] = False  # an all-masked sequence
    return lp, old, adv, mask, behav, ref, ent


CONFIGS = [
    {},
    {"eps_low": 0.1, "eps_high": 0.28},
    {"dual_clip_c": 1.5, "eps_low": 0.05},
    {"kl_coef": 0.1, "kl_estimator": "k1"},
    {"kl_coef": 0.1, "kl_estimator": "k2"},
    {"kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01},
] + [{"use_rho_correction": True, "rho_mode": m, "rho_cap": 1.2, "rho_low": 0.8, "rho_high": 1.25} for m in RHO_MODES]


# every (variant, config) pair except cispo + dual clip, which LossConfig rejects (tested in test_config_errors)
LOSS_CASES = [(n, e) for e in CONFIGS for n in LOSSES if not (n in ("cispo", "sapo") and "dual_clip_c" in e)]


@pytest.mark.parametrize(
    "name,extra",
    LOSS_CASES,
    ids=[f"{n}-" + ("-".join(f"{k}={v}" for k, v in e.items()) or "default") for n, e in LOSS_CASES],
)
def test_loss_matches_loop_reference(name, extra):
    cfg = LossConfig(name=name, max_len_norm=7, **extra)
    lp, old, adv, mask, behav, ref, ent = make_batch(1, spread=0.01 if name == "gspo" else 0.3)
    tt, ts = normalisers(mask)
    kw = {"behav_logprobs": behav, "ref_logprobs": ref, "entropy": ent, "total_tokens": tt, "total_seqs": ts}
    loss, stats = policy_loss(cfg, lp, old, adv, mask, **kw)
    loss.backward()
    g_lp, g_ent = lp.grad.clone(), ent.grad
    lp.grad = ent.grad = None
    want = ref_policy_loss(cfg, lp, old, adv, mask, behav, ref, ent, tt, ts)
    want.backward()
    assert close(loss.detach(), want.detach()) and close(stats["loss"], float(want.detach()))
    assert close(g_lp, lp.grad)
    assert (g_ent is None and ent.grad is None) or close(g_ent, ent.grad)
    assert g_lp[~mask].abs().sum() == 0
    # negative control: a perturbed old_logprobs in the reference no longer matches (behav moves with it,
    # else rho * ratio = pi / mu cancels pi_old under the sequence-level modes)
    shift = 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9))
    bad = ref_policy_loss(cfg, lp, old + shift, adv, mask, behav + shift, ref, ent, tt, ts)
    assert not close(loss.detach(), bad.detach(), atol=1e-6)


def test_the_variants_normalise_differently():
    # negative control for the table: the same micro-batch (half the batch) gives a different loss per variant
    lp, old, adv, mask, *_ = make_batch(2)
    tt, ts = normalisers(mask)
    half = torch.tensor([0, 2])  # 5 of the batch's 9 tokens: bnpo's local token mean differs from token_mean
    vals = [
        policy_loss(
            LossConfig(name=n, max_len_norm=7),
            lp[half],
            old[half],
            adv[half],
            mask[half],
            total_tokens=tt,
            total_seqs=ts,
        )[1]["loss"]
        for n in LOSSES
    ]
    assert len({round(v, 6) for v in vals}) == len(LOSSES)


# ---------------------------------------------------------------------------------------------
# hand-computed cases


def one(values, adv, cfg, old=None, **kw):
    lp = torch.tensor([values], requires_grad=True)
    old = torch.zeros_like(lp) if old is None else torch.tensor([old])
    mask = torch.ones_like(lp, dtype=torch.bool)
    kw.setdefault("total_tokens", lp.numel())
    kw.setdefault("total_seqs", 1)
    loss, stats = policy_loss(cfg, lp, old, torch.tensor([adv]), mask, **kw)
    loss.backward()
    return float(loss.detach()), lp.grad[0].tolist(), stats


def test_token_mean_hand():
    # token 1: ratio e^log1.5 = 1.5, A = 1 -> clipped at 1.2: -1.2, no gradient
    # token 2: ratio 1 -> -1, d/dlp (-A r) = -r = -1; token mean (-1.2 - 1) / 2 = -1.1, grads [0, -0.5]
    loss, grad, stats = one([math.log(1.5), 0.0], 1.0, LossConfig())
    assert close(loss, -1.1) and close(grad, [0.0, -0.5])
    assert stats["clip_high_frac"] == 0.5 and stats["clip_low_frac"] == 0.0 and close(stats["ratio_max"], 1.5)
    # clip-higher eps_high = 0.6: ratio 1.5 is inside -> (-1.5 - 1) / 2 = -1.25, grads [-0.75, -0.5]
    loss, grad, _ = one([math.log(1.5), 0.0], 1.0, LossConfig(eps_high=0.6))
    assert close(loss, -1.25) and close(grad, [-0.75, -0.5])


def test_dual_clip_hand():
    # A = -1, ratio 5: max(5, 1.2) = 5, gradient d(-A r)/dlp = r = 5
    loss, grad, _ = one([math.log(5.0)], -1.0, LossConfig())
    assert close(loss, 5.0) and close(grad, [5.0])
    # dual clip c = 3: min(5, -A c = 3) = 3, no gradient
    loss, grad, stats = one([math.log(5.0)], -1.0, LossConfig(dual_clip_c=3.0))
    assert close(loss, 3.0) and close(grad, [0.0]) and stats["clip_dual_frac"] == 1.0
    # A = -1, ratio 0.5 < 1 - 0.2: clipped at 0.8 -> loss 0.8, clip_low
    loss, grad, stats = one([math.log(0.5)], -1.0, LossConfig(dual_clip_c=3.0))
    assert close(loss, 0.8) and close(grad, [0.0]) and stats["clip_low_frac"] == 1.0


def test_seq_mean_and_constant_norm_hand():
    # seq 0: one token, ratio 1, A = 1 -> -1; seq 1: three tokens, ratio 1, A = 2 -> -2 each
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([1.0, 2.0])

    def run(cfg):
        return policy_loss(cfg, lp, lp.detach(), adv, mask, total_tokens=4, total_seqs=2)[1]["loss"]

    assert close(run(LossConfig()), (-1 - 6) / 4)  # token mean: -1.75
    assert close(run(LossConfig(name="seq_mean_token_mean")), (-1 + -6 / 3) / 2)  # -1.5
    assert close(run(LossConfig(name="constant_norm", max_len_norm=5)), (-1 - 6) / (2 * 5))  # -0.7
    assert close(run(LossConfig(name="gspo")), (-1 - 2) / 2)  # sequence mean of -A s_i: -1.5


def test_gspo_and_cispo_hand():
    # GSPO: log ratios [log 2, 0] -> s = exp(log 2 / 2) = 1.41421; A = 1, clipped at 1.2 -> -1.2
    loss, grad, stats = one([math.log(2.0), 0.0], 1.0, LossConfig(name="gspo"), total_seqs=1)
    assert close(loss, -1.2) and close(grad, [0.0, 0.0]) and stats["clip_high_frac"] == 1.0
    # eps_high = 0.5: -s = -1.41421; d(-s)/dlp_t = -s / 2 = -0.70711 for both tokens
    loss, grad, _ = one([math.log(2.0), 0.0], 1.0, LossConfig(name="gspo", eps_high=0.5), total_seqs=1)
    assert close(loss, -math.sqrt(2)) and close(grad, [-math.sqrt(2) / 2] * 2)
    # CISPO: lp = -0.5, old = -0.5 - log 1.5 -> r = 1.5, weight sg(clip) = 1.2, A = 1:
    # loss = -1.2 * 1 * (-0.5) = 0.6, grad = -1.2 (clipped tokens still get gradient, unlike PPO)
    loss, grad, _ = one([-0.5], 1.0, LossConfig(name="cispo"), old=[-0.5 - math.log(1.5)])
    assert close(loss, 0.6) and close(grad, [-1.2])


def test_sapo_hand():
    # on-policy (r = 1): loss = -(4 / tau) sigmoid(0) A = -2 A / tau, gradient 4 s (1 - s) r A = r A = -A (as PPO)
    loss, grad, _ = one([0.0], 1.0, LossConfig(name="sapo"))
    assert close(loss, -2.0) and close(grad, [-1.0])
    loss, grad, _ = one([0.0], -1.0, LossConfig(name="sapo"))  # A < 0: tau_neg = 1.05
    assert close(loss, 2 / 1.05) and close(grad, [1.0])
    # off-policy r = 3, A = 1, tau 1: s = sigmoid(2) = 0.880797; grad = -4 s (1 - s) r = -1.259929 (PPO would cut it
    # to 0 at eps 0.2, the unclipped surrogate gives -3): the soft gate fades it
    s = 1 / (1 + math.exp(-2))
    loss, grad, stats = one([math.log(3.0)], 1.0, LossConfig(name="sapo"))
    assert close(loss, -4 * s) and close(grad, [-4 * s * (1 - s) * 3]) and stats["clip_high_frac"] == 0.0
    assert not close(grad, [0.0]) and not close(grad, [-3.0])  # negative control: neither hard clip nor no clip


def _trl_bnpo(cfg, lp, old, adv, mask, split):
    """TRL's bnpo: per micro-batch (a 'local batch') sum(per_token_loss * mask) / mask.sum(), averaged over the
    gradient-accumulation steps; per_token_loss the PPO-clip term of the reference loop."""
    total = 0.0
    for idx in split:
        local = [(i, t) for i in idx for t in range(lp.shape[1]) if mask[i, t]]
        terms = []
        for i, t in local:
            r, a = torch.exp(lp[i, t] - old[i, t]), float(adv[i])
            terms.append(torch.maximum(-a * r, -a * r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)))
        total = total + sum(terms) / max(len(local), 1)
    return total / len(split)


def test_bnpo_is_trls_mean_of_local_token_means():
    cfg = LossConfig(name="bnpo")
    lp, old, adv, mask, *_ = make_batch(4, B=6, T=4)
    mask[1] = True  # every sequence non-empty, so equal-size micro-batches carry equal shares of sequences
    mask[5] = torch.tensor([True, False, False, False])  # and the two micro-batches unequal token counts
    tt, ts = normalisers(mask)
    split = [[0, 1, 2], [3, 4, 5]]
    theta = lp.detach().clone().requires_grad_()
    for idx in split:
        i = torch.tensor(idx)
        policy_loss(cfg, theta[i], old[i], adv[i], mask[i], total_tokens=tt, total_seqs=ts)[0].backward()
    want = _trl_bnpo(cfg, lp, old, adv, mask, split)
    want.backward()
    assert close(theta.grad, lp.grad)
    # negative control: token_mean (DAPO's global token count) gives another gradient on the same split
    mask_tokens = [int(mask[torch.tensor(idx)].sum()) for idx in split]
    assert mask_tokens[0] != mask_tokens[1]  # the split has unequal token counts, so the two must differ
    theta.grad = None
    for idx in split:
        i = torch.tensor(idx)
        policy_loss(LossConfig(), theta[i], old[i], adv[i], mask[i], total_tokens=tt, total_seqs=ts)[0].backward()
    assert not close(theta.grad, lp.grad, atol=1e-5)


def test_kl_estimators_hand():
    # lp = log 0.5, ref = log 0.25: x = ref - lp = -0.69315
    # k1 = 0.69315; k2 = 0.5 * 0.48045 = 0.24023; k3 = 0.5 - 1 + 0.69315 = 0.19315
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    want = {"k1": 0.69315, "k2": 0.24023, "k3": 0.19315}
    for k, fn in KL_ESTIMATORS.items():
        assert close(fn(lp, ref), [[want[k]]], atol=1e-4)
    # with A = 0 the loss is the KL term alone: 0.1 * k3
    loss, _, stats = one([math.log(0.5)], 0.0, LossConfig(kl_coef=0.1), old=[math.log(0.5)], ref_logprobs=ref)
    assert close(loss, 0.019315, atol=1e-5) and close(stats["kl"], 0.19315, atol=1e-4)


def test_rho_modes_hand():
    # log pi_old - log mu per token: [log 3, log 0.9]; rho = [3, 0.9]; seq rho 2.7, geometric sqrt(2.7) = 1.6432
    old = [0.0, 0.0]
    behav = torch.tensor([[-math.log(3.0), -math.log(0.9)]])
    want = {  # weights (cap 2, keep [0.5, 2])
        "token_tis": [2.0, 0.9],
        "seq_tis": [2.0, 2.0],
        "geo_seq_tis": [1.64317, 1.64317],
        "token_mis": [0.0, 0.9],
        "seq_mis": [0.0, 0.0],
        "geo_seq_mis": [1.64317, 1.64317],
    }
    for mode, w in want.items():
        cfg = LossConfig(use_rho_correction=True, rho_mode=mode)
        # ratio 1, A = 1: per-token loss -1, so the loss is -(w0 + w1) / 2 and grads -w / 2
        loss, grad, stats = one([0.0, 0.0], 1.0, cfg, old=old, behav_logprobs=behav)
        assert close(loss, -sum(w) / 2, atol=1e-4) and close(grad, [-x / 2 for x in w], atol=1e-4), mode
        assert close(stats["mismatch_abs_max"], math.log(3.0))
        assert close(stats["rho_max"], 3.0)
    # k3 of KL(mu || pi_old): mean of (rho - 1 - log rho) = ((3 - 1 - 1.09861) + (0.9 - 1 + 0.10536)) / 2
    assert close(stats["mismatch_kl_k3"], (0.90139 + 0.00536) / 2, atol=1e-4)
    assert stats["rho_masked_frac"] == 0.0  # geo_seq_mis kept both tokens


def test_top_p_ratio_is_unbiased_only_with_sampled_logprob():
    # pi_old = sampler policy p over 4 tokens; top-p 0.8 samples from q = p restricted to {0, 1}, renormalised.
    # Expected per-token weighted loss under y ~ q, with rho = p / q, is the pi_old expectation over the
    # support: sum_{y in {0, 1}} p(y) * (-f(y)). With the full-vocabulary logprob as mu, rho = 1 and the
    # expectation is sum q * (-f) instead: off by the factor 1 / Z = 1 / 0.8.
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.625, 0.375, 0.0, 0.0])
    f = torch.tensor([1.0, -2.0, 0.0, 0.0])  # advantages of the two samplable tokens
    want = float((p[:2] * -f[:2]).sum())  # -0.5 + 0.6 = 0.1
    cfg = LossConfig(use_rho_correction=True, rho_cap=10.0)

    def expected(mu):
        total = 0.0
        for y in range(2):
            lp = torch.tensor([[math.log(p[y])]])
            loss, _ = policy_loss(cfg, lp, lp, f[y : y + 1], torch.ones(1, 1, dtype=torch.bool),
                                  behav_logprobs=torch.tensor([[math.log(mu[y])]]), total_tokens=1, total_seqs=1)  # fmt: skip
            total += float(q[y]) * float(loss)
        return total

    assert close(expected(q), want)  # sampled-distribution logprob: exact
    assert not close(expected(p), want)  # full-vocabulary logprob: biased by 1 / Z
    assert close(expected(p), want / 0.8)


# ---------------------------------------------------------------------------------------------
# micro-batching and data parallelism


SPLITS = [
    [[0, 1, 2, 3, 4, 5]],
    [[0], [1], [2, 3], [4, 5]],
    [[0, 1, 2], [3, 4, 5]],
    [[5, 1], [0, 3, 4], [2]],
    [[1], [0, 2, 3, 4, 5]],
]


@pytest.mark.parametrize("name", [n for n in LOSSES if n != "bnpo"])  # bnpo depends on the split by definition
def test_micro_batches_give_the_whole_batch_gradient(name):
    cfg = LossConfig(name=name, max_len_norm=7, kl_coef=0.05, entropy_coef=0.01, use_rho_correction=True,
                     rho_mode="seq_tis" if name == "gspo" else "token_tis", rho_cap=1.5)  # fmt: skip
    lp, old, adv, mask, behav, ref, _ = make_batch(3, B=6, T=4)
    theta = lp.detach().clone().requires_grad_()
    tt, ts = normalisers(mask)  # global normalisers of the whole batch
    grads, all_stats = [], []
    for split in SPLITS:
        theta.grad = None
        stats = []
        for idx in split:  # each micro-batch (or rank) backward on its own share
            i = torch.tensor(idx)
            loss, s = policy_loss(cfg, theta[i], old[i], adv[i], mask[i], behav_logprobs=behav[i],
                                  ref_logprobs=ref[i], entropy=theta[i].exp().neg() * theta[i],
                                  total_tokens=tt, total_seqs=ts)  # fmt: skip
            loss.backward()
            stats.append(s)
        grads.append(theta.grad.clone())
        all_stats.append(merge_stats(stats))
    for g, s in zip(grads[1:], all_stats[1:]):
        assert close(g, grads[0], atol=1e-6)
        assert s.keys() == all_stats[0].keys()
        for k in s:
            assert close(s[k], all_stats[0][k]), k
    # negative control: per-micro-batch normalisers (the common bug) change the gradient
    theta.grad = None
    for idx in SPLITS[1]:
        i = torch.tensor(idx)
        t, n = normalisers(mask[i])
        if t:
            policy_loss(cfg, theta[i], old[i], adv[i], mask[i], behav_logprobs=behav[i], ref_logprobs=ref[i],
                        entropy=theta[i].exp().neg() * theta[i], total_tokens=t, total_seqs=n)[0].backward()  # fmt: skip
    assert not close(theta.grad, grads[0], atol=1e-4)


DDP_NAMES = ("token_mean", "seq_mean_token_mean", "gspo")


def _ddp_batch(name):
    lp, old, adv, mask, behav, ref, _ = make_batch(3, B=6, T=4)
    cfg = LossConfig(name=name, kl_coef=0.05, use_rho_correction=True)
    return cfg, lp, old, adv, mask, behav, ref


def _ddp_worker(rank, world, init_file, out_dir):
    """One rank of a real gloo process group: its rows, global normalisers by all_reduce, grads summed."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for name in DDP_NAMES:
            cfg, lp, old, adv, mask, behav, ref = _ddp_batch(name)
            rows = torch.tensor([[0, 2, 5], [1, 3, 4]][rank])
            counts = torch.tensor(normalisers(mask[rows]), dtype=torch.float64)
            dist.all_reduce(counts)  # whole-batch token / sequence counts
            theta = lp.detach()[rows].clone().requires_grad_()
            loss, _ = policy_loss(cfg, theta, old[rows], adv[rows], mask[rows], behav_logprobs=behav[rows],
                                  ref_logprobs=ref[rows], total_tokens=float(counts[0]), total_seqs=float(counts[1]))  # fmt: skip
            loss.backward()
            full = torch.zeros_like(lp)
            full[rows] = theta.grad
            dist.all_reduce(full)  # SUM, not DDP's average: the normalisers are already global
            if rank == 0:
                torch.save(full, f"{out_dir}/{name}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_the_whole_batch_gradient(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for name in DDP_NAMES:
        cfg, lp, old, adv, mask, behav, ref = _ddp_batch(name)
        tt, ts = normalisers(mask)
        loss, _ = policy_loss(cfg, lp, old, adv, mask, behav_logprobs=behav, ref_logprobs=ref, total_tokens=tt,
                              total_seqs=ts)  # fmt: skip
        loss.backward()
        got = torch.load(tmp_path / f"{name}.pt")
        assert close(got, lp.grad, atol=1e-6), name
        assert not close(got / 2, lp.grad, atol=1e-6)  # negative control: DDP-style averaging halves it


def test_all_masked_micro_batch_is_zero_not_nan():
    lp = torch.full((2, 3), -torch.inf).requires_grad_()  # padding may hold -inf
    old = torch.full((2, 3), NAN)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    adv = torch.tensor([NAN, 1.0])  # invalid completions' advantages are ignored when masked
    for name in LOSSES:
        cfg = LossConfig(name=name, max_len_norm=4, kl_coef=0.1, use_rho_correction=True)
        loss, stats = policy_loss(cfg, lp, old, adv, mask, behav_logprobs=old, ref_logprobs=old,
                                  total_tokens=10, total_seqs=3)  # fmt: skip
        loss.backward()
        assert float(loss.detach()) == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp)), name
        assert all(math.isfinite(v) for v in stats.values()) and stats["num_tokens"] == 0
        lp.grad = None


def test_bf16_logprobs_are_upcast():
    lp, old, adv, mask, *_ = make_batch(7)
    tt, ts = normalisers(mask)
    lp16 = lp.detach().bfloat16().requires_grad_()
    loss16, _ = policy_loss(LossConfig(), lp16, old.bfloat16(), adv, mask, total_tokens=tt, total_seqs=ts)
    loss32, _ = policy_loss(LossConfig(), lp16.detach().float().requires_grad_(), old.bfloat16().float(), adv, mask,
                            total_tokens=tt, total_seqs=ts)  # fmt: skip
    assert loss16.dtype == torch.float32 and close(loss16.detach(), loss32.detach())
    loss16.backward()
    assert lp16.grad.dtype == torch.bfloat16 and torch.isfinite(lp16.grad).all()


def test_padding_values_do_not_leak():
    lp, old, adv, mask, behav, ref, _ = make_batch(4)
    tt, ts = normalisers(mask)
    cfg = LossConfig(kl_coef=0.1, use_rho_correction=True)
    a, _ = policy_loss(cfg, lp, old, adv, mask, behav_logprobs=behav, ref_logprobs=ref, total_tokens=tt, total_seqs=ts)

    def junk(x):
        return torch.where(mask, x, torch.tensor(NAN))

    b, _ = policy_loss(cfg, lp, junk(old), adv, mask, behav_logprobs=junk(behav), ref_logprobs=junk(ref),
                       total_tokens=tt, total_seqs=ts)  # fmt: skip
    assert close(a.detach(), b.detach())
    b.backward()
    assert torch.isfinite(lp.grad).all()


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"name": "ppo"},
            "name='ppo' is unknown; valid: token_mean, seq_mean_token_mean, constant_norm, gspo, cispo, sapo, bnpo",
        ),
        ({"name": "sapo", "dual_clip_c": 3.0}, "no effect with name='sapo'"),
        ({"sapo_tau_neg": 0.0}, "sapo_tau_pos / sapo_tau_neg must be > 0"),
        ({"eps_low": -0.1}, "eps_low=-0.1 must be"),
        ({"eps_high": float("nan")}, "eps_high"),
        ({"kl_estimator": "k4"}, "valid: k1, k2, k3"),
        ({"rho_mode": "tis"}, "valid: token_tis, seq_tis"),
        ({"dual_clip_c": 1.0}, "dual_clip_c=1.0 must be > 1"),
        ({"name": "cispo", "dual_clip_c": 3.0}, "no effect with name='cispo'"),
        ({"name": "constant_norm"}, "max_len_norm=None"),
        ({"rho_low": 2.0, "rho_high": 1.0}, "rho_low=2.0"),
        ({"rho_cap": 0.0}, "rho_cap"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


def test_policy_loss_input_errors():
    lp, old, adv, mask, _behav, _ref, _ = make_batch(5)
    tt, ts = normalisers(mask)
    cfg = LossConfig()
    ok = {"total_tokens": tt, "total_seqs": ts}
    with pytest.raises(ValueError, match="old_logprobs shape"):
        policy_loss(cfg, lp, old[:, :-1], adv, mask, **ok)
    with pytest.raises(ValueError, match="advantages shape"):
        policy_loss(cfg, lp, old, adv[:-1], mask, **ok)
    with pytest.raises(ValueError, match="mask must be a bool"):
        policy_loss(cfg, lp, old, adv, mask.float(), **ok)
    with pytest.raises(ValueError, match="whole batch has no masked tokens"):
        policy_loss(cfg, lp, old, adv, torch.zeros_like(mask), total_tokens=0, total_seqs=0)
    with pytest.raises(ValueError, match="more than total_tokens"):
        policy_loss(cfg, lp, old, adv, mask, total_tokens=tt - 1, total_seqs=ts)
    with pytest.raises(ValueError, match="needs behav_logprobs"):
        policy_loss(LossConfig(use_rho_correction=True), lp, old, adv, mask, **ok)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(LossConfig(kl_coef=0.1), lp, old, adv, mask, **ok)
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(LossConfig(entropy_coef=0.1), lp, old, adv, mask, **ok)
    with pytest.raises(ValueError, match="advantages are NaN"):
        policy_loss(cfg, lp, old, torch.full_like(adv, NAN), mask, **ok)
    # kl_coef = 0 (default): no reference logprobs needed, and no KL in the loss
    loss, stats = policy_loss(cfg, lp, old, adv, mask, **ok)
    assert "kl" not in stats and stats["kl_loss"] == 0.0 and math.isfinite(float(loss.detach()))


def test_stats_are_floats_and_mismatch_reported_without_correction():
    lp, old, adv, mask, behav, ref, ent = make_batch(6)
    tt, ts = normalisers(mask)
    _, stats = policy_loss(LossConfig(), lp, old, adv, mask, behav_logprobs=behav, ref_logprobs=ref, entropy=ent,
                           total_tokens=tt, total_seqs=ts)  # fmt: skip
    assert all(type(v) is float for v in stats.values())
    for k in ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_kl_k3", "rho_mean", "kl", "entropy", "ratio_mean",
              "clip_low_frac", "clip_high_frac", "clip_dual_frac"):  # fmt: skip
        assert k in stats, k
    assert "is_weight_mean" not in stats  # correction off: reported, not applied
    d = (old - behav)[mask]
    assert close(stats["mismatch_abs_mean"], d.abs().mean()) and close(stats["mismatch_abs_max"], d.abs().max())


# ---------------------------------------------------------------------------------------------
# API edges: valid=, the Dr. GRPO paper's normaliser, what each KL estimator's gradient is

KL_GRAD_ATOL = 1e-6  # float64 exact expectations over a 5-token vocabulary


def test_valid_is_folded_into_the_mask():
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    lp, old, adv, mask, _, ref, ent = make_batch(11)
    valid = torch.tensor([True, True, False, True])
    adv = adv.clone()
    adv[2] = 0.0  # compute_advantages' value for an invalid completion
    folded = mask & valid[:, None]
    tt, ts = normalisers(folded)
    kw = {"ref_logprobs": ref, "entropy": ent, "total_tokens": tt, "total_seqs": ts}
    want, want_stats = policy_loss(cfg, lp, old, adv, folded, **kw)
    (g_want,) = torch.autograd.grad(want, lp)
    got, got_stats = policy_loss(cfg, lp, old, adv, mask, valid=valid, **kw)
    (g_got,) = torch.autograd.grad(got, lp)
    assert close(got.detach(), want.detach()) and close(g_got, g_want) and got_stats == want_stats
    assert g_got[2].abs().sum() == 0 and mask[2].any()  # row 2 had counted tokens; valid=False removed them
    # negative control: forgetting valid keeps row 2 in the KL / entropy terms (and its normaliser)
    t_all, s_all = normalisers(mask)
    bad, _ = policy_loss(cfg, lp, old, adv, mask, ref_logprobs=ref, entropy=ent, total_tokens=t_all, total_seqs=s_all)
    assert not close(bad.detach(), want.detach(), atol=1e-6)
    # an unscorable completion's NaN advantage: fine with valid=False on its row, an error on a counted row
    adv[2] = NAN
    nan_ok, _ = policy_loss(cfg, lp, old, adv, mask, valid=valid, **kw)
    assert close(nan_ok.detach(), want.detach())
    with pytest.raises(ValueError, match="pass valid="):
        policy_loss(cfg, lp, old, adv, mask, **kw | {"total_tokens": t_all, "total_seqs": s_all})
    with pytest.raises(ValueError, match="valid must be a"):
        policy_loss(cfg, lp, old, adv, mask, valid=valid.float(), **kw)


def test_dr_grpo_paper_normaliser_counts_every_sequence():
    """seq_count='all': sum_{i,t} m l / (B * max_len_norm), B = every row (masked ones too), vs a loop."""
    L = 7
    cfg = LossConfig(name="constant_norm", max_len_norm=L, seq_count="all", kl_coef=0.1)
    lp, old, adv, mask, _, ref, _ = make_batch(12, B=6, T=4)
    mask[4] = False  # a second fully masked completion (make_batch masks row 1)
    B = mask.shape[0]
    want = 0.0
    for i in range(B):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                r = torch.exp(lp[i, t] - old[i, t])
                a = float(adv[i])
                pg = torch.maximum(-a * r, -a * r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
                x = ref[i, t] - lp[i, t]
                want = want + (pg + 0.1 * (torch.exp(x) - 1 - x)) / (B * L)
    (g_want,) = torch.autograd.grad(want, lp)
    tt, ts = normalisers(mask, cfg)
    assert ts == B and normalisers(mask)[1] == B - 2
    grad = torch.zeros_like(lp)
    total = 0.0
    for rows in ([0, 1, 2], [3, 4, 5]):  # two micro-batches, whole-batch normalisers
        i = torch.tensor(rows)
        loss, _ = policy_loss(cfg, lp[i], old[i], adv[i], mask[i], ref_logprobs=ref[i], total_tokens=tt, total_seqs=ts)
        total = total + float(loss.detach())
        grad += torch.autograd.grad(loss, lp)[0]
    assert close(total, float(want.detach())) and close(grad, g_want)
    # summed per-micro-batch counts give the same B
    assert sum(normalisers(mask[r], cfg)[1] for r in (slice(0, 3), slice(3, 6))) == B
    # negative control: the default (non-empty sequences) divides by B - 2 instead
    default = LossConfig(name="constant_norm", max_len_norm=L, kl_coef=0.1)
    t2, s2 = normalisers(mask, default)
    loss, _ = policy_loss(default, lp, old, adv, mask, ref_logprobs=ref, total_tokens=t2, total_seqs=s2)
    assert close(float(loss.detach()) * (B - 2), total * B) and not close(float(loss.detach()), total)


def test_kl_estimator_expected_gradients():
    """As a loss on tokens from pi: E[grad k1] = 0, E[grad k2] = grad KL(pi||ref), E[grad k3] = grad KL(ref||pi).

    Exact expectation over a 5-token vocabulary: sum_x sg(pi(x)) grad k(x) (the sample is not differentiated)."""
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(5, generator=g, dtype=torch.float64).requires_grad_()
    log_ref = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), -1)

    def grad(f):
        (d,) = torch.autograd.grad(f(torch.log_softmax(theta, -1)), theta)
        return d

    expected = {
        k: grad(lambda lp, fn=fn: (lp.exp().detach() * fn(lp, log_ref)).sum()) for k, fn in KL_ESTIMATORS.items()
    }
    reverse = grad(lambda lp: (lp.exp() * (lp - log_ref)).sum())  # KL(pi || ref)
    forward = grad(lambda lp: (log_ref.exp() * (log_ref - lp)).sum())  # KL(ref || pi)
    assert close(expected["k1"], torch.zeros(5), atol=KL_GRAD_ATOL)
    assert close(expected["k2"], reverse, atol=KL_GRAD_ATOL)
    assert close(expected["k3"], forward, atol=KL_GRAD_ATOL)
    # negative controls: the two KL directions have different gradients here, and neither is zero
    assert not close(reverse, forward, atol=1e-3) and not close(reverse, torch.zeros(5), atol=1e-3)
    assert not close(forward, torch.zeros(5), atol=1e-3)
