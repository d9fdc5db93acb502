"""Run-safety checks: nothing a run writes may overwrite or delete data it did not create, a resumed run
never silently ignores a changed setting, and a bad value fails in the config, before anything runs.

- Values (``check_train_values``, from ``TrainConfig.__post_init__``): ranges that would otherwise fail only
  after the warm start (``--top-p``, ``--lr``, ``--temperature``, ...), and ``--group-size 1``.

- Paths, checked before anything is written: ``--out`` must not sit inside another run's dir (one holding a
  ``run_id``); it must not be, contain or sit inside ``--model``
  (it would overwrite the model's ``config.json``; a model inside the run dir could be garbage-collected).
  The built-in task's own ``{out}/base_model`` is the one model allowed inside the run dir.
  ``--eval-hf-dir`` must not be or sit inside ``{out}/checkpoints`` (its ``step_N`` names collide with the
  checkpoints and its GC would delete them), nor hold a ``step_N`` this run did not export (another run's
  snapshots or checkpoints). ``--save-hf`` must not overlap ``--out`` or ``--model``.
- One run per ``--out``: an exclusive ``flock`` on ``{out}/.align.lock`` (rank R > 0 of torchrun:
  ``.align.rank{R}.lock``, so every rank of a second run is refused at once, none waits in a collective for a
  rank that failed) held for the run's life; a second run is refused with the holder's pid.
- Exports (``--save-hf`` and eval snapshots) carry ``.align-export.json``: the run id kept in ``{out}/run_id``
  and the name and size of every file the export wrote. A dir is "an export of this run" only when the run id
  matches and it holds nothing else, so a copied ``run_id`` or a planted marker never lets a run delete files
  an export does not write.
- ``--save-hf DIR`` is written to a temporary sibling named with the run id and moved into place by rename. DIR
  may be replaced only when it is missing, empty, or an export of this run; anything else needs ``--overwrite``.
  Temporaries a killed export left (``.DIR.tmp-{run_id}-*``) are removed by the next run with that run id.
- Resume: the saved ``config.json`` is compared with the new config. Keys in ``RESUMABLE`` (operational
  settings: length of the run, eval, checkpoint cadence, threads, where rollouts run, timeouts) are applied
  and logged; any other change (model, lr, loss, sampling, seed, ...) would change the training math
  silently, so resuming is refused with a ``key: old -> new`` diff.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from align.atomic import EXPORT_MARKER, export_owner, hold_lock, write_export_marker
from align.data import InputError

RUN_ID_FILE = "run_id"
LOCK_FILE = ".align.lock"
STEP_DIR = re.compile(r"step_\d+")  # eval snapshot / checkpoint names
# files of a Hugging Face model / tokenizer dir that a run dir never holds at its top level
HF_DIR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "generation_config.json",
    "adapter_config.json",
)

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
    "stall_timeout_s",  # the watchdog (align.run.watchdog): when a stalled run ends, not what a step computes
    "group_timeout_s",  # like the reward timeout: a group past it is evicted
    "lean.banned",  # security guards grow between versions (0.3.0 rejects Lean that runs programs): a resumed run takes them
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


def check_paths(
    out: str, model: str | None, save_hf: str | None, eval_hf_dir: str | None, tokenizer: str | None = None
) -> None:
    """Refuse path combinations that would overwrite or delete data; call before anything is written."""
    o = _real(out)
    for flag, path in (("--model", model), ("--tokenizer", tokenizer)):
        m = None if path is None else _real(path)
        if m is not None and m != _real(Path(out) / "base_model") and _overlap(m, o):
            where = "is" if m == o else ("is inside" if _under(m, o) else "contains")
            raise InputError(
                f"{flag} {path} {where} the run dir --out {out}: the run would overwrite the model's config.json "
                "and its checkpoint GC could delete model files; use an --out outside the model dir"
            )
    for parent in Path(o).parents:  # a run's tree is its own: its retention and --resume-from move and delete in it
        if (parent / RUN_ID_FILE).is_file():
            raise InputError(
                f"--out {out} is inside {parent}, the run dir of another run ({parent / RUN_ID_FILE}): that run's "
                "checkpoint retention could delete it; use an --out outside every run dir"
            )
    held = [f for f in HF_DIR_FILES if (Path(out) / f).is_file()]
    if held:
        raise InputError(
            f"--out {out} holds a Hugging Face model or tokenizer ({', '.join(held)}): the run would overwrite its "
            "config.json; use an --out of its own (a new or empty dir, or an earlier run dir)"
        )
    if eval_hf_dir is not None and _under(_real(eval_hf_dir), _real(Path(out) / "checkpoints")):
        raise InputError(
            f"--eval-hf-dir {eval_hf_dir} is inside {Path(out) / 'checkpoints'}: eval snapshots named step_N would "
            "collide with the checkpoints and the eval GC would delete them; use a separate dir "
            "(e.g. /dev/shm/eval_hf)"
        )
    if eval_hf_dir is not None:
        check_eval_hf_dir(eval_hf_dir, run_id(out, create=False))
    if save_hf is not None:
        s = _real(save_hf)
        for flag, other in (("--out", out), ("--model", model)):
            if other is not None and _overlap(s, _real(other)):
                raise InputError(
                    f"--save-hf {save_hf} overlaps {flag} {other}: replacing the export would delete it (or "
                    f"the export would land inside it); choose a --save-hf dir outside both --out and --model"
                )


def make_out(out: str | os.PathLike) -> Path:
    """Create the run dir ``--out`` and prove it writable (a probe file); ``InputError`` naming the cause."""
    path = Path(out)
    probe = path / f".write-probe-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise InputError(
            f"--out {out}: the run dir cannot be written ({e.strerror or e}{': ' + e.filename if e.filename else ''}); "
            "choose an --out on a writable filesystem"
        ) from None
    return path


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


def export_problem(path: str | os.PathLike, rid: str | None) -> str | None:
    """Why ``path`` is not an untouched export of run ``rid`` (None when it is one): a dir whose marker carries
    ``rid`` and that holds exactly the files the marker lists, each of its recorded size."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return "a file, not a directory"
    owner = export_owner(path)
    if owner is None:
        return "not an align export of this run"
    if owner != rid:
        return f"an export of another run ({owner})"
    try:
        files = json.loads((path / EXPORT_MARKER).read_text()).get("files")
    except (OSError, ValueError):
        files = None
    if not isinstance(files, dict):
        return f"not an untouched export of this run: its {EXPORT_MARKER} lists no files"
    for f in sorted(path.iterdir()):
        if f.name != EXPORT_MARKER and (f.is_symlink() or not f.is_file() or files.get(f.name) != f.stat().st_size):
            return f"not an untouched export of this run: it holds {f.name}, which the export did not write"
    return None


def check_export_target(target: str | os.PathLike, rid: str | None, overwrite: bool) -> None:
    """Refuse a ``--save-hf`` target that holds anything but an untouched earlier export of run ``rid``."""
    t = Path(target)
    if overwrite or not (t.exists() or t.is_symlink()):
        return
    if t.is_dir() and not t.is_symlink() and not any(t.iterdir()):
        return
    what = export_problem(t, rid)
    if what is None:
        return
    raise ValueError(
        f"--save-hf {target} exists and is {what}; refusing to replace it. Choose another dir, or pass "
        "--overwrite to replace it"
    )


def check_eval_hf_dir(eval_hf_dir: str | os.PathLike, rid: str | None) -> None:
    """Refuse an ``--eval-hf-dir`` holding a ``step_N`` this run (id ``rid``) did not export: eval snapshots
    would replace it and the retention ring delete it (another run's checkpoints, a shared staging dir). An eval
    snapshot is this run's when its marker carries ``rid`` (an eval backend may add files to it)."""
    root = Path(eval_hf_dir)
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if STEP_DIR.fullmatch(p.name) and (rid is None or export_owner(p) != rid):
            owner = export_owner(p)
            why = f"an export of another run ({owner})" if owner else f"no {EXPORT_MARKER} of this run"
            raise ValueError(
                f"--eval-hf-dir {eval_hf_dir} holds {p.name}, which this run did not export ({why}); eval "
                "snapshots would replace it and their retention would delete it. Use an empty dir of this run's "
                "own (e.g. /dev/shm/eval_hf/<run name>)"
            )


def lock_out(out: str | os.PathLike, rank: int = 0) -> IO[str]:
    """Take the exclusive lock of run dir ``out`` for this rank (held until the returned file is closed, or the
    process dies); another run holding it: RuntimeError naming its pid."""
    path = Path(out) / (LOCK_FILE if rank == 0 else f".align.rank{rank}.lock")
    return hold_lock(
        path,
        lambda holder: (
            f"--out {out} is in use by another run ({holder}, lock {path}): two runs would interleave "
            "its metrics and checkpoints. Wait for it to finish (or stop it), or use another --out"
        ),
    )


def release(lock: IO[str] | None) -> None:
    """Release a lock taken by ``lock_out`` (idempotent)."""
    if lock is not None:
        lock.close()


def clean_stale_exports(target: str | os.PathLike, rid: str) -> list[Path]:
    """Remove what a killed ``--save-hf`` of run ``rid`` left beside ``target`` (temporaries named with ``rid``);
    an old export moved aside when the new one never landed is moved back. Returns what was removed."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    old = f".{target.name}.old-{rid}-"
    mine = (f".{target.name}.tmp-{rid}-", f"..{target.name}.tmp-{rid}-", old)  # save_pretrained's own tmp: "..X"
    removed = []
    for p in sorted(target.parent.iterdir()):
        if not p.name.startswith(mine) or p.is_symlink() or not p.is_dir():
            continue
        if p.name.startswith(old) and not (target.exists() or target.is_symlink()):
            os.replace(p, target)  # killed between the two renames: the old export is still the last one
            continue
        shutil.rmtree(p)
        removed.append(p)
    return removed


def open_out(cfg: Any, model: str | None) -> tuple[str, IO[str]]:
    """Claim ``cfg.out`` before anything is written: paths checked, the dir created and locked (every rank its own
    lock file), this run's id, the ``--save-hf`` target checked and this run's stale export temporaries removed.
    Returns (run id, lock)."""
    from align import dist

    check_paths(cfg.out, model, cfg.save_hf, cfg.eval.eval_hf_dir, cfg.data.tokenizer)
    out = make_out(Path(cfg.out))  # created, and writable (a read-only filesystem is one named error)
    lock = lock_out(out, dist.rank())
    try:
        rid = dist.main_first(lambda: run_id(out))
        if cfg.save_hf and dist.is_main():
            clean_stale_exports(cfg.save_hf, rid)
        if cfg.save_hf:
            check_export_target(cfg.save_hf, rid, cfg.overwrite)
    except BaseException:
        lock.close()
        raise
    return rid, lock


def export_hf(
    save_fn: Callable[[Path], object], target: str | os.PathLike, rid: str, overwrite: bool, step: int
) -> Path:
    """Write an HF export with ``save_fn(tmp_dir)`` next to ``target`` and move it into place by rename.

    The old ``target`` (empty, an earlier export of this run, or anything with ``overwrite``) is renamed aside
    first and removed only after the new export is in place. Both temporaries carry the run id, so the next run
    can tell its own leftovers (``clean_stale_exports``)."""
    target = Path(target)
    check_export_target(target, rid, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{rid}-{uuid.uuid4().hex[:8]}"
    tmp = target.with_name(f".{target.name}.tmp-{tag}")
    old = target.with_name(f".{target.name}.old-{tag}")
    try:
        save_fn(tmp)
        write_export_marker(tmp, rid, step)
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


def read_saved_config(saved_path: Path) -> dict:
    """The resumed run's ``config.json`` ({} when there is none); unreadable: a ValueError naming the fix."""
    try:
        saved = json.loads(Path(saved_path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot read the resumed run's config {saved_path}: {e}; restore it or start a fresh run with a new --out"
        ) from None
    if not isinstance(saved, dict):
        raise ValueError(  # noqa: TRY004 (bad input: the ValueError every caller reports)
            f"the resumed run's config {saved_path} is not a JSON object; restore it or start a fresh run with a new --out"
        )
    return saved


def check_resume_config(saved_path: Path, new: dict) -> list[str]:
    """Compare the resumed run's saved config with ``new``; return the applied changes as 'key: old -> new'.

    Raises ValueError listing every change outside ``RESUMABLE``. Keys missing on either side are skipped
    (a config written by another align version)."""
    saved = read_saved_config(saved_path)
    if not saved:
        return []
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
