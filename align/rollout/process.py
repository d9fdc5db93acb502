"""Process lifetime and the worker's environment. stdlib only (the vLLM worker imports it through
``align.rollout.protocol``, which re-exports these names).

- ``pid_alive``: a process exists on this host and is not a zombie.
- ``watch_parent`` / ``exit_with_parent``: a launched process exits with its launcher (a kill -9'd trainer must
  not leave its worker behind).
- ``worker_env``: the environment a rollout worker runs in (seed 003).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True if a process ``pid`` exists on this host and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child that its parent has not reaped yet is a zombie: dead for our purposes
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# ---------------------------------------------------------------------------------------------
# A launched process exits with its launcher (issue 19: a kill -9'd trainer must not leave its worker behind)


def watch_parent(
    parent_pid: int, on_gone: Callable[[str], None], fd: int | None = None, poll_s: float = 0.5
) -> threading.Thread:
    """A daemon thread that calls ``on_gone(reason)`` once the process that launched this one is gone.

    Two signals, either suffices: EOF on ``fd`` (the read end of a pipe whose write end the launcher holds and
    never writes: the kernel closes it when the launcher dies, even by SIGKILL, which no handler sees), and
    ``os.getppid()`` no longer being ``parent_pid`` (reparented to init or a subreaper), polled every ``poll_s``.
    PR_SET_PDEATHSIG is not used: it fires when the launching *thread* exits, not the process.
    """

    def reason() -> str | None:
        if os.getppid() != parent_pid:
            return f"the launching process {parent_pid} exited (reparented to pid {os.getppid()})"
        if fd is None:
            time.sleep(poll_s)
            return None
        try:
            readable = select.select([fd], [], [], poll_s)[0]
            data = os.read(fd, 64) if readable else None
        except OSError as e:
            return f"the launching process {parent_pid} is gone (its pipe: {e})"
        return f"the launching process {parent_pid} exited (its pipe closed)" if data == b"" else None

    def loop() -> None:
        while (why := reason()) is None:
            pass
        on_gone(why)

    t = threading.Thread(target=loop, daemon=True, name="parent-watch")
    t.start()
    return t


def exit_with_parent(
    parent_pid: int, fd: int | None = None, grace_s: float = 10.0, note: Callable[[str], None] | None = None
) -> threading.Thread:
    """When the launcher is gone (``watch_parent``): ``note(reason)``; with ``grace_s > 0`` SIGTERM to this
    process (its normal, clean exit path) and ``grace_s`` to finish; then (at once with ``grace_s == 0``) SIGKILL
    to its process group when it leads one (engine children included), else to itself."""

    def on_gone(why: str) -> None:
        if note is not None:
            note(why)
        if grace_s > 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(grace_s)
        with contextlib.suppress(OSError):
            if os.getpgrp() == os.getpid():
                os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    return watch_parent(parent_pid, on_gone, fd)


# ---------------------------------------------------------------------------------------------
# Launching a worker: the environment contract (used by align.rollout.client and rollout_pilot.py)

# torchrun / torch.distributed variables of the trainer; inherited, they make vLLM join the trainer's group.
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTHONPATH",
    "PYTHONHOME",
    "VIRTUAL_ENV",
)


def worker_env(
    base: dict[str, str] | None = None,
    *,
    gpu: int | str | None = None,
    cache_dir: str | os.PathLike | None = None,
    in_process: bool = False,
) -> dict[str, str]:
    """The environment a rollout worker runs in (seed 003): flashinfer sampler off, caches under
    ``cache_dir``, torchrun variables scrubbed, CUDA_VISIBLE_DEVICES pinned to ``gpu``. OMP_NUM_THREADS is kept, and
    defaults to 1 for a CPU worker (vLLM binds its own compute threads; without it a 1-token request took 147 ms
    instead of 43 ms on 2 cores)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in TORCHRUN_VARS}
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is sized for big boxes
        env.setdefault("OMP_NUM_THREADS", "1")
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cache_dir is not None:
        cache = Path(cache_dir).resolve()
        env["VLLM_CACHE_ROOT"] = str(cache / "vllm")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        env["TRITON_CACHE_DIR"] = str(cache / "triton")
    return env
