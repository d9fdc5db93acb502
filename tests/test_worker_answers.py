"""The rollout worker publishes its answers off its loop (extras/vllm_rollout/worker_answers.py): the real worker class
on a real spool, loaded by path as the worker's own tests do; no engine is needed to claim, answer and publish."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

from align.rollout import protocol as P
from align.rollout.protocol import SamplingParams

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 5.0  # every bounded wait in this file


def _worker(tmp_path: Path, *extra: str):
    spec = importlib.util.spec_from_file_location(
        "rollout_worker", REPO / "extras" / "vllm_rollout" / "rollout_worker.py"
    )
    rw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rw)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 16}))
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    args = rw.parse_args(["--spool", str(tmp_path / "spool"), "--model", str(model), *extra])
    return rw.Worker(args)


def _claimed(worker, n: int) -> list[P.Message]:
    for _ in range(n):
        worker.spool.submit(P.generate_request([[1, 2]], SamplingParams(max_tokens=1)))
    batch, command = worker.next_batch()
    assert command is None and len(batch) == n
    return [msg for msg, _ in batch]


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.01)


def test_answers_return_while_the_disk_is_slow_and_are_published_in_order(tmp_path):
    worker = _worker(tmp_path)
    reqs = _claimed(worker, 3)
    gate, order = threading.Event(), []
    respond = worker.spool.respond

    def slow_respond(msg):  # the first response's fsync takes as long as the test holds the gate
        if not order:
            gate.wait(WAIT_S)
        order.append(msg.id)
        return respond(msg)

    worker.spool.respond = slow_respond
    answered = threading.Event()

    def loop():  # the worker's loop answering three finished requests
        for r in reqs:
            worker.answer(P.Message("completions", r.id, {"completions": [], "weights_version": 0}))
        answered.set()

    threading.Thread(target=loop, daemon=True).start()
    try:
        assert answered.wait(WAIT_S), "answer() waited for the disk: the loop could not step the engine meanwhile"
        assert worker.writer.pending() == 3
        assert not any(worker.spool.request_state(r.id) == "answered" for r in reqs)
    finally:
        gate.set()
    assert worker.writer.flush(WAIT_S)
    assert order == [r.id for r in reqs]  # in the order answered
    for r in reqs:
        assert worker.spool.request_state(r.id) == "answered"
        assert (worker.spool.root / "done" / f"{r.id}.json").exists()  # moved out of claimed/ after its response
    worker.close(None)


def test_a_response_that_cannot_be_written_fails_the_worker_and_its_request_is_served_again(tmp_path):
    worker = _worker(tmp_path)
    (req,) = _claimed(worker, 1)

    def full_disk(msg):
        raise OSError(28, "No space left on device")

    worker.spool.respond = full_disk
    worker.answer(P.Message("completions", req.id, {"completions": [], "weights_version": 0}))
    assert worker.writer.flush(WAIT_S)
    with pytest.raises(OSError, match="No space left"):  # what the worker's loop calls first on every turn
        worker.writer.check()
    with pytest.raises(OSError, match="No space left"):
        worker.answer(P.error_response(req.id, "bad_request", "later"))
    assert (worker.spool.root / "claimed" / f"{req.id}.json").exists()  # not answered, not lost
    worker.close("OSError: No space left on device")
    assert P.Spool(worker.spool.root).recover() == [req.id]  # the next worker serves it again


def test_busy_and_ready_reach_the_heartbeat_without_waiting_for_the_next_beat(tmp_path):
    worker = _worker(tmp_path, "--heartbeat-s", "600")
    worker.set_state("ready")
    worker._beat.start()
    try:
        worker.flip_state("busy")  # returns at once; the heartbeat thread writes it
        _until(lambda: worker.spool.read_heartbeat()["state"] == "busy", "the heartbeat says busy")
        worker.flip_state("ready")
        _until(lambda: worker.spool.read_heartbeat()["state"] == "ready", "the heartbeat says ready")
    finally:
        worker.close(None)
    assert worker.spool.read_heartbeat()["state"] == "stopped"


def test_a_request_answered_while_its_state_is_read_is_never_read_as_consumed(tmp_path, monkeypatch):
    """The worker publishes (response, then claimed/ -> done/) between any two of the client's looks at the folders:
    under load a waiting thread can be descheduled there. Seen at 32 episodes x 16 turns on 2 cores: a turn's
    wait() read 'done' ('already answered and its response consumed') for an answer lying in responses/."""
    import pathlib

    worker = _worker(tmp_path)
    (req,) = _claimed(worker, 1)
    sp = worker.spool
    exists, armed = pathlib.Path.exists, []

    def exists_then_publish(path: pathlib.Path) -> bool:  # the worker's publish right after the first look
        found = exists(path)
        if armed and path.stem == req.id:
            armed.clear()
            worker.publish(P.Message("completions", req.id, {"completions": [], "weights_version": 0}))
        return found

    monkeypatch.setattr(pathlib.Path, "exists", exists_then_publish)
    armed.append(True)
    assert sp.request_state(req.id) == "answered"
    assert not armed  # the publish happened mid-read
    monkeypatch.undo()
    (sp.root / "responses" / f"{req.id}.json").unlink()  # the client took it
    assert sp.request_state(req.id) == "done"  # consumed: now it is
