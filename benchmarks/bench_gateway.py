"""The gateway's cost per request (issue 38, "Measured" (a), (b), (c)), side by side in one run.

(a) Concurrent multi-turn tool-style agents (each on a kept-alive connection, as the ``openai`` client keeps one)
through the gateway (HTTP + JSON + capture + rendering, ``align.gateway``) vs the same turns as bare
``client.generate`` calls on the captured prompt ids, on the native sampler with a random-weight model: one generate
per request vs bare calls one per request, and ``--gateway-batch-ms`` vs bare calls one per turn wave (the
environment path's batching, without its kept KV cache). Episodes/s by wall clock and by the process's CPU time (on a
shared machine the wall clock mostly measures the wait for a core), and per request the CPU spent in generation and
around it.
(b) With ``--spool``: the same task on one vLLM CPU worker (``.venv-rollout``), as an environment (``ToolEnv`` on
``EpisodeRunner``: each episode's next turn submitted as its step returns) vs as agents through the gateway (each
request submitted to the worker as it arrives), interleaved ``--repeats`` times: episodes/s and tokens/s, medians.
The model's ``<|im_end|>`` logit is raised (``--stop-logit``) so turns end by the stop (~10 tokens, max_tokens 2x
``--max-tokens``): the environment path ends an episode at a turn cut by max_tokens, the agents go on.
(c) A history-editing agent (its history replaced by a summary before turn ``--edit-at``): branches per episode, the
context re-rendered from scratch for the new branch vs the sampled (trained) tokens and the masked context.

Needs ``jinja2`` (the ``hf`` extra: a ChatML template renders the messages). The tokenizer is bytes (one id per
byte + ``<|im_end|>``), so ids are exact without a trained vocabulary. On a shared machine use ``--threads 1``.

    .venv/bin/python benchmarks/bench_gateway.py [--episodes 32 --turns 3 --max-tokens 16 --layers 2 --hidden 128
        --threads 1 --batch-ms 500 --edit-at 2] [--spool --repeats 5 --stop-logit 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import dataclasses
import http.client
import json
import os
import re
import threading
import time
from collections.abc import Callable

import torch
from common import numeric_flags

from align.chat import ChatTemplate, TurnRenderer
from align.envs import Step
from align.gateway.agents import DRAWS, Batcher, batch_draw, sample_rows
from align.gateway.server import Gateway
from align.model import ModelConfig, Transformer
from align.rollout.client import NativeClient
from align.rollout.protocol import Completion, SamplingParams

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


FIRST = "Use the tool, then answer."


def tool_result(t: int) -> str:
    return f"result {t}: 42"


def run_agent(host: str, port: int, key: str, turns: int, edit_at: int = 0) -> None:
    """A multi-turn tool-style agent on one kept-alive connection: each reply, then the tool's result, is appended to
    the history. ``edit_at`` k > 0: before turn k the agent replaces its history by the first message and a summary
    (as agents that compact their context do), so the gateway starts a branch rendered from scratch."""
    msgs = [{"role": "user", "content": FIRST}]
    conn = http.client.HTTPConnection(host, port, timeout=600)
    for t in range(turns):
        if edit_at and t == edit_at:
            msgs = [msgs[0], {"role": "user", "content": f"Summary: the tool was called {t} times; it said 42."}]
        r = post(conn, key, {"model": "m", "messages": msgs})
        msgs += [r["choices"][0]["message"], {"role": "tool", "content": tool_result(t)}]
    conn.close()


class ToolEnv:
    """The agent's task as an align environment: the same first message, the same tool result after each turn."""

    concurrent = True  # its instances share nothing: each episode steps on its own thread (as the agents run)

    def __init__(self, **_: object) -> None:
        self.t = 0

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": FIRST}]

    def step(self, completion: str) -> Step:
        self.t += 1
        return Step([{"role": "tool", "content": tool_result(self.t - 1)}], 0.0, False)


def through(gw: Gateway, episodes: int, turns: int, edit_at: int = 0, done: Callable[[], None] = lambda: None):
    """(wall s, process CPU s, captures) of ``episodes`` concurrent agents through ``gw`` (closed after)."""
    host, port = gw.httpd.server_address[:2]
    keys = [gw.open_episode() for _ in range(episodes)]
    for i, k in enumerate(keys):
        gw.episodes[k].index = i

    def agent(key: str) -> None:
        run_agent(host, port, key, turns, edit_at)
        done()

    t0, c0 = time.perf_counter(), time.process_time()
    with cf.ThreadPoolExecutor(episodes) as pool:
        list(pool.map(agent, keys))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    caps = [gw.close_episode(k) for k in keys]
    gw.close()
    return wall, cpu, caps


def lone_agent(tok: ByteTokenizer, turns: int, n: int = 40) -> tuple[float, float]:
    """(ms wall, ms CPU) per request of one agent at a time through the gateway with an instant sampler (a canned
    reply): the gateway's own round trip (HTTP both ways, JSON, capture, rendering), nothing to hide it behind."""
    reply = tok.encode("hello there")

    def sample(ids: list[int], max_tokens: int, cap: object) -> Completion:
        return Completion(0, 0, reply[:max_tokens], [-1.0] * len(reply[:max_tokens]), "length")

    gw = Gateway(sample, lambda tools: TurnRenderer(tok, tools=tools), tok.decode, "m", 16, 4096)
    host, port = gw.httpd.server_address[:2]
    keys = [gw.open_episode() for _ in range(n)]
    t0, c0 = time.perf_counter(), time.process_time()
    for k in keys:
        run_agent(host, port, k, turns)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gw.close()
    return 1000 * wall / (n * turns), 1000 * cpu / (n * turns)


def spool_part(args: argparse.Namespace, model: Transformer, tok: ByteTokenizer, params: SamplingParams) -> None:
    """(b): the environment path (``EpisodeRunner``: each episode's next turn submitted as its step returns) vs the
    agents through the gateway (each request submitted as it arrives), on one vLLM CPU worker, interleaved."""
    import shutil
    import statistics
    import tempfile
    from pathlib import Path

    from align.envs.config import EnvConfig
    from align.envs.episodes import EpisodeRunner
    from align.envs.runner import EnvRunner
    from align.model import save_pretrained
    from align.rollout.client import make_rollout_client, spawn_worker

    tmp = Path(tempfile.mkdtemp(prefix="bench_gateway_"))
    model = copy.deepcopy(model)
    with torch.no_grad():  # <|im_end|>'s logit from one hidden unit: turns end by the stop, not by max_tokens (the
        model.lm_head.weight[2].zero_()  # environment path ends an episode at a cut turn; the agents would go on)
        model.lm_head.weight[2, 0] = args.stop_logit
    path = save_pretrained(model, tmp / "model")
    params = dataclasses.replace(params, max_tokens=2 * args.max_tokens, seed=None)
    t0 = time.perf_counter()
    worker = spawn_worker(tmp / "spool", model=path, log_path=tmp / "worker.log", in_process=True,
                          max_model_len=1024, dtype="float32")  # fmt: skip
    client = make_rollout_client("spool", spool=tmp / "spool", timeout_s=600, worker=worker)
    client.generate([tok.encode("warm up")], params)  # the engine's start and first compile, outside the timings
    print(f"(b) vLLM CPU worker up in {time.perf_counter() - t0:.0f} s")
    renderer = TurnRenderer(tok)
    envs = EnvRunner(f"{Path(__file__).resolve()}:ToolEnv", ToolEnv, 0, 0.0)
    runner = EpisodeRunner(envs, renderer, tok.decode, EnvConfig(max_turns=args.turns), params.max_tokens, 1024)
    rows = [{}] * args.episodes

    def env_path() -> tuple[float, float, int]:
        t0, c0 = time.perf_counter(), time.process_time()
        eps = runner.run(client, rows, 1, params)
        assert all(e.error is None for e in eps), [e.error for e in eps if e.error]
        return time.perf_counter() - t0, time.process_time() - c0, sum(e.policy_tokens for e in eps)

    def agent_path() -> tuple[float, float, int]:
        def sample(ids: list[int], max_tokens: int, cap: object) -> object:
            return client.generate([ids], dataclasses.replace(params, max_tokens=max_tokens))[0]

        gw = Gateway(sample, lambda tools: TurnRenderer(tok, tools=tools), tok.decode, "m", params.max_tokens, 1024)
        wall, cpu, caps = through(gw, args.episodes, args.turns)
        return wall, cpu, sum(t["policy_tokens"] for c in caps for t in c.log)

    env_s, agent_s, ratios, env_tps, agent_tps = [], [], [], [], []
    try:
        for r in range(args.repeats):
            order = (env_path, agent_path) if r % 2 == 0 else (agent_path, env_path)
            got = {f: f() for f in order}
            (e, e_cpu, e_tok), (a, a_cpu, a_tok) = got[env_path], got[agent_path]
            env_s.append(e), agent_s.append(a), ratios.append(e / a)
            env_tps.append(e_tok / e), agent_tps.append(a_tok / a)
            print(f"  repeat {r}: environment {e:.2f} s ({e_tok} tokens, trainer CPU {e_cpu:.2f} s), agents {a:.2f} "
                  f"s ({a_tok} tokens, trainer CPU {a_cpu:.2f} s), ratio {e / a:.2f}x | load {os.getloadavg()[0]:.1f}")  # fmt: skip
    finally:
        worker.shutdown(grace_s=5)
        shutil.rmtree(tmp, ignore_errors=True)
    E, med = args.episodes, statistics.median
    print(f"{'(b) vLLM CPU worker, medians':38s} {'ep/s wall':>9s} {'tokens/s':>9s}")
    print(f"{'environment (EpisodeRunner)':38s} {E / med(env_s):9.2f} {med(env_tps):9.1f}")
    print(f"{'agents through the gateway':38s} {E / med(agent_s):9.2f} {med(agent_tps):9.1f}   ratio "
          f"{med(ratios):.2f}x episodes/s, {med(agent_tps) / med(env_tps):.2f}x tokens/s (each repeat: "
          f"{', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip


def editing_part(args: argparse.Namespace, generate: Callable, tok: ByteTokenizer) -> None:
    """(c): agents that replace their history by a summary before turn ``--edit-at``: branches per episode, the
    context tokens rendered from scratch for a new branch vs the sampled (trained) tokens and the masked context."""
    gw = Gateway(
        lambda ids, n, cap: generate([ids], n, 7919 * cap.index + 104_729 * cap.requests)[0],
        lambda tools: TurnRenderer(tok, tools=tools),
        tok.decode,
        "m",
        args.max_tokens,
        4096,
    )
    _, _, caps = through(gw, args.episodes, args.turns + 1, edit_at=args.edit_at)
    log = [t for c in caps for t in c.log]
    branches = sum(len(c.branches) for c in caps) / len(caps)
    rerendered = sum(t["context_tokens"] for t in log if t["parent"] is None and t["branch"])
    trained = sum(t["policy_tokens"] for t in log)
    first = sum(t["context_tokens"] for t in log if t["parent"] is None and not t["branch"])
    suffixes = sum(t["context_tokens"] for t in log if t["parent"] is not None)
    print(
        f"(c) {args.episodes} agents x {args.turns + 1} turns, history replaced by a summary before turn "
        f"{args.edit_at}: {branches:.2f} branches per episode; tokens per episode: trained (sampled) "
        f"{trained / len(caps):.1f}, re-rendered for a new branch {rerendered / len(caps):.1f} (masked), first "
        f"prompt {first / len(caps):.1f}, suffixes {suffixes / len(caps):.1f} (masked); every sampled token trained "
        f"once, in the branch that sampled it: {all(sum(b.mask) == sum(t['policy_tokens'] for t in c.log if t['branch'] == i) for c in caps for i, b in enumerate(c.branches))}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    numeric_flags(ap, episodes=32, turns=3, max_tokens=16, layers=2, hidden=128, threads=1, repeats=5, edit_at=2)
    ap.add_argument("--batch-ms", type=float, default=20.0, help="--gateway-batch-ms of the batched pass")
    ap.add_argument("--spool", action="store_true", help="also (b): the same on the vLLM CPU worker (.venv-rollout)")
    ap.add_argument("--stop-logit", type=float, default=5.0, help="(b): <|im_end|>'s logit scale (~10-token turns)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(
        model_type="qwen2", vocab_size=259, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        max_position_embeddings=4096, eos_token_id=2, pad_token_id=0, qkv_bias=True,  # Qwen2 has them (vLLM reads them)
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

    def generate_rows(prompts: list[list[int]], budgets: list[int], seed: int | None, draws: list[int]) -> list:
        """The batched pass's generate, as the trainer's gateway sends a batch (``align.gateway.agents``)."""
        with lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            p = dataclasses.replace(params, max_tokens=max(budgets), seed=seed)
            out = sample_rows(model, prompts, p, budgets, draws, args.episodes * DRAWS)
            gen_s[0] += time.perf_counter() - t0
            gen_cpu[0] += time.thread_time() - c0
            return out

    def through_gateway(batch_ms: float) -> tuple[float, float, float, float, list]:
        """(wall s, process CPU s, generation wall s, generation CPU s, captures) of the agents through a fresh
        gateway (the CPU of every thread: the agents' HTTP clients, the server, the capture, the sampler)."""
        left = [args.episodes]  # agents not done (the batcher sends a batch once each has a request in it)
        count = threading.Lock()
        batcher = Batcher(generate_rows, batch_ms, lambda: left[0]) if batch_ms else None

        def sample(ids: list[int], max_tokens: int, cap: object) -> object:
            if batcher:
                return batcher(ids, max_tokens, *batch_draw(0, cap.index, cap.requests))  # type: ignore[attr-defined]
            return generate([ids], max_tokens, 0)[0]

        gw = Gateway(sample, lambda tools: TurnRenderer(tok, tools=tools), tok.decode, "m", args.max_tokens, 4096)
        gen_s[0] = gen_cpu[0] = 0.0

        def done() -> None:
            with count:
                left[0] -= 1

        wall, cpu, caps = through(gw, args.episodes, args.turns, done=done)
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
    wall, cpu = min(lone_agent(tok, args.turns) for _ in range(3))
    print(f"one agent at a time, instant sampler: {wall:.2f} ms wall, {cpu:.2f} ms CPU per request (best of 3)")
    editing_part(args, generate, tok)
    if args.spool:
        spool_part(args, model, tok, params)


if __name__ == "__main__":
    main()
