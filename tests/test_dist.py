"""Multi-process training (align.dist): real ``torchrun --nproc-per-node 2`` (and ``--nnodes 2``, two launchers on
this machine) on gloo vs one process, same seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_train import TOK, TRAIN_BASE, build_char_model, char_moe_model, records, wait_for

from align.model import Transformer, load_pretrained
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "dist_driver.py"
LOSS_TOL = 1e-5  # losses and grad norms: 1 vs 2 ranks sum the same terms in another order
PARAM_TOL = 1e-5  # parameters after the last step
TEACHER_OUTSIDE = 2e-4  # the teacher run: the share of entries allowed past PARAM_TOL (see its test)
STEPS = 3


def test_generate_rows_samples_what_the_whole_call_samples(char_model_2l):
    """A rank's share of a step, sampled with rows=(first, total), is exactly that share of the one large call."""
    model = load_pretrained(char_model_2l)
    prompts = [[1, 2], [3], [2, 2, 4], [4, 1]]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7)
    whole = generate(model, prompts, params)
    halves = generate(model, prompts[:2], params, rows=(0, 12)) + generate(model, prompts[2:], params, rows=(6, 12))
    assert [c.token_ids for c in halves] == [c.token_ids for c in whole]
    # negative control: without rows= the second half draws other uniforms
    alone = generate(model, prompts[2:], params)
    assert [c.token_ids for c in alone] != [c.token_ids for c in whole[6:]]
    with pytest.raises(ValueError, match="do not fit"):
        generate(model, prompts, params, rows=(3, 12))


def _spec(tmp_path: Path, name: str, model: str, per_rank_normaliser: bool = False, hang: dict | None = None,
          kill_in_save: dict | None = None, with_eval: bool = False, with_env: bool = False, agent: str | None = None,
          **extra) -> dict:  # fmt: skip
    """tests/dist_driver.py's spec of one run: out dir ``tmp_path/name``, its HF export ``tmp_path/name.hf``."""
    cfg = {
        "out": str(tmp_path / name),
        **TRAIN_BASE,
        "steps": STEPS,
        "checkpoint_every": 0,
        "save_hf": str(tmp_path / f"{name}.hf"),
        "device": "cpu",
        "threads": 1,
        **extra,
    }
    return {
        "cfg": cfg,
        "model": model,
        "calls": str(tmp_path / f"{name}.calls.json"),
        "per_rank_normaliser": per_rank_normaliser,
        "hang": hang or {},
        "kill_in_save": kill_in_save or {},
        "eval": with_eval,
        "env": with_env,
        "agent": agent,
    }


def _launch(tmp_path: Path, spec: dict, nproc: int, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """The driver on ``spec`` in one process (``nproc`` 1) or under ``torchrun --nproc-per-node nproc``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + [str(DRIVER), json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=tmp_path, check=False)


def _result(spec: dict) -> dict:
    """What a finished run left: its checkpoint names, its step records, every record, the reward calls, the exported
    parameters and (with --teacher) what each rank held of the teacher."""
    calls = Path(spec["calls"])
    every = records(spec["cfg"]["out"])
    shards = sorted(calls.parent.glob(f"{calls.name}.teacher*.json"))
    ckpts = Path(spec["cfg"]["out"]) / "checkpoints"
    return {
        "checkpoints": sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else [],  # as the run left them
        "recs": [r for r in every if "reward_mean" in r],
        "all": every,
        "calls": json.loads(calls.read_text()),
        "params": dict(load_pretrained(spec["cfg"]["save_hf"]).named_parameters()),
        "teacher_shards": [json.loads(f.read_text()) for f in shards],
    }


def _run(tmp_path: Path, name: str, model: str, nproc: int, expect_fail: bool = False, **kw) -> dict:
    """One run in a launch of its own (train() creates and ends the process group); ``kw``: ``_spec``'s."""
    spec = _spec(tmp_path, name, model, **kw)
    p = _launch(tmp_path, spec, nproc)
    if kw.get("hang") or kw.get("kill_in_save") or expect_fail:
        return {"returncode": p.returncode, "log": p.stdout + p.stderr}
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return _result(spec)


def _run_batch(tmp_path: Path, model: str, nproc: int, runs: dict[str, dict]) -> dict[str, dict]:
    """Several runs, each in turn, in ONE launch (one torchrun, one torch import; under torchrun one process group
    the driver owns): ``runs`` maps a run name to ``_spec``'s keywords; returns name -> ``_result`` (+ its dir)."""
    specs = {name: _spec(tmp_path, name, model, **kw) for name, kw in runs.items()}
    p = _launch(tmp_path, {"runs": list(specs.values())}, nproc, timeout_s=300 * len(specs))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return {name: {**_result(spec), "dir": tmp_path, "name": name} for name, spec in specs.items()}


def _outside(a: dict, b: dict, tol: float = PARAM_TOL) -> float:
    """The fraction of parameter entries of ``a`` and ``b`` farther apart than ``tol``."""
    assert a.keys() == b.keys()
    return sum(int(((a[k] - b[k]).detach().abs() > tol).sum()) for k in a) / sum(v.numel() for v in a.values())


def _max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).detach().abs().max()) for k in a)


# The plain step; and K=2 updates x M=2 mini-batches per batch with a token budget (ranks run different numbers of
# micro-batches: the padding path), packed rows (--pack-sequences: a group split over ranks gets a prompt copy on
# each) and a KL term (the sharded reference model). The second makes 12 AdamW steps,
# which amplify the sum-order differences of near-zero gradient entries (Adam's update is ~lr * sign there): its
# lr is lower so the parameter tolerance stays PARAM_TOL.
CONFIGS = {
    "plain": {},
    "updates_minibatches_tokens_kl": {
        "updates_per_batch": 2,
        "mini_batches": 2,
        "micro_batch_tokens": 12,
        "pack_sequences": True,
        "lr": 1e-3,
        "loss": {"kl_coef": 0.1},
    },
}


EVAL = {"eval_interval": 1, "eval_max_tokens": 4}
AGENT_STEPS = 2
AGENT_ENVS = {"agent_timeout_s": 120}  # under torchrun below --dist-timeout-s (a rank waits for the others' agents)
DISTILL_KEYS = ("distill/reverse_kl_mean", "distill/teacher_logprob_mean", "distill/student_logprob_mean")


def _compared_runs(d: Path, nproc: int, teacher: str) -> dict[str, dict]:
    """The runs each made once in 1 process and once on 2 ranks and compared (name -> ``_spec`` keywords). Blocking
    eval: every rank samples its share of the held-out prompts; snapshot eval: every rank enters the weights gather
    at the same eval step, rank 0 exports and dispatches (tests/dist_driver.py's WeightSum)."""
    snapshot = {"eval_function_path": f"{DRIVER}:WeightSum", "eval_hf_dir": str(d / f"eval_snapshot{nproc}.eval")}
    return {
        **CONFIGS,
        "plain": {"checkpoint_every": 2},  # checkpoints at steps 2 and 3: resumed with the other world size below
        "env": {"with_env": True, "envs": {"max_turns": 3}},
        "agent": {"agent": "global", "with_eval": True, "steps": AGENT_STEPS, "eval": EVAL, "envs": AGENT_ENVS},
        "teacher": {"distill": {"teacher": teacher}},
        "bf16": {"precision": "bf16"},
        "eval_blocking": {"with_eval": True, "steps": 2, "eval": EVAL},
        "eval_snapshot": {"with_eval": True, "steps": 2, "eval": {**EVAL, **snapshot}},
    }


@pytest.fixture(scope="module")
def batches(tmp_path_factory, char_model_2l) -> dict[int, dict[str, dict]]:
    """Every compared run, in two launches (a launch per run spent most of its time starting torch): one process
    runs all of ``_compared_runs`` in turn; one torchrun of 2 ranks runs them again, plus the negative controls
    (each rank normalising by its own counts: ``NAME_bad``), HSDP (``hsdp``) and the one-process plain run's
    resumes (``again``, ``scaled``: ``_resumes``). {1: name -> result, 2: name -> result}."""
    d = tmp_path_factory.mktemp("batches")
    teacher = build_char_model(d / "teacher", layers=1)  # not the student: a real per-token signal
    TOK.save(teacher)  # the teacher's tokenizer is checked against the student's
    bad = {"per_rank_normaliser": True}
    controls = {"plain_bad": bad, "bf16_bad": {**bad, "precision": "bf16"}, "hsdp": {"dp_replicate": 2}}
    controls["agent_local"] = {"agent": "rank_local", "steps": 1, "envs": AGENT_ENVS}  # seeds by rank-local index
    controls |= {f"{name}_bad": {**bad, **kw} for name, kw in CONFIGS.items() if kw}
    out = {}
    for n in (1, 2):
        runs = _compared_runs(d, n, teacher) | (controls if n == 2 else {})
        if n == 2:  # test_single_process_checkpoint_resumes_on_two_ranks: the one-process run, resumed on 2 ranks
            runs |= _resumes(out[1]["plain"], _scale_trainer_state_second_moments)
        made = _run_batch(d, char_model_2l, n, {f"{name}{n}": kw for name, kw in runs.items()})
        out[n] = {name: made[f"{name}{n}"] for name in runs}
    return out


def _resumes(run: dict, scale: Callable[[Path], None]) -> dict[str, dict]:
    """``_spec`` keywords of two resumes of ``run`` (checkpoints at steps 2 and 3) from step_2, redoing step 3:
    ``again`` in its own dir; ``scaled`` in a copy whose step_2 optimizer state ``scale`` rewrote with exp_avg_sq x 4
    (the negative control: the optimizer state is restored, so the redone step differs)."""
    import shutil

    run_dir = run["dir"] / run["name"]
    copy = run["dir"] / f"{run['name']}.scaled"
    shutil.copytree(run_dir, copy)
    scale(copy / "checkpoints" / "step_2")
    return {
        "again": {"out": str(run_dir), "resume_from": "step_2"},
        "scaled": {"out": str(copy), "resume_from": "step_2"},
    }


def _scale_trainer_state_second_moments(ckpt: Path) -> None:
    """Rewrite a one-process checkpoint's optimizer state (trainer_state.pt) with exp_avg_sq x 4."""
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    for s in state["optimizer"]["state"].values():
        s["exp_avg_sq"] *= 4
    torch.save(state, ckpt / "trainer_state.pt")


@pytest.fixture(scope="module")
def resumed_in_one_process(batches, char_model_2l) -> dict[str, dict]:
    """The 2-rank run's sharded checkpoint resumed in one process (test_sharded_checkpoint_resumes_in_one_process_
    and_after_a_kill), as written and with its DCP optimizer state scaled: one launch."""
    run = batches[2]["plain"]
    scale = lambda ckpt: _scale_dcp_second_moments(ckpt, char_model_2l)
    return _run_batch(run["dir"], char_model_2l, 1, _resumes(run, scale))


@pytest.fixture(scope="module")
def plain_runs(batches) -> dict[int, dict]:
    """The plain config in 1 process and on 2 ranks, checkpointing at steps 2 and 3: compared with each other
    below, and each resumed with the other world size (``_resumes``)."""
    return {n: batches[n]["plain"] for n in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_ranks_give_the_single_process_result(char_model_2l, config, batches):
    # the plain runs also checkpoint (steps 2 and 3): that changes nothing they compute
    one, two = batches[1][config], batches[2][config]
    assert [r["step"] for r in one["recs"]] == [r["step"] for r in two["recs"]] == list(range(1, STEPS + 1))
    assert one["calls"] == two["calls"] and len(one["calls"]) == STEPS * 16  # the same completions, in order
    for a, b in zip(one["recs"], two["recs"]):
        assert a["reward_mean"] == b["reward_mean"] and a["num_tokens"] == b["num_tokens"]
        for k in ("loss", "grad_norm", "entropy"):
            assert abs(a[k] - b[k]) <= LOSS_TOL, (a["step"], k, a[k], b[k])
    base = dict(load_pretrained(char_model_2l).named_parameters())
    assert _max_param_diff(one["params"], base) > 100 * PARAM_TOL  # it trained
    assert _max_param_diff(one["params"], two["params"]) <= PARAM_TOL
    # negative control: each rank normalising by its own token counts is caught
    bad = batches[2][f"{config}_bad"]
    assert bad["recs"][0]["reward_mean"] == one["recs"][0]["reward_mean"]  # same first rollouts...
    assert _max_param_diff(one["params"], bad["params"]) > PARAM_TOL  # ...but not the whole-batch gradient


@pytest.mark.slow
def test_two_ranks_with_an_environment_give_the_single_process_result(batches):
    """Multi-turn episodes (tests/dist_driver.py's Retry environment, on --env lean's stage: each rank verifies its
    share through its own pool of REPL stand-ins): each rank runs its share of the episodes on the kept-cache
    sampler, every rank trains on all of them; the run, lean/* metrics included, equals one process."""
    one, two = batches[1]["env"], batches[2]["env"]
    assert one["calls"] == two["calls"] and len(one["calls"]) == STEPS * 16  # the same final answers, in order
    assert any(r["env/turns_mean"] > 1 for r in one["recs"])  # real multi-turn episodes
    assert sum(r["lean/proved"] for r in one["recs"]) > 0 and sum(r["lean/rejected_lean_error"] for r in one["recs"])
    for a, b in zip(one["recs"], two["recs"]):
        assert a["reward_mean"] == b["reward_mean"] and a["env/env_tokens_mean"] == b["env/env_tokens_mean"]
        assert {k: v for k, v in a.items() if k.startswith("lean/")} == {
            k: v for k, v in b.items() if k.startswith("lean/")
        }
        for k in ("loss", "grad_norm"):
            assert abs(a[k] - b[k]) <= LOSS_TOL, (a["step"], k, a[k], b[k])
    assert _max_param_diff(one["params"], two["params"]) <= PARAM_TOL


def _agent_urls(run: dict, ranks: int) -> list[list[str]]:
    """Per rank, the gateway URL of each agent run it ran (tests/dist_driver.py's ``drive``)."""
    files = (run["dir"] / f"{run['name']}.calls.json.agents{k}.json" for k in range(ranks))
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.slow
def test_two_ranks_with_agents_give_the_single_process_result(batches):
    """Agent programs through the gateway (tests/dist_driver.py's ``drive``: stdlib urllib, two requests a run): each
    rank runs its share of the step's agent runs against its own gateway (its own loopback port) on the full
    weights, each request seeded by its run's global index; every rank trains on all of them. The run, its held-out
    agent runs in the in-loop eval included, equals one process; seeding by the rank-local index does not."""
    one, two = batches[1]["agent"], batches[2]["agent"]
    evals = AGENT_STEPS + 1  # eval points 0..AGENT_STEPS, 3 held-out rows each, scored with the training rows
    assert one["calls"] == two["calls"] and len(one["calls"]) == AGENT_STEPS * 16 + evals * 3  # the same replies
    assert [r["step"] for r in one["recs"]] == [r["step"] for r in two["recs"]] == list(range(1, AGENT_STEPS + 1))
    for a, b in zip(one["recs"], two["recs"], strict=True):
        assert a["agent/requests_mean"] == b["agent/requests_mean"] == 2 and a["agent/errors"] == b["agent/errors"] == 0
        assert a["reward_mean"] == b["reward_mean"] and a["num_tokens"] == b["num_tokens"]
        for k in ("loss", "grad_norm"):
            assert abs(a[k] - b[k]) <= LOSS_TOL, (a["step"], k, a[k], b[k])
    assert _max_param_diff(one["params"], two["params"]) <= PARAM_TOL
    one_eval, two_eval = ([(r["step"], r["eval/avg@1"]) for r in x["all"] if "eval/avg@1" in r] for x in (one, two))
    assert one_eval == two_eval and [s for s, _ in one_eval] == list(range(evals))
    # each rank ran its contiguous share (8 of 16 a step; 2 and 1 of the 3 held-out rows) on a gateway of its own
    urls = {n: _agent_urls(r, n) for n, r in ((1, one), (2, two))}
    assert [len(u) for u in urls[1]] == [AGENT_STEPS * 16 + evals * 3]
    assert [len(u) for u in urls[2]] == [AGENT_STEPS * 8 + evals * 2, AGENT_STEPS * 8 + evals * 1]
    assert all(len(set(u)) == 1 for u in urls[1] + urls[2]) and urls[2][0][0] != urls[2][1][0]
    # negative control: seeded by its rank-local index, rank 1's share draws rank 0's seeds (step 1: after eval 0)
    local, step1 = batches[2]["agent_local"]["calls"], one["calls"][3 : 3 + 16]
    assert local[:8] == step1[:8] and local[8:] != step1[8:]


NODE_TIMEOUT_S = 150.0  # each launcher of the two-node run (both start, rendezvous and train 3 steps on 2 cores)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_nodes(tmp_path: Path, model: str, runs: dict[str, dict]) -> dict[str, dict]:
    """Two torchrun launchers on this machine, one process each (``--nnodes 2 --node-rank R``), meeting at a c10d
    rendezvous on 127.0.0.1:PORT, the way two hosts would (node 0 hosts the rendezvous store: ``is_host``). They
    share the run dir, as two nodes share a filesystem, and make each of ``runs`` (name -> ``_spec`` keywords) in
    turn: the same ``_run_batch`` specs and driver as the one-node runs."""
    specs = {name: _spec(tmp_path, name, model, **kw) for name, kw in runs.items()}
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=nodes",
               f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}", "--max-restarts=0",
               str(DRIVER), json.dumps({"runs": list(specs.values())})]  # fmt: skip
        with open(tmp_path / f"nodes.node{node}.log", "w") as log:  # the child keeps its own copy of the fd
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
    deadline = time.monotonic() + NODE_TIMEOUT_S * len(specs)
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(tmp_path / f"nodes.node{n}.log").read_text() for n in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(x[-4000:] for x in logs)
    return {name: _result(spec) for name, spec in specs.items()}


@pytest.mark.slow
def test_two_nodes_give_the_single_process_result(tmp_path, char_model_2l, plain_runs):
    """``torchrun --nnodes 2`` (two launchers, c10d rendezvous, gloo, one rank per node) trains exactly as one
    process (plain_runs' one-process run): the same completions in order, losses and grad norms within LOSS_TOL,
    parameters within PARAM_TOL. Negative control: the same two nodes (the same launch, next run) with another
    --seed sample other completions and end elsewhere."""
    one = plain_runs[1]
    runs = _run_two_nodes(tmp_path, char_model_2l, {"nodes": {"checkpoint_every": STEPS}, "seed1": {"seed": 1}})
    two = runs["nodes"]  # a checkpoint changes nothing
    ckpt = tmp_path / "nodes" / "checkpoints" / f"step_{STEPS}"
    assert sorted(p.name for p in ckpt.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]  # two ranks ran
    assert [r["step"] for r in two["recs"]] == list(range(1, STEPS + 1))
    assert two["calls"] == one["calls"] and len(two["calls"]) == STEPS * 16
    for a, b in zip(one["recs"], two["recs"], strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["num_tokens"] == b["num_tokens"]
        for k in ("loss", "grad_norm", "entropy"):
            assert abs(a[k] - b[k]) <= LOSS_TOL, (a["step"], k, a[k], b[k])
    assert _max_param_diff(one["params"], two["params"]) <= PARAM_TOL
    other = runs["seed1"]
    assert other["calls"] != one["calls"]
    assert _max_param_diff(one["params"], other["params"]) > PARAM_TOL


@pytest.mark.slow
def test_hsdp_two_replicas_give_the_single_process_result(char_model_2l, plain_runs, batches):
    """--dp-replicate 2 (HSDP on a (2, 1) DeviceMesh: each rank holds a full replica, gradients all-reduced across
    replicas) trains exactly as one process (plain_runs' one-process run, which checkpoints: this one does not, so
    a checkpoint is also shown to change nothing; the per-rank-normaliser control is the plain FSDP test's)."""
    one, two = plain_runs[1], batches[2]["hsdp"]
    assert one["calls"] == two["calls"]
    for a, b in zip(one["recs"], two["recs"], strict=True):
        for k in ("loss", "grad_norm"):
            assert abs(a[k] - b[k]) <= LOSS_TOL, (a["step"], k, a[k], b[k])
    assert _max_param_diff(one["params"], dict(load_pretrained(char_model_2l).named_parameters())) > 100 * PARAM_TOL
    assert _max_param_diff(one["params"], two["params"]) <= PARAM_TOL


@pytest.mark.slow
def test_two_ranks_with_a_teacher_give_the_single_process_result(plain_runs, batches):
    """On-policy distillation under torchrun (--teacher DIR beside the reward): the frozen teacher is FSDP-sharded
    like the reference model (each rank holds half of its parameters) and scores each rank's own rows; losses, grad
    norms, the distill/* figures and the final weights equal one process's. Negative control: the plain runs, the
    same seed without the teacher, sample the same first batch but differ far past the tolerances from step 1."""
    one, two = batches[1]["teacher"], batches[2]["teacher"]
    (whole,), halves = one["teacher_shards"], two["teacher_shards"]
    assert whole["local"] == whole["total"] and len(halves) == 2
    assert all(h["total"] == whole["total"] and h["local"] < 0.6 * h["total"] for h in halves)
    assert sum(h["local"] for h in halves) == whole["total"]
    assert one["calls"] == two["calls"] and len(one["calls"]) == STEPS * 16  # the same completions, in order
    assert all(abs(r["distill/reverse_kl_mean"]) > 100 * LOSS_TOL for r in one["recs"])  # the teacher disagrees
    for a, b in zip(one["recs"], two["recs"], strict=True):
        for k in ("loss", "grad_norm", *DISTILL_KEYS):
            assert abs(a[k] - b[k]) <= LOSS_TOL, (a["step"], k, a[k], b[k])
    # Parameters: AdamW (lr 1e-2) moves an entry whose gradient is near zero by up to lr in the direction of that
    # gradient's sign, which the sum order of 1 vs 2 ranks can flip: with torch's own GEMMs (MKL) 17 of ~300k entries
    # end 1e-5 to 1.9e-4 apart (none with oneDNN's); every other entry within PARAM_TOL.
    print(f"\nteacher run: {_outside(one['params'], two['params']):.1e} of the entries past {PARAM_TOL:g}")
    assert _outside(one["params"], two["params"]) <= TEACHER_OUTSIDE
    alone = plain_runs[1]
    assert alone["calls"][:16] == one["calls"][:16] and "distill/reverse_kl_mean" not in alone["recs"][0]
    assert abs(alone["recs"][0]["loss"] - one["recs"][0]["loss"]) > 100 * LOSS_TOL
    assert _max_param_diff(alone["params"], one["params"]) > 100 * PARAM_TOL
    assert _outside(alone["params"], one["params"]) > 0.5  # the criterion's negative control


BF16_LOSS_TOL = 2e-3  # bf16 weights: 1 vs 2 ranks round the summed gradients differently


@pytest.mark.slow
def test_two_ranks_bf16_weights(batches):
    """--precision bf16 (bf16 shards, AdamW32's fp32 moments sharded like them, fp32 gradient reduction): the same
    completions at step 1, losses within BF16_LOSS_TOL over 3 steps; a per-rank normaliser is caught."""
    one, two, bad = batches[1]["bf16"], batches[2]["bf16"], batches[2]["bf16_bad"]
    assert one["calls"][:16] == two["calls"][:16]
    assert all(abs(a["loss"] - b["loss"]) <= BF16_LOSS_TOL for a, b in zip(one["recs"], two["recs"]))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one["recs"], bad["recs"])) > BF16_LOSS_TOL


def _assert_same_last_step(whole: dict, again: dict) -> None:
    assert [r["step"] for r in again["recs"]] == [1, 2, 3]  # metrics.jsonl kept steps 1-2, then the redone step 3
    a, b = whole["recs"][-1], again["recs"][-1]
    assert a["reward_mean"] == b["reward_mean"]
    for k in ("loss", "grad_norm"):
        assert abs(a[k] - b[k]) <= LOSS_TOL, (k, a[k], b[k])
    assert _max_param_diff(whole["params"], again["params"]) <= PARAM_TOL


def _scale_dcp_second_moments(ckpt: Path, model: str) -> None:
    """Rewrite a sharded checkpoint's optimizer state with exp_avg_sq x 4 (DCP load and save in one process)."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from align.run import checkpoint as dist_checkpoint

    m = load_pretrained(model)
    opt = torch.optim.AdamW(m.parameters())
    torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # the run's param groups carry initial_lr
    model_sd, optim_sd = get_state_dict(m, opt)
    sd = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(sd, storage_reader=dist_checkpoint._reader(ckpt / "dcp"), planner=dist_checkpoint._planner())
    for s in sd["optimizer"]["state"].values():
        s["exp_avg_sq"] *= 4
    shutil.rmtree(ckpt / "dcp")
    dcp.save(sd, checkpoint_id=str(ckpt / "dcp"))


@pytest.mark.slow
def test_sharded_checkpoint_resumes_in_one_process_and_after_a_kill(tmp_path, char_model_2l, plain_runs,
                                                                    resumed_in_one_process):  # fmt: skip
    """2 ranks write DCP checkpoints (each rank its shards, rank 0 commits): one process resumes step_2 and redoes
    step 3 exactly (DCP resharding); a rank kill -9'd after writing its step-3 shards leaves no committed step_3, and
    rerunning the same command resumes step_2 and ends where the uninterrupted run ended."""
    whole, again = plain_runs[2], resumed_in_one_process["again"]
    assert whole["checkpoints"] == ["step_2", "step_3"]  # before the resume
    step2 = whole["dir"] / whole["name"] / "checkpoints" / "step_2"
    assert sorted(p.name for p in (step2 / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (step2 / "model").exists() and (step2 / "rng_rank1.pt").is_file()
    _assert_same_last_step(whole, again)
    # negative control: the optimizer state is restored (step 3 redone with its second moments scaled differs)
    bad = resumed_in_one_process["scaled"]
    assert _max_param_diff(whole["params"], bad["params"]) > PARAM_TOL
    # kill -9 of rank 1 after its step-3 shards (rank 0 waits at the barrier before the marker)
    killed = _run(tmp_path, "kill", char_model_2l, 2, kill_in_save={"rank": 1, "call": 2}, checkpoint_every=2)
    assert killed["returncode"] != 0
    ckpts = tmp_path / "kill" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")) == ["step_2"]
    assert [p for p in ckpts.iterdir() if p.name.startswith(".step_3.tmp-")]  # the uncommitted write is left...
    rerun = _run(tmp_path, "kill", char_model_2l, 2, checkpoint_every=2)
    _assert_same_last_step(whole, rerun)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_3"]  # ...and removed by the next save


@pytest.mark.slow
def test_single_process_checkpoint_resumes_on_two_ranks(plain_runs, batches):
    """A checkpoint written by one process (HF model + trainer_state.pt) resumes under torchrun: the redone step is
    the same step."""
    whole, again = plain_runs[1], batches[2]["again"]
    assert whole["checkpoints"] == ["step_2", "step_3"]  # before the resume
    _assert_same_last_step(whole, again)
    # negative control: the optimizer state is restored (step 3 redone with its second moments scaled differs)
    bad = batches[2]["scaled"]
    assert _max_param_diff(whole["params"], bad["params"]) > PARAM_TOL


def test_unsupported_settings_are_refused_before_any_collective(monkeypatch):
    """Under torchrun (WORLD_SIZE > 1) the config checks run before the process group exists: a clear error on
    every rank instead of a hang."""
    from align.dist import check_supported
    from align.train import TrainConfig

    def cfg(**kw) -> TrainConfig:
        c = TrainConfig(prompts_per_step=4, **kw)
        c.eval.eval_interval = 0
        return c

    check_supported(cfg(), 2)  # control: the plain config passes
    with pytest.raises(ValueError, match="--prompts-per-step 4 is not divisible by the world size 3"):
        check_supported(cfg(), 3)
    check_supported(cfg(rollout="spool"), 2)  # the spool works under torchrun
    with pytest.raises(ValueError, match="--lora-rank > 0"):
        c = cfg()
        c.lora.rank = 4
        check_supported(c, 2)
    check_supported(TrainConfig(prompts_per_step=4), 2)  # eval (on by default) works under torchrun
    with pytest.raises(ValueError, match="--adv-refill"):
        check_supported(cfg(adv_refill=True), 2)
    check_supported(cfg(dp_replicate=2, dp_shard=2), 4)  # HSDP: 2 replicas x 2 shards
    for bad in ({"dp_replicate": 3}, {"dp_replicate": 2, "dp_shard": 2}):
        with pytest.raises(ValueError, match=r"does not make the world size 2; pass --dp-replicate R and --dp-shard S"):
            check_supported(cfg(**bad), 2)
    # more local ranks than GPUs: rank 0 (which has a GPU when there is one) refuses too, before the process group
    from align.dist import setup

    for k, v in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 local ranks but this machine has 1 CUDA device"):
        setup(cfg(device="cuda"))
    with pytest.raises(ValueError, match="every rank would use the same GPU"):
        setup(cfg(device="cuda:0"))
    assert not torch.distributed.is_initialized()


def test_agents_under_torchrun_need_a_timeout_within_the_collectives_timeout(monkeypatch):
    """--agent under torchrun: a rank waits at the step's gather for the others' agents, so --agent-timeout-s must
    bound them below --dist-timeout-s (the defaults, 600 and 600, do not): refused before the model loads."""
    from align.errors import InputError
    from align.gateway.agents import bind
    from align.train import TrainConfig

    env, c = bind(lambda base_url, api_key, model, **row: 0.0), TrainConfig()
    env.open(c, None)  # control: one process, any timeout
    monkeypatch.setenv("WORLD_SIZE", "2")
    for wait in (600.0, 0.0):
        c.envs.agent_timeout_s = wait
        with pytest.raises(InputError, match=f"--agent-timeout-s {wait:g} under torchrun.*--dist-timeout-s 600"):
            env.open(c, None)
    c.envs.agent_timeout_s = 120
    assert env.open(c, None).fn is not None


def test_teardown_ends_only_the_group_setup_created(tmp_path, monkeypatch):
    """train() ends the process group it created (tests/dist_driver.py checks it after every torchrun run) and leaves
    one the caller initialised; rank() stays torchrun's RANK once the group is gone (one summary line, rank 0)."""
    from align import dist
    from align.train import TrainConfig

    c = TrainConfig(prompts_per_step=4)
    c.eval.eval_interval = 0
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    assert dist.rank() == 1  # torchrun's RANK before the group exists
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)  # the caller's own group
    try:
        assert dist.setup(c) is False  # the caller's group: not created here...
        dist.teardown(False)
        assert torch.distributed.is_initialized()  # ...so it is left alone
        dist.teardown(True)  # what train() does with a group its setup() created
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert dist.rank() == 1 and not dist.is_main()  # after the group: still torchrun's rank
    monkeypatch.delenv("WORLD_SIZE")
    assert dist.rank() == 0  # a stray RANK without torchrun's WORLD_SIZE is not a rank


def _start_cli(out: Path, model: str) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 -m align.train`` on the built-in task (its warm-started model), endless steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "align.train",
           "--device", "cpu", "--eval-interval", "0", "--prompts-per-step", "4", "--group-size", "4",
           "--steps", "100000", "--model", model, "--checkpoint-every", "0", "--dist-timeout-s", "60",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= n, proc, timeout_s, poll_s=0.2)


@pytest.mark.slow
def test_sigterm_to_torchrun_commits_one_checkpoint(tmp_path, builtin_model):
    """Every rank finishes the same step; rank 0 commits its checkpoint once (torchrun itself then exits 1: its own
    SignalException, not ours)."""
    out = tmp_path / "run"
    proc = _start_cli(out, builtin_model)
    _wait_for_steps(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert log.count("got signal 15") == 2, log[-3000:]  # both ranks
    steps = [r["step"] for r in records(out)]
    assert steps == list(range(1, steps[-1] + 1))
    assert (out / "checkpoints").is_dir(), f"no checkpoint written after SIGTERM; log:\n{log[-4000:]}"
    ckpts = [p.name for p in (out / "checkpoints").iterdir()]
    assert ckpts == [f"step_{steps[-1]}"], ckpts  # one, committed at the last logged step
    assert (out / "checkpoints" / ckpts[0] / ".complete").is_file()
    assert log.count("[align] done:") == 1


@pytest.mark.slow
def test_a_killed_rank_fails_the_run(tmp_path, builtin_model):
    """kill -9 of one rank: torchrun stops the other and exits non-zero, no hang."""
    out = tmp_path / "run"
    proc = _start_cli(out, builtin_model)
    _wait_for_steps(out, 2, proc)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False)
    pids = [int(p) for p in workers.stdout.split()]
    assert len(pids) == 2, workers.stdout
    os.kill(pids[-1], signal.SIGKILL)
    t0 = time.monotonic()
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, log[-3000:]
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_hung_rank_fails_the_others_within_the_timeout(tmp_path, char_model_2l):
    """Rank 1 hangs in its reward call at step 2: rank 0's next collective gives up after --dist-timeout-s and the
    run exits non-zero (no silent hang)."""
    t0 = time.monotonic()
    res = _run(tmp_path, "hang", char_model_2l, 2, hang={"rank": 1, "after_calls": 16}, dist_timeout_s=10)
    assert res["returncode"] != 0
    assert "Timed out" in res["log"], res["log"][-3000:]
    assert time.monotonic() - t0 < 120


def _sharded_checkpoint(tmp_path: Path, model: str) -> tuple[Path, dict, Transformer, torch.optim.Optimizer]:
    """A DCP checkpoint written by ``align.dist_checkpoint.save`` in one process (the code torchrun ranks run)."""
    from align.run import checkpoint as dist_checkpoint
    from align.run.checkpoint import load_state

    m = load_pretrained(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.tensor([[1, 2, 3]])).float().sum().backward()
    opt.step()
    ckpt = dist_checkpoint.save_sharded(tmp_path / "ckpts", 1, m, opt, {"scheduler": {}, "cursor": {"epoch": 0, "index": 4}},
                                keep=2)  # fmt: skip
    fresh = load_pretrained(model)
    return ckpt, load_state(ckpt), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2)


class _Payload:
    """Pickles to a call of os.mkdir: what a crafted .metadata could run if it were unpickled."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (str(self.target),))


def test_sharded_checkpoint_metadata_is_never_unpickled(tmp_path, char_model_2l):
    """DCP's .metadata is a pickle: align reads it with an allow-list unpickler, so a crafted file is refused with a
    CheckpointError and its payload never runs (negative control: torch's stock reader runs it)."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from align.run import checkpoint as dist_checkpoint
    from align.run.checkpoint import CheckpointError

    ckpt, state, model, opt = _sharded_checkpoint(tmp_path, char_model_2l)
    dist_checkpoint.restore_sharded(ckpt, state, model, opt)  # control: the genuine checkpoint loads
    saved = load_pretrained(char_model_2l)
    assert _max_param_diff(dict(model.named_parameters()), dict(saved.named_parameters())) > 0  # the stepped weights
    assert all(float(s["step"]) == 1 for s in opt.state.values())
    target = tmp_path / "payload_ran"
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(target)))
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read safely .*refused global posix\.mkdir"):
        dist_checkpoint.restore_sharded(ckpt, state, model, opt)
    assert not target.exists()
    model_sd, optim_sd = get_state_dict(model, opt)
    with pytest.raises(BaseException):  # noqa: B017 (whatever fails after the payload ran)
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(ckpt / "dcp"))
    assert target.is_dir()  # the stock reader unpickled it


def test_sharded_checkpoint_of_another_model_is_refused(tmp_path, char_model_2l):
    from align.run import checkpoint as dist_checkpoint
    from align.run.checkpoint import CheckpointError

    ckpt, state, model, _ = _sharded_checkpoint(tmp_path, char_model_2l)
    dist_checkpoint.check_model_config(ckpt, state, model)  # control
    state["model_config"]["num_hidden_layers"] += 1
    with pytest.raises(CheckpointError, match=r"another model .*'num_hidden_layers': \(3, 2\)"):
        dist_checkpoint.check_model_config(ckpt, state, model)


@pytest.mark.slow
@pytest.mark.rollout
def test_two_ranks_with_the_spool_sample_what_one_process_samples(tmp_path, char_model_2l):
    """--rollout spool under torchrun: rank 0 publishes the snapshot (gathered to its CPU) and syncs the worker, each
    rank submits its share of the prompts (seeded by global prompt index) to the real vLLM CPU worker: the same
    completions as one process, the same training. One worker serves both runs and the control."""
    from helpers_models import require_rollout_venv

    from align.rollout.client import SpoolClient, spawn_worker

    require_rollout_venv()
    spool = tmp_path / "spool"
    mcfg = load_pretrained(char_model_2l).config
    worker = spawn_worker(spool, model=char_model_2l, weights_version=0, log_path=tmp_path / "worker.log",
                          in_process=True, max_model_len=mcfg.max_position_embeddings, dtype="float32")  # fmt: skip
    extra = {"rollout": "spool", "spool": str(spool), "spawn_worker": False, "rollout_timeout_s": 600, "steps": 2}
    try:
        one = _run(tmp_path, "one", char_model_2l, 1, **extra)
        two = _run(tmp_path, "two", char_model_2l, 2, **extra)
        # negative control: a share submitted without its global prompt index samples other completions
        client = SpoolClient(spool, timeout_s=600)
        prompts = [[1, 3, 7], [4, 5, 7], [1, 6, 3, 7], [5, 5, 7]]
        params = SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=11)
        whole = client.generate(prompts, params)
        share = client.generate(prompts[2:], params, first_prompt_index=2)
        alone = client.generate(prompts[2:], params)
    finally:
        worker.shutdown(grace_s=5)
    assert [c.token_ids for c in share] == [c.token_ids for c in whole[8:]]
    assert [c.token_ids for c in alone] != [c.token_ids for c in whole[8:]]
    assert one["calls"] == two["calls"] and len(one["calls"]) == 2 * 16  # the same completions, in order
    for a, b in zip(one["recs"], two["recs"], strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["sync_time"] > 0 and b["sync_time"] > 0
        for k in ("loss", "grad_norm"):
            assert abs(a[k] - b[k]) <= LOSS_TOL, (a["step"], k, a[k], b[k])
    assert _max_param_diff(one["params"], two["params"]) <= PARAM_TOL


@pytest.mark.slow
def test_spool_dir_that_a_rank_cannot_write_fails_every_rank(tmp_path, char_model_2l):
    """torchrun + --rollout spool with a spool path no rank can create: the same clear error on both ranks, before
    any snapshot or worker (the verdicts are gathered, so no rank waits for another at a later collective)."""
    (tmp_path / "file").write_text("not a directory")
    res = _run(tmp_path, "run", char_model_2l, 2, expect_fail=True, rollout="spool", spool=str(tmp_path / "file" / "s"),
               spawn_worker=False)  # fmt: skip
    assert res["returncode"] != 0
    # every rank raises the gathered verdict; torchrun may stop the other rank before it prints, so the message is
    # seen once or twice, and it names both ranks' failures (what each rank found)
    assert res["log"].count("needs one spool directory every rank can write") >= 1, res["log"][-3000:]
    assert "rank 0 cannot write the spool dir" in res["log"] and "rank 1 cannot write the spool dir" in res["log"]
    assert not (tmp_path / "run" / "rollout_snapshots").exists()


EVAL_TOL = 1e-4  # the snapshot eval's sum of |w| (~5e3) of 1 vs 2 ranks (parameters agree to PARAM_TOL each)


@pytest.mark.slow
@pytest.mark.parametrize("posture", ["blocking", "snapshot"])
def test_eval_under_torchrun_measures_what_one_process_measures(batches, posture):
    """Blocking eval: every rank samples its share of the held-out prompts; snapshot eval: every rank enters the
    weights gather at the same eval step, rank 0 exports and dispatches. The eval records equal one process's."""
    key = "eval/avg@1" if posture == "blocking" else "eval/weight_sum"
    one, two = ([r for r in batches[n][f"eval_{posture}"]["all"] if key in r] for n in (1, 2))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]
    for a, b in zip(one, two, strict=True):
        assert abs(a[key] - b[key]) <= EVAL_TOL, (a, b)
    assert abs(one[0][key] - one[2][key]) > 100 * EVAL_TOL  # negative control: the points measure each step's weights


def test_fleet_seeds_a_share_by_its_global_prompt_index(monkeypatch):
    """The Ray fleet splits a request by prompt with a per-prompt seed: a torchrun rank's share (first_prompt_index)
    gets the seeds the whole request's prompts get (negative control: without it, other seeds)."""
    monkeypatch.syspath_prepend(str(ROOT / "extras" / "vllm_rollout"))
    import fleet_engine

    from align.rollout.protocol import Message, generate_request

    prompts, params = [[1, 3], [4, 5], [1, 6], [5, 5]], SamplingParams(n=2, seed=11)

    def seeds(msg) -> list[int]:
        job = fleet_engine.Job(msg, params, 0.0, set(range(len(msg.body["prompts"]))))
        return [Message.from_json(job.sub_message(i, "p")).body["params"]["seed"] for i in sorted(job.remaining)]

    whole = seeds(generate_request(prompts, params))
    assert seeds(generate_request(prompts[2:], params, first_prompt_index=2)) == whole[2:]
    assert seeds(generate_request(prompts[2:], params)) != whole[2:]


@pytest.mark.slow
def test_two_ranks_train_a_moe_model_as_one_process_does(tmp_path):
    """FSDP2 (torchrun, gloo) with the experts as ordinary parameters, replay on: 2 ranks end with the parameters
    of 1 process (align/moe.py; the launcher and tolerance of the dense comparisons)."""
    path = char_moe_model(tmp_path / "moe")
    TOK.save(path)
    runs = {"moe": {"moe": {"routing_replay": "rollout"}, "pack_sequences": True}}
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    one = _run_batch(tmp_path / "one", path, 1, runs)["moe"]
    two = _run_batch(tmp_path / "two", path, 2, runs)["moe"]
    assert [r["step"] for r in two["recs"]] == [r["step"] for r in one["recs"]] and one["recs"]
    assert all(r["moe/routing_mismatch"] == 0.0 for r in two["recs"])
    assert two["calls"] == one["calls"]  # the same completions were sampled and scored
    assert _max_param_diff(two["params"], one["params"]) < PARAM_TOL
    assert _max_param_diff(two["params"], dict(load_pretrained(path).named_parameters())) > 1e-4  # control: trained
