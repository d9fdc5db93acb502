"""The python tool's launcher (``align.envs.sandbox``), run as a script: ``python -I -S launcher.py SPEC``.

The trainer starts it with a scrubbed environment (``PATH``, ``LANG``, ``HOME``) and only the limits on its command
line, so the model's code, which the launcher starts as its child, has for parent a process that holds no secret:
``/proc/$PPID/environ`` is the scrubbed one, ``/proc/$PPID/mem`` a fresh interpreter's. The child takes the limits
(rlimits; with ``uid`` set, every uid and gid becomes ``uid``, supplementary groups none, which clears its
capabilities) and execs the first interpreter of ``interpreters`` it can (one under ``/root`` is not executable
by ``nobody``). The launcher waits and exits as the child did (the same exit code, or killed by the same signal),
so the caller reads the code's status as its own. stdlib only; imports nothing from ``align``.

SPEC (JSON): ``{"interpreters": [path, ...], "args": [...], "uid": int | null, "rlimits": [[which, soft, hard]]}``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys


def _child(spec: dict) -> None:
    """In the forked child: drop to ``uid``, take the limits, exec the interpreter. Never returns."""
    try:
        uid = spec["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        for which, soft, hard in spec["rlimits"]:
            resource.setrlimit(which, (soft, hard))
        last: OSError | None = None
        for exe in spec["interpreters"]:
            try:
                os.execv(exe, [exe, *spec["args"]])
            except OSError as e:  # not executable by this uid: the next one
                last = e
        os.write(2, f"[the python tool could not start an interpreter: {last}]\n".encode())
    except BaseException as e:  # noqa: BLE001 - whatever failed, say it on the output and exit
        os.write(2, f"[the python tool's launcher failed: {type(e).__name__}: {e}]\n".encode())
    os._exit(126)


def main() -> None:
    spec = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    pid = os.fork()
    if pid == 0:
        _child(spec)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the code's fate is the caller's: pass them on
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
