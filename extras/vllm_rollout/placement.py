"""Placement planner: which bundles (one GPU each) of one Ray placement group each region gets.

Stdlib only, so both venvs import it and ``fleet.py plan`` runs under plain ``python3``.

Layout (seed 000, "Eval fleet"): the trainer region comes first (bundles ``0 .. train_gpus-1``); the rollout
region comes next, or overlaps the trainer from bundle 0 when colocated (the colocated block is
``max(train_gpus, rollout_gpus)`` bundles); the eval bundles are appended after every other region. So adding or
removing an eval fleet never shifts a trainer or rollout offset, in either layout. Engine ``k`` of a region owns
``gpus_per_engine`` consecutive bundles (its tensor-parallel group).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bundle indices per region; ``rollout_engines[k]`` / ``eval_engines[k]`` are engine k's bundles."""

    num_bundles: int
    trainer: list[int]
    rollout: list[int]
    eval: list[int]
    rollout_engines: list[list[int]]
    eval_engines: list[list[int]]
    colocate: bool

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def _engines(bundles: list[int], per_engine: int) -> list[list[int]]:
    return [bundles[i : i + per_engine] for i in range(0, len(bundles), per_engine)]


def plan(
    train_gpus: int,
    rollout_engines: int,
    rollout_gpus_per_engine: int = 1,
    eval_num_gpus: int = 0,
    eval_num_gpus_per_engine: int = 1,
    colocate: bool = False,
    available_gpus: int | None = None,
) -> Plan:
    """The bundle layout; raises ValueError naming the numbers when the combination is impossible.

    ``available_gpus``: GPUs the node (or cluster) has; None skips that check.
    """
    ints = {
        "train_gpus": train_gpus, "rollout_engines": rollout_engines, "rollout_gpus_per_engine": rollout_gpus_per_engine,
        "eval_num_gpus": eval_num_gpus, "eval_num_gpus_per_engine": eval_num_gpus_per_engine,
    }  # fmt: skip
    for name, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if rollout_engines < 1:
        raise ValueError(f"rollout_engines must be >= 1, got {rollout_engines}")
    if rollout_gpus_per_engine < 1 or eval_num_gpus_per_engine < 1:
        raise ValueError(
            f"GPUs per engine must be >= 1, got rollout {rollout_gpus_per_engine}, eval {eval_num_gpus_per_engine}"
        )
    if eval_num_gpus % eval_num_gpus_per_engine:
        raise ValueError(
            f"--eval-num-gpus {eval_num_gpus} is not divisible by --eval-num-gpus-per-engine "
            f"{eval_num_gpus_per_engine}: pick a multiple of {eval_num_gpus_per_engine}"
        )
    if colocate and train_gpus < 1:
        raise ValueError("colocate needs train_gpus >= 1 (the rollout region overlaps the trainer's GPUs)")
    rollout_gpus = rollout_engines * rollout_gpus_per_engine
    trainer = list(range(train_gpus))
    if colocate:
        rollout = list(range(rollout_gpus))
        shared_end = max(train_gpus, rollout_gpus)
    else:
        rollout = list(range(train_gpus, train_gpus + rollout_gpus))
        shared_end = train_gpus + rollout_gpus
    evals = list(range(shared_end, shared_end + eval_num_gpus))
    total = shared_end + eval_num_gpus
    if available_gpus is not None and total > available_gpus:
        layout = "colocated max(trainer, rollout)" if colocate else "trainer + rollout"
        raise ValueError(
            f"the layout needs {total} GPUs ({layout} = {shared_end}, eval {eval_num_gpus}; rollout = "
            f"{rollout_engines} engines x {rollout_gpus_per_engine}) but only {available_gpus} are available: "
            f"use fewer engines or GPUs per engine"
        )
    return Plan(
        num_bundles=total, trainer=trainer, rollout=rollout, eval=evals,
        rollout_engines=_engines(rollout, rollout_gpus_per_engine),
        eval_engines=_engines(evals, eval_num_gpus_per_engine), colocate=colocate,
    )  # fmt: skip


def pg_strategy(p: Plan) -> str:
    """The Ray placement-group strategy: ``SPREAD`` when every engine has one GPU, else ``PACK``.

    One-GPU engines are spread over the nodes, so a node loss takes the fewest engines. Both strategies are soft,
    so Ray re-reserves a dead node's bundles on any node with free GPUs (the driver then restarts those engines
    there); a tensor-parallel engine keeps ``PACK``, so its bundles stay on as few nodes as hold them.
    """
    return "SPREAD" if all(len(b) == 1 for b in p.rollout_engines + p.eval_engines) else "PACK"


# ---------------------------------------------------------------------------------------------
# Command line (``fleet.py plan`` and the fleet driver's plan flags)


def add_plan_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--train-gpus", type=int, default=0, help="trainer GPUs (region 1; 0 = trainer not in Ray)")
    ap.add_argument("--rollout-engines", type=int, default=1, help="vLLM engines behind the spool")
    ap.add_argument("--rollout-gpus-per-engine", type=int, default=1, help="tensor-parallel size of each engine")
    ap.add_argument("--eval-num-gpus", type=int, default=0, help="eval GPUs appended after every other region")
    ap.add_argument("--eval-num-gpus-per-engine", type=int, default=1)
    ap.add_argument("--colocate", action="store_true", help="rollout bundles overlap the trainer's")
    ap.add_argument("--available-gpus", type=int, default=None, help="GPUs the node/cluster has (checked if set)")


def plan_from_args(a: argparse.Namespace) -> Plan:
    return plan(
        a.train_gpus, a.rollout_engines, a.rollout_gpus_per_engine, a.eval_num_gpus, a.eval_num_gpus_per_engine,
        colocate=a.colocate, available_gpus=a.available_gpus,
    )  # fmt: skip


def main_plan(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fleet.py plan", description="Print the bundle layout as JSON.")
    add_plan_args(ap)
    a = ap.parse_args(argv)
    try:
        print(plan_from_args(a).to_json())
    except ValueError as e:
        print(f"fleet.py plan: {e}", file=sys.stderr)
        return 2
    return 0
