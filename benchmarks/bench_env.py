"""Multi-turn rollouts, side by side in one run (issue 26, "Measured" (a), (b) and (c)):

(b) a 4-turn environment on the native sampler: the kept KV cache (``align.rollout.sessions``: each turn prefills
    only the environment's new tokens) vs re-prefilling the whole history every turn (``native.generate`` on prompt +
    history): prefill tokens, prefill time (1-token turns) and end-to-end time per episode, one row per
    ``--obs-tokens`` (the environment's reply per turn: 8 = a short answer, a few hundred = compiler errors or tool
    output);
(c) the environment machinery's overhead per turn with an instant environment: ``EpisodeRunner`` end to end vs the
    bare session calls of the same turns;
(a) with ``--spool``: an environment whose step sleeps 0-200 ms at random (``--spool-sleep-s``), on the vLLM CPU worker
    (``.venv-rollout``): episodes/s with per-episode submission (``EpisodeRunner``: each episode's next turn goes out
    as soon as its step returns) vs a turn-wave barrier on the same client (every live episode's turn in one request,
    then every live episode's step at once, all waited for; an episode whose turn was cut by max_tokens is stepped,
    then dropped, as the runner does). Turns end on a stop token (1 id in ``--spool-turn-tokens`` stops: that many
    tokens on average; max_tokens is 8x that, so a cut is rare). Also printed: the ratio the sleeps alone would give
    (zero generation time: the barrier waits for the slowest sleep of each turn, per-episode submission for the
    slowest episode's sum of sleeps), the figure generation and request overhead pull the measured ratio from.

Repeats interleaved (per-episode and barrier alternate, their order swapped every repeat), medians and each repeat's
ratio (the spread); the load average is printed beside the figures: the machines are shared, so read the ratios.
On a shared machine use ``--threads 1``: two torch threads beside other jobs' made (b) 10-100x slower, and noisy.

    .venv/bin/python benchmarks/bench_env.py [--layers 4 --hidden 256 --episodes 16 --turns 4 --max-tokens 32
        --obs-tokens 8 300 --repeats 3 --threads 0] [--spool [--spool-only] --spool-episodes 16 --spool-turns 16
        --spool-turn-tokens 4 --spool-layers 2 --spool-hidden 128 --spool-sleep-s 0.2 --env-workers 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
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

PROMPT = list(range(3, 67))  # the first prompt (64 tokens)
OBS = [5, 6, 7, 8, 9, 10, 11, 12]  # what the environment says each turn in (a) and (c) (8 tokens)
CONTEXT = 4096


def observation(n: int) -> list[int]:
    """An ``n``-token environment reply (ids below the vocabulary of 512)."""
    return [5 + k % 500 for k in range(n)]


class Instant:
    """Says OBS after every turn, never done: the episode runs --turns turns."""

    def __init__(self, **_):
        pass

    def reset(self) -> str:
        return "p"

    def step(self, completion: str) -> Step:
        return Step("o", 0.0, False)


class Sleepy(Instant):
    """Sleeps 0-``max_s`` s per step (seeded by the episode), then asks again. Its instances share nothing:
    concurrent."""

    concurrent = True

    def __init__(self, seed: int = 0, max_s: float = 0.2, **_):
        self.rng, self.max_s = random.Random(seed), max_s

    def step(self, completion: str) -> Step:
        time.sleep(self.rng.uniform(0.0, self.max_s))
        return Step("o", 0.0, False)


def sleeps_alone(episodes: int, turns: int) -> float:
    """The barrier / per-episode time ratio with zero generation time, from the same seeded sleeps as ``Sleepy``."""
    rngs = [random.Random(i) for i in range(episodes)]
    s = [[rng.uniform(0.0, 0.2) for _ in range(turns)] for rng in rngs]  # (episodes, turns)
    return sum(max(col) for col in zip(*s)) / max(sum(row) for row in s)


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def bench_spool(a: argparse.Namespace) -> None:
    """(a): per-episode submission vs a turn-wave barrier on one real vLLM CPU worker."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from align.model import save_pretrained
    from align.rollout.client import make_rollout_client, spawn_worker

    n, turns, k = a.spool_episodes, a.spool_turns, a.spool_turn_tokens
    stops = list(range(0, 512, k))  # 1 id in k stops: a turn is ~k tokens
    tmp = Path(tempfile.mkdtemp(prefix="bench_env_"))
    path = save_pretrained(model_of(a.spool_layers, a.spool_hidden), tmp / "model")
    worker = spawn_worker(tmp / "spool", model=path, log_path=tmp / "worker.log", in_process=True,
                          max_model_len=CONTEXT, dtype="float32")  # fmt: skip
    client = make_rollout_client("spool", spool=tmp / "spool", timeout_s=600, worker=worker)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=8 * k, seed=1, stop_token_ids=stops)
    rows = [{"seed": i, "max_s": a.spool_sleep_s} for i in range(n)]
    # in process (--env-workers 0) Sleepy is ``concurrent``: each episode's steps run on its own thread under its own
    # lock, so the episodes' sleeps overlap, as the barrier's do in its thread pool; --env-workers N: worker processes
    envs = EnvRunner(f"{Path(__file__).resolve()}:Sleepy", Sleepy, a.env_workers, 0.0)
    runner = EpisodeRunner(envs, _Renderer(), lambda ids: "x", EnvConfig(max_turns=turns), 8 * k, CONTEXT)

    def per_episode() -> int:
        return sum(e.policy_tokens for e in runner.run(client, rows, 1, params))

    def barrier() -> int:
        hist = [list(PROMPT) for _ in rows]
        sleepers = [Sleepy(**row) for row in rows]
        live, tokens = list(range(n)), 0
        with ThreadPoolExecutor(n) as pool:
            for t in range(turns):
                p = dataclasses.replace(params, seed=params.seed + 104_729 * t)
                comps = client.generate([hist[i] for i in live], p)  # one request: every live episode's turn
                list(pool.map(lambda i: sleepers[i].step("x"), live))  # then every step, all waited for
                tokens += sum(len(c.token_ids) for c in comps)
                for i, c in zip(live, comps):
                    hist[i] += c.token_ids + OBS
                live = [i for i, c in zip(live, comps) if c.finish_reason == "stop"]  # cut: stepped, then ends
                if not live:
                    break
        return tokens

    times: dict[str, list[float]] = {"per_episode": [], "barrier": []}
    tokens: dict[str, list[int]] = {"per_episode": [], "barrier": []}
    before = load()
    try:
        runner.run(client, rows[:2], 1, params)  # warm-up
        for r in range(a.repeats):
            order = (("per_episode", per_episode), ("barrier", barrier))
            for name, fn in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                tokens[name].append(fn())
                times[name].append(time.perf_counter() - t0)
    finally:
        envs.close()
        client.close()
        worker.shutdown()
    med = {key: statistics.median(v) for key, v in times.items()}
    ratios = [b / p for b, p in zip(times["barrier"], times["per_episode"])]
    tok = {key: statistics.mean(v) / n for key, v in tokens.items()}
    print(f"(a) spool (vLLM CPU), {n} episodes x {turns} turns of ~{k} tokens (max {8 * k}), steps sleep "
          f"0-{a.spool_sleep_s * 1e3:.0f} ms, {a.spool_layers}x{a.spool_hidden} model, {a.repeats} repeats; "
          f"{before} -> {load()}")  # fmt: skip
    for key, label in (("per_episode", "per-episode submission"), ("barrier", "turn-wave barrier     ")):
        rates = ", ".join(f"{n / x:.2f}" for x in times[key])
        print(f"    {label}: {n / med[key]:6.2f} episodes/s (each repeat: {rates}), {tok[key]:.1f} policy "
              "tokens/episode")  # fmt: skip
    print(f"    ratio: {statistics.median(ratios):.2f}x median (each repeat: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"min {min(ratios):.2f}, max {max(ratios):.2f}) (target >= 1.5x); the sleeps alone would give "
          f"{sleeps_alone(n, turns):.2f}x")  # fmt: skip


def model_of(layers: int, hidden: int) -> Transformer:
    cfg = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      qkv_bias=True, max_position_embeddings=CONTEXT)  # fmt: skip
    return Transformer(cfg).init_weights(seed=0).eval()


def kept(model: Transformer, prompts: list[list[int]], params: SamplingParams, turns: int, obs: list[int]) -> int:
    """``turns`` turns on one ``Session``; returns the prefill tokens (each later turn: obs + the last sampled id)."""
    s = Session(model, params)
    s.start(prompts, 1, [params.max_tokens] * len(prompts))
    prefill = sum(len(p) for p in prompts)
    for _ in range(turns - 1):
        rows = list(range(len(prompts)))
        s.next(rows, [obs] * len(rows), [params.max_tokens] * len(rows))
        prefill += (len(obs) + 1) * len(rows)
    return prefill


def reprefill(model: Transformer, prompts: list[list[int]], params: SamplingParams, turns: int, obs: list[int]) -> int:
    """The same turns, each a fresh ``generate`` on prompt + history; returns the prefill tokens."""
    hist = [list(p) for p in prompts]
    prefill = 0
    for t in range(turns):
        prefill += sum(len(h) for h in hist)
        comps = generate(model, hist, params)
        hist = [h + c.token_ids + (obs if t < turns - 1 else []) for h, c in zip(hist, comps)]
    return prefill


def bench_native(a: argparse.Namespace) -> None:
    """(b) for each --obs-tokens, then (c)."""
    torch.manual_seed(0)
    model = model_of(a.layers, a.hidden)
    n = a.episodes
    prompts = [list(PROMPT) for _ in range(n)]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=a.max_tokens, seed=1, stop_token_ids=[])
    one = SamplingParams(n=1, temperature=1.0, max_tokens=1, seed=1, stop_token_ids=[])  # a turn = its prefill
    every = SamplingParams(n=1, temperature=1.0, max_tokens=1, seed=1, stop_token_ids=list(range(512)))  # stops
    before = load()
    print(f"(b) {a.turns}-turn episodes, {n} at once, {a.layers}x{a.hidden} model, {a.max_tokens} sampled tokens per "
          f"turn, {torch.get_num_threads()} threads; per episode, kept KV cache vs re-prefill (ratio; target <= 0.5x "
          "time)")  # fmt: skip
    print(f"    {'obs tokens':>10} | {'prefill tokens':^26} | {'prefill ms (1-token turns)':^28} | "
          f"{'end to end ms':^28}")  # fmt: skip
    with torch.inference_mode():
        for size in a.obs_tokens:
            obs = observation(size)
            times: dict[str, list[float]] = {"kept": [], "reprefill": [], "kept1": [], "reprefill1": []}
            tokens: dict[str, int] = {}
            for r in range(a.repeats):
                order = (("kept", kept), ("reprefill", reprefill))
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    tokens[name] = fn(model, prompts, params, a.turns, obs)
                    times[name].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    fn(model, prompts, one, a.turns, obs)
                    times[name + "1"].append(time.perf_counter() - t0)
            med = {key: statistics.median(v) / n * 1e3 for key, v in times.items()}  # ms per episode
            tk, tr = tokens["kept"] / n, tokens["reprefill"] / n
            print(f"    {size:>10} | {tk:6.0f} vs {tr:6.0f} = {tk / tr:.2f}x | "
                  f"{med['kept1']:7.1f} vs {med['reprefill1']:7.1f} = {med['kept1'] / med['reprefill1']:.2f}x | "
                  f"{med['kept']:7.1f} vs {med['reprefill']:7.1f} = {med['kept'] / med['reprefill']:.2f}x")  # fmt: skip
        envs = EnvRunner(None, Instant, 0, 0.0)
        runner = EpisodeRunner(envs, _Renderer(), lambda ids: "x", EnvConfig(max_turns=a.turns), a.max_tokens, CONTEXT)
        rows = [{} for _ in range(n)]
        times = {"runner": [], "session": []}
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            runner.run(NativeClient(model), rows, 1, every)  # the same turns as kept(one): 1-token turns
            times["runner"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            kept(model, prompts, one, a.turns, OBS)
            times["session"].append(time.perf_counter() - t0)
        envs.close()
    med = {key: statistics.median(v) for key, v in times.items()}
    per_turn = (med["runner"] - med["session"]) / (n * a.turns)
    print(f"(c) environment machinery per turn (instant env, {len(OBS)}-token observations): {per_turn * 1e6:.0f} us "
          f"({med['runner'] / med['session']:.2f}x the bare session calls); {before} -> {load()}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="(b), (c): the model's layers")
    ap.add_argument("--hidden", type=int, default=256, help="(b), (c): the model's width")
    ap.add_argument("--episodes", type=int, default=16, help="(b), (c): episodes at once")
    ap.add_argument("--turns", type=int, default=4, help="(b), (c): turns per episode")
    ap.add_argument("--max-tokens", type=int, default=32, help="(b), (c): sampled tokens per turn")
    ap.add_argument(
        "--obs-tokens", type=int, nargs="+", default=[8, 300], help="(b): environment reply sizes, a row each"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--spool", action="store_true", help="also (a): the real vLLM CPU worker (.venv-rollout)")
    ap.add_argument("--spool-only", action="store_true", help="(a) alone (implies --spool)")
    ap.add_argument("--spool-episodes", type=int, default=16, help="(a): episodes at once")
    ap.add_argument("--spool-turns", type=int, default=16, help="(a): turns per episode (at 8: <= 1.43x)")
    ap.add_argument("--spool-turn-tokens", type=int, default=4, help="(a): mean tokens per turn (1 id in this stops)")
    ap.add_argument("--spool-layers", type=int, default=2, help="(a): the model's layers")
    ap.add_argument("--spool-hidden", type=int, default=128, help="(a): the model's width (vLLM CPU: head_dim >= 32)")
    ap.add_argument("--spool-sleep-s", type=float, default=0.2, help="(a): the longest step sleep (the issue: 0.2 s)")
    ap.add_argument("--env-workers", type=int, default=0, help="(a): environment worker processes (0 = in process)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.spool_only:
        bench_native(a)
    if a.spool or a.spool_only:
        bench_spool(a)


class _Renderer:
    def first(self, obs):
        return list(PROMPT)

    def suffix(self, obs):
        return list(OBS)


if __name__ == "__main__":
    main()
