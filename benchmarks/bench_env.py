"""Multi-turn rollouts on the native sampler, side by side in one run (issue 26, "Measured" (b) and (c)):

(b) a 4-turn environment: the kept KV cache (``align.rollout.sessions``: each turn prefills only the environment's
    new tokens) vs re-prefilling the whole history every turn (``native.generate`` on prompt + history): prefill
    tokens and time per episode;
(c) the environment machinery's overhead per turn with an instant environment: ``EpisodeRunner`` end to end vs the
    bare session calls of the same turns;
(a) with ``--spool``: an environment whose step sleeps 0-200 ms at random, on the real vLLM CPU worker
    (``.venv-rollout``): episodes/s with per-episode submission (``EpisodeRunner``: each episode's next turn goes out
    as soon as its step returns) vs a turn-wave barrier (every live episode's turn in one request, then every step).

Interleaved repeats, the median of each; the machines are shared, so read the ratios.

    .venv/bin/python benchmarks/bench_env.py [--layers 4 --hidden 256 --episodes 16 --turns 4 --repeats 3] [--spool]
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
# the runner's turns must end with a stop token (a turn cut by max_tokens ends its episode): 1/8 of the vocabulary
# stops, so a turn is ~8 tokens and almost never reaches 64
STOPS = list(range(0, 512, 8))


class Instant:
    """Says OBS after every turn, never done: the episode runs --turns turns."""

    def __init__(self, **_):
        pass

    def reset(self) -> str:
        return "p"

    def step(self, completion: str) -> Step:
        return Step("o", 0.0, False)


class Sleepy(Instant):
    """Sleeps 0-200 ms per step (seeded by the episode), then asks again. Its instances share nothing: concurrent."""

    concurrent = True

    def __init__(self, seed: int = 0, **_):
        import random

        self.rng = random.Random(seed)

    def step(self, completion: str) -> Step:
        time.sleep(self.rng.uniform(0.0, 0.2))
        return Step("o", 0.0, False)


def bench_spool(a: argparse.Namespace) -> None:
    """(a): per-episode submission vs a turn-wave barrier on one real vLLM CPU worker."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from align.model import save_pretrained
    from align.rollout.client import make_rollout_client, spawn_worker

    tmp = Path(tempfile.mkdtemp(prefix="bench_env_"))
    model = model_of(a.layers, a.hidden)
    path = save_pretrained(model, tmp / "model")
    worker = spawn_worker(tmp / "spool", model=path, log_path=tmp / "worker.log", in_process=True,
                          max_model_len=1024, dtype="float32")  # fmt: skip
    client = make_rollout_client("spool", spool=tmp / "spool", timeout_s=600, worker=worker)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=64, seed=1, stop_token_ids=STOPS)
    rows = [{"seed": i} for i in range(a.episodes)]
    # in process (--env-workers 0) Sleepy is ``concurrent``: each episode's steps run on its own thread under its own
    # lock, so the episodes' sleeps overlap, as the barrier's do in its thread pool; --env-workers N: worker processes
    envs = EnvRunner(f"{Path(__file__).resolve()}:Sleepy", Sleepy, a.env_workers, 0.0)
    runner = EpisodeRunner(envs, _Renderer(), lambda ids: "x", EnvConfig(max_turns=a.turns), 64, 1024)

    def barrier() -> None:
        hist = [list(range(3, 67)) for _ in rows]
        sleepers = [Sleepy(seed=i) for i in range(len(rows))]
        with ThreadPoolExecutor(len(rows)) as pool:
            for t in range(a.turns):
                comps = client.generate(hist, params)  # one request: every live episode's turn
                list(pool.map(lambda e: e.step("x"), sleepers))  # then every step, all waited for
                hist = [h + c.token_ids + OBS for h, c in zip(hist, comps)]

    times: dict[str, list[float]] = {"per_episode": [], "barrier": []}
    try:
        runner.run(client, rows[:2], 1, params)  # warm-up
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            runner.run(client, rows, 1, params)
            times["per_episode"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            barrier()
            times["barrier"].append(time.perf_counter() - t0)
    finally:
        envs.close()
        client.close()
        worker.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    n = a.episodes
    print(f"(a) spool (vLLM CPU), {n} episodes x {a.turns} turns, steps sleep 0-200 ms")
    print(f"    per-episode submission: {n / med['per_episode']:6.2f} episodes/s")
    print(f"    turn-wave barrier     : {n / med['barrier']:6.2f} episodes/s")
    print(f"    ratio: {med['barrier'] / med['per_episode']:.2f}x (target >= 1.5x)")


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
    ap.add_argument("--spool", action="store_true", help="also (a): the real vLLM CPU worker (.venv-rollout)")
    ap.add_argument("--env-workers", type=int, default=0, help="(a): environment worker processes (0 = in process)")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = model_of(a.layers, a.hidden)
    prompts = [list(range(3, 67)) for _ in range(a.episodes)]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=a.max_tokens, seed=1, stop_token_ids=[])
    one = SamplingParams(n=1, temperature=1.0, max_tokens=1, seed=1, stop_token_ids=[])  # a turn = its prefill
    every = SamplingParams(n=1, temperature=1.0, max_tokens=1, seed=1, stop_token_ids=list(range(512)))  # stops
    times: dict[str, list[float]] = {"kept": [], "reprefill": [], "runner": [], "session": [], "kept1": [],
                                     "reprefill1": []}  # fmt: skip
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
                fn(model, prompts, one, a.turns)
                times[name + "1"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            runner.run(NativeClient(model), rows, 1, every)  # the same turns as kept(one): 1-token turns
            times["runner"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            kept(model, prompts, one, a.turns)
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
    print(f"    prefill alone (1 token per turn): kept {med['kept1'] / n * 1e3:.2f} ms/episode, re-prefill "
          f"{med['reprefill1'] / n * 1e3:.2f} ms/episode: {med['kept1'] / med['reprefill1']:.2f}x")  # fmt: skip
    per_turn = (med["runner"] - med["session"]) / (n * a.turns)
    print(f"(c) environment machinery per turn (instant env): {per_turn * 1e6:.0f} us "
          f"({med['runner'] / med['session']:.2f}x the bare session calls)")  # fmt: skip
    if a.spool:
        bench_spool(a)


class _Renderer:
    def first(self, obs):
        return list(range(3, 67))

    def suffix(self, obs):
        return list(OBS)


if __name__ == "__main__":
    main()
