"""LoRA: low-rank adapters on the frozen linear layers of the decoder, saved and loaded in PEFT's format.

Key decisions
- ``LoRALinear`` subclasses ``align.model.Linear`` and keeps the frozen ``weight`` / ``bias`` under their
  Hugging Face names; the adapter adds ``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r) beside them.
  ``y = x W^T + b + (alpha / r) * B(A(dropout(x)))`` (Hu et al. 2021, "LoRA", eq. 3; PEFT's order of
  operations). A is Kaiming-uniform (PEFT's ``a=sqrt(5)``), B is zero, so step 0 equals the base model.
- Only the adapter is trainable (``requires_grad``); the base weights are frozen and never written.
- Sampling never merges into the frozen weights: the native sampler's packed copy is built from
  ``merged_weight()`` (one extra (out, in) GEMM of rank r per layer at pack time, no per-token cost), and
  an unpacked forward runs the low-rank path (2 extra thin GEMMs per layer and token).
- On disk an adapter is a PEFT directory: ``adapter_config.json`` + ``adapter_model.safetensors`` with
  PEFT's key names (``base_model.model.<align name>``, e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), committed by ``.complete``
  written last (vLLM's ``LoRARequest`` and ``peft.PeftModel.from_pretrained`` read it unchanged).
- The KL reference of a LoRA run is the policy itself inside ``adapters_disabled`` (the frozen base, PEFT's
  ``disable_adapter``): no second copy of the base weights.
- MoE experts (``--lora-experts``): align stores each expert as its own module (``align.moe.Expert``), so an
  expert projection is adapted like any linear, one (A, B) pair per expert and projection, under PEFT's per-module
  names (``...mlp.experts.3.gate_proj.lora_A.weight``: PEFT on per-expert checkpoints, vLLM's MoE LoRA layout).
  The target names are the roles gate_proj / up_proj / down_proj (Mixtral's w1 / w3 / w2 follow). Without the
  flag experts stay frozen and unadapted; an adapter file whose tensors include experts turns it on when loaded.

Shapes: E in_features, O out_features, r rank.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from align.atomic import commit_dir
from align.model import Linear, Transformer, check_weight, rope_inv_freq, save_pretrained
from align.options import flag  # the one definition of a flag's help

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_ROLES = ("gate_proj", "up_proj", "down_proj")  # align.moe.Expert.names order: (gate, up, down)
EXPERT_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's expert names -> roles
ALL_LINEAR = "all-linear"  # PEFT's spelling: every linear layer of the decoder (not embeddings, not lm_head)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel(LoraModel(model)): the align name follows this prefix
# adapter_config.json values align does not implement; a PEFT adapter using them is refused by name.
UNSUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
    "fan_in_fan_out": False,
}


@dataclass
class LoraConfig:
    """LoRA settings (CLI: ``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``,
    ``--lora-experts``)."""

    rank: int = flag(0, "LoRA rank r (0 = full fine-tune).")
    alpha: float | None = flag(None, "LoRA alpha; the update is scaled by alpha / r (None: alpha = r).")
    dropout: float = flag(0.0, "Dropout on the adapter's input while training.")
    targets: str = flag(
        ALL_LINEAR,
        f"Comma-separated linear names to adapt, e.g. q_proj,v_proj ('{ALL_LINEAR}': {','.join(DECODER_LINEARS)}).",
    )
    experts: bool = flag(
        False,
        "MoE: adapt the experts' projections too (one A/B pair per expert; the targets among gate_proj, up_proj, "
        "down_proj name them, Mixtral's w1/w3/w2 included); off: attention and dense MLPs only.",
    )

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"--lora-rank must be >= 0 (0 = full fine-tune), got {self.rank}")
        if self.rank == 0:
            given = {k: v for k, v in (("alpha", self.alpha), ("dropout", self.dropout or None)) if v is not None}
            if self.targets != ALL_LINEAR:
                given["targets"] = self.targets
            if self.experts:
                given["experts"] = ""
            if given:
                flags = ", ".join(f"--lora-{k} {v}".rstrip() for k, v in given.items())
                raise ValueError(f"{flags} given but --lora-rank is 0 (LoRA off): set --lora-rank > 0 or drop them")
            return
        if self.alpha is not None and not (0 < self.alpha < math.inf):
            raise ValueError(f"--lora-alpha must be > 0 and finite, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        names = self.target_names()
        if not names:
            raise ValueError(f"--lora-targets {self.targets!r} names no layer; e.g. q_proj,v_proj or {ALL_LINEAR}")
        bad = [n for n in names if n not in DECODER_LINEARS]
        if bad:
            raise ValueError(
                f"--lora-targets {','.join(bad)} matches no linear layer of the decoder; choose from "
                f"{','.join(DECODER_LINEARS)} (or {ALL_LINEAR}); embeddings and lm_head are not adapted"
            )
        if self.experts and not set(names) & set(EXPERT_ROLES):
            raise ValueError(
                f"--lora-experts with --lora-targets {self.targets!r}: no expert projection is a target; add one of "
                f"{','.join(EXPERT_ROLES)} or drop --lora-experts"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def target_names(self) -> list[str]:
        if self.targets.strip() == ALL_LINEAR:
            return list(DECODER_LINEARS)
        return [t.strip() for t in self.targets.split(",") if t.strip()]


class LoRALinear(Linear):
    """A frozen linear (the original ``weight`` / ``bias`` Parameters, same names) plus a rank-r adapter."""

    adapter_enabled = True  # False inside ``adapters_disabled``: the layer is its frozen base

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float, generator=None):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: nothing is copied
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev, dtype=dt)  # weight (r, E)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev, dtype=dt)  # weight (O, r)
        if dev.type != "meta":
            with torch.no_grad():
                a = torch.empty(rank, base.in_features)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # PEFT's init of A
                self.lora_A.weight.copy_(a)
                self.lora_B.weight.zero_()
        self.rank, self.scaling, self.dropout = rank, scaling, dropout

    def unpacked(self, x: torch.Tensor) -> torch.Tensor:
        y = super().unpacked(x)  # the frozen layer exactly as the base model runs it (align.cpu_linear)
        if not self.adapter_enabled:
            return y
        h = F.dropout(x, self.dropout) if self.dropout and self.training and torch.is_grad_enabled() else x
        return y + self.lora_B(self.lora_A(h)) * self.scaling

    def effective_weight(self) -> torch.Tensor:
        """``W + scaling * B @ A`` with autograd (A and B get their gradients through it): the weight a grouped
        expert GEMM runs with (``align.moe``). Refused while dropout is active (only the per-expert loop applies it)."""
        if not self.adapter_enabled:
            return self.weight
        if self.dropout and self.training and torch.is_grad_enabled():
            raise RuntimeError("a LoRA expert with active dropout runs in the per-expert loop, not the grouped GEMM")
        return self.weight + (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A (O, E), detached."""
        with torch.no_grad():
            return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B @ A (O, E) as a new tensor; the frozen weight is left untouched (PEFT's merge)."""
        with torch.no_grad():
            return self.weight + self.delta_weight()


# ----------------------------------------------------------------------------------------------- model


def apply_lora(
    model: Transformer, cfg: LoraConfig, *, base_model: str | os.PathLike | None = None, seed: int = 0
) -> Transformer:
    """Wrap ``cfg``'s target linears of every decoder layer in ``LoRALinear`` and freeze everything else.

    ``base_model`` (the checkpoint's path or hub name) is written as ``base_model_name_or_path`` and checked
    by ``load_adapter``. A and B are drawn from ``seed``, so the same seed gives the same adapter."""
    if not cfg.enabled:
        raise ValueError("apply_lora needs a LoraConfig with rank > 0 (rank 0 is the full fine-tune)")
    if is_lora(model):
        raise ValueError("the model already has LoRA adapters; load or build it from the base model")
    names = set(cfg.target_names())
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, getattr(layer, "mlp", None) or nn.Module()):  # Mixtral: block_sparse_moe
            for name, child in list(parent.named_children()):
                if name in names and isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, cfg.rank, cfg.scaling, cfg.dropout, generator=g))
                    wrapped += 1
        for expert in expert_modules(layer) if cfg.experts else ():
            for role, name in zip(EXPERT_ROLES, expert.names):
                if role in names:
                    child = getattr(expert, name)
                    setattr(expert, name, LoRALinear(child, cfg.rank, cfg.scaling, cfg.dropout, generator=g))
                    wrapped += 1
    if not wrapped:
        raise ValueError(f"--lora-targets {cfg.targets!r} matches no linear layer of this model")
    if cfg.experts and not any(expert_modules(layer) for layer in model.model.layers):
        raise ValueError(
            f"--lora-experts on a dense {model.config.model_type!r} model: it has no experts; drop the flag"
        )
    model.lora_config = cfg
    model.lora_base = None if base_model is None else str(base_model)
    return model


def expert_modules(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's MoE experts (``align.moe.Expert``: an ``experts`` list under the layer's sparse block)."""
    return [e for n, m in layer.named_modules() if n.endswith("experts") for e in m if hasattr(e, "names")]


def is_lora(model: nn.Module) -> bool:
    return getattr(model, "lora_config", None) is not None


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block ``model`` is its frozen base: every adapter's low-rank path is off (PEFT's
    ``disable_adapter``). The KL reference of a LoRA run. A model without adapters is unchanged."""
    mods = list(lora_modules(model).values())
    before = [m.adapter_enabled for m in mods]
    for m in mods:
        m.adapter_enabled = False
    try:
        yield model
    finally:
        for m, was in zip(mods, before):
            m.adapter_enabled = was


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should own: the adapters in LoRA mode, every parameter otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's key names, contiguous, on the CPU."""
    state = {}
    for name, m in lora_modules(model).items():
        for part in ("lora_A", "lora_B"):
            state[f"{PEFT_PREFIX}{name}.{part}.weight"] = getattr(m, part).weight.detach().contiguous().cpu()
    return state


def merged_model(model: Transformer) -> Transformer:
    """A plain ``Transformer`` whose linears hold ``W + scaling * B @ A`` (for ``--merge-lora`` exports and
    references). Shares every non-adapted tensor with ``model``; ``model`` is unchanged."""
    state = {k: v.detach() for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, m in lora_modules(model).items():
        state[f"{name}.weight"] = m.merged_weight()
    cfg = model.config
    with torch.device("meta"):
        plain = Transformer(cfg)
    plain.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        plain.lm_head.weight = plain.model.embed_tokens.weight
    plain.inv_freq = rope_inv_freq(cfg).to(model.lm_head.weight.device)
    plain.gradient_checkpointing = model.gradient_checkpointing
    return plain.train(model.training)


# ----------------------------------------------------------------------------------------------- files


def adapter_config(model: Transformer) -> dict:
    cfg: LoraConfig = model.lora_config
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora_modules(model)})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model.lora_base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha if cfg.alpha is not None else cfg.rank,
        "lora_dropout": cfg.dropout,
        "target_modules": targets,
        "inference_mode": True,
        "init_lora_weights": True,
        "revision": None,
        **UNSUPPORTED,
    }


def save_adapter(model: Transformer, path: str | os.PathLike) -> Path:
    """Write ``model``'s adapter as a PEFT directory, atomically: into a temporary sibling, ``.complete``
    last, then renamed onto ``path`` (an existing directory there is replaced)."""
    from safetensors.torch import save_file

    if not is_lora(model):
        raise ValueError("save_adapter needs a LoRA model (apply_lora or load_adapter first)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(adapter_state_dict(model), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(model), indent=2))
        commit_dir(tmp, path, {"format": "align-lora"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_adapter_config(path: str | os.PathLike) -> LoraConfig:
    """The ``LoraConfig`` of a PEFT adapter directory; a feature align does not implement is a ValueError."""
    path = Path(path)
    cfg_path = path / ADAPTER_CONFIG
    if not cfg_path.is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{path} is not a PEFT adapter directory: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e})") from e
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {raw.get('peft_type')!r} is not supported; align loads LORA adapters")
    for key, default in UNSUPPORTED.items():
        value = raw.get(key, default)
        empty = (None, {}, [])
        if value != default and not (value in empty and default in empty):
            raise ValueError(f"{cfg_path}: {key}={raw[key]!r} is not supported by align's LoRA (needs {default!r})")
    if raw.get("target_parameters"):
        raise ValueError(
            f"{cfg_path}: target_parameters={raw['target_parameters']!r} (PEFT's adapters on fused expert tensors, "
            "transformers >= 5) are not read by align: its expert adapters use per-expert module names "
            "(experts.N.gate_proj.lora_A.weight), which PEFT loads onto fused experts too; train with --lora-experts"
        )
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets in DECODER_LINEARS or targets == ALL_LINEAR else None
    experts = any(t in EXPERT_ALIASES for t in targets or ()) or _has_expert_tensors(path / ADAPTER_WEIGHTS)
    targets = sorted({EXPERT_ALIASES.get(t, t) for t in targets}) if targets else targets
    if not targets:
        raise ValueError(f"{cfg_path}: target_modules {raw.get('target_modules')!r} must be a list of linear names")
    values = {"r": raw.get("r"), "lora_alpha": raw.get("lora_alpha"), "lora_dropout": raw.get("lora_dropout", 0.0)}
    for key, v in values.items():  # JSON numbers only: "x", null, true would fail later, unnamed
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (key == "r" and not isinstance(v, int)):
            raise ValueError(f"{cfg_path}: {key}={v!r} must be {'an int' if key == 'r' else 'a number'}")
    return LoraConfig(
        rank=values["r"],
        alpha=float(values["lora_alpha"]),
        dropout=float(values["lora_dropout"]),
        targets=",".join(sorted(targets)),
        experts=experts,
    )


def _has_expert_tensors(weights: Path) -> bool:
    """Whether an adapter file holds MoE expert adapters (read from its header: no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            names = f.keys()  # the header's tensor names
        return any(".experts." in k for k in names)
    except SafetensorError as e:
        raise ValueError(f"{weights} is not a readable safetensors file ({e})") from None


def adapter_base(path: str | os.PathLike) -> str | None:
    """``base_model_name_or_path`` of an adapter directory."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")


def _same_base(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return a.rstrip("/") == b.rstrip("/")


def load_adapter(
    model: Transformer, path: str | os.PathLike, *, base_model: str | os.PathLike | None = None
) -> Transformer:
    """Load a PEFT adapter directory into ``model`` (wrapping it with ``apply_lora`` first if needed).

    ``base_model`` (default: the one ``model`` was wrapped with) must be the adapter's
    ``base_model_name_or_path`` when both are known; every tensor must exist in the model with its shape,
    and every adapted layer must get its tensors. Anything else raises ValueError naming the mismatch."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_adapter_config(path)
    base = str(base_model) if base_model is not None else getattr(model, "lora_base", None)
    recorded = adapter_base(path)
    if base and recorded and not _same_base(base, recorded):
        raise ValueError(
            f"adapter {path} was trained on base model {recorded!r}, but the loaded model is {base!r}: load the "
            f"adapter on its base model (or pass base_model= the path it names if the model moved)"
        )
    if is_lora(model):
        have: LoraConfig = model.lora_config
        if (have.rank, sorted(have.target_names()), have.experts) != (
            cfg.rank,
            sorted(cfg.target_names()),
            cfg.experts,
        ):
            raise ValueError(
                f"adapter {path} has rank {cfg.rank} on {cfg.targets} (experts: {cfg.experts}), the model's adapters "
                f"have rank {have.rank} on {have.targets} (experts: {have.experts}): load it into the base model instead"
            )
        for m in lora_modules(model).values():
            m.scaling = cfg.scaling
        model.lora_config = cfg
    else:
        apply_lora(model, cfg, base_model=base or recorded)
    try:
        state = load_file(str(path / ADAPTER_WEIGHTS))
    except SafetensorError as e:  # a truncated or corrupt header / data: named, with the file
        raise ValueError(f"{path / ADAPTER_WEIGHTS} is not a readable safetensors file ({e})") from None
    params = {f"{PEFT_PREFIX}{n}": p for n, p in model.named_parameters() if ".lora_" in n}
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise ValueError(
            f"adapter {path} has tensors the model does not ({unknown[:3]}{' ...' if len(unknown) > 3 else ''}): "
            f"it was trained on a different base model (base_model_name_or_path={recorded!r})"
        )
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"adapter {path} lacks tensors for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    with torch.no_grad():
        for key, t in state.items():
            p = params[key]
            if t.shape != p.shape:
                raise ValueError(
                    f"adapter tensor {key} in {path} has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}: "
                    f"the adapter was trained on a different base model (base_model_name_or_path={recorded!r})"
                )
            p.copy_(check_weight(t.to(p.dtype), key, path / ADAPTER_WEIGHTS, t.dtype))
    if base_model is not None:
        model.lora_base = str(base_model)
    return model


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def save_policy(model: Transformer, path: str | os.PathLike, *, merge: bool = False, **hf_kw: Any) -> Path:
    """Export a policy: a full model as an HF dir; a LoRA model as its PEFT adapter dir, or with ``merge`` as a
    merged full HF dir (``--save-hf`` / ``--merge-lora``, eval snapshots, rollout weight sync). ``hf_kw`` go to
    ``save_pretrained`` (e.g. ``copy_tokenizer_from``) when a full HF dir is written."""
    if not is_lora(model):
        return save_pretrained(model, path, **hf_kw)
    return save_pretrained(merged_model(model), path, **hf_kw) if merge else save_adapter(model, path)


def worker_args(model: Transformer) -> list[str]:
    """Extra ``rollout_worker.py`` flags: ``--max-lora-rank r`` for a LoRA policy (vLLM's ``enable_lora``)."""
    return ["--max-lora-rank", str(model.lora_config.rank)] if is_lora(model) else []
