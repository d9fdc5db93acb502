"""vLLM rollout worker: serves a spool directory (align/rollout/spool.py) with a vLLM engine.

Runs under ``.venv-rollout`` (vllm, ray, pyarrow, torch), never the align venv. From align it imports
only ``align.rollout.protocol`` (stdlib only). Usually launched by ``align.rollout.client.spawn_worker``;
by hand:

    .venv-rollout/bin/python extras/vllm_rollout/rollout_worker.py --spool runs/x/spool --model <hf dir>

Loop: claim requests in file-name order; generate requests join the running engine between its steps
(continuous batching, up to ``--max-batch-requests`` in flight) and each is answered once all its sequences
finished; a command waits until nothing is in flight, and nothing after it is claimed before it ran;
``sync_weights`` reloads the committed snapshot into the running engine
(``collective_rpc("reload_weights", weights_path=...)``), rebuilding the engine when the architecture
changed or reload fails; a committed PEFT adapter dir (LoRA training, worker started with
``--max-lora-rank``) is loaded as a new ``LoRARequest`` on the unchanged base model (no engine rebuild, no
base reload) and serves every later request; ``score`` (protocol 1.1, ``align/rollout/teacher_logprobs.py``) answers the
exact logprob of each given token (vLLM ``prompt_logprobs``); ``cut`` (protocol 1.2, ``align/rollout/cut.py``) is
served at once, between two engine steps, even ahead of a claimed command or a full batch: the named requests are
aborted and answered with their rows so far; ``sleep`` / ``wake_up`` (protocol 1.3, ``align/rollout/sleep_mode.py``)
put the engine in vLLM's sleep mode and back (``--enable-sleep-mode``; refused at start on a platform without it);
``shutdown`` answers and exits. A heartbeat thread rewrites
``heartbeat.json`` every ``--heartbeat-s``. One worker per spool (``worker.lock``). On start,
requests a dead predecessor had claimed but not answered are served again (answers are keyed by
request id, so none is answered twice).

Logprob basis (README "Logprob basis caveat"): ``--logprobs-mode raw`` returns vLLM's raw logprobs
(log_softmax of the logits, before temperature; the training basis only at T = 1);
``--logprobs-mode processed`` returns them after temperature and top-k/top-p (the training basis at
any T when no truncation is active; the sampled-distribution logprob always).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (tests), not run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_cpu import engine_kwargs
from worker_answers import ResponseWriter, Running, completions_message
from worker_commands import UNSTARTED, Commands, arch_of, sleep_mode_problem

from align.rollout import protocol as P

log = logging.getLogger("rollout_worker")

VLLM_LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--spool", required=True, help="spool directory shared with the trainer")
    ap.add_argument("--model", required=True, help="HF checkpoint directory to serve first")
    ap.add_argument("--weights-version", type=int, default=0, help="version stamped on answers until the first sync")
    ap.add_argument("--max-model-len", type=int, default=2048, help="context length (prompt + completion)")
    ap.add_argument("--dtype", default="auto", help="vLLM dtype: auto | float32 | bfloat16 | float16")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM default when unset")
    ap.add_argument(
        "--enable-sleep-mode", action="store_true", help="vLLM sleep mode: serve sleep / wake_up (GPU only)"
    )
    ap.add_argument(
        "--enforce-eager", action=argparse.BooleanOptionalAction, default=None, help="default: eager without CUDA"
    )
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--logprobs-mode", choices=sorted(VLLM_LOGPROBS_MODES), default="raw", help="see module docstring")
    ap.add_argument(
        "--sync-mode", choices=("auto", "reload", "rebuild"), default="auto", help="auto: reload, else rebuild"
    )
    ap.add_argument("--seed", type=int, default=0, help="engine seed (requests carry their own sampling seeds)")
    ap.add_argument("--max-lora-rank", type=int, default=0, help="serve LoRA adapters up to this rank (0 = off)")
    ap.add_argument(
        "--return-routes",
        action="store_true",
        help="MoE routing replay: vLLM's enable_return_routed_experts; completions carry routes (minor 4; GPU only)",
    )
    ap.add_argument("--max-batch-requests", type=int, default=64, help="generate requests in flight at once")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--poll-s", type=float, default=0.02)
    ap.add_argument("--log-path", default=None, help="this worker's log file (recorded in the heartbeat for clients)")
    ap.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process (the launcher) exits, even by kill -9"
    )
    ap.add_argument(
        "--parent-fd", type=int, default=None, help="read end of a pipe the launcher holds open (EOF: it exited)"
    )
    ap.add_argument(
        "--parent-grace-s",
        type=float,
        default=0.0,
        help="on the launcher's exit: seconds of clean shutdown (SIGTERM) before the process group is SIGKILLed; "
        "0 kills at once (what this worker had claimed is served again by the next worker on the spool)",
    )
    args = ap.parse_args(argv)
    if args.max_model_len < 2 or args.heartbeat_s <= 0 or args.poll_s <= 0 or args.max_batch_requests < 1:
        ap.error("--max-model-len >= 2, --heartbeat-s > 0, --poll-s > 0, --max-batch-requests >= 1")
    return args


def sample_seed(seed: int | None, prompt_index: int, sample_index: int) -> int | None:
    """A distinct, reproducible seed per (request seed, prompt, sample); None stays None (unseeded)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # < 2**62: fits a torch generator seed


class Worker(Commands):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.spool = P.Spool(args.spool).ensure()
        self.model_dir = P.check_hf_dir(args.model).resolve()
        self.version = args.weights_version
        self.basis = args.logprobs_mode
        self.state, self.error = "starting", None
        self.llm = None
        self.lora = None  # the LoRARequest serving the current adapter version (LoRA training)
        self.lora_ids = 0
        self.asleep = 0  # the sleep level the engine is in (0: awake)
        self.vocab_size = int(json.loads((self.model_dir / "config.json").read_text()).get("vocab_size", 0))
        self.arch = arch_of(self.model_dir / "config.json")  # kept: the snapshot dir may be deleted once loaded
        self.running: dict[str, Running] = {}  # generate requests in flight, by message id
        self.running_seqs: dict[str, tuple[Running, int]] = {}  # engine request id -> (its request, sequence index)
        self.queued_kinds: dict[str, str] = {}  # a queued request file's kind, read once (``cut_ahead``)
        self.finished_tokens = 0  # completion tokens of every finished sequence (the batch figures' basis)
        self.writer = ResponseWriter(self.publish)
        self._stop = threading.Event()
        self._wake = threading.Event()  # flip_state: the heartbeat thread writes the new state now
        self._beat = threading.Thread(target=self._heartbeat_loop, daemon=True, name="heartbeat")

    # -- liveness ----------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        info = {"weights_version": self.version, "logprob_basis": self.basis, "model": str(self.model_dir)}
        info.update(log_path=self.args.log_path, max_model_len=self.args.max_model_len, error=self.error)
        info.update(
            vocab_size=self.vocab_size, asleep=self.asleep
        )  # clients check answered token ids against it (0: unknown)
        info.update(routes=self.args.return_routes)  # completions carry MoE routes (protocol minor 4)
        info.update(untrusted_rejected=self.spool.untrusted)  # requests refused: another uid's, or no valid MAC
        self.spool.write_heartbeat(self.state, **info)

    def _heartbeat_loop(self) -> None:
        while True:
            self._wake.wait(self.args.heartbeat_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.heartbeat()
            except OSError as e:  # a full disk must not kill the worker; the client sees the stale heartbeat
                log.warning("heartbeat write failed: %s", e)

    def set_state(self, state: str, error: str | None = None) -> None:
        self.state, self.error = state, error
        self.heartbeat()

    def flip_state(self, state: str) -> None:
        """Serving's busy/ready flips: the heartbeat thread, woken for it, writes the new state (one fsync'ed write
        each, off the loop)."""
        self.state = state
        self._wake.set()

    # -- engine ------------------------------------------------------------------------------------
    def build_engine(self, model_dir: Path):
        """The ``vllm.LLM`` of the flags (on a CPU ``vllm_cpu.engine_kwargs``: a cut request resumes as prompt +
        thousands of ids)."""
        import torch
        from vllm import LLM

        a = self.args
        eager = a.enforce_eager if a.enforce_eager is not None else not torch.cuda.is_available()
        kw = {
            "model": str(model_dir), "skip_tokenizer_init": True, "dtype": a.dtype, "max_model_len": a.max_model_len,
            "max_num_seqs": a.max_num_seqs, "tensor_parallel_size": a.tensor_parallel_size, "seed": a.seed,
            "enforce_eager": eager, "logprobs_mode": VLLM_LOGPROBS_MODES[a.logprobs_mode],
        }  # fmt: skip
        kw.update(engine_kwargs(a.max_model_len, torch.cuda.is_available()))
        if a.gpu_memory_utilization is not None:
            kw["gpu_memory_utilization"] = a.gpu_memory_utilization
        if a.enable_sleep_mode:
            kw["enable_sleep_mode"] = True
        if a.enable_prefix_caching is not None:
            kw["enable_prefix_caching"] = a.enable_prefix_caching
        if a.return_routes:
            if not torch.cuda.is_available():
                raise ValueError(
                    "--return-routes: this vLLM build cannot return routed experts without a GPU (its "
                    "enable_return_routed_experts capture runs in the V2 model runner, which needs CUDA and Triton); "
                    "use the trainer's --rollout native for --routing-replay rollout"
                )
            kw["enable_return_routed_experts"] = True
        if a.max_lora_rank:
            rank = next((r for r in LORA_RANKS if r >= a.max_lora_rank), None)
            if rank is None:
                raise ValueError(f"--max-lora-rank {a.max_lora_rank} exceeds vLLM's largest LoRA rank {LORA_RANKS[-1]}")
            kw.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
        t0 = time.perf_counter()
        llm = LLM(**kw)
        log.info("engine up on %s in %.1f s (%s)", model_dir, time.perf_counter() - t0, kw)
        return llm

    def drop_engine(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()

    # -- requests ----------------------------------------------------------------------------------
    def checked(self, batch: list[tuple[P.Message, float]]) -> Iterator[tuple[P.Message, float, P.SamplingParams]]:
        """The claimed generate requests of ``batch`` that ``check_generate`` passes, with their sampling params;
        each other one is answered ``bad_request`` at once."""
        for msg, claimed_at in batch:
            params = P.SamplingParams.from_dict(msg.body["params"])
            problem = self.check_generate(msg.body["prompts"], params)
            if problem is not None:
                self.answer(P.error_response(msg.id, "bad_request", problem))
                continue
            yield msg, claimed_at, params

    def check_generate(self, prompts: list[list[int]], params: P.SamplingParams) -> str | None:
        if self.asleep:
            return "the engine is asleep (vLLM sleep mode): send wake_up first"
        limit = self.args.max_model_len
        for i, p in enumerate(prompts):
            if len(p) + params.max_tokens > limit:
                return (
                    f"prompt {i} has {len(p)} tokens + max_tokens {params.max_tokens} = {len(p) + params.max_tokens} "
                    f"> max_model_len {limit}: shorten the prompt, lower max_tokens or start the worker with a "
                    f"larger --max-model-len"
                )
            bad = [t for t in p if not 0 <= t < self.vocab_size] if self.vocab_size else []
            if bad:
                return f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
        return None

    def serve_generate(self, batch: list[tuple[P.Message, float]]) -> None:
        """Add each claimed request's sequences to the running engine; ``step`` serves them (continuous batching:
        ``run`` admits new requests between engine steps, ``drain`` waits for all in flight).

        A bad request is answered at once; one the engine refuses is answered ``engine_error`` (EngineDead raised)."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        for msg, claimed_at, params in self.checked(batch):
            first = msg.body.get("first_prompt_index", 0)  # a torchrun rank's share: seeds by global prompt index
            ids: list[str] = []
            try:
                for i, prompt in enumerate(msg.body["prompts"]):
                    for j in range(params.n):
                        sp = VSP(
                            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                            max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids),
                            ignore_eos=True,  # stop only on the requested ids, as the native sampler does
                            seed=sample_seed(params.seed, first + i, j), logprobs=0, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per sequence, when it finishes
                            skip_clone=True,  # one per sequence, never reused: vLLM's deepcopy of it is ~2 ms
                        )  # fmt: skip
                        # the prompt rendering LLM.generate does, then the engine's own unique id per sequence
                        engine_input = self.llm._preprocess_cmpl_one(TokensPrompt(prompt_token_ids=prompt))
                        ids.append(f"{msg.id}:{len(ids)}")
                        engine.add_request(ids[-1], engine_input, sp, lora_request=self.lora)
            except Exception as e:
                log.exception("engine refused request %s", msg.id)
                with contextlib.suppress(Exception):
                    engine.abort_request(ids)
                self.answer(P.error_response(msg.id, "engine_error", f"{e.__class__.__name__}: {e}"))
                if "EngineDead" in e.__class__.__name__:
                    raise
                continue
            job = Running(msg, claimed_at, params, len(ids), self.finished_tokens)
            self.running[msg.id] = job
            self.running_seqs.update({rid: (job, k) for k, rid in enumerate(ids)})
        for job in self.running.values():
            job.peak = max(job.peak, len(self.running))
        if self.running and self.state != "busy":
            self.flip_state("busy")

    def step(self) -> None:
        """One engine step; answer every request whose sequences have all finished (``engine_error`` for all in
        flight when the engine fails; EngineDead re-raised)."""
        try:
            outs = self.llm.llm_engine.step()
        except Exception as e:
            log.exception("engine failed on %d requests", len(self.running))
            with contextlib.suppress(Exception):
                self.llm.llm_engine.abort_request(list(self.running_seqs))
            for job in self.running.values():
                self.answer(P.error_response(job.msg.id, "engine_error", f"{e.__class__.__name__}: {e}"))
            self.running.clear()
            self.running_seqs.clear()
            self.set_state("ready")
            if "EngineDead" in e.__class__.__name__:
                raise
            return
        for out in outs:
            if not out.finished or out.request_id not in self.running_seqs:
                continue
            job, k = self.running_seqs.pop(out.request_id)
            job.outs[k], job.left = out, job.left - 1
            self.finished_tokens += len(out.outputs[0].token_ids)
            if job.left == 0:
                del self.running[job.msg.id]
                self.answer_job(job)
        if not self.running:
            self.flip_state("ready")

    def drain(self) -> None:
        """Step the engine until every request in flight is answered."""
        while self.running:
            self.step()

    def answer_job(self, job: Running) -> None:
        """Answer a request whose sequences all finished."""
        params = job.params
        comps = [self.completion(out, k // params.n, k % params.n, params) for k, out in enumerate(job.outs)]
        self.answer(completions_message(job, comps, self.finished_tokens, self.version, self.basis))

    def completion(self, out, prompt_index: int, sample_index: int, params: P.SamplingParams) -> P.Completion:
        truncated = params.processed  # top-k / top-p / min-p / repetition penalty
        exact = self.basis == "processed" or (params.temperature == 1.0 and not truncated)
        if out is UNSTARTED:  # cut before the engine started it
            return P.Completion(prompt_index, sample_index, [], [], "cut", [] if exact else None, self.version)
        o = out.outputs[0]
        ids = [int(t) for t in o.token_ids]
        lps = [float(o.logprobs[k][t].logprob) for k, t in enumerate(ids)]
        reason = "cut" if o.finish_reason == "abort" else o.finish_reason  # abort: our cut (serve_cut)
        if reason not in P.FINISH_REASONS:
            raise RuntimeError(f"vLLM finished a sequence with reason {o.finish_reason!r}")
        return P.Completion(
            prompt_index, sample_index, ids, lps, reason,
            sampled_logprobs=lps if exact else None, weights_version=self.version, routes=self.routes_of(out, ids),
        )  # fmt: skip

    def routes_of(self, out, ids: list[int]):
        """--return-routes: the experts of each completion token fed back to the model, (len(ids) - 1, MoE layers,
        top-k): vLLM's ``routed_experts`` covers the prompt then the generated tokens, so the prompt's rows are
        skipped. A short array goes on the wire as it is; the client's validation rejects it, naming the request."""
        got = getattr(out.outputs[0], "routed_experts", None) if self.args.return_routes else None
        if got is None:
            return None
        start = len(out.prompt_token_ids or [])
        return got[start : start + max(len(ids) - 1, 0)].astype("int16")

    def answer(self, msg: P.Message) -> None:
        """Publish ``msg`` on the writer's thread (the loop goes on stepping the engine)."""
        self.writer.put(msg)

    def publish(self, msg: P.Message) -> None:
        """The response on disk, then its request moved from claimed/ to done/ (the writer's thread)."""
        self.spool.respond(msg)
        self.spool.finish(msg.id)

    # -- main loop ---------------------------------------------------------------------------------
    def next_batch(self) -> tuple[list[tuple[P.Message, float]], P.Message | None]:
        """Claim consecutive generate requests (up to --max-batch-requests in flight) and/or the command after them."""
        batch: list[tuple[P.Message, float]] = []
        limit = self.args.max_batch_requests - len(self.running)
        if limit < 1:
            return batch, None
        for path in self.spool.pending():
            claimed = self.spool.claim(path)
            if claimed is None:
                continue
            try:
                msg = self.spool.read(claimed)
            except P.UntrustedMessageError as e:  # not the owner's, or no MAC of the spool's secret: never obeyed
                log.error("%s; moved to rejected/, not answered", e)
                self.spool.reject_untrusted(claimed)
                continue
            except P.ProtocolError as e:
                log.error("%s", e)
                self.spool.reject(claimed)
                with contextlib.suppress(ValueError):  # answer under the file's name so a waiting client learns why
                    self.spool.respond(P.error_response(claimed.stem, "malformed_request", str(e)))
                continue
            if self.spool.request_state(msg.id) == "answered":  # already answered before a restart
                self.spool.finish(msg.id)
                continue
            if msg.kind != "generate":  # a command (run once nothing is in flight), or a cut (run at once)
                return batch, msg
            batch.append((msg, time.time()))
            if len(batch) >= limit:
                break
        return batch, None

    def run(self) -> int:
        self.set_state("starting")
        self._beat.start()
        if self.args.enable_sleep_mode and (problem := sleep_mode_problem(True)) is not None:
            log.error("--enable-sleep-mode: %s", problem)  # before the engine loads
            self.set_state("failed", f"--enable-sleep-mode: {problem}")
            return 2
        requeued = self.spool.recover()
        if requeued:
            log.info("resuming %d request(s) claimed by a previous worker: %s", len(requeued), requeued)
        try:
            self.llm = self.build_engine(self.model_dir)
        except Exception as e:  # noqa: BLE001 - any engine failure is reported in the heartbeat, then exit 2
            log.error("engine failed to start on %s:\n%s", self.model_dir, traceback.format_exc())
            self.set_state("failed", f"engine failed to start on {self.model_dir}: {e.__class__.__name__}: {e}")
            return 2
        self.set_state("ready")
        log.info("serving %s (logprobs %s, weights version %d)", self.spool.root, self.basis, self.version)
        command = None  # claimed; runs once nothing is in flight (the requests claimed before it answered)
        while True:
            self.writer.check()  # a response that could not be published fails the loop (e.g. a full disk)
            batch = []
            if command is None:
                batch, command = self.next_batch()
                if batch:
                    self.serve_generate(batch)
            if command is not None and command.kind == "cut":  # between two engine steps, not after the drain
                command, cut = None, command
                self.serve_cut(cut)
                continue
            if self.running and (command is not None or len(self.running) >= self.args.max_batch_requests):
                self.cut_ahead()  # nothing more is claimed before the drain, but a cut is served at once
            if self.running:
                self.step()
                continue
            if command is None:
                if not batch:
                    time.sleep(self.args.poll_s)
                continue
            command, pending = None, command
            if pending.kind == "sync_weights":
                self.serve_sync(pending)
            elif pending.kind == "score":
                self.serve_score(pending)
            elif pending.kind in ("sleep", "wake_up"):
                self.serve_sleep(pending)
            elif pending.kind == "shutdown":
                self.answer(P.Message("stopped", pending.id, {}))
                self.writer.flush()
                self.writer.check()
                log.info("shutdown requested")
                return 0

    def close(self, error: str | None) -> None:
        self.writer.close(timeout_s=30.0)  # the answers of a worker that stops are published first
        self._stop.set()
        self._wake.set()
        if self.state == "failed" and self.error:  # a startup failure's record is kept; a later signal appended
            self.error = f"{self.error} (then {error})" if error else self.error
        else:
            self.state, self.error = ("failed", error) if error else ("stopped", None)
        with contextlib.suppress(OSError):
            self.heartbeat()
        self.drop_engine()


def lock_spool(spool: P.Spool) -> int | None:
    """Hold worker.lock for this process's lifetime (one worker per spool); None if another worker holds it."""
    fd = os.open(spool.lock_path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by engine children (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


_PARENT_GONE: list[str] = []  # why the launcher is gone, once the watch saw it
_WORKER: list[Worker] = []


def _parent_gone(why: str) -> None:
    """Called from the parent-watch thread: record why in the log and the heartbeat, before the exit."""
    _PARENT_GONE.append(why)
    log.error("%s: exiting (releasing worker.lock)", why)
    with contextlib.suppress(OSError):
        if _WORKER:
            w = _WORKER[0]
            w._stop.set()  # no later "ready" beat over this record
            w.state, w.error = "failed", why
            w.heartbeat()
        else:
            P.Spool(_ARGS[0].spool).write_heartbeat("failed", error=why, log_path=_ARGS[0].log_path)


_ARGS: list[argparse.Namespace] = []


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    _ARGS.append(args)
    if args.parent_pid is not None:  # spawn_worker: a kill -9'd trainer must not leave this worker holding the spool
        if args.parent_fd is not None:
            os.set_inheritable(args.parent_fd, False)  # engine children need not keep the pipe
        P.exit_with_parent(args.parent_pid, args.parent_fd, args.parent_grace_s, note=_parent_gone)
    try:
        spool = P.Spool(args.spool).ensure()
    except RuntimeError as e:
        log.error("%s", e)
        return 2
    if lock_spool(spool) is None:
        log.error("another rollout worker already serves %s (its worker.lock is held); not starting", spool.root)
        return 3
    try:
        worker = Worker(args)
        _WORKER.append(worker)
    except (ValueError, RuntimeError) as e:
        log.error("%s", e)
        spool.write_heartbeat("failed", error=str(e), log_path=args.log_path)
        return 2
    return serve(worker, "worker")


def serve(worker: object, name: str) -> int:
    """``worker.run()`` (this worker's, or the fleet driver's) until it returns, a SIGTERM or a failure; then
    ``worker.close(error)`` with why it ended, for its heartbeat: the signal, the launcher gone, or the exception
    (logged as ``{name} failed``, exit 1)."""

    def on_signal(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    error = None
    try:
        return worker.run()
    except SystemExit as e:
        error = f"terminated by signal {int(e.code) - 128}" if isinstance(e.code, int) and e.code > 128 else None
        error = _PARENT_GONE[0] if _PARENT_GONE else error
        raise
    except BaseException as e:  # noqa: BLE001 - recorded in the heartbeat and the log, exit 1
        error = f"{e.__class__.__name__}: {e}"
        log.error("%s failed:\n%s", name, traceback.format_exc())
        return 1
    finally:
        worker.close(error)
        if _PARENT_GONE:  # nobody waits for the interpreter's teardown, which vLLM's threads can hold for seconds
            logging.shutdown()
            os._exit(128 + signal.SIGTERM)


if __name__ == "__main__":  # required: vLLM's multiprocess engine spawns children that re-import this file
    sys.exit(main())
