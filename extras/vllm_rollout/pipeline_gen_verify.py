"""Generation then verification, round after round (Goedel's pipeline.sh, with stricter scoring).

Round k: run ``lean_gen.py`` (its own process group) -> check ``gen_r{k}.jsonl.manifest.json`` is
``complete`` (exit 4 otherwise) -> reap the generator's process group, sweep its ``/dev/shm`` leftovers,
wait for the GPUs to drain -> verify every record with a Lean REPL (``--repl-cmd``) into
``verif_r{k}.jsonl`` -> next round corrects the failures (``--corrections-from`` every earlier pair).

Verification follows the reference (compile ``compile_view(full_code)`` in env 0 of ``DEFAULT_IMPORTS``;
pass = no error messages; complete = pass, no sorries, no ``declaration uses 'sorry'`` / ``failed``
warning) and goes beyond it: a sample is ``accepted`` only if additionally the code starts with the
dataset statement unchanged, uses no ``sorry`` / ``admit`` / ``apply?`` / ``exact?``, declares no
``axiom``, ``#print axioms`` lists only ``--allowed-axioms``, and the REPL did not answer with a
REPL-level error (``{"message": ...}``, which the reference scores as complete).

stdlib only. Exit: 0 done, 2 bad input, 4 generator manifest not complete, 143 on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, str(Path(HERE).resolve().parents[1]))  # the repo's own align (its stdlib-only align.lean)
import lean_prompts as lp

from align.lean.guards import AXIOM_DECL, FORBIDDEN, STANDARD_AXIOMS, parse_axioms, theorem_name
from align.lean.repl import Repl, ReplError, reap_group

__all__ = ["AXIOM_DECL", "FORBIDDEN", "STANDARD_AXIOMS", "Repl", "ReplError", "main", "reap_group", "verify_record"]

EXIT_MANIFEST = 4
SHM_PATTERNS = re.compile(r"^(nccl|vllm|torch_|psm_|sem\.mp-|cuda)")


# --- verification (the REPL client and the guards' text rules are align.lean's) --------------------------------------


def verify_record(rec: dict, repl: Repl, allowed_axioms: tuple[str, ...]) -> dict:
    """One Verification record; ``repl_errors`` / ``repl_code`` are what a correction round needs."""
    t0 = time.monotonic()
    code = (
        rec["lean_code"]
        if rec.get("lean_code") is not None
        else lp.goedel_full_code(rec["lean4_code"], rec["completion_text"])
    )
    repl_code = lp.compile_view(code)
    out = {
        "sample_id": rec["sample_id"],
        "problem_id": rec["problem_id"],
        "round": rec["round"],
        "accepted": False,
        "reference": {"pass": False, "complete": False},
        "reasons": [],
        "repl_code": repl_code,
        "repl_errors": None,
        "warnings": [],
        "sorries": 0,
        "axioms": None,
        "system_error": None,
        "repl_level_error": None,
    }
    reasons = out["reasons"]
    if rec.get("lean_code") is None:
        reasons.append(f"no_lean_code:{rec.get('lean_code_error')}")
    if repl_code:
        try:
            reply = repl.run(repl_code)
        except ReplError as exc:
            out["system_error"] = str(exc)
            reasons.append("system_error")
            repl.start()
            reply = None
        if reply is not None:
            ref = lp.reference_verdict(reply)
            out["reference"] = {"pass": ref["pass"], "complete": ref["complete"]}
            out["repl_errors"] = ref["errors"]
            out["warnings"], out["sorries"] = ref["warnings"], len(ref["sorries"])
            if "env" not in reply:
                out["repl_level_error"] = reply.get("message", json.dumps(reply))
                out["repl_errors"] = None
                reasons.append("repl_level_error")
            elif not ref["complete"]:
                reasons.append("lean_errors" if ref["errors"] else "lean_incomplete")
            elif not reasons:
                name = theorem_name(rec["lean4_code"])
                try:
                    ax = parse_axioms(repl.send({"cmd": f"#print axioms {name}", "env": reply["env"]}))
                except ReplError as exc:
                    ax = None
                    out["system_error"] = str(exc)
                    repl.start()
                out["axioms"] = ax
                if ax is None:
                    reasons.append("axioms_unchecked")
                elif set(ax) - set(allowed_axioms):
                    reasons.append("nonstandard_axioms:" + ",".join(sorted(set(ax) - set(allowed_axioms))))
    else:
        reasons.append("empty_code")
    prefix = lp.statement_prefix(rec["lean4_code"])
    if rec.get("lean_code") is not None and (prefix is None or not code.startswith(prefix)):
        reasons.append("statement_changed")
    body = lp.remove_comments(code)
    if "apply?" in code or "exact?" in code:
        reasons.append("apply_or_exact")
    if FORBIDDEN.search(body):
        reasons.append("uses_sorry_or_admit")
    if AXIOM_DECL.search(body):
        reasons.append("adds_axiom")
    out["accepted"] = out["reference"]["complete"] and not reasons
    out["verify_time"] = round(time.monotonic() - t0, 2)
    return out


def verify_file(gen_path: str, verif_path: str, args) -> dict:
    with open(gen_path, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    repl = Repl(args.repl_cmd, args.repl_cwd, args.repl_timeout, args.import_timeout)
    try:
        rows = [verify_record(r, repl, tuple(args.allowed_axioms.split(","))) for r in recs]
    finally:
        repl.close()
    tmp = verif_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    os.replace(tmp, verif_path)
    solved = sorted({r["problem_id"] for r in rows if r["accepted"]})
    ref_solved = sorted({r["problem_id"] for r in rows if r["reference"]["complete"]})
    return {
        "samples": len(rows),
        "accepted": sum(r["accepted"] for r in rows),
        "solved_problems": len(solved),
        "reference_solved_problems": len(ref_solved),
    }


# --- generator process hygiene ------------------------------------------------------------------------------------------


def _open_paths() -> set[str]:
    paths = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                paths.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return paths


def sweep_shm(before: set[str], shm: str = "/dev/shm") -> list[str]:
    """Remove /dev/shm entries that appeared during the generator run, look like engine leftovers, are ours,
    and that no live process holds open (the machine may be shared)."""
    if not os.path.isdir(shm):
        return []
    new = [n for n in os.listdir(shm) if n not in before and SHM_PATTERNS.match(n)]
    if not new:
        return []
    held = _open_paths()
    removed = []
    for n in new:
        p = os.path.join(shm, n)
        try:
            if os.lstat(p).st_uid == os.getuid() and p not in held and not os.path.isdir(p):
                os.unlink(p)
                removed.append(n)
        except OSError:
            continue
    return removed


def wait_gpu_drain(pids: set[int], timeout_s: float) -> str:
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            check=False,
            text=True,
            timeout=30,
        )
        if not ({int(x) for x in r.stdout.split() if x.strip().isdigit()} & pids):
            return "drained"
        time.sleep(2)
    return f"not drained after {timeout_s} s"


def _group_pids(pgid: int) -> set[int]:
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getpgid(int(pid)) == pgid:
                    out.add(int(pid))
            except OSError:
                continue
    return out


def run_generator(cmd: list[str], log_path: str, drain_s: float, stop: dict) -> tuple[int, dict]:
    """Run lean_gen in its own process group. It gets this process's pid and the read end of a pipe only this
    process holds open (``--parent-pid`` / ``--parent-fd``): if this process dies, even by kill -9, the generator
    stops within seconds and releases its --out lock instead of running on, orphaned."""
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    read_fd, write_fd = os.pipe()
    cmd = [*cmd, "--parent-pid", str(os.getpid()), "--parent-fd", str(read_fd)]
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(read_fd,)
            )
            os.close(read_fd)
            read_fd = None
            stop["pgid"] = proc.pid
            seen: set[int] = set()
            while proc.poll() is None:
                seen |= _group_pids(proc.pid)
                time.sleep(0.5)
    finally:
        for fd in (read_fd, write_fd):
            if fd is not None:
                os.close(fd)
    stop["pgid"] = None
    reap_group(proc.pid)
    info = {"rc": proc.returncode, "shm_removed": sweep_shm(before), "gpu": wait_gpu_drain(seen | {proc.pid}, drain_s)}
    return proc.returncode, info


# --- CLI ----------------------------------------------------------------------------------------------------------------


def seconds(text: str) -> float:
    """A timeout flag's value: finite and > 0 (``inf`` would wait forever on a hung REPL, ``nan`` never times out)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a timeout must be a finite number of seconds > 0")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeline_gen_verify.py", description=__doc__.split("\n")[0])
    p.add_argument("--problems", required=True)
    p.add_argument("--workdir", required=True, help="gen_r{k}.jsonl, verif_r{k}.jsonl, logs")
    p.add_argument("--rounds", type=int, default=2, help="correction rounds after round 0 (Goedel: 2)")
    p.add_argument("--n-initial", type=int, default=8)
    p.add_argument("--n-correction", type=int, default=2)
    p.add_argument("--cap-tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-python", default=sys.executable, help="interpreter of lean_gen.py (.venv-rollout)")
    p.add_argument("--gen-args", default="", help="extra lean_gen.py arguments (one shell-quoted string)")
    p.add_argument("--repl-cmd", default="lake exe repl", help="command starting a Lean REPL (JSON on stdin/stdout)")
    p.add_argument("--repl-cwd", default=None, help="where to start it (the Mathlib project)")
    p.add_argument("--repl-timeout", type=seconds, default=seconds(os.environ.get("PROOF_TIMEOUT", "300")))
    p.add_argument("--import-timeout", type=seconds, default=100.0)
    p.add_argument("--allowed-axioms", default=",".join(STANDARD_AXIOMS))
    p.add_argument("--gpu-drain-timeout", type=seconds, default=120.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    stop: dict = {"signum": None, "pgid": None}

    def on_signal(signum, frame):
        stop["signum"] = signum
        if stop["pgid"]:
            try:
                os.killpg(stop["pgid"], signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pairs: list[tuple[str, str]] = []
    for k in range(args.rounds + 1):
        gen = os.path.join(args.workdir, f"gen_r{k}.jsonl")
        verif = os.path.join(args.workdir, f"verif_r{k}.jsonl")
        cmd = [
            args.gen_python,
            os.path.join(HERE, "lean_gen.py"),
            "--problems",
            args.problems,
            "--out",
            gen,
            "--n",
            str(args.n_initial if k == 0 else args.n_correction),
            "--cap-tokens",
            str(args.cap_tokens),
            "--round",
            str(k),
            "--seed",
            str(args.seed),
        ]
        for v, g in pairs:
            cmd += ["--corrections-from", v, g]
        cmd += shlex.split(args.gen_args)
        rc, info = run_generator(cmd, os.path.join(args.workdir, f"gen_r{k}.log"), args.gpu_drain_timeout, stop)
        print(
            f"round {k}: generator exit {rc} | shm removed {len(info['shm_removed'])} | gpu {info['gpu']}", flush=True
        )
        if stop["signum"]:
            return 143
        try:
            with open(gen + ".manifest.json", encoding="utf-8") as f:
                status = json.load(f).get("status")
        except (OSError, json.JSONDecodeError) as exc:
            status = f"unreadable ({exc})"
        if status != "complete":
            print(
                f"round {k}: {gen}.manifest.json status is {status!r}, not 'complete' (generator exit {rc}); "
                f"see {args.workdir}/gen_r{k}.log",
                file=sys.stderr,
            )
            return EXIT_MANIFEST
        if os.path.getsize(gen) == 0:
            print(f"round {k}: nothing to generate (all parents solved or skipped); stopping", flush=True)
            break
        try:
            summary = verify_file(gen, verif, args)
        except (ReplError, OSError) as exc:
            print(f"round {k}: verification failed: {exc}", file=sys.stderr)
            return 1
        print(f"round {k}: " + " | ".join(f"{a} {b}" for a, b in summary.items()), flush=True)
        pairs.append((verif, gen))
        if stop["signum"]:
            return 143
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
