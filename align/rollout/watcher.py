"""The rollout side's weight watcher (seed 002): loads committed ``v{N}`` snapshots under the policy lock.

It waits for publication WITHOUT the lock, re-resolves once it holds it (retargeting to the latest stable snapshot
if the wanted one was deleted meanwhile) and uses that one version for the path, the engine and every stamp.
Snapshots still pinned by in-flight work are never deleted. stdlib only (+ ``protocol.snapshot_marker``).
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align.rollout.protocol import snapshot_marker

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.01  # how often a publication wait looks for the snapshot
SNAPSHOT_RE = re.compile(r"\Av(\d+)\Z")


class WeightWatcher:
    """Rollout-side weight loading from committed ``v{N}`` snapshot dirs under ``root`` (seed 002).

    ``update(wanted)`` waits for a STABLE snapshot of version >= ``wanted`` WITHOUT holding ``lock`` (the policy lock,
    also the eval lease), then takes the lock, re-resolves (``wanted`` if it is still there, else the latest stable
    one: a retarget when it was deleted meanwhile), loads it through ``load(path, version)`` and returns that one
    version, used for the path, the engine and every stamp. ``pin``/``unpin`` count the in-flight work on a version;
    ``collect_garbage`` deletes only unpinned snapshots older than the loaded one."""

    def __init__(self, root: Path, load: Callable[[Path, int], Any], lock: threading.RLock | None = None) -> None:
        self.root, self.load = Path(root), load
        self.lock = lock if lock is not None else threading.RLock()
        self.version: int | None = None
        self.refs: Counter[int] = Counter()
        self._refs_lock = threading.Lock()

    def stable(self) -> dict[int, Path]:
        return stable_snapshots(self.root)

    def _resolve(self, wanted: int) -> tuple[int, Path] | None:
        found = self.stable()
        if wanted in found:
            return wanted, found[wanted]
        newer = [v for v in found if v > wanted]
        return (max(newer), found[max(newer)]) if newer else None

    def update(self, wanted: int, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> int:
        deadline = time.monotonic() + timeout_s
        while self._resolve(wanted) is None:  # publication wait: the policy lock is NOT held here
            if should_stop():
                raise RuntimeError(f"stopped while waiting for snapshot v{wanted} under {self.root}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no committed snapshot v{wanted} (or newer) under {self.root} within {timeout_s:.0f} s"
                )
            time.sleep(WAIT_POLL_S)
        with self.lock:
            target = self._resolve(wanted)  # again: a newer one may have replaced the first while we waited
            if target is None:
                raise RuntimeError(f"snapshot v{wanted} and every newer one under {self.root} were deleted")
            version, path = target
            if version != wanted:
                log.info(
                    "weight watcher: v%d was deleted; retargeting to the latest stable snapshot v%d", wanted, version
                )
            if version != self.version:
                self.load(path, version)
                self.version = version
            return version

    def pin(self, version: int) -> None:
        with self._refs_lock:
            self.refs[version] += 1

    def unpin(self, version: int) -> None:
        with self._refs_lock:
            self.refs[version] -= 1
            if self.refs[version] <= 0:
                del self.refs[version]

    def collect_garbage(self) -> None:
        with self._refs_lock:
            if self.version is not None:
                remove_snapshots_before(self.root, self.version, pinned={v for v, n in self.refs.items() if n > 0})


def stable_snapshots(root: Path) -> dict[int, Path]:
    """The committed ``v{N}`` snapshot dirs under ``root``, by version."""
    out = {}
    for p in root.iterdir() if root.is_dir() else ():
        m = SNAPSHOT_RE.match(p.name)
        if m and snapshot_marker(p) is not None:
            out[int(m.group(1))] = p
    return out


def remove_snapshots_before(root: Path, version: int, pinned: set[int] = frozenset()) -> None:
    """Snapshot GC, the one place: delete the committed ``v{N}`` under ``root`` older than ``version`` and not
    ``pinned`` (in-flight work still reads them). Only this run's own snapshot root is ever passed here."""
    for v, p in stable_snapshots(Path(root)).items():
        if v < version and v not in pinned:
            shutil.rmtree(p, ignore_errors=True)
