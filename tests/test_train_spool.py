"""GRPO end to end with --rollout spool: the real vLLM worker (CPU build, .venv-rollout) generates, the
trainer publishes a snapshot every step and the worker reloads it. On-policy at T=1 the sampler's
logprobs and the trainer's recompute agree, so the reported mismatch (rho) is ~1."""

from __future__ import annotations

import json

import pytest
from helpers_models import record_carries, require_rollout_venv
from helpers_train import records, spool_cfg, two_turns

from align.tasks import reverse
from align.train import TrainConfig, train


def record_worker_and_learner(monkeypatch) -> tuple:
    """Patches ``SpoolClient.generate`` and ``Learner.update``; returns ``(returned, trained, most)``: a Counter of
    (prompt ids, completion ids, logprobs) of every completion the worker returned, the completions the learner got
    per step, and ``most[0]``: the most generate calls in flight at once."""
    import threading
    from collections import Counter

    from align.rollout.client import SpoolClient
    from align.run.parts import Learner

    returned: Counter = Counter()
    trained: list[list] = []
    in_flight, most, lock = [0], [0], threading.Lock()
    real_generate, real_update = SpoolClient.generate, Learner.update

    def generate(self, prompts, params, **kw):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            out = real_generate(self, prompts, params, **kw)
        finally:
            with lock:
                in_flight[0] -= 1
        returned.update((tuple(prompts[c.prompt_index]), tuple(c.token_ids), tuple(c.logprobs)) for c in out)
        return out

    def update(self, batch):
        trained.append(list(batch.completions))
        return real_update(self, batch)

    monkeypatch.setattr(SpoolClient, "generate", generate)
    monkeypatch.setattr(Learner, "update", update)
    return returned, trained, most


pytestmark = pytest.mark.rollout

MISMATCH_TOL = 1e-3  # |log pi_old - log mu| per token, fp32 vLLM CPU vs align (measured ~1e-5)


def test_grpo_with_spool_rollout(tmp_path, reverse_model):
    require_rollout_venv()
    tok = reverse.tokenizer()
    model = reverse_model
    cfg = spool_cfg(tmp_path / "run", steps=3)
    prompts = reverse.prompts(16, "train")
    summary = train(
        cfg,
        model=str(model),
        tokenizer=tok,
        prompts=prompts,
        reward=lambda prompt, completion, **_: completion.count("a") / 6,
    )  # dense: learnable from scratch
    assert summary["steps"] == 3
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["sync_time"] > 0  # a snapshot was published and reloaded after every step
        assert r["mismatch_abs_max"] < MISMATCH_TOL, r["mismatch_abs_max"]
    # the updates were real: a different policy after step 1 means the worker must have reloaded weights,
    # else the rollouts of later steps would still match the base model's logprobs and the mismatch would grow
    assert recs[0]["grad_norm"] > 0
    assert not any(p.is_dir() for p in (tmp_path / "run").iterdir() if p.name.startswith("spool-proc"))


def test_lean_episodes_on_the_spool_worker_train_on_what_vllm_sampled(prover, tmp_path, monkeypatch):
    """`--rollout spool --env lean --max-turns 2 --lean-correction-fraction 0.5 --preset dr_grpo` (the recipe's shape,
    docs/lean.md) on the real vLLM worker and the REPL stand-in (no Lean compiler here: it replays replies recorded
    from the real REPL, tests/helpers_lean.py). Each episode submits its next turn as its own request: the first prompt (Goedel's, or a correction prompt from the
    queue), every earlier turn's sampled ids and the correction feedback's ids. Checked on what the learner got: each
    policy segment is exactly a completion the worker returned for exactly that prefix (ids and logprobs; every
    returned completion trained once), the feedback between turns is masked environment ids (the chat template's
    render of Goedel's feedback, logprob 0, never sampled), the trainer's recompute matches vLLM's logprobs (rho ~1),
    the lean/* counts add up to the turns verified, step 2 draws a correction prompt from step 1's failures, and
    every compiled proof (and the #print axioms of each accepted one) reached a stand-in REPL process."""
    require_rollout_venv()
    from collections import Counter

    from helpers_lean import STATEMENT, lean_rows, standin

    from align.chat import TurnRenderer
    from align.data import load_tokenizer
    from align.lean import goedel
    from align.train import main

    returned, trained, _ = record_worker_and_learner(monkeypatch)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in lean_rows(4)))
    calls = tmp_path / "repl_calls.jsonl"
    argv = [
        "--out",
        str(tmp_path / "run"),
        "--model",
        prover,
        "--train-data",
        str(data),
        "--env",
        "lean",
        "--lean-repl",
        standin(calls),
        "--lean-workers",
        "2",
        "--max-turns",
        "2",
        "--lean-correction-fraction",
        "0.5",
        "--rollout",
        "spool",
        "--rollout-in-process",
        "--rollout-timeout-s",
        "600",
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-tokens",
        "24",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "0",
        "--threads",
        "1",
        "--checkpoint-every",
        "0",
        "--eval-interval",
        "0",
        "--preset",
        "dr_grpo",
    ]
    assert main(argv) == 0
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and [len(eps) for eps in trained] == [8, 8]
    tok = load_tokenizer(prover, prover)
    renderer = TurnRenderer(tok)
    got: Counter = Counter()
    queued: list[list[dict]] = []  # the first prompts of step 2's correction episodes, as messages
    compiled: Counter = Counter()  # the compile views of the proofs Lean was asked about (not refused by a text guard)
    for eps in trained:
        for e in eps:
            # the first prompt's messages: Goedel's first prompt, or a correction prompt (+ r failed rounds)
            n0 = next(n for n in range(1, len(e.messages), 2) if renderer.first(e.messages[:n]) == e.prompt_ids)
            rounds, at = (n0 - 1) // 2, 0
            assert rounds == ("lean/correction" in e.turns[0]["info"]) * 2  # a --max-turns 2 failure's 2 rounds
            if rounds:
                queued.append(e.messages[:n0])
            for k, turn in enumerate(e.turns):
                seg = slice(at, at + turn["policy_tokens"])
                assert all(e.mask[seg]) and turn["policy_tokens"] > 0
                got[(tuple(e.prompt_ids + e.token_ids[:at]), tuple(e.token_ids[seg]), tuple(e.logprobs[seg]))] += 1
                if {"lean/ok", "lean/rejected_lean_error"} & set(turn["info"]):
                    text = e.messages[n0 + 2 * k]["content"]
                    compiled[goedel.compile_view(goedel.full_code(STATEMENT, text)[0])] += 1
                at = seg.stop
                env = slice(at, at + turn["env_tokens"])
                if turn["env_tokens"]:  # a correction round: Goedel's feedback as the template renders it, masked
                    feedback = e.messages[n0 + 2 * k + 1]
                    assert feedback["content"].startswith(f"The proof (Round {k + rounds}) is not correct.")
                    assert e.token_ids[env] == renderer.suffix([feedback])
                    assert not any(e.mask[env]) and all(lp == 0.0 for lp in e.logprobs[env])
                at = env.stop
            assert at == len(e.token_ids)
    assert got == returned  # the trained policy ids are the sampled ones, each once, and nothing else was sampled
    for r, eps in zip(recs, trained):
        assert r["mismatch_abs_max"] < MISMATCH_TOL, r["mismatch_abs_max"]
        verdicts = r["lean/proved"] + r["lean/verifier_errors"] + sum(v for k, v in r.items() if "lean/rejected_" in k)
        assert verdicts == sum(len(e.turns) for e in eps) and r["lean/verifier_errors"] == 0  # one per turn
        assert r["reward_mean"] == pytest.approx(r["lean/proved"] / 8)  # the last turn's verdict (--env-reward last)
    assert [r["lean/correction_prompts"] for r in recs] == [0.0, 1.0] and len(queued) == 4  # one group of G
    assert queued[0] in [e.messages for e in trained[0] if e.env_reward == 0.0]  # a step-1 failure, whole
    # negative control for got == returned: a second turn's key without the feedback ids in its prefix is no request
    # the worker answered (the requests carried the environment's ids; a prefix of policy ids alone would not match)
    two = [e for step in trained for e in step if len(e.turns) == 2]
    assert two  # real correction rounds as turns
    for e in two:
        cut, n = e.turns[0]["policy_tokens"], e.turns[1]["policy_tokens"]
        key = (tuple(e.prompt_ids + e.token_ids[:cut]), tuple(e.token_ids[-n:]), tuple(e.logprobs[-n:]))
        assert key not in returned and (key[0] + tuple(e.token_ids[cut:-n]), *key[1:]) in returned
    sent = [json.loads(x) for x in calls.read_text().splitlines()]
    proofs = Counter(c["cmd"] for c in sent if c["env"] is not None and not c["cmd"].startswith("#print"))
    assert proofs == compiled and sum(compiled.values()) > 0
    assert sum(c["cmd"] == "#print axioms t" for c in sent) == sum(r["lean/proved"] for r in recs)
    assert len({c["pid"] for c in sent}) >= 2  # the pool's --lean-workers 2 processes


@pytest.fixture(scope="module")
def reverse_worker(reverse_model, tmp_path_factory):
    """A vLLM worker (in process) on ``reverse_model``, shared by the runs that attach to it (``--no-spawn-worker``:
    each run syncs its own first snapshot to it, so the order of the tests does not matter). Yields its spool dir."""
    require_rollout_venv()
    from align.rollout.client import spawn_worker

    where = tmp_path_factory.mktemp("worker")
    worker = spawn_worker(
        where / "spool",
        model=reverse_model,
        weights_version=0,
        log_path=where / "worker.log",
        in_process=True,
        max_model_len=reverse.model_config(reverse.tokenizer()).max_position_embeddings,
        dtype="float32",
    )
    try:
        yield where / "spool"
    finally:
        worker.shutdown(grace_s=5)


@pytest.mark.slow
def test_resume_attached_to_a_running_worker_samples_the_resumed_weights(tmp_path, reverse_model, reverse_worker):
    """--no-spawn-worker: the worker keeps whatever it loaded last (here: the base model again, as after a
    restart or another user's sync). The resumed run must sync its checkpoint before step 1 of the rerun,
    or the rollouts come from the wrong policy and the sampler/trainer logprobs disagree."""
    import torch

    from align.model import load_pretrained
    from align.rollout.client import make_rollout_client
    from align.rollout.native import generate
    from align.rollout.protocol import SamplingParams

    tok = reverse.tokenizer()
    base, spool = reverse_model, reverse_worker
    prompts = reverse.prompts(16, "train")

    def run(steps: int) -> None:
        cfg = TrainConfig(
            out=str(tmp_path / "run"),
            steps=steps,
            prompts_per_step=4,
            group_size=4,
            max_tokens=6,
            lr=1e-2,
            rollout="spool",
            spool=str(spool),
            spawn_worker=False,
            checkpoint_every=1,
            rollout_timeout_s=600,
        )
        cfg.eval.eval_interval = 0
        train(
            cfg,
            model=str(base),
            tokenizer=tok,
            prompts=prompts,
            reward=lambda prompt, completion, **_: completion.count("a") / 6,
        )

    run(1)
    make_rollout_client("spool", spool=spool, timeout_s=600).sync_weights(base, 0)  # stale
    run(2)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[1]["mismatch_abs_max"] < MISMATCH_TOL, recs[1]["mismatch_abs_max"]
    # negative control: the base and the step-1 policy differ by far more than the tolerance on these prompts,
    # so sampling step 2 on the stale base weights would have failed the check above
    step1 = load_pretrained(tmp_path / "run" / "checkpoints" / "step_1" / "model")
    ids = [tok.encode(p["prompt"]) for p in prompts[:4]]
    comps = generate(step1, ids, SamplingParams(n=2, max_tokens=6, seed=0))
    base_model, diffs = load_pretrained(base), []
    for c in comps:
        seq = torch.tensor([ids[c.prompt_index] + c.token_ids])  # (1, L)
        with torch.no_grad():
            a, b = (
                torch.log_softmax(m(seq[:, :-1]), -1).gather(-1, seq[:, 1:, None])[0, :, 0] for m in (step1, base_model)
            )
        diffs.append(float((a - b)[-len(c.token_ids) :].abs().max()))
    assert max(diffs) > 10 * MISMATCH_TOL, diffs


def test_an_agent_through_the_worker_trains_what_vllm_sampled(tmp_path, reverse_model, reverse_worker, monkeypatch):
    """`--agent` with `--rollout spool` (attached to the module's worker): the gateway sends each request to the real
    vLLM worker as it arrives (its own request, several in flight at once: no lock, no batching window), token ids in
    and out. What the learner gets: each sampled segment is exactly a completion the worker returned for exactly that
    prefix (ids and logprobs; every returned completion trained once), the user's "=" between the turns is masked
    context (the chat template's render, logprob 0), and the trainer's recompute matches vLLM's logprobs (rho ~1)."""
    pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")
    from collections import Counter

    from align.chat import TurnRenderer
    from align.tasks.agent import ChatCharTokenizer

    returned, trained, most = record_worker_and_learner(monkeypatch)
    tok = ChatCharTokenizer(reverse.ALPHABET)  # the reverse task's ids, with a chat template the gateway renders
    cfg = spool_cfg(tmp_path / "run", steps=2, prompts_per_step=2, spool=str(reverse_worker), spawn_worker=False)
    cfg.envs.gateway_batch_ms = 500.0  # the native sampler's window: not applied to the worker's requests
    train(cfg, model=str(reverse_model), tokenizer=tok, prompts=reverse.prompts(8, "train"), agent=two_turns)

    assert [len(eps) for eps in trained] == [8, 8] and most[0] > 1  # requests in flight at once, each on its own
    feedback = TurnRenderer(tok).suffix([{"role": "user", "content": "="}])
    got: Counter = Counter()
    for e in (e for eps in trained for e in eps):
        # a first turn cut by max_tokens has no <eos>: the template's closing is masked context before the "="
        context = ([] if e.turns[0]["finish_reason"] == "stop" else [tok.eos_token_id]) + feedback
        assert e.error is None and [t["env_tokens"] for t in e.turns] == [0, len(context)], e.turns
        n = e.turns[0]["policy_tokens"]
        env = slice(n, n + len(context))
        assert e.token_ids[env] == context and not any(e.mask[env]) and all(lp == 0.0 for lp in e.logprobs[env])
        assert all(e.mask[: env.start]) and all(e.mask[env.stop :])
        second = (tuple(e.token_ids[env.stop :]), tuple(e.logprobs[env.stop :]))
        got[(tuple(e.prompt_ids), tuple(e.token_ids[:n]), tuple(e.logprobs[:n]))] += 1
        got[(tuple(e.prompt_ids + e.token_ids[: env.stop]), *second)] += 1
        # negative control: the second turn without the masked feedback in its prefix is no request the worker answered
        assert (tuple(e.prompt_ids + e.token_ids[:n]), *second) not in returned
    assert got == returned  # the trained policy ids are the sampled ones, each once, and nothing else was sampled
    for r in records(tmp_path / "run"):
        assert r["mismatch_abs_max"] < MISMATCH_TOL and r["agent/requests_mean"] == 2 and r["agent/errors"] == 0, r


def test_readme_worker_command_runs_on_make_tiny(tmp_path):
    """README "With the vLLM worker" on the README's own model (examples/own_data/make_tiny.py, head_dim 32: vLLM's
    CPU attention refuses 16) and data, with --min-p / --repetition-penalty passed through to vLLM: under
    --rollout-logprobs-mode processed the worker's logprobs are then those of the penalised distribution, far from
    the trainer's (the run above, unpenalised, stays within MISMATCH_TOL: the negative control)."""
    require_rollout_venv()
    import importlib.util
    from pathlib import Path

    from align.train import main

    ex = Path(__file__).resolve().parents[1] / "examples" / "own_data"
    spec = importlib.util.spec_from_file_location("make_tiny", ex / "make_tiny.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    make_tiny.main(str(tmp_path / "tiny_model"))
    argv = ["--model", str(tmp_path / "tiny_model"), "--train-data", str(ex / "train.jsonl")]
    argv += ["--reward", f"{ex / 'rewards.py'}:short", "--rollout", "spool", "--out", str(tmp_path / "run")]
    argv += ["--rollout-in-process", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2"]
    argv += ["--max-tokens", "8", "--eval-interval", "0", "--repetition-penalty", "1.5", "--min-p", "0.01"]
    argv += ["--rollout-logprobs-mode", "processed"]
    assert main(argv) == 0
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["step"] == 1 and rec["mismatch_abs_max"] > 10 * MISMATCH_TOL, rec["mismatch_abs_max"]


def test_partial_rollouts_on_the_spool_worker_cut_carry_and_train(tmp_path, reverse_model, monkeypatch):
    """`--partial-rollouts --max-async-steps 1 --rollout spool`: each step's call on the real vLLM worker stops once
    the step's groups are complete, the worker's cut request returns the other rows so far, and they are carried into
    the next call under the next weights (per-token versions). The cut/resume exactness on this worker is
    tests/test_spool_cut.py's; here: the wiring through the run."""
    require_rollout_venv()
    from align.rollout import cut as cut_lib

    cuts: list[int] = []
    real = cut_lib.cut_requests
    monkeypatch.setattr(cut_lib, "cut_requests", lambda client, ids: cuts.append(len(ids)) or real(client, ids))
    carries = record_carries(monkeypatch)
    cfg = spool_cfg(tmp_path / "run", steps=4, max_async_steps=1, partial_rollouts=True, max_tokens=24)
    summary = train(
        cfg,
        model=str(reverse_model),
        tokenizer=reverse.tokenizer(),
        prompts=reverse.prompts(32, "train"),
        reward=lambda prompt, completion, **_: completion.count("a") / 6,
    )
    assert summary["steps"] == 4
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert sum(cuts) > 0  # the worker was asked to cut rows still running
    lags = [r["rollout/token_lag_max"] for r in recs]  # (t-1) - version: K = 1 for a fresh token, more if carried
    assert lags[0] == 0 and all(1 <= lag <= 1 + 24 for lag in lags[1:]), lags
    assert all(kept for kept, _ in carries.resumed), carries.resumed  # a cut row continues from its own tokens
    assert [r["rollout/partial_frac"] for r in recs] == [carries.spans[t] for t in range(1, 5)]
    print(
        f"rows cut mid-generation and continued: {len(carries.resumed)}, under newer weights: "
        f"{sum(newer for _, newer in carries.resumed)}; trained spanning versions: {carries.spans}"
    )
    if any(carries.spans.values()):  # a carried row finished under newer weights (timing: a starved trainer sees none)
        assert max(lags) >= 2, lags
