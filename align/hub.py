"""Hugging Face Hub ids (``--model Qwen/Qwen2.5-0.5B-Instruct``) resolved from the local cache, offline, stdlib only.

An ``org/name`` that is not a local directory is looked up in the Hugging Face cache layout that
``huggingface-cli download`` / ``hf download`` (``huggingface_hub``) writes::

    $HF_HUB_CACHE (default $HF_HOME/hub, default ~/.cache/huggingface/hub)
      models--Org--Name/refs/main                   the commit hash of the main branch
      models--Org--Name/snapshots/<hash>/...        the files (links into blobs/)

``org/name@REV`` picks ``refs/REV`` or the snapshot ``REV``. The flags that take one: ``--model`` (align.train and
align.sft), ``--teacher`` and ``--tokenizer`` (a snapshot with ``tokenizer.json``). align never downloads (``local_files_only``): a model
that is not cached is an ``InputError`` giving the one command that downloads it, before anything loads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from align.errors import InputError

HUB_ID = re.compile(r"(?P<org>[A-Za-z0-9][\w.-]*)/(?P<name>[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w.-]+))?")


def hub_cache() -> Path:
    """The hub cache directory, as ``huggingface_hub`` computes it from the environment."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def resolve_model(name: str | None, flag: str = "--model", needs: tuple[str, ...] = ("config.json",)) -> str | None:
    """``name`` unchanged when it is None, an existing path or no ``org/name``; else the cached snapshot dir of that
    hub id (one holding a file of ``needs``). ``InputError`` with the download command when the id is not cached."""
    if name is None or Path(name).expanduser().exists():
        return name
    m = HUB_ID.fullmatch(name)
    if m is None:
        return name  # a missing local path: the loader names it
    repo_id, rev = f"{m['org']}/{m['name']}", m["rev"] or "main"
    repo = hub_cache() / f"models--{m['org']}--{m['name']}"
    snapshot = _snapshot(repo, rev, needs)
    if snapshot is None:
        download = f"huggingface-cli download {repo_id}" + (f" --revision {rev}" if m["rev"] else "")
        raise InputError(
            f"{flag} {name}: not a local directory, and the Hugging Face cache ({repo}) has no complete snapshot "
            f"of {repo_id}@{rev}; download it once with: {download} (or: hf download {repo_id}); align reads the "
            "cache offline and never downloads"
        )
    return str(snapshot)


def resolve_tokenizer(name: str | None, flag: str = "--tokenizer") -> str | None:
    """``--tokenizer``: as ``resolve_model``, a snapshot holding ``tokenizer.json`` (a tokenizer-only repo too) or a
    built-in task's ``align_tokenizer.json``."""
    return resolve_model(name, flag, needs=("tokenizer.json", "align_tokenizer.json"))


def _snapshot(repo: Path, rev: str, needs: tuple[str, ...]) -> Path | None:
    """The snapshot dir of ``rev`` (a ref name or a commit hash) holding a file of ``needs``, else None."""
    ref = repo / "refs" / rev
    try:
        commit = ref.read_text().strip() if ref.is_file() else rev
    except OSError:
        return None
    if not re.fullmatch(r"[\w.-]+", commit) or set(commit) == {"."}:  # a ref of "../../x" would leave the cache
        return None
    snap = repo / "snapshots" / commit
    return snap if any((snap / f).is_file() for f in needs) else None
