"""The Lean driver's files, sampling plan and Generation records: stdlib only (``lean_gen.py`` is the CLI,
``lean_engine.py`` the engine).

Pure functions, unit-tested from the align venv (tests/test_lean_gen_contract.py): atomic JSON/JSONL files,
per-sample seeds, round-0 and self-correction plans, token budgets, resume, the trajectory ledger and the
Generation record; and what one launch holds: ``Stop`` (the signal flag), ``SetupError`` and the ``Manifest``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lean_prompts as lp

PROMPT_FIT = 0.75  # the reference drops prompts longer than max_model_len * 3/4 tokens
NO_FEEDBACK_POLICIES = ("skip", "resample", "goedel")

# --- files -------------------------------------------------------------------------------------------------------------


def read_jsonl(path: str, repair_tail: bool = False, fix: bool = True) -> list[dict]:
    """Read a JSONL file; a bad line raises ``ValueError`` naming it. With ``repair_tail`` an unterminated
    last line is read as a record when it parses as a JSON object (only its newline is missing: one is appended),
    else it is a write cut by a kill and is dropped from the file: that sample is generated again. ``fix=False``
    reads the same rows and leaves the file as it is (lean_gen before the launch's checks pass)."""
    return [row for _, row in read_jsonl_numbered(path, repair_tail, fix)]


def _parses_as_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return False


def read_jsonl_numbered(path: str, repair_tail: bool = False, fix: bool = True) -> list[tuple[int, dict]]:
    """``read_jsonl`` with each row's 1-based line number (for errors that name ``file:line``)."""
    with open(path, "rb") as f:
        data = f.read()
    if repair_tail and data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        if _parses_as_object(data[keep:]):  # a complete record that merely lacks its newline: kept
            if fix:
                with open(path, "ab") as f:
                    f.write(b"\n")
        else:
            if fix:
                print(f"lean_gen: dropping an unterminated last line of {path} ({len(data) - keep} bytes)",
                      file=sys.stderr)  # fmt: skip
                with open(path, "r+b") as f:
                    f.truncate(keep)
            data = data[:keep]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_no = data[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line_no}: not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as UTF-8"
        ) from None
    rows = []
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg}); fix or remove the line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")  # noqa: TRY004 bad file
        rows.append((i, row))
    return rows


# --- Generation / Verification records read back: types checked, duplicates resolved or refused -------------------

# field -> (accepted JSON types, required); bool is never an int here and an int never a bool
RECORD_FIELDS = {
    "gen": {
        "sample_id": ((str,), True),
        "problem_id": ((str,), True),
        "round": ((int,), True),
        "parent_id": ((str, type(None)), False),
        "messages": ((list,), False),
        "completion_text": ((str,), False),
        "completion_tokens": ((int,), False),
        "trajectory": ((dict,), False),
    },
    "verif": {
        "sample_id": ((str,), True),
        "problem_id": ((str,), True),
        "accepted": ((bool,), True),
        "round": ((int,), False),
        "repl_errors": ((list, type(None)), False),
        "repl_code": ((str, type(None)), False),
    },
}
# two records of one sample_id that differ in any of these are a conflict (timings and sessions may differ)
CONFLICT_KEYS = {
    "gen": ("problem_id", "round", "parent_id", "messages", "completion_text", "trajectory"),
    "verif": ("problem_id", "accepted", "repl_errors", "repl_code"),
}


def record_problem(row: dict, kind: str) -> str | None:
    """Why ``row`` is not a valid ``kind`` ('gen' | 'verif') record, or None."""
    for key, (types, required) in RECORD_FIELDS[kind].items():
        if key not in row:
            if required:
                return f"no {key!r} field"
            continue
        v = row[key]
        empty_id = key.endswith("_id") and v == ""
        if (isinstance(v, bool) and bool not in types) or not isinstance(v, types) or empty_id:
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            return f"{key!r} is {json.dumps(v)[:60]} ({type(v).__name__}), expected {want}"
    return None


def _conflict(a: dict, b: dict, kind: str) -> list[str]:
    return [k for k in CONFLICT_KEYS[kind] if a.get(k) != b.get(k)]


def load_records(
    path: str, kind: str, repair_tail: bool = False, keep_first: bool = False, fix: bool = True
) -> tuple[list[dict], int]:
    """The ``kind`` records of JSONL ``path``, type-checked (errors name ``file:line``), one per sample_id.

    A repeated sample_id that agrees with the first on ``CONFLICT_KEYS`` is dropped (the first is kept);
    one that disagrees raises ``ValueError`` naming both lines, unless ``keep_first`` (lean_gen's own --out,
    where a repeat is the same sample generated twice; ``fix``: see ``read_jsonl``). Returns (records, repeats
    dropped)."""
    first: dict[str, tuple[int, dict]] = {}
    dropped = 0
    for i, row in read_jsonl_numbered(path, repair_tail, fix):
        why = record_problem(row, kind)
        if why is not None:
            raise ValueError(f"{path}:{i}: not a valid {kind} record: {why}; fix or remove the line")
        sid = row["sample_id"]
        if sid in first:
            j, kept = first[sid]
            diff = _conflict(kept, row, kind)
            if diff and not keep_first:
                raise ValueError(
                    f"{path}:{i}: sample_id {sid!r} repeats line {j} with different {', '.join(diff)}; "
                    "keep the right one and remove the other"
                )
            dropped += 1
            continue
        first[sid] = (i, row)
    return [row for _, row in first.values()], dropped


def load_out_for_resume(path: str, fix: bool = True) -> list[dict]:
    """lean_gen's own --out before a resume: a cut last line is dropped, a repeated sample (a rerun that wrote it
    twice) keeps its first complete record and the file is rewritten atomically without the repeats. ``fix=False``:
    the same rows, the file untouched (read before the launch's checks; ``fix=True`` once they passed)."""
    rows, dropped = load_records(path, "gen", repair_tail=True, keep_first=True, fix=fix)
    if dropped and fix:
        print(f"lean_gen: {path}: dropping {dropped} repeated record(s), keeping each sample's first", file=sys.stderr)
        write_jsonl_atomic(path, rows)
    return rows


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_jsonl_atomic(path: str, rows: list[dict]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    os.replace(tmp, path)


def load_problems(path: str) -> tuple[dict[str, dict], list[dict]]:
    """Problems by id (``origin_problem_id`` / ``problem_id`` / ``name``, as the reference) plus counted skips:
    rows without ``lean4_code`` (the reference skips them) and rows without ``:= by`` (never guessed)."""
    problems, skips = {}, []
    for i, row in enumerate(read_jsonl(path), 1):
        pid = row.get("origin_problem_id", row.get("problem_id", row.get("name")))
        if not isinstance(pid, str) or not pid:
            raise ValueError(f"{path}:{i}: no problem id (origin_problem_id / problem_id / name)")
        if pid in problems:
            raise ValueError(f"{path}:{i}: duplicate problem id {pid!r}")
        code = row.get("lean4_code")
        if not code:
            skips.append({"problem_id": pid, "reason": "no_lean4_code"})
        elif not isinstance(code, str):
            raise ValueError(f"{path}:{i}: lean4_code of {pid!r} is {type(code).__name__}, expected a string")
        elif not lp.has_by_marker(code):
            skips.append({"problem_id": pid, "reason": "no_by_marker", "detail": "lean4_code has no ':= by'"})
        else:
            problems[pid] = {"problem_id": pid, "lean4_code": lp.formal_statement(code)}
    if not problems and not skips:
        raise ValueError(f"{path}: no problems")
    return problems, skips


# --- planning ----------------------------------------------------------------------------------------------------------


def derive_seed(seed: int, problem_id: str, sample_idx: int, round_k: int) -> int:
    """Per-sample sampling seed from (seed, problem, sample_idx, round): stable across resumes and caps."""
    h = hashlib.sha256(f"{seed}\x00{problem_id}\x00{sample_idx}\x00{round_k}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


def _item(
    problem: dict,
    round_k: int,
    sample_idx: int,
    seed: int,
    sample_id: str,
    messages: list[dict],
    parent: dict | None,
    lineage: list[str],
    ancestor_tokens: int,
    lineage_state: str,
    kind: str,
) -> dict:
    return {
        "sample_id": sample_id,
        "problem_id": problem["problem_id"],
        "round": round_k,
        "sample_idx": sample_idx,
        "seed": derive_seed(seed, problem["problem_id"], sample_idx, round_k),
        "kind": kind,
        "parent_id": parent["sample_id"] if parent else None,
        "lean4_code": problem["lean4_code"],
        "messages": messages,
        "lineage": lineage,
        "ancestor_tokens": ancestor_tokens,
        "lineage_state": lineage_state,
    }


def plan_round0(problems: dict[str, dict], n: int, seed: int) -> list[dict]:
    return [
        _item(
            p,
            0,
            i,
            seed,
            f"{pid}_g{i}",
            lp.initial_messages(p["lean4_code"]),
            None,
            [f"{pid}_g{i}"],
            0,
            "complete",
            "initial",
        )
        for pid, p in problems.items()
        for i in range(n)
    ]


def plan_corrections(
    problems: dict[str, dict],
    round_k: int,
    n: int,
    seed: int,
    pairs: list[tuple[list[dict], list[dict]]],
    policy: str = "skip",
    repair_solved: bool = False,
    trajectory_cap: int | None = None,
) -> tuple[list[dict], list[dict]]:
    """Children of the failed round ``k - 1`` samples found in the VERIF/GEN pairs; returns (items, skips)."""
    if round_k < 1:
        raise ValueError(f"--corrections-from needs --round >= 1, got {round_k}")
    if policy not in NO_FEEDBACK_POLICIES:
        raise ValueError(f"--no-feedback-policy must be one of {NO_FEEDBACK_POLICIES}, got {policy!r}")
    gen = _unique((r for _, g in pairs for r in g), "gen")
    verif = _unique((v for vs, _ in pairs for v in vs), "verif")
    missing = sorted(set(verif) - set(gen))
    if verif and len(missing) == len(verif):
        raise ValueError(
            "none of the verification records' sample_ids are in the GEN files given with them; "
            "pass each VERIF with the GEN file it verified (--corrections-from VERIF GEN)"
        )
    skips = [{"parent_id": s, "reason": "parent_not_found"} for s in missing]
    solved = {v["problem_id"] for v in verif.values() if v.get("accepted")}
    parents = sorted((r for r in gen.values() if r.get("round") == round_k - 1), key=lambda r: r["sample_id"])
    children: list[tuple[dict, dict, list[dict], str]] = []
    for par in parents:
        pid, sid = par["problem_id"], par["sample_id"]
        v = verif.get(sid)
        skip = None
        if v is None:
            skip = "not_verified"
        elif v.get("accepted"):
            continue
        elif pid in solved and not repair_solved:
            skip = "solved"
        elif pid not in problems:
            skip = "problem_not_in_problems_file"
        elif v.get("repl_errors") is None or not isinstance(v.get("repl_code"), str):
            skip = "no_repl_errors"
        if skip:
            skips.append({"parent_id": sid, "problem_id": pid, "reason": skip})
            continue
        kind, messages = "correction", None
        if not v["repl_errors"]:
            if policy == "skip":
                skips.append({"parent_id": sid, "problem_id": pid, "reason": "skipped_no_feedback"})
                continue
            if policy == "resample":
                kind, messages = "resample", [dict(m) for m in par["messages"]]
        if messages is None:
            try:
                err = lp.get_error_str(v["repl_code"], v["repl_errors"])
            except (ValueError, KeyError, TypeError) as exc:
                skips.append({"parent_id": sid, "problem_id": pid, "reason": "bad_repl_errors", "detail": str(exc)})
                continue
            messages = lp.correction_messages(par["messages"], par["completion_text"], err, round_k)
        children.append((par, problems[pid], messages, kind))
    items, per_problem = [], {}
    for par, prob, messages, kind in children:
        traj = par.get("trajectory") or {}
        lineage = list(traj.get("lineage") or [par["sample_id"]])
        state = "complete" if traj and all(a in gen for a in lineage) else "partial"
        if state == "partial" and trajectory_cap is not None:
            raise ValueError(
                f"lineage of {par['sample_id']} is partial (ancestors {lineage} not all in the GEN "
                "files); with --trajectory-cap-tokens pass every earlier round's VERIF GEN pair"
            )
        ancestors = int(traj.get("cumulative_completion_tokens", par.get("completion_tokens", 0)))
        for i in range(n):
            idx = per_problem.get(prob["problem_id"], 0)
            per_problem[prob["problem_id"]] = idx + 1
            sid = f"{par['sample_id']}_corr{round_k}_g{i}"
            items.append(_item(prob, round_k, idx, seed, sid, messages, par, lineage + [sid], ancestors, state, kind))
    return items, skips


def _unique(rows, kind: str) -> dict[str, dict]:
    """Records by sample_id: each type-checked; a repeat must agree with the first (else ValueError naming it)."""
    out: dict[str, dict] = {}
    for r in rows:
        why = record_problem(r, kind)
        if why is not None:
            raise ValueError(f"a {kind} record ({str(r.get('sample_id'))[:80]}) is not valid: {why}")
        kept = out.setdefault(r["sample_id"], r)
        diff = _conflict(kept, r, kind)
        if diff:
            raise ValueError(
                f"sample_id {r['sample_id']!r} appears twice in the --corrections-from {kind} files with different "
                f"{', '.join(diff)}; pass each round's files once"
            )
    return out


def token_budget(
    cap: int, max_model_len: int, prompt_len: int, ancestor_tokens: int = 0, trajectory_cap: int | None = None
) -> dict | None:
    """``sampling.max_tokens`` and why it is below the cap; ``None`` when the prompt does not fit."""
    if prompt_len > max_model_len * PROMPT_FIT:
        return None
    window = min(cap, max_model_len - prompt_len)
    max_tokens = window
    if trajectory_cap is not None:
        left = trajectory_cap - ancestor_tokens
        if left < 1:
            return None
        max_tokens = min(window, left)
    return {
        "max_tokens": max_tokens,
        "context_clipped": max_model_len - prompt_len < cap,
        "budget_clipped": max_tokens < window,
    }


def resume_split(planned: list[dict], existing: list[dict]) -> tuple[list[dict], set[str]]:
    """(todo items, done ids). A record that is not in the plan means the output was made by another plan."""
    ids = {it["sample_id"] for it in planned}
    done = {r["sample_id"] for r in existing}
    extra = sorted(done - ids)
    if extra:
        raise ValueError(
            f"{len(extra)} records in --out are not in this plan (e.g. {extra[0]!r}); "
            "the output was made with other inputs: use a new --out"
        )
    return [it for it in planned if it["sample_id"] not in done], done


def build_trajectory_ledger(gen_records: list[dict], verif_records: list[dict]) -> dict[str, dict]:
    """Final state per root (round-0 sample): rounds, samples, tokens, and whether a descendant was accepted."""
    accepted = {v["sample_id"] for v in verif_records if v.get("accepted")}
    verified = {v["sample_id"] for v in verif_records}
    roots: dict[str, dict] = {}
    for r in sorted(gen_records, key=lambda r: (r["round"], r["sample_id"])):
        t = r["trajectory"]
        e = roots.setdefault(
            t["root_id"],
            {
                "root_id": t["root_id"],
                "problem_id": r["problem_id"],
                "samples": 0,
                "max_round": 0,
                "max_cumulative_tokens": 0,
                "truncated": 0,
                "budget_clipped": 0,
                "solved_round": None,
                "lineage_state": "complete",
            },
        )
        e["samples"] += 1
        e["max_round"] = max(e["max_round"], r["round"])
        e["max_cumulative_tokens"] = max(e["max_cumulative_tokens"], t["cumulative_completion_tokens"])
        e["truncated"] += bool(t["truncated"])
        e["budget_clipped"] += bool(t["budget_clipped"])
        if t["lineage_state"] != "complete":
            e["lineage_state"] = "partial"
        if r["sample_id"] in accepted and e["solved_round"] is None:
            e["solved_round"] = r["round"]
        e.setdefault("_ids", []).append(r["sample_id"])
    for e in roots.values():
        ids = e.pop("_ids")
        e["state"] = (
            "solved"
            if e["solved_round"] is not None
            else "unverified"
            if any(i not in verified for i in ids)
            else "failed"
        )
    return roots


def make_record(
    item: dict,
    *,
    prompt_ids: list[int],
    completion_ids: list[int],
    completion_text: str,
    finish_reason: str | None,
    budget: dict,
    cap_tokens: int,
    sampling: dict,
    model_rev: str,
    adapter: dict | None,
    trajectory_cap: int | None,
    session: int,
) -> dict:
    code, code_err = lp.full_code(item["lean4_code"], completion_text)
    cumulative = item["ancestor_tokens"] + len(completion_ids)
    return {
        "sample_id": item["sample_id"],
        "problem_id": item["problem_id"],
        "round": item["round"],
        "sample_idx": item["sample_idx"],
        "parent_id": item["parent_id"],
        "kind": item["kind"],
        "model_rev": model_rev,
        "adapter": adapter,
        "cap_tokens": cap_tokens,
        "sampling": {**sampling, "max_tokens": budget["max_tokens"], "seed": item["seed"]},
        "context_clipped": budget["context_clipped"],
        "messages": item["messages"],
        "prompt_ids": prompt_ids,
        "prompt_tokens": len(prompt_ids),
        "completion_text": completion_text,
        "completion_ids": completion_ids,
        "completion_tokens": len(completion_ids),
        "finish_reason": finish_reason,
        "lean4_code": item["lean4_code"],
        "lean_code": code,
        "lean_code_error": code_err,
        "trajectory": {
            "root_id": item["lineage"][0],
            "lineage": item["lineage"],
            "round": item["round"],
            "ancestor_completion_tokens": item["ancestor_tokens"],
            "cumulative_completion_tokens": cumulative,
            "cap_tokens": trajectory_cap,
            "budget_clipped": budget["budget_clipped"],
            "truncated": finish_reason == "length",
            "lineage_state": item["lineage_state"],
        },
        "session": session,
    }


# --- a launch: signals, setup errors, the manifest ---------------------------------------------------------------------


class SetupError(Exception):
    """The environment cannot run lean_gen (missing package, unreachable model): one line, exit 2."""


class Stop:
    """SIGTERM / SIGINT set a flag; the generation loop aborts its requests and exits 143."""

    def __init__(self) -> None:
        self.signum = None

    def __call__(self, signum, frame) -> None:
        self.signum = signum

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)


class Manifest:
    """``<out>.manifest.json``: the plan fingerprint every launch that fills ``out`` must match, the status and
    counts of ``out``, and one ``sessions[]`` entry per launch (written when it begins and again when it ends)."""

    def __init__(self, out: str, plan: dict) -> None:
        self.path = out + ".manifest.json"
        self.data: dict = {"out": os.path.abspath(out), "plan": plan, "sessions": []}

    @classmethod
    def open(cls, out: str, plan: dict) -> Manifest:
        """The manifest of ``out`` (a new one when there is none); ``ValueError`` when ``out`` was made with
        another plan (the message names each setting, old and new)."""
        m = cls(out, plan)
        if os.path.exists(m.path):
            m.data = cls._read(m.path)
            if m.data.get("plan") != plan:
                old = m.data.get("plan", {})
                diff = {k: (old.get(k), v) for k, v in plan.items() if old.get(k) != v}
                raise ValueError(f"{out} was made with other settings {diff} (old, new); use a new --out")
        return m

    @staticmethod
    def _read(path: str) -> dict:
        """The manifest's JSON object; a hand-edited file (not UTF-8 JSON, not an object, ``sessions`` missing or not a
        list of objects, ``plan`` not an object) is a ``ValueError`` naming the file and the fix."""
        fix = "restore the file, or use a new --out"
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a lean_gen manifest ({e}); {fix}") from None
        if not isinstance(data, dict):
            what = f"the top level is a {type(data).__name__}, not an object"
        elif not (isinstance(data.get("sessions"), list) and all(isinstance(x, dict) for x in data["sessions"])):
            what = f"'sessions' is {data.get('sessions')!r:.80}, not a list of session objects"
        elif not isinstance(data.get("plan", {}), dict):
            what = f"'plan' is {data['plan']!r:.80}, not an object"
        else:
            return data
        raise ValueError(f"{path}: not a lean_gen manifest ({what}); {fix}")

    @property
    def sessions(self) -> list[dict]:
        return self.data["sessions"]

    def begin(self, session: dict, planned: int, done: int, skipped: int) -> None:
        """Append this launch's ``session`` (its ``index`` is ``len(self.sessions)``), mark ``out`` incomplete with
        these sample counts, and write the file."""
        self.sessions.append(session)
        self.data.update(status="incomplete", planned_samples=planned, done_samples=done, skipped=skipped)
        self.write()

    def set_done(self, done: int, complete: bool) -> None:
        """The distinct planned samples now in ``out``, and whether that is all of them (written by ``end``)."""
        self.data.update(status="complete" if complete else "incomplete", done_samples=done)

    def end(self, session: dict, exit_code: int) -> None:
        """Stamp the session's end and exit code and write the file (also after a failure)."""
        session["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        session["exit_code"] = exit_code
        self.write()

    def write(self) -> None:
        write_json_atomic(self.path, self.data)
