"""Multi-turn rollouts on the native sampler, side by side in one run (issue 26, "Measured" (b) and (c)):

(b) a 4-turn environment: the kept KV cache (``align.rollout.sessions``: each turn prefills only the environment's
    new tokens) vs re-prefilling the whole history every turn (``native.generate`` on prompt + history): prefill
    tokens and time per episode;
(c) the environment machinery's overhead per turn with an instant environment: ``EpisodeRunner`` end to end vs the
    bare session calls of the same turns.

Interleaved repeats, the median of each; the machines are shared, so read the ratios.

    .venv/bin/python benchmarks/bench_env.py [--layers 4 --hidden 256 --episodes 16 --turns 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from align.envs import Step
from align.envs.config import EnvConfig
from align.envs.episodes import EpisodeRunner
from align.envs.runner import EnvRunner
from align.model import ModelConfig, Transformer
from align.rollout.client import NativeClient
from align.rollout.native import generate
from align.rollout.protocol import SamplingParams
from align.rollout.sessions import Session

OBS = [5, 6, 7, 8, 9, 10, 11, 12]  # what the environment says each turn (8 tokens)


class Instant:
    """Says OBS after every turn, never done: the episode runs --turns turns."""

    def __init__(self, **_):
        pass

    def reset(self) -> str:
        return "p"

    def step(self, completion: str) -> Step:
        return Step("o", 0.0, False)


class Tok:
    """Prompt "p" -> 64 tokens, observation "o" -> OBS."""

    eos_token_id = 2

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return list(range(3, 67)) if text == "p" else list(OBS)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x"


def model_of(layers: int, hidden: int) -> Transformer:
    cfg = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      qkv_bias=True, max_position_embeddings=1024)  # fmt: skip
    return Transformer(cfg).init_weights(seed=0).eval()


def kept(model, prompts, params, turns):
    s = Session(model, params)
    s.start(prompts, 1, [params.max_tokens] * len(prompts))
    prefill = sum(len(p) for p in prompts)
    for _ in range(turns - 1):
        rows = list(range(len(prompts)))
        s.next(rows, [OBS] * len(rows), [params.max_tokens] * len(rows))
        prefill += sum(len(OBS) + 1 for _ in rows)
    return prefill


def reprefill(model, prompts, params, turns):
    hist = [list(p) for p in prompts]
    prefill = 0
    for t in range(turns):
        prefill += sum(len(h) for h in hist)
        comps = generate(model, hist, params)
        hist = [h + c.token_ids + (OBS if t < turns - 1 else []) for h, c in zip(hist, comps)]
    return prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = model_of(a.layers, a.hidden)
    prompts = [list(range(3, 67)) for _ in range(a.episodes)]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=a.max_tokens, seed=1, stop_token_ids=[])
    times: dict[str, list[float]] = {"kept": [], "reprefill": [], "runner": [], "session": []}
    tokens: dict[str, int] = {}
    envs = EnvRunner(None, Instant, 0, 0.0)
    runner = EpisodeRunner(envs, _Renderer(), lambda ids: "x", EnvConfig(max_turns=a.turns), a.max_tokens, 1024)
    rows = [{} for _ in range(a.episodes)]
    with torch.inference_mode():
        for _ in range(a.repeats):
            for name, fn in (("kept", kept), ("reprefill", reprefill)):
                t0 = time.perf_counter()
                tokens[name] = fn(model, prompts, params, a.turns)
                times[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            runner.run(NativeClient(model), rows, 1, params)
            times["runner"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            kept(model, prompts, params, a.turns)
            times["session"].append(time.perf_counter() - t0)
    envs.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    n = a.episodes
    print(f"(b) {a.turns}-turn episodes, {n} at once, {a.layers}x{a.hidden} model, {a.max_tokens} tokens per turn")
    print(
        f"    kept KV cache : prefill {tokens['kept'] / n:7.0f} tokens/episode, {med['kept'] / n * 1e3:7.2f} ms/episode"
    )
    print(
        f"    re-prefill    : prefill {tokens['reprefill'] / n:7.0f} tokens/episode, {med['reprefill'] / n * 1e3:7.2f} ms/episode"
    )
    print(
        f"    ratio kept/re-prefill: tokens {tokens['kept'] / tokens['reprefill']:.2f}x, time {med['kept'] / med['reprefill']:.2f}x (target <= 0.5x time)"
    )
    per_turn = (med["runner"] - med["session"]) / (n * a.turns)
    print(f"(c) environment machinery per turn (instant env): {per_turn * 1e6:.0f} us "
          f"({med['runner'] / med['session']:.2f}x the bare session calls)")  # fmt: skip


class _Renderer:
    def first(self, obs):
        return list(range(3, 67))

    def suffix(self, obs):
        return list(OBS)


if __name__ == "__main__":
    main()
