"""Training a prover (``--env lean``, align/lean/env.py, align/lean/corrections.py): Goedel's first prompt byte for
byte lean_gen's, each verdict's reward and feedback, correction rounds as masked turns, correction prompts in the
batch byte for byte lean_gen's for the same failure, bad input before the model loads, the queue across kill -9.

No Lean compiler exists on these machines: every verification goes through ``extras/vllm_rollout/lean_repl_standin.py``
(launched by path as --lean-repl), which replays replies recorded from the real Lean REPL
(tests/lean_fixtures/standin_replies.json). ``ScriptedVerifier`` stands in for the pool only in the env's unit tests
(it says so), and ``ScriptedClient`` for a policy that writes proofs (a random tiny model never writes a lean4 block).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from helpers_lean import ERR, EXTRAS, PROOFS, STANDIN, STATEMENT, lean_rows

from align.envs import check_step
from align.lean import goedel
from align.lean.env import CORRECTION_KEY, LeanEnv, problem_code
from align.lean.verify import Verdict
from align.rollout.protocol import Completion

MINIF2F = Path(__file__).resolve().parent / "data" / "minif2f_test.jsonl"
ROWS = [{"name": f"t{i}", "formal_statement": f"theorem t{i} : {i} + 1 = {i + 1} := by\n"} for i in range(6)]


def _load(name: str):
    """An extras/vllm_rollout module by path, as tests/test_lean_gen_contract.py loads them (never via sys.path)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXTRAS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class ScriptedVerifier:
    """A stand-in for the verifier pool in the env's unit tests: verdicts by a rule on the completion text."""

    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(2)
        self.seen: list[tuple[str, str]] = []

    def verdict(self, completion: str) -> Verdict:
        if "PROVED" in completion:
            return Verdict(True, None, "proof")
        if "CRASH" in completion:
            return Verdict(False, "verifier_error", None, detail="the REPL crashed twice")
        if "SORRY" in completion:
            return Verdict(False, "sorry", "proof")
        return Verdict(False, "lean_error", "proof", errors=ERR)

    def submit(self, lean4_code: str, completion: str) -> concurrent.futures.Future:
        self.seen.append((lean4_code, completion))
        return self.pool.submit(self.verdict, completion)

    def close(self) -> None:
        self.pool.shutdown()


# ------------------------------------------------------------------------------------------------ rows and prompts


def test_problem_rows_give_lean_gens_first_prompt_byte_for_byte():
    """All 244 miniF2F problems as Goedel rows (name, formal_statement, informal_prefix; no lean4_code): the first
    turn is the messages lean_gen plans for the same problems (lean_records.plan_round0, loaded by path)."""
    lr = _load("lean_records")
    full = [json.loads(line) for line in MINIF2F.read_text().splitlines()]
    problems, skips = lr.load_problems(str(MINIF2F))
    assert not skips and len(problems) == 244
    planned = {it["problem_id"]: it["messages"] for it in lr.plan_round0(problems, 1, 0)}
    Env = LeanEnv.bind(ScriptedVerifier())
    for row in full:
        goedel_row = {k: row[k] for k in ("name", "formal_statement", "informal_prefix")}
        assert Env(**goedel_row).reset() == planned[row["name"]]
    # negative control: a statement without its prefix gets it in front, and then the prompt differs
    row = {k: full[0][k] for k in ("name", "informal_prefix")}
    row["formal_statement"] = full[0]["formal_statement"].replace(full[0]["informal_prefix"], "")
    assert problem_code(row).startswith(full[0]["informal_prefix"])
    bare = {"name": "x", "formal_statement": row["formal_statement"]}
    assert Env(**bare).reset() != planned[full[0]["name"]]


# ------------------------------------------------------------------------------------------------ the environment


def test_each_verdict_gives_its_reward_feedback_and_named_info():
    v = ScriptedVerifier()
    Env = LeanEnv.bind(v)
    env = Env(**ROWS[0])
    assert check_step(env.step("```lean4\nPROVED\n```")) == (None, 1.0, True, {"lean/ok": 1})
    assert v.seen[-1] == (problem_code(ROWS[0]), "```lean4\nPROVED\n```")
    crash = check_step(Env(**ROWS[0]).step("CRASH"))
    assert crash.done and math.isnan(crash.reward) and crash.info == {"lean/rejected_verifier_error": 1}
    assert check_step(Env(**ROWS[0]).step("SORRY")) == (None, 0.0, True, {"lean/rejected_sorry": 1})
    env = Env(**ROWS[0])
    first, second = check_step(env.step("wrong")), check_step(env.step("wrong again"))
    assert first.observation == [{"role": "user", "content": goedel.correction_feedback(ERR, 1)}]
    assert second.observation == [{"role": "user", "content": goedel.correction_feedback(ERR, 2)}]
    assert (first.reward, first.done, first.info) == (0.0, False, {"lean/rejected_lean_error": 1})
    assert "Round 0" in first.observation[0]["content"] and "Round 1" in second.observation[0]["content"]
    # a correction row asks for round k: its feedback names round k, and its first turn counts as a correction
    corr = {**ROWS[0], CORRECTION_KEY: {"messages": [{"role": "user", "content": "m"}], "round": 2}}
    env = Env(**corr)
    assert env.reset() == [{"role": "user", "content": "m"}]
    st = check_step(env.step("wrong"))
    assert (
        st.info == {"lean/rejected_lean_error": 1, "lean/correction": 1} and "Round 2" in st.observation[0]["content"]
    )


def test_error_text_is_cut_to_lean_error_tokens():
    from align.char_tokenizer import CharTokenizer

    tok = CharTokenizer(sorted(set(ERR)))
    env = LeanEnv.bind(ScriptedVerifier(), error_tokens=10, tokenizer=tok)(**ROWS[0])
    fb = env.step("wrong").observation[0]["content"]
    assert ERR[:9] + "\n... [Truncated to --lean-error-tokens]" in fb and ERR not in fb  # 10 ids: BOS + 9 chars
    whole = LeanEnv.bind(ScriptedVerifier(), error_tokens=len(ERR) + 1, tokenizer=tok)(**ROWS[0])  # BOS + text
    assert whole.step("wrong").observation[0]["content"] == goedel.correction_feedback(ERR, 1)  # fits: unchanged


def test_unbound_env_and_bad_rows_are_refused_by_name():
    from align.data import InputError

    with pytest.raises(RuntimeError, match="no verifier"):
        LeanEnv(**ROWS[0])
    with pytest.raises(InputError, match=r"f\.jsonl:2: the row has no 'formal_statement'"):
        LeanEnv.check_rows([("f.jsonl:1", ROWS[0]), ("f.jsonl:2", {"name": "x", "problem": "1+1=2"})])
    with pytest.raises(InputError, match=r"f\.jsonl:1: the statement has no ':= by'"):
        LeanEnv.check_rows([("f.jsonl:1", {"name": "x", "formal_statement": "theorem x : True := trivial"})])
    LeanEnv.check_rows([("f.jsonl:1", ROWS[0])])  # a good row passes


class ScriptedClient:
    """A policy that writes the given completions in turn (a stand-in: a random tiny model never writes a proof)."""

    def __init__(self, tok, texts: list[str], stop: int):
        self.tok, self.texts, self.stop, self.n = tok, texts, stop, 0
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):
        self.prompts.append(list(prompts[0]))
        text = self.texts[min(self.n, len(self.texts) - 1)]
        self.n += 1
        ids = self.tok.encode(text) + [self.stop]
        return [Completion(0, 0, ids, [-0.5] * len(ids), "stop", [-0.5] * len(ids), 0)]


@pytest.fixture
def verifier():
    from align.lean.config import LeanConfig
    from align.lean.verify import LeanVerifier

    v = LeanVerifier(LeanConfig(repl=STANDIN, workers=2))
    yield v
    v.close()


def lean_cfg(out, **kw):
    """A small --env lean run on the stand-in REPL: 2 problems x 4 episodes per step, no eval."""
    from align.train import TrainConfig

    base = {"out": str(out), "steps": 2, "prompts_per_step": 2, "group_size": 4, "max_tokens": 24, "lr": 1e-3,
            "warmup_steps": 0, "micro_batch_size": 8, "threads": 1}  # fmt: skip
    base.update(kw)
    c = TrainConfig(**base)
    c.envs.env, c.envs.max_turns = "lean", 1
    c.lean.repl, c.lean.workers = STANDIN, 2
    c.eval.eval_interval = 0
    return c


def lean_argv(out, model, data, *extra) -> list[str]:
    return ["--out", str(out), "--model", model, "--train-data", str(data), "--env", "lean", "--lean-repl", STANDIN,
            "--lean-workers", "2", "--steps", "4", "--checkpoint-every", "2", "--prompts-per-step", "2",
            "--group-size", "4", "--max-tokens", "24", "--lr", "1e-3", "--warmup-steps", "0", "--threads", "1",
            "--eval-interval", "0", "--max-turns", "1", *extra]  # fmt: skip


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ episodes and runs


def test_correction_rounds_are_masked_turns_and_the_last_verdict_is_the_reward(prover, verifier):
    """--max-turns 3 with the real verifier pool over the stand-in REPL: a failed attempt is answered with Goedel's
    correction feedback of its round as environment tokens (mask False), the episode's reward is its last verdict."""
    from align.chat import TurnRenderer
    from align.data import load_tokenizer
    from align.envs.config import EnvConfig
    from align.envs.episodes import EpisodeRunner
    from align.envs.runner import EnvRunner
    from align.rollout.protocol import SamplingParams

    tok = load_tokenizer(prover, prover)
    renderer = TurnRenderer(tok)
    eos = 2
    decode = lambda ids: tok.decode(ids[:-1] if ids and ids[-1] == eos else ids)
    with EnvRunner(None, LeanEnv.bind(verifier), 0, 30.0) as envs:
        runner = EpisodeRunner(envs, renderer, decode, EnvConfig(max_turns=3), 64, 1024)
        client = ScriptedClient(tok, [PROOFS[1], "no code", PROOFS[0]], eos)  # errors, format (ends), -
        ep = runner.run(client, lean_rows(1), 1, SamplingParams(n=1, max_tokens=64))[0]
        client = ScriptedClient(tok, [PROOFS[1], PROOFS[1], PROOFS[0]], eos)
        solved = runner.run(client, lean_rows(1), 1, SamplingParams(n=1, max_tokens=64))[0]
    assert [t["info"] for t in ep.turns] == [{"lean/rejected_lean_error": 1}, {"lean/rejected_format": 1}]
    assert ep.env_reward == 0.0 and ep.error is None
    assert [t["info"] for t in solved.turns] == [{"lean/rejected_lean_error": 1}] * 2 + [{"lean/ok": 1}]
    assert solved.env_reward == 1.0 and [t["reward"] for t in solved.turns] == [0.0, 0.0, 1.0]
    errors = verifier.verify([(STATEMENT, PROOFS[1])])[0].errors
    assert errors and "Error Message: unsolved goals" in errors
    first = goedel.initial_messages(STATEMENT)
    want = goedel.correction_messages(goedel.correction_messages(first, PROOFS[1], errors, 1), PROOFS[1], errors, 2)
    assert solved.messages[:-1] == want and solved.messages[-1] == {"role": "assistant", "content": PROOFS[0]}
    at = 0
    for turn in solved.turns:  # policy ids (mask True) then the feedback's ids (mask False, logprob 0)
        assert all(solved.mask[at : at + turn["policy_tokens"]])
        at += turn["policy_tokens"]
        assert not any(solved.mask[at : at + turn["env_tokens"]])
        assert all(lp == 0.0 for lp in solved.logprobs[at : at + turn["env_tokens"]])
        at += turn["env_tokens"]
    assert [t["env_tokens"] > 0 for t in solved.turns] == [True, True, False] and at == len(solved.token_ids)
    # the next prompt the policy saw is the conversation so far: the round-2 correction prompt as suffix ids
    assert client.prompts[2] == solved.prompt_ids + solved.token_ids[: at - solved.turns[-1]["policy_tokens"]]
    assert tok.decode(client.prompts[1], skip_special_tokens=False).endswith(
        goedel.render_qwen3(want[:3]).split(PROOFS[1])[-1]
    )


def test_training_a_prover_end_to_end_with_corrections_in_the_batch_and_eval(prover, tmp_path):
    """train() with --env lean on the stand-in REPL: rewards are the verdicts, every step logs the lean/* counts,
    step 2 draws a correction prompt from step 1's failures (Goedel's correction messages), the completions log
    names each rejection, and the held-out problems are evaluated through the same pool."""
    from align.train import train

    cfg = lean_cfg(tmp_path / "run", lean_corrections={"lean_correction_fraction": 0.5})
    cfg.eval.eval_interval, cfg.eval.eval_n = 2, 2
    cfg.log.log_completions_every = 1
    train(cfg, model=prover, prompts=lean_rows(4), eval_prompts=lean_rows(2))
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        counted = r["lean/proved"] + sum(v for k, v in r.items() if k.startswith("lean/rejected_"))
        assert counted + r["lean/verifier_errors"] == 8  # one verdict per episode (one turn each)
        assert r["reward_mean"] == pytest.approx(r["lean/proved"] / 8)
        assert r["lean/rejected_lean_error"] > 0 and r["lean/verifier_errors"] == 0
    assert [r["lean/correction_prompts"] for r in steps] == [0.0, 1.0]  # round(0.5 * 2) = 1 from step 1's failures
    samples = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    infos = {k for s in samples for e in s["episodes"] for t in e["turns"] for k in t.get("info", {})}
    assert {"lean/ok", "lean/rejected_lean_error"} <= infos
    corr = [e for s in samples if s["step"] == 2 for e in s["episodes"] if "lean/correction" in e["turns"][0]["info"]]
    assert len(corr) == 4  # the correction group: G episodes of one correction prompt
    first = goedel.initial_messages(STATEMENT)
    failed = next(e for s in samples if s["step"] == 1 for e in s["episodes"] if e["turns"][0]["reward"] == 0.0)
    assert corr[0]["messages"][:2] == first + [{"role": "assistant", "content": failed["messages"][1]["content"]}]
    assert corr[0]["messages"][2]["content"].startswith("The proof (Round 0) is not correct.")
    evals = [r for r in recs if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(0 < r["eval/pass@1"] <= 1 for r in evals)  # verified proofs


def test_a_correction_prompt_is_lean_gens_for_the_same_failure(prover, verifier, tmp_path):
    """The same failed attempt through the trainer (episode -> queue -> correction row -> LeanEnv.reset) and through
    lean_gen's code path (lean_records.make_record -> pipeline_gen_verify.verify_record on the stand-in REPL ->
    lean_records.plan_corrections): the same messages, rendered to the same ids."""
    from types import SimpleNamespace

    from align.chat import TurnRenderer
    from align.data import load_tokenizer
    from align.envs.config import EnvConfig
    from align.envs.episodes import EpisodeRunner
    from align.envs.runner import EnvRunner
    from align.lean.corrections import CorrectionConfig, CorrectionQueue
    from align.rollout.protocol import SamplingParams
    from align.run.policy import DataCursor

    lr, pgv = _load("lean_records"), _load("pipeline_gen_verify")
    tok, rows = load_tokenizer(prover, prover), lean_rows(3)
    renderer = TurnRenderer(tok)
    with EnvRunner(None, LeanEnv.bind(verifier), 0, 30.0) as envs:
        runner = EpisodeRunner(envs, renderer, lambda ids: tok.decode(ids[:-1]), EnvConfig(max_turns=1), 64, 1024)
        ep = runner.run(ScriptedClient(tok, [PROOFS[1]], 2), rows[:1], 1, SamplingParams(n=1, max_tokens=64))[0]
    queue = CorrectionQueue(CorrectionConfig(lean_correction_fraction=0.5), rows, DataCursor(3, 0))
    queue.begin(1)
    assert queue.add(SimpleNamespace(idx=[0], completions=[ep]), 1) == 1
    queue.begin(2)
    idx = queue.next_prompts(2)
    assert idx[0] == 3 and idx[1] < 3  # one correction (index past the rows), one fresh problem
    ours = LeanEnv.bind(verifier)(**queue.row(idx[0])).reset()
    # lean_gen: the problem, its round-0 sample, its verification record, the round-1 plan
    problems = {"p0": {"problem_id": "p0", "lean4_code": goedel.formal_statement(problem_code(rows[0]))}}
    item = lr.plan_round0(problems, 1, 0)[0]
    gen = lr.make_record(item, prompt_ids=ep.prompt_ids, completion_ids=ep.token_ids, completion_text=ep.text,
                         finish_reason="stop", budget=lr.token_budget(64, 1024, len(ep.prompt_ids)), cap_tokens=64,
                         sampling={}, model_rev="test", adapter=None, trajectory_cap=None, session=0)  # fmt: skip
    repl = pgv.Repl(STANDIN, None, 30.0, 30.0)
    try:
        verif = pgv.verify_record(gen, repl, pgv.STANDARD_AXIOMS)
    finally:
        repl.close()
    assert verif["accepted"] is False and verif["repl_errors"]
    planned, skips = lr.plan_corrections(problems, 1, 1, 0, [([verif], [gen])])
    assert not skips and planned[0]["messages"] == ours
    assert renderer.first(ours) == tok.encode(goedel.render_qwen3(planned[0]["messages"]))  # Qwen3's rendering
    # negative control: another failure's errors give another prompt
    other = dict(verif, repl_errors=verif["repl_errors"][:1])
    assert lr.plan_corrections(problems, 1, 1, 0, [([other], [gen])])[0][0]["messages"] != ours


@pytest.mark.parametrize(
    ("case", "extra", "message"),
    [
        ("no_verifier", ["--lean-repl", ""], "needs exactly one of --lean-repl CMD"),
        ("no_statement", [], "rows.jsonl:2: the row has no 'formal_statement'"),
        ("no_by", [], "rows.jsonl:1: the statement has no ':= by'"),
        ("missing_program", ["--lean-repl", "no_such_lean_repl_xyz"], "not found or not executable"),
        ("exits_at_once", ["--lean-repl", f"{sys.executable} -c pass"], "did not start a Lean REPL"),
        ("env_workers", ["--env-workers", "1"], "--env-workers 1 does not apply"),
        ("fraction", ["--lean-correction-fraction", "1.5"], "--lean-correction-fraction must be in [0, 1)"),
    ],
)
def test_bad_lean_input_fails_by_name_before_the_model_loads(prover, tmp_path, monkeypatch, capsys, case, extra,
                                                             message):  # fmt: skip
    import align.model
    from align.train import main

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(align.model, "load_pretrained", no_load)
    rows = lean_rows(2)
    if case == "no_statement":
        rows[1] = {"name": "p1", "problem": "1 + 1 = 2"}
    if case == "no_by":
        rows[0] = {"name": "p0", "formal_statement": "theorem t : 1 + 1 = 2 := rfl"}
    data = write_rows(tmp_path / "rows.jsonl", rows)
    try:
        rc = main(lean_argv(tmp_path / "run", prover, data, *extra))
    except (SystemExit, ValueError) as e:  # argparse / config checks
        rc, err = 2, str(e) + capsys.readouterr().err
    else:
        err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_the_correction_queue_survives_kill_9_and_the_resumed_run_logs_what_the_uninterrupted_one_logs(
    prover, tmp_path
):
    """4 steps in one go vs a CLI run killed (SIGKILL) after its step-2 checkpoint and rerun: the same metrics,
    corrections drawn after the resume included. Negative control: the same checkpoint with its queue emptied
    resumes into other records."""
    import shutil

    import torch
    from helpers_train import comparable, run_cli, wait_for

    from align.atomic import is_committed
    from align.train import main

    data = write_rows(tmp_path / "rows.jsonl", lean_rows(4))
    extra = ("--lean-correction-fraction", "0.5", "--log-completions-every", "0")
    assert main(lean_argv(tmp_path / "straight", prover, data, *extra)) == 0
    killed = tmp_path / "killed"
    proc = run_cli(lean_argv(killed, prover, data, *extra))
    try:
        wait_for(lambda: is_committed(killed / "checkpoints" / "step_2"), proc)
    finally:
        proc.kill()
        proc.wait()
    assert not (killed / "checkpoints" / "step_4").exists()  # killed mid-run: the rerun has steps 3 and 4 to do
    state = torch.load(killed / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True)
    assert state["cursor"]["lean_corrections"]  # the queue is in the checkpoint
    shutil.copytree(killed, tmp_path / "emptied")
    assert main(lean_argv(killed, prover, data, *extra)) == 0
    straight = comparable(tmp_path / "straight")
    assert comparable(killed) == straight
    assert [r["lean/correction_prompts"] for r in straight if "loss" in r][2:] == [1.0, 1.0]
    # negative control: resuming without the queue draws fresh problems where the run drew corrections
    path = tmp_path / "emptied" / "checkpoints" / "step_2" / "trainer_state.pt"
    state["cursor"]["lean_corrections"] = []
    torch.save(state, path)
    assert main(lean_argv(tmp_path / "emptied", prover, data, *extra)) == 0
    assert comparable(tmp_path / "emptied")[:2] == straight[:2] and comparable(tmp_path / "emptied") != straight


def test_the_queue_with_async_rollouts_resumes_exactly(prover, tmp_path):
    """--max-async-steps 1: the checkpoint of step 2 holds step 3's batch, generated before it, with the queue in its
    cursor; resuming from it (the later checkpoint removed) logs what the uninterrupted run logged, corrections
    included, and the held-out problems' eval, pinned to each version on the rollout engine, verified by the pool."""
    import shutil

    from helpers_train import comparable

    from align.train import train

    def run(name: str) -> list[dict]:
        c = lean_cfg(tmp_path / name, steps=4, checkpoint_every=2, max_async_steps=1,
                     lean_corrections={"lean_correction_fraction": 0.5})  # fmt: skip
        c.eval.eval_interval, c.eval.eval_n = 2, 2
        train(c, model=prover, prompts=lean_rows(4), eval_prompts=lean_rows(2))
        recs = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in comparable(tmp_path / name)]  # timings
        return sorted(recs, key=lambda r: (r["step"], "eval/step" in r))  # an eval record lands when it is done

    straight = run("straight")
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_4")
    assert run("resumed") == straight
    assert [r["lean/correction_prompts"] for r in straight if "loss" in r] == [0.0, 1.0, 1.0, 1.0]
    evals = [r for r in straight if "eval/step" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and all(0 < r["eval/pass@1"] <= 1 for r in evals), evals
    assert all(r["eval/weight_version"] == r["step"] and r["eval/mixed_version_ratio"] == 0.0 for r in evals)


def test_episode_steps_wait_on_the_pool_at_once_not_one_after_another():
    """LeanEnv.concurrent: EnvRunner runs the episodes' steps together, so each waits only on its own verdict. A
    verifier whose verdicts need two proofs in flight at once passes; the negative control (the same class with
    concurrent = False, serialised as any environment) never has two in flight and times out."""
    import threading

    from align.envs.runner import EnvRunner

    class PairVerifier(ScriptedVerifier):
        def __init__(self, wait_s: float):
            super().__init__()
            self.barrier = threading.Barrier(2, timeout=wait_s)

        def verdict(self, completion: str) -> Verdict:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                return Verdict(False, "verifier_error", None, detail="alone")
            return super().verdict(completion)

    def steps(env_cls) -> list:
        with EnvRunner(None, env_cls, 0, 0.0) as envs:
            envs.call_many([(k, "open", (ROWS[k],)) for k in range(2)])
            return envs.call_many([(k, "step", ("PROVED",)) for k in range(2)])

    assert [s.reward for s in steps(LeanEnv.bind(PairVerifier(30.0)))] == [1.0, 1.0]
    serial = type("Serial", (LeanEnv.bind(PairVerifier(0.5)),), {"concurrent": False})
    assert [s.info for s in steps(serial)] == [{"lean/rejected_verifier_error": 1}] * 2


def test_partial_rollouts_carry_a_correction_turn_as_one_more_segment(prover, tmp_path):
    """--partial-rollouts with --env lean --max-turns 2 (align.envs.partial): an episode whose first proof failed is
    carried with Goedel's correction feedback and its correction turn is sampled under the next version, one more
    segment; a proof still being written when the call stops is cut inside its turn and finished under the next
    version, so a one-turn episode spans versions too (the stand-in's proofs run to ~21 of 24 tokens: the long
    turn). Seeded: the native sampler is deterministic."""
    from align.train import train

    c = lean_cfg(tmp_path / "run", steps=5, prompts_per_step=1, group_size=2, seed=0)
    c.max_async_steps, c.partial_rollouts, c.envs.max_turns = 1, True, 2
    train(c, model=prover, prompts=lean_rows(16))
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert len(steps) == 5 and all(r["lean/verifier_errors"] == 0 for r in steps)
    spans = [r for r in steps if r["rollout/partial_frac"] > 0]
    assert spans and any(r["env/turns_mean"] > 1 and r["env/env_tokens_mean"] > 0 for r in spans)  # corrections
    # two turns at most: (turns_mean - 1) of a step's episodes have two, so a larger share spanning versions holds a
    # one-turn episode that does, a proof cut inside its turn (carrying at turn boundaries alone: never)
    assert any(r["rollout/partial_frac"] > r["env/turns_mean"] - 1 for r in spans)
    assert max(r["rollout/token_lag_max"] for r in steps) >= 2
    # the correction queue draws its own rows each step (no data index to carry): refused before any sampling
    from align.data import InputError

    c = lean_cfg(tmp_path / "q", lean_corrections={"lean_correction_fraction": 0.5}, max_async_steps=1)
    c.partial_rollouts = True
    with pytest.raises(InputError, match="draws its own rows each step"):
        train(c, model=prover, prompts=lean_rows(4))
    assert not (tmp_path / "q" / "metrics.jsonl").exists()
