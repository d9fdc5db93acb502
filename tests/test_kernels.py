"""Chunked token logprobs / entropy (torch path and Triton kernel) against plain log_softmax, values and gradients.

The Triton kernels run for real: on CUDA when present, else on CPU tensors under TRITON_INTERPRET=1 (set by
conftest.py before triton is imported). Shapes are tiny and do not divide the block: the interpreter's cost is
programs x loop iterations.
"""

import subprocess
import sys

import pytest
import torch

from align import kernels
from align.kernels import token_logprobs, token_logprobs_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = {"rtol": 1e-5, "atol": 2e-5}
BF16_GRAD_TOL = {"rtol": 1.6e-2, "atol": 1e-5}  # bf16 gradient: one rounding of an fp32-exact value
BF16_MATMUL_TOL = {"rtol": 1.6e-2, "atol": 1e-2}  # bf16 grad @ weight: one-ulp differences in the summands add up
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not kernels.triton_available(), reason="no triton")),
]
# (N, V, chunk): V not a multiple of the chunk; a chunk wider than V; 3 rows x 2.02 chunks.
SHAPES = [(5, 300, 128), (3, 129, 64), (4, 100, 256)]


def _logits(n, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(n, v, generator=g)).to(dtype).to(DEVICE)


def _targets(n, v, seed=1):
    return torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _run(fn, logits, targets, temperature, with_entropy=True, **kw):
    """Values and the gradient of a random weighted sum of logprobs and entropy (what a GRPO loss does)."""
    x = logits.detach().clone().requires_grad_()
    lp, ent = fn(x, targets, temperature, with_entropy=with_entropy, **kw)
    w = torch.linspace(-1.5, 2.0, lp.numel(), device=lp.device).reshape(lp.shape)
    loss = (w * lp).sum() + ((1.0 - w) * ent).sum() if with_entropy else (w * lp).sum()
    loss.backward()
    return lp, ent, x.grad


def _reference(x, t, temperature, with_entropy=True):
    return token_logprobs_reference(x, t, temperature, with_entropy)


def _close(a, b, **tol):
    return torch.allclose(a.float(), b.float(), **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,v,chunk", SHAPES)
def test_matches_log_softmax_forward_and_backward(backend, dtype, n, v, chunk):
    logits, targets = _logits(n, v, dtype), _targets(n, v)
    for temperature in (1.0, 0.7):
        lp, ent, grad = _run(token_logprobs, logits, targets, temperature, backend=backend, chunk_size=chunk)
        lp_ref, ent_ref, grad_ref = _run(_reference, logits, targets, temperature)
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (n,)
        assert grad.dtype == dtype and grad.shape == logits.shape
        torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
        torch.testing.assert_close(ent, ent_ref, **FP32_TOL)
        torch.testing.assert_close(grad, grad_ref, **(FP32_TOL if dtype == torch.float32 else BF16_GRAD_TOL))


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_controls(backend):
    """Each check above fails when one thing is off: temperature, target, the entropy term of the gradient."""
    n, v, chunk, temperature = 5, 300, 128, 0.7
    logits, targets = _logits(n, v, torch.float32), _targets(n, v)
    lp, ent, grad = _run(token_logprobs, logits, targets, temperature, backend=backend, chunk_size=chunk)
    lp_ref, ent_ref, grad_ref = _run(_reference, logits, targets, temperature)
    assert _close(lp, lp_ref, **FP32_TOL) and _close(ent, ent_ref, **FP32_TOL) and _close(grad, grad_ref, **FP32_TOL)

    lp_t, ent_t, grad_t = _run(_reference, logits, targets, temperature * 1.001)
    assert not _close(lp, lp_t, **FP32_TOL) and not _close(ent, ent_t, **FP32_TOL)
    assert not _close(grad, grad_t, **FP32_TOL)
    lp_s, _, grad_s = _run(_reference, logits, (targets + 1) % v, temperature)
    assert not _close(lp, lp_s, **FP32_TOL) and not _close(grad, grad_s, **FP32_TOL)
    _, _, grad_no_entropy = _run(_reference, logits, targets, temperature, with_entropy=False)
    assert not _close(grad, grad_no_entropy, **FP32_TOL)
    # one logit nudged by less than a bf16 step is seen by the fp32 check
    nudged = logits.clone()
    nudged[2, 7] += 0.01
    _lp_n, ent_n, _ = _run(_reference, nudged, targets, temperature)
    assert not _close(ent, ent_n, **FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_entropy(backend):
    logits, targets = _logits(4, 200, torch.float32), _targets(4, 200)
    lp, ent, grad = _run(token_logprobs, logits, targets, 0.9, with_entropy=False, backend=backend, chunk_size=64)
    lp_ref, _, grad_ref = _run(_reference, logits, targets, 0.9, with_entropy=False)
    assert ent is None
    torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_batch_dims(backend):
    """Logits sliced out of a wider tensor (row stride != V) and (B, T, V) inputs with (B, T) targets."""
    wide = _logits(6, 260, torch.float32)
    logits, targets = wide[:, :250], _targets(6, 250)
    assert not logits.is_contiguous()
    lp, ent, grad = _run(token_logprobs, logits, targets, 1.0, backend=backend, chunk_size=64)
    lp_ref, ent_ref, grad_ref = _run(_reference, logits, targets, 1.0)
    torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
    torch.testing.assert_close(ent, ent_ref, **FP32_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_TOL)

    logits3, targets3 = logits.reshape(2, 3, 250), targets.reshape(2, 3)
    lp3, ent3, grad3 = _run(token_logprobs, logits3, targets3, 1.0, backend=backend, chunk_size=64)
    assert lp3.shape == ent3.shape == (2, 3)
    torch.testing.assert_close(lp3.reshape(-1), lp)
    torch.testing.assert_close(grad3.reshape(6, 250), grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_vocabulary(backend):
    """-inf logits (banned tokens) drop out: finite results, zero gradient there, equal to the reference with the
    banned logits at -1e4 instead (whose softmax weight underflows to exactly 0). Row 0 has its whole first chunk
    banned, so the running max is still -inf after one full chunk."""
    n, v, chunk = 3, 200, 64
    logits, targets = _logits(n, v, torch.float32), _targets(n, v)
    banned = torch.zeros(n, v, dtype=torch.bool, device=DEVICE)
    banned[0, :chunk] = True
    banned[1, ::3] = True
    banned[torch.arange(n), targets] = False
    masked = logits.masked_fill(banned, float("-inf"))
    lp, ent, grad = _run(token_logprobs, masked, targets, 0.8, backend=backend, chunk_size=chunk)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    assert (grad[banned] == 0).all()
    lp_ref, ent_ref, grad_ref = _run(_reference, logits.masked_fill(banned, -1e4), targets, 0.8)
    torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
    torch.testing.assert_close(ent, ent_ref, **FP32_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_TOL)
    _, ent_unmasked, _ = _run(_reference, logits, targets, 0.8)  # negative control: the mask matters
    assert not _close(ent, ent_unmasked, **FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_blocks_and_no_rows(backend, monkeypatch):
    """The torch path's row blocking (TORCH_ROWS) with a last partial block; zero rows give empty results."""
    monkeypatch.setattr(kernels, "TORCH_ROWS", 2)
    logits, targets = _logits(5, 150, torch.float32), _targets(5, 150)
    lp, ent, grad = _run(token_logprobs, logits, targets, 0.7, backend=backend, chunk_size=64)
    lp_ref, ent_ref, grad_ref = _run(_reference, logits, targets, 0.7)
    torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
    torch.testing.assert_close(ent, ent_ref, **FP32_TOL)
    torch.testing.assert_close(grad, grad_ref, **FP32_TOL)
    lp0, ent0, grad0 = _run(token_logprobs, logits[:0], targets[:0], 0.7, backend=backend)
    assert lp0.shape == ent0.shape == (0,) and lp0.dtype == torch.float32 and grad0.shape == (0, 150)


def test_backend_selection_and_errors(monkeypatch):
    x, t = torch.randn(2, 10), torch.tensor([1, 2])
    assert kernels._resolve_backend(x, "auto") == "torch"  # CPU tensors take the torch path
    with pytest.raises(ValueError, match="backend"):
        token_logprobs(x, t, backend="cuda")
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(x, torch.tensor([1, 10]))
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(x, t.int())
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(x, t, 0.0)
    with pytest.raises(ValueError, match="weight"):
        kernels.linear_token_logprobs(torch.randn(2, 4), torch.randn(10, 5), t)
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton"):
        token_logprobs(x, t, backend="triton")
    lp, _ent = token_logprobs(x, t, backend="auto")
    torch.testing.assert_close(lp, token_logprobs_reference(x, t)[0], **FP32_TOL)


def test_import_is_lazy():
    """Importing align.kernels imports no triton and touches no device."""
    code = "import sys, align.kernels; assert 'triton' not in sys.modules, 'triton imported at import time'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _run_linear(fn, hidden, weight, targets, temperature, **kw):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    lp, ent = fn(h, w, targets, temperature, **kw)
    scale = torch.linspace(-1.5, 2.0, lp.numel(), device=lp.device)
    ((scale * lp).sum() + ((1.0 - scale) * ent).sum()).backward()
    return lp, ent, h.grad, w.grad


def _linear_reference(hidden, weight, targets, temperature):
    return token_logprobs_reference(hidden @ weight.T, targets, temperature)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_matmul_then_log_softmax(backend, dtype, monkeypatch):
    """Fused final linear layer: 2-token blocks (last one partial) x 64-column chunks of V = 130."""
    monkeypatch.setattr(kernels, "LINEAR_ROWS", 2)
    n, d, v = 5, 16, 130
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, d, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(v, d, generator=g) / 2).to(dtype).to(DEVICE)
    targets = _targets(n, v)
    kw = {"backend": backend, "chunk_size": 64}
    lp, ent, g_h, g_w = _run_linear(kernels.linear_token_logprobs, hidden, weight, targets, 0.7, **kw)
    lp_ref, ent_ref, g_h_ref, g_w_ref = _run_linear(_linear_reference, hidden, weight, targets, 0.7)
    assert g_h.dtype == g_w.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else BF16_MATMUL_TOL
    torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
    torch.testing.assert_close(ent, ent_ref, **FP32_TOL)
    torch.testing.assert_close(g_h, g_h_ref, **tol)
    torch.testing.assert_close(g_w, g_w_ref, **tol)
    # negative control: the weight gradient is checked tightly enough to see one wrong target
    _, _, _, g_w_bad = _run_linear(_linear_reference, hidden, weight, (targets + 1) % v, 0.7)
    assert not _close(g_w, g_w_bad, **tol)


def test_linear_frozen_weight():
    """A weight that needs no gradient gets none; the hidden gradient is unchanged."""
    hidden, weight, targets = torch.randn(3, 8), torch.randn(40, 8), torch.tensor([0, 5, 39])
    h = hidden.clone().requires_grad_()
    lp, ent = kernels.linear_token_logprobs(h, weight, targets, backend="torch", chunk_size=16)
    (lp.sum() + ent.sum()).backward()
    h_ref = hidden.clone().requires_grad_()
    lp_ref, ent_ref = token_logprobs_reference(h_ref @ weight.T, targets)
    (lp_ref.sum() + ent_ref.sum()).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, **FP32_TOL)


GEMMS = ["mkl", *(["onednn"] if torch.backends.mkldnn.is_available() else [])]  # align.cpu_linear's backends


@pytest.mark.parametrize("gemm", GEMMS)
def test_linear_backward_reuses_the_first_logits_block(monkeypatch, gemm):
    """Forward leaves block 0's logits in its buffer and backward starts from them: one (R, V) product fewer in
    backward, the same gradients bit for bit as a backward that recomputes every block (a second backward with
    retain_graph recomputes, since the first wrote its gradient over the kept block). Control: the product count.
    On either GEMM backend (``align.cpu_linear``: oneDNN makes each block anew, MKL writes one buffer)."""
    monkeypatch.setenv("ALIGN_CPU_GEMM", gemm)
    monkeypatch.setattr(kernels, "LINEAR_ROWS", 4)
    n, d, v = 10, 8, 40  # blocks of 4, 4, 2 rows
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = torch.randn(v, d, generator=g).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    logits_products = []
    real_logits = kernels._logits

    def counting(h, w, buf):
        logits_products.append(h.shape[0])
        return real_logits(h, w, buf)

    monkeypatch.setattr(kernels, "_logits", counting)
    lp, ent = kernels.linear_token_logprobs(hidden, weight, targets, backend="torch", chunk_size=16)
    assert logits_products == [2, 4, 4]  # forward: last block first, block 0 last
    loss = (lp * torch.linspace(0.5, 1.5, n)).sum() + 0.3 * ent.sum()
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    assert logits_products[3:] == [4, 2]  # backward: blocks 1 and 2 recomputed, block 0 reused
    second = torch.autograd.grad(loss, (hidden, weight))
    assert logits_products[5:] == [4, 4, 2]  # the kept block was consumed: everything recomputed
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    h_ref = hidden.detach().clone().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    lp_ref, ent_ref = token_logprobs_reference(h_ref @ w_ref.T, targets)
    ref = torch.autograd.grad((lp_ref * torch.linspace(0.5, 1.5, n)).sum() + 0.3 * ent_ref.sum(), (h_ref, w_ref))
    for a, b in zip(first, ref):
        torch.testing.assert_close(a, b, **FP32_TOL)


RMS_GRAD_RTOL = 1e-6  # fp32: the fused backward vs autograd through F.rms_norm's composite, max |diff| / max |grad|


def test_rms_norm_matches_f_rms_norm_forward_and_backward(monkeypatch):
    """The torch path (no fused CPU kernel: ``align.fused_cpu`` off; tests/test_fused_cpu.py tests that one)."""
    import torch.nn.functional as F

    from align import fused_cpu

    monkeypatch.setattr(fused_cpu, "usable", lambda *t: False)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 512, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(512, generator=g)).requires_grad_()
    dy = torch.randn(3, 50, 512, generator=g)
    want = F.rms_norm(x, w.shape, w, 1e-6)
    got = kernels.rms_norm(x, w, 1e-6)
    assert torch.equal(got, want)  # the same floats forward
    grads = [torch.autograd.grad(y, (x, w), dy) for y in (want, got)]
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= RMS_GRAD_RTOL * a.abs().max()
    # negative control: the backward without the normaliser's own term (d r / d x) is far off
    r = torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (dy * w.detach() * r - grads[0][0]).abs().max() > 100 * RMS_GRAD_RTOL * grads[0][0].abs().max()
    with torch.no_grad():  # no autograd: F.rms_norm itself
        assert torch.equal(kernels.rms_norm(x, w, 1e-6), want)
