"""align.fused_cpu: the fused RMSNorm and SwiGLU kernels against the torch composites they replace (forward and
backward, with negative controls), the torch fallback when they are off, and the callers (``kernels.rms_norm``,
``moe.GroupedExperts``) equal with and without them. This machine has a C++ compiler: the kernels must build."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from align import fused_cpu, kernels, moe

TOL = 2e-6  # fp32: max |diff| / max |reference| (the kernels' exp is Cephes', not torch's: last-bit differences)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def test_kernels_build_and_load_here():
    assert fused_cpu.load() is not None, fused_cpu._state.get("why")


def test_swiglu_forward_and_backward_match_torch():
    ops = fused_cpu.load()
    g = torch.Generator().manual_seed(0)
    h = (4 * torch.randn(300, 2 * 40, generator=g)).requires_grad_()  # F = 40: a vector tail on AVX-512
    ws = torch.rand(300, generator=g).requires_grad_()
    ga = torch.randn(300, 40, generator=g)
    gate, up = h.chunk(2, dim=-1)
    want = F.silu(gate) * up * ws[:, None]
    got = ops.swiglu_fwd(h.detach(), ws.detach())
    assert rel(got, want) <= TOL
    dh, dws = torch.autograd.grad(want, (h, ws), ga)
    aw, gw, gh = ops.swiglu_bwd(h.detach(), ws.detach(), ga)
    assert rel(aw, want) <= TOL  # the weighted activation again (the down GEMM's weight gradient)
    assert rel(gh, dh) <= TOL and rel(gw * ws.detach(), dws * ws.detach()) <= TOL
    # negative controls: d gate without silu's own derivative term, d ws weighted twice
    s = torch.sigmoid(gate.detach())
    wrong = ga * ws.detach()[:, None] * up.detach() * s
    assert rel(wrong, dh[:, :40]) > 100 * TOL
    assert rel(gw * ws.detach(), dws) > 100 * TOL


def test_rms_norm_forward_and_backward_match_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, 200, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(200, generator=g)).requires_grad_()
    dy = torch.randn(3, 50, 200, generator=g)
    want = F.rms_norm(x, w.shape, w, 1e-6)
    got = kernels.rms_norm(x, w, 1e-6)  # the fused kernel: it loads here
    assert got.grad_fn is not None and "RMSNorm" in type(got.grad_fn).__name__
    assert torch.equal(got, want)  # F.rms_norm's floats forward (its reduction for r, then (x r) w)
    grads = torch.autograd.grad(want, (x, w), dy), torch.autograd.grad(got, (x, w), dy)
    for a, b in zip(*grads):
        assert rel(b, a) <= TOL
    with torch.no_grad():
        assert torch.equal(kernels.rms_norm(x, w, 1e-6), want)
    # negative control: the backward without the normaliser's own term (d r / d x) is far off
    r = torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel(dy * w.detach() * r, grads[1][0]) > 100 * TOL


def test_grouped_experts_same_with_and_without_the_kernels(monkeypatch):
    """The MoE Function's forward and backward (input, routing weights, both stacked weights) fused == torch."""
    if not moe._grouped_mm_usable(torch.zeros(1)):
        raise AssertionError("torch >= 2.11 runs the CPU grouped GEMM; this test needs it")
    g = torch.Generator().manual_seed(2)
    N, E, F_, X, k = 64, 32, 24, 6, 2
    x = torch.randn(N, E, generator=g, requires_grad=True)
    idx = torch.rand(N, X, generator=g).topk(k, dim=-1).indices
    w = torch.rand(N, k, generator=g, requires_grad=True)
    gu = (0.3 * torch.randn(X, 2 * F_, E, generator=g)).requires_grad_()
    dn = (0.3 * torch.randn(X, E, F_, generator=g)).requires_grad_()
    dy = torch.randn(N, E, generator=g)

    def run():
        y = moe.GroupedExperts.apply(x, idx, w, gu, dn)
        return [y, *torch.autograd.grad(y, (x, w, gu, dn), dy)]

    fused = run()
    monkeypatch.setattr(fused_cpu, "usable", lambda *t: False)
    plain = run()
    for a, b in zip(fused, plain):
        assert rel(a, b) <= 1e-5
    assert rel(fused[2], plain[2].flip(-1)) > 1e-2  # negative control: the routing weights' gradient per slot


def test_off_switch_falls_back_and_says_why():
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import torch; from align import fused_cpu, kernels\n"
        "x = torch.randn(4, 8, requires_grad=True); w = torch.ones(8)\n"
        "y = kernels.rms_norm(x, w, 1e-6); y.sum().backward()\n"
        "print(fused_cpu.load() is None, type(y.grad_fn).__name__)\n"
    )
    env = {**os.environ, "ALIGN_FUSED_CPU": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "_RMSNormBackward"]
    assert out.stderr.count("fused CPU kernels (RMSNorm, RoPE, SwiGLU): off (disabled by ALIGN_FUSED_CPU=0)") == 1


def test_rope_forward_and_backward_match_torch(monkeypatch):
    from align.attention import apply_rope

    g = torch.Generator().manual_seed(3)
    B, T, H, D = 2, 9, 3, 16
    rows = torch.randn(B, T, H, D, generator=g, requires_grad=True)  # the projection's layout; RoPE sees (B, H, T, D)
    ang = torch.rand(B, T, D // 2, generator=g) * 6
    cos = torch.cat((ang.cos(), ang.cos()), -1)[:, None]
    sin = torch.cat((-ang.sin(), ang.sin()), -1)[:, None]
    dy = torch.randn(B, H, T, D, generator=g)
    got = apply_rope(rows.transpose(1, 2), cos, sin)
    assert "Rope" in type(got.grad_fn).__name__
    gx = torch.autograd.grad(got, rows, dy)[0]
    with monkeypatch.context() as m:
        m.setattr(fused_cpu, "usable", lambda *t: False)
        want = apply_rope(rows.transpose(1, 2), cos, sin)
        wx = torch.autograd.grad(want, rows, dy)[0]
    assert torch.equal(got, want) and rel(gx, wx) <= TOL  # torch's floats forward (no FMA contraction)
    with torch.no_grad():
        assert torch.equal(apply_rope(rows.transpose(1, 2), cos, sin), want)
    # negative control: the backward as the forward (swap(dy) s instead of swap(dy s)) is far off
    wrong = fused_cpu.load().rope(dy.transpose(1, 2).reshape(B * T, H, D), *fused_cpu._tables(cos, sin), False)
    assert rel(wrong.view(B, T, H, D), wx) > 100 * TOL


GEMM_TOL = 1e-5  # oneDNN's GEMM sums in its own order: max |diff| / max |reference|


def test_grouped_gemms_match_per_group_products():
    ops, g = fused_cpu.load(), torch.Generator().manual_seed(6)
    a, c = torch.randn(1001, 37, generator=g), torch.randn(1001, 19, generator=g)
    for ends in ([13, 13, 600, 1001], [0, 0, 1, 1001], [1001, 1001, 1001, 1001], [5, 300, 301, 990]):
        offs, starts = torch.tensor(ends, dtype=torch.int32), [0, *ends[:-1]]
        b = torch.randn(4, 19, 37, generator=g).transpose(1, 2)  # (X, K, N) transposed, as the forward reads it
        rows = ops.gmm_rows(a, b, offs)
        want = torch.zeros(1001, 19)
        for i, (s, e) in enumerate(zip(starts, ends)):
            want[s:e] = a[s:e] @ b[i]
        assert rel(rows, want) <= GEMM_TOL, ends  # rows after the last group (990: 11 of them) are zero
        wgrad = ops.gmm_wgrad(a, c, offs)
        want = torch.stack([a[s:e].t() @ c[s:e] for s, e in zip(starts, ends)])
        assert rel(wgrad, want) <= GEMM_TOL, ends  # an empty group's gradient is zero
    b = torch.randn(4, 37, 19, generator=g)
    offs = torch.tensor([300, 600, 900, 1001], dtype=torch.int32)
    shifted = torch.cat([a[:1] @ b[0], ops.gmm_rows(a, b, offs)[:-1]])  # negative control: off by one row
    assert rel(shifted, ops.gmm_rows(a, b, offs)) > 0.1
    for bad in ([13, 12, 600, 1001], [13, 600, 1001, 1002], [-1, 5, 6, 7]):  # falling, past M, negative: refused
        try:
            ops.gmm_rows(a, b, torch.tensor(bad, dtype=torch.int32))
        except RuntimeError as e:
            assert "group ends" in str(e)
        else:
            raise AssertionError(f"offs {bad} accepted")
