"""MoE routes on the spool (protocol minor 4, ``align/rollout/protocol.py``): ``Completion.routes`` base64-packed
int16 with its shape, round-tripped from routes the native sampler recorded (equal, and replay on the decoded routes
gives the learner the same loss), validation against the completion (a truncated blob, a wrong shape, a forged
value, missing routes: rejected naming the answer), and a worker below minor 4 refused before anything is sent."""

from __future__ import annotations

import array
import json

import helpers_moe as tm
import pytest
import torch
from helpers_learner import CPU, cfg

from align import learner
from align.grpo import merge_stats
from align.rollout import protocol as P
from align.rollout.client import SpoolClient
from align.rollout.message import WorkerTooOldError
from align.rollout.native import generate

PARAMS = P.SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=0)
SOURCE = "responses/req-abc.json"


@pytest.fixture(scope="module")
def sampled():
    """A bf16 sampler on near-tied routers (its experts differ from the fp32 learner's for some tokens), the
    learner, prompts and the sampler's completions with their recorded routes."""
    model = tm.tiny_moe(seed=5)
    with torch.no_grad():
        for block in tm.sparse_blocks(model):
            block.gate.weight.mul_(0.02)
    sampler = tm.tiny_moe(seed=5).to(torch.bfloat16)
    sampler.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9, 3)]
    comps = generate(sampler, prompts, PARAMS)
    assert all(c.routes is not None and c.routes.dtype == torch.int16 for c in comps)
    return model, prompts, comps


def wire_body(comps) -> dict:
    """A completions answer as the worker writes it and the client reads it (JSON text in between)."""
    body = {"completions": [c.to_dict() for c in comps], "logprob_basis": "training"}
    return json.loads(json.dumps(body))


def replay_loss(model, prompts, comps, replay: str) -> tuple[float, dict, dict]:
    """The learner's loss, stats and gradients on one batch of ``comps`` (the loss value alone is blind to the
    routes on-policy, where the ratio is 1: the gradients are not)."""
    g = torch.Generator().manual_seed(1)
    adv, valid = torch.randn(3, 3, generator=g), torch.ones(3, 3, dtype=torch.bool)
    c = cfg(group_size=3)
    c.moe.routing_replay = replay
    b = learner.make_batch(learner.StepBatch(prompts, comps, adv, valid), c, torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    st = merge_stats(learner.backward_batch(model, None, c, *b, place=CPU))
    return st["loss"], st, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def differ(g1: dict, g2: dict) -> float:
    return max(float((g1[k] - g2[k]).abs().max()) for k in g1)


def test_routes_round_trip_and_replay_gives_the_same_loss(sampled):
    model, prompts, comps = sampled
    body = wire_body(comps)
    r0 = body["completions"][0]["routes"]
    assert r0["dtype"] == "int16" and r0["shape"] == list(comps[0].routes.shape) and isinstance(r0["data"], str)
    back = P.check_completions(body, prompts, PARAMS, SOURCE, need_routes=True)
    for a, b in zip(comps, back):
        assert b.routes.shape == tuple(a.routes.shape)
        assert torch.equal(torch.tensor(b.routes.tolist(), dtype=torch.int16).reshape(b.routes.shape), a.routes)
    assert P.Completion.from_dict(comps[1].to_dict()).routes.data == back[1].routes.data  # from_dict decodes too
    orig, _, g_orig = replay_loss(model, prompts, comps, "rollout")
    got, st2, g_got = replay_loss(model, prompts, back, "rollout")
    assert got == orig and st2["moe/routing_mismatch"] == 0.0
    assert g_got.keys() == g_orig.keys() and all(torch.equal(g_got[k], g_orig[k]) for k in g_orig)
    _, st_off, g_off = replay_loss(model, prompts, back, "off")
    assert st_off["moe/routing_mismatch"] > 0 and differ(g_off, g_orig) > 1e-6  # control: the routes matter
    # control: one route changed on the wire (a valid blob, another expert) changes the replayed gradients
    forged = wire_body(comps)
    first = P.decode_routes(forged["completions"][0]["routes"])
    first.data[0] = (first.data[0] + 1) % 6 if (first.data[0] + 1) % 6 != first.data[1] else (first.data[0] + 2) % 6
    forged["completions"][0]["routes"] = P.encode_routes(first)
    g_forged = replay_loss(model, prompts, P.check_completions(forged, prompts, PARAMS, SOURCE), "rollout")[2]
    assert differ(g_forged, g_orig) > 1e-6


def _tamper(body: dict, how: str) -> dict:
    r = body["completions"][4]["routes"]
    rows, layers, k = r["shape"]
    if how == "truncated":
        r["data"] = r["data"][:-8]  # still base64, 6 bytes short
    elif how == "shape":
        r["shape"], r["data"] = [rows - 1, layers, k], P.encode_routes(_rows(r, rows - 1))["data"]
    elif how == "not_base64":
        r["data"] = "!" + r["data"][1:]
    elif how == "negative":
        r["data"] = P.encode_routes(P.PackedRoutes((rows, layers, k), _neg(r)))["data"]
    elif how == "missing":
        body["completions"][4]["routes"] = None
    return body


def _rows(r: dict, n: int) -> P.PackedRoutes:
    full = P.decode_routes(r)
    per = full.shape[1] * full.shape[2]
    return P.PackedRoutes((n, *full.shape[1:]), array.array("h", full.data[: n * per]))


def _neg(r: dict):
    d = P.decode_routes(r).data
    d[0] = -1
    return d


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        ("truncated", r"routes data holds \d+ bytes, shape .* needs \d+ \(int16\): truncated"),
        ("shape", r"routes have \d+ rows for \d+ tokens: expected \d+ \(len\(token_ids\) - 1\)"),
        ("not_base64", "routes data is not base64"),
        ("negative", "routes hold a negative expert id"),
        ("missing", "carries no routes, and --routing-replay rollout needs them"),
    ],
)
def test_a_forged_or_truncated_route_answer_is_rejected_naming_it(sampled, how, needle):
    _model, prompts, comps = sampled
    body = _tamper(wire_body(comps), how)
    with pytest.raises(P.ProtocolError, match=f"{SOURCE}: completion 4: {needle}"):
        P.check_completions(body, prompts, PARAMS, SOURCE, need_routes=True)
    P.check_completions(wire_body(comps), prompts, PARAMS, SOURCE, need_routes=True)  # control: untouched passes


def test_routes_of_another_shape_are_refused_by_the_learner(sampled):
    """(MoE layers, top-k) are not known to the protocol: a blob re-shaped to another (layers, k) decodes, and the
    learner refuses it by name."""
    model, prompts, comps = sampled
    body = wire_body(comps)
    for c in body["completions"]:
        rows, layers, k = c["routes"]["shape"]
        c["routes"]["shape"] = [rows, layers * k, 1]
    back = P.check_completions(body, prompts, PARAMS, SOURCE)
    with pytest.raises(ValueError, match=r"routes have \(MoE layers, top-k\) \(4, 1\), the model \(2, 2\)"):
        replay_loss(model, prompts, back, "rollout")


def test_a_worker_below_minor_4_or_without_routes_is_refused_before_sending(tmp_path):
    client = SpoolClient(tmp_path / "spool", timeout_s=5)
    client.needs_routes = True
    spool = client.spool
    with pytest.raises(P.ProtocolError, match="no worker has announced itself"):
        client.generate([[1, 2]], PARAMS)
    spool.write_heartbeat("ready", minor=3, routes=True)  # a minor-3 worker (sleep / wake_up, no routes)
    with pytest.raises(WorkerTooOldError, match=r"speaks align-spool 1\.3; --routing-replay rollout needs 1\.4"):
        client.generate([[1, 2]], PARAMS)
    spool.write_heartbeat("ready", routes=False)  # this checkout's minor, started without --return-routes
    with pytest.raises(P.ProtocolError, match="does not return MoE routes: start it with --return-routes"):
        client.generate([[1, 2]], PARAMS)
    assert spool.pending() == []  # nothing was sent
    spool.write_heartbeat("ready", routes=True)  # control: the request goes out (no worker answers it here)
    client.timeout_s = 0.3
    with pytest.raises(Exception, match="(?i)timed out|no answer|timeout"):
        client.generate([[1, 2]], PARAMS)
    assert len(spool.pending()) == 1
