"""Where training runs and in which precision: ``--device`` and ``--precision`` resolved once, before any model loads.

Devices: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` (the current CUDA device), ``cuda:N``.
Precisions (bytes per parameter for weights + gradients + AdamW moments, activations aside):

    fp32        fp32 weights, grads, moments                                4 + 4 + 8 = 16   (the CPU default)
    bf16-mixed  fp32 master weights, grads and moments; forward/backward    4 + 4 + 8 = 16   (the CUDA default)
                in bf16 under autocast (activations in bf16; autocast also
                keeps a bf16 copy of the weights during the step, +2)
    bf16        bf16 weights and grads, fp32 AdamW moments (``AdamW32``)    2 + 2 + 8 = 12

Logprobs, the loss, advantages and statistics are always float32 (``align.kernels`` reduces bf16 logits in fp32).
The reference model (KL) is frozen: it is held in bf16 whenever the precision is not fp32 (2 bytes per parameter).

Nothing here probes a device at import time; ``resolve`` is called by ``align.train`` at the start of a run.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

DEVICES_HELP = "auto, cpu, cuda or cuda:N"
PRECISIONS = ("fp32", "bf16-mixed", "bf16")
LEGACY_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # the former --dtype flag, now an alias of --precision


@dataclass(frozen=True)
class Placement:
    """A resolved device and precision: where the policy, the batches and the optimizer state live."""

    device: torch.device
    precision: str  # one of PRECISIONS

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the trained weights (the master copy)."""
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def frozen_dtype(self) -> torch.dtype:
        """dtype of a frozen copy (the reference model): bf16 unless the run is fp32."""
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    @property
    def compute_dtype_name(self) -> str:
        """The dtype forward passes run in, as vLLM's ``--dtype`` spells it (for a spawned rollout worker)."""
        return "float32" if self.precision == "fp32" else "bfloat16"

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast for ``bf16-mixed``, else nothing (fp32 runs fp32; bf16 weights already compute in bf16)."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def bf16_supported(device: torch.device) -> bool:
    """True when ``device`` runs bf16 matmuls natively (CUDA: compute capability >= 8.0; CPU: torch's kernels)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu"


def resolve_device(spec: str) -> torch.device:
    """``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` -> a torch.device, or a ValueError naming ``--device`` and the fix."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec != "cuda" and not (spec.startswith("cuda:") and spec[5:].isdigit()):
        raise ValueError(f"--device {spec!r} is not one of {DEVICES_HELP}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {spec}: CUDA is not available here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}); use --device cpu or a CUDA build of torch on a GPU"
        )
    if spec == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    index, count = int(spec[5:]), torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"--device {spec}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1}); "
            "pick one of them or --device cuda"
        )
    return torch.device("cuda", index)


def resolve_precision(spec: str, device: torch.device) -> str:
    """``auto`` -> ``bf16-mixed`` on CUDA with bf16 support, else ``fp32``; an explicit bf16 mode needs support."""
    if spec == "auto":
        return "bf16-mixed" if device.type == "cuda" and bf16_supported(device) else "fp32"
    if spec not in PRECISIONS:
        raise ValueError(f"--precision {spec!r} is not one of auto, {', '.join(PRECISIONS)}")
    if spec != "fp32" and not bf16_supported(device):
        raise ValueError(
            f"--precision {spec}: {device} has no native bf16 support "
            f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type}); "
            "use --precision fp32"
        )
    return spec


def resolve(device: str, precision: str) -> Placement:
    d = resolve_device(device)
    return Placement(d, resolve_precision(precision, d))


def precision_from_legacy(precision: str, dtype: str | None) -> str:
    """Fold the former ``--dtype float32|bfloat16`` into ``--precision`` (an alias; a contradiction is an error)."""
    if dtype is None:
        return precision
    if dtype not in LEGACY_DTYPES:
        raise ValueError(
            f"--dtype {dtype!r} must be one of {tuple(LEGACY_DTYPES)}; it is deprecated: use "
            f"--precision {' / '.join(PRECISIONS)}"
        )
    mapped = LEGACY_DTYPES[dtype]
    if precision not in ("auto", mapped):
        raise ValueError(
            f"--dtype {dtype} (deprecated, means --precision {mapped}) contradicts --precision "
            f"{precision}; drop --dtype"
        )
    return mapped


def auto_threads(cpus: int | None = None, local_ranks: int = 1) -> int:
    """``--threads 0``: ``OMP_NUM_THREADS`` when set (torchrun sets 1 for several ranks unless you set it), else this
    process's share of the CPUs (``cpus``: those it may run on, ``os.sched_getaffinity``; split between
    ``local_ranks`` torchrun ranks), at least 1.

    Not from the model size: on a quiet machine even a 0.1M-parameter model's GRPO step is ~1.2x faster on 2 threads
    than on 1 (the loss forward/backward over a step's ~1500 tokens parallelises; decode neither gains nor loses),
    a 31M one ~1.6x (``benchmarks/bench_vs_trl.py --threads N``)."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, local_ranks))


def resolve_threads(requested: int) -> int:
    """The torch CPU thread count of a run: ``requested`` when > 0, else ``auto_threads`` (torchrun: per local rank)."""
    if requested > 0:
        return requested
    return auto_threads(local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class AdamW32(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, Loshchilov & Hutter 2019) whose moments are float32 whatever the parameter dtype.

    For ``--precision bf16``: ``torch.optim.AdamW`` keeps its moments in the parameter's dtype, and bf16 moments
    lose most small updates. Here each step reads the bf16 parameter and gradient as fp32, updates fp32 moments, and
    rounds the new parameter to bf16 once. Same update rule and hyper-parameters as torch's AdamW (amsgrad off)."""

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        assert closure is None, "AdamW32 takes no closure"
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)  # FSDP2: sharded like p
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = float(state["step"])
                g, m, v = p.grad.float(), state["exp_avg"], state["exp_avg_sq"]
                p32 = p.float().mul_(1 - lr * wd)
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
                p32.addcdiv_(m, denom, value=-lr / (1 - b1**t))
                p.copy_(p32)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded state to the parameter's dtype; put the saved fp32 moments back (exact resume)."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k in ("exp_avg", "exp_avg_sq"):
                if i in state_dict["state"]:
                    self.state[p][k] = state_dict["state"][i][k].to(device=p.device, dtype=torch.float32)


def make_optimizer(
    params: Iterable, place: Placement, lr: float, betas: Iterable[float], weight_decay: float
) -> torch.optim.Optimizer:
    """torch's fused AdamW for fp32 weights (fp32 and bf16-mixed), ``AdamW32`` for bf16 weights.

    Fused: one pass over parameter, gradient and both moments per tensor (CPU and CUDA kernels, FSDP2's DTensors
    included); the 31M shape's optimizer step takes ~23 ms on 2 CPU threads against ~100 ms for the default
    multi-tensor ("foreach") AdamW, which reads and writes the same tensors about ten times. The update rule is the
    same; the rounding differs from foreach's (relative ~1e-7)."""
    if place.param_dtype != torch.float32:
        return AdamW32(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=True)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``: a CUDA device's free memory, the host's ``MemAvailable``
    (Linux ``/proc/meminfo``) for the CPU; None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next((int(line.split()[1]) for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError):
        return None
    return None if kib is None else kib * 1024
