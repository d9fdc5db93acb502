"""The fused CPU draw (``align.rollout.cpu_sample.sample_rows``) against ``native.sample_next``'s torch path: the same
token for the same uniform, the logprob to fp32 rounding, zero-mass tokens never chosen; and the sampler runs it."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_model, save_hf

from align.model import load_pretrained
from align.rollout import cpu_kernel, cpu_sample, native
from align.rollout.protocol import SamplingParams

KERNEL_PARAMS = [pytest.param("avx512", marks=pytest.mark.avx512), pytest.param("avx2", marks=pytest.mark.avx2)]


def _ops(kind: str):
    ops = cpu_kernel.load(kind)
    assert ops is not None, f"this CPU runs {kind} but its build is unavailable: {cpu_kernel.unavailable_reason(kind)}"
    return ops


def _torch_draw(logits: torch.Tensor, u: torch.Tensor, T: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_next``'s torch path for a given uniform per row."""
    logp = (logits / T if T != 1.0 else logits).log_softmax(-1)
    cdf = logp.exp().cumsum(-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=logits.shape[1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
@pytest.mark.parametrize(("R", "V", "T", "threads"), [(7, 1000, 1.0, 1), (16, 8192, 0.7, 2), (4, 50_000, 1.3, 2)])
def test_sample_rows_matches_the_torch_draw(kind, R, V, T, threads):
    """Blocks of 64 with a partial last one, serial (<= 2^17 logits) and rows in parallel: the torch path's tokens
    for the same uniforms, its logprobs to 1e-5. Control: other uniforms give other tokens."""
    ops = _ops(kind)
    g = torch.Generator().manual_seed(R + V)
    logits = torch.randn(R, V, generator=g) * 3
    u = torch.rand(R, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tok, lp = ops.sample_rows(logits, u, T)
    finally:
        torch.set_num_threads(before)
    want_tok, want_lp = _torch_draw(logits, u, T)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    other, _ = ops.sample_rows(logits, (u + 0.37) % 1.0, T)  # negative control: the draw follows u
    assert (other != want_tok).float().mean() > 0.5


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
def test_sample_rows_never_picks_a_zero_mass_token(kind):
    """Masked (-inf) tokens, uniforms at 0 and just below 1, a distribution on the last token only, a near point mass:
    the first / last token with mass, as the torch path picks; the logprob of a point mass is 0."""
    ops = _ops(kind)
    V = 200
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    logits[:, :10] = float("-inf")  # rows 0-1: the first tokens have no mass
    logits[:, -10:] = float("-inf")  # the last ones neither
    logits[2] = float("-inf")
    logits[2, V - 1] = 0.0  # row 2: all mass on the last token (a zero-mass block before it)
    logits[3, 70] = 200.0  # row 3: everything else underflows
    u = torch.tensor([0.0, 1.0 - 2**-24, 0.5, 0.999, 0.3])
    tok, lp = ops.sample_rows(logits, u, 1.0)
    want_tok, want_lp = _torch_draw(logits, u, 1.0)
    assert torch.equal(tok, want_tok)
    assert tok[0] == 10 and tok[1] == V - 11 and tok[2] == V - 1 and tok[3] == 70
    assert torch.isfinite(logits.gather(1, tok[:, None])).all()
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    assert lp[2] == 0.0 and lp[3] == 0.0


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
def test_sample_rows_rejects_bad_input(kind):
    ops = _ops(kind)
    logits, u = torch.randn(3, 10), torch.rand(3)
    with pytest.raises(RuntimeError, match="logits"):
        ops.sample_rows(logits.double(), u, 1.0)
    with pytest.raises(RuntimeError, match="u"):
        ops.sample_rows(logits, u[:2], 1.0)
    with pytest.raises(RuntimeError, match="temperature"):
        ops.sample_rows(logits, u, 0.0)


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
def test_the_sampler_draws_through_the_fused_op(tmp_path, monkeypatch, kind):
    """``generate`` on a CPU calls the op once per token (counted) and samples what the torch path samples for the
    seed. Controls: top-k (a processed distribution) keeps the torch path; without the op the calls are 0."""
    model = load_pretrained(save_hf(hf_model("qwen2"), tmp_path))
    ops, calls = _ops(kind), []

    class Spy:  # the library, its draw counted
        name = f"align_cpu_{kind}"

        def __getattr__(self, attr):
            return getattr(ops, attr)

        def sample_rows(self, *args):
            calls.append(args[0].shape[0])
            return ops.sample_rows(*args)

    monkeypatch.setattr(native, "_kernel_ops", lambda: Spy())
    params = SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=7)
    prompts = [[1, 5, 9], [4, 2]]
    fused = native.generate(model, prompts, params)
    assert calls == [6] * 6
    monkeypatch.setattr(cpu_sample, "usable", lambda logits: False)
    plain = native.generate(model, prompts, params)
    assert len(calls) == 6
    assert [c.token_ids for c in fused] == [c.token_ids for c in plain]
    for a, b in zip(fused, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert a.sampled_logprobs == a.logprobs
    monkeypatch.undo()
    monkeypatch.setattr(native, "_kernel_ops", lambda: Spy())
    native.generate(model, prompts, SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=7, top_k=5))
    assert len(calls) == 6  # top-k: the torch path


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
def test_rows_without_a_finite_logit_give_an_in_range_token_and_a_nan_logprob(kind):
    """A row of NaN or -inf logits (a model gone non-finite): a token inside the vocabulary and a NaN logprob, so the
    run's non-finite checks see it downstream; a finite row beside it gets the torch path's draw (control)."""
    ops = _ops(kind)
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    logits[0], logits[1] = float("nan"), float("-inf")
    u = torch.tensor([0.5, 0.5, 0.5])
    tok, lp = ops.sample_rows(logits, u, 1.0)
    assert all(0 <= t < 100 for t in tok.tolist()) and lp[:2].isnan().all() and lp[2].isfinite()
    assert tok[2].item() == _torch_draw(logits[2:], u[2:], 1.0)[0].item()
