"""align.learner: fused lm_head logprobs vs the plain logits path, token-budget micro-batches vs one whole batch,
several updates per batch vs a loop written here; align.device: --device / --precision resolution and AdamW32.

Everything runs on the CPU through the code CUDA runs (``--device cpu``); tests/test_gpu.py repeats the device
specific parts on a GPU. Random-weight models built in the test, no download.
"""

from __future__ import annotations

import pytest
import torch
from helpers_learner import CPU, batch_for, cfg, plain_loss, tiny

from align import device as device_mod
from align import kernels, learner
from align.device import AdamW32, Placement, resolve_device, resolve_precision
from align.grpo import merge_stats, normalisers, policy_loss
from align.model import Transformer
from align.train import TrainConfig

FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, the same math summed in a different order
BF16_TOL = {"rtol": 2e-2, "atol": 2e-3}  # bf16 forward/backward vs the same in bf16 by another path
SAMPLER_TOL = 1e-3  # sampler logprob vs the trainer's teacher-forced recompute in the same precision


def grads(model: Transformer) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def assert_grads_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ------------------------------------------------------------------------------------------------ fused logprobs


@pytest.mark.parametrize("tied", [False, True])
def test_fused_loss_and_gradients_equal_the_plain_path(tied, monkeypatch):
    monkeypatch.setattr(kernels, "LINEAR_ROWS", 7)  # several token blocks in forward and backward
    model = tiny(tied)
    c = cfg(entropy_coef=0.01)
    b = batch_for(model)
    model.zero_grad(set_to_none=True)
    loss_p, stats_p = plain_loss(model, b, c)
    loss_p.backward()
    plain = grads(model)
    model.zero_grad(set_to_none=True)

    def no_logits(*a, **k):
        raise AssertionError("the fused path must not run the lm_head over the whole sequence")

    monkeypatch.setattr(model.lm_head, "forward", no_logits)
    stats_f = merge_stats(learner.backward_batch(model, None, c, *b, place=CPU))
    fused = grads(model)
    assert stats_f["loss"] == pytest.approx(stats_p["loss"], rel=1e-5)
    assert stats_f["entropy"] == pytest.approx(stats_p["entropy"], rel=1e-5)
    assert_grads_close(fused, plain, **FP32_TOL)  # every parameter, the (tied) lm_head included
    if tied:
        assert "lm_head.weight" not in fused and fused["model.embed_tokens.weight"].abs().sum() > 0
    # negative control: a 1e-3 change of the head gives gradients the tolerance rejects
    model.zero_grad(set_to_none=True)
    monkeypatch.undo()
    plain_loss(model, b, c, head_scale=1.001)[0].backward()
    assert max_diff(grads(model), fused) > 10 * FP32_TOL["atol"]


def test_the_head_runs_on_the_scored_positions_only(monkeypatch):
    """token_logprobs(mask=...): the fused head sees the masked rows only (not prompt or padding positions); the
    logprobs and entropy there equal the unmasked call's, 0 elsewhere, and the gradient of a masked sum is the same.
    Control: the unmasked call's head sees every position and its logprobs off the mask are not 0."""
    model = tiny(False)
    b = batch_for(model)
    seen = []
    real = learner.linear_token_logprobs
    monkeypatch.setattr(
        learner, "linear_token_logprobs", lambda h, *a, **k: seen.append(h.numel() // h.shape[-1]) or real(h, *a, **k)
    )
    model.zero_grad(set_to_none=True)
    lp, ent = learner.token_logprobs(model, b.inputs, b.targets, 0.7, mask=b.mask)
    (lp.sum() + ent.sum()).backward()
    masked_grads = grads(model)
    model.zero_grad(set_to_none=True)
    lp_all, ent_all = learner.token_logprobs(model, b.inputs, b.targets, 0.7)
    (torch.where(b.mask, lp_all, 0.0).sum() + torch.where(b.mask, ent_all, 0.0).sum()).backward()
    assert seen == [int(b.mask.sum()), b.mask.numel()] and seen[0] < seen[1]
    torch.testing.assert_close(lp[b.mask], lp_all[b.mask], **FP32_TOL)
    torch.testing.assert_close(ent[b.mask], ent_all[b.mask], **FP32_TOL)
    assert not lp[~b.mask].any() and not ent[~b.mask].any() and lp_all[~b.mask].abs().min() > 0
    assert_grads_close(masked_grads, grads(model), **FP32_TOL)


def test_bf16_mixed_fused_matches_plain_under_autocast():
    model = tiny(tied=True)
    c = cfg()
    b = batch_for(model)
    place = Placement(torch.device("cpu"), "bf16-mixed")
    model.zero_grad(set_to_none=True)
    with place.autocast():
        loss_p, _ = plain_loss(model, b, c)
    loss_p.backward()
    plain = grads(model)
    model.zero_grad(set_to_none=True)
    st = merge_stats(learner.backward_batch(model, None, c, *b, place=place))
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # fp32 master gradients
    assert st["loss"] == pytest.approx(float(loss_p.detach()), rel=BF16_TOL["rtol"], abs=BF16_TOL["atol"])
    fused = grads(model)
    for k in fused:  # relative to each gradient's scale: bf16 rounds every matmul
        scale = plain[k].abs().max()
        assert (fused[k] - plain[k]).abs().max() <= BF16_TOL["rtol"] * 5 * scale + 1e-6, k
    fp32 = Placement(torch.device("cpu"), "fp32")  # control: autocast did run (fp32 gives other numbers)
    lp_32, _ = learner.token_logprobs(model, b.inputs, b.targets, 1.0, place=fp32)
    lp_16, _ = learner.token_logprobs(model, b.inputs, b.targets, 1.0, place=place)
    assert (lp_32 - lp_16).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------------ micro-batches


def test_micro_batches_pack_sorted_rows_within_the_budget():
    lengths = [5, 0, 9, 3, 9, 2, 7]
    mbs = learner.micro_batches(lengths, cfg(micro_batch_tokens=18))
    assert sorted(i for mb in mbs for i in mb) == [0, 2, 3, 4, 5, 6]  # every row with tokens, once; row 1 skipped
    assert [i for mb in mbs for i in mb] == [2, 4, 6, 0, 3, 5]  # longest first, stable
    assert all(len(mb) * max(lengths[i] for i in mb) <= 18 for mb in mbs)
    assert mbs == [[2, 4], [6, 0], [3, 5]]
    with pytest.raises(ValueError, match="--micro-batch-tokens 8 is smaller than the longest sequence"):
        learner.micro_batches(lengths, cfg(micro_batch_tokens=8, max_tokens=8))


@pytest.mark.parametrize("loss", ["token_mean", "seq_mean_token_mean", "gspo"])
def test_token_budget_micro_batches_give_the_whole_batch_gradient(loss):
    model = tiny(tied=False)
    b = batch_for(model)
    longest = max(learner.row_lengths(b.mask))

    def run(**kw):
        model.zero_grad(set_to_none=True)
        st = merge_stats(learner.backward_batch(model, None, cfg(name=loss, **kw), *b, place=CPU))
        return grads(model), st

    whole, st_whole = run(micro_batch_size=64)
    for budget in (longest, 2 * longest + 3, 5 * longest):
        split, st = run(micro_batch_tokens=budget)
        assert_grads_close(split, whole, **FP32_TOL)
        assert st["loss"] == pytest.approx(st_whole["loss"], rel=1e-5)
        assert st["num_tokens"] == st_whole["num_tokens"]
    # negative control: each micro-batch normalised by its own tokens (the common bug) changes the gradient
    model.zero_grad(set_to_none=True)
    lengths = learner.row_lengths(b.mask)
    for idx in learner.micro_batches(lengths, cfg(micro_batch_tokens=longest)):
        sub = learner.Batch(*(t[idx] for t in b if t is not None))
        learner.backward_batch(model, None, cfg(name=loss), *sub, place=CPU)
    assert max_diff(grads(model), whole) > 1e-4


def test_budget_errors():
    with pytest.raises(ValueError, match="--micro-batch-tokens 4 is smaller than --max-tokens 11"):
        cfg(micro_batch_tokens=4)
    with pytest.raises(ValueError, match="--micro-batch-tokens 12 is smaller than the longest sequence a step"):
        learner.check_token_budget(cfg(micro_batch_tokens=12), [1, 5, 2])
    learner.check_token_budget(cfg(micro_batch_tokens=15), [1, 5, 2])  # 5 + 11 - 1 = 15 fits


# ------------------------------------------------------------------------------------------------ updates per batch


def loop_reference(model, opt, b: learner.Batch, c: TrainConfig, K: int, M: int, recompute_old: bool = False):
    """PPO epochs written plainly: old logprobs once (unless ``recompute_old``), K passes over M mini-batches."""
    with torch.no_grad():
        old, _ = learner.token_logprobs(model, b.inputs, b.targets, c.temperature, place=CPU, with_entropy=False)
    stats = []
    for _ in range(K):
        for rows in torch.arange(len(b.inputs)).tensor_split(M):
            mb = learner.Batch(*(t[rows] for t in b if t is not None))
            opt.zero_grad(set_to_none=True)
            lp, ent = learner.token_logprobs(model, mb.inputs, mb.targets, c.temperature, place=CPU)
            tokens, seqs = normalisers(mb.mask)
            o = lp.detach() if recompute_old else old[rows]
            loss, st = policy_loss(c.loss, lp, o, mb.advantages, mb.mask, behav_logprobs=mb.behav, entropy=ent,
                                   total_tokens=tokens, total_seqs=seqs)  # fmt: skip
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
            opt.step()
            stats.append(st)
    return stats


def params(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_one_update_per_batch_is_bit_identical_to_a_single_step():
    c = cfg(micro_batch_size=4, lr=0.05)
    b = batch_for(tiny(False))
    a_model, r_model = tiny(False), tiny(False)
    a_opt = torch.optim.AdamW(a_model.parameters(), lr=c.lr)
    r_opt = torch.optim.AdamW(r_model.parameters(), lr=c.lr)
    upd = learner.optimize(a_model, None, a_opt, c, CPU, b)
    # today's step, as train.py did it: zero_grad, micro-batched backward with old = current logprobs, clip, step
    r_opt.zero_grad(set_to_none=True)
    st = learner.backward_batch(r_model, None, c, *b, place=CPU)
    norm = float(torch.nn.utils.clip_grad_norm_(r_model.parameters(), c.grad_clip))
    r_opt.step()
    pa, pr = params(a_model), params(r_model)
    assert all(torch.equal(pa[k], pr[k]) for k in pa)
    assert upd.stats == merge_stats(st) and upd.grad_norm == norm and len(upd.per_update) == 1
    assert upd.stats["ratio_max"] == 1.0 and upd.stats["clip_low_frac"] == upd.stats["clip_high_frac"] == 0.0
    # control: a second update moves the weights further
    learner.optimize(a_model, None, a_opt, c, CPU, b)
    assert not all(torch.equal(p, pa[k]) for k, p in params(a_model).items())


@pytest.mark.parametrize("M", [1, 2])
def test_two_updates_per_batch_match_the_loop_reference(M):
    c = cfg(micro_batch_tokens=40, updates_per_batch=2, mini_batches=M, lr=2.0, eps_low=0.02, eps_high=0.02)
    b = batch_for(tiny(False))
    a_model, r_model, n_model = tiny(False), tiny(False), tiny(False)
    # SGD: Adam's m / sqrt(v) turns fp32 summation-order noise in near-zero gradients into visible steps
    opts = [torch.optim.SGD(m.parameters(), lr=c.lr) for m in (a_model, r_model, n_model)]
    upd = learner.optimize(a_model, None, opts[0], c, CPU, b)
    ref_stats = loop_reference(r_model, opts[1], b, c, K=2, M=M)
    pa, pr = params(a_model), params(r_model)
    assert_grads_close(pa, pr, rtol=1e-4, atol=1e-5)
    assert len(upd.per_update) == 2 * M
    for got, want in zip(upd.per_update, ref_stats):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
        assert got["ratio_mean"] == pytest.approx(want["ratio_mean"], rel=1e-5)
    first, later = upd.per_update[0], upd.per_update[M:]
    assert first["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # the first update starts at pi_old
    for st in later:  # the ratio and the clipping are live from the second pass on
        assert abs(st["ratio_mean"] - 1) > 1e-3
        assert st["clip_low_frac"] + st["clip_high_frac"] > 0
    assert upd.stats["num_tokens"] == normalisers(b.mask)[0]  # the batch's tokens, the K passes counted once
    # negative control: old logprobs recomputed before every update (ratio stuck at 1) end elsewhere
    loop_reference(n_model, opts[2], b, c, K=2, M=M, recompute_old=True)
    assert max_diff(params(n_model), pa) > 1e-4


# ------------------------------------------------------------------------------------------------ device, precision


def test_device_and_precision_errors(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    for bad in ("gpu", "cuda:x", "cuda:-1"):
        with pytest.raises(ValueError, match="--device"):
            TrainConfig(device=bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available here"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--device cuda:7: this machine has 1 CUDA device\(s\) \(cuda:0..cuda:0\)"):
        resolve_device("cuda:7")
    monkeypatch.setattr(device_mod, "bf16_supported", lambda d: False)
    with pytest.raises(ValueError, match="--precision bf16-mixed: cpu has no native bf16 support"):
        resolve_precision("bf16-mixed", torch.device("cpu"))
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    with pytest.raises(ValueError, match="--precision"):
        TrainConfig(precision="fp16")


def test_errors_come_before_any_model_is_loaded(tmp_path, monkeypatch):
    from align.train import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda"):  # the model path does not exist: not reached
        train(TrainConfig(out=str(tmp_path / "o"), device="cuda"), model=str(tmp_path / "nope"), tokenizer=object(),
              prompts=["x"], reward=lambda p, c: 0.0)  # fmt: skip
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(device_mod, "bf16_supported", lambda d: False)
    with pytest.raises(ValueError, match="--precision bf16"):
        train(TrainConfig(out=str(tmp_path / "o"), device="cpu", precision="bf16"), model=str(tmp_path / "nope"),
              tokenizer=object(), prompts=["x"], reward=lambda p, c: 0.0)  # fmt: skip


def test_dtype_is_a_deprecated_alias_of_precision():
    assert TrainConfig(dtype="bfloat16").precision == "bf16"
    assert TrainConfig(dtype="float32", precision="fp32").precision == "fp32"
    assert TrainConfig(dtype="bfloat16").dtype is None  # folded: the saved config holds --precision only
    with pytest.raises(ValueError, match="--dtype bfloat16 .deprecated, means --precision bf16. contradicts"):
        TrainConfig(dtype="bfloat16", precision="fp32")
    with pytest.raises(ValueError, match="--dtype 'float16' must be one of"):
        TrainConfig(dtype="float16")


def test_fp32_optimizer_is_torch_fused_adamw_and_matches_the_default_one():
    """fp32 weights get torch's fused AdamW (one pass per tensor): same update as the default (foreach) AdamW within
    fp32 rounding, over 4 steps with weight decay; its state dict loads into a fresh one. Control: another lr."""
    from align.device import Placement, make_optimizer

    torch.manual_seed(0)
    w0, grads_ = torch.randn(8, 5), [torch.randn(8, 5) for _ in range(4)]

    def run(make, lr=1e-2):
        p = torch.nn.Parameter(w0.clone())
        opt = make([p], lr)
        for g in grads_:
            p.grad = g.clone()
            opt.step()
        return p.detach(), opt

    place = Placement(torch.device("cpu"), "fp32")
    ours, opt = run(lambda ps, lr: make_optimizer(ps, place, lr, (0.9, 0.99), 0.1))
    assert opt.defaults["fused"] is True
    theirs, _ = run(lambda ps, lr: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.99), weight_decay=0.1))
    torch.testing.assert_close(ours, theirs, **FP32_TOL)
    other, _ = run(lambda ps, lr: make_optimizer(ps, place, lr, (0.9, 0.99), 0.1), lr=1.1e-2)  # negative control
    assert (other - theirs).abs().max() > 10 * FP32_TOL["atol"]
    p2 = torch.nn.Parameter(w0.clone())
    opt2 = make_optimizer([p2], place, 1e-2, (0.9, 0.99), 0.1)
    opt2.load_state_dict(opt.state_dict())  # resume
    assert torch.equal(opt2.state[p2]["exp_avg_sq"], next(iter(opt.state.values()))["exp_avg_sq"])


def test_adamw32_matches_torch_adamw_and_keeps_fp32_moments():
    torch.manual_seed(0)
    w0 = torch.randn(8, 5)
    grads_ = [torch.randn(8, 5) for _ in range(4)]

    def run(cls, dtype, lr=1e-2):
        p = torch.nn.Parameter(w0.clone().to(dtype))
        opt = cls([p], lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
        for g in grads_:
            p.grad = g.to(dtype)
            opt.step()
        return p.detach().float(), opt

    ours, _ = run(AdamW32, torch.float32)
    theirs, _ = run(torch.optim.AdamW, torch.float32)
    torch.testing.assert_close(ours, theirs, **FP32_TOL)
    other, _ = run(AdamW32, torch.float32, lr=1.1e-2)  # negative control
    assert (other - theirs).abs().max() > 10 * FP32_TOL["atol"]
    bf, opt = run(AdamW32, torch.bfloat16)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in opt.state)
    torch.testing.assert_close(bf, theirs, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the weights per step
    # resume: torch would cast the loaded moments to bf16; AdamW32 keeps them exact
    p2 = torch.nn.Parameter(torch.zeros(8, 5, dtype=torch.bfloat16))
    opt2 = AdamW32([p2], lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    (m_saved,) = [s["exp_avg"] for s in opt.state.values()]
    assert opt2.state[p2]["exp_avg"].dtype == torch.float32 and torch.equal(opt2.state[p2]["exp_avg"], m_saved)


# ------------------------------------------------------------------------------------------------ the whole loop


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_training_loop_runs_and_resumes_in_each_precision(tmp_path, precision):
    """``--device cpu`` with every precision the CPU supports, token-budget micro-batches, two updates per batch
    and a reference model (KL): finite metrics, weights and optimizer state in the documented dtypes, resume."""
    import json

    from align.char_tokenizer import CharTokenizer
    from align.model import save_pretrained
    from align.run import checkpoint as ckpt
    from align.tasks import reverse
    from align.train import train

    tok = CharTokenizer("abcd=")
    mcfg = reverse.model_config(tok)
    mcfg.num_hidden_layers = 1
    model_dir = save_pretrained(Transformer(mcfg).init_weights(seed=0), tmp_path / "m")
    prompts = [{"prompt": w + "="} for w in ("ab", "cd", "bca", "dd")]

    def run(steps):
        c = TrainConfig(out=str(tmp_path / "run"), steps=steps, prompts_per_step=2, group_size=3, max_tokens=4,
                        lr=1e-2, warmup_steps=0, checkpoint_every=1, device="cpu", precision=precision,
                        micro_batch_tokens=16, updates_per_batch=2, mini_batches=2)  # fmt: skip
        c.loss.kl_coef = 0.01
        c.eval.eval_interval = 0
        return train(c, model=str(model_dir), tokenizer=tok, prompts=prompts,
                     reward=lambda p, comp, **_: comp.count("a") / 4)  # fmt: skip

    run(2)
    run(3)  # resumes from step 2
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert all(r[k] == r[k] and abs(r[k]) < 1e6 for k in ("loss", "kl", "entropy", "grad_norm", "ratio_mean"))
    last = ckpt.latest(tmp_path / "run" / "checkpoints")[1]
    weights = json.loads((last / "model" / "config.json").read_text())["torch_dtype"]
    assert weights == ("bfloat16" if precision == "bf16" else "float32")
    moments = [s["exp_avg"].dtype for s in ckpt.load_state(last)["optimizer"]["state"].values()]
    assert set(moments) == {torch.float32}


@pytest.mark.cpu_bf16
def test_sampler_under_bf16_mixed_computes_like_the_trainer(monkeypatch):
    """The loop samples inside ``place.autocast()``: the CPU packing path steps aside, the KV cache is bf16, and the
    sampler's logprobs are the trainer's bf16-mixed recompute (to bf16 rounding), not the fp32 ones.

    Needs native bf16 GEMMs (``cpu_bf16``): on an AVX2 CPU (AMD EPYC here, no AVX-512) torch's fallback bf16 kernels
    gave decode steps after the first 0.015-0.027 away from the teacher-forced recompute (measured), beyond bf16
    rounding of one GEMM; the GPU check covers bf16 on CUDA."""
    from align import model as model_mod
    from align.rollout import native
    from align.rollout.protocol import SamplingParams

    model = tiny(tied=True)
    prompts = [[1, 2, 3], [4, 5]]
    caches = []
    real_cache = model_mod.KVCache

    def spy(*a, **k):
        caches.append(real_cache(*a, **k))
        return caches[-1]

    monkeypatch.setattr(native, "KVCache", spy)
    place = Placement(torch.device("cpu"), "bf16-mixed")
    with place.autocast():
        comps = native.generate(model, prompts, SamplingParams(n=2, max_tokens=6, seed=0))
    assert caches[0].k.dtype == torch.bfloat16
    inputs, targets, mask, full_lp, _ = learner.sequence_batch(prompts, comps, 2, "cpu")
    with torch.no_grad():
        lp16, _ = learner.token_logprobs(model, inputs, targets, 1.0, place=place, with_entropy=False)
        lp32, _ = learner.token_logprobs(model, inputs, targets, 1.0, place=CPU, with_entropy=False)
    err16 = (lp16 - full_lp)[mask].abs().max()
    err32 = (lp32 - full_lp)[mask].abs().max()
    assert err16 < SAMPLER_TOL < err32  # control: the fp32 recompute is another basis


# ------------------------------------------------------------------------------------------------ --threads


def test_auto_threads_from_omp_num_threads_or_the_cpus(monkeypatch):
    """--threads 0: OMP_NUM_THREADS when set, else the CPUs this process may use, split between the local ranks."""
    auto = device_mod.auto_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert auto(cpus=2) == 2
    assert auto(cpus=16, local_ranks=4) == 4  # torchrun: the CPUs split between the local ranks
    assert auto(cpus=2, local_ranks=4) == 1
    monkeypatch.setattr(device_mod.os, "sched_getaffinity", lambda pid: {0, 1, 2})  # the CPUs this process may use
    assert auto() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert device_mod.resolve_threads(0) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's (or torchrun's) choice wins over the CPU count
    assert device_mod.resolve_threads(0) == 5
    for bad in ("0", "", "x"):  # unset / meaningless values fall back to the CPUs
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        assert device_mod.resolve_threads(0) == 1
    assert device_mod.resolve_threads(7) == 7  # an explicit --threads N is kept as given


def test_import_align_makes_openmp_threads_sleep_when_idle():
    """``import align`` before torch sets OMP_WAIT_POLICY=PASSIVE (libgomp reads it when torch loads it); a policy or
    spin count of the user's wins, and a process that loaded torch first is left alone (too late for libgomp)."""
    import os
    import subprocess
    import sys

    def policy(code: str, **env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        code += "; import os; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
        out = subprocess.run(
            [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=False, timeout=60
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    assert policy("import align") == "PASSIVE"
    assert policy("import align", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"  # the user's choice
    assert policy("import align", GOMP_SPINCOUNT="100000") == "unset"  # a spin count of the user's: theirs
    assert policy("import sys; sys.modules['torch'] = None; import align") == "unset"  # torch loaded first


@pytest.mark.parametrize("threads", [0, 3])
def test_training_sets_the_threads_from_the_model_or_the_flag(tmp_path, monkeypatch, threads):
    """The loop applies --threads: 0 picks ``auto_threads`` (here every one of 4 CPUs), N is N.
    Negative control: the thread count torch had before the run (1, from conftest) differs from both."""
    from align.char_tokenizer import CharTokenizer
    from align.model import save_pretrained
    from align.tasks import reverse
    from align.train import train

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # conftest sets 1 for the suite
    monkeypatch.setattr(device_mod.os, "sched_getaffinity", lambda pid: set(range(4)))
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)  # record, leave the test process's threads alone
    tok = CharTokenizer("abcd=")
    mcfg = reverse.model_config(tok)
    mcfg.num_hidden_layers = 1
    model_dir = save_pretrained(Transformer(mcfg).init_weights(seed=0), tmp_path / "m")
    c = TrainConfig(out=str(tmp_path / "run"), steps=1, prompts_per_step=2, group_size=2, max_tokens=3,
                    warmup_steps=0, device="cpu", threads=threads)  # fmt: skip
    c.eval.eval_interval = 0
    train(c, model=str(model_dir), tokenizer=tok, prompts=[{"prompt": "ab="}, {"prompt": "cd="}],
          reward=lambda p, comp, **_: comp.count("a") / 4)  # fmt: skip
    assert torch.get_num_threads() == 1
    assert seen == [4 if threads == 0 else 3]
