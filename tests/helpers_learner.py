"""What the learner tests share (tests/test_learner.py on the CPU, tests/test_gpu.py on CUDA, tests/test_train_lora.py):
a tiny random-weight model, a fake sampler step, a small TrainConfig, its tensor batch, and the plain-logits loss
the fused path is compared with."""

from __future__ import annotations

import torch
from helpers_models import SMALL

from align import kernels, learner
from align.attention import PackedLayout, Segment
from align.device import Placement
from align.grpo import normalisers, policy_loss
from align.model import ModelConfig, Transformer
from align.rollout.protocol import Completion, SamplingParams
from align.train import TrainConfig

CPU = Placement(torch.device("cpu"), "fp32")


def tiny(tied: bool, seed: int = 0, vocab: int = 300, layers: int = 2) -> Transformer:
    shape = {"vocab_size": vocab, "num_hidden_layers": layers, "max_position_embeddings": 64}
    cfg = ModelConfig(**{**SMALL, **shape, "tie_word_embeddings": tied})
    return Transformer(cfg).init_weights(std=0.2, seed=seed)


def fake_step(N: int = 10, V: int = 300, seed: int = 0) -> tuple[list[list[int]], list[Completion]]:
    """Prompts and completions of different lengths (what the sampler returns), with random behaviour logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (4,), generator=g)]
    comps = []
    for i in range(N):
        k = int(torch.randint(1, 12, (1,), generator=g))
        lp = (-torch.rand(k, generator=g) * 3).tolist()
        comps.append(Completion(prompt_index=i % 4, sample_index=i // 4, token_ids=torch.randint(0, V, (k,),
                                generator=g).tolist(), logprobs=lp, sampled_logprobs=lp, finish_reason="length"))  # fmt: skip
    return prompts, comps


def cfg(**kw) -> TrainConfig:
    base = {"out": "unused", "micro_batch_size": 64, "prompts_per_step": 4, "group_size": 3, "max_tokens": 11,
            "temperature": 0.9, "device": "cpu"}  # fmt: skip
    loss = {k: kw.pop(k) for k in list(kw) if k in ("name", "kl_coef", "entropy_coef", "eps_low", "eps_high")}
    c = TrainConfig(**{**base, **kw})
    for k, v in loss.items():
        setattr(c.loss, k, v)
    return c


def batch_for(model: Transformer, N: int = 10, seed: int = 0) -> learner.Batch:
    prompts, comps = fake_step(N, model.config.vocab_size, seed)
    inputs, targets, mask, _, behav = learner.sequence_batch(prompts, comps, 3, "cpu")
    adv = torch.randn(N, generator=torch.Generator().manual_seed(seed + 1))
    mask[3] = False  # an invalid completion: nothing to learn from
    return learner.Batch(inputs, targets, mask, adv, behav)


def plain_loss(model, b: learner.Batch, c: TrainConfig, head_scale: float = 1.0):
    """The path the fused one replaces: full (B, L, V) logits, then the reference log_softmax."""
    hidden = model(b.inputs, return_hidden=True)
    logits = hidden @ (model.lm_head.weight * head_scale).T  # (B, L, V)
    lp, ent = kernels.token_logprobs(logits, b.targets, c.temperature, backend="reference")
    tokens, seqs = normalisers(b.mask)
    return policy_loss(c.loss, lp, lp.detach(), b.advantages, b.mask, behav_logprobs=b.behav, entropy=ent,
                       total_tokens=tokens, total_seqs=seqs)  # fmt: skip


def siblings_visible(layout: PackedLayout) -> PackedLayout:
    """The layout with the first two completions of every segment merged into one span: the second sees the first."""
    segs = []
    for s in layout.segments:
        comps = list(s.completions)
        if len(comps) >= 2:
            (c0, n0), (_, n1) = comps[:2]
            comps[:2] = [(c0, n0 + n1)]
        segs.append(Segment(s.start, s.prompt, comps))
    return PackedLayout(segs, layout.length, layout.backend)


def rev_model(seed: int = 0):
    """A random-weight model of the built-in reverse task's shape (the environment tests' policy)."""
    from align.tasks import reverse

    return Transformer(reverse.model_config(reverse.tokenizer())).init_weights(std=0.2, seed=seed).eval()


PARAMS = SamplingParams(n=1, temperature=1.0, max_tokens=8, seed=11, stop_token_ids=[2])
