"""The gateway's cost per request (issue 38, "Measured" (a), in part): a multi-turn tool-style conversation run as an
agent through the gateway (HTTP + JSON + capture + rendering, ``align.gateway``) vs the same turns as bare
``client.generate`` calls on the same prompt ids, on the native sampler with a random-weight model: episodes/s, the
time per request, and the share of it spent outside generation (one generate per request, serialised).

Needs ``jinja2`` (the ``hf`` extra: a ChatML template renders the messages). The tokenizer is bytes (one id per
byte + ``<|im_end|>``), so ids are exact without a trained vocabulary. On a shared machine use ``--threads 1``.

    .venv/bin/python benchmarks/bench_gateway.py [--episodes 8 --turns 3 --max-tokens 16 --layers 2 --hidden 128
        --threads 1]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import re
import threading
import time
import urllib.request

import torch

from align.chat import TurnRenderer
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
        self.eos_token_id, self.chat_template, self.special_tokens_map = [2], CHATML, {"eos_token": END}

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


def post(url: str, key: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
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
    gen_s = [0.0]

    def sample(ids: list[int], max_tokens: int, cap: object) -> object:
        with lock:
            t0 = time.perf_counter()
            c = client.generate([ids], dataclasses.replace(params, max_tokens=max_tokens))[0]
            gen_s[0] += time.perf_counter() - t0
            return c

    gw = Gateway(sample, lambda tools: TurnRenderer(tok, tools=tools), tok.decode, "m", args.max_tokens, 4096)
    url = gw.base_url + "/chat/completions"

    def agent(key: str) -> None:
        msgs = [{"role": "user", "content": "Use the tool, then answer."}]
        for t in range(args.turns):
            r = post(url, key, {"model": "m", "messages": msgs})
            msgs += [r["choices"][0]["message"], {"role": "tool", "content": f"result {t}: 42"}]

    keys = [gw.open_episode() for _ in range(args.episodes)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.episodes) as pool:
        list(pool.map(agent, keys))
    wall = time.perf_counter() - t0
    caps = [gw.close_episode(k) for k in keys]
    gw.close()
    requests = sum(c.requests for c in caps)
    assert all(len(c.branches) == 1 for c in caps), "every agent extends its history: one trajectory each"

    # the same turns as bare generate calls (the ids the gateway captured, prompt by prompt)
    t0 = time.perf_counter()
    for c in caps:
        b = c.branches[0]
        at = 0
        for turn in b.turns:
            at += turn["env_tokens"]
            client.generate([b.prompt_ids + b.token_ids[:at]], params)
            at += turn["policy_tokens"]
    bare = time.perf_counter() - t0
    print(
        f"threads {torch.get_num_threads()} | load {os.getloadavg()[0]:.2f} | episodes {args.episodes} x {args.turns} turns"
    )
    print(f"gateway: {args.episodes / wall:.2f} episodes/s | {1000 * wall / requests:.1f} ms/request wall")
    print(f"  generation {1000 * gen_s[0] / requests:.1f} ms/request; outside it {100 * (1 - gen_s[0] / wall):.0f}%")
    print(f"bare generate on the same prompts: {args.episodes / bare:.2f} episodes/s ({wall / bare:.2f}x the time)")


if __name__ == "__main__":
    main()
