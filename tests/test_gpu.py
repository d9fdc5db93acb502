"""The CUDA paths of issue 13, on a GPU: every test here is marked ``gpu`` and skips without CUDA (conftest.py).

Run them with ``bash scripts/gpu_check.sh`` (or ``PYTHONPATH=. python3 -m pytest -m gpu tests/test_gpu.py``). The same
code runs on the CPU in tests/test_learner.py (``--device cpu``); these add what only a GPU shows: the Triton kernel
selected by ``auto``, bf16 autocast on CUDA, the native sampler on CUDA, and the peak memory of the fused path.
"""

from __future__ import annotations

import json

import pytest
import torch

from align import kernels, learner
from align.device import Placement, resolve
from align.grpo import merge_stats
from align.rollout.protocol import SamplingParams

pytestmark = pytest.mark.gpu

BF16_GRAD_TOL = 5e-2  # bf16 matmuls by two paths: max |diff| relative to the gradient's max
SAMPLER_TOL = 5e-2  # sampler logprob vs teacher-forced recompute, same precision, different kernels / batch shapes
MEMORY_RATIO = 0.5  # the fused step's memory beyond weights and grads vs the plain one's (the benchmark: <= 1/3)


def cuda_tiny(tied: bool = True, vocab: int = 4096, layers: int = 2, dtype=torch.float32):
    from helpers_learner import tiny

    return tiny(tied, vocab=vocab, layers=layers).to("cuda", dtype)


def cuda_batch(model, N, seed):
    from helpers_learner import fake_step

    prompts, comps = fake_step(N, model.config.vocab_size, seed)
    inputs, targets, mask, _, behav = learner.sequence_batch(prompts, comps, 3, "cuda")
    adv = torch.randn(N, generator=torch.Generator().manual_seed(seed + 1)).cuda()
    return learner.Batch(inputs, targets, mask, adv, behav)


def test_auto_resolves_to_cuda_bf16_mixed_and_triton():
    place = resolve("auto", "auto")
    assert place.device.type == "cuda" and place.precision == "bf16-mixed"
    h = torch.zeros(2, 8, device="cuda")
    assert kernels._resolve_backend(h, "auto") == "triton"
    with pytest.raises(ValueError, match="CUDA device"):
        resolve(f"cuda:{torch.cuda.device_count()}", "auto")


def test_fused_matches_plain_on_cuda_in_bf16_mixed():
    from helpers_learner import cfg, plain_loss

    model = cuda_tiny()
    c = cfg(device="cuda")
    b = cuda_batch(model, 8, 0)
    place = Placement(torch.device("cuda"), "bf16-mixed")
    model.zero_grad(set_to_none=True)
    with place.autocast():
        loss_p, _ = plain_loss(model, b, c)
    loss_p.backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    st = merge_stats(learner.backward_batch(model, None, c, *b, place=place))
    assert st["loss"] == pytest.approx(float(loss_p.detach()), rel=2e-2, abs=2e-3)
    for k, p in model.named_parameters():
        scale = plain[k].abs().max()
        assert (p.grad - plain[k]).abs().max() <= BF16_GRAD_TOL * scale + 1e-6, k


def test_native_sampler_on_cuda_shares_the_weights_and_matches_the_trainer():
    from align.rollout import native

    model = cuda_tiny()
    place = Placement(torch.device("cuda"), "bf16-mixed")
    prompts = [[1, 2, 3], [4, 5], [6]]
    params = SamplingParams(n=3, max_tokens=12, seed=0)
    with torch.inference_mode(), native.packed_weights(model, 9) as packed:
        assert packed is False  # no CPU packing (no second copy of the weights) on CUDA; True on a CPU
    with place.autocast():
        a = native.generate(model, prompts, params)
        b = native.generate(model, prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]  # same seed, same completions
    inputs, targets, mask, full_lp, _ = learner.sequence_batch(prompts, a, 3, "cuda")
    with torch.no_grad():
        lp, _ = learner.token_logprobs(model, inputs, targets, 1.0, place=place, with_entropy=False)
    assert (lp - full_lp)[mask].abs().max() < SAMPLER_TOL
    with torch.no_grad():  # the sampler reads the live weights: a change shows in the next sample
        model.lm_head.weight.mul_(3.0)
    with place.autocast():
        c = native.generate(model, prompts, params)
    assert [x.logprobs for x in c] != [x.logprobs for x in a]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_training_loop_on_cuda(tmp_path, precision):
    from align.char_tokenizer import CharTokenizer
    from align.model import Transformer, save_pretrained
    from align.tasks import reverse
    from align.train import TrainConfig, train

    tok = CharTokenizer("abcd=")
    mcfg = reverse.model_config(tok)
    model_dir = save_pretrained(Transformer(mcfg).init_weights(seed=0), tmp_path / "m")
    c = TrainConfig(out=str(tmp_path / "run"), steps=3, prompts_per_step=4, group_size=4, max_tokens=6, lr=1e-2,
                    warmup_steps=0, device="cuda", precision=precision, micro_batch_tokens=64, updates_per_batch=2,
                    mini_batches=2)  # fmt: skip
    c.loss.kl_coef = 0.01
    c.eval.eval_interval = 0
    train(c, model=str(model_dir), tokenizer=tok, prompts=[{"prompt": w + "="} for w in ("ab", "cd", "bca", "dd")],
          reward=lambda p, comp, **_: comp.count("a") / 4)  # fmt: skip
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(abs(r["loss"]) < 1e6 and r["grad_norm"] == r["grad_norm"] for r in recs)


def test_fused_step_peak_memory_is_below_the_plain_one():
    """One forward + backward at a Qwen-sized vocabulary: the memory beyond weights and gradients."""
    V, N, L = 151936, 8, 512  # 4096 tokens: four LINEAR_ROWS blocks; the logits dominate a 2-layer, 64-wide model
    model = cuda_tiny(tied=True, vocab=V, layers=2)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, V, (N, L), generator=g).cuda()
    targets = torch.randint(0, V, (N, L), generator=g).cuda()
    place = Placement(torch.device("cuda"), "bf16-mixed")
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def extra(step) -> int:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before - grad_bytes

    def plain():
        with place.autocast():
            logits = model(inputs)  # (N, L, V)
        lp, ent = kernels.token_logprobs(logits, targets)
        (lp.sum() + ent.sum()).backward()

    def fused():
        lp, ent = learner.token_logprobs(model, inputs, targets, 1.0, place=place)
        (lp.sum() + ent.sum()).backward()

    p, f = extra(plain), extra(fused)
    print(f"extra memory plain {p / 2**20:.0f} MiB, fused {f / 2**20:.0f} MiB")
    assert f < MEMORY_RATIO * p


PACKED_FP32_TOL = {"rtol": 1e-4, "atol": 1e-5}  # fp32 on CUDA: FlexAttention's fused kernel vs SDPA's, other sum order


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_packed_rows_match_the_padded_path_on_cuda(precision, monkeypatch):
    """--pack-sequences on CUDA: FlexAttention block masks (compiled), rows padded to the token budget; the loss and
    every parameter's gradient equal the padded path's (tests/test_packing.py does the same on the CPU's SDPA path).
    Control: a layout that lets a completion see its sibling does not."""
    from helpers_learner import cfg, siblings_visible

    from align import packing

    model = cuda_tiny(tied=True)
    b = cuda_batch(model, 12, 3)
    place = Placement(torch.device("cuda"), precision)

    def run(**kw):
        model.zero_grad(set_to_none=True)
        st = merge_stats(learner.backward_batch(model, None, cfg(device="cuda", **kw), *b, place=place))
        return st, {k: p.grad.clone() for k, p in model.named_parameters()}

    (st_pad, padded), (st_pack, packed) = run(pack_sequences=False), run(pack_sequences=True, micro_batch_tokens=64)
    rows = learner.plan_micro_batches(b.inputs, b.mask, cfg(device="cuda", pack_sequences=True, micro_batch_tokens=64))
    assert packing.build(b.inputs, b.targets, b.mask, rows[0], pad_to=64).layout.backend == "flex"
    tol = PACKED_FP32_TOL if precision == "fp32" else {"rtol": BF16_GRAD_TOL, "atol": 1e-6}
    assert st_pack["loss"] == pytest.approx(st_pad["loss"], rel=tol["rtol"], abs=tol["atol"])

    def far(grads) -> list[str]:  # the parameters whose gradient is off the padded one by more than the tolerance
        return [
            k
            for k, g in grads.items()
            if (g - padded[k]).abs().max() > tol["rtol"] * padded[k].abs().max() + tol["atol"]
        ]

    assert not far(packed)
    real = packing.build

    def broken(*a, **k):
        pk = real(*a, **k)
        pk.layout = siblings_visible(pk.layout)
        return pk

    monkeypatch.setattr(packing, "build", broken)
    assert far(run(pack_sequences=True, micro_batch_tokens=64)[1])


GRAPH_LOGPROB_TOL = 1e-4  # fp32: the graph attends over the whole static cache (masked), eager over the used slots


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_graph_decode_matches_eager_decode(precision, monkeypatch):
    """The native sampler's CUDA-graph decode (align.rollout.graph_decode). fp32: the eager loop's tokens and
    logprobs for a seed. bf16-mixed: bf16 rounds the two attention widths differently and near-ties may sample other
    tokens, so the contract checked is the logprob basis (each token's logprob = the teacher-forced one, as
    test_native_sampler_on_cuda_shares_the_weights_and_matches_the_trainer). Control: a graph whose static token
    input is not refreshed before a replay fails both."""
    from align.rollout import graph_decode, native

    model = cuda_tiny()
    place = Placement(torch.device("cuda"), precision)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    params = SamplingParams(n=4, max_tokens=40, seed=0, stop_token_ids=[11])

    def run(**kw):
        with place.autocast():
            return native.generate(model, prompts, params, **kw)

    def close(a, b) -> bool:
        if [c.token_ids for c in a] != [c.token_ids for c in b]:
            return False
        return all(max(abs(x - y) for x, y in zip(p.logprobs, q.logprobs)) <= GRAPH_LOGPROB_TOL for p, q in zip(a, b))

    def teacher_forced(a) -> bool:
        inputs, targets, mask, full_lp, _ = learner.sequence_batch(prompts, a, 4, "cuda")
        with torch.no_grad():
            lp, _ = learner.token_logprobs(model, inputs, targets, 1.0, place=place, with_entropy=False)
        return bool((lp - full_lp)[mask].abs().max() < SAMPLER_TOL)

    ok = close if precision == "fp32" else (lambda a, _: teacher_forced(a))
    eager = run(cuda_graphs=False)
    assert graph_decode.captured(model) == []
    graph = run()
    assert len(graph_decode.captured(model)) == 1  # captured, not fallen back
    assert ok(graph, eager)
    assert ok(run(), eager)  # replayed again by the next call, same seed
    step = graph_decode.StaticDecode.step  # control: the token buffer never refreshed before a replay

    def stale(self, tok, pos):
        return step(self, self.tok[:, 0].clone(), pos)  # feeds what the buffer already holds

    monkeypatch.setattr(graph_decode.StaticDecode, "step", stale)
    assert not ok(run(), eager)
