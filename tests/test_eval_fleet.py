"""The eval fleet for real: spool vLLM workers (the CPU build of vLLM in .venv-rollout) evaluating snapshots that
align.model.save_pretrained exports while a training loop keeps stepping.

One fleet of 2 in-process CPU engines serves the whole sequence (engine start is the expensive part on 2 cores):
real pins and evals of changing weights, then a pin violation (one engine misses the load: its spool client is
wrapped so the load message is never sent; the stale version is read back from the real engine), then one engine
SIGSTOPped while the trainer waits behind a full queue (the watchdog's line names the eval fleet), then stopped past
its heartbeat staleness (unhealthy at once), then an unhealthy fleet (one worker process killed). Without .venv-rollout these tests skip, or fail under
ALIGN_REQUIRE_ROLLOUT=1.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers_models import VLLM_TIMEOUT_S, exact_eval_set, require_rollout_venv
from helpers_train import fleet_eval_config, greedy_eval, native_episode_rewards, partial_credit

from align.eval import EvalConfig, make_evaluator

pytestmark = pytest.mark.rollout

PROMPTS = [[5, 17, 99, 123], [7, 8], [300, 2, 44, 45, 46, 47], [11, 12, 13]]
MAX_TOKENS = 8
NOISE = 0.05  # per-"optimizer step" weight change: enough to change greedy continuations
STALL_S = 4.0  # the watchdog's timeout while an eval engine is stopped (its client's staleness is 30 s)


def fake_optimizer_step(model: torch.nn.Module, step: int) -> None:
    """Deterministic stand-in for one optimizer step: every weight moves (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * NOISE)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from helpers_models import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("base") / "qwen2", seed=0)


def reference_greedy(base_dir: Path, steps: int, tmp: Path) -> list[list[int]]:
    """transformers' greedy continuations of PROMPTS under the weights after ``steps`` fake optimizer steps."""
    from helpers_models import greedy_ids, load_hf

    from align.model import load_pretrained, save_pretrained

    m = load_pretrained(base_dir)
    for s in range(1, steps + 1):
        fake_optimizer_step(m, s)
    ref = save_pretrained(m, tmp / f"ref_step_{steps}")
    hf = load_hf(ref)
    return [greedy_ids(hf, p, MAX_TOKENS) for p in PROMPTS]


class StaleClient:
    """Wraps an engine's spool client so a snapshot load is never delivered (an engine that missed the reload)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def sync_weights(self, snapshot_dir, version) -> float:
        return 0.0

    def generate(self, prompts, params):
        return self.inner.generate(prompts, params)


@pytest.mark.slow  # two vLLM engines start side by side, then 9 eval points: ~75 s on 2 loaded cores
def test_fleet_evaluates_exact_snapshots_while_training_continues(base, tmp_path):
    require_rollout_venv()
    from align.model import load_pretrained, save_pretrained

    target = 2  # the eval set rewards exactly the greedy continuations of the step-2 weights
    expected = reference_greedy(base, target, tmp_path)
    eval_set = exact_eval_set(PROMPTS, expected, MAX_TOKENS, step=target)
    cfg = EvalConfig(
        eval_interval=1,
        eval_num_gpus=2,
        eval_hf_dir=str(tmp_path / "eval_hf"),
        eval_max_in_flight=2,
        eval_keep_snapshots=1,
        eval_timeout_s=VLLM_TIMEOUT_S,
    )
    model = load_pretrained(base)
    ev = make_evaluator(cfg, eval_set, export_fn=lambda p: save_pretrained(model, p), blocking_eval_fn=None)
    fleet = ev.dispatcher.runner.fleet
    records, step_seconds, in_flight_after = [], {}, {}
    try:
        for step in (1, 2, 3):
            fake_optimizer_step(model, step)
            t0 = time.perf_counter()
            records += ev.step(step)
            step_seconds[step] = time.perf_counter() - t0
            in_flight_after[step] = [p.step for p in ev.dispatcher.pending]
        records += ev.dispatcher.drain()  # settle (not terminal) before tampering with the fleet

        # training advanced while eval 1 (which includes the fleet's start) was still in flight
        assert 1 in in_flight_after[2], in_flight_after
        by_step = {r["step"]: r for r in records}
        assert sorted(by_step) == [1, 2, 3], records
        assert step_seconds[1] < by_step[1]["eval/duration_seconds"], (step_seconds, by_step[1])
        for s, r in by_step.items():
            # each result names the exact snapshot it measured: every engine read back version == step ...
            assert r["eval/weight_version"] == s and r["eval/mixed_version_ratio"] == 0.0, r
        # ... and the generations are those of that step's weights (transformers reference on step 2)
        assert by_step[2]["eval/pass@1"] == 1.0, by_step
        assert by_step[1]["eval/pass@1"] < 1.0 and by_step[3]["eval/pass@1"] < 1.0, by_step
        assert by_step[1]["eval/lag_steps"] >= 1  # it landed after training had moved on
        snapshots = sorted(d for d in os.listdir(cfg.eval_hf_dir) if d.startswith("step_"))
        assert snapshots == ["step_3"]  # retention ring, keep=1 (the fleet's spools/logs live beside them)

        # one engine misses the load of step 4: the real engine still answers with version 3 -> pin_violation
        e1 = fleet.engines[1]
        real_client, e1.client = e1.client, StaleClient(e1.client)
        fake_optimizer_step(model, 4)
        records = ev.step(4) + ev.dispatcher.drain()
        e1.client = real_client
        assert [(r["step"], r.get("eval/skipped_pin_violation")) for r in records] == [(4, 1)], records

        # one engine is stopped (SIGSTOP) while the trainer waits behind a full queue: the watchdog names the eval
        # fleet (not "the training loop stopped between parts"), the wait gives up as at a safe point, and after
        # SIGCONT the queued points land pinned (control: the fleet itself was fine)
        records = stopped_engine_stalls_the_wait_on_the_fleet(ev, model, e1, tmp_path / "run")
        by_step = {r["step"]: r for r in records}
        assert sorted(by_step) == [5, 6, 7] and by_step[7].get("eval/skipped_interrupted") == 1, records
        assert [by_step[s].get("eval/weight_version") for s in (5, 6)] == [5, 6], records

        # an engine stopped for longer than its client's heartbeat staleness: the point is unhealthy at once (it was
        # pin_violation after two loads that each waited for the staleness)
        e1.client.stale_s = 2.0
        os.killpg(e1.handle.pid, signal.SIGSTOP)
        try:
            fake_optimizer_step(model, 8)
            records = ev.step(8) + ev.dispatcher.drain()
        finally:
            os.killpg(e1.handle.pid, signal.SIGCONT)
        assert [(r["step"], r.get("eval/skipped_unhealthy")) for r in records] == [(8, 1)], records

        # one worker process dies: the next point (the final step, never dropped) is skipped as unhealthy
        os.killpg(e1.handle.pid, signal.SIGKILL)
        e1.handle.proc.wait(timeout=30)
        fake_optimizer_step(model, 9)
        records = ev.step(9, is_final=True) + ev.drain()
        assert [(r["step"], r.get("eval/skipped_unhealthy")) for r in records] == [(9, 1)], records
        assert ev.drain() == []
    finally:
        ev.drain()
    assert not any(e.handle.group_alive() for e in fleet.engines), "an eval worker survived drain()"


def stopped_engine_stalls_the_wait_on_the_fleet(ev, model, engine, out: Path) -> list[dict]:
    """Steps 5, 6 fill the queue (--eval-max-in-flight 2) while ``engine`` is stopped; step 7 waits behind them with a
    watchdog of STALL_S on: its line must name the eval fleet within STALL_S plus polls. Returns the records."""
    from align.run.watchdog import Watchdog

    stop_flag: dict = {"prog": "align.train"}
    ev.dispatcher.should_stop = lambda: bool(stop_flag.get("stall"))  # as align.train's (a stall stops the run)
    out.mkdir()
    watchdog = Watchdog(out, STALL_S, stop_flag)
    os.killpg(engine.handle.pid, signal.SIGSTOP)
    try:
        watchdog.start()
        records = []
        for step in (5, 6):
            fake_optimizer_step(model, step)
            records += ev.step(step)
        fake_optimizer_step(model, 7)
        t0 = time.monotonic()
        records += ev.step(7)  # waits for the oldest point (pinning on the stopped engine) until the stall
        waited = time.monotonic() - t0
    finally:
        watchdog.close()
        os.killpg(engine.handle.pid, signal.SIGCONT)
        ev.dispatcher.should_stop = lambda: False
    line = stop_flag.get("stall") or ""
    assert line.startswith("stalled:") and "the eval fleet stopped" in line, line
    assert waited < STALL_S + 10, waited  # the line came within the timeout (+ the watchdog's and the wait's polls)
    stall = (out / "stall.txt").read_text()
    assert "eval fleet: for" in stall and "engine_1" in stall and "load 5" in stall, stall[:2000]
    assert "the trainer waits here at a safe point" in stall, stall[:2000]
    return records + ev.dispatcher.drain()


def test_training_run_evaluates_on_a_real_fleet_while_it_trains(tmp_path, builtin_model_30):
    """align.train's loop end to end: GRPO steps on CPU, evals on a real eval worker (vLLM CPU build).

    ``--eval-keep-snapshots 0``: every snapshot is deleted as soon as its point settles, so the worker must never
    touch a snapshot after loading it (it used to re-read the last one's config.json at the next load:
    FileNotFoundError, worker dead, every later point unhealthy). The step-0 baseline goes through the fleet
    too (the base checkpoint, caller-owned: evaluated in place, never deleted)."""
    require_rollout_venv()
    import json

    from align.model import load_pretrained
    from align.run.checkpoint import committed
    from align.run.sources import apply_task_defaults
    from align.tasks import reverse
    from align.train import TrainConfig, train

    base = builtin_model_30  # the reverse task after a 30-step warm start (tests/conftest.py)
    tok = reverse.tokenizer()
    eval_prompts = reverse.prompts(24, "eval", 0)
    eval_cfg = fleet_eval_config(tmp_path, keep=0)  # greedy: the final point is re-scored below with align's sampler
    cfg = TrainConfig(
        out=str(tmp_path / "run"),
        steps=6,
        prompts_per_step=8,
        group_size=4,
        checkpoint_every=0,
        eval=eval_cfg,
    )
    apply_task_defaults(cfg, reverse.TRAIN_DEFAULTS)  # max_tokens (its model's context), lr, eps_high
    summary = train(
        cfg,
        model=str(base),
        tokenizer=tok,
        prompts=reverse.prompts(200, "train", 0),
        reward=partial_credit,
        eval_prompts=eval_prompts,
    )
    assert summary["steps"] == 6
    lines = (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    train_at = {r["step"]: i for i, r in enumerate(records) if "step_time" in r}
    evals = {r["step"]: (i, r) for i, r in enumerate(records) if "eval/avg@1" in r}
    assert sorted(evals) == [0, 2, 4, 6], records
    for s, (_, r) in evals.items():
        assert r["eval/weight_version"] == s and r["eval/mixed_version_ratio"] == 0.0, r  # read back from the engine
    # training advanced while the first eval (the baseline: fleet start + eval) was in flight: its record was
    # written after the records of later training steps, and it says how far training had moved on
    i0, r0 = evals[0]
    assert i0 > train_at[1], [(r["step"], "eval" if "eval/step" in r else "train") for r in records]
    assert r0["eval/lag_steps"] >= 1
    assert r0["eval/train_blocked_seconds"] < r0["eval/duration_seconds"]  # the loop paid nothing for it
    assert os.path.isfile(os.path.join(base, "config.json"))  # the caller-owned base is never deleted
    assert not [d for d in os.listdir(eval_cfg.eval_hf_dir) if d.startswith(("step_", ".step_"))]  # keep 0

    # the step-6 record measured exactly the step-6 weights: re-score that policy with align's native sampler
    (last_step, last_dir), *_ = sorted(committed(Path(cfg.out) / "checkpoints"), reverse=True)
    assert last_step == 6
    native, _ = greedy_eval(load_pretrained(last_dir / "model"), tok, eval_prompts, cfg.max_tokens)
    assert native["eval/avg@1"] > 0  # a non-trivial fingerprint
    assert evals[6][1]["eval/avg@1"] == pytest.approx(native["eval/avg@1"], abs=1e-9), (evals[6][1], native)
    # negative control: the fingerprint tells snapshots apart (the step-2 and step-4 weights score differently)
    assert native["eval/avg@1"] not in (evals[2][1]["eval/avg@1"], evals[4][1]["eval/avg@1"]), (evals, native)


@pytest.mark.slow  # one vLLM eval engine start + 2 GRPO steps of episodes: ~50 s on 2 loaded cores
def test_held_out_episodes_are_evaluated_on_the_fleet_at_each_snapshot(tmp_path, builtin_model):
    """``--env`` with ``--eval-num-gpus 1``: each eval point runs the held-out rows' episodes (every turn a request to
    the eval worker, the environment's replies as suffix ids) on the snapshot of its step, while training goes on.
    The final point equals the reference: the same episodes on align's native sampler from the step-2 weights."""
    require_rollout_venv()
    import json
    import sys

    from align.envs.config import EnvConfig
    from align.model import load_pretrained
    from align.run.checkpoint import committed
    from align.tasks import reverse
    from align.train import TrainConfig, train

    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    import turn_envs

    tok = reverse.tokenizer()
    eval_rows = reverse.prompts(10, "eval", 0)
    eval_cfg = EvalConfig(eval_interval=2, eval_num_gpus=1, eval_hf_dir=str(tmp_path / "eval_hf"), eval_temperature=0.0,
                          eval_timeout_s=VLLM_TIMEOUT_S, ci_test=True)  # fmt: skip
    cfg = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=4, group_size=4, max_tokens=8, lr=1e-2,
                      checkpoint_every=0, eval=eval_cfg, envs=EnvConfig(max_turns=3, env_reward="sum"))  # fmt: skip
    train(cfg, model=str(builtin_model), tokenizer=tok, prompts=reverse.prompts(64, "train", 0),
          env=turn_envs.Graded, eval_prompts=eval_rows)  # fmt: skip
    records = [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval/step" in r}
    assert sorted(evals) == [0, 2], records
    for s, r in evals.items():  # each point measured its own snapshot, read back from the engine
        assert r["eval/weight_version"] == s and r["eval/mixed_version_ratio"] == 0.0, r
        assert 0 <= r["eval/first_turn_pass@1"] <= r["eval/pass@1"] <= 1, r
    (last_step, last_dir), *_ = sorted(committed(Path(cfg.out) / "checkpoints"), reverse=True)
    assert last_step == 2
    final = load_pretrained(last_dir / "model")
    ref = native_episode_rewards(final, tok, eval_rows, turn_envs.Graded, 3, 8)
    assert evals[2]["eval/avg@1"] == pytest.approx(sum(ref) / len(ref), abs=1e-6), (evals, ref)
    # negative controls: the step-0 point measured other weights, and one turn (the feedback never read) scores less
    assert abs(evals[0]["eval/avg@1"] - evals[2]["eval/avg@1"]) > 1e-3, evals
    one = native_episode_rewards(final, tok, eval_rows, turn_envs.Graded, 1, 8)
    assert abs(sum(one) - sum(ref)) > 1e-3, (one, ref)


def reverse_agent(base_url: str, api_key: str, model: str, prompt: str, answer: str, **row) -> float:
    """An agent written only against the ``openai`` client: asks, then asks again after a user's "=", and scores
    both replies against the reversed word (``partial_credit``)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages, score = [{"role": "user", "content": prompt}], 0.0
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6).choices[0].message
        score += partial_credit(prompt, reply.content or "", answer=answer) / 2
        messages += [{"role": "assistant", "content": reply.content or ""}, {"role": "user", "content": "="}]
    return score


@pytest.mark.slow  # one vLLM eval engine start + 2 GRPO steps of agent runs, then the same run evaluated in the loop
def test_held_out_agent_runs_are_evaluated_on_the_fleet_at_each_snapshot(tmp_path, builtin_model):
    """``--agent`` with ``--eval-num-gpus 1``: each eval point runs the held-out rows' agents (an agent written only
    against the ``openai`` client) through a gateway over the eval worker pinned to the snapshot of its step, while
    training goes on. Reference: the same run evaluated in the loop on align's native sampler (greedy, the live
    policy at steps 0 and 2): every point equal. Control: the two points measured different weights."""
    require_rollout_venv()
    pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")
    import json

    from align.tasks import reverse
    from align.tasks.agent import ChatCharTokenizer
    from align.train import TrainConfig, train

    tok = ChatCharTokenizer(reverse.ALPHABET)  # the reverse task's ids, with a chat template the gateway renders
    evals = {}
    for posture in ("fleet", "loop"):
        out = tmp_path / posture
        if posture == "fleet":
            eval_cfg = fleet_eval_config(out, keep=0)
        else:
            eval_cfg = EvalConfig(eval_interval=2, eval_temperature=0.0)
        cfg = TrainConfig(out=str(out / "run"), steps=2, prompts_per_step=2, group_size=2, max_tokens=6, lr=1e-2,
                          checkpoint_every=0, eval=eval_cfg)  # fmt: skip
        train(cfg, model=builtin_model, tokenizer=tok, prompts=reverse.prompts(8, "train", 0),
              eval_prompts=reverse.prompts(6, "eval", 0), agent=reverse_agent)  # fmt: skip
        records = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        evals[posture] = {r["step"]: r for r in records if "eval/step" in r}
    fleet, loop = evals["fleet"], evals["loop"]
    assert sorted(fleet) == sorted(loop) == [0, 2], evals
    for s, r in fleet.items():  # each point measured its own snapshot, read back from the engine
        assert r["eval/weight_version"] == s and r["eval/mixed_version_ratio"] == 0.0 and "eval/errors" not in r, r
        assert r["eval/avg@1"] == pytest.approx(loop[s]["eval/avg@1"], abs=1e-9), (s, r, loop[s])
    assert abs(fleet[0]["eval/avg@1"] - fleet[2]["eval/avg@1"]) > 1e-3, fleet  # control: other weights, other score


@pytest.mark.slow  # one vLLM eval engine start + 2 GRPO steps of proof episodes + 2 eval points: ~60 s on 2 loaded cores
def test_lean_minif2f_held_out_is_evaluated_on_its_own_engine_with_the_verifier(tmp_path, prover):
    """``--env lean --eval-data miniF2F --eval-num-gpus 1`` (docs/lean.md's posture): each eval point runs the held-out
    problems' proof episodes on the eval worker (the CPU build of vLLM) pinned to its step's snapshot, the Lean verifier
    (the REPL stand-in: no Lean compiler here, it replays replies recorded from the real REPL) deciding every turn.
    The final point equals the reference: the same greedy episodes on align's native sampler from the step-2
    checkpoint through a verifier of its own. Controls: the problem the prover can prove passes and the miniF2F ones
    do not (pass@1 strictly between 0 and 1: the verdicts are per problem), and its proof reached a stand-in REPL."""
    require_rollout_venv()
    import json

    from helpers_lean import STATEMENT, lean_rows, standin
    from helpers_train import native_episode_rewards

    from align.data import load_tokenizer
    from align.lean.config import LeanConfig
    from align.lean.env import LeanEnv
    from align.lean.verify import LeanVerifier
    from align.model import load_pretrained
    from align.run.checkpoint import committed
    from align.train import main

    minif2f = Path(__file__).parent / "data" / "minif2f_test.jsonl"
    held_out = [json.loads(x) for x in minif2f.read_text().splitlines()[:4]] + lean_rows(1)
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lean_rows(4)))
    log = tmp_path / "repl_commands.jsonl"
    out = tmp_path / "run"
    rc = main(["--out", str(out), "--model", prover, "--train-data", str(tmp_path / "train.jsonl"), "--env", "lean",
               "--lean-repl", standin(log), "--lean-workers", "2", "--steps", "2", "--prompts-per-step", "2",
               "--group-size", "2", "--max-tokens", "24", "--lr", "1e-3", "--warmup-steps", "0", "--threads", "1",
               "--max-turns", "2", "--env-reward", "sum", "--checkpoint-every", "0", "--eval-data",
               str(tmp_path / "eval.jsonl"), "--eval-interval", "2", "--eval-n", "1", "--eval-temperature", "0",
               "--eval-num-gpus", "1", "--eval-hf-dir", str(tmp_path / "eval_hf"), "--eval-timeout-s",
               str(VLLM_TIMEOUT_S), "--ci-test"])  # fmt: skip
    assert rc == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval/step" in r}
    assert sorted(evals) == [0, 2], records
    for s, r in evals.items():  # each point measured its own snapshot, read back from the engine
        assert r["eval/weight_version"] == s and r["eval/mixed_version_ratio"] == 0.0, r
    (last_step, last_dir), *_ = sorted(committed(out / "checkpoints"), reverse=True)
    assert last_step == 2
    final, tok = load_pretrained(last_dir / "model"), load_tokenizer(prover, prover)
    verifier = LeanVerifier(LeanConfig(repl=standin(), workers=2))
    try:
        ref = native_episode_rewards(final, tok, held_out, LeanEnv.bind(verifier), 2, 24)
    finally:
        verifier.close()
    assert evals[2]["eval/avg@1"] == pytest.approx(sum(ref) / len(ref), abs=1e-6), (evals, ref)
    assert 0 < evals[2]["eval/pass@1"] < 1 and ref[-1] == 1.0, (evals[2], ref)  # the provable one, not miniF2F
    cmds = [json.loads(x)["cmd"] for x in log.read_text().splitlines()]
    assert any(STATEMENT.split(":=")[0] in c for c in cmds)  # its proof was compiled by a REPL process
