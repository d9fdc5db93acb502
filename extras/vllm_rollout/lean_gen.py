"""Lean proving generation driver (experiment P2): Goedel-Prover-V2 proof attempts with vLLM.

Writes one Generation record per sample to ``--out`` (JSONL), ``<out>.manifest.json`` (one ``sessions[]``
entry per launch) and ``<out>.skipped.jsonl`` (planned prompts that were not generated, with the reason).
Round 0 samples each problem ``--n`` times; round k >= 1 (``--corrections-from VERIF GEN ...``) builds
Goedel's self-correction prompt for every failed parent of round k - 1. Rerunning the same command resumes.

Layout: files, the sampling plan, records and the manifest live in ``lean_records.py``; the tokenizer, prompt
rendering, the vLLM engine and its generation loop in ``lean_engine.py``, which imports vLLM, transformers and torch
inside its functions (``.venv-rollout``). This file is the CLI, the plan and ``run()``'s phases. All three are
stdlib-only at import (unit-tested from the align venv).

Key decisions (see LEAN.md):
* prompts are rendered by the model's own chat template (``AutoTokenizer.apply_chat_template``), exactly as
  the reference; ``sampling.max_tokens = min(cap, max_model_len - prompt_len[, trajectory budget left])``;
  a prompt longer than 3/4 of ``max_model_len`` is skipped (the reference's filter).
* one seed per sample from (seed, problem, sample_idx, round); the cap is not part of it.
* the driver steps the engine itself (``add_request`` / ``step``) and keeps a refill window of waiting
  requests, so one long straggler never leaves the engine idle.
* exit 0 only when every planned sample exists; 143 on SIGTERM/SIGINT (the file stays resumable).
* the model repository's own code (``auto_map``) runs only with ``--trust-remote-code``; a local ``--model``
  directory puts the Hugging Face hub offline (no network wait); launched with ``--parent-pid`` (by
  ``pipeline_gen_verify.py``) it exits when its launcher does, even by kill -9.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lean_engine import build_engine, generate, load_tokenizer, prepare, versions
from lean_records import (
    NO_FEEDBACK_POLICIES,
    Manifest,
    SetupError,
    Stop,
    load_out_for_resume,
    load_problems,
    load_records,
    make_record,
    plan_corrections,
    plan_round0,
    resume_split,
    write_jsonl_atomic,
)

EXIT_OK, EXIT_INCOMPLETE, EXIT_BAD_INPUT, EXIT_LOCKED, EXIT_SIGNAL = 0, 1, 2, 75, 143
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEFAULT_LOCK = os.path.join(REPO, ".cache", "heavy_gpu.lock")
DEFAULT_MODEL = "Goedel-LM/Goedel-Prover-V2-8B"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
EXIT_CODES = f"""exit codes:
  {EXIT_OK:<4} every planned sample is in --out (manifest status "complete")
  {EXIT_INCOMPLETE:<4} some planned samples are missing: rerun the same command to resume
  {EXIT_BAD_INPUT:<4} bad input or environment (one line on stderr says what and how to fix it)
  {EXIT_LOCKED:<4} --out is being written by another launch (its .lock is held)
  {EXIT_SIGNAL:<4} stopped by SIGTERM / SIGINT or because its launcher exited; --out stays resumable"""


def hub_offline_env(model: str, tokenizer: str | None) -> dict[str, str]:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE = 1 when the model (and tokenizer) are local directories: nothing
    needs the network, and transformers would otherwise spend ~60 s retrying an unreachable hub."""
    if os.path.isdir(model) and (tokenizer is None or os.path.isdir(tokenizer)):
        return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return {}


def sha256_dir(path: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(os.path.relpath(full, path).encode() + b"\x00")
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def model_rev(model: str, adapter_sha: str | None = None) -> str:
    """``<name>@<sha12 of config + weight file names/sizes>`` for a local snapshot, the id otherwise;
    ``+lora-<sha12>`` when an un-merged adapter is served."""
    rev = model
    if os.path.isdir(model):
        h = hashlib.sha256()
        with open(os.path.join(model, "config.json"), "rb") as f:
            h.update(f.read())
        for name in sorted(os.listdir(model)):
            if name.endswith((".safetensors", ".bin")):
                h.update(f"{name}:{os.path.getsize(os.path.join(model, name))}".encode())
        rev = f"{os.path.basename(os.path.normpath(model))}@{h.hexdigest()[:12]}"
    return f"{rev}+lora-{adapter_sha[:12]}" if adapter_sha else rev


def model_max_len(model: str) -> int | None:
    cfg = os.path.join(model, "config.json")
    if not os.path.isfile(cfg):
        return None
    with open(cfg, encoding="utf-8") as f:
        c = json.load(f)
    c = c.get("text_config", c)
    return c.get("max_position_embeddings")


def resolve_max_model_len(requested: int | None, model_limit: int | None) -> int:
    if requested is None:
        if model_limit is None:
            raise ValueError(
                "--max-model-len is required when the model's config.json is not local "
                "(pass a local --model snapshot directory, or --max-model-len)"
            )
        return model_limit
    if model_limit is not None and requested > model_limit:
        raise ValueError(
            f"--max-model-len {requested} is above the model's position limit {model_limit} "
            "(max_position_embeddings); lower it"
        )
    return requested


def plan_fingerprint(args: argparse.Namespace, rev: str, max_model_len: int) -> dict:
    """What must not change between the launches that fill one --out."""
    return {
        "round": args.round,
        "n": args.n,
        "seed": args.seed,
        "cap_tokens": args.cap_tokens,
        "max_model_len": max_model_len,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "trajectory_cap_tokens": args.trajectory_cap_tokens,
        "model_rev": rev,
        "no_feedback_policy": args.no_feedback_policy,
        "repair_solved": args.repair_solved,
    }


def acquire_lock(path: str, wait: bool, what: str, stop: Stop | None = None):
    """flock ``path`` (fd returned, held until exit). Held by another: RuntimeError, or with ``wait`` poll until it
    is free; a signal (``stop``) ends the wait with None, so SIGTERM / a dead launcher exit cleanly."""
    import fcntl

    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if not wait:
            os.close(fd)
            raise RuntimeError(f"{what} {path} is held by another launch ({holder or 'unknown holder'})") from None
        print(f"lean_gen: waiting for {what} {path} (held by {holder})", file=sys.stderr, flush=True)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stop is not None and stop.signum is not None:
                    os.close(fd)
                    return None
                time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
    return fd


# --- CLI ---------------------------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option's help; the description and the exit-code epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lean_gen.py",
        description=__doc__.split("\n")[0] + "\n\nRun it with .venv-rollout/bin/python (vllm, transformers).",
        epilog=EXIT_CODES,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--problems", required=True, help="JSONL with lean4_code and name / problem_id")
    p.add_argument("--out", required=True, help="Generation record JSONL (resumed when it exists)")
    p.add_argument("--n", type=int, default=1, help="samples per problem (round 0) or per failed parent")
    p.add_argument("--cap-tokens", type=int, required=True, help="completion-token cap, the label of every number")
    p.add_argument("--round", type=int, default=0, help="0: initial proofs; k >= 1: corrections of round k-1")
    p.add_argument(
        "--corrections-from",
        nargs=2,
        action="append",
        metavar=("VERIF", "GEN"),
        default=[],
        help="verification JSONL and the Generation JSONL it verified; repeat for every earlier round",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed; each sample's seed derives from it (resume-stable)")
    p.add_argument(
        "--model",
        default=os.environ.get("ALIGN_LEAN_MODEL", DEFAULT_MODEL),
        help="local HF snapshot directory (or a hub id, which needs network); env ALIGN_LEAN_MODEL sets the default",
    )
    p.add_argument("--tokenizer", default=None, help="defaults to --model")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run Python code shipped in the model/tokenizer repo (auto_map); only for repos you trust",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--max-model-len", type=int, default=None, help="defaults to the model's position limit")
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences the engine runs at once")
    p.add_argument("--refill-window", type=int, default=None, help="requests kept in the engine (2 x max-num-seqs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90, help="vLLM's share of GPU memory")
    p.add_argument("--dtype", default="auto", help="vLLM dtype: auto | bfloat16 | float16 | float32")
    p.add_argument(
        "--enforce-eager", action=argparse.BooleanOptionalAction, default=False, help="no CUDA graphs (faster start)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold")
    p.add_argument("--trajectory-cap-tokens", type=int, default=None, help="class-B cumulative completion-token cap")
    p.add_argument(
        "--no-feedback-policy",
        choices=NO_FEEDBACK_POLICIES,
        default="skip",
        help="failed parents without compiler errors: skip (counted), resample their prompt, or goedel "
        "(correction prompt with an empty error message, as the reference)",
    )
    p.add_argument(
        "--repair-solved", action="store_true", help="also correct problems that already have an accepted sample"
    )
    p.add_argument("--lora-adapter", default=None, help="PEFT adapter dir served un-merged (vLLM LoRARequest)")
    p.add_argument("--lora-name", default="adapter", help="the adapter's name in vLLM")
    p.add_argument("--wait-lock", action="store_true", help="wait for the heavy-GPU lock (flock) before loading")
    p.add_argument(
        "--lock-file", default=os.environ.get("ALIGN_HEAVY_LOCK", DEFAULT_LOCK), help="the heavy-GPU lock (--wait-lock)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="plan + prompts only (<out>.dry_run.jsonl); no engine, no lock"
    )
    p.add_argument("--parent-pid", type=int, default=None, help="exit (143) when this process exits, even by kill -9")
    p.add_argument("--parent-fd", type=int, default=None, help="read end of a pipe the launcher holds open")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.n < 1 or a.cap_tokens < 1:
        p.error("--n and --cap-tokens must be >= 1")
    if a.round == 0 and a.corrections_from:
        p.error("--corrections-from needs --round >= 1")
    if a.round > 0 and not a.corrections_from:
        p.error(f"--round {a.round} needs --corrections-from VERIF GEN")
    return a


def plan(args) -> tuple[list[dict], list[dict]]:
    problems, skips = load_problems(args.problems)
    if args.round == 0:
        return plan_round0(problems, args.n, args.seed), skips
    pairs = []
    for verif, gen in args.corrections_from:
        pairs.append((load_records(verif, "verif")[0], load_records(gen, "gen")[0]))
    items, more = plan_corrections(
        problems,
        args.round,
        args.n,
        args.seed,
        pairs,
        args.no_feedback_policy,
        args.repair_solved,
        args.trajectory_cap_tokens,
    )
    return items, skips + more


def watch_launcher(args) -> None:
    """With --parent-pid: SIGTERM this process (-> exit 143, resumable) when the launcher exits, even by kill -9;
    SIGKILL its process group if it has not exited 10 s later (stuck loading the engine)."""
    if args.parent_pid is None:
        return
    sys.path.insert(0, REPO)
    from align.rollout.protocol import exit_with_parent  # stdlib only

    if args.parent_fd is not None:
        os.set_inheritable(args.parent_fd, False)

    def note(why: str) -> None:
        print(f"lean_gen: {why}; stopping (--out stays resumable)", file=sys.stderr, flush=True)

    exit_with_parent(args.parent_pid, args.parent_fd, grace_s=10.0, note=note)


# --- run(), phase by phase ---------------------------------------------------------------------------------------------


def load_adapter(args: argparse.Namespace) -> dict | None:
    """The --lora-adapter served un-merged: name, path, sha256 of its files, rank, and vLLM's max_lora_rank."""
    if not args.lora_adapter:
        return None
    with open(os.path.join(args.lora_adapter, "adapter_config.json"), encoding="utf-8") as f:
        r = int(json.load(f).get("r", 16))
    sha = sha256_dir(args.lora_adapter)
    return {
        "name": args.lora_name,
        "path": os.path.abspath(args.lora_adapter),
        "sha256": sha,
        "r": r,
        "max_lora_rank": next(x for x in LORA_RANKS if x >= r),
    }


def render_prompts(args: argparse.Namespace, items: list[dict], max_model_len: int) -> tuple[list[dict], list[dict]]:
    """The planned prompts rendered and tokenized by the model's tokenizer, with token budgets; (ready, skips)."""
    for key, value in hub_offline_env(args.model, args.tokenizer).items():  # before transformers / vllm import
        os.environ.setdefault(key, value)  # an explicit setting wins
    return prepare(items, load_tokenizer(args), args, max_model_len)


def write_dry_run(args: argparse.Namespace, ready: list[dict], skips: list[dict]) -> int:
    """--dry-run: the rendered plan and the skips to ``<out>.dry_run.jsonl``; nothing else is written."""
    write_jsonl_atomic(
        args.out + ".dry_run.jsonl",
        [
            {k: it[k] for k in ("sample_id", "problem_id", "round", "parent_id", "seed", "messages", "prompt_text")}
            | {"prompt_tokens": len(it["prompt_ids"]), **it["budget"]}
            for it in ready
        ]
        + [{"skipped": s} for s in skips],
    )
    print(f"dry-run: {len(ready)} planned samples, {len(skips)} skipped -> {args.out}.dry_run.jsonl")
    return EXIT_OK


def resume(args: argparse.Namespace, ready: list[dict]) -> tuple[list[dict], set[str]]:
    """(todo, done ids) against the records already in --out, read without changing it (``commit_resume``
    repairs it once the launch's checks passed)."""
    existing = load_out_for_resume(args.out, fix=False) if os.path.exists(args.out) else []
    return resume_split(ready, existing)


def commit_resume(args: argparse.Namespace, skips: list[dict]) -> None:
    """The launch's checks passed (the engine is up, or nothing needs one): repair --out (a cut last line dropped,
    a newline after a complete one, repeats removed), create it and write ``<out>.skipped.jsonl``."""
    if os.path.exists(args.out):
        load_out_for_resume(args.out)
    write_jsonl_atomic(args.out + ".skipped.jsonl", skips)
    open(args.out, "a").close()  # an empty --out means "nothing to generate", never "not run"


def new_session(
    args: argparse.Namespace,
    manifest: Manifest,
    rev: str,
    adapter: dict | None,
    ready: list[dict],
    done: set[str],
    todo: list[dict],
    skips: list[dict],
) -> dict:
    """This launch's ``sessions[]`` entry as it begins (the end adds timings, stats, status and exit code)."""
    return {
        "index": len(manifest.sessions),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": "running",
        "args": vars(args),
        "model": args.model,
        "model_rev": rev,
        "adapter": adapter,
        "versions": versions(),
        "planned": len(ready),
        "done_before": len(done),
        "todo": len(todo),
        "skipped": len(skips),
        "skip_reasons": _count(s["reason"] for s in skips),
    }


def start_engine(args: argparse.Namespace, sess: dict, stop: Stop, max_model_len: int, adapter: dict | None):
    """The vLLM engine (after the heavy-GPU lock with --wait-lock), or None when a signal came first; its load
    time and KV-cache blocks go to ``sess``."""
    heavy = acquire_lock(args.lock_file, True, "heavy-GPU lock", stop) if args.wait_lock else None  # noqa: F841
    t0 = time.monotonic()
    llm = None if stop.signum else build_engine(args, max_model_len, adapter)
    sess["load_wall_s"] = round(time.monotonic() - t0, 2)
    if llm is not None:
        cfg = llm.llm_engine.vllm_config.cache_config
        sess["kv_blocks"] = {"num_gpu_blocks": cfg.num_gpu_blocks, "block_size": cfg.block_size}
    return llm


def sample(args: argparse.Namespace, llm, todo: list[dict], sess: dict, stop: Stop, rev: str, adapter: dict | None):
    """Generate ``todo`` on ``llm``, appending one Generation record per sample to --out; stats go to ``sess``."""
    sampling = {"n": 1, "temperature": args.temperature, "top_p": args.top_p, "top_k": None}

    def make(it, ids, text, finish):
        return make_record(
            it,
            prompt_ids=it["prompt_ids"],
            completion_ids=ids,
            completion_text=text,
            finish_reason=finish,
            budget=it["budget"],
            cap_tokens=args.cap_tokens,
            sampling=sampling,
            model_rev=rev,
            adapter=adapter,
            trajectory_cap=args.trajectory_cap_tokens,
            session=sess["index"],
        )

    t1 = time.monotonic()
    with open(args.out, "a", encoding="utf-8") as out_f:
        sess.update(generate(llm, todo, args, out_f, stop, make))
    sess["generate_wall_s"] = round(time.monotonic() - t1, 2)
    sess["tok_per_s"] = round(sess["completion_tokens"] / max(sess["generate_wall_s"], 1e-9), 1)


def tally(args: argparse.Namespace, ready: list[dict], sess: dict, manifest: Manifest, stop: Stop) -> int:
    """Count the distinct planned samples in --out (never lines): the session's status and the exit code."""
    planned_ids = {it["sample_id"] for it in ready}
    written = load_out_for_resume(args.out) if os.path.exists(args.out) else []
    n_done = len({r["sample_id"] for r in written} & planned_ids)
    complete = n_done == len(ready)
    code = EXIT_SIGNAL if stop.signum else (EXIT_OK if complete else EXIT_INCOMPLETE)
    sess["status"] = "interrupted" if stop.signum else ("complete" if complete else "incomplete")
    manifest.set_done(n_done, complete)
    return code


def run(args: argparse.Namespace) -> int:
    """One launch: plan and render; then (unless --dry-run) resume, generate what is missing, record the session."""
    stop = Stop()
    stop.install()
    watch_launcher(args)
    out_lock = None if args.dry_run else acquire_lock(args.out + ".lock", False, "output lock")  # noqa: F841 held
    adapter = load_adapter(args)
    rev = model_rev(args.model, adapter["sha256"] if adapter else None)
    max_model_len = resolve_max_model_len(args.max_model_len, model_max_len(args.model))
    items, skips = plan(args)
    ready, fit_skips = render_prompts(args, items, max_model_len)
    skips += fit_skips
    if args.dry_run:
        return write_dry_run(args, ready, skips)
    manifest = Manifest.open(args.out, plan_fingerprint(args, rev, max_model_len))
    todo, done = resume(args, ready)
    sess = new_session(args, manifest, rev, adapter, ready, done, todo, skips)
    manifest.begin(sess, planned=len(ready), done=len(done), skipped=len(skips))
    print(
        f"lean_gen: {len(ready)} planned, {len(done)} done, {len(todo)} to generate, {len(skips)} skipped", flush=True
    )
    code = EXIT_INCOMPLETE
    try:
        # the engine is kept until run returns, as before the split
        llm = start_engine(args, sess, stop, max_model_len, adapter) if todo else None
        commit_resume(args, skips)  # nothing in --out changes before here
        if llm is not None:
            sample(args, llm, todo, sess, stop, rev, adapter)
        code = tally(args, ready, sess, manifest, stop)
    except BaseException as exc:
        sess["status"], sess["error"] = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        manifest.end(sess, code)
    return code


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        return run(args)
    except (ValueError, FileNotFoundError, SetupError) as exc:
        print(f"lean_gen: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RuntimeError as exc:
        if "lock" in str(exc):
            print(f"lean_gen: error: {exc}", file=sys.stderr)
            return EXIT_LOCKED
        raise


if __name__ == "__main__":
    raise SystemExit(main())
