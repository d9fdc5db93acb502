"""End to end: lean_gen.py and pipeline_gen_verify.py with the real CPU build of vLLM (.venv-rollout).

The model is a tiny random-weight Qwen2 (hidden 128, 4 heads, 2 layers) with a BPE tokenizer and a Qwen3-style
chat template trained/built here (tests/lean_fixtures/build_tiny.py); no downloads. Its outputs are noise, so
no proof block is ever extracted and every sample goes down the reference's "None" path.

There is no Lean with Mathlib on these machines: verification uses extras/vllm_rollout/lean_repl_standin.py,
which replays REPL JSON recorded from the real Lean REPL (tests/lean_fixtures/*.json). It checks nothing.

Without .venv-rollout these tests skip, unless ALIGN_REQUIRE_ROLLOUT=1 (scripts/test.sh), where they fail.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers_lean import load_script

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ROOT / "extras" / "vllm_rollout"
FIX = Path(__file__).resolve().parent / "lean_fixtures"
RPY = ROOT / ".venv-rollout" / "bin" / "python"
MINIF2F = Path(__file__).resolve().parent / "data" / "minif2f_test.jsonl"  # shipped; see tests/data/NOTICE.md
TIMEOUT_S = 240
pytestmark = pytest.mark.rollout

ENV = {
    **os.environ,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / "inductor"),
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
ENGINE = ["--max-model-len", "1536", "--enforce-eager", "--dtype", "float32", "--max-num-seqs", "8"]


def _require_rollout() -> None:
    if not RPY.exists():
        msg = f"{RPY} missing: build it with scripts/setup_rollout_venv.sh"
        if os.environ.get("ALIGN_REQUIRE_ROLLOUT") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def _load(name: str):
    return load_script(EXTRAS / f"{name}.py")


lp = _load("lean_prompts")
lr = _load("lean_records")  # files, plan and records (the stdlib half lean_gen imports)
lg = _load("lean_gen")

_LIVE: list[subprocess.Popen] = []


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        p = subprocess.Popen(
            [str(RPY), *args], stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, start_new_session=True
        )
    _LIVE.append(p)
    return p


def _wait(p: subprocess.Popen, timeout: float = TIMEOUT_S) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        pytest.fail(f"{p.args} did not finish within {timeout} s")


def _run(args: list[str], log: Path, timeout: float = TIMEOUT_S) -> int:
    return _wait(_start(args, log), timeout)


@pytest.fixture(scope="module", autouse=True)
def _reap():
    yield
    for p in _LIVE:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _lean_gen(w: Path, problems: str, out: Path, flags: str, *more: str) -> list[str]:
    """A lean_gen.py command line on the module's model: ``w / problems`` -> ``out``, then ``flags`` (split on spaces,
    as typed in a shell) and ``more``."""
    head = [
        str(EXTRAS / "lean_gen.py"),
        "--problems",
        str(w / problems),
        "--out",
        str(out),
        "--model",
        str(w / "model"),
    ]
    return [*head, *flags.split(), *more]


def _python(args: list[str]) -> subprocess.CompletedProcess:
    """``args`` under the rollout venv's python, to the end, output captured (a run expected to fail fast)."""
    return subprocess.run([str(RPY), *args], check=False, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def _manifest(out: Path) -> dict:
    return json.loads(Path(str(out) + ".manifest.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """The tiny model + adapter, and a 3-problem miniF2F slice (plus one problem without ':= by')."""
    _require_rollout()
    d = tmp_path_factory.mktemp("lean_e2e")
    rows = MINIF2F.read_text(encoding="utf-8").splitlines()
    (d / "p3.jsonl").write_text("\n".join(rows[:3]) + "\n", encoding="utf-8")
    (d / "p4.jsonl").write_text("\n".join(rows[3:7]) + "\n", encoding="utf-8")
    r = subprocess.run(
        [
            str(RPY),
            str(FIX / "build_tiny.py"),
            str(d / "model"),
            "--adapter",
            str(d / "adapter"),
            "--corpus",
            str(MINIF2F),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def pipeline(w):
    """Round 0 (3 problems x n=2) -> stand-in verification -> correction round 1 (n=1), via the pipeline."""
    t0 = time.monotonic()
    wd = w / "pipe"
    standin = f"{RPY} {EXTRAS / 'lean_repl_standin.py'} --replies {FIX / 'standin_replies.json'}"
    gen_args = " ".join(["--model", str(w / "model"), *ENGINE])
    rc = _run(
        [
            str(EXTRAS / "pipeline_gen_verify.py"),
            "--problems",
            str(w / "p3.jsonl"),
            "--workdir",
            str(wd),
            "--rounds",
            "1",
            "--n-initial",
            "2",
            "--n-correction",
            "1",
            "--cap-tokens",
            "24",
            "--seed",
            "0",
            "--gen-python",
            str(RPY),
            "--gen-args",
            gen_args,
            "--repl-cmd",
            standin,
            "--repl-timeout",
            "30",
            "--import-timeout",
            "30",
        ],
        w / "pipeline.log",
        timeout=2 * TIMEOUT_S,
    )
    assert rc == 0, (w / "pipeline.log").read_text()[-4000:]
    print(f"pipeline 2 rounds: {time.monotonic() - t0:.1f} s")
    return wd


@pytest.mark.slow  # the module's pipeline fixture (tiny model build + 2 vLLM rounds): ~75 s on 2 loaded cores
def test_round0_records(pipeline, w):
    recs = _jsonl(pipeline / "gen_r0.jsonl")
    assert sorted(r["sample_id"] for r in recs) == sorted(
        f"{p}_g{i}" for p in ("mathd_algebra_478", "numbertheory_4x3m7y3neq2003", "aime_1983_p1") for i in range(2)
    )
    for r in recs:
        assert r["cap_tokens"] == 24 and r["sampling"]["max_tokens"] == 24 and r["context_clipped"] is False
        assert r["sampling"]["temperature"] == 1.0 and r["sampling"]["top_p"] == 0.95
        assert r["sampling"]["seed"] == lr.derive_seed(0, r["problem_id"], r["sample_idx"], 0)
        assert 1 <= len(r["completion_ids"]) <= 24
        assert (r["finish_reason"] == "stop") == (len(r["completion_ids"]) < 24)
        assert r["messages"] == lp.initial_messages(r["lean4_code"])
        assert r["prompt_tokens"] == len(r["prompt_ids"]) > 100
        assert r["lean_code"] is None and r["lean_code_error"] == "no_code_block"
        assert r["trajectory"]["root_id"] == r["sample_id"] and r["adapter"] is None
    m = _manifest(pipeline / "gen_r0.jsonl")
    s = m["sessions"][-1]
    assert m["status"] == "complete" and s["status"] == "complete" and s["new_samples"] == 6
    assert s["versions"]["vllm"] and s["kv_blocks"]["num_gpu_blocks"] > 0 and s["load_wall_s"] > 0
    assert sum(s["finish_counts"].values()) == 6


def test_verification_via_recorded_repl_and_correction_round(pipeline):
    ver = _jsonl(pipeline / "verif_r0.jsonl")
    assert len(ver) == 6 and not any(v["accepted"] for v in ver)
    assert all(v["repl_code"] == "None" and len(v["repl_errors"]) == 2 for v in ver)
    gen0 = {r["sample_id"]: r for r in _jsonl(pipeline / "gen_r0.jsonl")}
    gen1 = _jsonl(pipeline / "gen_r1.jsonl")
    assert sorted(r["sample_id"] for r in gen1) == sorted(f"{s}_corr1_g0" for s in gen0)
    for r in gen1:
        par = gen0[r["parent_id"]]
        err = lp.get_error_str("None", ver[0]["repl_errors"])
        assert r["messages"] == lp.correction_messages(par["messages"], par["completion_text"], err, 1)
        assert r["round"] == 1 and r["trajectory"]["lineage"] == [par["sample_id"], r["sample_id"]]
        assert r["trajectory"]["cumulative_completion_tokens"] == par["completion_tokens"] + r["completion_tokens"]
        assert r["prompt_tokens"] > par["prompt_tokens"]
    assert _manifest(pipeline / "gen_r1.jsonl")["status"] == "complete"
    assert (pipeline / "verif_r1.jsonl").exists()


def test_rerun_resumes_with_zero_new_samples(pipeline, w):
    out = pipeline / "gen_r0.jsonl"
    before = out.read_bytes()
    rc = _run(_lean_gen(w, "p3.jsonl", out, "--n 2 --cap-tokens 24 --round 0 --seed 0", *ENGINE), w / "rerun.log")
    assert rc == 0, (w / "rerun.log").read_text()[-3000:]
    assert out.read_bytes() == before
    s = _manifest(out)["sessions"]
    assert len(s) == 2 and s[-1]["todo"] == 0 and s[-1]["done_before"] == 6 and "load_wall_s" not in s[-1]


def test_dry_run_round1_renders_with_the_model_template(pipeline, w):
    out = w / "dry" / "gen_r1.jsonl"
    out.parent.mkdir()
    probs = w / "p3bad.jsonl"
    probs.write_text(
        (w / "p3.jsonl").read_text() + json.dumps({"name": "nob", "lean4_code": "theorem x : True"}) + "\n"
    )
    corrections = ["--corrections-from", str(pipeline / "verif_r0.jsonl"), str(pipeline / "gen_r0.jsonl")]
    flags = "--n 1 --cap-tokens 24 --round 1 --max-model-len 1536 --dry-run"
    rc = _run(_lean_gen(w, probs.name, out, flags, *corrections), w / "dry.log")
    assert rc == 0, (w / "dry.log").read_text()[-3000:]
    rows = _jsonl(Path(str(out) + ".dry_run.jsonl"))
    planned = [r for r in rows if "skipped" not in r]
    assert len(planned) == 6 and [r["skipped"] for r in rows if "skipped" in r] == [
        {"problem_id": "nob", "reason": "no_by_marker", "detail": "lean4_code has no ':= by'"}
    ]
    for r in planned:  # 3-turn prompts: the tokenizer's template == the stdlib Qwen3 model of it
        assert len(r["messages"]) == 3 and r["prompt_text"] == lp.render_qwen3(r["messages"])
    assert not out.exists() and not Path(str(out) + ".manifest.json").exists()


@pytest.mark.slow  # two lean_gen runs (vLLM starts): ~90 s on 2 loaded cores
def test_sigterm_gives_143_and_a_resumable_state(w, pipeline):
    out = w / "sig" / "gen.jsonl"
    out.parent.mkdir()
    # one sequence at a time, 8 samples: the signal lands within ~0.1 s of the first record, seconds before the end
    flags = "--n 2 --cap-tokens 64 --seed 0 --max-model-len 1024 --enforce-eager --dtype float32"
    cmd = _lean_gen(w, "p4.jsonl", out, flags, "--max-num-seqs", "1", "--refill-window", "1")
    p = _start(cmd, w / "sig.log")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and p.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert _wait(p) == 143, (w / "sig.log").read_text()[-3000:]
    first = _jsonl(out)
    m = _manifest(out)
    assert 1 <= len(first) < 8 and m["status"] == "incomplete" and m["sessions"][-1]["status"] == "interrupted"
    assert m["sessions"][-1]["exit_code"] == 143
    resume = cmd[: cmd.index("--max-num-seqs")] + ["--max-num-seqs", "8"]  # engine sizing is not part of the plan
    assert _run(resume, w / "sig2.log") == 0, (w / "sig2.log").read_text()[-3000:]
    recs = _jsonl(out)
    assert len(recs) == 8 == len({r["sample_id"] for r in recs}) and recs[: len(first)] == first
    m = _manifest(out)
    assert m["status"] == "complete" and m["sessions"][-1]["done_before"] == len(first)
    assert [r["session"] for r in recs] == [0] * len(first) + [1] * (8 - len(first))


def test_lora_adapter_unmerged(w, pipeline):
    out = w / "lora" / "gen.jsonl"
    out.parent.mkdir()
    lora = ["--lora-adapter", str(w / "adapter"), "--wait-lock", "--lock-file", str(w / "heavy.lock")]
    cmd = _lean_gen(w, "p3.jsonl", out, "--n 2 --cap-tokens 16 --seed 0", *ENGINE, *lora)
    assert _run(cmd, w / "lora.log") == 0, (w / "lora.log").read_text()[-3000:]
    sha = lg.sha256_dir(str(w / "adapter"))
    m = _manifest(out)
    assert m["sessions"][-1]["adapter"]["sha256"] == sha and m["sessions"][-1]["model_rev"].endswith(
        f"+lora-{sha[:12]}"
    )
    recs = _jsonl(out)
    assert all(r["adapter"]["sha256"] == sha and r["model_rev"].endswith(f"+lora-{sha[:12]}") for r in recs)
    assert "lora" in (w / "lora.log").read_text().lower()
    # same seeds as the base run of round 0: the adapter must change what is sampled
    base = {r["sample_id"]: r["completion_ids"] for r in _jsonl(pipeline / "gen_r0.jsonl")}
    assert all(r["completion_ids"][:8] != base[r["sample_id"]][:8] for r in recs)


def test_bad_inputs_fail_clearly(w, pipeline):
    def gen(problems: str, out: Path, flags: str = "", *more: str) -> subprocess.CompletedProcess:
        return _python(_lean_gen(w, problems, out, f"--cap-tokens 8 {flags}", *more))

    bad = w / "bad.jsonl"
    bad.write_text('{"name": "a", "lean4_code": "x := by"}\n{oops\n')
    r = gen(bad.name, w / "b1.jsonl")
    assert r.returncode == 2 and "bad.jsonl:2: not valid JSON" in r.stderr
    r = gen("p3.jsonl", w / "b2.jsonl", "--max-model-len 4096")
    assert r.returncode == 2 and "above the model's position limit 2048" in r.stderr
    other = w / "other_gen.jsonl"
    other.write_text(json.dumps({"sample_id": "zzz_g0", "problem_id": "zzz", "round": 0}) + "\n")
    r = gen("p3.jsonl", w / "b3.jsonl", "--round 1", "--corrections-from", str(pipeline / "verif_r0.jsonl"), str(other))
    assert r.returncode == 2 and "none of the verification records" in r.stderr
    out = w / "b4.jsonl"
    fd = os.open(str(out) + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = gen("p3.jsonl", out)
    finally:
        os.close(fd)
    assert r.returncode == 75 and "held by another launch" in r.stderr and not out.exists()
    for p in (w / "b1.jsonl", w / "b2.jsonl", w / "b3.jsonl"):
        assert not p.exists()


def test_pipeline_exits_4_when_the_generator_manifest_is_not_complete(w):
    r = _python(
        [
            str(EXTRAS / "pipeline_gen_verify.py"),
            "--problems",
            str(w / "p3.jsonl"),
            "--workdir",
            str(w / "pipe_bad"),
            "--rounds",
            "0",
            "--cap-tokens",
            "8",
            "--gen-python",
            str(RPY),
            "--gen-args",
            f"--model {w / 'model'} --max-model-len 99999",
            "--repl-cmd",
            "false",
        ]
    )
    assert r.returncode == 4 and "not 'complete'" in r.stderr
