"""The gateway's cost per request (issue 38, "Measured" (a), in part): concurrent multi-turn tool-style agents (each
on a kept-alive connection, as the ``openai`` client keeps one) through the gateway (HTTP + JSON + capture +
rendering, ``align.gateway``) vs the same turns as bare ``client.generate`` calls on the captured prompt ids, on the
native sampler with a random-weight model, side by side in one run: one generate per request vs bare calls one per
request, and ``--gateway-batch-ms`` vs bare calls one per turn wave (the environment path's batching, without its
kept KV cache). Episodes/s by wall clock and by the process's CPU time (on a shared machine the wall clock mostly
measures the wait for a core), and per request the CPU spent in generation and around it.

Needs ``jinja2`` (the ``hf`` extra: a ChatML template renders the messages). The tokenizer is bytes (one id per
byte + ``<|im_end|>``), so ids are exact without a trained vocabulary. On a shared machine use ``--threads 1``.

    .venv/bin/python benchmarks/bench_gateway.py [--episodes 32 --turns 3 --max-tokens 16 --layers 2 --hidden 128
        --threads 1 --batch-ms 500]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import http.client
import json
import os
import re
import threading
import time

import torch
from common import numeric_flags

from align.chat import ChatTemplate, TurnRenderer
from align.gateway.agents import Batcher
from align.gateway.server import Gateway
from align.model import ModelConfig, Transformer
from align.rollout.client import NativeClient
from align.rollout.protocol import SamplingParams

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
END = "<|im_end|>"


class ByteTokenizer:
    """One id per byte (3..258), ``<|im_end|>`` = 2 (the stop), ``<|im_start|>`` = 1."""

    def __init__(self) -> None:
        self.eos_token_id, self.special_tokens_map = [2], {"eos_token": END}
        self.chat_template = ChatTemplate(CHATML, self.special_tokens_map)  # compiled once, as HFTokenizer holds it

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        for part in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            out += (
                [{"<|im_start|>": 1, END: 2}[part]] if part in ("<|im_start|>", END) else [3 + b for b in part.encode()]
            )
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        special = {1: "<|im_start|>", 2: END}
        text = bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")
        if skip_special_tokens:
            return text
        return "".join(special.get(i, bytes([i - 3]).decode("latin-1") if i >= 3 else "") for i in ids)


def post(conn: http.client.HTTPConnection, key: str, body: dict) -> dict:
    """One request on the agent's kept-alive connection (as the openai client's httpx pool keeps it)."""
    data = json.dumps(body).encode()
    conn.request("POST", "/v1/chat/completions", data, {"Authorization": f"Bearer {key}"})
    r = conn.getresponse()
    out = r.read()
    assert r.status == 200, out
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    numeric_flags(ap, episodes=32, turns=3, max_tokens=16, layers=2, hidden=128, threads=1)
    ap.add_argument("--batch-ms", type=float, default=20.0, help="--gateway-batch-ms of the batched pass")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(
        model_type="qwen2", vocab_size=259, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        max_position_embeddings=4096, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = Transformer(cfg).eval()
    client = NativeClient(model)
    tok = ByteTokenizer()
    params = SamplingParams(n=1, temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=[2], seed=0)
    lock = threading.Lock()
    gen_s, gen_cpu = [0.0], [0.0]
    sizes: list[float] = []  # the batched pass's mean generate size

    def generate(prompts: list[list[int]], max_tokens: int, seed: int | None) -> list:
        with lock:  # one generate at a time on the model, as the trainer's gateway does
            t0, c0 = time.perf_counter(), time.thread_time()
            out = client.generate(prompts, dataclasses.replace(params, max_tokens=max_tokens, seed=seed))
            gen_s[0] += time.perf_counter() - t0
            gen_cpu[0] += time.thread_time() - c0
            return out

    def through_gateway(batch_ms: float) -> tuple[float, float, float, float, list]:
        """(wall s, process CPU s, generation wall s, generation CPU s, captures) of the agents through a fresh
        gateway (the CPU of every thread: the agents' HTTP clients, the server, the capture, the sampler)."""
        left = [args.episodes]  # agents not done (the batcher sends a batch once each has a request in it)
        count = threading.Lock()
        batcher = Batcher(generate, batch_ms, lambda: left[0]) if batch_ms else None

        def sample(ids: list[int], max_tokens: int, cap: object) -> object:
            return batcher(ids, max_tokens, 0) if batcher else generate([ids], max_tokens, 0)[0]

        gw = Gateway(sample, lambda tools: TurnRenderer(tok, tools=tools), tok.decode, "m", args.max_tokens, 4096)
        host, port = gw.httpd.server_address[:2]

        def agent(key: str) -> None:
            msgs = [{"role": "user", "content": "Use the tool, then answer."}]
            conn = http.client.HTTPConnection(host, port, timeout=600)
            for t in range(args.turns):
                r = post(conn, key, {"model": "m", "messages": msgs})
                msgs += [r["choices"][0]["message"], {"role": "tool", "content": f"result {t}: 42"}]
            conn.close()
            with count:
                left[0] -= 1

        keys = [gw.open_episode() for _ in range(args.episodes)]
        gen_s[0] = gen_cpu[0] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        with cf.ThreadPoolExecutor(args.episodes) as pool:
            list(pool.map(agent, keys))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        caps = [gw.close_episode(k) for k in keys]
        gw.close()
        if batcher:
            batcher.close()
            sizes.append(sum(batcher.batches) / len(batcher.batches))
        assert all(len(c.branches) == 1 for c in caps), "every agent extends its history: one trajectory each"
        return wall, cpu, gen_s[0], gen_cpu[0], caps

    def turn_prompts(caps: list) -> list[list[tuple[list[int], int]]]:
        """Per turn, each episode's (prompt ids, sampled tokens) as the gateway captured them."""
        waves: list[list[tuple[list[int], int]]] = [[] for _ in range(args.turns)]
        for c in caps:
            b, at = c.branches[0], 0
            for t, turn in enumerate(b.turns):
                at += turn["env_tokens"]
                waves[t].append((b.prompt_ids + b.token_ids[:at], turn["policy_tokens"]))
                at += turn["policy_tokens"]
        return waves

    def bare(caps: list, batched: bool) -> tuple[float, float]:
        """The same turns as bare generate calls: one per request, or one per turn wave (all episodes' turn t in one
        call, as the environment path batches its turns; it also keeps each episode's KV cache, which this does not)."""
        t0, c0 = time.perf_counter(), time.process_time()
        for wave in turn_prompts(caps):
            for group in [wave] if batched else [[w] for w in wave]:
                generate([p for p, _ in group], max(n for _, n in group), 0)
        return time.perf_counter() - t0, time.process_time() - c0

    print(
        f"threads {torch.get_num_threads()} | load {os.getloadavg()[0]:.2f} | {args.episodes} concurrent agents x "
        f"{args.turns} turns | max_tokens {args.max_tokens} | model {args.layers} layers x {args.hidden}"
    )
    rows = []
    for label, batch_ms, ref_label, batched in (
        ("gateway, a generate per request", 0.0, "bare generate per request", False),
        (f"gateway --gateway-batch-ms {args.batch_ms:g}", args.batch_ms, "bare generate per turn wave", True),
    ):
        wall, cpu, gen, gcpu, caps = through_gateway(batch_ms)
        n = sum(c.requests for c in caps)
        ref, ref_cpu = min(bare(caps, batched) for _ in range(2))  # the better of two: the machine is shared
        rows.append((label, wall, cpu, gen / n, gcpu / n, n, ref_label, ref, ref_cpu))
    E = args.episodes
    print(
        f"{'path':38s} {'ep/s wall':>9s} {'ep/s CPU':>9s} {'ms/req':>7s} {'gen ms':>7s} {'CPU/req':>7s} {'gen CPU':>7s}"
    )
    for label, wall, cpu, gen, gcpu, n, ref_label, ref, ref_cpu in rows:
        print(
            f"{label:38s} {E / wall:9.2f} {E / cpu:9.2f} {1000 * wall / n:7.1f} {1000 * gen:7.1f} "
            f"{1000 * cpu / n:7.1f} {1000 * gcpu:7.1f}"
        )
        print(
            f"{'  vs ' + ref_label:38s} {E / ref:9.2f} {E / ref_cpu:9.2f}   ratio {ref / wall:.2f}x wall, {ref_cpu / cpu:.2f}x CPU"
        )
    print(f"batched pass: {sizes[0]:.1f} requests per generate on average (a turn wave is {args.episodes})")


if __name__ == "__main__":
    main()
