"""lean_gen.py as a newcomer and a careless or hostile input meet it (issues 19 and 20), without vLLM.

Runs lean_gen in subprocesses of this (core) venv, which has transformers but no vLLM: ``--dry-run`` needs only the
tokenizer, and a run whose samples all exist never builds an engine. The model is the tiny random-weight Qwen2 with
a locally trained BPE tokenizer of tests/lean_fixtures/build_tiny.py (no downloads).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_locks import assert_flock_released

ROOT = Path(__file__).resolve().parents[1]
# ALIGN_LEAN_EXTRAS points the suite at another copy of extras/vllm_rollout (as in test_lean_gen_contract.py)
LEAN_GEN = Path(os.environ.get("ALIGN_LEAN_EXTRAS", ROOT / "extras" / "vllm_rollout")) / "lean_gen.py"
FIX = Path(__file__).resolve().parent / "lean_fixtures"
STMT = json.loads((FIX / "goedel_examples.json").read_text(encoding="utf-8"))["lean4_code_478"]
TIMEOUT_S = 180
EVIL = """from pathlib import Path
Path({marker!r}).write_text("the model repository's code ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _lean_gen_module():
    sys.path.insert(0, str(LEAN_GEN.parent))
    spec = importlib.util.spec_from_file_location("lean_gen", LEAN_GEN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_MODULES_CACHE": str(tmp / "hf_modules"), "TOKENIZERS_PARALLELISM": "false", **extra}


def _run(args: list[str], tmp: Path, prelude: str = "", **env: str) -> subprocess.CompletedProcess:
    """lean_gen.py ARGS under this venv's python; ``prelude`` runs first (e.g. to hide a package)."""
    code = f"{prelude}\nimport runpy, sys\nsys.argv = {[str(LEAN_GEN), *args]!r}\n"
    code += f"runpy.run_path({str(LEAN_GEN)!r}, run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_env(tmp, **env),
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("lean_cli")
    r = subprocess.run(
        [sys.executable, str(FIX / "build_tiny.py"), str(d / "model")],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (d / "problems.jsonl").write_text(json.dumps({"name": "mathd_algebra_478", "lean4_code": STMT}) + "\n")
    return d


def _args(w: Path, out: Path, *more: str) -> list[str]:
    base = ["--problems", str(w / "problems.jsonl"), "--out", str(out), "--n", "2", "--cap-tokens", "16"]
    return [*base, "--model", str(w / "model"), "--max-model-len", "1024", *more]


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith("lean_gen: error: "), r.stderr[-3000:]
    return lines[-1]


def test_help_shows_defaults_exit_codes_and_every_option(tmp_path):
    r = subprocess.run(
        [sys.executable, str(LEAN_GEN), "--help"], check=False, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for code in ("0 every planned sample", "1 some planned samples are missing", "2 bad input", "75 ", "143 "):
        assert code in text, code
    assert "--round ROUND 0: initial proofs" in text and "(default: 0)" in text
    assert "--seed SEED base seed" in text and "--top-p TOP_P nucleus sampling threshold (default: 0.95)" in text
    assert "--trust-remote-code" in text and ".venv-rollout" in text
    helpless = [a.option_strings for a in _lean_gen_module().build_parser()._actions if not a.help]
    assert not helpless, f"options without help: {helpless}"


@pytest.mark.slow  # a subprocess importing transformers: ~10-30 s on 2 shared cores
def test_without_transformers_one_line_says_which_venv(w, tmp_path):
    r = _run(
        _args(w, tmp_path / "o.jsonl", "--dry-run"), tmp_path, prelude="import sys; sys.modules['transformers'] = None"
    )
    line = _one_line_error(r)
    assert "cannot import transformers" in line and ".venv-rollout/bin/python" in line and "local --model" in line


@pytest.mark.slow  # a subprocess importing transformers: ~10-30 s on 2 shared cores
def test_without_vllm_one_line_says_which_venv(w, tmp_path):
    r = _run(_args(w, tmp_path / "o.jsonl"), tmp_path, prelude="import sys; sys.modules['vllm'] = None")
    line = _one_line_error(r)
    assert "cannot import vllm" in line and ".venv-rollout/bin/python" in line


@pytest.mark.slow  # a subprocess importing transformers: ~10-30 s on 2 shared cores
def test_unreachable_hub_model_is_one_line(w, tmp_path):
    args = _args(w, tmp_path / "o.jsonl", "--dry-run")
    args[args.index("--model") + 1] = "no-such-org/no-such-model"
    r = _run(args, tmp_path, HF_HUB_OFFLINE="1")  # offline: the hub's answer without ~60 s of retries
    line = _one_line_error(r)
    assert "cannot load the tokenizer of 'no-such-org/no-such-model' (not a local directory" in line
    assert "local --model snapshot" in line


def test_local_model_puts_the_hub_offline(tmp_path):
    lg = _lean_gen_module()
    assert lg.hub_offline_env(str(tmp_path), None) == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    assert lg.hub_offline_env(str(tmp_path), "org/tokenizer") == {}  # a hub tokenizer still needs the hub
    assert lg.hub_offline_env("org/model", None) == {}


@pytest.fixture
def evil_model(w, tmp_path):
    """The tiny model whose tokenizer_config auto_map points at a .py that writes a marker file when imported."""
    model = tmp_path / "evil_model"
    shutil.copytree(w / "model", model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "marker"
    (model / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return model, marker


@pytest.mark.slow  # a subprocess importing transformers: ~10-30 s on 2 shared cores
def test_model_repo_code_runs_only_with_trust_remote_code(w, tmp_path, evil_model):
    model, marker = evil_model
    args = _args(w, tmp_path / "o.jsonl", "--dry-run")
    args[args.index("--model") + 1] = str(model)
    r = _run(args, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not marker.exists(), "lean_gen ran the model repository's code without --trust-remote-code"
    r = _run([*args, "--trust-remote-code"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker.exists()  # control: the fixture's code does run when trusted


@pytest.mark.slow  # a subprocess importing transformers: ~10-30 s on 2 shared cores
def test_a_repeated_record_neither_completes_a_missing_sample_nor_blocks_completion(w, tmp_path):
    out = tmp_path / "o.jsonl"
    recs = [{"sample_id": f"mathd_algebra_478_g{i}", "problem_id": "mathd_algebra_478", "round": 0} for i in (0, 1)]
    out.write_text("".join(json.dumps(r) + "\n" for r in [recs[0], recs[1], {**recs[1], "session": 9}]))
    r = _run(_args(w, out), tmp_path)  # every planned sample exists: no engine is built
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["done_samples"] == 2
    assert [json.loads(x) for x in out.read_text().splitlines()] == recs  # the repeat is gone, the first kept
    assert "dropping 1 repeated record" in r.stderr


ORPHAN_EXIT_S = 20.0  # the watch sees the pipe's EOF at once; a main thread stuck for 10 s more is SIGKILLed


@pytest.mark.slow  # lean_gen imports transformers and tokenizes before it waits: ~10-30 s on 2 shared cores
def test_generator_exits_when_the_pipeline_is_killed(w, tmp_path):
    """kill -9 of pipeline_gen_verify.py while its lean_gen waits for the heavy-GPU lock (held here): lean_gen
    notices its launcher is gone and exits, releasing the --out lock, so a rerun is not locked out."""
    import fcntl
    import signal
    import time

    sys.path.insert(0, str(ROOT))
    from align.rollout.protocol import pid_alive

    heavy = tmp_path / "heavy.lock"
    hold = os.open(heavy, os.O_RDWR | os.O_CREAT)
    fcntl.flock(hold, fcntl.LOCK_EX)
    wd = tmp_path / "wd"
    gen_args = f"--model {w / 'model'} --max-model-len 1024 --wait-lock --lock-file {heavy}"
    cmd = [sys.executable, str(LEAN_GEN.parent / "pipeline_gen_verify.py"), "--problems", str(w / "problems.jsonl")]
    cmd += ["--workdir", str(wd), "--rounds", "0", "--cap-tokens", "8", "--gen-python", sys.executable]
    cmd += ["--gen-args", gen_args, "--repl-cmd", "false"]
    pipeline = subprocess.Popen(cmd, env=_env(tmp_path), cwd=ROOT, start_new_session=True)
    gen_pid = None
    try:
        log, lock = wd / "gen_r0.log", wd / "gen_r0.jsonl.lock"
        deadline = time.monotonic() + TIMEOUT_S
        while not (log.exists() and "waiting for heavy-GPU lock" in log.read_text()):
            assert time.monotonic() < deadline and pipeline.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        gen_pid = int(lock.read_text().split()[1])  # "pid N since ...", written by lean_gen's --out lock
        os.kill(pipeline.pid, signal.SIGKILL)
        pipeline.wait()
        t0 = time.monotonic()
        while pid_alive(gen_pid):
            assert time.monotonic() - t0 < ORPHAN_EXIT_S, f"lean_gen outlived its pipeline:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        print(f"\nlean_gen gone {time.monotonic() - t0:.1f} s after kill -9 of the pipeline")
        assert "launching process" in log.read_text()
        session = json.loads((wd / "gen_r0.jsonl.manifest.json").read_text())["sessions"][-1]
        assert session["status"] == "interrupted" and session["exit_code"] == 143  # the clean path, resumable
        assert_flock_released(lock)  # a rerun gets the --out lock
    finally:
        os.close(hold)
        for pid in (pipeline.pid, gen_pid):
            if pid is not None and pid_alive(pid):
                os.killpg(pid, signal.SIGKILL)
        pipeline.wait()


@pytest.mark.slow  # a subprocess importing transformers: ~10-30 s on 2 shared cores
def test_a_launch_that_fails_its_vllm_check_leaves_out_untouched(w, tmp_path):
    """Issue 30: the resume repair truncated --out before the launch failed its vLLM check."""
    out = tmp_path / "o.jsonl"
    rec = {"sample_id": "mathd_algebra_478_g0", "problem_id": "mathd_algebra_478", "round": 0}
    out.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "session": 9}) + "\n" + '{"sample_id": "mathd_al')
    before = out.read_bytes()
    r = _run(_args(w, out), tmp_path, prelude="import sys; sys.modules['vllm'] = None")
    assert "cannot import vllm" in _one_line_error(r)
    assert out.read_bytes() == before and not Path(f"{out}.skipped.jsonl").exists()
