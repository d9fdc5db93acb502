"""Run-safety checks: nothing a run writes may overwrite or delete data it did not create, a resumed run
never silently ignores a changed setting, and a bad value fails in the config, before anything runs.

- Values (``check_train_values``, from ``TrainConfig.__post_init__``): ranges that would otherwise fail only
  after the warm start (``--top-p``, ``--lr``, ``--temperature``, ...), and ``--group-size 1``.

- Paths, checked before anything is written: ``--out`` must not be, contain or sit inside ``--model``
  (it would overwrite the model's ``config.json``; a model inside the run dir could be garbage-collected).
  The built-in task's own ``{out}/base_model`` is the one model allowed inside the run dir.
  ``--eval-hf-dir`` must not be or sit inside ``{out}/checkpoints`` (its ``step_N`` names collide with the
  checkpoints and its GC would delete them). ``--save-hf`` must not overlap ``--out`` or ``--model``.
- ``--save-hf DIR`` is written to a temporary sibling and moved into place by rename. DIR may be replaced
  only when it is missing, empty, or an earlier export of the same run (``.align-export.json`` carries the
  run id kept in ``{out}/run_id``); anything else needs ``--overwrite``.
- Resume: the saved ``config.json`` is compared with the new config. Keys in ``RESUMABLE`` (operational
  settings: length of the run, eval, checkpoint cadence, threads, where rollouts run, timeouts) are applied
  and logged; any other change (model, lr, loss, sampling, seed, ...) would change the training math
  silently, so resuming is refused with a ``key: old -> new`` diff.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

EXPORT_MARKER = ".align-export.json"
RUN_ID_FILE = "run_id"

# Settings that may change when a run resumes (dotted keys; "eval." covers every eval setting).
RESUMABLE = (
    "steps",  # run longer or stop earlier (a linear/cosine LR decay is recomputed on the new horizon)
    "checkpoint_every",
    "keep_checkpoints",
    "max_nonfinite_steps",  # how many skipped steps stop the run, not what a step computes
    "resume_from",
    "save_hf",
    "overwrite",
    "threads",
    "micro_batch_size",  # never changes the gradient (global normalisers)
    "gradient_checkpointing",  # recomputes activations, same math
    "logprob_backend",  # kernels with the same result
    "rollout",  # where rollouts are sampled (same policy and sampling settings)
    "spool",
    "spawn_worker",
    "rollout_gpu",
    "rollout_in_process",
    "rollout_timeout_s",
    "eval_prompts",
    "eval.",
    "log.",  # sample logs and the optional metrics mirror
    "rewards.reward_workers",  # how rewards are computed, not what they are
    "rewards.reward_timeout_s",
    "dist_timeout_s",  # torchrun: how long a collective waits
    "dp_replicate",  # torchrun: the sharding layout (same numbers: checkpoints reshard)
    "dp_shard",
)


def _real(p: str | os.PathLike) -> str:
    return os.path.realpath(os.path.expanduser(str(p)))


def _under(path: str, root: str) -> bool:
    """``path`` is ``root`` or inside it (both real paths)."""
    return os.path.commonpath([path, root]) == root


def _overlap(a: str, b: str) -> bool:
    return _under(a, b) or _under(b, a)


def check_paths(out: str, model: str | None, save_hf: str | None, eval_hf_dir: str | None) -> None:
    """Refuse path combinations that would overwrite or delete data; call before anything is written."""
    o = _real(out)
    if model is not None:
        m = _real(model)
        if m != _real(Path(out) / "base_model") and _overlap(m, o):
            where = "is" if m == o else ("is inside" if _under(m, o) else "contains")
            raise ValueError(
                f"--model {model} {where} the run dir --out {out}: the run would overwrite the model's config.json "
                "and its checkpoint GC could delete model files; use an --out outside the model dir"
            )
    if eval_hf_dir is not None and _under(_real(eval_hf_dir), _real(Path(out) / "checkpoints")):
        raise ValueError(
            f"--eval-hf-dir {eval_hf_dir} is inside {Path(out) / 'checkpoints'}: eval snapshots named step_N would "
            "collide with the checkpoints and the eval GC would delete them; use a separate dir "
            "(e.g. /dev/shm/eval_hf)"
        )
    if save_hf is not None:
        s = _real(save_hf)
        for flag, other in (("--out", out), ("--model", model)):
            if other is not None and _overlap(s, _real(other)):
                raise ValueError(
                    f"--save-hf {save_hf} overlaps {flag} {other}: replacing the export would delete it (or "
                    f"the export would land inside it); choose a --save-hf dir outside both --out and --model"
                )


def run_id(out: str | os.PathLike, create: bool = True) -> str | None:
    """This run's id (``{out}/run_id``), created on first use; identifies its ``--save-hf`` exports."""
    path = Path(out) / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    if not create:
        return None
    rid = uuid.uuid4().hex
    tmp = path.with_name(f".{RUN_ID_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(rid + "\n")
    os.replace(tmp, path)
    return rid


def _export_owner(target: Path) -> str | None:
    try:
        return json.loads((target / EXPORT_MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def check_export_target(target: str | os.PathLike, rid: str | None, overwrite: bool) -> None:
    """Refuse a ``--save-hf`` target that holds anything but an earlier export of run ``rid``."""
    t = Path(target)
    if overwrite or not (t.exists() or t.is_symlink()):
        return
    if t.is_dir() and not t.is_symlink():
        if not any(t.iterdir()) or (rid is not None and _export_owner(t) == rid):
            return
        owner = _export_owner(t)
        what = f"an export of another run ({owner})" if owner else "not an align export of this run"
    else:
        what = "a file, not a directory"
    raise ValueError(
        f"--save-hf {target} exists and is {what}; refusing to replace it. Choose another dir, or pass "
        "--overwrite to replace it"
    )


def export_hf(
    save_fn: Callable[[Path], object], target: str | os.PathLike, rid: str, overwrite: bool, step: int
) -> Path:
    """Write an HF export with ``save_fn(tmp_dir)`` next to ``target`` and move it into place by rename.

    The old ``target`` (empty, an earlier export of this run, or anything with ``overwrite``) is renamed aside
    first and removed only after the new export is in place."""
    target = Path(target)
    check_export_target(target, rid, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = target.with_name(f".{target.name}.tmp-{tag}")
    old = target.with_name(f".{target.name}.old-{tag}")
    try:
        save_fn(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"run_id": rid, "step": step}) + "\n")
        had_old = target.exists() or target.is_symlink()
        if had_old:
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if had_old:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    return target


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _resumable(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


def check_resume_config(saved_path: Path, new: dict) -> list[str]:
    """Compare the resumed run's saved config with ``new``; return the applied changes as 'key: old -> new'.

    Raises ValueError listing every change outside ``RESUMABLE``. Keys missing on either side are skipped
    (a config written by another align version)."""
    try:
        saved = json.loads(Path(saved_path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot read the resumed run's config {saved_path}: {e}; restore it or start a fresh run with a new --out"
        ) from None
    old, cur = _flat(saved), _flat(new)
    for d in (old, cur):  # the same dir spelled differently is no change; "out" is the dir being resumed
        d.pop("out", None)
        if isinstance(d.get("model"), str):
            d["model"] = _real(d["model"])
    changed = [k for k in cur if k in old and old[k] != cur[k]]
    refused = [f"{k}: {old[k]!r} -> {cur[k]!r}" for k in changed if not _resumable(k)]
    if refused:
        raise ValueError(
            f"cannot resume {Path(saved_path).parent} with changed settings that the saved run did not use:\n  "
            + "\n  ".join(refused)
            + f"\nRerun with the saved settings (--config {saved_path}), or start a fresh run with a new --out. "
            f"Settings that may change on resume: {', '.join(r.rstrip('.') + ('.*' if r.endswith('.') else '') for r in RESUMABLE)}"
        )
    return [f"{k}: {old[k]!r} -> {cur[k]!r}" for k in changed]
