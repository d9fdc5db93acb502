"""A toy rollout backend: what adding one takes is this file and a row in ``align.rollout.backends.BACKENDS``
(``tests/test_backends.py`` adds the row, ``"toy": ToyBackend()``, for its runs).

It samples with the native sampler on its own copy of the policy, which changes only when the run publishes
weights: a stand-in for an engine in another process (a fake only in that it shares this process; the sampler and
the training loop are the real ones). ``stale=True`` never copies the weights: the negative control."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from align.rollout.backends import Opened, Target
from align.rollout.client import NativeClient
from align.rollout.engines import NativeEngine


class ToyPublisher:
    """K = 0: after a step, its weights into the toy's copy; every completion is then stamped with that version."""

    def __init__(self, opened: ToyOpened, version: int) -> None:
        self.opened, self.version = opened, version

    def publish(self, version: int, policy: Any) -> float:
        if not self.opened.stale:
            self.opened.model.load_state_dict(policy.state_dict())
        self.opened.client.weights_version = self.version = version
        self.opened.published.append(version)
        return 0.0

    def close(self) -> None:
        pass


class ToyOpened(Opened):
    def __init__(self, policy: Any, step: int, stale: bool) -> None:
        self.model = copy.deepcopy(policy).requires_grad_(False).eval()  # the toy engine's weights
        super().__init__(NativeClient(self.model), policy)
        self.client.weights_version, self.stale, self.published, self.closed = step, stale, [], False

    def engine(self, cfg: Any, step: int, snapshots: Path) -> Any:
        return NativeEngine(self.policy, step) if cfg.max_async_steps else ToyPublisher(self, step)

    def close(self) -> None:
        self.closed = True
        super().close()


class ToyBackend:
    def __init__(self, stale: bool = False) -> None:
        self.stale, self.opened = stale, []

    def check(self, cfg: Any) -> None:
        if cfg.spool is not None:
            raise ValueError(f"--rollout toy has no spool; drop --spool {cfg.spool}")

    def uses_ray(self, cfg: Any) -> bool:
        return False

    def open(self, cfg: Any, target: Target) -> ToyOpened:
        self.opened.append(ToyOpened(target.policy, target.step, self.stale))
        return self.opened[-1]
