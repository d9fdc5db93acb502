"""Non-finite numbers are never trained on or committed (issue 30): non-float or NaN/inf weights are refused at load
(model, LoRA adapter, checkpoint), an optimizer step with a non-finite loss or gradient norm is skipped and counted
(``nonfinite_steps``) and the run stops at ``--max-nonfinite-steps`` with its last checkpoint intact, a model holding
NaN is never checkpointed, and a reward float32 cannot hold is an error, not a crash mid-run. Each check has a
negative control that passes the check with the same setup."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers_train import PROMPTS, TOK, a_reward, cfg_for

from align import lora
from align.model import load_pretrained
from align.run import checkpoint as ckpt
from align.train import TrainConfig, train

SWAPPED = "model.embed_tokens.weight"


def run(cfg: TrainConfig, model: str, reward=a_reward) -> dict:
    return train(cfg, model=model, tokenizer=TOK, prompts=PROMPTS, reward=reward)


def swap_dtype(path: Path, prefix: str = "") -> str:
    """Rewrite the safetensors header of ``path`` so its first F32 tensor (``prefix`` + ``SWAPPED`` when present)
    reads as I32: same size, so the file still parses. Returns the tensor's name."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = prefix + SWAPPED if prefix + SWAPPED in header else next(k for k in header if k != "__metadata__")
    assert header[name]["dtype"] == "F32"
    header[name]["dtype"] = "I32"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # same length: the offsets stay valid
    path.write_bytes(data[:8] + raw + data[8 + n :])
    return name


def poison(path: Path, name: str) -> None:
    """Set one value of tensor ``name`` in safetensors file ``path`` to NaN (a valid file, a non-finite weight)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    state[name].view(-1)[0] = math.nan
    save_file(state, str(path), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------ at load


@pytest.mark.parametrize("fault", ["dtype", "nan"])
def test_model_weights_that_are_not_finite_floats_are_named(tmp_path, char_model, fault):
    model = tmp_path / "m"
    shutil.copytree(char_model, model)
    load_pretrained(model)  # negative control: the intact copy loads
    f = model / "model.safetensors"
    name = swap_dtype(f) if fault == "dtype" else SWAPPED
    if fault == "nan":
        poison(f, name)
    want = "is stored as torch.int32" if fault == "dtype" else "holds 1 non-finite value"
    with pytest.raises(ValueError, match=rf"tensor '{name}' in {f} {want}"):
        load_pretrained(model)


def lora_cfg(**kw) -> lora.LoraConfig:
    return lora.LoraConfig(**{"rank": 2, "targets": "q_proj,v_proj", **kw})


@pytest.mark.parametrize("fault", ["dtype", "nan"])
def test_adapter_weights_that_are_not_finite_floats_are_named(tmp_path, char_model, fault):
    policy = lora.apply_lora(load_pretrained(char_model), lora_cfg(), base_model=char_model, seed=0)
    adapter = lora.save_adapter(policy, tmp_path / "adapter")
    lora.load_adapter(load_pretrained(char_model), adapter)  # negative control: the intact adapter loads
    f = Path(adapter) / lora.ADAPTER_WEIGHTS
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        name = next(k for k in json.loads(fh.read(n)) if k != "__metadata__")
    if fault == "dtype":
        swap_dtype(f)
    else:
        poison(f, name)
    want = "is stored as torch.int32" if fault == "dtype" else "holds 1 non-finite value"
    with pytest.raises(ValueError, match=rf"tensor '{name}' in {f} {want}"):
        lora.load_adapter(load_pretrained(char_model), adapter)


def test_infinite_lora_alpha_is_refused():
    assert lora_cfg(alpha=1e30).scaling == 5e29  # large but finite: the step check below handles it
    for alpha in (math.inf, math.nan):
        with pytest.raises(ValueError, match="--lora-alpha must be > 0 and finite"):
            lora_cfg(alpha=alpha)


def test_resume_from_a_checkpoint_with_swapped_dtype_is_named(tmp_path, char_model):
    out = tmp_path / "run"
    run(cfg_for(out, steps=2), char_model)
    step2 = out / "checkpoints" / "step_2"
    ckpt.load_model(step2, torch.float32)  # negative control: the intact checkpoint loads
    f = step2 / "model" / "model.safetensors"
    name = swap_dtype(f)
    with pytest.raises(ckpt.CheckpointError, match=rf"(?s)tensor '{name}' in {f} is stored as torch.int32"):
        run(cfg_for(out, steps=4), char_model)
    assert [d.name for _, d in ckpt.committed(out / "checkpoints")] == ["step_2"]
