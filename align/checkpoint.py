"""Training checkpoints: atomic directories committed by a marker, keep-last-K, exact resume.

``{run}/checkpoints/step_{N}/`` holds ``model/`` (an HF snapshot, loadable by transformers and vLLM;
with LoRA ``adapter/`` instead, a PEFT adapter dir on the run's base model) and ``trainer_state.pt`` (optimizer, scheduler, RNG states, data cursor). It is written under a
temporary name and renamed into place after its ``.complete`` marker; a directory without the
marker (a crash mid-write) is never loaded and is removed on the next save.

``trainer_state.pt`` holds only tensors and plain data (dict / list / tuple / int / float / str / bool /
None): the numpy RNG state is stored as a tensor plus ints, so the file is read with
``torch.load(weights_only=True)`` and a crafted pickle can never run code on resume. A checkpoint that
cannot be read (truncated, tampered, optimizer state of another model) raises ``CheckpointError`` naming
the file and the ``--resume-from step_N`` of the previous committed checkpoint.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

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


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if m and (d / COMMIT_MARKER).is_file():
            out.append((int(m.group(1)), d))
    return sorted(out)


def save(root: Path, step: int, model: Transformer, trainer_state: dict, keep: int) -> Path:
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
        (tmp / COMMIT_MARKER).write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
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
    loaded or garbage-collected), so the resumed run's new ``step_M`` cannot mix with them."""
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
    return state


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
