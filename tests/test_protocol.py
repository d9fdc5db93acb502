"""The spool protocol and the rollout clients, without vLLM (core venv, seconds).

The real worker is exercised in ``test_spool_worker.py``. Here the worker side of the protocol is
played by a thread using the same ``Spool`` calls the worker uses: this tests the client's handling of
answers, errors, dead and silent workers, which a real vLLM engine cannot be made to produce on cue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from align.rollout import protocol as P
from align.rollout import spool as S
from align.rollout.client import (
    NativeClient,
    RolloutError,
    SpoolClient,
    WorkerDiedError,
    WorkerHandle,
    make_rollout_client,
    spawn_worker,
)
from align.rollout.protocol import Completion, Message, ProtocolError, SamplingParams
from align.rollout.spool import Spool

REPO = Path(__file__).resolve().parents[1]
FAST_TIMEOUT_S = 5.0  # every client call in this file must return well within this
# the scripted worker's answer to prompts [[10, 11], [20]] with n=2: (prompt_index, sample_index, token_ids)
SCRIPTED_ANSWER = [(0, 0, [11]), (0, 1, [12]), (1, 0, [20]), (1, 1, [21])]


def _valid(tmp_path: Path) -> Path:
    msg = P.generate_request([[1, 2, 3]], SamplingParams(n=2, temperature=0.7, seed=3))
    path = tmp_path / f"{msg.id}.json"
    path.write_text(msg.to_json())
    return path


def python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter at the repo root (what a worker process sees at import)."""
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_protocol_and_client_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "import align.rollout.protocol, align.rollout.client\n"
        "assert 'torch' not in {m for m, v in sys.modules.items() if v is not None}\n"
        "print('ok')"
    )
    out = python(code)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_spool_names_stay_importable_from_protocol():
    """The worker imports only ``protocol`` (``P.Spool``, ``P.Message``): the spool's and the message module's public
    names resolve there to their own modules' objects (protocol imports both; neither imports protocol: no circle,
    tests/test_layout.py). An unknown name is still an AttributeError (negative control: not everything answers)."""
    code = (
        "import align.rollout.protocol as P\n"
        "import align.rollout.message as M\n"
        "assert (P.Message, P.SamplingParams, P.ProtocolError, P.new_id) == (M.Message, M.SamplingParams, "
        "M.ProtocolError, M.new_id)\n"
        "from align.rollout.protocol import AlreadyWaitingError, HEARTBEAT_MAX_BYTES, Spool, heartbeat_problem\n"
        "from align.rollout.protocol import read_message\n"
        "import align.rollout.spool as S\n"
        "got = (Spool, read_message, heartbeat_problem, AlreadyWaitingError, HEARTBEAT_MAX_BYTES)\n"
        "want = (S.Spool, S.read_message, S.heartbeat_problem, S.AlreadyWaitingError, S.HEARTBEAT_MAX_BYTES)\n"
        "assert all(a is b for a, b in zip(got, want, strict=True)), got\n"
        "try:\n    P.Spools\nexcept AttributeError as e:\n    print('ok', e)\n"
    )
    out = python(code)
    assert out.returncode == 0 and "ok module 'align.rollout.protocol' has no attribute 'Spools'" in out.stdout, (
        out.stderr
    )


def test_message_round_trip_keeps_every_field(tmp_path):
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, max_tokens=7, stop_token_ids=[2], seed=11)
    msg = P.generate_request([[5, 6], [7]], params)
    back = S.read_message(_write(tmp_path / "m.json", msg.to_json()))
    assert back == msg and SamplingParams.from_dict(back.body["params"]) == params
    c = Completion(1, 2, [4, 2], [-0.5, -1.0], "stop", sampled_logprobs=None, weights_version=3)
    assert Completion.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _corrupt(text: str) -> dict[str, str | bytes]:
    d = json.loads(text)
    return {
        "truncated": text[: len(text) // 2],
        "empty": "",
        "not_utf8": b"\xff\xfe{",
        "future_version": json.dumps({**d, "version": P.PROTOCOL_VERSION + 1}),
        "other_protocol": json.dumps({**d, "protocol": "something-else"}),
        "missing_id": json.dumps({k: v for k, v in d.items() if k != "id"}),
        "unknown_kind": json.dumps({**d, "kind": "launch_missiles"}),
        "empty_prompt": json.dumps({**d, "body": {**d["body"], "prompts": [[]]}}),
        "float_token": json.dumps({**d, "body": {**d["body"], "prompts": [[1.5]]}}),
        "bad_params": json.dumps({**d, "body": {**d["body"], "params": {**d["body"]["params"], "top_p": 2.0}}}),
        "unknown_param": json.dumps({**d, "body": {**d["body"], "params": {"bogus": 1}}}),
        "path_in_id": json.dumps({**d, "id": "../escape"}),
        "a_list": "[1, 2]",
    }


@pytest.mark.parametrize("defect", list(_corrupt(P.generate_request([[1]], SamplingParams()).to_json())))
def test_malformed_file_is_rejected_naming_the_file(tmp_path, defect):
    good = _valid(tmp_path)
    S.read_message(good)  # negative control: the intact file reads
    bad = _write(tmp_path / "bad.json", _corrupt(good.read_text())[defect])
    with pytest.raises(ProtocolError, match="bad.json"):
        S.read_message(bad)


def test_unknown_version_error_says_what_to_do(tmp_path):
    d = json.loads(_valid(tmp_path).read_text())
    bad = _write(tmp_path / "v9.json", json.dumps({**d, "version": 9}))
    with pytest.raises(ProtocolError, match=r"v9.json: unsupported protocol version 9 .*same align checkout"):
        S.read_message(bad)


def test_atomic_write_failure_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "out.json"

    def boom(fd):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        P.atomic_write_text(target, '{"a": 1}')
    assert not target.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    P.atomic_write_text(target, '{"a": 1}')  # control: the same call without the fault publishes
    assert json.loads(target.read_text()) == {"a": 1} and list(tmp_path.iterdir()) == [target]


_CLAIMER = """
import sys
from pathlib import Path
from align.rollout.spool import Spool
sp = Spool(sys.argv[1])
got = []
for _ in range(50):
    for p in sp.pending():
        if sp.claim(p) is not None:
            got.append(p.stem)
print("\\n".join(got))
"""


def test_claim_by_rename_is_exclusive_across_processes(tmp_path):
    sp = Spool(tmp_path / "spool").ensure()
    ids = [sp.submit(P.shutdown_request()).stem for _ in range(300)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _CLAIMER, str(sp.root)], cwd=REPO, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    claimed = [set(p.communicate(timeout=120)[0].split()) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert set.union(*claimed) == set(ids)
    assert sum(len(c) for c in claimed) == len(ids), "a message was claimed twice"


def test_responses_are_idempotent_by_request_id(tmp_path):
    sp = Spool(tmp_path).ensure()
    req = sp.submit(P.shutdown_request())
    rid = req.stem
    first = Message("synced", rid, {"version": 1, "seconds": 0.1, "method": "reload"})
    sp.respond(first)
    sp.respond(Message("synced", rid, {"version": 2, "seconds": 0.2, "method": "rebuild"}))  # a duplicate answer
    assert sp.take_response(rid).body == first.body
    assert sp.take_response(rid) is None  # taken once
    with pytest.raises(ValueError, match="already exists"):
        sp.submit(Message("shutdown", rid, {}))


def test_recover_requeues_unanswered_and_finishes_answered(tmp_path):
    sp = Spool(tmp_path).ensure()
    a, b = (sp.claim(sp.submit(P.shutdown_request())) for _ in range(2))
    sp.respond(Message("stopped", a.stem, {}))
    (sp.root / "tmp" / ".x.json.abc.tmp").write_text("{")  # a writer died mid-write
    assert sp.recover() == [b.stem]
    assert sp.request_state(a.stem) == "answered" and sp.request_state(b.stem) == "pending"
    assert list((sp.root / "tmp").iterdir()) == []


def test_unwritable_spool_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match=r"spool directory .*a_file/spool is not usable"):
        make_rollout_client("spool", spool=blocker / "spool", timeout_s=1)
    with pytest.raises(RuntimeError, match="not usable"):
        spawn_worker(blocker / "spool", model=_fake_model_dir(tmp_path), venv=sys.prefix)
    assert blocker.read_text() == "not a directory"


def _fake_model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return d


def test_spawn_worker_bad_inputs_start_nothing(tmp_path):
    model = _fake_model_dir(tmp_path)
    with pytest.raises(RuntimeError, match=r"rollout venv missing: .*bash scripts/setup_rollout_venv.sh"):
        spawn_worker(tmp_path / "spool", model=model, venv=tmp_path / "no-venv")
    (model / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        spawn_worker(tmp_path / "spool", model=model, venv=sys.prefix)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"model.safetensors is not a valid safetensors file"):
        spawn_worker(tmp_path / "spool", model=model, venv=sys.prefix)
    with pytest.raises(ValueError, match="does not exist"):
        spawn_worker(tmp_path / "spool", model=tmp_path / "nowhere", venv=sys.prefix)
    (model / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        spawn_worker(tmp_path / "spool", model=model, venv=sys.prefix)
    assert not (tmp_path / "spool" / "worker.log").exists()


def test_make_rollout_client_names_the_backends():
    with pytest.raises(ValueError, match=r"unknown rollout backend 'vllm'.*native.*spool"):
        make_rollout_client("vllm")


def test_worker_env_scrubs_torchrun_and_pins_caches(tmp_path):
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "PYTHONPATH": "/x", "HOME": "/h"}
    env = P.worker_env(base, gpu=3, cache_dir=tmp_path, in_process=True)
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT", "PYTHONPATH"} & set(env) and env["HOME"] == "/h"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path)) and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in P.worker_env(base)


def test_worker_env_keeps_omp_threads_and_defaults_a_cpu_worker_to_one():
    """A CPU worker without OMP_NUM_THREADS oversubscribed the cores (a 1-token request: 147 ms instead of 43 ms)."""
    assert P.worker_env({"OMP_NUM_THREADS": "4", "RANK": "0"})["OMP_NUM_THREADS"] == "4"
    assert P.worker_env({})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in P.worker_env({}, gpu=0)  # a GPU worker keeps the OpenMP default


def test_logprob_basis_warning():
    hot = SamplingParams(temperature=0.7)
    assert "--logprobs-mode processed" in P.logprob_basis_warning("raw", hot)
    assert P.logprob_basis_warning("raw", SamplingParams(temperature=1.0)) is None
    assert P.logprob_basis_warning("processed", hot) is None
    assert "truncated" in P.logprob_basis_warning("processed", SamplingParams(top_p=0.9))
    assert P.logprob_basis_warning("training", SamplingParams(temperature=0.7, top_k=3)) is None
    with pytest.raises(ValueError, match="unknown logprob basis"):
        P.logprob_basis_warning("bogus", hot)


def test_heartbeat_problem(tmp_path):
    sp = Spool(tmp_path).ensure()
    assert S.heartbeat_problem(None, 1.0) is None  # not started yet: tolerated (the call's timeout bounds it)
    sp.write_heartbeat("ready")
    hb = sp.read_heartbeat()
    assert S.heartbeat_problem(hb, 5.0) is None
    assert "stopped heart-beating" in S.heartbeat_problem(hb, 5.0, now=hb["time"] + 6)
    assert "is stopped" in S.heartbeat_problem({**hb, "state": "stopped"}, 5.0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert "is gone" in S.heartbeat_problem({**hb, "pid": gone.pid}, 5.0)


# ---------------------------------------------------------------------------------------------
# SpoolClient against a scripted worker (the real one: test_spool_worker.py)


class ScriptedWorker(threading.Thread):
    """Plays the worker side of the protocol with the worker's own Spool calls."""

    def __init__(self, root: Path, answer, heartbeat: bool = True, **info: object) -> None:
        super().__init__(daemon=True)
        self.info = {"logprob_basis": "raw", **info}
        self.sp, self.answer, self.heartbeat = Spool(root).ensure(), answer, heartbeat
        self.stop = threading.Event()
        self.served: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            if self.heartbeat:
                self.sp.write_heartbeat("ready", **self.info)
            for path in self.sp.pending():
                claimed = self.sp.claim(path)
                if claimed is None:
                    continue
                msg = self.sp.read(claimed)
                reply = self.answer(msg)
                if reply is not None:
                    self.served.append(msg.id)  # before the answer: a client may read `served` once answered
                    self.sp.respond(reply)
                    self.sp.finish(msg.id)
            time.sleep(0.01)


def _echo(msg: Message) -> Message:
    if msg.kind == "generate":
        params = SamplingParams.from_dict(msg.body["params"])
        comps = [
            Completion(i, j, [p[-1] + j], [-1.0], "length", weights_version=7).to_dict()
            for i, p in enumerate(msg.body["prompts"])
            for j in range(params.n)
        ]
        return Message(
            "completions", msg.id, {"completions": comps, "weights_version": 7, "logprob_basis": "raw", "timings": {}}
        )
    if msg.kind == "sync_weights":
        return Message("synced", msg.id, {"version": msg.body["version"], "seconds": 0.5, "method": "reload"})
    return P.error_response(msg.id, "bad_request", "prompt of 9 tokens + max_tokens 8 exceeds max_model_len 16")


@pytest.fixture
def scripted(tmp_path):
    workers = []

    def start(answer=_echo, heartbeat=True, **info):
        w = ScriptedWorker(tmp_path / "spool", answer, heartbeat, **info)
        w.start()
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop.set()
        w.join(timeout=5)


def test_spool_client_generate_and_sync(tmp_path, scripted):
    scripted()
    client = make_rollout_client("spool", spool=tmp_path / "spool", timeout_s=FAST_TIMEOUT_S)
    out = client.generate([[10, 11], [20]], SamplingParams(n=2))
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in out] == SCRIPTED_ANSWER
    assert client.logprob_basis == "raw" and client.weights_version == 7
    snap = _fake_model_dir(tmp_path)
    with pytest.raises(ValueError, match="not committed"):
        client.sync_weights(snap, 8)
    (snap / ".complete").write_text("{}")
    assert client.sync_weights(snap, 8) == 0.5 and client.weights_version == 8


def test_spool_client_raises_worker_errors(tmp_path, scripted):
    scripted(answer=lambda m: _echo(m) if m.kind != "generate" else P.error_response(m.id, "bad_request", "too long"))
    client = SpoolClient(tmp_path / "spool", timeout_s=FAST_TIMEOUT_S)
    with pytest.raises(RolloutError, match=r"rejected request .*bad_request: too long"):
        client.generate([[1]], SamplingParams())


def test_dead_worker_is_detected_with_log_tail_and_request_resumes(tmp_path, scripted):
    sp = Spool(tmp_path / "spool").ensure()
    log = tmp_path / "worker.log"
    log.write_text("loading model\nSegmentation fault (core dumped)\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    hb = {"protocol": P.PROTOCOL, "version": 1, "kind": "heartbeat", "state": "busy", "pid": gone.pid}
    hb.update(host=os.uname().nodename, time=time.time(), log_path=str(log))
    P.atomic_write_text(sp.heartbeat_path, json.dumps(hb))
    client = SpoolClient(sp.root, timeout_s=FAST_TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"(?s)is gone.*Segmentation fault") as err:
        client.generate([[3, 4]], SamplingParams(n=1))
    assert time.monotonic() - t0 < 2.0
    rid = err.value.request_id
    assert sp.request_state(rid) == "pending"
    w = scripted()  # "restart": the pending request is served once and picked up by id, not resubmitted
    out = client.generate([[3, 4]], SamplingParams(n=1), request_id=rid)
    assert out[0].token_ids == [4] and w.served == [rid]


def test_a_worker_killed_between_the_two_checks_is_named_by_its_exit_code(tmp_path):
    """The client's liveness check reads the heartbeat (its pid: gone once a zombie) and polls its own handle. A
    worker whose kill the kernel completes between the two (forced here: the heartbeat read kills the real child
    and waits until it is a zombie) is named by its exit code, whichever order the kernel chose (the other order
    answered "is gone", no code: a loaded run's failure of test_spool_worker's kill test)."""
    sp = Spool(tmp_path / "spool").ensure()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hb = {"protocol": P.PROTOCOL, "version": 1, "kind": "heartbeat", "state": "busy", "pid": child.pid}
        P.atomic_write_text(sp.heartbeat_path, json.dumps({**hb, "host": os.uname().nodename, "time": time.time()}))
        client = SpoolClient(sp.root, timeout_s=FAST_TIMEOUT_S, worker=WorkerHandle(child, sp, tmp_path / "w.log"))
        read = client.spool.read_heartbeat

        def killed_first():
            if child.returncode is None and P.pid_alive(child.pid):
                child.send_signal(9)
                deadline = time.monotonic() + 10
                while P.pid_alive(child.pid):  # until the kernel has made it a zombie (not reaped: the handle does)
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
            return read()

        client.spool.read_heartbeat = killed_first
        with pytest.raises(WorkerDiedError, match=r"worker process \d+ exited with code -9\."):
            client.generate([[1]], SamplingParams())
    finally:
        child.kill()
        child.wait()


def test_silent_worker_times_out_never_hangs(tmp_path, scripted):
    scripted(answer=lambda m: None)  # heart-beats, claims, never answers
    client = SpoolClient(tmp_path / "spool", timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"no answer to request .* within timeout_s=1 \(state: claimed\)"):
        client.generate([[1]], SamplingParams())
    assert time.monotonic() - t0 < 3.0


def test_stale_heartbeat_is_detected_before_the_timeout(tmp_path):
    sp = Spool(tmp_path / "spool").ensure()
    sp.write_heartbeat("busy")
    hb = sp.read_heartbeat()
    P.atomic_write_text(sp.heartbeat_path, json.dumps({**hb, "time": time.time() - 100.0}))
    client = SpoolClient(sp.root, timeout_s=30.0, stale_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="stopped heart-beating"):
        client.generate([[1]], SamplingParams())
    assert time.monotonic() - t0 < 3.0


# ---------------------------------------------------------------------------------------------
# Untrusted answers and spool entries (issue 19: "Spool responses are trusted")


def _tamper(change):
    """A scripted worker whose generate answers are _echo's, edited by ``change(completions, body)``."""

    def answer(msg: Message) -> Message:
        reply = _echo(msg)
        if msg.kind == "generate":
            body = json.loads(json.dumps(reply.body))
            change(body["completions"], body)
            return Message("completions", msg.id, body)
        return reply

    return answer


def _set(key, value, k=0):
    return lambda cs, body: cs[k].__setitem__(key, value)


BAD_ANSWERS = {
    "too_few": (lambda cs, body: cs.pop(), r"3 completions for 2 prompt\(s\) x n=2 = 4"),
    "too_many": (lambda cs, body: cs.append(dict(cs[0])), r"5 completions for 2 prompt\(s\) x n=2 = 4"),
    "duplicate_pair": (_set("sample_index", 0, k=1), r"completion 1: duplicates \(prompt_index, sample_index\)"),
    "prompt_index_out_of_range": (_set("prompt_index", 2), r"completion 0: prompt_index 2 is not an int in \[0, 2\)"),
    "sample_index_out_of_range": (_set("sample_index", -1), r"sample_index -1 is not an int in \[0, n=2\)"),
    "short_logprobs": (_set("logprobs", []), r"logprobs must be 1 numbers"),
    "long_sampled_logprobs": (_set("sampled_logprobs", [-1.0, -1.0]), r"sampled_logprobs must be 1 numbers"),
    "positive_logprob": (_set("logprobs", [3.0]), r"logprobs must be 1 numbers <= 0"),
    "str_token_ids": (_set("token_ids", ["11"]), r"token_ids must be a list of int token ids"),
    "bool_token_ids": (_set("token_ids", [True]), r"token_ids must be a list of int token ids"),
    "float_token_ids": (_set("token_ids", [11.0]), r"token_ids must be a list of int token ids"),
    "negative_token_id": (_set("token_ids", [-3]), r"token ids outside the vocabulary"),
    "too_many_tokens": (_set("token_ids", list(range(17))), r"17 token ids, expected 1..max_tokens=16"),
    "bad_finish_reason": (_set("finish_reason", "abort"), r"finish_reason 'abort'"),
    "bad_basis": (lambda cs, body: body.__setitem__("logprob_basis", "guess"), r"logprob_basis 'guess'"),
}


@pytest.mark.parametrize("defect", sorted(BAD_ANSWERS))
def test_bad_answer_is_refused_naming_the_file(tmp_path, scripted, defect):
    change, pattern = BAD_ANSWERS[defect]
    scripted(answer=_tamper(change))
    client = SpoolClient(tmp_path / "spool", timeout_s=FAST_TIMEOUT_S)
    with pytest.raises(ProtocolError, match=r"responses/r\S+\.json: .*" + pattern) as err:
        client.generate([[10, 11], [20]], SamplingParams(n=2, max_tokens=16))
    rid = str(err.value).split("responses/", 1)[1].split(".json", 1)[0]
    assert (tmp_path / "spool" / "rejected" / f"{rid}.json").is_file()  # kept for a look, not half-used


def test_answer_in_order_and_ids_inside_the_announced_vocabulary(tmp_path, scripted):
    # answers arrive shuffled: the client returns them in (prompt, sample) order
    w = scripted(answer=_tamper(lambda cs, body: cs.reverse()), vocab_size=22)
    client = SpoolClient(tmp_path / "spool", timeout_s=FAST_TIMEOUT_S)
    out = client.generate([[10, 11], [20]], SamplingParams(n=2))
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in out] == SCRIPTED_ANSWER
    w.info["vocab_size"] = 21  # the heartbeat announces the vocabulary (the real worker does): 21 is outside it
    deadline = time.monotonic() + FAST_TIMEOUT_S
    while (w.sp.read_heartbeat() or {}).get("vocab_size") != 21:  # the worker's next heartbeat carries it
        assert time.monotonic() < deadline, "the scripted worker never announced vocab_size 21"
        time.sleep(0.01)
    with pytest.raises(ProtocolError, match=r"completion 0: token ids outside the vocabulary \[0, 21\): \[21\]"):
        client.generate([[10, 11], [20]], SamplingParams(n=2))


def test_answer_with_another_id_is_refused(tmp_path):
    sp = Spool(tmp_path / "spool").ensure()
    client = SpoolClient(sp.root, timeout_s=FAST_TIMEOUT_S)
    msg = P.generate_request([[1]], SamplingParams())
    sp.submit(msg)
    bad = Message("completions", "someone-else", _echo(msg).body)
    P.atomic_write_text(sp.root / "responses" / f"{msg.id}.json", bad.to_json(sp.key))  # under the request's name
    with pytest.raises(ProtocolError, match=rf"responses/{msg.id}.json: the response's id 'someone-else' is not"):
        client.wait(msg.id)
    assert (sp.root / "rejected" / f"{msg.id}.json").is_file()


def test_message_id_with_a_trailing_newline_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bad message id"):
        Message("shutdown", "abc\n", {})
    text = Message("shutdown", "abc", {}).to_json().replace('"id":"abc"', '"id":"abc\\n"')
    with pytest.raises(ProtocolError, match="bad message id"):
        S.read_message(_write(tmp_path / "m.json", text))


def _load_worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "rollout_worker", REPO / "extras" / "vllm_rollout" / "rollout_worker.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # stdlib + align.rollout.protocol at import; vLLM only inside the engine calls
    return mod


def test_worker_rejects_a_directory_and_a_fifo_named_json_without_blocking(tmp_path):
    """The real worker's request loop (Worker.next_batch; no engine needed to claim and read requests)."""
    rw = _load_worker_module()
    spool = tmp_path / "spool"
    args = rw.parse_args(["--spool", str(spool), "--model", str(_fake_model_dir(tmp_path))])
    worker = rw.Worker(args)
    sp = worker.spool
    (sp.root / "requests" / "r0-dir.json").mkdir()
    fifo = sp.root / "requests" / "r1-fifo.json"
    os.mkfifo(fifo)
    good = P.generate_request([[1, 2]], SamplingParams())
    sp.submit(good)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=_catch(worker.next_batch)), daemon=True)
    t.start()
    t.join(FAST_TIMEOUT_S)
    if t.is_alive():  # unblock the old code's open() of the FIFO so the thread can end
        os.close(os.open(sp.root / "claimed" / "r1-fifo.json", os.O_WRONLY | os.O_NONBLOCK))
        t.join(FAST_TIMEOUT_S)
        pytest.fail("the worker blocked opening a FIFO named *.json in requests/")
    batch, command = result["out"]
    assert [m.id for m, _ in batch] == [good.id] and command is None
    for name, kind in (("r0-dir", "a directory"), ("r1-fifo", "a FIFO")):
        assert (sp.root / "rejected" / f"{name}.json").exists()
        err = S.read_message(sp.root / "responses" / f"{name}.json")
        assert err.kind == "error" and f"not a regular file ({kind})" in err.body["message"]
    worker.heartbeat()
    assert sp.read_heartbeat()["vocab_size"] == 0  # the fake config has none: the client then skips the id check


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported by the assertion that reads it
        return e


def test_second_waiter_on_one_request_fails_at_once(tmp_path, scripted):
    scripted(answer=lambda m: None)  # claims, never answers
    sp = Spool(tmp_path / "spool").ensure()
    first = SpoolClient(sp.root, timeout_s=2.0)
    msg = P.generate_request([[1]], SamplingParams())
    sp.submit(msg)
    t = threading.Thread(target=lambda: _catch(lambda: first.wait(msg.id)), daemon=True)
    t.start()
    deadline = time.monotonic() + FAST_TIMEOUT_S
    lock = sp.root / "waiters" / f"{msg.id}.lock"
    # the holder's line, written once it holds the flock (the file alone exists from the open before the flock:
    # a second waiter there could win the lock, seen once under load)
    while not (lock.exists() and lock.read_text().startswith("pid ")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = SpoolClient(sp.root, timeout_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(
        RolloutError, match=rf"another client \(pid {os.getpid()} .*\) is already waiting for request {msg.id}"
    ):
        second.wait(msg.id)
    assert time.monotonic() - t0 < 1.0
    t.join(FAST_TIMEOUT_S)
    assert not (sp.root / "waiters" / f"{msg.id}.lock").exists()  # released with the first waiter


# ---------------------------------------------------------------------------------------------
# Native


def test_native_client_matches_native_generate_and_stamps_version(tmp_path):
    torch = pytest.importorskip("torch")
    from helpers_models import make_tiny_qwen2

    from align.model import load_pretrained
    from align.rollout.native import generate

    model = load_pretrained(make_tiny_qwen2(tmp_path / "m"))
    params = SamplingParams(n=2, max_tokens=5, seed=0)
    client = make_rollout_client("native", model=model)
    assert isinstance(client, NativeClient) and client.logprob_basis == "training"
    assert client.sync_weights(None, 4) == 0.0
    out = client.generate([[1, 2, 3], [4]], params)
    ref = generate(model, [[1, 2, 3], [4]], params)
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    assert [(c.prompt_index, c.sample_index, c.weights_version) for c in out] == [
        (0, 0, 4),
        (0, 1, 4),
        (1, 0, 4),
        (1, 1, 4),
    ]
    assert torch.isfinite(torch.tensor([lp for c in out for lp in c.logprobs])).all()


def test_first_prompt_index_travels_and_a_bad_one_is_refused():
    """A torchrun rank's share carries the global index of its first prompt (the worker seeds by it); 0 is the
    default and is left out, so a whole-batch request reads as before."""
    from align.rollout.protocol import generate_request

    params = SamplingParams(n=2, seed=3)
    assert "first_prompt_index" not in generate_request([[1, 2]], params).body
    assert generate_request([[1, 2]], params, first_prompt_index=4).body["first_prompt_index"] == 4
    for bad in (-1, 1.5, True):
        with pytest.raises(ProtocolError, match="'first_prompt_index' must be an int >= 0"):
            generate_request([[1, 2]], params, first_prompt_index=bad)


# ---------------------------------------------------------------------------------------------
# Trust: the spool is this user's, every message carries the spool secret's MAC, one trainer per spool

OTHER_UID = 54321


def _as_other_user(path: Path, monkeypatch) -> None:
    """Make ``path`` another user's: chown as root; else this process pretends to be another uid."""
    if os.getuid() == 0:
        os.chown(path, OTHER_UID, -1)
    else:
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)


def test_spool_is_created_private_and_a_shared_or_foreign_one_is_refused(tmp_path, monkeypatch):
    sp = Spool(tmp_path / "new" / "spool").ensure()
    for d in (sp.root, *(sp.root / n for n in S._SPOOL_DIRS)):
        assert oct(d.stat().st_mode & 0o777) == oct(0o700), d
    assert oct(sp.secret_path.stat().st_mode & 0o777) == oct(0o600) and len(sp.key) >= 32
    assert Spool(sp.root).key == sp.key  # one secret per spool: the other side reads the same one
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # pre-created world-writable (by another user, or a careless umask)
    with pytest.raises(RuntimeError, match=rf"spool directory {shared} is writable by group or others.*chmod 700"):
        Spool(shared).ensure()
    os.chmod(shared, 0o700)
    Spool(shared).ensure()  # negative control: the same dir, private, is used
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    _as_other_user(foreign, monkeypatch)
    with pytest.raises(RuntimeError, match=rf"spool directory {foreign} is owned by uid \d+, not by this user"):
        Spool(foreign).ensure()


def test_worker_refuses_requests_without_the_secret_or_from_another_uid(tmp_path, monkeypatch):
    """The real worker's request loop: a shutdown with no MAC, one signed with another secret, one whose body was
    changed after signing and one written by another uid are moved to rejected/, counted, never obeyed or answered."""
    rw = _load_worker_module()
    args = rw.parse_args(["--spool", str(tmp_path / "spool"), "--model", str(_fake_model_dir(tmp_path))])
    worker = rw.Worker(args)
    sp = worker.spool
    forged = {
        "r0-nomac": P.shutdown_request("r0-nomac").to_json(),
        "r1-othersecret": P.shutdown_request("r1-othersecret").to_json(b"x" * 32),
        "r2-tampered": P.sync_request(tmp_path, 3, "r2-tampered").to_json(sp.key).replace('"version":3', '"version":4'),
        "r3-otheruid": P.shutdown_request("r3-otheruid").to_json(sp.key),
    }
    for name, text in forged.items():
        P.atomic_write_text(sp.root / "requests" / f"{name}.json", text)
    if os.getuid() == 0:  # a file of another uid, MAC and all (the secret leaked, or the file was copied)
        os.chown(sp.root / "requests" / "r3-otheruid.json", OTHER_UID, -1)
    else:
        del forged["r3-otheruid"]
        os.unlink(sp.root / "requests" / "r3-otheruid.json")
    batch, command = worker.next_batch()
    assert batch == [] and command is None
    for name in forged:
        assert (sp.root / "rejected" / f"{name}.json").is_file() and sp.request_state(name) is None
    assert sp.untrusted == len(forged)
    worker.heartbeat()
    assert sp.read_heartbeat()["untrusted_rejected"] == len(forged)
    good = P.shutdown_request()  # negative control: the trainer's own, signed with the spool's secret
    sp.submit(good)
    batch, command = worker.next_batch()
    assert command is not None and command.id == good.id and sp.untrusted == len(forged)


def test_spool_read_checks_the_file_owner_on_the_open_fd(tmp_path, monkeypatch):
    sp = Spool(tmp_path / "spool").ensure()
    path = sp.submit(P.shutdown_request())
    assert sp.read(path).kind == "shutdown"  # negative control
    _as_other_user(path, monkeypatch)
    with pytest.raises(P.UntrustedMessageError, match=r"written by uid \d+, not the spool's owner uid \d+"):
        sp.read(path)


def test_client_waits_past_a_forged_answer_and_takes_the_workers(tmp_path, scripted):
    sp = Spool(tmp_path / "spool").ensure()

    def answer(msg: Message) -> Message:
        forged = Message("completions", msg.id, {**_echo(msg).body, "weights_version": 666})
        target = sp.root / "responses" / f"{msg.id}.json"
        P.atomic_write_text(target, forged.to_json())  # no MAC: not the worker's
        deadline = time.monotonic() + FAST_TIMEOUT_S
        while target.exists() and time.monotonic() < deadline:  # the client takes it aside
            time.sleep(0.01)
        return _echo(msg)

    scripted(answer=answer)
    client = SpoolClient(sp.root, timeout_s=FAST_TIMEOUT_S)
    out = client.generate([[10, 11]], SamplingParams())
    assert client.weights_version == 7 and [c.token_ids for c in out] == [[11]]
    assert client.spool.untrusted == 1 and len(list((sp.root / "rejected").glob("*.json"))) == 1


def test_second_trainer_on_one_spool_is_refused_at_once(tmp_path):
    from align.rollout.client import lock_trainer

    first = lock_trainer(tmp_path / "spool")
    code = (
        "import sys; from align.rollout.client import lock_trainer\n"
        "try:\n    lock_trainer(sys.argv[1])\nexcept RuntimeError as e:\n    print(e); sys.exit(3)\n"
    )
    run = [sys.executable, "-c", code, str(tmp_path / "spool")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert out.returncode == 3, out.stderr
    assert f"in use by another trainer (pid {os.getpid()} on" in out.stdout and "--spool" in out.stdout
    first.close()
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr  # negative control: once released, the next trainer runs


def test_heartbeat_that_is_a_fifo_or_a_device_is_refused_without_blocking(tmp_path):
    """A FIFO in heartbeat.json's place blocked the client's open() forever; a symlink to /dev/zero read until
    out of memory. Both are refused at once (O_NONBLOCK, O_NOFOLLOW, fstat), a real heartbeat still reads."""
    sp = Spool(tmp_path / "spool").ensure()
    os.mkfifo(sp.heartbeat_path)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=_catch(sp.read_heartbeat)), daemon=True)
    t.start()
    t.join(FAST_TIMEOUT_S)
    if t.is_alive():  # unblock the old code's open() of the FIFO so the thread can end
        os.close(os.open(sp.heartbeat_path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(FAST_TIMEOUT_S)
        pytest.fail("read_heartbeat blocked opening a FIFO in heartbeat.json's place")
    assert isinstance(result["out"], ProtocolError) and "not a regular file (a FIFO)" in str(result["out"])
    sp.heartbeat_path.unlink()
    sp.heartbeat_path.symlink_to("/dev/zero")
    code = (  # in a child with a 1 GiB address-space limit: the old code's unbounded read fails there, not here
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from align.rollout.protocol import ProtocolError\nfrom align.rollout.spool import Spool\n"
        f"try: Spool({str(sp.root)!r}).read_heartbeat()\n"
        "except ProtocolError as e: print('refused:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, env=env)
    assert "refused:" in run.stdout and "not a regular file" in run.stdout, run.stderr[-2000:]
    sp.heartbeat_path.unlink()
    sp.write_heartbeat("ready")  # negative control: a real heartbeat reads
    assert sp.read_heartbeat()["state"] == "ready"


def test_heartbeat_of_another_user_is_ignored_counted_and_warned_once(tmp_path, monkeypatch, caplog):
    """A heartbeat.json not written by the spool's owner was trusted: a forged 'stopped' heartbeat told the client
    its worker was gone (and ended the run). Now it reads as no heartbeat, counted, with one warning. The file is
    chowned to another uid when this user may (root); else os.fstat is patched to report another owner for it."""
    sp = Spool(tmp_path / "spool").ensure()
    sp.write_heartbeat("stopped", error="forged by another user")
    other = os.getuid() + 1
    try:
        os.chown(sp.heartbeat_path, other, -1)
    except PermissionError:  # not root: make the owner check see another uid
        real_fstat, ino = os.fstat, os.stat(sp.heartbeat_path).st_ino

        def fstat(fd):
            st = real_fstat(fd)
            if st.st_ino != ino:
                return st
            fields = list(st)
            fields[4] = other  # st_uid
            return os.stat_result(fields)

        monkeypatch.setattr(os, "fstat", fstat)
    with caplog.at_level("WARNING", logger="align.rollout.spool"):
        assert sp.read_heartbeat() is None and sp.read_heartbeat() is None
    assert sp.foreign_heartbeats == 2
    warned = [r.getMessage() for r in caplog.records if "heartbeat.json" in r.getMessage()]
    assert len(warned) == 1 and f"written by uid {other}" in warned[0], warned
    assert S.heartbeat_problem(sp.read_heartbeat(), stale_s=30.0) is None  # the forged 'stopped' decides nothing
    monkeypatch.undo()
    if os.stat(sp.heartbeat_path).st_uid != os.getuid():
        os.chown(sp.heartbeat_path, os.getuid(), -1)
    assert sp.read_heartbeat()["state"] == "stopped"  # negative control: the owner's heartbeat is read


def test_heartbeat_read_is_bounded(tmp_path, monkeypatch):
    sp = Spool(tmp_path / "spool").ensure()
    sp.write_heartbeat("ready")
    size = sp.heartbeat_path.stat().st_size
    monkeypatch.setattr(S, "HEARTBEAT_MAX_BYTES", size)
    assert sp.read_heartbeat()["state"] == "ready"  # negative control: at the bound it reads
    with open(sp.heartbeat_path, "ab") as f:
        f.write(b" ")
    with pytest.raises(ProtocolError, match=f"larger than {size} bytes"):
        sp.read_heartbeat()
