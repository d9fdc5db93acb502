"""fp32 linear layers on an AMD CPU through oneDNN instead of torch's BLAS (MKL): the forward GEMM and both of the
backward's (d input, d weight), with the same autograd contract as ``F.linear``.

Why: torch runs every fp32 ``F.linear`` / ``mm`` on the CPU through MKL's sgemm, and MKL does not give AMD CPUs its
best code. On the AMD EPYC (Zen 5, AVX-512) of docs/performance.md "Against TRL", one core at the 31M learner's
shapes (1136 tokens x 512 x 1408 and back) ran MKL's sgemm at ~90-95 GFLOP/s and oneDNN's matmul at ~180-220
(its AVX-512 kernels; d weight, read through transposed views, ~150): the learner's forward + backward GEMMs (~2/3
of their time) in about half the time. oneDNN is torch's own CPU library (``torch.ops.mkldnn``, the op the
native sampler's oneDNN layout already runs), read here on the tensors' own memory (no reorder, any strides).

oneDNN builds a kernel per new shape (a few ms): with a new token count every step the learner's forward + backward
still took 0.60x of MKL's CPU time (0.58x at a fixed count). Below ``MIN_MACS`` multiply-adds a GEMM stays on MKL
by default: there the build (~0.4 ms on this CPU) costs more than oneDNN saves (a 1800 x 16 x 48 GEMM of a new
shape: MKL 0.32 ms, oneDNN 0.59; 1800 x 64 x 256: 1.55 vs 1.27).

Numerics: the same products summed in another order (fp32 rounding, ~1e-7 relative; tests/test_cpu_linear.py holds
values and gradients to ``F.linear``'s). Deterministic for a given thread count, like MKL.

Where: ``linear(x, w, b)`` takes this path for float32 CPU tensors (plain ones: no tensor subclass such as FSDP's
DTensor) outside CPU autocast (bf16-mixed keeps ``F.linear``, which autocast casts) when ``backend()`` is
``"onednn"`` and the GEMM has ``MIN_MACS`` multiply-adds or more (any size when ``ALIGN_CPU_GEMM=onednn`` is set);
everything else is ``F.linear``. ``backend()``: ``ALIGN_CPU_GEMM=onednn|mkl`` when set, else
``"onednn"`` on an AMD (or Hygon) x86 CPU with oneDNN in torch, else ``"mkl"`` (torch's own path, unchanged: Intel
CPUs, where MKL runs its best code, were not measured against oneDNN here). Only stdlib and torch are imported.
"""

from __future__ import annotations

import functools
import logging
import os
import platform

import torch
import torch.nn.functional as F
from torch import Tensor

from align import cxx

BACKENDS = ("onednn", "mkl")
AMD_VENDORS = ("AuthenticAMD", "HygonGenuine")
MIN_MACS = 1 << 23  # the default backend's smallest oneDNN GEMM (M x N x K); smaller ones stay on MKL (see above)
log = logging.getLogger(__name__)


def cpu_vendor() -> str:
    """The CPU's vendor string (``vendor_id`` of /proc/cpuinfo: GenuineIntel, AuthenticAMD, ...), or ""."""
    return next((line.split(":", 1)[1].strip() for line in cxx.cpu_lines() if line.startswith("vendor_id")), "")


@functools.cache
def _auto() -> str:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    ok = x86 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    chosen = "onednn" if ok and cpu_vendor() in AMD_VENDORS else "mkl"
    if chosen == "onednn":  # said once per process: the floats differ from MKL's in the last bits
        log.info("fp32 CPU GEMMs on oneDNN (an AMD CPU, where MKL takes its AVX2 path); ALIGN_CPU_GEMM=mkl keeps MKL")
    return chosen


def _env() -> str:
    chosen = os.environ.get("ALIGN_CPU_GEMM", "").strip().lower()
    if chosen and chosen not in BACKENDS:
        raise ValueError(f"ALIGN_CPU_GEMM={chosen!r}: expected one of {BACKENDS}")
    return chosen


def backend() -> str:
    """``"onednn"`` or ``"mkl"``: ``ALIGN_CPU_GEMM`` when set (read on every call), else the CPU's default."""
    return _env() or _auto()


def _plain(t: Tensor | None) -> bool:
    return t is None or (
        type(t) in (Tensor, torch.nn.Parameter) and t.dtype == torch.float32 and t.device.type == "cpu"
    )


def usable(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether ``linear(x, weight, bias)`` runs on oneDNN."""
    if not (x.dim() >= 2 and weight.dim() == 2 and _plain(x) and _plain(weight) and _plain(bias)):
        return False
    forced = _env()  # ALIGN_CPU_GEMM=onednn: any size
    big = x.numel() * weight.shape[0] >= MIN_MACS
    return not torch.is_autocast_enabled("cpu") and (forced or _auto()) == "onednn" and (big or forced == "onednn")


def _gemm(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K) @ weight.T (weight (N, K), any strides) + bias, on oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _gemm(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()  # an expanded gradient (a sum's) has stride 0
        dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
        dx = _gemm(dy, weight.t()) if ctx.needs_input_grad[0] else None  # (..., K) = dy @ W
        dw = _wgrad(dy2, x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None  # (N, K) = dy.T @ x
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def _wgrad(dy: Tensor, x: Tensor) -> Tensor:
    """dy.T @ x (dy (M, N), x (M, K)): oneDNN copies its first operand, a transposed view, so the smaller of the two
    is transposed: x when N > K (then the (K, N) product is transposed back; the 31M learner's (1136, 1408, 512)
    8.7 vs 11.3 ms, the MoE bench's head (1024, 2048, 256) 7.5 vs 10.8)."""
    if dy.shape[1] <= x.shape[1]:
        return _gemm(dy.t(), x.t())
    return _gemm(x.t(), dy.t()).t().contiguous()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, on oneDNN where ``usable`` (then differentiable in x, weight and bias once:
    no double backward), else ``F.linear`` itself."""
    if not usable(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _Linear.apply(x, weight, bias)
    return _gemm(x, weight, bias)


def matmul_t(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b.T for a (M, K), b (N, K), any strides: on oneDNN where ``usable`` (a new tensor; ``out`` unused), else
    ``torch.matmul(a, b.T, out=out)`` (``out``: None, or a (M, N) tensor to write)."""
    if usable(a, b):
        return _gemm(a, b)
    return torch.matmul(a, b.T) if out is None else torch.matmul(a, b.T, out=out)


def add_matmul_t(acc: Tensor | None, a: Tensor, b: Tensor, shape: tuple[int, int]) -> Tensor:
    """acc + a @ b.T, a sum over blocks (a (M, K), b (N, K), acc (M, N) or None for a zero one of ``shape``): on
    oneDNN where ``usable`` (the first block's product itself, then each block added by the GEMM's own post-op: a new
    tensor each time), else ``acc.addmm_(a, b.T)`` in place (torch's path, unchanged)."""
    if usable(a, b):
        return _gemm(a, b) if acc is None else torch.ops.mkldnn._linear_pointwise.binary(a, acc, b, None, "add")
    acc = torch.zeros(shape, dtype=a.dtype, device=a.device) if acc is None else acc
    return acc.addmm_(a, b.T)
