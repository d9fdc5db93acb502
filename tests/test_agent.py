"""Training an agent program unchanged (``train(cfg, ..., agent=fn)``, align/gateway/agents.py): the example agent
(examples/agent/agent.py, written only against the ``openai`` client) runs its function-calling loop through the
gateway; the episode the learner gets is the turn loop's ids exactly (first prompt, the sampled call, the tool's
result as masked context, the sampled answer), and failing agents make unscorable episodes, counted.

A random-weight model never writes a well-formed call, so the policy is steered by a supervised warm start (as
tests/test_tool_train.py does) on the two turns of one conversation; sampling stays the real T=1 sampler."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path

import pytest
from helpers_models import load_hf, teacher_forced_logprobs
from helpers_tokenizer import QUESTION, warm_tool_model

from align.errors import InputError
from align.gateway.agents import check_agent, load_agent
from align.run.config import TrainConfig

pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]
AGENT = f"{ROOT / 'examples' / 'agent' / 'agent.py'}:run"
LOGPROB_TOL = 1e-3  # fp32 sampler vs transformers' forward


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory) -> tuple[Path, list[int], list[int], list[int]]:
    """(the warm-started model dir, the first prompt's ids, the suffix ids of the tool's result "5", of "6")."""
    return warm_tool_model(tmp_path_factory, load_agent(AGENT).__globals__["TOOLS"], "agent")


def _config(tmp_path: Path, **kw) -> TrainConfig:
    c = TrainConfig(out=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=2, max_tokens=80, lr=1e-3)
    c.eval.eval_interval, c.log.log_completions_every = 0, 1
    for k, v in kw.items():
        setattr(c.envs, k, v)
    return c


def test_the_example_agent_trains_token_exact(tmp_path, agent_model, monkeypatch):
    from align.envs.sampler import Episodes
    from align.train import train

    model_dir, first, suffix, wrong = agent_model
    seen: list = []
    real = Episodes.episodes
    monkeypatch.setattr(Episodes, "episodes", lambda self, *a: seen.extend(eps := real(self, *a)) or eps)
    rows = [{"question": QUESTION, "answer": "5"}] * 4
    train(_config(tmp_path), model=str(model_dir), prompts=rows, agent=load_agent(AGENT))

    assert len(seen) == 8 and all(e.error is None for e in seen), [e.error for e in seen]
    called = [e for e in seen if len(e.turns) == 2]
    assert called, [e.messages for e in seen]
    for e in called:
        assert e.prompt_ids == first
        n = e.turns[0]["policy_tokens"]
        env = slice(n, n + len(suffix))
        assert e.token_ids[env] == suffix and e.turns[1]["env_tokens"] == len(suffix)
        assert e.token_ids[env] != wrong  # negative control: another tool result is other tokens
        assert e.mask[env] == [False] * len(suffix) and e.logprobs[env] == [0.0] * len(suffix)
        assert all(e.mask[:n]) and all(e.mask[env.stop :]) and e.mask.count(False) == len(suffix)
        assert e.messages[-2]["role"] == "tool" and e.messages[-2]["content"] == "5"
    # the logprobs of the sampled tokens are the policy's on exactly these ids (transformers, the weights of step 1)
    hf = load_hf(model_dir)
    first_step = [e for e in seen[:4] if len(e.turns) == 2]  # step 1's episodes, sampled before any update
    assert first_step
    for e in first_step:
        ref = teacher_forced_logprobs(hf, e.prompt_ids, e.token_ids)
        got = [(a, b) for a, b, m in zip(e.logprobs, ref, e.mask) if m]
        assert max(abs(a - b) for a, b in got) < LOGPROB_TOL
        bad = teacher_forced_logprobs(hf, e.prompt_ids[:-1], e.token_ids)  # control: the prompt one token short
        assert max(abs(a - b) for a, b, m in zip(e.logprobs, bad, e.mask) if m) > LOGPROB_TOL
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 2 and all(r["agent/errors"] == 0 and r["agent/branches_mean"] == 1 for r in steps)
    assert sum(r["agent/requests_mean"] for r in steps) * 4 == sum(len(e.turns) for e in seen)
    assert all(r["reward/env_mean"] == r["reward/env_mean"] for r in steps)  # scored (not NaN)
    logged = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    requests = [t for rec in logged for ep in rec["episodes"] for t in ep["turns"]]
    assert requests and all(t["trained"] and t["branch"] == 0 for t in requests)
    assert any(t["new_messages"][-1]["role"] == "tool" and t["reply"]["content"] for t in requests if t["request"])


CALLS = itertools.count()
COUNT_LOCK = threading.Lock()


def test_concurrent_requests_batch_into_one_generate_and_stay_token_exact(tmp_path, agent_model, monkeypatch):
    from align.envs.sampler import Episodes
    from align.gateway import agents
    from align.rollout.client import NativeClient
    from align.train import train

    model_dir, first, _, _ = agent_model
    sizes: list[int] = []
    seen: list = []
    real_gen, real_rows, real_eps = NativeClient.generate, agents.sample_rows, Episodes.episodes
    monkeypatch.setattr(
        NativeClient, "generate", lambda self, p, params: sizes.append(len(p)) or real_gen(self, p, params)
    )
    monkeypatch.setattr(agents, "sample_rows", lambda m, p, *a: sizes.append(len(p)) or real_rows(m, p, *a))
    monkeypatch.setattr(Episodes, "episodes", lambda self, *a: seen.extend(eps := real_eps(self, *a)) or eps)
    rows = [{"question": QUESTION, "answer": "5"}] * 4
    train(_config(tmp_path, gateway_batch_ms=300.0), model=str(model_dir), prompts=rows, agent=load_agent(AGENT))
    assert max(sizes) > 1 and sum(sizes) == sum(len(e.turns) for e in seen)  # batched; every request sampled once
    hf = load_hf(model_dir)
    for e in seen[:4]:  # step 1's episodes (2 rows x G = 2), sampled before any update
        assert e.error is None and e.prompt_ids == first
        ref = teacher_forced_logprobs(hf, e.prompt_ids, e.token_ids)
        assert max(abs(a - b) for a, b, m in zip(e.logprobs, ref, e.mask) if m) < LOGPROB_TOL


def flaky(base_url: str, api_key: str, model: str, question: str, answer: str, **row) -> dict:
    """Every other call raises (4 episodes a step: 2 fail, 2 run the example agent)."""
    with COUNT_LOCK:
        k = next(CALLS)
    if k % 2:
        raise RuntimeError("the agent's own bug")
    return {"reward": load_agent(AGENT)(base_url, api_key, model, question, answer), "metrics": {"calls": 1 + k % 4}}


def failing(base_url: str, api_key: str, model: str, **row) -> float:
    raise RuntimeError("every agent fails here")


def test_failing_agents_are_unscorable_and_all_failing_stops_the_run(tmp_path, agent_model):
    from align.train import train

    model_dir = str(agent_model[0])
    rows = [{"question": QUESTION, "answer": "5"}] * 4
    train(_config(tmp_path, agent_workers=2), model=model_dir, prompts=rows, agent=flaky)
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert sum(r["agent/errors"] for r in steps) == 4 and all(r["unscorable"] == 2 for r in steps)
    assert all(r["agent/calls_mean"] == 2 for r in steps)  # the agents' own metrics (1 and 3 a step), averaged
    with pytest.raises(RuntimeError, match="every agent fails here"):
        train(_config(tmp_path / "b"), model=model_dir, prompts=rows, agent=failing)


RELEASE = threading.Event()


def hangs_once_a_step(base_url: str, api_key: str, model: str, question: str, answer: str, **row) -> float:
    """The first call of each step (4 a step) hangs until the test ends; the others run the example agent."""
    with COUNT_LOCK:
        k = next(CALLS)
    if k % 4 == 0:
        RELEASE.wait(120)
        return 1.0
    return load_agent(AGENT)(base_url, api_key, model, question, answer)


def test_a_hung_agent_times_out_and_the_step_goes_on(tmp_path, agent_model):
    from align.train import train

    global CALLS
    CALLS = itertools.count()
    rows = [{"question": QUESTION, "answer": "5"}] * 4
    try:
        # 10 s: the other episodes (80 tokens through the gateway) finish well inside it even on loaded cores (3 s
        # timed them out too at load 14)
        train(_config(tmp_path, agent_timeout_s=10.0), model=str(agent_model[0]), prompts=rows, agent=hangs_once_a_step)
    finally:
        RELEASE.set()
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["agent/timeouts"] for r in steps] == [1, 1] and all(r["unscorable"] == 1 for r in steps)
    assert all(r["agent/errors"] == 0 for r in steps)


def test_a_bad_agent_spec_names_the_flag(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "x = 3\ndef two(base_url, api_key):\n    return 0.0\ndef norow(base_url, api_key, model):\n    return 0.0\n"
    )
    for spec, why in [
        (f"{tmp_path}/missing.py:run", "no such file"),
        (f"{bad}:x", "not a function"),
        (f"{bad}:two", "model"),
        (f"{bad}:norow", "\\*\\*row"),
    ]:
        with pytest.raises(InputError, match=f"--agent .*{why}"):
            load_agent(spec)
    assert check_agent(failing, "failing") is failing  # control: a right signature passes


@pytest.mark.parametrize(
    ("spec", "message"),
    [("examples/agent/missing.py:run", "no such file"), ("examples/agent/agent.py:TOOLS", "not a function")],
)
def test_a_bad_agent_flag_fails_by_name_before_the_model_loads(
    tmp_path, agent_model, monkeypatch, capsys, spec, message
):
    import align.model
    from align.train import main

    def no_load(*a, **k):
        raise AssertionError("the model loaded before --agent was checked")

    monkeypatch.setattr(align.model, "load_pretrained", no_load)
    monkeypatch.chdir(ROOT)
    argv = ["--out", str(tmp_path / "run"), "--model", str(agent_model[0]), "--train-data", "examples/agent/rows.jsonl"]
    try:
        rc = main([*argv, "--agent", spec])
    except (SystemExit, ValueError) as e:
        rc, err = 2, str(e) + capsys.readouterr().err
    else:
        err = capsys.readouterr().err
    assert rc == 2 and "--agent" in err and message in err, err


def test_held_out_agent_runs_are_evaluated_in_the_loop(tmp_path, agent_model):
    from align.train import train

    c = _config(tmp_path)
    c.steps, c.eval.eval_interval, c.eval.eval_n = 1, 1, 2
    rows = [{"question": QUESTION, "answer": "5"}] * 4
    train(c, model=str(agent_model[0]), prompts=rows, eval_prompts=rows[:2], agent=load_agent(AGENT))
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval/step" in r]
    assert [r["eval/step"] for r in evals] == [0, 1], recs
    # the example agent's reward on held-out rows: the warm-started policy calls the tool and answers 5
    assert all(r["eval/avg@2"] > 0.0 for r in evals), evals


def test_the_documented_command_trains_the_example_agent(tmp_path, agent_model, monkeypatch):
    from align.train import main

    monkeypatch.chdir(ROOT)
    argv = ["--out", str(tmp_path / "run"), "--model", str(agent_model[0]), "--train-data", "examples/agent/rows.jsonl"]
    flags = ["--agent", "examples/agent/agent.py:run", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2"]
    assert main([*argv, *flags, "--max-tokens", "80", "--eval-interval", "0", "--agent-workers", "2"]) == 0
    (rec,) = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert rec["agent/requests_mean"] >= 1 and rec["agent/errors"] == 0


def test_an_agent_run_killed_mid_run_resumes_where_an_uninterrupted_run_goes(tmp_path, agent_model, monkeypatch):
    """kill -9 of the trainer after its step-1 checkpoint (its agents and gateway are threads of it), then the same
    command again: it resumes from the last checkpoint and its metrics continue to the same values as a run never
    killed (the example agent is deterministic and each request draws with its own seed: --gateway-batch-ms 0)."""
    from helpers_train import comparable, records, run_cli, wait_for

    from align.train import main

    monkeypatch.chdir(ROOT)

    def args(out: Path) -> list[str]:
        return ["--out", str(out), "--model", str(agent_model[0]), "--train-data", "examples/agent/rows.jsonl",
                "--agent", "examples/agent/agent.py:run", "--steps", "3", "--prompts-per-step", "2",
                "--group-size", "2", "--max-tokens", "80", "--eval-interval", "0", "--checkpoint-every", "1",
                "--agent-workers", "2", "--seed", "3"]  # fmt: skip

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(args(whole)) == 0
    proc = run_cli(args(killed), cwd=ROOT)
    try:
        wait_for(lambda: (killed / "checkpoints" / "step_1").is_dir(), proc, timeout=240)
        proc.kill()  # SIGKILL: no handler runs
        proc.wait(timeout=60)
    except BaseException:
        proc.kill()
        raise
    assert proc.returncode == -9
    done = {p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith("step_")}
    assert done and "step_3" not in done, done  # killed mid-run
    assert main(args(killed)) == 0  # the same command again: resumes
    steps = [r["step"] for r in records(killed) if "loss" in r]
    assert steps == [1, 2, 3]  # the metrics continue (records past the checkpoint dropped, none twice)
    got = [r for r in comparable(killed) if "loss" in r]
    want = [r for r in comparable(whole) if "loss" in r]
    assert got == want  # every value but the wall-clock ones: entropy, rewards, agent/*, grad norm
    assert len({r["entropy"] for r in want}) == 3  # control: the steps differ from each other (the policy moved)


def editing(base_url: str, api_key: str, model: str, question: str, answer: str, **row) -> float:
    """Asks, then asks again with its history edited (a summary in place of the question): two trajectories."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}])
    edited = [{"role": "user", "content": "(summary) " + question}, first.choices[0].message.model_dump()]
    edited.append({"role": "user", "content": "Again."})
    last = client.chat.completions.create(model=model, messages=edited).choices[0].message
    return float(str(answer) in (last.content or ""))


def test_every_trajectory_of_an_editing_agent_reaches_the_learner(tmp_path, agent_model, monkeypatch):
    """train() with an agent that edits its history: the learner's batch holds both trajectories of every episode,
    each with its sampled tokens trained once (control: the episodes alone hold only the last request's tokens)."""
    from align.run.parts import Run
    from align.train import train

    batches: list = []
    real = Run.batch
    monkeypatch.setattr(Run, "batch", lambda self, *a: batches.append(b := real(self, *a)) or b)
    rows = [{"question": QUESTION, "answer": "5"}] * 4
    train(_config(tmp_path), model=str(agent_model[0]), prompts=rows, agent=editing)
    assert len(batches) == 2
    for b in batches:
        eps = [c for c in b.completions if c.turns]  # the episodes (their branches carry no request records)
        assert len(eps) == 4 and len(b.completions) == 8  # one more trajectory per episode
        for e in eps:
            assert len(e.branches) == 1 and e.branches[0] in b.completions
            sampled = sum(t["policy_tokens"] for t in e.turns)
            assert sum(e.mask) + sum(e.branches[0].mask) == sampled
            assert sum(e.mask) < sampled  # control: the last request's trajectory alone misses the first reply
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert all(r["agent/branches_mean"] == 2 and r["agent/branch_tokens"] > 0 for r in steps), steps


# ------------------------------------------------------------------------------------------------ --agent-processes


def _steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_agents_in_processes_give_the_threads_episodes(tmp_path, agent_model, monkeypatch):
    """The example agent (deterministic; each request draws with its own seed) run in worker processes gives the
    episodes it gives on threads: ids, masks, logprobs, rewards (control: another episode's are other ids)."""
    from align.envs.sampler import Episodes
    from align.train import train

    seen: dict[str, list] = {"threads": [], "processes": []}
    real = Episodes.episodes
    mode = ["threads"]
    monkeypatch.setattr(Episodes, "episodes", lambda self, *a: seen[mode[0]].extend(eps := real(self, *a)) or eps)
    rows = [{"question": QUESTION, "answer": "5"}] * 4
    for m in seen:
        mode[0] = m
        c = _config(tmp_path / m, agent_processes=m == "processes")
        c.steps = 1
        train(c, model=str(agent_model[0]), prompts=rows, agent=load_agent(AGENT))
    threads, procs = seen["threads"], seen["processes"]
    assert len(threads) == len(procs) == 4 and all(e.error is None for e in threads + procs)
    for a, b in zip(threads, procs):
        assert (a.prompt_ids, a.token_ids, a.mask, a.logprobs) == (b.prompt_ids, b.token_ids, b.mask, b.logprobs)
        assert a.env_reward == b.env_reward and len(a.turns) == len(b.turns)
    assert any(a.token_ids != b.token_ids for a, b in zip(threads, procs[1:] + procs[:1]))  # control
    want, got = (_steps(tmp_path / m / "run")[0] for m in seen)
    assert want["agent/requests_mean"] == got["agent/requests_mean"] and want["agent/errors"] == got["agent/errors"]


def test_agents_in_processes_that_crash_hang_or_raise_are_unscorable_and_the_step_goes_on(
    tmp_path, agent_model, monkeypatch
):
    """One step, two runs per row, in worker processes: an agent that exits (os._exit(3)), one that raises, one that
    returns text and one that hangs (killed with its process group past --agent-timeout-s: the agent's process and
    the one it started are gone) are unscorable and counted; the ok rows train. Then every agent failing stops the
    run with the child's traceback."""
    from helpers_agents import by_mode, fails

    from align.envs.sampler import Episodes
    from align.rollout.process import pid_alive
    from align.train import train

    seen: list = []
    real = Episodes.episodes
    monkeypatch.setattr(Episodes, "episodes", lambda self, *a: seen.extend(eps := real(self, *a)) or eps)
    pids = tmp_path / "pids"
    pids.mkdir()
    modes = ["ok", "crash", "raise", "text", "hang"]
    rows = [{"question": QUESTION, "mode": m, "pids": str(pids)} for m in modes]
    c = _config(tmp_path, agent_processes=True, agent_timeout_s=10.0)  # the others end in it under load (as above)
    c.steps, c.prompts_per_step = 1, len(modes)
    train(c, model=str(agent_model[0]), prompts=rows, agent=by_mode)
    (rec,) = _steps(tmp_path / "run")
    assert rec["agent/timeouts"] == 2 and rec["agent/errors"] == 6 and rec["unscorable"] == 8, rec
    said = {  # each failure named as it happened in its process
        "ok": lambda w: w is None,
        "crash": lambda w: "worker process exited (exit code 3)" in w,
        "raise": lambda w: "in its worker process" in w and "RuntimeError: the agent's own bug" in w,
        "text": lambda w: "returned 'five'" in w,
        "hang": lambda w: "past --agent-timeout-s" in w and "process group" in w,
    }
    errors = [e.error for e in seen]
    assert all(sum(1 for w in errors if (w is None) == (m == "ok") and ok(w)) == 2 for m, ok in said.items()), errors
    hung = [json.loads(p.read_text()) for p in pids.iterdir()]
    assert len(hung) == 2 and pid_alive(os.getpid())  # control: pid_alive sees a live pid
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for pair in hung for p in pair) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for pair in hung for p in pair if pid_alive(p)]  # the agent and its sleeper: killed with the group
    with pytest.raises(RuntimeError, match="(?s)in its worker process.*every agent fails here"):
        train(_config(tmp_path / "b", agent_processes=True), model=str(agent_model[0]), prompts=rows, agent=fails)


def test_agent_processes_refuse_an_agent_not_importable_by_name_before_the_model_loads(
    tmp_path, agent_model, monkeypatch
):
    from helpers_agents import by_mode

    import align.model
    from align.gateway.workers import agent_spec
    from align.train import train

    def no_load(*a, **k):
        raise AssertionError("the model loaded before --agent-processes was checked")

    def nested(base_url, api_key, model, **row):
        return 1.0

    monkeypatch.setattr(align.model, "load_pretrained", no_load)
    rows = [{"question": QUESTION, "answer": "5"}] * 4
    for fn in (nested, lambda base_url, api_key, model, **row: 1.0):
        with pytest.raises(InputError, match="--agent-processes .*cannot be imported"):
            train(_config(tmp_path, agent_processes=True), model=str(agent_model[0]), prompts=rows, agent=fn)
    assert agent_spec(None, by_mode) == "helpers_agents:by_mode"  # control: a top-level function is loaded by name
    assert agent_spec(AGENT, failing) == AGENT  # --agent's own spec is the workers'


def test_failed_held_out_episodes_are_counted_not_silently_zero(caplog):
    """``eval/errors``: held-out episodes that failed (here: an agent refused with a 503) are counted and the first
    one's last line logged; a clean set reports no such key (control)."""
    from align.eval.metrics import score_episodes
    from align.rollout.groups import Episode

    class Scores:  # (total, terms) per episode, as align.rewards' Scores.item gives them
        def __init__(self, rewards):
            self.rewards = rewards

        def item(self, j):
            return self.rewards[j], {}

    def eps(errors):
        out = []
        for j, err in enumerate(errors):
            e = Episode(j // 2, j % 2, [], [], "stop", [], 0, prompt_ids=[0])
            e.error = err
            out.append(e)
        return out

    failed = eps([None, "Traceback ...\nurllib.error.HTTPError: HTTP Error 503", None, None])
    with caplog.at_level("WARNING", logger="align.eval.metrics"):
        m = score_episodes(failed, Scores([1.0, 0.0, 0.0, 1.0]), 2, 2, "total")
    assert m["eval/errors"] == 1 and m["eval/avg@2"] == 0.5
    assert "1 of 4 held-out episodes failed" in caplog.text and "HTTP Error 503" in caplog.text
    assert "eval/errors" not in score_episodes(eps([None] * 4), Scores([1.0, 0.0, 0.0, 1.0]), 2, 2, "total")
