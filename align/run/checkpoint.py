"""Training checkpoints: atomic directories committed by a marker, keep-last-K, exact resume.

``{run}/checkpoints/step_{N}/`` holds ``model/`` (an HF snapshot, loadable by transformers and vLLM;
with LoRA ``adapter/`` instead, a PEFT adapter dir on the run's base model) and ``trainer_state.pt`` (optimizer, scheduler, RNG states, data cursor). It is written under a
temporary name and renamed into place after its ``.complete`` marker (which carries the step and the run id of
``{run}/run_id``); a directory without the marker (a crash mid-write) is never loaded and is removed on the next
save. A ``step_N`` that is a symlink or carries another run's id is never resumed from (``CheckpointError``) nor
deleted by the keep-last-K retention.

``trainer_state.pt`` holds only tensors and plain data (dict / list / tuple / int / float / str / bool /
None): the numpy RNG state is stored as a tensor plus ints, so the file is read with
``torch.load(weights_only=True)`` and a crafted pickle can never run code on resume. A checkpoint that
cannot be read (truncated, tampered, optimizer state of another model) raises ``CheckpointError`` naming
the file and the ``--resume-from step_N`` of the previous committed checkpoint.

Sharded checkpoints (torchrun):
Sharded checkpoints under ``torchrun``: ``torch.distributed.checkpoint`` (DCP), each rank writes its own shards.

Layout of ``{run}/checkpoints/step_{N}/`` written by N > 1 ranks (a single process keeps ``save_full``'s
format: ``model/`` HF snapshot + ``trainer_state.pt``)::

    dcp/                 DCP: model + optimizer state, one ``__{rank}_0.distcp`` file per rank and ``.metadata``
    rng_rank{r}.pt       rank r's torch / python / numpy RNG states (``torch.save`` of tensors and plain data)
    trainer_state.pt     rank 0: scheduler, data cursor, step, world size, model config, ``"format": "dcp"``
    .complete            written LAST by rank 0, after a barrier every rank reaches once its files are fsynced

Commit protocol (the single-process one, made collective): rank 0 creates ``.step_{N}.tmp-XXXX`` and broadcasts its
name; every rank writes its shards and RNG file into it (``dcp.save`` is itself a collective: rank 0 writes
``.metadata`` after every rank's plan); a barrier; rank 0 writes ``trainer_state.pt``, then the marker, then renames
the directory to ``step_{N}``; a second barrier. A rank killed at any point leaves a directory without the marker
(or under its temporary name): ``committed`` never lists it and the next save removes it, so a rerun
resumes from the previous committed step.

World size changes are DCP resharding: the state dict is addressed by parameter names (``get_state_dict``), so any
world size, one process included (DCP loads without a process group), reads what any other wrote. The other way
(torchrun resuming a single-process checkpoint) goes through ``restore_optimizer_any``.

Never unpickle. DCP stores ``.metadata`` with ``pickle.dump`` and its stock ``FileSystemReader.read_metadata`` calls
``pickle.load`` (unrestricted: a crafted file runs code), and its ``DefaultLoadPlanner.load_bytes`` reads non-tensor
items (the optimizer's ``param_groups`` values) with ``torch.load(weights_only=False)``. Tensor data itself is read
with ``weights_only=True``. Here ``.metadata`` is read by ``MetadataUnpickler``, which resolves only the DCP metadata
dataclasses, ``torch.Size``, torch dtypes, the layout decoder and ``pathlib`` paths (anything else is refused with
``CheckpointError``), and byte items are read with ``torch.load(weights_only=True)``. So a tampered checkpoint can
make resume fail, never run code.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from align import dist
from align.atomic import COMMIT_MARKER
from align.model import Transformer, save_pretrained

STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A committed checkpoint that cannot be resumed from; the message names the file and the way out."""


def rng_state() -> dict:
    """torch, python and numpy RNG states as tensors and plain data (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),  # (int, tuple of 625 ints, float | None)
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )


def _run_id(root: Path) -> str | None:
    """The id of the run whose checkpoints dir is ``root`` (``{out}/run_id``; None outside a run dir)."""
    from align.run.safety import run_id

    return run_id(root.parent, create=False)


def checkpoint_owner(ckpt: Path) -> str | None:
    """The run id a checkpoint's commit marker carries (None: a checkpoint written before markers carried one)."""
    try:
        marker = json.loads((ckpt / COMMIT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker.get("run_id") if isinstance(marker, dict) else None


def not_ours(ckpt: Path, rid: str | None) -> str | None:
    """Why step dir ``ckpt`` is not a checkpoint of run ``rid`` (None when it is, or cannot be told): a symlink (to
    another run's checkpoint, say) or a marker naming another run. Such a dir is never resumed from nor deleted."""
    if ckpt.is_symlink():
        return f"a symlink (to {os.readlink(ckpt)})"
    owner = checkpoint_owner(ckpt)
    if rid is not None and owner is not None and owner != rid:
        return f"a checkpoint of another run ({owner})"
    return None


def _refuse(ckpt: Path, why: str, rid: str | None) -> CheckpointError:
    return CheckpointError(
        f"{ckpt} is {why}, not a checkpoint of this run (run id {rid}, {ckpt.parent.parent / 'run_id'}): a run never "
        "resumes from nor deletes another run's checkpoint. Move it out of the run dir (a symlink: remove the link "
        "only), or use another --out"
    )


def committed(root: Path) -> list[tuple[int, Path]]:
    """This run's committed checkpoints under ``root``, oldest first (``not_ours`` ones left out)."""
    if not root.is_dir():
        return []
    rid, out = _run_id(root), []
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if m and (d / COMMIT_MARKER).is_file() and not_ours(d, rid) is None:
            out.append((int(m.group(1)), d))
    return sorted(out)


def _commit(tmp: Path, final: Path, step: int) -> None:
    """The marker (the step and this run's id) written last into ``tmp``, then ``tmp`` renamed to ``final``,
    replacing an older ``final`` of this run only."""
    rid = _run_id(final.parent)
    (tmp / COMMIT_MARKER).write_text(json.dumps({"step": step, "run_id": rid}))
    if final.exists() or final.is_symlink():
        if why := not_ours(final, rid):
            raise _refuse(final, why, rid)
        shutil.rmtree(final)
    os.replace(tmp, final)


def save_full(root: Path, step: int, model: Transformer, trainer_state: dict, keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for d in root.iterdir():  # leftovers of a crash mid-write
        if d.name.startswith(".step_") and ".tmp-" in d.name:
            shutil.rmtree(d, ignore_errors=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if getattr(model, "lora_config", None) is not None:  # LoRA: the adapter only; the base is the run's model
            from align.lora import save_adapter

            save_adapter(model, tmp / "adapter")
        else:
            save_pretrained(model, tmp / "model")
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
        with open(tmp / "trainer_state.pt", "rb+") as fh:
            os.fsync(fh.fileno())
        _commit(tmp, final, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in committed(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> tuple[int, Path] | None:
    found = committed(root)
    return found[-1] if found else None


def pick(root: Path, resume_from: str | None) -> tuple[int, Path] | None:
    """The checkpoint to resume from: the latest committed one, or ``resume_from`` ('step_N').

    With ``resume_from``, committed checkpoints after it are renamed ``abandoned_step_M`` (kept, never
    loaded or garbage-collected), so the resumed run's new ``step_M`` cannot mix with them. A ``step_N`` that is not
    this run's (``not_ours``: a symlink, another run's) is refused with ``CheckpointError``, never skipped."""
    rid = _run_id(root)
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if STEP_DIR.match(d.name) and (why := not_ours(d, rid)):
            raise _refuse(d, why, rid)
    found = committed(root)
    if resume_from is None:
        return found[-1] if found else None
    chosen = [(n, d) for n, d in found if d.name == resume_from]
    if not chosen:
        names = ", ".join(d.name for _, d in found) or "none"
        raise ValueError(
            f"--resume-from {resume_from!r}: no committed checkpoint of that name in {root} (committed: {names})"
        )
    for n, d in found:
        if n > chosen[0][0]:
            aside = d.with_name(f"abandoned_{d.name}.{uuid.uuid4().hex[:6]}")
            os.replace(d, aside)
            print(f"[align] --resume-from {resume_from}: moved the later checkpoint {d} aside to {aside}", flush=True)
    return chosen[0]


def _previous_hint(ckpt: Path) -> str:
    """How to resume from the committed checkpoint before ``ckpt`` (or start over when there is none)."""
    m = STEP_DIR.match(ckpt.name)
    earlier = [d for n, d in committed(ckpt.parent) if m and n < int(m.group(1))]
    if earlier:
        return f"resume from the previous committed checkpoint with --resume-from {earlier[-1].name}"
    return f"no earlier committed checkpoint exists; start a fresh run with a new --out (or remove {ckpt})"


def load_state(ckpt: Path) -> dict:
    """``trainer_state.pt`` of a committed checkpoint, read with ``weights_only=True`` (never unpickles code)."""
    path = ckpt / "trainer_state.pt"
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise CheckpointError(
                f"{path} cannot be read ({e}); the file is truncated or corrupt: {_previous_hint(ckpt)}"
            ) from None
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain data, refused (loading it could run code): "
            f"{_previous_hint(ckpt)}. (Trainer states written by align before weights-only checkpoints pickled the "
            f"numpy RNG state and are refused too: start a fresh run.) Details: {str(e).splitlines()[0]}"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:  # truncated / corrupt zip, missing file
        raise CheckpointError(
            f"{path} cannot be read ({type(e).__name__}: {e}); the file is truncated or corrupt: {_previous_hint(ckpt)}"
        ) from None
    missing = [k for k in ("optimizer", "scheduler", "rng", "cursor", "step") if k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: not an align trainer state; {_previous_hint(ckpt)}")
    cursor = state["cursor"]
    kinds = {  # what align writes; a hand-edited value fails here, by name, not mid-resume
        "step": isinstance(state["step"], int) and not isinstance(state["step"], bool) and state["step"] >= 0,
        "cursor": isinstance(cursor, dict) and all(type(cursor.get(k)) is int for k in ("epoch", "index")),
        # a sharded (DCP) checkpoint names its shard dir instead (``save_sharded``)
        "optimizer": isinstance(state["optimizer"], dict)
        or (state.get("format") == FORMAT and state["optimizer"] == DCP_DIR),
        "scheduler": isinstance(state["scheduler"], dict),
        "rng": isinstance(state["rng"], dict),
        "pending_batches": isinstance(state.get("pending_batches", []), list),
    }
    bad = [f"{k}={state.get(k)!r}" for k, ok in kinds.items() if not ok]
    if bad:
        raise CheckpointError(
            f"{path} has values align never writes ({', '.join(bad)[:300]}; step is an int >= 0, cursor "
            f"{{'epoch': int, 'index': int}}): the file was edited or is corrupt; {_previous_hint(ckpt)}"
        )
    return state


def load_adapter(model: Transformer, ckpt: Path) -> Transformer:
    """A LoRA checkpoint's ``adapter/`` into ``model``; an unreadable or foreign adapter names its file and the way
    out (``align.lora.load_adapter`` raises ValueError naming the mismatch)."""
    from safetensors import SafetensorError

    from align import lora

    try:
        return lora.load_adapter(model, ckpt / "adapter")
    except (ValueError, OSError, SafetensorError) as e:
        raise CheckpointError(
            f"{ckpt / 'adapter'} cannot be loaded ({type(e).__name__}: {e}); {_previous_hint(ckpt)}"
        ) from None


def load_model(ckpt: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> Transformer:
    """The policy of a committed checkpoint; an unreadable ``model/`` names its file and the way out."""
    from safetensors import SafetensorError

    from align.model import load_pretrained

    try:
        return load_pretrained(ckpt / "model", dtype=dtype, device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:  # truncated header / data, bad config
        raise CheckpointError(
            f"{_unreadable_file(ckpt / 'model')} cannot be read ({type(e).__name__}: {e}); the "
            f"checkpoint's model is truncated or corrupt: {_previous_hint(ckpt)}"
        ) from None


def _unreadable_file(model_dir: Path) -> Path:
    """The first weight file whose safetensors header does not cover the file (or the dir if all parse)."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                sf.keys()
        except (SafetensorError, OSError):
            return f
    return model_dir


def restore_optimizer(opt: torch.optim.Optimizer, state: dict, ckpt: Path) -> None:
    """Load the optimizer state, first checking every per-parameter tensor against the model's shapes."""
    path = ckpt / "trainer_state.pt"
    saved = state["optimizer"]
    params = [p for g in opt.param_groups for p in g["params"]]
    n_saved = sum(len(g["params"]) for g in saved.get("param_groups", []))
    if n_saved != len(params):
        raise CheckpointError(
            f"the optimizer state in {path} is for {n_saved} parameters, the model has "
            f"{len(params)}: the checkpoint belongs to another model; {_previous_hint(ckpt)}"
        )
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    for i, p in zip(ids, params):
        for k, t in saved["state"].get(i, {}).items():
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != p.shape:
                raise CheckpointError(
                    f"the optimizer state {k!r} of parameter {i} in {path} has shape "
                    f"{tuple(t.shape)}, the model's parameter has {tuple(p.shape)}: the checkpoint "
                    f"belongs to another model; {_previous_hint(ckpt)}"
                )
    opt.load_state_dict(saved)


# ------------------------------------------------------------------------------------------------ torchrun (DCP)

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
                raise CheckpointError(
                    f"{meta_path} cannot be read safely ({type(e).__name__}: {e}); the checkpoint "
                    "is corrupt or was not written by align: resume from another one with "
                    "--resume-from step_N, or start a fresh run"
                ) from None
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


def save_sharded(
    root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, trainer_state: dict, keep: int
) -> Path:
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
        state = {
            **trainer_state,
            "format": FORMAT,
            "optimizer": DCP_DIR,
            "step": step,
            "rng": rng_state(),
            "world_size": dist.world(),
            "model_config": asdict(model.config),
        }
        torch.save(state, tmp / "trainer_state.pt")
        _fsync(tmp / "trainer_state.pt")
        _commit(tmp, final, step)  # the marker last: commits the step
        for _, old in committed(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def check_model_config(ckpt: Path, state: dict, model: torch.nn.Module) -> None:
    """A sharded checkpoint must hold the model being trained (raised on every rank, before any collective)."""
    saved, cur = state.get("model_config"), asdict(model.config)
    if saved != cur:
        diff = {k: (saved.get(k), cur.get(k)) for k in cur if saved and saved.get(k) != cur.get(k)} or saved
        raise CheckpointError(
            f"{ckpt} was written for another model (checkpoint vs --model: {diff}); resume with "
            "the --model that run used, or start a fresh run with a new --out"
        )


def restore_sharded(ckpt: Path, state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
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
        raise CheckpointError(
            f"{ckpt / DCP_DIR} cannot be read ({type(first).__name__}: {first}); resume from "
            "another committed checkpoint with --resume-from step_N, or start a fresh run"
        ) from None
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    own = ckpt / f"rng_rank{dist.rank()}.pt"
    if own.is_file():
        try:
            set_rng_state(torch.load(own, weights_only=True))
        except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
            raise CheckpointError(
                f"{own} cannot be read ({type(e).__name__}: {e}); resume from another "
                "committed checkpoint with --resume-from step_N"
            ) from None
    else:
        set_rng_state(state["rng"])


def save_any(
    root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, trainer_state: dict, keep: int
) -> None:
    """The run's checkpoint: sharded (``save_sharded``) under torchrun, ``save_full``'s format in one process.
    A model holding a NaN / inf is never written (the retention ring would then delete the last good one)."""
    from align.learner import nonfinite_parameters

    bad = nonfinite_parameters(model)
    if dist.max_int(len(bad)):  # torchrun: any rank's shards
        raise CheckpointError(
            f"refusing to write checkpoint step_{step} under {root}: parameter(s) {bad[:3] or '(on another rank)'} "
            "hold NaN/inf; the last committed checkpoint is kept. Lower --lr or check the data and rewards, then "
            "resume from it"
        )
    if dist.active():
        save_sharded(root, step, model, opt, trainer_state, keep)
    else:
        save_full(root, step, model, {"optimizer": opt.state_dict(), **trainer_state}, keep)


def restore_any(ckpt: Path, state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Optimizer (and, for a sharded checkpoint, model) state and RNG states of any checkpoint, at any world size;
    a single-process checkpoint's model was already loaded from its ``model/`` (``load_pretrained`` refuses NaN /
    inf weights there). Then NaN / inf in what was loaded is refused (``refuse_nonfinite``)."""
    if is_sharded(ckpt):
        restore_sharded(ckpt, state, model, opt)
    else:
        restore_optimizer_any(model, opt, state, ckpt)
        set_rng_state(state["rng"])
    refuse_nonfinite(ckpt, model, opt)


def refuse_nonfinite(ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """A ``CheckpointError`` naming ``ckpt`` when the model's weights (a DCP checkpoint's shards) or the optimizer
    state loaded from it hold a NaN / inf: training on from it would only spread them (an AdamW moment of NaN makes
    its parameter NaN at the first step). torchrun: every rank checks its shards and all raise together."""
    from align.learner import nonfinite_parameters

    names = {id(p): n for n, p in model.named_parameters()}
    bad = [f"weight {n}" for n in nonfinite_parameters(model)]
    for p, s in opt.state.items():
        for k, t in s.items():
            local = t.to_local() if hasattr(t, "to_local") else t
            if isinstance(local, torch.Tensor) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
                bad.append(f"optimizer state {k!r} of {names.get(id(p), 'a parameter')}")
    if dist.max_int(len(bad)):
        what = ", ".join(bad[:3]) + (" and more" if len(bad) > 3 else "") if bad else "another rank's shards"
        raise CheckpointError(
            f"checkpoint {ckpt} holds NaN/inf in {what}: training on from it would spread them; {_previous_hint(ckpt)}"
        )


def restore_optimizer_any(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict, ckpt: Any) -> None:
    """Load a checkpoint's optimizer state (written by any world size) into ``opt``, sharded like ``model``."""
    if not dist.active():
        return restore_optimizer(opt, state, ckpt)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = state["optimizer"]
    fqns = _optimizer_fqns(model, opt)
    ids = [i for g in saved.get("param_groups", []) for i in g["params"]]
    if len(ids) != len(fqns):
        raise CheckpointError(
            f"the optimizer state in {ckpt} is for {len(ids)} parameters, the model has "
            f"{len(fqns)}: the checkpoint belongs to another model"
        )
    name = dict(zip(ids, fqns))
    full = {
        "state": {name[i]: s for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, opt, full, options=StateDictOptions(full_state_dict=True))


def _optimizer_fqns(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]
