"""Mixture-of-experts layers for ``align.model`` (Qwen3-MoE, Mixtral): top-k routing, grouped expert compute, and
rollout routing replay (R3).

Key decisions
- Hugging Face tensor names, one module per expert (``mlp.experts.3.gate_proj.weight`` for Qwen3-MoE,
  ``block_sparse_moe.experts.3.w1.weight`` for Mixtral; the router is ``gate.weight``), so loading stays a strict
  key match with no permutation and experts are ordinary parameters (FSDP2 shards them like any other). The family
  differences are a row of ``MOE_FAMILIES``.
- Routing (HF's ``TopKRouter``): softmax of the router logits in fp32 over every expert, top-k of it, renormalised
  over the k when ``norm_topk_prob`` (Mixtral always), cast back to the activations' dtype.
- Grouped compute: the (token, slot) pairs are sorted by expert and each expert's tokens are one group of torch's
  grouped GEMM (``F.grouped_mm`` over the stacked expert weights, gate|up fused; CUDA bf16, and the CPU on
  torch >= 2.11) inside one autograd Function (``GroupedExperts``: its backward keeps the sorted inputs and the
  gate|up output only, half of what autograd kept), or, without it, one GEMM per active expert in a loop; outputs
  are weighted and scattered back with one ``index_add``. No token ever passes an expert it was not routed to. LoRA on the experts (``--lora-experts``,
  ``align.lora``): the loop runs each expert's adapted projections; the grouped GEMM runs on ``W + s * B @ A`` per
  expert (autograd reaches A and B; one (out, r) x (r, in) GEMM per expert and projection per forward).
- Routing replay (R3, Ma et al. 2025, arXiv 2510.11370): a ``Routing`` passed to the forward may carry the
  rollout's expert ids per token and MoE layer (-1: the token routes itself, e.g. prompt tokens). A replayed token
  uses those experts, weighted by the *current* router's probabilities of them (renormalised as the family does),
  so the router keeps its gradient. The same object returns the router's own top-k (``chosen``), for the
  ``moe/routing_mismatch`` metric, and the router logits for the load-balancing loss (Switch / Mixtral form).

Shapes: N tokens (B*T flattened), E hidden size, F expert intermediate size, X experts, k experts per token,
Lm MoE layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from align import cpu_linear, fused_cpu
from align.errors import InputError
from align.options import flag  # the one definition of a flag's help


@dataclass(frozen=True)
class MoeFamily:
    """How a family names its MoE block and its expert projections (gate, up, down) in HF checkpoints."""

    block: str  # the decoder layer's attribute holding the sparse block
    proj: tuple[str, str, str]  # expert (gate, up, down) projection names
    expert_size_key: str  # config.json key of an expert's intermediate size
    always_norm_topk: bool  # Mixtral renormalises the top-k probabilities unconditionally


MOE_FAMILIES = {
    "qwen3_moe": MoeFamily("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_intermediate_size", False),
    "mixtral": MoeFamily("block_sparse_moe", ("w1", "w3", "w2"), "intermediate_size", True),
}
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step")


def moe_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of ``align.model.ModelConfig`` read from a Hugging Face ``config.json`` (empty: dense)."""
    fam = MOE_FAMILIES.get(hf.get("model_type"))
    if fam is None:
        return {}
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    return {
        "num_experts": experts,
        "num_experts_per_tok": hf.get("num_experts_per_tok"),
        "moe_intermediate_size": hf.get(fam.expert_size_key),
        "norm_topk_prob": True if fam.always_norm_topk else bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
        "mlp_only_layers": list(hf.get("mlp_only_layers") or []),
        "sliding_window": hf.get("sliding_window") if hf.get("model_type") == "mixtral" else None,
    }


def moe_hf_config(cfg: Any) -> dict[str, Any]:
    """The MoE keys of a fresh ``config.json`` for ``cfg`` (a ``ModelConfig``)."""
    if cfg.model_type == "mixtral":
        return {
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "sliding_window": cfg.sliding_window,
        }
    if cfg.model_type == "qwen3_moe":
        return {k: getattr(cfg, k) for k in MOE_FIELDS} | {"mlp_only_layers": list(cfg.mlp_only_layers)}
    return {}


def check_moe_config(cfg: Any) -> None:
    """ValueError naming the field when a MoE config contradicts itself (or a dense one carries experts)."""
    if cfg.model_type not in MOE_FAMILIES:
        if cfg.num_experts:
            raise ValueError(f"num_experts={cfg.num_experts} on a dense {cfg.model_type!r} model; set it to 0")
        return
    X, k, step = cfg.num_experts, cfg.num_experts_per_tok, cfg.decoder_sparse_step
    for name, v in (
        ("num_experts", X),
        ("num_experts_per_tok", k),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
    ):
        if type(v) is not int or v <= 0:
            raise ValueError(f"config.json {name} is {v!r}: a {cfg.model_type} model needs a positive integer")
    if k > X:
        raise ValueError(f"config.json num_experts_per_tok={k} exceeds num_experts={X}: a token cannot use more")
    if type(step) is not int or step <= 0:
        raise ValueError(f"config.json decoder_sparse_step={step!r}: it must be a positive integer (1 = every layer)")
    bad = [i for i in cfg.mlp_only_layers if type(i) is not int or not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"config.json mlp_only_layers {bad} are not layers of a {cfg.num_hidden_layers}-layer model")
    if not any(is_sparse(cfg, i) for i in range(cfg.num_hidden_layers)):
        raise ValueError(
            f"config.json decoder_sparse_step={step} with mlp_only_layers={list(cfg.mlp_only_layers)} leaves no "
            f"MoE layer in {cfg.num_hidden_layers} layers: use the dense family instead"
        )
    if cfg.sliding_window is not None and (type(cfg.sliding_window) is not int or cfg.sliding_window <= 0):
        raise ValueError(f"config.json sliding_window={cfg.sliding_window!r}: a positive integer or null")


def is_sparse(cfg: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` is a MoE layer (HF: not in ``mlp_only_layers``, (i + 1) % step == 0)."""
    return (
        cfg.model_type in MOE_FAMILIES
        and cfg.num_experts > 0
        and layer not in cfg.mlp_only_layers
        and (layer + 1) % cfg.decoder_sparse_step == 0
    )


def moe_layers(cfg: Any) -> list[int]:
    """The decoder layers that are MoE layers, in order (position j = the j-th MoE layer of ``Routing``)."""
    return [i for i in range(cfg.num_hidden_layers) if is_sparse(cfg, i)]


@dataclass(eq=False)
class Routing:
    """What the MoE layers of one forward read and write.

    ``routes`` (B, T, Lm, k) integer expert ids the rollout used, -1 where none was recorded (prompt tokens, padding);
    the learner creates one per micro-batch holding the whole batch's routes and cuts them to the micro-batch's
    rows (padded) or packed row (``align.packing.build``) before the forward;
    ``replay``: the forward uses them (R3), else they only feed the mismatch metrics. After the forward, per MoE
    layer j: ``chosen[j]`` (N, k) the router's own top-k, ``used[j]`` (N, k) the experts that ran, ``logits[j]``
    (N, X) the router logits when ``keep_logits`` (the load-balancing loss)."""

    routes: Tensor | None = None
    replay: bool = False
    keep_logits: bool = False
    num_experts: int = 0  # set by the forward
    chosen: dict[int, Tensor] = field(default_factory=dict)
    used: dict[int, Tensor] = field(default_factory=dict)
    logits: dict[int, Tensor] = field(default_factory=dict)

    def cut(self, select: Any) -> None:
        """Replace ``routes`` (a batch's) by ``select(routes)`` (one micro-batch's rows)."""
        if self.routes is not None:
            self.routes = select(self.routes)


class Expert(nn.Module):
    """One SwiGLU expert: ``down(silu(gate(x)) * up(x))`` under its family's projection names."""

    def __init__(self, hidden: int, inner: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        for name, (i, o) in zip(names, ((hidden, inner), (hidden, inner), (inner, hidden))):
            setattr(self, name, nn.Linear(i, o, bias=False))

    def weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """(gate, up, down) weights as the expert computes with them: a LoRA projection's ``W + s * B @ A`` with
        autograd (``align.lora.LoRALinear.effective_weight``, ``--lora-experts``), else the plain weight."""
        mods = [getattr(self, n) for n in self.names]
        return tuple(m.effective_weight() if hasattr(m, "effective_weight") else m.weight for m in mods)  # type: ignore[return-value]

    def dropout_active(self) -> bool:
        """A LoRA projection applies dropout now: only the per-expert loop (the layer's own forward) does that."""
        mods = [getattr(self, n) for n in self.names]
        return any(getattr(m, "dropout", 0) and m.training and torch.is_grad_enabled() for m in mods)

    def forward(self, x: Tensor) -> Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


class SparseMoE(nn.Module):
    """Top-k routed experts (HF ``SparseMoeBlock``): ``gate`` (the router, (X, E)) and ``experts``."""

    def __init__(self, cfg: Any, index: int):
        super().__init__()
        fam = MOE_FAMILIES[cfg.model_type]
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, fam.proj) for _ in range(cfg.num_experts)
        )
        self.top_k, self.norm_topk_prob, self.index = cfg.num_experts_per_tok, cfg.norm_topk_prob, index

    def route(self, x: Tensor, replay: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (N, E) -> router logits (N, X), own top-k (N, k), the experts used (N, k) and their weights (N, k)."""
        logits = self.gate(x)  # (N, X)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = probs.topk(self.top_k, dim=-1)  # (N, k)
        idx, w = top_i, top_w
        if replay is not None:
            idx = torch.where(replay[:, :1] >= 0, replay.long(), top_i)  # (N, k): recorded experts, else own
            w = probs.gather(1, idx)  # the current router's probabilities of the replayed experts
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return logits, top_i, idx, w.to(logits.dtype)

    def forward(self, x: Tensor, routing: Routing | None = None) -> Tensor:
        B, T, E = x.shape
        flat = x.reshape(-1, E)  # (N, E)
        replay = None
        if routing is not None and routing.replay and routing.routes is not None:
            replay = routing.routes[:, :, self.index].reshape(B * T, -1)  # (N, k)
        logits, own, idx, w = self.route(flat, replay)
        if routing is not None:  # a dict entry per layer: a checkpointed recompute overwrites, never appends
            routing.chosen[self.index], routing.used[self.index] = own, idx
            routing.num_experts = logits.shape[-1]
            if routing.keep_logits:
                routing.logits[self.index] = logits
        return expert_mix(flat, idx, w, self.experts).view(B, T, E)


def _grouped_mm_usable(x: Tensor) -> bool:
    """torch's grouped GEMM runs here: CUDA (sm80+, bf16) or a CPU with torch >= 2.11 (its CPU kernel, without the
    16-byte alignment limit of earlier versions); else the loop over the active experts."""
    if GROUPED_MM is None:
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu" and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)


GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MIN_PAIRS_PER_EXPERT = 4  # below 4 (token, slot) pairs per expert on average, stacking the weights costs more


def expert_mix(x: Tensor, idx: Tensor, w: Tensor, experts: nn.ModuleList, grouped: bool | None = None) -> Tensor:
    """sum_j w[n, j] * expert_{idx[n, j]}(x[n]) for x (N, E), idx / w (N, k): (token, slot) pairs sorted by expert,
    then torch's grouped GEMM over the experts' token groups (``grouped`` None: where it runs, ``_grouped_mm_usable``;
    ``GroupedExperts``) or, without it, one GEMM per active expert, scattered back with one index_add."""
    if grouped is None:  # few tokens per expert (decode): the loop reads only the active experts' weights
        grouped = _grouped_mm_usable(x) and idx.numel() >= GROUPED_MIN_PAIRS_PER_EXPERT * len(experts)
        grouped = grouped and not experts[0].dropout_active()  # LoRA dropout: the loop applies it per expert
    if grouped:
        ws = [e.weights() for e in experts]
        X, E = len(experts), x.shape[1]
        gate_up = torch.stack([t for g, u, _ in ws for t in (g, u)]).view(X, -1, E)  # (X, 2F, E), one copy
        down = torch.stack([d for _, _, d in ws])  # (X, E, F)
        # autocast (fp32 weights, bf16 activations): the GEMMs run in the activations' dtype
        return GroupedExperts.apply(x, idx, w, gate_up.to(x.dtype), down.to(x.dtype))
    k = idx.shape[1]
    order = idx.reshape(-1).argsort(stable=True)  # (N*k,) pairs grouped by expert
    token = order // k  # (N*k,) the token of each sorted pair
    counts = torch.bincount(idx.reshape(-1), minlength=len(experts))  # (X,)
    parts = x.index_select(0, token).split(counts.tolist())  # views: the backward concatenates them
    ys = torch.cat([experts[e](p) for e, p in enumerate(parts) if p.shape[0]])  # (N*k, E)
    ys = ys * w.reshape(-1)[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))


class GroupedExperts(torch.autograd.Function):
    """The experts over (token, slot) pairs sorted by expert as two grouped GEMMs (gate|up fused, then down), each
    pair's routing weight applied to the F-wide activation before the down projection (half the width of its E-wide
    output), with a hand-written backward that keeps the sorted inputs and the gate|up output only (no expert output,
    no activation copies) and takes the routing weights' gradient at width F too: d out / d w = <dy, down(a)> =
    <dy @ down, a>. The rows go back with one ``index_add`` each way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
        k, X = idx.shape[1], gate_up.shape[0]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # (M,) pairs grouped by expert, M = N*k
        token = order // k  # (M,) the token of each sorted pair
        offs = torch.bincount(flat, minlength=X).cumsum(0).to(torch.int32)  # (X,) end of each expert's rows
        xs = x.index_select(0, token)  # (M, E)
        h = _gmm(xs, gate_up.transpose(1, 2), offs).contiguous()  # (M, 2F), as the fused kernels read it
        ws = w.reshape(-1)[order, None].to(h.dtype)  # (M, 1) each sorted pair's weight
        if fused_cpu.usable(h):  # one pass (align.fused_cpu)
            a = fused_cpu.load().swiglu_fwd(h, ws[:, 0])
        else:
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate).mul_(up).mul_(ws)
        y = _gmm(a, down.transpose(1, 2), offs)  # (M, E), weighted
        ctx.save_for_backward(xs, h, ws, order, offs, gate_up, down)
        ctx.k, ctx.w_dtype = k, w.dtype
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        xs, h, ws, order, offs, gate_up, down = ctx.saved_tensors
        N, token = grad.shape[0], order // ctx.k
        gs = grad.to(h.dtype).index_select(0, token)  # (M, E) each sorted pair's output gradient
        ga = _gmm(gs, down, offs)  # (M, F) gradient of the weighted activation / ws
        if fused_cpu.usable(h):  # one pass: the weighted activation, d ws, d gate | d up (align.fused_cpu)
            aw, gw_sorted, gh = fused_cpu.load().swiglu_bwd(h, ws[:, 0], ga.contiguous())
        else:
            aw, gw_sorted, gh = _swiglu_backward(h, ws, ga)
        gw = None
        if ctx.needs_input_grad[2]:
            gw = torch.empty_like(ws[:, 0]).index_copy_(0, order, gw_sorted).view(N, -1).to(ctx.w_dtype)
        g_down = _gmm_wgrad(gs, aw, offs) if ctx.needs_input_grad[4] else None  # (X, E, F)
        g_gate_up = _gmm_wgrad(gh, xs, offs) if ctx.needs_input_grad[3] else None  # (X, 2F, E)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.zeros_like(grad).index_add_(0, token, _gmm(gh, gate_up, offs).to(grad.dtype))
        return gx, None, gw, g_gate_up, g_down


def _onednn(a: Tensor, b: Tensor) -> bool:
    """fp32 CPU grouped GEMMs by oneDNN (``align.fused_cpu``) where the dense layers run on it (``align.cpu_linear``:
    AMD CPUs, ~2x MKL's AVX2 path); elsewhere torch's grouped GEMM."""
    return cpu_linear.backend() == "onednn" and fused_cpu.usable(a, b)


def _gmm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Each group's rows of a (M, K) times its b (X, K, N)."""
    return fused_cpu.load().gmm_rows(a, b, offs) if _onednn(a, b) else GROUPED_MM(a, b, offs=offs)


def _gmm_wgrad(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Per group, its rows of a (M, P) transposed times its rows of b (M, Q): (X, P, Q)."""
    return fused_cpu.load().gmm_wgrad(a, b, offs) if _onednn(a, b) else GROUPED_MM(a.t(), b, offs=offs)


def _swiglu_backward(h: Tensor, ws: Tensor, ga: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """torch composite of ``fused_cpu``'s ``swiglu_bwd``: from h (M, 2F), ws (M, 1), ga (M, F) the weighted
    activation (M, F), d ws (M,) and d h (M, 2F); ``ga`` is overwritten."""
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate)
    a = act * up  # (M, F) the unweighted activation
    gw = (ga * a).sum(-1)
    ga.mul_(ws)
    gh = torch.empty_like(h)  # (M, 2F): d gate | d up, written in place (no cat)
    d_gate, d_up = gh.chunk(2, dim=-1)
    torch.ops.aten.silu_backward.grad_input(ga * up, gate, grad_input=d_gate)
    torch.mul(ga, act, out=d_up)
    return a.mul_(ws), gw, gh


def dense_expert_mix(x: Tensor, idx: Tensor, w: Tensor, experts: nn.ModuleList) -> Tensor:
    """The reference a grouped path must beat: every token through every expert, weights zero where not routed."""
    full = torch.zeros(x.shape[0], len(experts), dtype=w.dtype, device=x.device).scatter(1, idx, w)  # (N, X)
    return sum(full[:, e, None].to(x.dtype) * ex(x) for e, ex in enumerate(experts))


# ----------------------------------------------------------------------------------------------- metrics, losses


def routing_stats(routing: Routing) -> dict[str, float]:
    """Per forward: ``moe/routing_mismatch``, the fraction of (token, MoE layer) pairs with a recorded route whose
    experts in this forward (as a set) differ from the rollout's (0 under replay: the replayed experts ran);
    ``moe/router_mismatch``, the same for the router's own top-k (what replay hides); ``moe/expert_load_max`` /
    ``moe/expert_load_cv``, the busiest expert's share of the (token, slot) assignments over the uniform share and
    the coefficient of variation of the per-expert counts (layers pooled)."""
    if not routing.used:
        return {}
    load = sum(torch.bincount(u.reshape(-1), minlength=routing.num_experts).double() for u in routing.used.values())
    stats = {
        "moe/expert_load_max": float(load.max() / load.mean()),
        "moe/expert_load_cv": float(load.std(0) / load.mean()),
    }
    if routing.routes is None:
        return stats
    for key, taken in (("moe/routing_mismatch", routing.used), ("moe/router_mismatch", routing.chosen)):
        differ, total = 0, 0
        for j, got in taken.items():
            rec = routing.routes[:, :, j].reshape(got.shape[0], -1)  # (N, k)
            has = rec[:, 0] >= 0
            differ += int((got[has].sort(-1).values != rec[has].long().sort(-1).values).any(-1).sum())
            total += int(has.sum())
        stats[key] = differ / total if total else 0.0
    return stats


def load_balancing_loss(routing: Routing) -> Tensor:
    """Switch-Transformer / Mixtral auxiliary loss ``X * sum_e f_e * P_e`` per MoE layer, averaged over layers:
    f_e the fraction of tokens routed to expert e (HF's scale: a perfectly balanced router gives top_k), P_e its
    mean router probability."""
    losses, num_experts = [], routing.num_experts
    for j, logits in routing.logits.items():
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # (N, X)
        f = torch.bincount(routing.used[j].reshape(-1), minlength=num_experts).float() / logits.shape[0]
        losses.append(num_experts * (f * probs.mean(0)).sum())
    return torch.stack(losses).mean()


# ----------------------------------------------------------------------------------------------- the run's settings


REPLAY_MODES = ("off", "rollout")


@dataclass
class MoeConfig:
    """Mixture-of-experts training settings (CLI: ``--routing-replay``, ``--router-aux-loss-coef``,
    ``--freeze-router``); they apply to MoE models only."""

    routing_replay: str = flag(
        "off",
        "MoE: 'rollout' replays the experts the sampler chose for each sampled token in the learner's forward "
        "(R3; gate weights from the current router); 'off' routes afresh (the mismatch is still logged).",
    )
    router_aux_loss_coef: float = flag(0.0, "MoE: weight of the load-balancing loss (Switch / Mixtral form); 0 = off.")
    freeze_router: bool = flag(False, "MoE: keep the routers' weights fixed.")

    def __post_init__(self) -> None:
        if self.routing_replay not in REPLAY_MODES:
            raise ValueError(f"--routing-replay must be one of {REPLAY_MODES}, got {self.routing_replay!r}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"--router-aux-loss-coef must be >= 0, got {self.router_aux_loss_coef}")

    def prepare(self, model: nn.Module) -> None:
        """Apply the settings to a loaded policy: ``--freeze-router`` stops every router's gradient."""
        if self.freeze_router:
            freeze_router(model)

    def check_run(self, rollout: str, model_path: str | os.PathLike) -> None:
        """Before the model loads: replay needs a MoE model (its ``config.json``) and a sampler that records routes."""
        if self.routing_replay == "off":
            return
        if rollout != "native" and not torch.cuda.is_available():
            raise InputError(
                f"--routing-replay {self.routing_replay} with --rollout {rollout} on a machine without CUDA: the vLLM "
                "worker returns routed experts (enable_return_routed_experts, protocol minor 4) only on a GPU build "
                "(vLLM >= 0.11 with its V2 model runner); its CPU build cannot. Use --rollout native or "
                "--routing-replay off"
            )
        path = Path(model_path) / "config.json"
        model_type = json.loads(path.read_text()).get("model_type") if path.is_file() else None
        if model_type not in MOE_FAMILIES:
            raise InputError(
                f"--routing-replay {self.routing_replay} needs a mixture-of-experts model ({', '.join(MOE_FAMILIES)}); "
                f"{path} says model_type {model_type!r}: drop --routing-replay or pick a MoE --model"
            )


def freeze_router(model: nn.Module) -> int:
    """Stop the gradient of every MoE router (``--freeze-router``); returns how many were frozen."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for b in blocks:
        b.gate.weight.requires_grad_(False)
    return len(blocks)


def routing_for(model: nn.Module, cfg: Any, routes: Tensor | None) -> Routing | None:
    """A fresh ``Routing`` for one learner forward of ``model`` under the run's ``cfg.moe``, holding the batch's
    recorded ``routes`` (N, L, Lm, k) or None; None for a dense model."""
    mc = getattr(model, "config", None)
    if not getattr(mc, "num_experts", 0):
        return None
    want = (len(moe_layers(mc)), mc.num_experts_per_tok)
    if routes is not None and tuple(routes.shape[2:]) != want:
        raise ValueError(
            f"the rollout's routes have (MoE layers, top-k) {tuple(routes.shape[2:])}, the model {want}: they were "
            "recorded by another model; sample with the policy being trained"
        )
    m = getattr(cfg, "moe", None) or MoeConfig()
    return Routing(routes, replay=m.routing_replay == "rollout", keep_logits=m.router_aux_loss_coef > 0)


def batch_routes(prompt_ids: list[list[int]], completions: list, L: int, device: Any) -> Tensor | None:
    """The rollout's routes in the learner's padded layout (N, L, Lm, k) int16, -1 where none was recorded: input
    position p + j holds completion token j (fed back to the sampler at decode step j), for j < len - 1. None when
    no completion carries routes (a dense model, or a backend that does not record them)."""
    have = [_as_tensor(getattr(c, "routes", None)) for c in completions]
    shape = next((r.shape[1:] for r in have if r is not None), None)
    if shape is None:
        return None
    out = torch.full((len(completions), L, *shape), -1, dtype=torch.int16)
    for i, (c, r) in enumerate(zip(completions, have)):
        p = getattr(c, "prompt_ids", None) or prompt_ids[c.prompt_index]
        if r is None or getattr(c, "mask", None) is not None:  # an episode's turns are not one sampled run
            continue
        if r.shape[0] != max(len(c.token_ids) - 1, 0) or r.shape[1:] != shape:
            raise ValueError(
                f"completion {i} carries routes of shape {tuple(r.shape)} for {len(c.token_ids)} tokens: expected "
                f"({len(c.token_ids) - 1}, {shape[0]}, {shape[1]}) (one row per token fed back to the sampler)"
            )
        out[i, len(p) : len(p) + r.shape[0]] = r
    return out.to(device)


def _as_tensor(routes: Any) -> Tensor | None:
    """A completion's routes as an int16 tensor: the native sampler's already are; the spool's arrive as
    ``align.rollout.protocol.PackedRoutes`` (stdlib: ``shape`` and ``tolist``)."""
    if routes is None or isinstance(routes, Tensor):
        return routes
    return torch.tensor(routes.tolist(), dtype=torch.int16).reshape(routes.shape)


def add_router_terms(loss: Tensor, stats: dict, routing: Routing | None, cfg: Any, share: float) -> tuple[Tensor, dict]:
    """One micro-batch's loss plus ``--router-aux-loss-coef`` x its load-balancing loss (weighted by ``share``, its
    fraction of the batch's scored tokens), and its stats plus the ``moe/*`` ones. Unchanged for a dense model."""
    if routing is None:
        return loss, stats
    stats = {**stats, **routing_stats(routing)}
    coef = getattr(getattr(cfg, "moe", None), "router_aux_loss_coef", 0.0)
    if not coef or not routing.logits:
        return loss, stats
    aux = load_balancing_loss(routing)
    stats["moe/aux_loss"] = float(aux.detach())
    return loss + coef * share * aux, stats
