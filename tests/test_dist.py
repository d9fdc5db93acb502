"""Multi-process training (align.dist): real ``torchrun --nproc-per-node 2`` on gloo vs one process, same seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from align.model import Transformer, load_pretrained, save_pretrained
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams
from align.tasks import reverse
from align.tasks.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "dist_driver.py"
LOSS_TOL = 1e-5  # losses and grad norms: 1 vs 2 ranks sum the same terms in another order
PARAM_TOL = 1e-5  # parameters after the last step
STEPS = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    cfg = reverse.model_config(CharTokenizer("abcd="))
    cfg.num_hidden_layers = 2  # two FSDP layer units plus the root
    return str(save_pretrained(Transformer(cfg).init_weights(seed=0), tmp_path_factory.mktemp("tiny") / "m"))


def test_generate_rows_samples_what_the_whole_call_samples(tiny_model):
    """A rank's share of a step, sampled with rows=(first, total), is exactly that share of the one large call."""
    model = load_pretrained(tiny_model)
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


def _run(tmp_path: Path, name: str, model: str, nproc: int, per_rank_normaliser: bool = False, hang: dict | None = None,
         **extra) -> dict:  # fmt: skip
    out = tmp_path / name
    cfg = {
        "out": str(out),
        "steps": STEPS,
        "prompts_per_step": 4,
        "group_size": 4,
        "max_tokens": 4,
        "lr": 1e-2,
        "warmup_steps": 0,
        "checkpoint_every": 0,
        "micro_batch_size": 8,
        "save_hf": str(tmp_path / f"{name}.hf"),
        "device": "cpu",
        "threads": 1,
        **extra,
    }
    spec = {
        "cfg": cfg,
        "model": model,
        "calls": str(tmp_path / f"{name}.calls.json"),
        "per_rank_normaliser": per_rank_normaliser,
        "hang": hang or {},
    }
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + [str(DRIVER), json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    if hang:
        return {"returncode": p.returncode, "log": p.stdout + p.stderr}
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "reward_mean" in r]
    params = dict(load_pretrained(cfg["save_hf"]).named_parameters())
    return {"recs": recs, "calls": json.loads((tmp_path / f"{name}.calls.json").read_text()), "params": params}


def _max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).detach().abs().max()) for k in a)


# The plain step; and K=2 updates x M=2 mini-batches per batch with a token budget (ranks run different numbers of
# micro-batches: the padding path) and a KL term (the sharded reference model). The second makes 12 AdamW steps,
# which amplify the sum-order differences of near-zero gradient entries (Adam's update is ~lr * sign there): its
# lr is lower so the parameter tolerance stays PARAM_TOL.
CONFIGS = {
    "plain": {},
    "updates_minibatches_tokens_kl": {
        "updates_per_batch": 2,
        "mini_batches": 2,
        "micro_batch_tokens": 12,
        "lr": 1e-3,
        "loss": {"kl_coef": 0.1},
    },
}


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, tiny_model) -> dict:
    """The plain config in 1 process and on 2 ranks, checkpointing at steps 2 and 3: compared with each other
    below, and each resumed with the other world size (test_resume_with_another_world_size)."""
    d = tmp_path_factory.mktemp("plain")
    return {n: {**_run(d, f"run{n}", tiny_model, n, checkpoint_every=2), "dir": d, "name": f"run{n}"} for n in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("extra", CONFIGS.values(), ids=CONFIGS.keys())
def test_two_ranks_give_the_single_process_result(tmp_path, tiny_model, extra, plain_runs):
    if extra:
        one = _run(tmp_path, "one", tiny_model, 1, **extra)
        two = _run(tmp_path, "two", tiny_model, 2, **extra)
    else:  # the plain runs also checkpoint (steps 2 and 3): that changes nothing they compute
        one, two = plain_runs[1], plain_runs[2]
    assert [r["step"] for r in one["recs"]] == [r["step"] for r in two["recs"]] == list(range(1, STEPS + 1))
    assert one["calls"] == two["calls"] and len(one["calls"]) == STEPS * 16  # the same completions, in order
    for a, b in zip(one["recs"], two["recs"]):
        assert a["reward_mean"] == b["reward_mean"] and a["num_tokens"] == b["num_tokens"]
        for k in ("loss", "grad_norm", "entropy"):
            assert abs(a[k] - b[k]) <= LOSS_TOL, (a["step"], k, a[k], b[k])
    base = dict(load_pretrained(tiny_model).named_parameters())
    assert _max_param_diff(one["params"], base) > 100 * PARAM_TOL  # it trained
    assert _max_param_diff(one["params"], two["params"]) <= PARAM_TOL
    # negative control: each rank normalising by its own token counts is caught
    bad = _run(tmp_path, "bad", tiny_model, 2, per_rank_normaliser=True, **extra)
    assert bad["recs"][0]["reward_mean"] == one["recs"][0]["reward_mean"]  # same first rollouts...
    assert _max_param_diff(one["params"], bad["params"]) > PARAM_TOL  # ...but not the whole-batch gradient


BF16_LOSS_TOL = 2e-3  # bf16 weights: 1 vs 2 ranks round the summed gradients differently


@pytest.mark.slow
def test_two_ranks_bf16_weights(tmp_path, tiny_model):
    """--precision bf16 (bf16 shards, AdamW32's fp32 moments sharded like them, fp32 gradient reduction): the same
    completions at step 1, losses within BF16_LOSS_TOL over 3 steps; a per-rank normaliser is caught."""
    one = _run(tmp_path, "one", tiny_model, 1, precision="bf16")
    two = _run(tmp_path, "two", tiny_model, 2, precision="bf16")
    bad = _run(tmp_path, "bad", tiny_model, 2, per_rank_normaliser=True, precision="bf16")
    assert one["calls"][:16] == two["calls"][:16]
    assert all(abs(a["loss"] - b["loss"]) <= BF16_LOSS_TOL for a, b in zip(one["recs"], two["recs"]))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(one["recs"], bad["recs"])) > BF16_LOSS_TOL


@pytest.mark.slow
@pytest.mark.parametrize(("first", "second"), [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_resume_with_another_world_size(tiny_model, first, second, plain_runs):
    """A checkpoint written by 2 ranks resumes in 1 process and vice versa: the redone step is the same step.
    ``first`` ranks ran 3 steps (plain_runs, checkpoints at steps 2 and 3); ``second`` ranks resume that run from
    step_2 and redo step 3."""
    whole = plain_runs[first]
    tmp_path, name = whole["dir"], whole["name"]
    assert sorted(p.name for p in (tmp_path / name / "checkpoints").iterdir()) == ["step_2", "step_3"]
    again = _run(tmp_path, name, tiny_model, second, resume_from="step_2", save_hf=str(tmp_path / f"{name}.again.hf"))
    assert [r["step"] for r in again["recs"]] == [1, 2, 3]  # metrics.jsonl kept steps 1-2, then the redone step 3
    a, b = whole["recs"][-1], again["recs"][-1]
    assert a["reward_mean"] == b["reward_mean"]
    for k in ("loss", "grad_norm"):
        assert abs(a[k] - b[k]) <= LOSS_TOL, (k, a[k], b[k])
    assert _max_param_diff(whole["params"], again["params"]) <= PARAM_TOL
    # negative control: the optimizer state is restored (step 3 redone with its second moments scaled differs)
    state_path = tmp_path / name / "checkpoints" / "step_2" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)
    for s in state["optimizer"]["state"].values():
        s["exp_avg_sq"] *= 4
    torch.save(state, state_path)
    bad = _run(tmp_path, name, tiny_model, second, resume_from="step_2", save_hf=str(tmp_path / f"{name}.bad.hf"))
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
    with pytest.raises(ValueError, match="--rollout spool"):
        check_supported(cfg(rollout="spool"), 2)
    with pytest.raises(ValueError, match="--eval-interval"):
        check_supported(TrainConfig(prompts_per_step=4), 2)  # eval on by default
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
    deadline = time.monotonic() + timeout_s
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {n} steps in {timeout_s}s: {proc.communicate()[0][-3000:]}")


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
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, steps[-1] + 1))
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
def test_a_hung_rank_fails_the_others_within_the_timeout(tmp_path, tiny_model):
    """Rank 1 hangs in its reward call at step 2: rank 0's next collective gives up after --dist-timeout-s and the
    run exits non-zero (no silent hang)."""
    t0 = time.monotonic()
    res = _run(tmp_path, "hang", tiny_model, 2, hang={"rank": 1, "after_calls": 16}, dist_timeout_s=10)
    assert res["returncode"] != 0
    assert "Timed out" in res["log"], res["log"][-3000:]
    assert time.monotonic() - t0 < 120
