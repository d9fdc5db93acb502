"""Multi-process training under ``torchrun``: process group, FSDP2 sharding, the batch split, all-reduces, rank 0.

``torchrun --nproc-per-node N -m align.train ...`` (or ``train()`` called by a script torchrun starts) gives every
rank the same config. Without torchrun's environment (``WORLD_SIZE`` unset or 1) every helper here is a no-op and a
run is exactly the single-process run: no process group, no wrapping.

Key decisions (issue 14)
- One process per device: NCCL on CUDA (``LOCAL_RANK`` picks the GPU), gloo on the CPU. ``init_process_group``
  gets ``--dist-timeout-s``, so a dead or hung rank fails the others instead of hanging them forever.
- The policy (and the frozen reference model) is sharded with ``torch.distributed.fsdp.fully_shard``: one unit per
  decoder layer plus the root (embedding, final norm, lm_head). ``MixedPrecisionPolicy`` follows ``--precision``:
  bf16-mixed all-gathers bf16 copies of the fp32 master shards and reduces gradients in fp32; fp32 and bf16 keep
  the weights' dtype, reducing in fp32. The gradient divide factor is 1: every rank's loss is already divided by
  the whole batch's normalisers, so the gradient is the *sum* over ranks.
- Same numbers as one process: every rank samples its contiguous share of the step's prompts (``share``); the
  sampler draws the uniforms of all the step's rows and keeps its own (``align.rollout.native.generate(rows=)``),
  so a completion depends only on (seed, step, global row), and the shares are gathered so every rank holds the
  whole batch: rewards, advantages and logged statistics are computed from the full group set on every rank
  (reward calls are therefore repeated on each rank: not split yet). The learner takes the rank's share of each
  mini-batch, all-reduces the token and sequence counts (``reduce_counts``), pads the micro-batch count to the
  largest rank's (FSDP's collectives need every rank to run the same forwards) and merges the loss statistics.
- Generation with sharded weights: ``full_model`` all-gathers the parameters into a plain, unsharded
  ``Transformer`` (meta-initialised, the gathered tensors assigned, no second copy) that the native sampler runs;
  it is dropped after the step's generation. Peak memory per rank while sampling: the shards (1/N of weights,
  gradients, optimizer state) + one full copy of the weights in the parameter dtype + the KV cache.
- Checkpoints: sharded DCP directories, each rank writing its shards (``align.run.checkpoint``); a single-process
  checkpoint still resumes under torchrun: ``align.run.checkpoint.restore_optimizer_any`` shards its full
  optimizer state for this world size.
- ``--rollout spool``: ``align.rollout.client.ShardedSpoolClient`` (each rank submits its share with ``first_prompt_index``; rank 0
  syncs the worker, every rank waits); ``full_model(to_main_cpu=True)`` streams the weights to rank 0's CPU for
  snapshots; ``check_shared_dir`` makes every rank agree that the spool is one writable directory.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_MESH: dict = {}  # {"mesh": the 2-D DeviceMesh} under HSDP (--dp-replicate > 1), set by setup


def env_world_size() -> int:
    """The world size torchrun announces (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def active() -> bool:
    """True inside an initialised process group of more than one rank."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and world() > 1


def world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def rank() -> int:
    """This process's rank: the group's, else torchrun's RANK (before ``setup`` / after ``teardown``), else 0."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0")) if env_world_size() > 1 else 0


def is_main() -> bool:
    """Rank 0 (or the single process): the one that writes run files."""
    return rank() == 0


# ------------------------------------------------------------------------------------------------ setup


def check_supported(cfg: Any, n: int) -> None:
    """What this first slice of multi-process training refuses, before any collective could hang."""
    rep, shard_n = getattr(cfg, "dp_replicate", 1), getattr(cfg, "dp_shard", 0)
    if rep < 1 or shard_n < 0 or rep * (shard_n or n // rep) != n or n % rep:
        raise ValueError(
            f"--dp-replicate {rep} x --dp-shard {shard_n} does not make the world size {n}; pass "
            f"--dp-replicate R and --dp-shard S with R x S = {n} (--dp-shard 0: {n} / R)"
        )
    if getattr(cfg, "prompts_per_step", 0) % n:  # align.sft splits its rows unevenly: no such rule
        raise ValueError(
            f"--prompts-per-step {cfg.prompts_per_step} is not divisible by the world size {n} "
            f"(torchrun --nproc-per-node x nodes); make it a multiple of {n}"
        )
    unsupported = {
        "--lora-rank > 0": cfg.lora.enabled,
        "--adv-refill": getattr(cfg, "adv_refill", False),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"not supported under torchrun yet: {', '.join(bad)}; run without them or in one process")


def setup(cfg: Any) -> bool:
    """Join torchrun's process group (gloo on the CPU, NCCL with one GPU per local rank). No-op without torchrun
    or when the caller already initialised the group. Call before ``align.device.resolve``: on CUDA it makes the
    local rank's GPU current, so ``--device auto|cuda`` resolves to it. Returns True when it created the group
    (then the caller ends it with ``teardown``)."""
    n = env_world_size()
    if n <= 1:
        return False
    check_supported(cfg, n)
    _MESH.clear()
    if torch.distributed.is_initialized():
        _make_mesh(cfg, n, "cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
        return False
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda:
        if cfg.device.startswith("cuda:"):
            raise ValueError(
                f"--device {cfg.device} under torchrun: every rank would use the same GPU; pass "
                "--device cuda (each local rank takes GPU LOCAL_RANK)"
            )
        count, local_ranks = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))
        if max(local + 1, local_ranks) > count:  # every rank refuses, not only those without a GPU
            raise ValueError(
                f"{local_ranks} local ranks but this machine has {count} CUDA device(s) (one GPU per "
                f"rank); lower torchrun --nproc-per-node to <= {count} or pass --device cpu"
            )
        torch.cuda.set_device(local)
    timeout = datetime.timedelta(seconds=getattr(cfg, "dist_timeout_s", 600.0))
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo", timeout=timeout, device_id=torch.device("cuda", local) if cuda else None
    )
    _make_mesh(cfg, n, "cuda" if cuda else "cpu")
    return True


def _make_mesh(cfg: Any, n: int, device_type: str) -> None:
    """HSDP (``--dp-replicate R > 1``): a (R, n / R) DeviceMesh, replicas over dim 0, shards over dim 1."""
    rep = getattr(cfg, "dp_replicate", 1)
    if rep > 1:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH["mesh"] = init_device_mesh(device_type, (rep, n // rep), mesh_dim_names=("replicate", "shard"))


def teardown(created: bool) -> None:
    """Destroy the process group ``setup`` created (``created``); a group the caller initialised is left alone."""
    _MESH.clear()
    if created and torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank tears down while another still has work in flight on the group
        torch.distributed.destroy_process_group()


def shard(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, then the root. Returns ``model`` (unchanged in one process)."""
    if not active():
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    param_dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    mesh = _MESH.get("mesh")  # None: plain FSDP over every rank
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # the per-rank losses are parts of one sum (see the docstring)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def main_first(fn: Callable[[], T]) -> T:
    """Rank 0 runs ``fn`` (e.g. creates a file), then the others do (they find it made)."""
    if not active():
        return fn()
    if is_main():
        out = fn()
    torch.distributed.barrier()
    if not is_main():
        out = fn()
    return out


class RankLog:
    """What a rank other than 0 keeps instead of a run file or a progress bar: the records, in memory."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.sinks: list = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def update(self, step: int, line: str) -> None:
        pass

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ collectives


def share(n: int) -> tuple[int, int]:
    """[lo, hi) of this rank's contiguous share of ``n`` items (the first ``n % world`` ranks take one more)."""
    return share_of(n, rank())


def reduce_counts(counts: tuple[int, int]) -> tuple[int, int]:
    """Sum the (tokens, sequences) normalisers over ranks."""
    if not active():
        return counts
    t = torch.tensor(counts, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return int(t[0]), int(t[1])


def max_int(n: int) -> int:
    """The largest ``n`` over ranks."""
    if not active():
        return n
    t = torch.tensor([n], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t[0])


def agree_on_signal(stop_flag: dict) -> None:
    """Under torchrun, a signal any rank caught (``stop_flag["signal"]``) is set on every rank (no-op in one process):
    the ranks leave the loop after the same step and checkpoint together."""
    if active() and (signum := max_int(stop_flag.get("signal") or 0)):
        stop_flag["signal"] = signum


def gather(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if not active():
        return [obj]
    out: list = [None] * world()
    torch.distributed.all_gather_object(out, obj)
    return out


def merge_rank_stats(stats: list[dict], merge: Callable[[list[dict]], dict]) -> list[dict]:
    """The per-micro-batch stats of every rank merged into one record (unchanged in one process)."""
    if not active():
        return stats
    parts = [s for s in gather(merge(stats) if stats else {}) if s]
    return [merge(parts)] if parts else []


def scalar(t: torch.Tensor | float) -> float:
    """A float from a (possibly DTensor) scalar, e.g. ``clip_grad_norm_``'s total norm."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)


# ------------------------------------------------------------------------------------------------ full weights


def full_model(model: torch.nn.Module, to_main_cpu: bool = False) -> torch.nn.Module | None:
    """An unsharded ``Transformer`` with the current weights (a collective every rank enters); ``model`` itself in
    one process. The parameters are all-gathered one by one and assigned, never copied twice.

    ``to_main_cpu``: streamed to rank 0's CPU (each parameter gathered on the device, copied to the CPU, the device
    copy freed before the next: never two full copies on a device); the other ranks get None. For snapshots."""
    if not active():
        return model
    from torch.distributed.fsdp import FSDPModule

    from align.model import Transformer, rope_inv_freq

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # the root stays unsharded after a forward; gather from the shards
    cfg = model.config
    state = {}
    for name, p in model.named_parameters():  # tied: the embedding once
        state[name] = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if to_main_cpu:
            state[name] = state[name].cpu() if is_main() else None
    if to_main_cpu and not is_main():
        return None
    with torch.device("meta"):
        full = Transformer(cfg)
    full.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    if cfg.tie_word_embeddings:
        full.lm_head.weight = full.model.embed_tokens.weight
    device = next(iter(state.values())).device
    full.inv_freq = rope_inv_freq(cfg).to(device)
    return full.requires_grad_(False).eval()


def check_shared_dir(path: Any) -> None:
    """Under torchrun: ``path`` (the spool) must be one directory every rank can write. Each rank probes it, rank 0
    leaves a token the others must see; the verdicts are gathered, so every rank raises the same error (no rank
    waits at a later collective for one that already failed)."""
    import uuid
    from pathlib import Path

    if not active():
        return
    root = Path(path)
    token = root / f".rank0-probe-{uuid.uuid4().hex[:8]}" if is_main() else None
    problem = None
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: Spool.ensure refuses a group-writable one
        probe = root / f".probe-rank{rank()}-{uuid.uuid4().hex[:8]}"
        probe.write_text("ok")
        probe.unlink()
        if token is not None:
            token.write_text("ok")
    except OSError as e:
        problem = f"rank {rank()} cannot write the spool dir {root} ({e})"
    names = gather(token.name if token is not None else None)
    if problem is None and not (root / names[0]).is_file():
        problem = f"rank {rank()} does not see rank 0's files in {root} (not a shared filesystem)"
    problems = [p for p in gather(problem) if p]
    barrier()
    if token is not None:
        token.unlink(missing_ok=True)
    if problems:
        raise RuntimeError(
            f"--rollout spool under torchrun needs one spool directory every rank can write (--spool "
            f"on a shared filesystem): {'; '.join(problems)}"
        )


def share_of(n: int, r: int) -> tuple[int, int]:
    """``share`` of rank ``r``."""
    base, extra = divmod(n, world())
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


# ------------------------------------------------------------------------------------------------ checkpoints


def barrier() -> None:
    if active():
        torch.distributed.barrier()
