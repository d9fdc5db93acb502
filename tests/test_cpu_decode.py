"""The fused CPU decode attention (``align.rollout.cpu_decode``) against the model's torch path: RoPE, the cache
write and the masked attention of one new token per row, in each kernel's build; and the sampler runs it."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_model, save_hf

from align.attention import KVCache, apply_rope, attend, cache_mask
from align.model import ModelConfig, Transformer, load_pretrained
from align.rollout import cpu_kernel, native

# the builds that carry the op, each marked with the CPU it needs (elsewhere: skipped, listed)
KERNEL_PARAMS = [pytest.param("avx512", marks=pytest.mark.avx512), pytest.param("avx2", marks=pytest.mark.avx2)]


def _ops(kind: str):
    ops = cpu_kernel.load(kind)
    assert ops is not None, f"this CPU runs {kind} but its build is unavailable: {cpu_kernel.unavailable_reason(kind)}"
    return ops


def _setup(B=5, H=6, K=2, D=16, S=12, length=9, L=3, seed=0, qscale=1.0, holes=0.3):
    cfg = ModelConfig("qwen2", 64, H * D, 32, L, H, K, D)
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(cfg, B, S, torch.float32, "cpu")
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    cache.valid[:, : length + 1] = torch.rand(B, length + 1, generator=g) > holes  # left padding and holes
    cache.valid[:, length] = True  # the caller marks the new slot
    cache.length = length
    qkv = torch.randn(B, (H + 2 * K) * D, generator=g) * qscale
    positions = torch.randint(0, 50, (B, 1), generator=g)
    cos, sin = Transformer(cfg).rope(positions, torch.float32)  # (B, 1, 1, D) each
    return cfg, cache, qkv, cos, sin


def _torch_path(cfg, cache, qkv, cos, sin, layer):
    """What ``align.model.Attention`` does after its projections, on a copy of the cache."""
    H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    B = qkv.shape[0]
    q, k, v = qkv[:, None].split([H * D, K * D, K * D], dim=-1)
    q = apply_rope(q.view(B, 1, H, D).transpose(1, 2), cos, sin)
    k = apply_rope(k.view(B, 1, K, D).transpose(1, 2), cos, sin)
    ks, vs = cache.write(layer, k, v.view(B, 1, K, D).transpose(1, 2))
    return attend(q, ks, vs, cache_mask(cache, 1)).transpose(1, 2).reshape(B, H * D)


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
@pytest.mark.parametrize(
    "shape",
    [
        {},  # D 16: the vector path, one vector per head row
        {"B": 1, "H": 4, "K": 4, "D": 8, "length": 0},  # D 8: the scalar path
        {"B": 16, "D": 64, "S": 40},
        {"B": 3, "D": 128, "S": 40, "length": 37},  # slots over three vector blocks, the last one partial
        {"B": 2, "H": 8, "K": 1, "D": 32, "S": 20, "length": 16},
        {"B": 2, "D": 48, "S": 20, "length": 17},  # D 48: no vector path, the scalar one
        {"B": 4, "D": 64, "S": 30, "length": 20, "qscale": 40.0},  # near one-hot softmax: most exps underflow
        {"B": 8, "H": 2, "K": 1, "D": 32, "S": 334, "length": 310, "holes": 0.7},  # whole blocks past a row's slots
    ],
)
def test_decode_attention_matches_the_torch_path(kind, shape):
    """GQA and plain multi-head, one to 16 rows, the first slot only, holes in ``valid``: the output and the written
    cache slot equal the torch path's; the other layers and slots are untouched."""
    ops = _ops(kind)
    cfg, cache, qkv, cos, sin = _setup(**shape)
    H, layer = cfg.num_attention_heads, cfg.num_hidden_layers - 1
    ref = KVCache(cfg, 1, 1, torch.float32, "cpu")
    ref.k, ref.v, ref.valid, ref.length = cache.k.clone(), cache.v.clone(), cache.valid, cache.length
    want = _torch_path(cfg, ref, qkv, cos, sin, layer)
    got = ops.decode_attention(qkv, cos, sin, cache.k, cache.v, cache.valid, layer, cache.length, H)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.k, ref.k, atol=1e-6, rtol=1e-6)  # the new slot, and nothing else
    assert torch.equal(cache.v, ref.v)
    # negative controls: a hidden slot made visible changes the output; a wrong position's RoPE does
    holes = (~cache.valid[:, : cache.length]).nonzero()  # (n, 2): hidden slots before the new one
    if len(holes) and shape.get("qscale", 1.0) == 1.0:  # (near one-hot: a revealed slot may weigh ~0)
        row, slot = holes[0].tolist()
        hidden = cache.valid.clone()
        hidden[row, slot] = True
        shown = ops.decode_attention(qkv, cos, sin, cache.k.clone(), cache.v.clone(), hidden, layer, cache.length, H)
        assert (shown[row] - want[row]).abs().max() > 1e-3
    k = cache.k.clone()  # RoPE at the wrong angles: the written key differs
    ops.decode_attention(qkv, sin, cos, k, cache.v.clone(), cache.valid, layer, cache.length, H)
    assert (k - ref.k).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
def test_decode_attention_rejects_bad_input(kind):
    ops = _ops(kind)
    _, cache, qkv, cos, sin = _setup()
    with pytest.raises(RuntimeError, match="qkv"):
        ops.decode_attention(qkv[:, 1:], cos, sin, cache.k, cache.v, cache.valid, 0, cache.length, 6)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.decode_attention(qkv, cos, sin, cache.k, cache.v, cache.valid, 3, cache.length, 6)
    with pytest.raises(RuntimeError, match="valid"):
        ops.decode_attention(qkv, cos, sin, cache.k, cache.v, cache.valid.int(), 0, cache.length, 6)


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
@torch.inference_mode()
def test_the_sampler_decodes_through_the_fused_attention(tmp_path, monkeypatch, kind):
    """Inside ``packed_weights`` every decode step of every layer runs the fused op (counted), a prefill does not,
    and the logits equal the model's own layers'. Control: the unpacked model never calls it."""
    model = load_pretrained(save_hf(hf_model("qwen2"), tmp_path))
    calls = []
    real = cpu_kernel.load(kind).decode_attention

    class Spy:  # the op, counted
        name = f"align_cpu_{kind}"

        def __getattr__(self, attr):
            return getattr(cpu_kernel.load(kind), attr)

        def decode_attention(self, *args):
            calls.append(args[6])
            return real(*args)

    monkeypatch.setattr(native, "_kernel_ops", lambda: Spy())

    def decode():
        cache = KVCache(model.config, 2, 12, torch.float32, "cpu")
        ids = torch.tensor([[1, 5, 9, 13], [0, 7, 3, 2]])
        cache.valid[:, :4] = True
        cache.valid[1, 0] = False  # a left-padded row
        out = [model(ids, positions=torch.tensor([[0, 1, 2, 3], [0, 0, 1, 2]]), cache=cache)[:, -1]]
        cache.length = 4
        for t in range(4, 9):
            cache.valid[:, t] = True
            tok = out[-1].argmax(-1)[:, None]
            out.append(model(tok, positions=torch.tensor([[t], [t - 1]]), cache=cache)[:, -1])
            cache.length += 1
        return torch.stack(out)

    plain = decode()
    assert calls == []
    with native.packed_weights(model, rows=2):
        fused = decode()
    assert calls == list(range(model.config.num_hidden_layers)) * 5
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KERNEL_PARAMS)
@torch.inference_mode()
def test_rows_past_the_gemm_kernel_still_decode_fused(tmp_path, monkeypatch, kind):
    """More rows than the kernel's GEMM takes (its GEMMs then run on MKL / oneDNN): the attention is still the fused
    op, each row over its own valid slots, rows left-padded to lengths 1-20 (a partial call's resumed rows beside
    fresh ones), and the sampler draws what the unpacked model draws. Failed before (the op only with the kernel's
    GEMM: <= 16 rows)."""
    model = load_pretrained(save_hf(hf_model("qwen2"), tmp_path))
    calls = []
    real = _ops(kind)

    class Spy:
        name = f"align_cpu_{kind}"

        def __getattr__(self, attr):
            return getattr(real, attr)

        def decode_attention(self, *args):
            calls.append(args[0].shape[0])
            return real.decode_attention(*args)

    monkeypatch.setattr(native, "_kernel_ops", lambda: Spy())
    rows = cpu_kernel.MAX_ROWS + 4
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (1 + (7 * i) % 20,), generator=g).tolist() for i in range(rows)]
    params = native.SamplingParams(n=1, max_tokens=6, seed=3)
    want = native.generate(model, prompts, params, pack_weights=False)
    assert calls == []
    got = native.generate(model, prompts, params)
    assert calls and calls[0] == rows  # every decode step of every layer, the first with all the rows
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
