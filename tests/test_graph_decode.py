"""The CUDA-graph decode's CPU-testable part (align.rollout.graph_decode): shape buckets, when it runs eager, the
static-cache decode loop, the fallback of a failed capture.

No GPU here: the capture itself (``graph_decode.capture``: side-stream warm-up, ``torch.cuda.graph``) is replaced by
running the step eagerly on the same static buffers, which is everything the graph path does except the CUDA graph
(a fake, said here: nothing real captures a CUDA graph on a CPU). tests/test_gpu.py runs the real capture.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hf_reference import hf_model, save_hf

from align.model import load_pretrained
from align.rollout import graph_decode
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams

LOGPROB_ATOL = 1e-5  # static cache (all slots, masked) vs the eager cache (used slots): one SDPA, other widths
PROMPTS = [[1, 5, 9, 13, 2, 40], [7, 3], [11, 12, 13]]
PARAMS = SamplingParams(n=2, max_tokens=12, seed=3, stop_token_ids=[5, 17, 23])  # stops: rows finish early


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_pretrained(save_hf(hf_model("qwen2"), tmp_path_factory.mktemp("m")))


@pytest.fixture
def on_cpu(monkeypatch):
    """The graph path on the CPU: every shape may run static, the 'capture' runs the step eagerly (see above)."""
    monkeypatch.setattr(graph_decode, "eager_reason", lambda device, cfg, rows: None)
    monkeypatch.setattr(graph_decode, "capture", lambda step: step)
    monkeypatch.setattr(graph_decode, "_graphs", graph_decode.weakref.WeakKeyDictionary())
    monkeypatch.setattr(graph_decode, "_said", set())


def same(a, b) -> bool:
    if [c.token_ids for c in a] != [c.token_ids for c in b]:
        return False
    return all(
        torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=LOGPROB_ATOL, rtol=0)
        and x.finish_reason == y.finish_reason
        for x, y in zip(a, b)
    )


def test_cache_length_buckets():
    assert graph_decode.cache_bucket(3, 4096) == graph_decode.MIN_CACHE
    assert graph_decode.cache_bucket(257, 4096) == 512
    assert graph_decode.cache_bucket(512, 4096) == 512
    assert graph_decode.cache_bucket(600, 1024) == 1024
    assert graph_decode.cache_bucket(600, 700) == 700  # capped at the context
    assert graph_decode.cache_bucket(800, 700) == 800  # prompt + max_tokens past the context: rows stop there


def test_eager_reasons(model, monkeypatch):
    cfg = model.config
    cuda = torch.device("cuda")
    assert graph_decode.eager_reason(torch.device("cpu"), cfg, 4) == "cpu device"
    assert graph_decode.eager_reason(cuda, cfg, 4) is None
    assert "rows" in graph_decode.eager_reason(cuda, cfg, graph_decode.MAX_ROWS + 1)
    monkeypatch.setattr(cfg, "sliding_window", 64)
    assert graph_decode.eager_reason(cuda, cfg, 4) == "sliding-window attention"
    monkeypatch.setattr(cfg, "sliding_window", None)
    monkeypatch.setenv(graph_decode.ENV, "0")
    assert graph_decode.eager_reason(cuda, cfg, 4) == f"{graph_decode.ENV}=0"


def test_cpu_never_takes_the_graph_path(model):
    assert graph_decode.decoder(model, 4, 20, torch.float32, torch.device("cpu")) is None
    generate(model, PROMPTS, PARAMS)
    assert graph_decode.captured(model) == []


def test_static_cache_decode_equals_the_eager_loop(model, on_cpu, monkeypatch):
    eager = generate(model, PROMPTS, PARAMS, cuda_graphs=False)
    assert {c.finish_reason for c in eager} == {"stop", "length"}  # rows finish at different steps
    static = generate(model, PROMPTS, PARAMS)
    size = graph_decode.cache_bucket(6 + 12, model.config.max_position_embeddings)  # the tiny model's context: 128
    assert graph_decode.captured(model) == [(6, size, torch.float32, None, "cpu")]
    assert same(static, eager)
    assert same(generate(model, PROMPTS, PARAMS), eager)  # the shape's buffers reused by the next call
    # negative control: a 'graph' that replays its captured output instead of reading the static inputs
    monkeypatch.setattr(graph_decode, "_graphs", graph_decode.weakref.WeakKeyDictionary())

    def stale(step):
        out = step()
        return lambda: out

    monkeypatch.setattr(graph_decode, "capture", stale)
    assert not same(generate(model, PROMPTS, PARAMS), eager)


BF16_TOL = 0.1  # bf16 autocast: the sampler's logprob vs a teacher-forced recompute (other shapes, other rounding)


def teacher_forced_gap(model, completions, shift: int = 0) -> float:
    """Max |sampler logprob - teacher-forced logprob| over every token (``shift``: compare with the next token's)."""
    gap = 0.0
    for c in completions:
        p = PROMPTS[c.prompt_index]
        ids = torch.tensor([p + c.token_ids[:-1]])
        logp = model(ids)[0, len(p) - 1 :].float().log_softmax(-1)  # (len, V)
        want = logp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        got = torch.tensor(c.logprobs).roll(shift)
        gap = max(gap, float((want - got).abs().max()))
    return gap


def test_static_cache_under_bf16_autocast(model, on_cpu):
    """bf16-mixed (the trainer's autocast): the cache holds bf16 and RoPE hands it fp32 keys (written cast). bf16
    rounds the whole-buffer attention differently from the eager loop's, so near-ties may sample other tokens: the
    contract checked is the logprob basis, each sampled token's logprob = the teacher-forced one."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        static = generate(model, PROMPTS, PARAMS)
        assert graph_decode.captured(model)[0][2:4] == (torch.bfloat16, torch.bfloat16)
        assert teacher_forced_gap(model, static) < BF16_TOL
        assert teacher_forced_gap(model, static, shift=1) > BF16_TOL  # control: logprobs one token off


def test_failed_capture_decodes_eagerly_said_once(model, on_cpu, monkeypatch, caplog):
    def fails(step):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(graph_decode, "capture", fails)
    eager = generate(model, PROMPTS, PARAMS, cuda_graphs=False)
    with caplog.at_level(logging.WARNING, logger=graph_decode.__name__):
        assert same(generate(model, PROMPTS, PARAMS), eager)
        assert same(generate(model, PROMPTS, PARAMS), eager)
    said = [r.getMessage() for r in caplog.records if r.name == graph_decode.__name__]
    size = graph_decode.cache_bucket(6 + 12, model.config.max_position_embeddings)
    want = f"capturing 6 rows x {size} slots failed: RuntimeError: operation not permitted when stream is capturing"
    assert said == [f"native sampler: eager decode, no CUDA graph ({want})"]
    assert graph_decode.captured(model) == []


def test_shape_cap_and_replaced_weights(model, on_cpu, monkeypatch, caplog):
    monkeypatch.setattr(graph_decode, "MAX_GRAPHS", 1)
    cpu = torch.device("cpu")
    first = graph_decode.decoder(model, 4, 20, torch.float32, cpu)
    assert graph_decode.decoder(model, 4, 30, torch.float32, cpu) is first  # same bucket, same capture
    with caplog.at_level(logging.WARNING, logger=graph_decode.__name__):
        assert graph_decode.decoder(model, 5, 20, torch.float32, cpu) is None  # a second shape: eager
    assert "more than 1 decode shapes" in caplog.text
    w = model.model.norm.weight
    monkeypatch.setattr(model.model.norm, "weight", torch.nn.Parameter(w.detach().clone()))  # a new address
    again = graph_decode.decoder(model, 4, 20, torch.float32, cpu)
    assert again is not None and again is not first  # captured again: the old graph read the old address
