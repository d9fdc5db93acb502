"""The native sampler: cache vs full forward, ragged batches, exact logprobs, seeds, stops, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_reference import hf_model, save_hf

from align.model import KVCache, load_pretrained
from align.rollout import cpu_kernel, native
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams

LOGIT_ATOL = 1e-5
LOGPROB_ATOL = 1e-5
# the decode GEMMs of align.rollout.cpu_kernel, each marked with the CPU it needs (elsewhere: skipped, listed)
KERNEL_PARAMS = [pytest.param("avx512", marks=pytest.mark.avx512), pytest.param("avx2", marks=pytest.mark.avx2)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_pretrained(save_hf(hf_model("qwen2"), tmp_path_factory.mktemp("m")))


def decode_step_by_step(model, ids, corrupt_at=None):
    cache = KVCache(model.config, 1, ids.shape[1], torch.float32, "cpu")
    cache.valid[:, :4] = True
    out = [model(ids[:, :4], cache=cache)[0]]
    cache.length = 4
    for t in range(4, ids.shape[1]):
        if corrupt_at == t:
            cache.k[0, :, :, 1] += 0.5
        cache.valid[:, t] = True
        out.append(model(ids[:, t : t + 1], positions=torch.tensor([[t]]), cache=cache)[0])
        cache.length += 1
    return torch.cat(out)


@torch.no_grad()
def test_cached_decode_equals_full_forward(model):
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    full = model(ids)[0]
    torch.testing.assert_close(decode_step_by_step(model, ids), full, atol=LOGIT_ATOL, rtol=0)
    bad = decode_step_by_step(model, ids, corrupt_at=10)  # negative control: a corrupted cache slot
    assert (bad[10:] - full[10:]).abs().max() > 1e-3


PROMPTS = [[1, 5, 9, 13, 2, 40], [7, 3], [11, 12, 13], [60, 61, 62, 63, 64, 65, 66, 67, 68]]


def test_ragged_batch_equals_one_by_one(model):
    params = SamplingParams(temperature=0, max_tokens=10)
    batched = generate(model, PROMPTS, params)
    for i, p in enumerate(PROMPTS):
        alone = generate(model, [p], params)[0]
        assert batched[i].token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(batched[i].logprobs), torch.tensor(alone.logprobs), atol=LOGPROB_ATOL, rtol=0
        )


def test_negative_control_padding_mask_matters(model, monkeypatch):
    """If padded slots were attended to, short prompts in a ragged batch would change."""
    real_forward = type(model).forward

    def leaky(self, input_ids, *, positions=None, cache=None, return_hidden=False):
        if cache is not None:
            cache.valid[:] = True
        return real_forward(self, input_ids, positions=positions, cache=cache, return_hidden=return_hidden)

    monkeypatch.setattr(type(model), "forward", leaky)
    params = SamplingParams(temperature=0, max_tokens=10)
    batched = generate(model, PROMPTS, params)
    monkeypatch.undo()
    alone = generate(model, [PROMPTS[1]], params)[0]
    assert batched[1].logprobs != pytest.approx(alone.logprobs, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.8, 10, 0.8)])
def test_logprobs_equal_teacher_forced(model, temperature, top_k, top_p):
    params = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=12, seed=7)
    outs = generate(model, PROMPTS, params)
    assert len(outs) == len(PROMPTS) * 3
    truncated = top_k > 0 or top_p < 1
    for c in outs:
        p = PROMPTS[c.prompt_index]
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            scaled = model(ids)[0, len(p) - 1 : -1] / temperature  # (T, V)
        tgt = torch.tensor(c.token_ids)[:, None]
        ref = scaled.log_softmax(-1).gather(-1, tgt).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
        q = native.truncate_logits(scaled, top_k, top_p).log_softmax(-1).gather(-1, tgt).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.sampled_logprobs), q, atol=LOGPROB_ATOL, rtol=0)
        assert torch.isfinite(q).all()  # every sampled token lies inside the truncated support
        if truncated:  # negative control: the two bases really differ under truncation
            assert (q - ref).abs().max() > 1e-3
        # negative control: the T=1 basis is not the returned one unless T == 1
        raw = (scaled * temperature).log_softmax(-1).gather(-1, tgt).squeeze(-1)
        assert (temperature == 1.0) == bool(torch.allclose(raw, torch.tensor(c.logprobs), atol=LOGPROB_ATOL))


def test_sampling_follows_the_distribution(model):
    """First-token frequencies over 4000 draws match softmax(logits/T) restricted to top-k."""
    prompt, T, k = [3, 4, 5], 1.5, 6
    with torch.no_grad():
        probs = native.truncate_logits(model(torch.tensor([prompt]))[0, -1:] / T, k, 1.0).softmax(-1)[0]
    outs = generate(model, [prompt], SamplingParams(n=4000, temperature=T, top_k=k, max_tokens=1, seed=0))
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in outs]), minlength=97).float()
    assert counts[probs == 0].sum() == 0  # nothing outside the top-k
    freq = counts / counts.sum()
    assert (freq - probs).abs().max() < 0.03  # 4000 draws: std of a frequency <= 0.008


def test_seeds(model):
    p = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=123)
    a, b = generate(model, PROMPTS, p), generate(model, PROMPTS, p)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    c = generate(model, PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=124))
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert a[0].token_ids != a[1].token_ids  # the n samples of one prompt differ


def test_stop_tokens_and_max_tokens(model):
    free = generate(model, PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=5))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 20 for c in free)
    # Stop on a token that the free run produced mid-way: those rows end right after it.
    stop = free[0].token_ids[5]
    outs = generate(model, PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=5, stop_token_ids=[stop]))
    for f, c in zip(free, outs):
        if stop in f.token_ids:
            cut = f.token_ids.index(stop) + 1
            assert c.finish_reason == "stop" and c.token_ids == f.token_ids[:cut]
            assert c.logprobs == pytest.approx(f.logprobs[:cut], abs=LOGPROB_ATOL)
        else:
            assert c.finish_reason == "length" and c.token_ids == f.token_ids
    assert any(c.finish_reason == "stop" for c in outs) and any(c.finish_reason == "length" for c in outs)


def test_compaction_does_not_change_results(model, monkeypatch):
    params = SamplingParams(n=3, temperature=0.9, max_tokens=15, seed=11, stop_token_ids=[10, 20, 30, 40, 50])
    compacted = generate(model, PROMPTS, params)
    monkeypatch.setattr(native, "COMPACT_FRACTION", 2.0)  # never compact
    plain = generate(model, PROMPTS, params)
    assert any(c.finish_reason == "stop" for c in plain)
    for a, b in zip(compacted, plain):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_ATOL)


def test_context_limit_ends_with_length(model):
    ctx = model.config.max_position_embeddings  # 128
    outs = generate(model, [[1] * (ctx - 3)], SamplingParams(temperature=0, max_tokens=50))
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 3


@pytest.mark.parametrize(
    "prompts,kwargs,match",
    [
        ([[]], {}, "prompt 0 is empty"),
        ([[1, 2], [5, 97]], {}, "token id 97 outside the vocabulary"),
        ([[1, -1]], {}, "token id -1"),
        ([[1] * 128], {}, "no room in the model's context"),
        ([], {}, "at least one prompt"),
    ],
)
def test_bad_prompts(model, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, SamplingParams(**kwargs))


@pytest.mark.parametrize(
    "kwargs,match", [({"n": 0}, "n must be >= 1"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")]
)
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("layout", [*KERNEL_PARAMS, "library"])
def test_packed_weights_give_the_same_samples(model, monkeypatch, layout):
    """CPU sampling runs on prepacked, fused copies of the weights (each decode kernel, or MKL/oneDNN without one):
    same tokens, same logprobs as the model's own layers."""
    if layout in cpu_kernel.KERNELS:
        _require_kernel(layout)
    monkeypatch.setattr(native, "_kernel_ops", lambda: cpu_kernel.load(layout) if layout != "library" else None)
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=12, seed=3, stop_token_ids=[10])
    packed = generate(model, PROMPTS, params)
    plain = generate(model, PROMPTS, params, pack_weights=False)
    for a, b in zip(packed, plain):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_ATOL)
    with torch.inference_mode(), native.packed_weights(model, rows=4) as active:
        assert active and "qkv" in model.model.layers[0].self_attn.__dict__
        assert model.model.layers[0].self_attn.qkv.kind == (layout if layout != "library" else "mkl")
        assert model.lm_head.packed is not None
        ids = torch.tensor([PROMPTS[0]])
        fast = model(ids)
        model.lm_head.packed = None  # negative control: the packed path is what runs inside the context
        real_qkv = model.model.layers[0].self_attn.qkv
        model.model.layers[0].self_attn.qkv = lambda x: torch.zeros_like(real_qkv(x))
        broken = model(ids)
    assert (broken - fast).abs().max() > 1e-3
    assert "qkv" not in model.model.layers[0].self_attn.__dict__ and model.lm_head.packed is None  # restored
    with torch.no_grad():
        torch.testing.assert_close(model(ids), fast, atol=LOGIT_ATOL, rtol=0)


def _require_kernel(kind: str):
    """Kernel ``kind`` on a machine that runs it (tests that call this are marked ``avx512`` / ``avx2``: elsewhere they
    skip, listed)."""
    ops = cpu_kernel.load(kind)
    assert ops is not None, (
        f"this CPU runs {kind} but its decode kernel is unavailable: {cpu_kernel.unavailable_reason(kind)}"
    )
    return ops


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 33), (8, 5)], ids=["odd-blocks", "partial-block", "one-block"])
@torch.no_grad()
def test_cpu_kernel_matches_f_linear(kind, rows, n, k):
    """Each decode GEMM against F.linear: 1-16 rows (AVX-512: the two-block and one-block paths; AVX2: one to three
    register passes over a block, 6 rows at most each), N not a multiple of 16 (a masked half block and a wholly masked
    upper half), an odd number of 16-column blocks, with and without bias."""
    ops = _require_kernel(kind)
    g = torch.Generator().manual_seed(rows * 100 + n)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    wp = ops.pack([w])
    torch.testing.assert_close(ops.linear(x, wp, n, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, wp, n, None), F.linear(x, w), atol=1e-5, rtol=1e-5)
    w2 = w.clone()
    w2[n - 1, k - 1] += 0.01  # negative control: one weight in the last (partial) block
    assert (ops.linear(x, ops.pack([w2]), n, b) - F.linear(x, w, b)).abs().max() > 1e-3
    x2 = x.clone()
    x2[-1, 0] += 0.01  # negative control: the last row (the last register pass) reads its own input
    assert (ops.linear(x2, wp, n, b)[-1] - F.linear(x, w, b)[-1]).abs().max() > 1e-4


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
@torch.no_grad()
def test_cpu_kernel_reads_strided_input(kind):
    """The op transposes its input itself (a plain loop over any strides): a transposed view and a column slice give
    F.linear's result, as their contiguous copies do. Control: the views are not contiguous."""
    ops = _require_kernel(kind)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(40, 33, generator=g), torch.randn(40, generator=g)
    wp = ops.pack([w])
    for x in (torch.randn(33, 7, generator=g).t(), torch.randn(16, 66, generator=g)[:, ::2]):
        assert not x.is_contiguous()
        torch.testing.assert_close(ops.linear(x, wp, 40, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        assert torch.equal(ops.linear(x, wp, 40, b), ops.linear(x.contiguous(), wp, 40, b))


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
@torch.no_grad()
def test_cpu_kernel_packs_a_list_as_its_concatenation(kind):
    """pack([q, k, v]) is pack([cat([q, k, v])]) bit for bit, with parts that straddle 16-row blocks and a zero-padded
    last block; the fused GEMM then equals the three F.linear outputs side by side. Control: the parts reordered."""
    ops = _require_kernel(kind)
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(n, 24, generator=g) for n in (20, 8, 13)]
    wp = ops.pack(parts)
    assert wp.shape == (3, 24, 16) and torch.equal(wp, ops.pack([torch.cat(parts)]))
    x = torch.randn(5, 24, generator=g)
    want = torch.cat([F.linear(x, w) for w in parts], dim=-1)
    torch.testing.assert_close(ops.linear(x, wp, 41, None), want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(ops.pack(parts[::-1]), wp)
    with pytest.raises(RuntimeError, match="one input size"):
        ops.pack([torch.randn(4, 24), torch.randn(4, 25)])


@torch.no_grad()
def test_packed_weights_of_one_model_are_held_by_one_thread_at_a_time(model):
    """An eval point and the producer sample one snapshot from two threads: the second context waits for the first
    to leave, then packs its own copy (sharing one let the first to leave unpack the layers under the other's
    generation: its later tokens ran other kernels, which round differently, and a resumed run stopped matching)."""
    import threading

    attn = model.model.layers[0].self_attn
    state = {}
    entered = threading.Event()

    def other():
        with torch.no_grad(), native.packed_weights(model, 2):  # grad mode is per thread
            entered.set()
            state["rows"] = model.lm_head.packed.rows

    worker = threading.Thread(target=other)
    with native.packed_weights(model, 4) as on:
        assert on and model.lm_head.packed.rows == 4
        worker.start()
        assert not entered.wait(0.5)  # held: the other thread waits on this context
        with native.packed_weights(model, 8):  # same thread: re-entrant, reuses the copy
            assert model.lm_head.packed.rows == 4
        assert "qkv" in attn.__dict__ and not entered.is_set()
    worker.join(30)
    assert state["rows"] == 2  # packed for its own rows once this one left
    assert model.lm_head.packed is None and "qkv" not in attn.__dict__


@torch.no_grad()
def test_cpu_kernels_share_the_packed_weights():
    """The packed-weight contract is one: a weight packed by the AVX-512 build runs in the AVX2 GEMM and the reverse,
    equal to F.linear (on an AVX-512 machine, which runs both)."""
    wide, narrow = _require_kernel("avx512"), _require_kernel("avx2")
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(70, 40, generator=g), torch.randn(70, generator=g), torch.randn(11, 40, generator=g)
    assert torch.equal(wide.pack([w]), narrow.pack([w]))
    torch.testing.assert_close(narrow.linear(x, wide.pack([w]), 70, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wide.linear(x, narrow.pack([w]), 70, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
def test_cpu_kernel_rejects_bad_input(kind):
    ops = _require_kernel(kind)
    wp = ops.pack([torch.randn(20, 8)])
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        ops.linear(torch.randn(17, 8), wp, 20, None)
    with pytest.raises(RuntimeError, match="N does not match"):
        ops.linear(torch.randn(2, 8), wp, 40, None)
    with pytest.raises(RuntimeError, match="from align_cpu::pack"):
        ops.linear(torch.randn(2, 9), wp, 20, None)


@pytest.mark.parametrize("kind", KERNEL_PARAMS)  # elsewhere the kernel is never built (test_cpu_kernel_is_optional)
def test_cpu_kernel_build_failure_falls_back(tmp_path, kind):
    """A compiler that fails: a warning naming the failure, no half-written library, MKL/oneDNN sampling."""
    import os
    import subprocess
    import sys

    code = """
import warnings, torch
from align.rollout import cpu_kernel, native
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert cpu_kernel.load() is None
print(caught[0].message)
print(native.PackedLinear([torch.nn.Linear(8, 8)], 4).kind)
"""
    env = {**os.environ, "CXX": "false", "XDG_CACHE_HOME": str(tmp_path), "ALIGN_CPU_KERNEL": kind}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    first, kind_used = out.strip().splitlines()[0], out.strip().splitlines()[-1]
    assert "build failed" in first and "exited with 1" in first and "MKL/oneDNN" in first and kind in first
    assert kind_used in ("mkl", "onednn")
    assert [p.name for p in (tmp_path / "align").iterdir() if not p.name.endswith(".lock")] == []


_LOAD = "from align.rollout import cpu_kernel; assert cpu_kernel.load() is not None, cpu_kernel.unavailable_reason()"


@pytest.mark.avx2  # any kernel (the best this CPU runs): the build machinery is shared
@pytest.mark.slow
def test_cpu_kernel_builds_once_under_concurrency_and_after_a_killed_build(tmp_path):
    """Two processes loading at once share one build; a builder killed mid-compile leaves no lock that blocks
    the next build and no half-written library (its leftovers are cleared by the next builder)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    _require_kernel(cpu_kernel.choose()[0])
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    cache = tmp_path / "align"
    victim = subprocess.Popen([sys.executable, "-c", _LOAD], env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(cache.glob("*.cpp")) and time.monotonic() < deadline and victim.poll() is None:
        time.sleep(0.05)
    assert victim.poll() is None and list(cache.glob("*.cpp")), "the build did not start"
    os.killpg(victim.pid, signal.SIGKILL)  # the compiler too
    victim.wait()
    assert not list(cache.glob("*.so"))  # nothing half-written under the final name
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD], env=env) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    names = sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))
    assert len(names) == 1 and names[0].endswith(".so"), names  # one build, leftovers of the killed one cleared


_OPTIONAL = (
    "import logging, torch; from align.rollout import cpu_kernel, native; logging.basicConfig(level=logging.INFO);"
    "assert cpu_kernel.load() is None and cpu_kernel.load() is None; print(cpu_kernel.unavailable_reason());"
    "lin = torch.nn.Linear(8, 8); print(native.PackedLinear([lin], 4).kind)"
)


@pytest.mark.parametrize(
    "env,reason",
    [
        ({"ALIGN_CPU_KERNEL": "0"}, "disabled by ALIGN_CPU_KERNEL=0"),
        ({"ATEN_CPU_CAPABILITY": "default"}, "needs AVX2 and FMA (torch reports DEFAULT)"),  # the probe forced off
        ({"ATEN_CPU_CAPABILITY": "avx2", "ALIGN_CPU_KERNEL": "avx512"}, "needs AVX-512 (torch reports AVX2)"),
        ({"PATH": "", "CXX": ""}, "no C++ compiler found (set CXX, or install g++)"),
    ],
    ids=["disabled", "no-avx2-fma", "avx512-asked-on-avx2", "no-compiler"],
)
def test_cpu_kernel_is_optional(tmp_path, env, reason):
    """ALIGN_CPU_KERNEL=0, a CPU without AVX2 + FMA (torch's probe capped at DEFAULT), a kernel the CPU lacks, no C++
    compiler: no build, the reason said once in the log, and sampling still packs (MKL/oneDNN), on any x86 machine."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **env, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _OPTIONAL], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.splitlines()[0] == reason
    assert proc.stdout.splitlines()[1] in ("mkl", "onednn")
    said = [line for line in proc.stderr.splitlines() if "CPU decode GEMM" in line]
    assert said == [f"INFO:align.rollout.cpu_kernel:CPU decode GEMM: none, the MKL/oneDNN path ({reason})"], said
    assert not (tmp_path / "align").exists()  # nothing was built


@pytest.mark.avx2
def test_cpu_kernel_choice_follows_the_cpu(tmp_path):
    """One place decides: a CPU with AVX2 + FMA but not AVX-512 (torch capped at AVX2) gets the AVX2 kernel, said once;
    ALIGN_CPU_KERNEL=avx2 picks it on an AVX-512 CPU too. Control: uncapped, the best kernel this CPU runs."""
    import os
    import subprocess
    import sys

    code = (
        "import logging, torch; from align.rollout import cpu_kernel, native; logging.basicConfig(level=logging.INFO);"
        "print(native.PackedLinear([torch.nn.Linear(8, 8)], 4).kind, cpu_kernel.load().name, cpu_kernel.describe())"
    )
    cache = os.environ.get("XDG_CACHE_HOME") or str(tmp_path)  # the usual cache: the build is made once per source

    def run(**extra: str) -> tuple[str, list[str]]:
        env = {**os.environ, "XDG_CACHE_HOME": cache, **extra}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return proc.stdout.strip(), [line for line in proc.stderr.splitlines() if "CPU decode GEMM" in line]

    out, said = run(ATEN_CPU_CAPABILITY="avx2")
    assert out.startswith("avx2 align_cpu_avx2 ") and out.endswith("decode GEMM: avx2"), out
    assert said == ["INFO:align.rollout.cpu_kernel:CPU decode GEMM: avx2 (the best this CPU runs; torch reports AVX2)"]
    out, said = run(ALIGN_CPU_KERNEL="avx2")
    assert out.startswith("avx2 ") and len(said) == 1 and "ALIGN_CPU_KERNEL=avx2" in said[0], (out, said)
    best = cpu_kernel.choose()[0]
    out, said = run(ALIGN_CPU_KERNEL="1")
    assert out.startswith(f"{best} ") and len(said) == 1, (out, said)


def test_cpu_kernel_rejects_an_unknown_choice(monkeypatch):
    monkeypatch.setenv("ALIGN_CPU_KERNEL", "avx3")
    with pytest.raises(ValueError, match="ALIGN_CPU_KERNEL='avx3': use 1 .* 0 .* or one of"):
        cpu_kernel.choose()


@pytest.mark.parametrize("layout", [*KERNEL_PARAMS, "mkl", "onednn"])
@pytest.mark.parametrize("m", [3, 6, 40], ids=["fewer-rows-padded", "packed-rows", "more-rows-prefill"])
@torch.no_grad()
def test_packed_linear_matches_the_layers(monkeypatch, layout, m):
    """Every packed layout, fused q|k|v-style, for fewer, exactly and more rows than packed for."""
    import platform

    x86 = platform.machine() in ("x86_64", "AMD64")
    if layout in cpu_kernel.KERNELS:
        _require_kernel(layout)
        monkeypatch.setattr(native, "_kernel_ops", lambda: cpu_kernel.load(layout))
    else:
        monkeypatch.setattr(native, "_kernel_ops", lambda: None)
    if layout == "mkl":
        if x86:
            assert native._mkl_packing_available(torch.float32), "x86 torch wheels ship MKL; the fast path is missing"
        elif not native._mkl_packing_available(torch.float32):
            pytest.skip("this torch build has no MKL (not x86); the oneDNN layout is used")
    elif layout == "onednn":
        monkeypatch.setattr(native, "MKL_MAX_BYTES", 0)
    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(24, n, bias=True) for n in (16, 8, 9)]  # 33 outputs: a partial 16-column block
    for lin in layers:
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
        lin.bias.copy_(torch.randn(lin.bias.shape, generator=g))
    packed = native.PackedLinear(layers, rows=6)
    assert packed.kind == layout
    x = torch.randn(m, 1, 24, generator=g)
    want = torch.cat([lin(x) for lin in layers], dim=-1)
    got = packed(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    swapped = torch.cat([lin(x) for lin in (layers[0], layers[2], layers[1])], dim=-1)  # negative control: k|v swapped
    assert (got - swapped).abs().max() > 1e-3


@pytest.mark.parametrize(
    "temperature,top_k,min_p,penalty", [(1.0, 0, 0.1, 1.0), (0.7, 0, 0.0, 1.3), (1.2, 8, 0.05, 1.5), (1.0, 0, 0.0, 0.8)]
)
def test_min_p_and_repetition_penalty_keep_the_exact_logprob_contract(model, temperature, top_k, min_p, penalty):
    """The sampled-distribution logprob is exactly that of transformers' own processors (live reference:
    RepetitionPenaltyLogitsProcessor on the raw logits with the prompt and the completion so far, then temperature,
    MinPLogitsWarper, top-k); the training basis stays log_softmax(logits / T) of the unprocessed logits."""
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    params = SamplingParams(
        n=3, temperature=temperature, top_k=top_k, min_p=min_p, repetition_penalty=penalty, max_tokens=12, seed=3
    )
    outs = generate(model, PROMPTS, params)
    for c in outs:
        p = PROMPTS[c.prompt_index]
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logits = model(ids)[0, len(p) - 1 : -1]  # (T, V)
        tgt = torch.tensor(c.token_ids)[:, None]
        basis = (logits / temperature).log_softmax(-1).gather(-1, tgt).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), basis, atol=LOGPROB_ATOL, rtol=0)
        q = []
        for t in range(len(c.token_ids)):
            prefix, row = ids[:, : len(p) + t], logits[t : t + 1].clone()
            if penalty != 1.0:
                row = RepetitionPenaltyLogitsProcessor(penalty)(prefix, row)
            row = row / temperature
            if min_p > 0:
                row = MinPLogitsWarper(min_p)(prefix, row)
            row = native.truncate_logits(row, top_k, 1.0)
            q.append(row.log_softmax(-1)[0, c.token_ids[t]])
        q = torch.stack(q)
        assert torch.isfinite(q).all()  # every sampled token lies inside the processed support
        torch.testing.assert_close(torch.tensor(c.sampled_logprobs), q, atol=LOGPROB_ATOL, rtol=0)
        # negative control: the processing really changes the sampled distribution's logprobs
        assert (q - basis).abs().max() > 1e-3


def test_repetition_penalty_changes_what_is_sampled(model):
    plain = generate(model, PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    penalised = generate(model, PROMPTS, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=3.0))
    repeats = lambda cs: sum(len(c.token_ids) - len(set(c.token_ids)) for c in cs)
    assert repeats(penalised) < repeats(plain)  # greedy decoding repeats less under a strong penalty
    assert SamplingParams(repetition_penalty=1.0).to_dict().keys() == SamplingParams().to_dict().keys()
    assert "min_p" not in SamplingParams().to_dict()  # unset: the request an older worker reads
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.0)
