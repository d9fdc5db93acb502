"""The native sampler's decode step on CUDA as a captured CUDA graph (gpt-fast's approach), with eager fallback.

Why: a small model's decode step on a GPU is a few hundred tiny kernel launches per token (launch-bound: the GPU
idles between them). Captured once for a fixed (rows, cache length) shape and replayed, a step is one launch.

How (``StaticDecode``):
- a static KV cache: ``align.attention.KVCache`` indexed by ``slot`` (a device tensor), so the new token is written
  with ``index_copy_`` and attention reads the whole buffer under the ``valid`` mask: every shape and address is
  the same from step to step. The model code is the same one the CPU runs (``Attention`` calls ``cache.write``);
- static input buffers (tokens, positions, the write slot) that each step copies into before ``replay()``; the
  graph's output is the step's (R, V) logits;
- the graph is the model's forward for one token per row only; sampling (one uniform per row per step,
  ``native.sample_next``) stays outside, eager, on the sampler's own ``torch.Generator`` (no graph-safe RNG needed);
- capture after a warm-up on a side stream, the same stream for the capture (cuBLAS handles and workspaces are
  made before capture, not inside it), under autocast with its weight cache off (a cached bf16 copy of a weight
  would be baked into the graph and go stale when the optimizer updates the weights in place).

Which shapes: rows exactly (a training run samples ``prompts_per_step * G`` rows every step), the cache length
bucketed up to a power of two (at least ``MIN_CACHE``, at most the model's context), so varying prompt lengths and
``max_tokens`` reuse one graph. At most ``MAX_GRAPHS`` shapes per model are kept; others run eager. Finished rows
are not compacted on the graph path (the shape is fixed; on a launch-bound GPU the dead rows are nearly free).

Eager (the plain ``native`` loop), said once per reason in the log: off CUDA, ``ALIGN_CUDA_GRAPHS=0``, MoE models
(routing is data-dependent), sliding-window attention, more than ``MAX_ROWS`` rows, more shapes than
``MAX_GRAPHS``, and a capture that fails (an op that cannot be captured, out of memory): that shape runs eager
from then on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable

import torch
from torch import nn

from align.attention import KVCache
from align.moe import moe_layers

MIN_CACHE = 256  # the smallest cache length bucket
MAX_ROWS = 512  # more rows than this: eager (a graph's static buffers and logits grow with the rows)
MAX_GRAPHS = 8  # captured shapes kept per model; a ninth shape runs eager
WARMUP_STEPS = 3  # eager steps on the capture stream before capturing
ENV = "ALIGN_CUDA_GRAPHS"  # "0": never capture

log = logging.getLogger(__name__)
_said: set[str] = set()  # reasons already logged (once per process each)
_graphs: weakref.WeakKeyDictionary[nn.Module, dict[tuple, StaticDecode | None]] = weakref.WeakKeyDictionary()


def cache_bucket(needed: int, context: int) -> int:
    """The static cache length for ``needed`` slots: the next power of two, at least ``MIN_CACHE``, capped at the
    model's ``context`` (max_position_embeddings) unless ``needed`` is beyond it (a prompt plus ``max_tokens``
    past the context: such rows stop at the context, the slots after it are never written)."""
    size = max(MIN_CACHE, 1 << (needed - 1).bit_length())
    return size if size <= context else max(needed, context)


def eager_reason(device: torch.device, cfg, rows: int) -> str | None:
    """Why this call decodes eagerly, or None when its shape may run as a CUDA graph."""
    if device.type != "cuda":
        return f"{device.type} device"
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if moe_layers(cfg):
        return "MoE routing is data-dependent"
    if cfg.sliding_window:
        return "sliding-window attention"
    if rows > MAX_ROWS:
        return f"{rows} rows > {MAX_ROWS}"
    return None


def say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        log.warning("native sampler: eager decode, no CUDA graph (%s)", reason)


def capture(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``step``'s CUDA work captured in a graph: WARMUP_STEPS eager runs on a side stream, then the capture on that
    same stream. Returns a replay that returns the captured output tensor (overwritten by every replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


class StaticDecode:
    """A static KV cache of ``rows`` x ``cache_len`` slots and the one-token decode step on it, captured."""

    def __init__(self, model: nn.Module, rows: int, cache_len: int, dtype: torch.dtype, device: torch.device):
        self._model = weakref.ref(model)  # the graph reads the weights by address; this keeps no model alive
        self.weights = weight_addresses(model)
        self.cache = KVCache(model.config, rows, cache_len, dtype, device)
        self.cache.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.cache.valid[:, 0] = True  # the warm-up and capture attend to one valid slot (never an all-masked row)
        autocast = torch.is_autocast_enabled(device.type)
        self.autocast = (device.type, torch.get_autocast_dtype(device.type)) if autocast else None
        with self._no_weight_cache():
            self.replay = capture(self._forward)

    def _no_weight_cache(self) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast[0], dtype=self.autocast[1], cache_enabled=False)

    def _forward(self) -> torch.Tensor:
        return self._model()(self.tok, positions=self.pos, cache=self.cache)[:, -1]  # (R, V)

    def load(self, cache: KVCache) -> None:
        """Take over an (R, S) prefilled cache (``cache.length`` slots used): its keys, values and valid slots."""
        S = cache.length
        self.cache.k[:, :, :, :S].copy_(cache.k[:, :, :, :S])
        self.cache.v[:, :, :, :S].copy_(cache.v[:, :, :, :S])
        self.cache.valid.zero_()
        self.cache.valid[:, :S].copy_(cache.valid[:, :S])
        self.cache.length = S

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Feed tokens (R,) at positions (R,), written at slot ``cache.length`` (the caller marks it valid first and
        advances ``cache.length`` after, as for the model's own call); returns the (R, V) logits, a static buffer
        the next step overwrites."""
        self.tok.copy_(tok[:, None])
        self.pos.copy_(pos[:, None])
        self.cache.slot.fill_(self.cache.length)
        with self._no_weight_cache():
            return self.replay()


def weight_addresses(model: nn.Module) -> tuple[int, ...]:
    """Where the parameters live: a graph replays reads of these addresses, so a model whose parameters were
    replaced (not updated in place, as the optimizer does) needs a new capture."""
    return tuple(p.data_ptr() for p in model.parameters())


def decoder(model: nn.Module, rows: int, needed: int, dtype: torch.dtype, device: torch.device) -> StaticDecode | None:
    """The captured decode step for ``rows`` rows and ``needed`` cache slots (made on first use, kept per model), or
    None: decode eagerly (the reason logged once)."""
    reason = eager_reason(device, model.config, rows)
    if reason is not None:
        if device.type == "cuda":
            say_once(reason)
        return None
    size = cache_bucket(needed, model.config.max_position_embeddings)
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    key = (rows, size, dtype, autocast, str(device))
    shapes = _graphs.setdefault(model, {})
    if shapes.get(key) is not None and shapes[key].weights != weight_addresses(model):
        del shapes[key]  # parameters replaced (load_state_dict(assign=True), .to()): capture again
    if key not in shapes:
        if len(shapes) >= MAX_GRAPHS:
            say_once(f"more than {MAX_GRAPHS} decode shapes for one model")
            return None
        try:
            shapes[key] = StaticDecode(model, rows, size, dtype, device)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # an op that cannot be captured, out of memory
            shapes[key] = None  # this shape runs eager from now on
            say_once(f"capturing {rows} rows x {size} slots failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return shapes[key]


def captured(model: nn.Module) -> list[tuple]:
    """The shapes captured for ``model``: (rows, cache length, dtype, autocast dtype, device) each."""
    return [k for k, v in _graphs.get(model, {}).items() if v is not None]
