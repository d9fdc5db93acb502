"""examples/eval/external_vllm_eval_fn.py: a CheckpointEvalFn that evaluates each snapshot on a vLLM OpenAI server.

The rollout-marked test launches the real server (the CPU build of vLLM in .venv-rollout) on localhost through
``--eval-function-path`` and checks that each eval point measured exactly its snapshot's weights (against a
transformers reference). The fast tests drive the same class against an in-test HTTP stub that speaks the few
endpoints the pin uses; a stub is used there only to make the server misbehave on purpose (a weight version that
never moves), which a healthy real server will not do.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from helpers_models import exact_eval_set, require_rollout_venv

from align.eval import EvalConfig, EvalSet, make_evaluator, retarget_args
from align.eval.checkpoint_eval import _import_target

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "eval" / "external_vllm_eval_fn.py"
PROMPTS = [[5, 17, 99, 123], [7, 8], [300, 2, 44, 45, 46, 47]]
MAX_TOKENS = 8
NOISE = 0.05


def example_class():
    return _import_target(f"{EXAMPLE}:ExternalVllmEvalFn")


def write_snapshot(path: str) -> None:
    os.makedirs(path)
    Path(path, "config.json").write_text(json.dumps({"max_position_embeddings": 64, "torch_dtype": "float32"}))


class Stub:
    """A minimal OpenAI/vLLM-dev HTTP server: records calls; completions echo the prompt's first token."""

    def __init__(self, stuck_version: bool = False) -> None:
        self.calls: list[tuple[str, dict | None]] = []
        self.version = "default"
        self.stuck = stuck_version
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, obj) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                stub.calls.append((self.path, None))
                if self.path == "/weight_info":
                    return self._reply({"weight_version": stub.version})
                if self.path == "/v1/models":
                    return self._reply({"data": [{"id": "stub-model"}]})
                return self._reply({})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                stub.calls.append((self.path, body))
                if self.path == "/update_weight_version" and not stub.stuck:
                    stub.version = body["new_version"]
                if self.path == "/v1/completions":
                    tok = body["prompt"][0]
                    choices = [
                        {"index": j, "token_ids": [tok] * body["max_tokens"], "finish_reason": "length"}
                        for j in range(body["n"])
                    ]
                    return self._reply({"choices": choices})
                return self._reply({"success": True})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]


@pytest.fixture
def stub_fn_path(tmp_path):
    """A subclass of the example attached to a stub (the documented ALIGN_EVAL_VLLM_URL mode)."""

    def make(stub: Stub) -> str:
        src = tmp_path / "attached.py"
        src.write_text(
            f"import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('ext_example', {str(EXAMPLE)!r})\n"
            f"mod = importlib.util.module_from_spec(spec); sys.modules['ext_example'] = mod\n"
            f"spec.loader.exec_module(mod)\n"
            f"class Attached(mod.ExternalVllmEvalFn):\n"
            f"    url = {stub.url!r}\n"
        )
        return f"{src}:Attached"

    return make


def run_points(tmp_path, fn_path, steps, **cfg_kw):
    prompts = [[10, 1], [11, 2]]
    eval_set = EvalSet(prompts=prompts, score=lambda i, toks: float(toks[0] == prompts[i][0]), name="echo")
    cfg = EvalConfig(
        eval_interval=1, eval_function_path=fn_path, eval_hf_dir=str(tmp_path / "eval_hf"), eval_max_tokens=2, **cfg_kw
    )
    ev = make_evaluator(cfg, eval_set, export_fn=write_snapshot, blocking_eval_fn=None)
    records = []
    for s in steps:
        records += ev.step(s, is_final=s == steps[-1])
    return records + ev.drain()


def test_external_eval_fn_waits_pins_then_evals(tmp_path, stub_fn_path):
    stub = Stub()
    records = run_points(tmp_path, stub_fn_path(stub), [1, 2], eval_n=3)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["eval/pass@1"] == 1.0 and r["eval/pass@3"] == 1.0 and r["eval/weight_version"] == r["step"]
    p = stub.paths()
    first_pin = p.index("/collective_rpc")
    assert p[0] == "/health" and p.count("/health") == 1  # health only before the first point
    assert p[first_pin : first_pin + 4] == [
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/weight_info",
    ]
    rpc = [b for path, b in stub.calls if path == "/collective_rpc"]
    assert [b["kwargs"]["weights_path"] for b in rpc] == [str(tmp_path / "eval_hf" / f"step_{s}") for s in (1, 2)]
    assert [b["new_version"] for path, b in stub.calls if path == "/update_weight_version"] == ["1", "2"]
    comps = [b for path, b in stub.calls if path == "/v1/completions"]
    assert len(comps) == 4 and all(b["model"] == "stub-model" and b["n"] == 3 for b in comps)


def test_external_eval_fn_stuck_version_retries_then_skips_pin_violation(tmp_path, stub_fn_path):
    stub = Stub(stuck_version=True)
    records = run_points(tmp_path, stub_fn_path(stub), [1])
    assert records == [{"step": 1, "eval/skipped_pin_violation": 1, "eval/step": 1}]
    assert stub.paths().count("/collective_rpc") == 2  # 2 attempts
    assert "/v1/completions" not in stub.paths()  # never evaluates unpinned weights


def test_example_reexports_retarget_args():
    mod = _import_target(f"{EXAMPLE}:retarget_args")
    assert mod is retarget_args


HANG_S = 30.0  # the server's silence (the client's timeout); exit must not wait for it
EXIT_BOUND_S = 12.0  # generous bound for a Python start + exit on a loaded machine


def test_exit_does_not_wait_for_a_hung_server(tmp_path):
    """A server that accepts connections and never answers: the client's request threads must not hold up exit."""
    import socket
    import subprocess
    import sys
    import textwrap
    import time

    with socket.socket() as srv:  # listening, never accepting: every request waits for its timeout
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        port = srv.getsockname()[1]
        script = textwrap.dedent(
            f"""
            import sys, threading, time
            sys.path.insert(0, {str(REPO)!r})
            from align.eval.checkpoint_eval import _import_target
            from align.rollout.protocol import SamplingParams
            Gen = _import_target({str(EXAMPLE)!r} + ":OpenAICompletionsGenerate")
            gen = Gen("http://127.0.0.1:{port}", "m", concurrency=2, timeout_s={HANG_S})
            threading.Thread(target=gen.generate, args=([[1], [2], [3]], SamplingParams(max_tokens=2)),
                             daemon=True).start()  # the dispatcher's daemon thread runs generate
            time.sleep(1.0)
            print("exiting", flush=True)
            """
        )
        proc = subprocess.Popen([sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith("exiting"):
                break
        t0 = time.monotonic()
        proc.wait(timeout=HANG_S * 2)
        assert time.monotonic() - t0 < EXIT_BOUND_S, "interpreter exit waited on a hung server request"


# ---- the real server ----


def fake_optimizer_step(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(2000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * NOISE)


@pytest.mark.rollout
def test_vllm_server_evaluates_each_exact_snapshot(tmp_path, monkeypatch):
    require_rollout_venv()
    from helpers_models import greedy_ids, load_hf, make_tiny_qwen2

    from align.model import load_pretrained, save_pretrained

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "rollout" / "inductor"))
    base = make_tiny_qwen2(tmp_path / "base", seed=0)
    ref = load_pretrained(base)
    for s in (1, 2):
        fake_optimizer_step(ref, s)
    hf = load_hf(save_pretrained(ref, tmp_path / "ref_step_2"))
    expected = [greedy_ids(hf, p, MAX_TOKENS) for p in PROMPTS]
    eval_set = exact_eval_set(PROMPTS, expected, MAX_TOKENS, step=2)
    cfg = EvalConfig(
        eval_interval=1,
        eval_function_path=f"{EXAMPLE}:ExternalVllmEvalFn",
        eval_hf_dir=str(tmp_path / "eval_hf"),
        eval_n=2,
        eval_timeout_s=300,
        ci_test=True,  # any skip (unhealthy server, pin violation) fails the test
    )
    model = load_pretrained(base)
    ev = make_evaluator(cfg, eval_set, export_fn=lambda p: save_pretrained(model, p), blocking_eval_fn=None)
    fn = ev.dispatcher.runner.eval_fn
    records = []
    try:
        for s in (1, 2):
            fake_optimizer_step(model, s)
            records += ev.step(s, is_final=s == 2)
        records += ev.drain()
    finally:
        ev.drain()
        fn.dispose()
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == [1, 2], records
    assert by_step[2]["eval/pass@1"] == 1.0 and by_step[2]["eval/pass@2"] == 1.0, by_step  # exactly step 2's weights
    assert by_step[1]["eval/pass@1"] < 1.0, by_step  # step 1's weights generate something else
    assert all(r["eval/weight_version"] == s for s, r in by_step.items())
    assert fn.proc is None and fn.server_pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(fn.server_pid, 0)  # dispose() left no process of the server's group
