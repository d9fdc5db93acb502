"""Training checkpoints: atomic directories committed by a marker, keep-last-K, exact resume.

``{run}/checkpoints/step_{N}/`` holds ``model/`` (an HF snapshot, loadable by transformers and vLLM;
with LoRA ``adapter/`` instead, a PEFT adapter dir on the run's base model) and ``trainer_state.pt`` (optimizer, scheduler, RNG states, data cursor). It is written under a
temporary name and renamed into place after its ``.complete`` marker; a directory without the
marker (a crash mid-write) is never loaded and is removed on the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

from align.model import COMMIT_MARKER, Transformer, save_pretrained

STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


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


def load_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "trainer_state.pt", weights_only=False)
