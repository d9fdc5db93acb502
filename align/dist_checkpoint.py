"""Sharded checkpoints under ``torchrun``: ``torch.distributed.checkpoint`` (DCP), each rank writes its own shards.

Layout of ``{run}/checkpoints/step_{N}/`` written by N > 1 ranks (a single process keeps ``align.checkpoint``'s
format: ``model/`` HF snapshot + ``trainer_state.pt``)::

    dcp/                 DCP: model + optimizer state, one ``__{rank}_0.distcp`` file per rank and ``.metadata``
    rng_rank{r}.pt       rank r's torch / python / numpy RNG states (``torch.save`` of tensors and plain data)
    trainer_state.pt     rank 0: scheduler, data cursor, step, world size, model config, ``"format": "dcp"``
    .complete            written LAST by rank 0, after a barrier every rank reaches once its files are fsynced

Commit protocol (the single-process one, made collective): rank 0 creates ``.step_{N}.tmp-XXXX`` and broadcasts its
name; every rank writes its shards and RNG file into it (``dcp.save`` is itself a collective: rank 0 writes
``.metadata`` after every rank's plan); a barrier; rank 0 writes ``trainer_state.pt``, then the marker, then renames
the directory to ``step_{N}``; a second barrier. A rank killed at any point leaves a directory without the marker
(or under its temporary name): ``align.checkpoint.committed`` never lists it and the next save removes it, so a rerun
resumes from the previous committed step.

World size changes are DCP resharding: the state dict is addressed by parameter names (``get_state_dict``), so any
world size, one process included (DCP loads without a process group), reads what any other wrote. The other way
(torchrun resuming a single-process checkpoint) goes through ``align.dist.restore_optimizer``.

Never unpickle. DCP stores ``.metadata`` with ``pickle.dump`` and its stock ``FileSystemReader.read_metadata`` calls
``pickle.load`` (unrestricted: a crafted file runs code), and its ``DefaultLoadPlanner.load_bytes`` reads non-tensor
items (the optimizer's ``param_groups`` values) with ``torch.load(weights_only=False)``. Tensor data itself is read
with ``weights_only=True``. Here ``.metadata`` is read by ``MetadataUnpickler``, which resolves only the DCP metadata
dataclasses, ``torch.Size``, torch dtypes, the layout decoder and ``pathlib`` paths (anything else is refused with
``CheckpointError``), and byte items are read with ``torch.load(weights_only=True)``. So a tampered checkpoint can
make resume fail, never run code.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from align import dist
from align.atomic import COMMIT_MARKER
from align.checkpoint import CheckpointError, committed, rng_state, set_rng_state

FORMAT = "dcp"
DCP_DIR = "dcp"

# (module, name) pairs a DCP ``.metadata`` file may reference (torch 2.x FileSystemWriter); everything else is refused
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals a DCP ``.metadata`` needs (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} (not DCP checkpoint metadata)")


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.storage import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            try:
                with open(meta_path, "rb") as fh:
                    metadata = MetadataUnpickler(fh).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, OSError) as e:
                raise CheckpointError(f"{meta_path} cannot be read safely ({type(e).__name__}: {e}); the checkpoint "
                                      "is corrupt or was not written by align: resume from another one with "
                                      "--resume-from step_N, or start a fresh run") from None  # fmt: skip
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:  # the stock one unpickles (weights_only=False)
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def is_sharded(ckpt: Path) -> bool:
    """True for a checkpoint written by ``save`` under torchrun (a ``dcp/`` directory)."""
    return (ckpt / DCP_DIR).is_dir()


def _fsync(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _broadcast(obj: Any) -> Any:
    if not dist.active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def save(root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, trainer_state: dict,
         keep: int) -> Path:  # fmt: skip
    """Write and commit ``step_{step}`` (a collective every rank enters; see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = root / f"step_{step}"
    tmp = None
    if dist.is_main():
        root.mkdir(parents=True, exist_ok=True)
        for d in root.iterdir():  # leftovers of a crash (or a killed rank) mid-write
            if d.name.startswith(".step_") and ".tmp-" in d.name:
                shutil.rmtree(d, ignore_errors=True)
        tmp = root / f".step_{step}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    tmp = Path(_broadcast(str(tmp)))
    model_sd, optim_sd = get_state_dict(model, opt)
    writer = dcp.FileSystemWriter(str(tmp / DCP_DIR), sync_files=True)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=writer)
    rng_path = tmp / f"rng_rank{dist.rank()}.pt"
    torch.save(rng_state(), rng_path)
    _fsync(rng_path)
    dist.barrier()  # every rank's shards and RNG states are on disk
    if dist.is_main():
        state = {**trainer_state, "format": FORMAT, "optimizer": DCP_DIR, "step": step, "rng": rng_state(),
                 "world_size": dist.world(), "model_config": asdict(model.config)}  # fmt: skip
        torch.save(state, tmp / "trainer_state.pt")
        _fsync(tmp / "trainer_state.pt")
        (tmp / COMMIT_MARKER).write_text(str(step))  # last: commits the step
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in committed(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def check_model_config(ckpt: Path, state: dict, model: torch.nn.Module) -> None:
    """A sharded checkpoint must hold the model being trained (raised on every rank, before any collective)."""
    saved, cur = state.get("model_config"), asdict(model.config)
    if saved != cur:
        diff = {k: (saved.get(k), cur.get(k)) for k in cur if saved and saved.get(k) != cur.get(k)} or saved
        raise CheckpointError(f"{ckpt} was written for another model (checkpoint vs --model: {diff}); resume with "
                              "the --model that run used, or start a fresh run with a new --out")  # fmt: skip


def restore(ckpt: Path, state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load a sharded checkpoint's model and optimizer into ``model`` / ``opt`` (sharded or not: DCP reshards), and
    this rank's RNG states (rank 0's when the checkpoint had fewer ranks). Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    check_model_config(ckpt, state, model)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optimizer": optim_sd}
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(sd, storage_reader=_reader(ckpt / DCP_DIR), planner=_planner())
    except (CheckpointException, RuntimeError, OSError, ValueError, KeyError) as e:
        # DCP wraps every rank's failure (ours included: an unsafe .metadata) in a CheckpointException
        errors = [x for x, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
        if own := next((x for x in errors if isinstance(x, CheckpointError)), None):
            raise own from None
        first = errors[0] if errors else e
        raise CheckpointError(f"{ckpt / DCP_DIR} cannot be read ({type(first).__name__}: {first}); resume from "
                              "another committed checkpoint with --resume-from step_N, or start a fresh run") from None  # fmt: skip
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    own = ckpt / f"rng_rank{dist.rank()}.pt"
    if own.is_file():
        try:
            set_rng_state(torch.load(own, weights_only=True))
        except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
            raise CheckpointError(f"{own} cannot be read ({type(e).__name__}: {e}); resume from another "
                                  "committed checkpoint with --resume-from step_N") from None  # fmt: skip
    else:
        set_rng_state(state["rng"])


def save_any(root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, trainer_state: dict,
             keep: int) -> None:  # fmt: skip
    """The run's checkpoint: sharded (``save``) under torchrun, ``align.checkpoint``'s format in one process."""
    from align import checkpoint

    if dist.active():
        save(root, step, model, opt, trainer_state, keep)
    else:
        checkpoint.save(root, step, model, {"optimizer": opt.state_dict(), **trainer_state}, keep)


def restore_any(ckpt: Path, state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Optimizer (and, for a sharded checkpoint, model) state and RNG states of any checkpoint, at any world size;
    a single-process checkpoint's model was already loaded from its ``model/``."""
    if is_sharded(ckpt):
        restore(ckpt, state, model, opt)
    else:
        dist.restore_optimizer(model, opt, state, ckpt)
        set_rng_state(state["rng"])
