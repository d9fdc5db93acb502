"""On-policy distillation's teacher: ``--teacher DIR`` (``DistillConfig``), checked before the model loads, and its
logprobs of each step's batch, from a frozen model in this process or from a vLLM worker through a spool.

Per token of the student's own samples the advantage gains ``--teacher-coef * -(log mu(y_t) - log pi_teacher(y_t))``
(``align.advantages.add_teacher_signal``): the negated reverse KL(student || teacher) estimate, GKD with lambda = 1
(Agarwal et al. 2024) and Thinking Machines' on-policy distillation (2025). ``--distill-only`` trains on it alone: no
reward function runs for the training rollouts (every reward is the constant 0, so the group advantage is exactly 0);
the held-out eval still uses the task's reward when there is one.

Sources of the teacher's logprobs (same basis as the student's: ``log_softmax(logits / T)`` of each sampled token):

- in process (default): the teacher loaded frozen like the KL reference (``--precision``'s frozen dtype, FSDP-sharded
  under torchrun) and run through ``align.learner.reference_logprobs``: the fused head on the scored positions only;
- ``--teacher-worker``: a vLLM worker spawned on ``{out}/teacher_spool`` serving DIR, asked with ``score`` requests
  (``align.rollout.teacher_logprobs``: vLLM ``prompt_logprobs`` of the given ids, protocol 1.1). vLLM's prompt logprobs are
  before temperature, so this source needs ``--temperature 1``.

The teacher must tokenize as the student does (``check_tokenizers``): the same vocabulary size (model and tokenizer),
the same stop tokens and the same ids for a sample of strings (the task's prompts, fixed strings, every special token
of the student's tokenizer and a conversation rendered with its chat template); else an ``InputError`` naming both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.errors import InputError
from align.options import flag  # the one definition of a flag's help

SAMPLE_TEXTS = ("Hello, world!", " The answer is 42.", "a b\tc\n\nd", "x = f(y) + 3 * z", "ünïcødé ✓ 你好", "cabd=")
TEACHER_SPOOL = "teacher_spool"  # under --out


@dataclass
class DistillConfig:
    teacher: str | None = flag(
        None,
        "On-policy distillation: HF checkpoint dir of a teacher with the student's tokenizer; adds "
        "--teacher-coef * -(log mu - log pi_teacher) to each sampled token's advantage (reverse KL).",
    )
    teacher_coef: float = flag(1.0, "Weight of the teacher's per-token reverse-KL signal.")
    distill_only: bool = flag(False, "Train on the teacher signal alone: no reward is computed for the rollouts.")
    teacher_worker: bool = flag(
        False,
        "Score with a vLLM worker serving --teacher on {out}/teacher_spool (score requests, vLLM prompt_logprobs) "
        "instead of a frozen copy in this process; needs --temperature 1.",
    )
    teacher_gpu: int | None = flag(None, "GPU of the --teacher-worker (None = CPU build).")

    def __post_init__(self) -> None:
        if not (math.isfinite(self.teacher_coef) and self.teacher_coef >= 0):
            raise ValueError(f"--teacher-coef {self.teacher_coef!r} must be a finite number >= 0")
        if self.teacher is None and (self.distill_only or self.teacher_worker):
            flag = "--distill-only" if self.distill_only else "--teacher-worker"
            raise ValueError(f"{flag} needs --teacher DIR (the teacher's HF checkpoint directory)")
        if self.distill_only and self.teacher_coef == 0:
            raise ValueError("--distill-only with --teacher-coef 0 has no signal at all: raise --teacher-coef")
        if self.teacher_gpu is not None and self.teacher_gpu < 0:
            raise ValueError(f"--teacher-gpu {self.teacher_gpu} must be a GPU index >= 0 (or unset for the CPU build)")


# ------------------------------------------------------------------------------------------------ checks


def check_teacher(cfg: Any, student_dir: str, student_tok: Any, prompts: list[dict]) -> None:
    """Before any model loads: ``--teacher`` is an HF checkpoint whose tokenizer matches the student's."""
    from align.atomic import check_hf_dir

    d = cfg.distill
    if d.teacher is None:
        return
    try:
        check_hf_dir(d.teacher)  # config.json, and every safetensors file whole (a truncated one is named here)
    except ValueError as e:
        raise InputError(f"--teacher {d.teacher}: {e}") from None
    if not d.teacher_worker:
        check_fits(cfg, d.teacher, student_dir)
    if d.teacher_worker and cfg.temperature != 1.0:
        raise InputError(
            f"--teacher-worker scores with vLLM prompt logprobs, which are before temperature; "
            f"--temperature {cfg.temperature} needs the in-process teacher (drop --teacher-worker)"
        )
    from align.chat import load_tokenizer

    teacher_tok = load_tokenizer(d.teacher, d.teacher, flag="--teacher")
    texts = [*SAMPLE_TEXTS, *(p.get("prompt", "") for p in prompts[:16] if isinstance(p.get("prompt"), str))]
    check_tokenizers(student_dir, d.teacher, student_tok, teacher_tok, texts)


def _parameters(model_dir: str | None) -> int:
    """Parameters in ``model_dir``'s safetensors files, from their headers (0 without a model dir)."""
    from align.atomic import safetensors_header

    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir and Path(model_dir).is_dir() else []
    return sum(math.prod(v["shape"]) for f in files for k, v in safetensors_header(f).items() if k != "__metadata__")


def check_fits(cfg: Any, teacher_dir: str, student_dir: str | None) -> None:
    """The in-process teacher (frozen dtype) and the student (trained dtype) fit the free memory of ``--device``,
    counted from the safetensors headers before either loads (a lower bound: activations and the optimizer come on
    top); else an ``InputError`` naming ``--teacher`` and its size."""
    from align.device import available_memory, resolve

    place = resolve(cfg.device, cfg.precision)
    try:
        teacher, student = _parameters(teacher_dir), _parameters(student_dir)
    except (TypeError, KeyError, ValueError) as e:
        raise InputError(f"--teacher {teacher_dir}: a safetensors header without tensor shapes ({e})") from None
    t_bytes, s_bytes = teacher * place.frozen_dtype.itemsize, student * place.param_dtype.itemsize
    free = available_memory(place.device)
    if free is not None and t_bytes + s_bytes > free:
        gib = 1 << 30
        raise InputError(
            f"--teacher {teacher_dir}: its weights ({teacher:,} parameters: {t_bytes / gib:.1f} GiB as "
            f"{str(place.frozen_dtype).removeprefix('torch.')}) and the student's ({s_bytes / gib:.1f} GiB) need "
            f"{(t_bytes + s_bytes) / gib:.1f} GiB; {place.device} has {free / gib:.1f} GiB available. Use a smaller "
            "teacher, --teacher-worker (the teacher in its own vLLM process) or another --device"
        )


def check_tokenizers(student_dir: str, teacher_dir: str, student: Any, teacher: Any, texts: list[str]) -> None:
    """Refuse a teacher whose token ids mean something else than the student's (an ``InputError`` naming both)."""

    def vocab(d: str) -> object:
        return json.loads((Path(d) / "config.json").read_text()).get("vocab_size")

    problem = None
    if vocab(student_dir) != vocab(teacher_dir) or student.vocab_size != teacher.vocab_size:
        problem = (
            f"vocabulary sizes differ (model {vocab(student_dir)} vs {vocab(teacher_dir)}, tokenizer "
            f"{student.vocab_size} vs {teacher.vocab_size})"
        )
    elif _stops(student) != _stops(teacher):
        problem = f"stop tokens differ ({_stops(student)} vs {_stops(teacher)})"
    else:
        for text in [*texts, *_special_texts(student)]:
            a, b = _ids(student, text), _ids(teacher, text)
            if a != b:
                problem = f"{str(text)[:60]!r} encodes as {str(a)[:80]} vs {str(b)[:80]}"
                break
    if problem:
        raise InputError(
            f"--teacher {teacher_dir} does not tokenize as the student {student_dir}: {problem}. On-policy "
            "distillation compares both models' logprobs of the same token ids: use a teacher of the same tokenizer"
        )


def _stops(tok: Any) -> list[int]:
    eos = getattr(tok, "eos_token_id", None)
    return sorted(eos) if isinstance(eos, (list, tuple)) else [eos]


def _ids(tok: Any, text: Any) -> list[int] | str:
    try:
        return list(tok.encode(text))
    except (ValueError, KeyError) as e:  # a char tokenizer refuses characters outside its alphabet
        return f"refused ({type(e).__name__})"


def _special_texts(tok: Any) -> list[Any]:
    """The tokenizer's special tokens alone and together, and a short conversation in its chat template."""
    path = getattr(tok, "directory", None)
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return []
    added = json.loads((Path(path) / "tokenizer.json").read_text()).get("added_tokens") or []
    specials = [t["content"] for t in added if isinstance(t, dict) and isinstance(t.get("content"), str)]
    out: list[Any] = [*specials, "".join(specials)]
    if getattr(tok, "chat_template", None) is not None:
        chat = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}]
        out.append(tok.render_chat(chat))
    return out


# ------------------------------------------------------------------------------------------------ sources


class InProcessTeacher:
    """The frozen teacher in this process; called as ``align.learner.Teacher``."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, batch: Any, cfg: Any, place: Any, rows: Any) -> Any:
        from align.learner import reference_logprobs

        return reference_logprobs(self.model, batch, cfg, place, rows)

    def close(self) -> None:
        self.model = None


class WorkerTeacher:
    """A vLLM worker serving the teacher; each call is one ``score`` request of the batch's (or ``rows``') sequences."""

    def __init__(self, client: Any, worker: Any = None) -> None:
        self.client, self.worker = client, worker

    def __call__(self, batch: Any, cfg: Any, place: Any, rows: Any) -> Any:
        import torch

        from align.learner import row_lengths
        from align.rollout.teacher_logprobs import score

        sel = list(range(batch.mask.shape[0])) if rows is None else rows.tolist()
        lengths = row_lengths(batch.mask)
        seqs, starts = [], []
        for i in sel:
            n = lengths[i]
            ids = batch.inputs[i, :n].tolist() + [int(batch.targets[i, n - 1])] if n else []
            first = int(batch.mask[i, :n].int().argmax()) if n else 0
            seqs.append(ids)
            starts.append(first + 1)  # input position p predicts target p, token p + 1 of the sequence
        out = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)  # (N, L)
        keep = [k for k, s in enumerate(seqs) if s]
        if keep:
            lps = score(self.client, [seqs[k] for k in keep], [starts[k] for k in keep])
            for k, lp in zip(keep, lps):
                i, s = sel[k], starts[k] - 1
                out[i, s : s + len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return torch.where(batch.mask, out, 0.0)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


def open_teacher(cfg: Any, place: Any, out: Path) -> InProcessTeacher | WorkerTeacher | None:
    """The run's teacher source (after the policy: the same placement and sharding as the KL reference)."""
    from align import dist
    from align import model as model_lib

    d = cfg.distill
    if d.teacher is None:
        return None
    if not d.teacher_worker:
        teacher = model_lib.load_pretrained(d.teacher, dtype=place.frozen_dtype, device=place.device)
        return InProcessTeacher(dist.shard(teacher.requires_grad_(False), place.precision))
    from align.rollout import client as client_mod

    spool = out / TEACHER_SPOOL
    dist.check_shared_dir(spool)  # torchrun: every rank writes score requests there
    worker = None
    if dist.is_main():  # the teacher's own context (vLLM refuses a max_model_len past its config's), not the student's
        context = model_lib.ModelConfig.from_hf_config(json.loads((Path(d.teacher) / "config.json").read_text()))
        context = context.max_position_embeddings
        worker = client_mod.spawn_worker(
            spool,
            gpu=d.teacher_gpu,
            log_path=out / "teacher_worker.log",
            model=d.teacher,
            max_model_len=context,
            dtype=place.compute_dtype_name,
            in_process=cfg.rollout_in_process,
        )
    dist.barrier()
    client = client_mod.make_rollout_client("spool", spool=spool, timeout_s=cfg.rollout_timeout_s, worker=worker)
    return WorkerTeacher(client, worker)
