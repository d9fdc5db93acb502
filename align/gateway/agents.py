"""Agent programs as an episode source: ``--agent path/file.py:fn`` (or ``module:fn``; Python ``train(cfg, ...,
agent=fn)``) runs ``fn(base_url, api_key, model, **row) -> float | dict | None`` G times per data row against the
gateway (``align.gateway.server``); each run is one episode, captured token-exactly (``align.gateway.capture``).

The agent builds its own client (``openai.OpenAI(base_url=..., api_key=...)``, any framework pointed at that URL),
makes as many calls as it likes and returns its reward: a float, None (unscorable) or ``{"reward": r, "metrics":
{...}}``. With ``--reward`` functions the final reply is scored too (added, as for environments).

Wiring: ``--env agent`` (``--agent`` alone picks it) is a row of ``align.tasks.ENVIRONMENTS``; ``AgentEnv.open``
loads and checks the function before the model loads and returns a class whose ``run_episodes`` hook replaces the
environment turn loop in the sampling seam (``align.envs.sampler.Episodes``). Agents run on a thread pool
(``--agent-workers``; 0 = one per episode of the step), or with ``--agent-processes`` each run in a worker process
of its own (``align.gateway.workers``: loaded by spec, JSON over pipes, killed with its process group at the
deadline); an agent that raises, runs past ``--agent-timeout-s`` (its key is revoked; its thread abandoned, as a
Python thread cannot be killed, or its process killed), dies or returns a non-number makes its episode unscorable
(``agent/errors``, ``agent/timeouts``); the step goes on (``Episodes.sample`` stops the run when every episode
failed, with the first traceback). Under torchrun (``on_ranks``) each rank runs its contiguous share of the
episodes against a gateway of its own (its own loopback port), each request seeded by its episode's global index
(``request_seed``), and the ranks' episodes are gathered: 2 ranks sample what 1 process samples. On the in-process sampler one generate runs at a time
(``--gateway-batch-ms`` batches concurrent requests); a vLLM worker (``--rollout spool``) gets each request as it
arrives, token ids in and out, and batches those in flight itself.

An episode that the agent branched (edited history, a return to an earlier turn) trains every trajectory: the last
request's is the episode (what ``--reward`` scores, what the log shows first), the others ride in ``Episode.branches``
and the learner lays each out as a sequence of its own with the episode's advantage (``align.rollout.groups.
trajectories``): the episode counts once in its group's normalisation, each sampled token once in the loss.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from align.errors import InputError

log = logging.getLogger(__name__)

FLAG = "--agent"
MODEL_NAME = "align-policy"


def check_agent(fn: Any, where: str) -> Callable[..., Any]:
    """``fn`` if it can be called as ``fn(base_url, api_key, model, **row)``, else an InputError naming --agent."""
    if not callable(fn):
        raise InputError(f"{FLAG} {where}: a {type(fn).__name__} is not callable; give a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise InputError(f"{FLAG} {where}: its signature cannot be read ({e})") from None
    try:
        sig.bind_partial("base_url", "api_key", "model")  # positional; the row's columns may be named parameters
    except TypeError as e:
        raise InputError(
            f"{FLAG} {where}: {e}; an agent is fn(base_url, api_key, model, **row) -> float | dict | None"
        ) from None
    if len(sig.parameters) <= 3:
        raise InputError(f"{FLAG} {where}: it takes no **row (the data row's columns are passed as keywords)")
    return fn


def load_agent(spec: str) -> Callable[..., Any]:
    from align.specs import load_spec

    if not spec:
        raise InputError(f"{FLAG}: give the agent as 'path/file.py:fn' or 'module:fn'")
    return check_agent(load_spec(spec, FLAG, kind="function"), repr(spec))


def reward_of(out: Any) -> tuple[float | None, dict, str | None]:
    """(reward, metrics, why unscorable) of an agent's return value."""
    metrics: dict = {}
    if isinstance(out, dict):
        metrics = out.get("metrics") or {}
        out = out.get("reward")
    if out is None:
        return None, metrics, None
    if isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out):
        return None, metrics, f"the agent returned {out!r}: expected a finite number, a dict with 'reward' or None"
    return float(out), metrics, None


def run_pool(calls: list[Callable[[], Any]], workers: int, timeout_s: float | None) -> list[cf.Future]:
    """Each call on one of ``workers`` daemon threads; returns once all are done or ``timeout_s`` passed. A call not
    done by then is abandoned (a daemon thread: a hung agent never blocks the trainer's exit, as a
    ``ThreadPoolExecutor``'s joined threads would); one not started is cancelled."""
    futs: list[cf.Future] = [cf.Future() for _ in calls]
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(calls)):
        todo.put(i)

    def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            if not futs[i].set_running_or_notify_cancel():
                continue
            try:
                futs[i].set_result(calls[i]())
            except BaseException as e:  # noqa: BLE001 -- the agent's failure: its episode's error
                futs[i].set_exception(e)

    for _ in range(min(workers, len(calls))):
        threading.Thread(target=worker, name="align-agent", daemon=True).start()
    cf.wait(futs, timeout=timeout_s)
    for f in futs:
        f.cancel()  # those not started never will be (a running one is not cancelled)
    return futs


def top_logprobs(model: Any, temperature: float, prompt_ids: list[int], token_ids: list[int], k: int) -> list:
    """Per token of ``token_ids`` (sampled after ``prompt_ids``) its ``k`` most likely ``(id, logprob)`` under the
    training basis ``log_softmax(logits / T)`` (``log_softmax(logits)`` greedy), teacher-forced on ``model``: what
    the learner recomputes, the sampler's own distribution up to float summation order. The caller holds the
    model's lock and autocast."""
    import torch

    if not token_ids:
        return []
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + token_ids[:-1]], device=device)
        logits = model(ids)[0, len(prompt_ids) - 1 :].float()  # (len(token_ids), V)
    lp = (logits / temperature if temperature > 0 else logits).log_softmax(-1)
    values, idx = lp.topk(min(k, lp.shape[-1]), -1)
    return [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]


def request_seed(seed: int | None, index: int, requests: int) -> int | None:
    """The seed of an episode's request number ``requests``: by the episode's place in its step (``index``, global
    under torchrun) and the call's seed, never by what ran before or beside it."""
    return None if seed is None else seed + 7919 * index + 104_729 * requests


def on_ranks(run: Callable[[Any, range], list], client: Any, n: int) -> list:
    """torchrun: ``run(rank_client, share)`` on this rank's contiguous share of the ``n`` episodes (``dist.share``),
    then every rank's episodes gathered in order. The rank's gateway (its own loopback port) samples alone, so no
    request is a collective: on the full weights (``dist.full_model``, gathered once here) for the native sampler,
    on the vLLM worker behind ``ShardedSpoolClient`` directly. A rank that fails says so to the others (no rank
    waits at the gather for one that raised)."""
    from align import dist
    from align.envs.episodes import _native_model
    from align.rollout.client import NativeClient, ShardedSpoolClient

    model, _ = _native_model(client)
    own = client.client if isinstance(client, ShardedSpoolClient) else client
    if model is not None:  # the train step's ShardedNativeClient or the eval's NativeClient on the sharded policy
        own = NativeClient(dist.full_model(model))
        own.weights_version = getattr(client, "weights_version", 0)
    lo, hi = dist.share(n)
    mine, failed = [], None
    try:
        mine = run(own, range(lo, hi)) if hi > lo else []
    except Exception as e:  # noqa: BLE001 -- raised below on every rank, after the gather
        failed = e
    finally:
        del own
    parts = dist.gather((mine, None if failed is None else f"rank {dist.rank()}: {failed!r}"))
    if failed is not None:
        raise failed
    if errors := [e for _, e in parts if e]:
        raise RuntimeError(f"the agents of another rank failed: {errors[0]}")
    return [ep for part, _ in parts for ep in part]


def batch_draw(seed: int | None, index: int, requests: int) -> tuple[int | None, int]:
    """``--gateway-batch-ms``: the generator seed and the draw row of an episode's request number ``requests``. Each
    decode step of a generate draws one uniform per row of all ``DRAWS`` x episodes rows (``native.Until.draw``) and
    a request keeps its own row's, so its tokens depend on the call's seed, its episode's place in the step
    (``index``, global under torchrun) and its request number, never on which requests shared its batch. Requests
    ``DRAWS`` apart share a row under another seed (a batch goes out as one generate per seed)."""
    block, r = divmod(requests, DRAWS)
    return (None if seed is None else seed + 104_729 * block), index * DRAWS + r


DRAWS = 8  # an episode's requests drawing from one seed's rows (the built-in agent task makes at most 2)


def sample_rows(model: Any, prompts: list[list[int]], params: Any, budgets: list[int], draws: list[int], total: int):
    """One generate of ``prompts`` on the in-process sampler, each row to its own token budget (cut there, finish
    ``length``) and drawing from its own row ``draws[i]`` of ``total`` uniforms per decode step (``native.Until``)."""
    import torch

    from align import heartbeat
    from align.rollout.native import Until, _generate, packed_weights

    until = Until(list(range(len(prompts))), len(prompts), budgets, draws, total)  # every row a group: none is cut
    rows = len(prompts)
    with torch.inference_mode(), packed_weights(model, rows), heartbeat.working("sampler", engine="native", rows=rows):
        return _generate(model, prompts, params, None, until=until)


class Batcher:
    """``--gateway-batch-ms``: requests arriving within that many ms of the first go out as one generate per seed
    (``generate(prompts, budgets, seed, draws)``, each row sampled to its own budget). A request's ``seed`` and
    ``draw`` (``batch_draw``) fix its tokens whatever shared its batch: the run is deterministic in one process.
    ``running() -> int``: the agents running now; once each of them has a request waiting, the batch goes out
    without waiting out the window (no agent can add to it)."""

    def __init__(
        self,
        generate: Callable[[list[list[int]], list[int], int | None, list[int]], list],
        batch_ms: float,
        running: Callable[[], int] | None = None,
    ) -> None:
        self.generate, self.wait_s, self.running = generate, batch_ms / 1000, running
        self.q: queue.Queue = queue.Queue()
        self.batches: list[int] = []  # the size of each generate (for the metrics and the tests)
        self.thread = threading.Thread(target=self._loop, name="align-gateway-batch", daemon=True)
        self.thread.start()

    def __call__(self, ids: list[int], max_tokens: int, seed: int | None, draw: int = 0) -> Any:
        slot: dict[str, Any] = {"ids": ids, "max": max_tokens, "seed": seed, "draw": draw, "done": threading.Event()}
        self.q.put(slot)
        slot["done"].wait()
        if "error" in slot:
            raise slot["error"]
        return slot["out"]

    def _loop(self) -> None:
        while (first := self.q.get()) is not None:
            batch, end = [first], time.monotonic() + self.wait_s
            while (left := end - time.monotonic()) > 0 and not (self.running and len(batch) >= self.running()):
                try:
                    item = self.q.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    self.q.put(None)
                    break
                batch.append(item)
            self.batches.append(len(batch))
            by_seed: dict[int | None, list[dict]] = {}
            for s in batch:
                by_seed.setdefault(s["seed"], []).append(s)
            for seed, part in by_seed.items():
                try:
                    outs = self.generate(
                        [s["ids"] for s in part], [s["max"] for s in part], seed, [s["draw"] for s in part]
                    )
                    for s, c in zip(part, outs):
                        s["out"] = c
                except BaseException as e:  # noqa: BLE001 -- each waiting request raises it (the gateway answers 500)
                    for s in part:
                        s["error"] = e
                for s in part:
                    s["done"].set()

    def close(self) -> None:
        self.q.put(None)


class AgentEnv:
    """``--env agent``: the row of ``align.tasks.ENVIRONMENTS``. Opened, never run: ``open`` returns the class whose
    ``run_episodes`` hook runs the agent (``bind(fn)`` for ``train(..., agent=fn)``)."""

    fn: Callable[..., Any] | None = None
    tools = None

    @classmethod
    def open(cls, cfg: Any, tokenizer: Any) -> type:
        from align import dist

        limit, wait = getattr(cfg, "dist_timeout_s", 600.0), cfg.envs.agent_timeout_s
        if dist.env_world_size() > 1 and not 0 < wait < limit:  # torchrun: each rank's share, then a gather
            raise InputError(
                f"--agent-timeout-s {wait:g} under torchrun: a rank waits at the step's gather for the other ranks' "
                f"agents, and --dist-timeout-s {limit:g} bounds that wait; pass --agent-timeout-s below it (0 < t < "
                f"{limit:g}) or raise --dist-timeout-s"
            )
        fn = cls.fn if cls.fn is not None else load_agent(cfg.envs.agent)
        spec = None
        if cfg.envs.agent_processes:  # checked here, before the model loads: the workers load the agent by spec
            from align.gateway.workers import agent_spec

            spec = agent_spec(cfg.envs.agent if cls.fn is None else None, fn)
        return type("Agent", (_Agents,), {"fn": staticmethod(fn), "spec": spec, "cfg": cfg.envs, "state": {}})

    def __init__(self, **row: Any) -> None:
        raise RuntimeError("AgentEnv is opened, never run")

    def reset(self) -> list[dict]:
        raise NotImplementedError

    def step(self, completion: str) -> Any:
        raise NotImplementedError


def bind(fn: Callable[..., Any]) -> type:
    """The environment class of ``train(cfg, ..., agent=fn)``."""
    return type("AgentEnv", (AgentEnv,), {"fn": staticmethod(check_agent(fn, getattr(fn, "__name__", repr(fn))))})


class _Agents(AgentEnv):
    fn: Callable[..., Any]
    spec: str | None  # --agent-processes: the spec each worker process loads the agent from
    cfg: Any
    state: dict

    @classmethod
    def gateway(cls, sampler: Any) -> Any:
        if "gw" not in cls.state:
            from align.chat import TurnRenderer
            from align.gateway.server import Gateway

            tok = sampler.renderer.tok
            cls.state["gw"] = Gateway(
                None,  # each episode carries its step's or eval point's sampler (``run_share``)
                lambda tools: TurnRenderer(tok, tools=tools),
                sampler.decode,
                MODEL_NAME,
                sampler.cfg.max_tokens,
                sampler.context,
                cls.cfg.gateway_max_body_mb,
                episode_tokens=cls.cfg.max_episode_tokens,
                max_connections=cls.cfg.gateway_max_connections,
                read_timeout_s=cls.cfg.gateway_read_timeout_s,
            )
            cls.state["gen_lock"] = threading.Lock()
        return cls.state["gw"]

    @classmethod
    def run_episodes(cls, sampler: Any, client: Any, rows: list[dict], G: int, params: Any) -> list:
        """G runs of the agent per row, as ``Episode``s in (row, sample) order. torchrun: each rank runs its
        share against its own gateway (``on_ranks``); every rank gets every episode."""
        from align import dist

        if dist.active():
            return on_ranks(lambda c, share: cls.run_share(sampler, c, rows, G, params, share), client, len(rows) * G)
        return cls.run_share(sampler, client, rows, G, params)

    @classmethod
    def run_share(cls, sampler: Any, client: Any, rows: list[dict], G: int, params: Any, share: Any = None) -> list:
        """The episodes ``share`` (a range of the (row, sample) indices; default all) on this process's gateway."""
        gw = cls.gateway(sampler)
        # the in-process sampler's model (a vLLM worker's is out of reach: its requests go out as they arrive)
        model = getattr(client, "model", None)
        lock = cls.state["gen_lock"] if model is not None else contextlib.nullcontext()

        def generate(prompts: list[list[int]], max_tokens: int, seed: int | None) -> list:
            p = dataclasses.replace(params, n=1, max_tokens=max_tokens, seed=seed)
            with lock, sampler.autocast():  # one generate at a time on the shared model (autocast is per thread)
                return client.generate(prompts, p)

        jobs = [(p, g) for p in range(len(rows)) for g in range(G)]
        share = share if share is not None else range(len(jobs))
        jobs = jobs[share.start : share.stop]
        # at most as many agents at once as the gateway serves connections: one more would get a 503 (a held-out
        # set of 200 prompts x 4 ran 800 agents against 512 connections, and the refused ones scored 0)
        workers = min(cls.cfg.agent_workers or len(jobs), cls.cfg.gateway_max_connections)
        left = [len(jobs)]  # agents not returned yet: min(workers, left) of them run or are about to
        count = threading.Lock()

        def counted(call: Callable[[], Any]) -> Any:
            try:
                return call()
            finally:
                with count:
                    left[0] -= 1

        # a worker batches the requests in flight itself (continuous batching, its prefix cache reusing each turn's)
        batch_ms = cls.cfg.gateway_batch_ms if model is not None else 0.0
        total = len(rows) * G * DRAWS  # every episode of the step (all ranks'): each its DRAWS rows of uniforms

        def generate_rows(prompts: list[list[int]], budgets: list[int], seed: int | None, draws: list[int]) -> list:
            p = dataclasses.replace(params, n=1, max_tokens=max(budgets), seed=seed)
            with lock, sampler.autocast():
                outs = sample_rows(model, prompts, p, budgets, draws, total)
            for c in outs:
                c.weights_version = client.weights_version
            return outs

        batcher = Batcher(generate_rows, batch_ms, lambda: min(workers, left[0])) if batch_ms else None

        def sample(ids: list[int], max_tokens: int, cap: Any) -> Any:
            if batcher:
                return batcher(ids, max_tokens, *batch_draw(params.seed, cap.index, cap.requests))
            return generate([ids], max_tokens, request_seed(params.seed, cap.index, cap.requests))[0]

        def top(prompt_ids: list[int], token_ids: list[int], k: int) -> list:
            with lock, sampler.autocast():
                return top_logprobs(model, params.temperature, prompt_ids, token_ids, k)

        keys = [gw.open_episode() for _ in jobs]
        for i, k in zip(share, keys):  # the episode's global index: its draws do not depend on the rank split
            cap = gw.episodes[k]
            # this call's backend travels with its episodes: an eval point (the fleet's thread) and a training step
            # run agents on the one gateway at once, each request served by its own episode's sampler
            cap.index, cap.sample, cap.top = i, sample, (top if model is not None else None)
        timeout_s = cls.cfg.agent_timeout_s or None
        if cls.spec is not None:  # --agent-processes: each run in a worker process, the row and result as JSON
            from align.gateway.workers import run_processes

            def pool(calls: list[Callable[[], Any]], n: int, t: float | None) -> list[cf.Future]:
                return run_pool([functools.partial(counted, c) for c in calls], n, t)

            runs = [
                {"base_url": gw.base_url, "api_key": k, "model": MODEL_NAME, "row": rows[p]}
                for (p, _), k in zip(jobs, keys)
            ]
            futs = run_processes(cls.spec, runs, workers, timeout_s, pool)
        else:
            calls = [
                functools.partial(counted, functools.partial(cls.fn, gw.base_url, k, MODEL_NAME, **rows[p]))
                for (p, _), k in zip(jobs, keys)
            ]
            futs = run_pool(calls, workers, timeout_s)
        # an agent past its time is abandoned: its key is revoked here, so its next request gets a 401
        eps = [
            cls.episode(gw.close_episode(k), f, f.done() and not f.cancelled(), p, g)
            for (p, g), k, f in zip(jobs, keys, futs)
        ]
        if batcher:
            batcher.close()
        return eps

    @classmethod
    def episode(cls, cap: Any, fut: cf.Future, finished: bool, p: int, g: int) -> Any:
        from align.rollout.groups import Episode

        ep = Episode(p, g, [], [], "stop", [], 0, prompt_ids=[0])
        metrics: dict = {}
        from align.gateway.workers import AgentFailed, AgentTimeout

        e = fut.exception() if finished else None
        if not finished or isinstance(e, AgentTimeout):
            ep.error = f"the agent ran past {FLAG}-timeout-s {cls.cfg.agent_timeout_s} s"
            ep.error += " (its worker process killed with its process group)" if cls.spec is not None else ""
            ep.timed_out = True
        elif isinstance(e, AgentFailed):  # the child's traceback, or how its process ended
            ep.error = e.text
        elif e is not None:
            ep.error = "the agent raised:\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__))
        else:
            reward, metrics, why = reward_of(fut.result())
            ep.env_reward, ep.error = reward, why
        if cap.last < 0 and ep.error is None:
            ep.error = "the agent made no request through the gateway: nothing to train"
        if cap.last >= 0:
            b = cap.branches[cap.last]
            ep.prompt_ids, ep.token_ids, ep.mask = b.prompt_ids, b.token_ids, b.mask
            ep.logprobs, ep.sampled_logprobs = b.logprobs, b.sampled_logprobs
            # every trajectory with a sampled token is trained: the others ride along with the episode's advantage
            ep.branches = [
                Episode(
                    p,
                    g,
                    o.token_ids,
                    o.logprobs,
                    o.turns[-1]["finish_reason"],
                    o.sampled_logprobs,
                    o.weights_version,
                    prompt_ids=o.prompt_ids,
                    mask=o.mask,
                )
                for i, o in enumerate(cap.branches)
                if i != cap.last and any(o.mask)
            ]
            # every request in order (completions.jsonl, metrics): trained = in a trajectory the learner gets
            ep.turns = [{**r, "trained": any(cap.branches[r["branch"]].mask)} for r in cap.log]
            ep.turns[-1]["agent_metrics"] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            ep.weights_version, ep.finish_reason = b.weights_version, b.turns[-1]["finish_reason"]
            ep.truncated = ep.finish_reason == "length"
            # chat False: the run's append-only comparator renders without the agent's tools
            ep.messages, ep.text, ep.chat = cap.final, cap.final[-1]["content"], False
        return ep

    @staticmethod
    def metrics(episodes: list) -> dict:
        """The ``agent/*`` metrics of a step's episodes (from their request records, ``turns``)."""
        n = max(len(episodes), 1)
        reqs = [t for e in episodes for t in e.turns]
        out = {
            "agent/requests_mean": len(reqs) / n,
            "agent/branches_mean": sum(len({t["branch"] for t in e.turns}) for e in episodes) / n,
            # a later branch rendered from scratch (edited history); the first prompt is no re-render
            "agent/rerendered_tokens": sum(t["context_tokens"] for t in reqs if t["parent"] is None and t["branch"]),
            # sampled in a trajectory other than the last request's (trained with the episode's advantage)
            "agent/branch_tokens": sum(
                t["policy_tokens"] for e in episodes for t in e.turns if t["branch"] != e.turns[-1]["branch"]
            ),
            "agent/overridden_sampling": sum(t.get("overridden_sampling", False) for t in reqs),
            "agent/errors": sum(e.error is not None and not e.timed_out for e in episodes),
            "agent/timeouts": sum(e.timed_out for e in episodes),
        }
        own = [t["agent_metrics"] for e in episodes if e.turns for t in e.turns[-1:]]
        for key in {k for m in own for k in m}:
            vals = [m[key] for m in own if key in m]
            out[f"agent/{key}_mean"] = sum(vals) / len(vals)
        return out

    @classmethod
    def close(cls) -> None:
        gw = cls.state.pop("gw", None)
        if gw is not None:
            gw.close()
