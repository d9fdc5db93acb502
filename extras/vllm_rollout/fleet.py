"""Rollout fleet: N vLLM engines as Ray actors behind one spool, and the placement planner's command line.

    python extras/vllm_rollout/fleet.py plan --train-gpus 4 --rollout-engines 2 --rollout-gpus-per-engine 2 \
        --eval-num-gpus 2 --eval-num-gpus-per-engine 1 [--colocate]          # plain python3; prints JSON
    .venv-rollout/bin/python extras/vllm_rollout/fleet.py --rollout-engines 2 --spool runs/x/spool --model <hf dir>

Usually started by ``align.rollout.client.spawn_worker(..., engines=N)`` (``--rollout-num-engines N``). To the
trainer the fleet is one rollout worker: same spool protocol, same heartbeat file (plus an ``engines`` list with
each engine's state, version, outstanding work, pid, node and GPUs, and ``engine_deaths``).

The driver (``FleetSpool``, ``FleetWorker``, the eval router and its ``EvalRunner`` actor) is ``fleet_driver.py``,
which also describes the design (routing, weight sync, faults, the eval fleet, multi-node); the engine actor and
the records of engines and work are ``fleet_engine.py``. This file is the command line: ``plan`` (stdlib only,
no Ray import) and the driver's entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import rollout_worker as rw  # stdlib only at import; puts the repo root on sys.path
from fleet_driver import FleetWorker
from placement import add_plan_args, main_plan, plan_from_args

from align.rollout import protocol as P

log = logging.getLogger("rollout_fleet")

# ---------------------------------------------------------------------------------------------
# Command line


def fleet_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_plan_args(ap)
    ap.add_argument("--rollout-engine-restarts", type=int, default=1, help="restarts of dead engines, fleet total")
    ap.add_argument("--eval-spool", default=None, help="serve --eval-num-gpus engines (the appended bundles) on "
                    "this spool: their own router, never in training weight sync")  # fmt: skip
    ap.add_argument("--eval-model", default=None, help="HF dir the eval engines start on (default: --model); "
                    "it must outlive the fleet (e.g. the base model, not a training snapshot)")  # fmt: skip
    ap.add_argument("--eval-weights-version", type=int, default=None, help="version the eval engines report until "
                    "their first load (default: --weights-version)")  # fmt: skip
    ap.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    ap.add_argument("--ray-num-gpus", type=int, default=None, help="GPUs a local Ray declares (default: detect; "
                    "logical GPUs for the plan when the machine has none)")  # fmt: skip
    ap.add_argument("--engine-start-timeout-s", type=float, default=900.0)
    ap.add_argument("--call-timeout-s", type=float, default=900.0, help="bound on one sync / version read-back")
    return ap


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        return main_plan(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    fargs, rest = fleet_parser().parse_known_args(argv)
    args = rw.parse_args(rest)
    if args.parent_pid is not None:  # spawn_worker: a kill -9'd trainer must not leave this fleet holding the spool
        if args.parent_fd is not None:
            os.set_inheritable(args.parent_fd, False)
        P.exit_with_parent(args.parent_pid, args.parent_fd, args.parent_grace_s)
    try:
        plan_from_args(fargs)
        spool = P.Spool(args.spool).ensure()
    except (ValueError, RuntimeError) as e:
        log.error("%s", e)
        return 2
    engine_argv = _engine_argv(rest)
    if rw.lock_spool(spool) is None:
        log.error("another rollout worker already serves %s (its worker.lock is held); not starting", spool.root)
        return 3
    try:
        worker = FleetWorker(args, fargs, engine_argv)
        if fargs.eval_spool and fargs.eval_num_gpus:
            eval_spool = P.Spool(fargs.eval_spool).ensure()
            if rw.lock_spool(eval_spool) is None:  # held by this driver: its EvalRunner actor serves the spool
                raise RuntimeError(f"another rollout worker already serves the eval spool {eval_spool.root}")
            worker.eval_argv = [*rest, "--spool", str(eval_spool.root)]
            if fargs.eval_model is not None:
                worker.eval_argv += ["--model", fargs.eval_model]
            if fargs.eval_weights_version is not None:
                worker.eval_argv += ["--weights-version", str(fargs.eval_weights_version)]
            rw.parse_args(worker.eval_argv)  # bad flags fail here, not in the actor
    except (ValueError, RuntimeError) as e:
        log.error("%s", e)
        spool.write_heartbeat("failed", error=str(e), log_path=args.log_path)
        return 2
    return rw.serve(worker, "rollout fleet")  # the fleet's launcher watch sets no reason: a signal or the exception


def _engine_argv(rest: list[str]) -> list[str]:
    """The worker flags each engine gets: everything but the driver-only spool/model/version/TP/log flags."""
    drop = {
        "--spool",
        "--model",
        "--weights-version",
        "--tensor-parallel-size",
        "--log-path",
        "--parent-pid",
        "--parent-fd",
        "--parent-grace-s",
    }
    out, skip = [], False
    for tok in rest:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in drop:
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


if __name__ == "__main__":  # required: vLLM's multiprocess engine spawns children that re-import this file
    sys.exit(main())
