"""The rollout worker's commands (run once nothing is in flight): ``sync_weights`` (a committed snapshot reloaded
into the running engine, or the engine rebuilt when the architecture changed or reload fails; a committed PEFT
adapter dir loaded as a new ``LoRARequest``), ``score`` (the exact logprob of given tokens) and ``sleep`` /
``wake_up`` (vLLM's sleep mode, ``align/rollout/sleep_mode.py``: the GPU shared with the trainer); and ``cut``
(``align/rollout/cut.py``), served at once between two engine steps: the named generate requests answered with
what their rows sampled so far.

A mixin of ``rollout_worker.Worker``: it uses the worker's engine (``self.llm``), arguments, state and ``answer``.
Stdlib only at import, like the worker.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from align.rollout import protocol as P

log = logging.getLogger("rollout_worker")

UNSTARTED = "unstarted"  # a cut row the engine never started (no tokens): ``Running.outs`` entry

# config.json keys that do not change the architecture (a reload suffices when only these differ).
_NON_ARCH_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "architectures"}


def arch_of(config_path: Path) -> dict:
    """The architecture part of a config.json: what decides between a weights reload and an engine rebuild."""
    cfg = json.loads(config_path.read_text())
    return {k: v for k, v in cfg.items() if k not in _NON_ARCH_KEYS}


def snapshot_problem(path: Path) -> str | None:
    """Why ``path`` cannot be loaded as a full snapshot (not an HF checkpoint dir, or not committed), or None."""
    try:
        P.check_hf_dir(path)
    except ValueError as e:
        return str(e)
    if P.snapshot_marker(path) is None:
        return f"snapshot {path} is not committed (no {' / '.join(P.SNAPSHOT_MARKERS)} marker)"
    return None


def partial_output(engine, rid: str):
    """The output so far of engine request ``rid`` (vLLM's RequestOutput, as a finished one looks), or None when the
    engine has not taken it. vLLM 0.32's ``LLMEngine.abort_request`` drops an aborted request's state without an
    output (only ``AsyncLLM`` queues the final "abort" output), so the output is made here the way
    ``OutputProcessor.abort_requests`` makes it: from the request's state, before the abort. Its token ids and
    logprobs are the ones the output processor accumulated, the same as a finished request's."""
    from vllm.v1.engine import FinishReason

    op = engine.output_processor
    for internal in op.external_req_ids.get(rid, []):
        state = op.request_states.get(internal)
        if state is not None:
            return state.make_request_output([], None, FinishReason.ABORT, None)
    return None


def sleep_mode_problem(enabled: bool) -> str | None:
    """Why this worker's engine cannot sleep (vLLM's platform has no sleep mode, or it was not enabled), or None."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        name = getattr(current_platform, "device_name", None) or "this platform"
        return (
            f"vLLM has no sleep mode on {name} (the CPU build has none): --colocate needs a GPU worker "
            "(--rollout-gpu N, the trainer's GPU)"
        )
    if not enabled:
        return "this worker was started without --enable-sleep-mode (the trainer passes it with --colocate)"
    return None


def _free_gpu_bytes() -> int:
    import torch

    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else 0


class Commands:
    """``serve_sync``, ``serve_adapter_sync``, ``serve_score``, ``serve_cut``, ``serve_sleep``: see the module docstring."""

    def serve_sleep(self, msg: P.Message) -> None:
        """``sleep`` (``LLM.sleep(level)``) or ``wake_up`` (``LLM.wake_up()``); ``unsupported`` without sleep mode."""
        from align.rollout.sleep_mode import SLEEP_LEVELS

        problem = sleep_mode_problem(self.args.enable_sleep_mode)
        if problem is not None:
            return self.answer(P.error_response(msg.id, "unsupported", problem))
        level = msg.body.get("level")
        if msg.kind == "sleep" and level not in SLEEP_LEVELS:
            return self.answer(P.error_response(msg.id, "bad_request", f"sleep level {level!r} not in {SLEEP_LEVELS}"))
        t0, free0 = time.perf_counter(), _free_gpu_bytes()
        if msg.kind == "sleep" and not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = level
        elif msg.kind == "wake_up" and self.asleep:
            self.llm.wake_up()
            self.asleep = 0
        seconds = time.perf_counter() - t0
        if msg.kind == "sleep":
            freed = _free_gpu_bytes() - free0
            log.info("asleep (level %d) in %.2f s, %.2f GiB freed", level, seconds, freed / 2**30)
            body = {"level": int(level), "seconds": seconds, "freed_bytes": freed}
            return self.answer(P.Message("slept", msg.id, body))
        log.info("awake in %.2f s", seconds)
        return self.answer(P.Message("awake", msg.id, {"seconds": seconds}))

    def serve_sync(self, msg: P.Message) -> None:
        path, version = Path(msg.body["path"]), msg.body["version"]
        if self.asleep:  # the trainer wakes it before a sync; an attached client may not have
            self.llm.wake_up()
            self.asleep = 0
        if (path / "adapter_config.json").is_file():
            return self.serve_adapter_sync(msg, path, version)
        problem = snapshot_problem(path)
        if problem is not None:
            return self.answer(P.error_response(msg.id, "bad_snapshot", problem))
        self.set_state("busy")
        t0 = time.perf_counter()
        method = "rebuild"
        new_arch = arch_of(path / "config.json")
        same_arch = new_arch == self.arch  # never re-read the loaded snapshot: its owner may have deleted it
        if self.args.sync_mode != "rebuild" and same_arch:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
                self.reset_prefix_cache()
                method = "reload"
            except Exception as e:
                if self.args.sync_mode == "reload":
                    self.answer(P.error_response(msg.id, "sync_failed", f"reload_weights failed: {e}"))
                    raise
                log.warning("reload_weights failed (%s); rebuilding the engine", e)
        if method == "rebuild":
            self.drop_engine()
            try:
                self.llm = self.build_engine(path)
            except Exception as e:
                self.answer(P.error_response(msg.id, "sync_failed", f"engine rebuild on {path} failed: {e}"))
                raise
            self.vocab_size = int(json.loads((path / "config.json").read_text()).get("vocab_size", 0))
        seconds = time.perf_counter() - t0
        self.model_dir, self.version, self.arch = path, version, new_arch
        log.info("weights version %d from %s by %s in %.2f s", version, path, method, seconds)
        self.answer(P.Message("synced", msg.id, {"version": version, "seconds": seconds, "method": method}))
        self.set_state("ready")

    def serve_adapter_sync(self, msg: P.Message, path: Path, version: int) -> None:
        """Load a committed PEFT adapter as a new LoRARequest (a fresh id per version) and drop the previous one."""
        from vllm.lora.request import LoRARequest

        problem = None
        if not self.args.max_lora_rank:
            problem = f"{path} is a LoRA adapter but this worker was started without --max-lora-rank"
        elif P.snapshot_marker(path) is None:
            problem = f"adapter {path} is not committed (no {' / '.join(P.SNAPSHOT_MARKERS)} marker)"
        else:
            rank = json.loads((path / "adapter_config.json").read_text()).get("r", 0)
            if not isinstance(rank, int) or not 0 < rank <= self.args.max_lora_rank:
                problem = f"adapter {path} has rank {rank!r}; this worker serves ranks up to --max-lora-rank"
        if problem:
            return self.answer(P.error_response(msg.id, "bad_snapshot", problem))
        self.set_state("busy")
        t0 = time.perf_counter()
        self.lora_ids += 1
        request = LoRARequest(f"v{version}", self.lora_ids, str(path))
        try:
            self.llm.llm_engine.add_lora(request)  # load now: errors surface on the sync, not the next generate
        except Exception as e:  # noqa: BLE001 - answered; the previous adapter keeps serving
            self.answer(P.error_response(msg.id, "sync_failed", f"loading adapter {path} failed: {e}"))
            self.set_state("ready")
            return None
        old, self.lora = self.lora, request
        if old is not None and old.lora_int_id in self.llm.llm_engine.list_loras():
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        self.reset_prefix_cache()
        seconds = time.perf_counter() - t0
        self.version = version
        log.info("weights version %d: adapter %s as LoRA %d in %.2f s", version, path, request.lora_int_id, seconds)
        self.answer(P.Message("synced", msg.id, {"version": version, "seconds": seconds, "method": "lora"}))
        self.set_state("ready")
        return None

    def serve_score(self, msg: P.Message) -> None:
        """A ``score`` request (align/rollout/teacher_logprobs.py): vLLM ``prompt_logprobs=1`` on a prompt of each sequence's
        ids gives the exact logprob of every given token (the token itself is always among them, whatever the top-1);
        the one token generated per sequence is discarded."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        from align.rollout import teacher_logprobs

        problem = teacher_logprobs.score_problem(msg.body, self.vocab_size, self.args.max_model_len)
        if self.asleep:
            problem = "the engine is asleep (vLLM sleep mode): send wake_up first"
        if problem is not None:
            return self.answer(P.error_response(msg.id, "bad_request", problem))
        self.set_state("busy")
        seqs, starts = msg.body["sequences"], msg.body["starts"]
        sp = VSP(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        t0 = time.perf_counter()
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], sp, use_tqdm=False,
                                     lora_request=self.lora)  # fmt: skip
        except Exception as e:
            log.exception("engine failed on score request %s", msg.id)
            self.answer(P.error_response(msg.id, "engine_error", f"{e.__class__.__name__}: {e}"))
            self.set_state("ready")
            if "EngineDead" in e.__class__.__name__:
                raise
            return None
        lps = [[float(out.prompt_logprobs[j][s[j]].logprob) for j in range(first, len(s))]
               for out, s, first in zip(outs, seqs, starts)]  # fmt: skip
        timings = {"score_s": time.perf_counter() - t0, "tokens": sum(len(s) for s in seqs)}
        self.answer(P.Message("scores", msg.id, {"logprobs": lps, "timings": timings}))
        self.set_state("ready")
        return None

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache after a weight load: its KV was computed under the old weights, and a continuation
        of a cut completion (prompt + its ids so far) must be prefilled under the new ones. vLLM resets only when no
        request holds KV (a sync runs after the drain); a refusal is an error, never stale KV served."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight load (a request still holds KV)")

    def serve_cut(self, msg: P.Message) -> None:
        """A ``cut`` request (align/rollout/cut.py): each named generate request in flight is aborted in the engine
        and answered with its rows so far (finished rows as they finished, the rest ``cut``); one still queued in
        the spool is taken and answered with every row cut before its first token; the rest are left alone."""
        from align.rollout import cut

        problem = cut.cut_problem(msg.body)
        if problem is not None:
            return self.answer(P.error_response(msg.id, "bad_request", problem))
        engine, done, untouched = self.llm.llm_engine, [], []
        for rid in msg.body["requests"]:
            job = self.running.pop(rid, None)
            if job is None:
                job = self.take_queued(rid)
            if job is None:
                untouched.append(rid)
                continue
            left = []
            for k, out in enumerate(job.outs):
                if out is None:  # not finished: its output so far, taken before the abort drops it
                    left.append(f"{rid}:{k}")
                    self.running_seqs.pop(left[-1], None)
                    job.outs[k] = partial_output(engine, left[-1]) or UNSTARTED
                    self.finished_tokens += 0 if job.outs[k] is UNSTARTED else len(job.outs[k].outputs[0].token_ids)
            if left:
                engine.abort_request(left)
            job.left = 0
            self.answer_job(job)
            done.append(rid)
        log.info("cut %d request(s) %s; %d already answered or unknown", len(done), done, len(untouched))
        self.answer(P.Message("cut_done", msg.id, {"cut": done, "untouched": untouched}))
        if not self.running:
            self.flip_state("ready")
        return None

    def cut_ahead(self) -> None:
        """Serve the cut requests queued behind what cannot be claimed yet (a command waiting for the drain, a full
        batch); each queued file is read once for its kind."""
        queued = self.spool.pending()
        self.queued_kinds = {p.name: self.queued_kinds.get(p.name) or self._kind(p) for p in queued}
        for path in queued:
            if self.queued_kinds[path.name] != "cut" or (claimed := self.spool.claim(path)) is None:
                continue
            try:
                msg = self.spool.read(claimed)
            except P.ProtocolError as e:  # changed since it was read: the main loop's handling, in short
                log.error("%s", e)
                self.spool.reject(claimed)
                continue
            self.serve_cut(msg)

    def _kind(self, path: Path) -> str:
        try:
            return self.spool.read(path).kind
        except (OSError, P.ProtocolError):
            return "?"  # gone, or bad: the main loop deals with it when it comes to it

    def take_queued(self, rid: str):
        """A generate request ``rid`` still queued in the spool, claimed as a ``Running`` none of whose rows
        started; None when it is not queued (answered, in flight elsewhere, unknown) or not a valid generate."""
        from worker_answers import Running

        path = self.spool.requests / f"{rid}.json"
        try:
            msg = self.spool.read(path)
        except (OSError, P.ProtocolError):
            return None  # gone meanwhile, or one the main loop rejects when it comes to it
        if msg.kind != "generate" or self.spool.claim(path) is None:
            return None
        params = P.SamplingParams.from_dict(msg.body["params"])
        job = Running(msg, time.time(), params, len(msg.body["prompts"]) * params.n, self.finished_tokens)
        job.outs = [UNSTARTED] * len(job.outs)
        return job
