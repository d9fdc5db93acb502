"""align.cpu_linear: fp32 CPU linear layers on oneDNN (AMD CPUs), values and gradients held to F.linear's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from align import cpu_linear
from align.model import ModelConfig, Transformer

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
    reason="torch built without oneDNN",
)
TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32, another summation order


@pytest.fixture
def gemm_calls(monkeypatch):
    """Forces the oneDNN backend and records the shape of every oneDNN GEMM's input."""
    monkeypatch.setenv("ALIGN_CPU_GEMM", "onednn")
    calls = []
    real = cpu_linear._gemm

    def counting(x, w, b=None):
        calls.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(cpu_linear, "_gemm", counting)
    return calls


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24), (1, 1, 24)])
def test_linear_matches_f_linear(gemm_calls, bias, shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g), torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    args = (x, w, b) if bias else (x, w)
    out, grads = _grads(cpu_linear.linear, *args)
    ref, ref_grads = _grads(F.linear, *args)
    torch.testing.assert_close(out, ref, **TOL)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, **TOL)
    assert len(gemm_calls) == 3  # forward, d input, d weight: all three on oneDNN
    wrong, wrong_grads = _grads(F.linear, x, w.flip(0), *args[2:])  # negative control: the weight's rows permuted
    assert not torch.allclose(out, wrong, **TOL) and not torch.allclose(grads[0], wrong_grads[0], **TOL)


def test_strided_input_and_frozen_weight(gemm_calls):
    """A non-contiguous input (a slice of a wider tensor) and a weight that needs no gradient: no d weight GEMM."""
    g = torch.Generator().manual_seed(1)
    wide, w = torch.randn(9, 40, generator=g), torch.randn(16, 24, generator=g)
    x = wide[:, 8:32].clone().requires_grad_()
    xs = torch.zeros(9, 40).index_copy(1, torch.arange(8, 32), x.detach())[:, 8:32].requires_grad_()
    cpu_linear.linear(xs, w).square().sum().backward()
    F.linear(x, w).square().sum().backward()
    torch.testing.assert_close(xs.grad, x.grad, **TOL)
    assert len(gemm_calls) == 2 and w.grad is None


def test_expanded_gradient():
    """A sum's gradient reaches backward expanded (stride 0)."""
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALIGN_CPU_GEMM", "onednn")
        cpu_linear.linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 5) @ w.detach(), **TOL)
    torch.testing.assert_close(w.grad, torch.ones(5, 4) @ x.detach(), **TOL)


def test_torch_path_where_not_usable(gemm_calls, monkeypatch):
    """bf16, CPU autocast and ALIGN_CPU_GEMM=mkl run F.linear itself."""
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert torch.equal(cpu_linear.linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_linear.linear(x, w).dtype == torch.bfloat16
    monkeypatch.setenv("ALIGN_CPU_GEMM", "mkl")
    assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
    assert gemm_calls == []
    monkeypatch.setenv("ALIGN_CPU_GEMM", "blas")
    with pytest.raises(ValueError, match="ALIGN_CPU_GEMM"):
        cpu_linear.backend()


def test_default_is_onednn_on_amd_only(monkeypatch):
    monkeypatch.delenv("ALIGN_CPU_GEMM", raising=False)
    auto = cpu_linear._auto.__wrapped__
    for vendor, expected in (("AuthenticAMD", "onednn"), ("HygonGenuine", "onednn"), ("GenuineIntel", "mkl")):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda v=vendor: v)
        assert auto() == (expected if cpu_linear.platform.machine().lower() in ("x86_64", "amd64") else "mkl")


def test_the_default_backend_keeps_gemms_below_min_macs_on_mkl(gemm_calls, monkeypatch):
    """Unforced (no ALIGN_CPU_GEMM) on oneDNN's CPUs: a GEMM of MIN_MACS multiply-adds or more runs oneDNN, one of
    fewer stays on F.linear itself (bit for bit), where oneDNN's per-shape build costs more than it saves."""
    monkeypatch.delenv("ALIGN_CPU_GEMM")
    monkeypatch.setattr(cpu_linear, "_auto", lambda: "onednn")
    w = torch.randn(64, 64)
    small, large = torch.randn(cpu_linear.MIN_MACS // 64**2 - 1, 64), torch.randn(cpu_linear.MIN_MACS // 64**2, 64)
    assert torch.equal(cpu_linear.linear(small, w), F.linear(small, w)) and gemm_calls == []
    torch.testing.assert_close(cpu_linear.linear(large, w), F.linear(large, w), **TOL)
    assert gemm_calls == [tuple(large.shape)]
    monkeypatch.setenv("ALIGN_CPU_GEMM", "onednn")  # forced: any size
    cpu_linear.linear(small, w)
    assert gemm_calls[-1] == tuple(small.shape)


def test_model_step_on_onednn_matches_mkl(gemm_calls, monkeypatch):
    """The model's linear layers (and the fused head, ``align.kernels``) take the oneDNN path: one training forward +
    backward gives MKL's loss and gradients to fp32 rounding."""
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True)  # fmt: skip
    model = Transformer(cfg).init_weights(seed=0)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    from align.kernels import linear_token_logprobs

    def run(backend):
        monkeypatch.setenv("ALIGN_CPU_GEMM", backend)
        model.zero_grad(set_to_none=True)
        hidden = model(ids[:, :-1], return_hidden=True).flatten(0, 1)
        lp, ent = linear_token_logprobs(hidden, model.lm_head.weight, ids[:, 1:].flatten(), backend="torch")
        loss = -(lp.sum() + 0.1 * ent.sum())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_mkl, grads_mkl = run("mkl")
    assert gemm_calls == []
    loss_dnn, grads_dnn = run("onednn")
    assert len(gemm_calls) == 2 * 7 * 3 + 3  # 7 linears per layer x (forward, d input, d weight) + the head's 3
    torch.testing.assert_close(loss_dnn, loss_mkl, **TOL)
    for n, g in grads_mkl.items():
        torch.testing.assert_close(grads_dnn[n], g, rtol=1e-4, atol=1e-5, msg=n)
    with torch.no_grad():  # negative control: one weight moved by 1e-3 moves the gradients past the tolerance
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    _, moved = run("onednn")
    assert any(not torch.allclose(moved[n], g, rtol=1e-4, atol=1e-5) for n, g in grads_mkl.items())
