"""Memory-efficient token logprobs and entropy: Triton kernels beside the torch functions they must match.

GRPO needs, for every completion token, the logprob of the sampled token and (for logging / an entropy bonus)
the entropy of the policy, both under the sampler's basis ``softmax(logits / T)``. The plain way,
``log_softmax(logits.float() / T)`` then gather, materialises several (N, V) float32 tensors in the forward and
the backward; at V = 151936 (Qwen) that is the peak-memory problem (TRL PR 2773, Liger-Kernel PR 953).

Here both quantities come from one streaming pass over the vocabulary in chunks with an online log-sum-exp
(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"). Per row x = logits / T we keep

    m = running max,  d = sum exp(x - m),  s = sum exp(x - m) * x
    lse = m + log d,   logprob = x[target] - lse,   entropy = lse - s / d   (= -sum p log p)

and save only lse and entropy (N floats each) for the backward, which recomputes p = exp(x - lse) chunk by chunk:

    d loss / d x_j = g (1[j = target] - p_j) + h p_j (S - x_j),   S = sum_k p_k x_k = lse - entropy

for g = d loss / d logprob and h = d loss / d entropy, then divides by T (chain rule of logits / T). The only
(N, V) tensor ever allocated is the gradient of the logits itself, in the logits' dtype.

Backends, selected in one place (``_resolve_backend``; implementations in ``_IMPLS``):
  "triton"     one program per row, looping over BLOCK_V-wide vocabulary tiles (CUDA; on CPU under TRITON_INTERPRET=1)
  "torch"      the same chunked algorithm in plain torch (CPU, or where Triton is missing)
  "reference"  plain log_softmax + gather + entropy, the definition the other two are tested against
  "auto"       triton when the logits are on CUDA and triton imports, else torch

-inf logits (banned tokens) are allowed: their p log p and gradient are 0, not nan.
``linear_token_logprobs`` also fuses the final linear layer (hidden @ weight.T, LINEAR_ROWS tokens at a time), so the
(N, V) logits are never whole either.

Shapes: N = tokens (rows), V = vocabulary, D = hidden size. Triton is imported lazily on first use, never at import.
"""

from __future__ import annotations

import functools

import torch

from align import cpu_linear, fused_cpu

TORCH_CHUNK = 8192  # vocabulary columns per step of the torch path
TORCH_ROWS = 256  # rows per step of the torch path: (256, 8192) float32 work buffers, 8 MiB each, whatever N and V
TRITON_BLOCK = 4096  # vocabulary tile of one Triton program iteration
LINEAR_ROWS = 1024  # tokens per (R, V) logits block of linear_token_logprobs (311 MB at V = 151936 in bf16)

tl = None  # triton.language, bound by _triton_kernels() on first use so that importing this module stays cheap


# ---------------------------------------------------------------------------------------------------------------------
# Reference: the definition.


def token_logprobs_reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain ``log_softmax(logits.float() / T)`` gathered at ``targets``, and the entropy of that softmax."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V) float32
    logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None  # (N,)
    return logprobs, entropy


# ---------------------------------------------------------------------------------------------------------------------
# Torch path: chunked over the vocabulary, online log-sum-exp.


def _scaled_chunk(logits: torch.Tensor, start: int, stop: int, temperature: float, buf: torch.Tensor) -> torch.Tensor:
    """Columns [start, stop) of logits as float32 divided by T, exactly as the reference computes them.

    Written into buf (a preallocated (R, C) float32 work buffer: a fresh allocation per chunk costs page faults on
    CPU), or a view of the logits when they are float32 and T = 1."""
    chunk = logits[:, start:stop]  # (R, C)
    if chunk.dtype == torch.float32 and temperature == 1.0:
        return chunk
    x = buf[: chunk.shape[0], : chunk.shape[1]].copy_(chunk)
    return x.div_(temperature) if temperature != 1.0 else x


def _torch_forward(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, chunk: int, bufs: list
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(logprobs, entropy, lse, starts of the chunks that hold a -inf logit) of a block of R rows."""
    R, V = logits.shape
    m = torch.full((R,), float("-inf"), device=logits.device)  # running max
    d = torch.zeros(R, device=logits.device)  # sum exp(x - m)
    s = torch.zeros(R, device=logits.device)  # sum exp(x - m) * x
    masked = []
    for start in range(0, V, chunk):
        stop = min(start + chunk, V)
        x = _scaled_chunk(logits, start, stop, temperature, bufs[0])  # (R, C)
        m_new = torch.maximum(m, x.amax(dim=1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row that is -inf so far must not give nan
        scale = torch.exp(m - m_safe)
        e = torch.sub(x, m_safe.unsqueeze(1), out=bufs[1][:R, : stop - start]).exp_()  # (R, C)
        d = d * scale + e.sum(dim=1)
        if with_entropy:
            ex = e.mul_(x).sum(dim=1)
            if ex.isnan().any():  # 0 * -inf where a logit is -inf (its p log p -> 0): recount, remember for backward
                ex = e.nansum(dim=1)
                masked.append(start)
            s = s * scale + ex
        m = m_new
    lse = m + torch.log(d)
    x_target = logits.gather(1, targets.unsqueeze(1)).squeeze(1).float()
    logprobs = (x_target / temperature if temperature != 1.0 else x_target) - lse
    entropy = lse - s / d if with_entropy else torch.zeros_like(lse)
    return logprobs, entropy, lse, masked


def _torch_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    chunk: int,
    masked: list[int],
    grad: torch.Tensor,
    bufs: list,
) -> None:
    """Write the gradient w.r.t. a block of R rows of logits into grad (same shape), streaming over the vocabulary.

    d/dlogits = p (c - h' x) + g' 1[target] with g' = g / T, h' = h / T, c = h' S - g' (S = sum p x = lse - entropy)."""
    R, V = logits.shape
    g = grad_logprobs.float().unsqueeze(1) / temperature  # (R, 1)
    if grad_entropy is not None:
        h = grad_entropy.float().unsqueeze(1) / temperature  # (R, 1)
        c = h * (lse - entropy).unsqueeze(1) - g  # (R, 1)
    for start in range(0, V, chunk):
        stop = min(start + chunk, V)
        x = _scaled_chunk(logits, start, stop, temperature, bufs[0])  # (R, C)
        p = torch.sub(x, lse.unsqueeze(1), out=bufs[1][:R, : stop - start]).exp_()  # (R, C)
        out = grad[:, start:stop]  # (R, C), written once, rounded once to the logits' dtype
        if grad_entropy is not None:
            q = torch.addcmul(c, x, h, value=-1.0, out=bufs[2][:R, : stop - start])  # (R, C) = c - h' x
            torch.mul(q, p, out=out)
            if start in masked:  # p (c - h' x) = 0 * inf where x = -inf: that term is 0
                out.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        else:
            q = g.neg().expand(R, stop - start)
            torch.mul(q, p, out=out)
        # the target column, where it falls in this chunk, gets p q + g' (computed in float32; other rows rewrite
        # what they hold: a scatter with no host sync)
        col = (targets - start).unsqueeze(1)  # (R, 1)
        idx = col.clamp(0, stop - start - 1)
        at_target = p.gather(1, idx) * q.gather(1, idx) + g
        out.scatter_(1, idx, torch.where(col == idx, at_target, out.gather(1, idx).float()).to(out.dtype))


def _work_buffers(logits: torch.Tensor, chunk: int, k: int) -> list:
    shape = (min(TORCH_ROWS, logits.shape[0]), min(chunk, logits.shape[1]))  # (R, C)
    return [torch.empty(shape, device=logits.device) for _ in range(k)]


def _torch_fwd(logits, targets, temperature, with_entropy, chunk):
    """Blocks of TORCH_ROWS rows x chunk columns, so the temporaries are bounded whatever N and V."""
    bufs = _work_buffers(logits, chunk, 2)
    blocks = [
        _torch_forward(logits[r : r + TORCH_ROWS], targets[r : r + TORCH_ROWS], temperature, with_entropy, chunk, bufs)
        for r in range(0, logits.shape[0], TORCH_ROWS)
    ]
    if not blocks:  # no rows
        return (*(torch.zeros(0, device=logits.device) for _ in range(3)), [])
    logprobs, entropy, lse = (torch.cat(parts) for parts in list(zip(*blocks))[:3])
    return logprobs, entropy, lse, [block[3] for block in blocks]


def _torch_bwd(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, chunk, masked, out=None):
    """``out``: where to write the gradient; may be ``logits`` itself (each chunk is read before it is written)."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if out is None else out  # (N, V)
    bufs = _work_buffers(logits, chunk, 3)
    for i, r in enumerate(range(0, logits.shape[0], TORCH_ROWS)):
        rows = slice(r, r + TORCH_ROWS)
        g_ent = grad_entropy[rows] if grad_entropy is not None else None
        _torch_backward(
            logits[rows],
            targets[rows],
            lse[rows],
            entropy[rows],
            grad_logprobs[rows],
            g_ent,
            temperature,
            chunk,
            masked[i],
            grad[rows],
            bufs,
        )
    return grad


# ---------------------------------------------------------------------------------------------------------------------
# Triton path: the same algorithm, one program per row. Plain functions here, wrapped by triton.jit on first use.


def _fwd_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    temperature,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride overflows int32 at N * V > 2^31
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    s = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - m_safe)
        e = tl.exp(x - m_safe)
        d = d * scale + tl.sum(e, axis=0)
        if WITH_ENTROPY:
            s = s * scale + tl.sum(e * tl.where(e > 0.0, x, 0.0), axis=0)  # p log p -> 0 where x = -inf
        m = m_new
    lse = m + tl.log(d)
    target = tl.load(targets_ptr + row)
    x_target = tl.load(base + target).to(tl.float32) / temperature
    tl.store(logprobs_ptr + row, x_target - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, lse - s / d)


def _bwd_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    grad_ptr,
    stride_grad_row,
    V,
    temperature,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    grad_base = grad_ptr + row * stride_grad_row
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_logprobs_ptr + row).to(tl.float32)
    target = tl.load(targets_ptr + row)
    if WITH_ENTROPY:
        h = tl.load(grad_entropy_ptr + row).to(tl.float32)
        S = lse - tl.load(entropy_ptr + row)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        p = tl.exp(x - lse)
        gx = tl.where(offs == target, g, 0.0) - g * p
        if WITH_ENTROPY:
            gx += h * p * (S - tl.where(p > 0.0, x, S))  # 0 where p = 0 (x = -inf), not 0 * inf
        gx = gx / temperature
        tl.store(grad_base + offs, gx.to(grad_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _triton_kernels():
    """Import triton and jit the kernels once. Raises ImportError when triton is missing."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_fwd_kernel), triton.jit(_bwd_kernel)


def triton_available() -> bool:
    try:
        _triton_kernels()
    except ImportError:
        return False
    return True


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _triton_fwd(logits, targets, temperature, with_entropy, block):
    fwd, _ = _triton_kernels()
    N, V = logits.shape
    logprobs = torch.empty(N, dtype=torch.float32, device=logits.device)
    entropy = torch.zeros(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    block = min(block, max(16, 1 << (V - 1).bit_length()))  # a power of two no wider than the vocabulary needs
    if N:
        fwd[(N,)](
            logits,
            logits.stride(0),
            targets,
            logprobs,
            entropy,
            lse,
            V,
            float(temperature),
            BLOCK_V=block,
            WITH_ENTROPY=with_entropy,
            num_warps=_num_warps(block),
        )
    return logprobs, entropy, lse, block


def _triton_bwd(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, chunk, block, out=None):
    _, bwd = _triton_kernels()
    N, V = logits.shape
    grad = torch.empty(N, V, dtype=logits.dtype, device=logits.device) if out is None else out  # (N, V); may alias
    with_entropy = grad_entropy is not None
    grad_logprobs = grad_logprobs.float().contiguous()  # the grad of a sum is an expanded, stride-0 tensor
    grad_entropy = grad_entropy.float().contiguous() if with_entropy else grad_logprobs
    if N:
        bwd[(N,)](
            logits,
            logits.stride(0),
            targets,
            lse,
            entropy,
            grad_logprobs,
            grad_entropy,
            grad,
            grad.stride(0),
            V,
            float(temperature),
            BLOCK_V=block,
            WITH_ENTROPY=with_entropy,
            num_warps=_num_warps(block),
        )
    return grad


# ---------------------------------------------------------------------------------------------------------------------
# Autograd: one Function over logits, one over (hidden, weight) for the fused final linear layer.

_IMPLS = {"torch": (_torch_fwd, _torch_bwd, TORCH_CHUNK), "triton": (_triton_fwd, _triton_bwd, TRITON_BLOCK)}


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk, impl):
        logprobs, entropy, lse, state = _IMPLS[impl][0](logits, targets, temperature, with_entropy, chunk)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.args = temperature, with_entropy, chunk, impl, state
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, with_entropy, chunk, impl, state = ctx.args
        g_ent = grad_entropy if with_entropy else None
        grad = _IMPLS[impl][1](logits, targets, lse, entropy, grad_logprobs, g_ent, temperature, chunk, state)
        return grad, None, None, None, None, None


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """One (R, V) block reused by every block of a call (a fresh one per block costs page faults on CPU); None where
    the GEMM makes its own (oneDNN, ``align.cpu_linear``)."""
    if cpu_linear.usable(hidden, weight):
        return None
    rows = min(LINEAR_ROWS, hidden.shape[0])
    return torch.empty(rows, weight.shape[0], dtype=torch.result_type(hidden, weight), device=hidden.device)


def _logits(h: torch.Tensor, weight: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """The (R, V) logits block h @ weight.T, in the model's dtype as its lm_head makes them, into ``buf`` if any."""
    return cpu_linear.matmul_t(h, weight, None if buf is None else buf[: h.shape[0]])


class _LinearTokenLogprobs(torch.autograd.Function):
    """Logits = hidden @ weight.T made LINEAR_ROWS rows at a time, in forward and again in backward, into one
    reused (R, V) buffer (oneDNN, ``align.cpu_linear``: a block each, the last dropped first); backward writes the
    logits' gradient over the recomputed logits (one block in memory).

    Forward makes the blocks last to first, so the buffer ends up holding the first block's logits; when a gradient
    will be needed the buffer is kept for backward, which starts with that block and does not recompute it (the
    whole recompute when N <= LINEAR_ROWS). Same peak memory (backward needs the block anyway), same floats."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk, impl):
        parts, states = [], []
        buf = _logits_buffer(hidden, weight)
        for r in reversed(range(0, hidden.shape[0], LINEAR_ROWS)):
            h = hidden[r : r + LINEAR_ROWS]
            logits = None  # the last block's, dropped before the next is made
            logits = _logits(h, weight, buf)  # (R, V)
            *out, state = _IMPLS[impl][0](logits, targets[r : r + LINEAR_ROWS], temperature, with_entropy, chunk)
            parts.append(out)
            states.append(state)
        parts.reverse()
        states.reverse()
        if parts:
            logprobs, entropy, lse = (torch.cat(p) for p in zip(*parts))
        else:
            logprobs, entropy, lse = (torch.zeros(0, device=hidden.device) for _ in range(3))
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.args = temperature, with_entropy, chunk, impl, states
        ctx.first_block = logits if parts and any(ctx.needs_input_grad[:2]) else None  # block 0's, for backward
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, with_entropy, chunk, impl, states = ctx.args
        need_hidden, need_weight = ctx.needs_input_grad[:2]  # a frozen lm_head needs no (V, D) gradient
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # (N, D)
        grad_weight = None  # (V, D), the blocks' fp32 sum (cpu_linear.add_matmul_t)
        kept, ctx.first_block = ctx.first_block, None  # backward overwrites it: a second backward recomputes
        buf = kept if kept is not None and not cpu_linear.usable(hidden, weight) else _logits_buffer(hidden, weight)
        for i, r in enumerate(range(0, hidden.shape[0], LINEAR_ROWS)):
            rows = slice(r, r + LINEAR_ROWS)
            h = hidden[rows]
            if i == 0 and kept is not None:
                logits = kept  # block 0 as forward left it
            else:
                logits = grad_logits = None  # the last block's, dropped before the next is made
                logits = _logits(h, weight, buf)  # (R, V), recomputed
            g_ent = grad_entropy[rows] if with_entropy else None
            args = logits, targets[rows], lse[rows], entropy[rows], grad_logprobs[rows], g_ent, temperature, chunk
            grad_logits = _IMPLS[impl][1](*args, states[i], out=logits)  # (R, V), written over the logits
            if need_hidden:
                grad_hidden[rows] = cpu_linear.matmul_t(grad_logits, weight.T, grad_hidden[rows])
            if need_weight and grad_logits.dtype == torch.float32:
                grad_weight = cpu_linear.add_matmul_t(grad_weight, grad_logits.T, hidden[rows].T, weight.shape)
            elif need_weight:  # one rounding per block in the matmul's dtype, summed over blocks in float32
                part = (grad_logits.T @ hidden[rows]).float()
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else torch.zeros_like(weight)
        return grad_hidden, grad_weight, None, None, None, None, None


class _RMSNorm(torch.autograd.Function):
    """fp32 RMSNorm, F.rms_norm's floats forward, a hand-written backward: F.rms_norm is composite on the CPU (pow,
    mean, rsqrt, two muls), so autograd's backward is ~10 elementwise passes over (N, E) and as many temporaries;
    this one is five: with xhat = x r, r = rsqrt(mean(x^2) + eps), g = dy w:
    dx = r (g - xhat mean(g xhat)),  dw = sum over tokens of dy xhat."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        xhat = x * r
        ctx.save_for_backward(xhat, r, weight)
        return xhat * weight

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        xhat, r, weight = ctx.saved_tensors
        dw = (dy * xhat).reshape(-1, xhat.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            g = dy * weight
            dot = (g * xhat).mean(-1, keepdim=True)  # (..., 1)
            dx = torch.addcmul(g, xhat, dot, value=-1.0).mul_(r)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, weight.shape, weight, eps)`` for float32 x and weight (E,): on the CPU one fused pass each way
    (``align.fused_cpu``, last-bit floats of its own) where it builds, else F.rms_norm's floats forward and under
    autograd a fused backward (``_RMSNorm``)."""
    if fused_cpu.usable(x, weight):
        return fused_cpu.rms_norm(x, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


# ---------------------------------------------------------------------------------------------------------------------
# Public entry point: one place selects the backend.


_BACKENDS = ("reference", "torch", "triton")


def _resolve_backend(logits: torch.Tensor, backend: str) -> str:
    if backend == "auto":
        return "triton" if logits.is_cuda and triton_available() else "torch"
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of 'auto', {', '.join(map(repr, _BACKENDS))}")
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend='triton' needs the triton package (pip install triton), or use backend='torch'")
    return backend


def _check_common(
    targets: torch.Tensor, lead: torch.Size, where: str, V: int, temperature: float, chunk_size: int | None
) -> None:
    """The checks both entry points make: targets int64 of shape ``lead`` (the input's leading dims, ``where`` says
    which), then the temperature, the chunk size and the target ids against the vocabulary size V."""
    if targets.dtype != torch.long or targets.shape != lead:
        raise ValueError(
            f"targets must be int64 with shape {tuple(lead)} ({where}), got {targets.dtype} {tuple(targets.shape)}"
        )
    if not temperature > 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a positive finite float, got {temperature!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(f"targets must lie in [0, {V}) (the vocabulary), got ids outside it")


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target token and the entropy, under the sampler's basis softmax(logits.float() / T).

    logits: (N, V) or (..., V), any float dtype; targets: (N,) or (...) int64 token ids in [0, V).
    Returns (logprobs, entropy), each float32 with the shape of targets; entropy is None unless with_entropy.
    Differentiable w.r.t. logits (exact gradient of any weighted sum of logprobs and entropy). The "torch" and
    "triton" backends stream over the vocabulary in chunks of ``chunk_size`` columns and never allocate an (N, V)
    float32 tensor besides the gradient (which has the logits' dtype). On CPU with triton, "triton" needs
    TRITON_INTERPRET=1 set before triton is first imported.
    """
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got dtype {logits.dtype}")
    V = logits.shape[-1]
    _check_common(targets, logits.shape[:-1], "logits without the vocabulary dim", V, temperature, chunk_size)
    batch_shape = targets.shape
    logits2d = logits.reshape(-1, V)  # (N, V); a view unless the leading dims are not collapsible
    targets1d = targets.reshape(-1)  # (N,)
    impl = _resolve_backend(logits, backend)
    if impl == "reference":
        logprobs, entropy = token_logprobs_reference(logits2d, targets1d, temperature, with_entropy)
    else:
        if logits2d.stride(-1) != 1:
            logits2d = logits2d.contiguous()
        chunk = chunk_size or _IMPLS[impl][2]
        logprobs, entropy = _TokenLogprobs.apply(
            logits2d, targets1d.contiguous(), float(temperature), with_entropy, chunk, impl
        )
    return logprobs.reshape(batch_shape), entropy.reshape(batch_shape) if with_entropy else None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs(hidden @ weight.T, targets, ...) without the (N, V) logits: the final linear layer is fused.

    hidden: (N, D) or (..., D); weight: (V, D) (an lm_head / tied embedding, no bias); targets: (N,) or (...).
    The logits are made LINEAR_ROWS tokens at a time in the hidden dtype (as the model's lm_head makes them), reduced
    by the chosen backend, dropped, and made again in backward; gradients flow to hidden and weight (the weight's is
    summed over token blocks in float32, then cast to its dtype). Peak extra memory: one (LINEAR_ROWS, V) logits
    block and its gradient, plus the (V, D) float32 weight-gradient sum, whatever N.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(
            f"weight must be (V, D) with D = hidden.shape[-1], got {tuple(weight.shape)} for hidden "
            f"{tuple(hidden.shape)}"
        )
    _check_common(targets, hidden.shape[:-1], "hidden without its last dim", weight.shape[0], temperature, chunk_size)
    hidden2d, targets1d = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # (N, D), (N,)
    impl = _resolve_backend(hidden, backend)
    if impl == "reference":
        logprobs, entropy = token_logprobs_reference(hidden2d @ weight.T, targets1d, temperature, with_entropy)
    else:
        chunk = chunk_size or _IMPLS[impl][2]
        logprobs, entropy = _LinearTokenLogprobs.apply(
            hidden2d, weight, targets1d.contiguous(), float(temperature), with_entropy, chunk, impl
        )
    return logprobs.reshape(targets.shape), entropy.reshape(targets.shape) if with_entropy else None
