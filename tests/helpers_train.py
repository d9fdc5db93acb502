"""What the training-loop tests share: the char task, its random-weight model, a small TrainConfig, the run files.

The char task is trivially learnable: prompts over ``abcd=`` and a reward for the share of 'a' in a 4-letter
completion (``a_reward``). ``build_char_model`` is the one builder of its model (the ``char_model`` /
``char_model_2l`` fixtures of tests/conftest.py). ``cfg_for`` is the base run config (4 prompts x 4 completions of
up to 4 tokens, lr 1e-2, no warmup, no eval); ``run_cli`` starts ``python -m align.train`` in a subprocess, and
``wait_for`` / ``wait_for_steps`` poll its run dir with a bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from align.char_tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
TIMING_KEYS = {"tokens_per_s", "rollout_time", "sync_time", "step_time"}  # wall-clock figures, never compared
RUN_TIMEOUT_S = 300.0  # a CLI run on a tiny model reaches a given step well within this on 2 loaded cores
POLL_S = 0.05

TOK = CharTokenizer("abcd=")
PROMPTS = [{"prompt": w + "="} for w in ("ab", "cd", "bca", "dd", "abc", "cab", "dab", "bb")]

# The TrainConfig fields every small run here shares (the driver of tests/test_dist.py takes them as JSON too).
TRAIN_BASE = {
    "prompts_per_step": 4,
    "group_size": 4,
    "max_tokens": 4,
    "lr": 1e-2,
    "warmup_steps": 0,
    "micro_batch_size": 8,
}


def a_reward(prompt: str, completion: str, **_) -> float:
    return completion.count("a") / 4


def partial_credit(prompt: str, completion: str, answer: str | None = None, **_) -> float:
    """Fraction of the reversed word's characters in place: a fine-grained fingerprint of what a policy generates."""
    return sum(a == b for a, b in zip(completion, answer)) / len(answer)


def build_char_model(path: str | os.PathLike, layers: int = 1) -> str:
    """A random-weight (seed 0) model of the reverse task's shape for ``TOK`` with ``layers`` decoder layers, saved
    (committed) at ``path``. Returns the path as a string (what ``--model`` takes)."""
    from align.model import Transformer, save_pretrained
    from align.tasks import reverse

    cfg = reverse.model_config(TOK)
    cfg.num_hidden_layers = layers
    return str(save_pretrained(Transformer(cfg).init_weights(seed=0), Path(path)))


def tree_digest(path: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file under ``path`` by relative name: equal digests mean nothing was written there."""
    root = Path(path)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def cfg_for(out, **kw):
    """The base run: ``TRAIN_BASE``, 4 steps, a checkpoint every 2, no eval; ``kw`` overrides TrainConfig fields."""
    from align.train import TrainConfig

    base = {"out": str(out), **TRAIN_BASE, "steps": 4, "checkpoint_every": 2}
    base.update(kw)
    c = TrainConfig(**base)
    c.eval.eval_interval = 0
    return c


def spool_cfg(out, **kw):
    """The reverse task's base run on the real spool path (an in-process vLLM worker, ``--rollout spool``): 4 prompts
    x 4 completions of up to 6 tokens, lr 1e-2, no checkpoint, no eval; ``kw`` overrides TrainConfig fields."""
    from align.train import TrainConfig

    spool = {"rollout": "spool", "rollout_in_process": True, "rollout_timeout_s": 600}
    base = {"out": str(out), "prompts_per_step": 4, "group_size": 4, "max_tokens": 6, "lr": 1e-2, **spool}
    c = TrainConfig(**{**base, "checkpoint_every": 0, **kw})
    c.eval.eval_interval = 0
    return c


def jsonl_rows(path) -> list[dict]:
    """A run's .jsonl log, one dict per finished line: a live run may be mid-write of the last one (a reader polling
    it can see the line's first bytes before the rest land)."""
    text = Path(path).read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def records(out) -> list[dict]:
    """The run's metrics.jsonl (``jsonl_rows``)."""
    return jsonl_rows(Path(out) / "metrics.jsonl")


def train_steps(out) -> int:
    """How many training steps the run dir has logged so far (0 before metrics.jsonl exists)."""
    return sum(1 for r in records(out) if "reward_mean" in r) if (Path(out) / "metrics.jsonl").exists() else 0


def comparable(out) -> list[dict]:
    """The run's records without wall-clock figures: what two runs of the same config must log alike."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.endswith("seconds")} for r in records(out)]


def run_cli(args: list[str], module: str = "align.train", **kw) -> subprocess.Popen:
    """``python -m align.train ARGS`` (or another ``module``, e.g. ``align.sft``) on this checkout, stdout and stderr
    together in ``proc.stdout``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def cli_args(out, model) -> list[str]:
    """An 8-step CLI run of the built-in reverse task: checkpoints every 2 steps, eval every 4."""
    return [
        "--out",
        str(out),
        "--model",
        model,
        "--steps",
        "8",
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
        "--max-tokens",
        "6",
        "--checkpoint-every",
        "2",
        "--eval-interval",
        "4",
        "--eval-prompts",
        "16",
    ]


def wait_for(
    pred: Callable[[], bool], proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S, poll_s: float = POLL_S
) -> None:
    """Poll ``pred()`` until it holds; an AssertionError with the run's output if ``proc`` exits first, or (after
    killing it) if ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        time.sleep(poll_s)
    proc.kill()
    raise AssertionError(f"timed out after {timeout} s:\n{proc.stdout.read()[-3000:]}")


def wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> None:
    """Until the run in ``out`` has logged ``n`` training steps (see ``wait_for``)."""
    wait_for(lambda: train_steps(out) >= n, proc, timeout)


def native_episode_rewards(policy, tok, rows: list[dict], env_cls, max_turns: int, max_tokens: int) -> list[float]:
    """The reference: each held-out row's greedy episode with align's native sampler (kept KV cache, turn waves), one
    per row, scored as the run scores it (``--env-reward sum``). Built from the pieces, not through align.train's
    eval."""
    from align.chat import TurnRenderer
    from align.envs.config import EnvConfig
    from align.envs.episodes import EpisodeRunner
    from align.envs.runner import EnvRunner
    from align.rollout.client import NativeClient
    from align.rollout.protocol import SamplingParams
    from align.run.policy import stop_ids

    stops = stop_ids(tok, policy.config)
    decode = lambda ids: tok.decode(ids[:-1] if ids and ids[-1] in stops else ids)
    with EnvRunner(None, env_cls, 0, 0.0) as envs:
        runner = EpisodeRunner(envs, TurnRenderer(tok), decode, EnvConfig(max_turns=max_turns, env_reward="sum"),
                               max_tokens, policy.config.max_position_embeddings)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
        eps = runner.run(NativeClient(policy), rows, 1, params)
    return [e.env_reward or 0.0 for e in eps]


def fleet_eval_config(tmp_path: Path, keep: int):
    """The eval-fleet runs' eval: every 2 steps on one vLLM eval engine, greedy (so a point can be re-scored with
    align's own sampler, ``greedy_eval``), snapshots under ``tmp_path / "eval_hf"`` (``keep`` of them kept), any
    skipped or crashed point failing the run."""
    from helpers_models import VLLM_TIMEOUT_S

    from align.eval.config import EvalConfig

    fleet = {"eval_interval": 2, "eval_num_gpus": 1, "eval_timeout_s": VLLM_TIMEOUT_S, "ci_test": True}
    return EvalConfig(**fleet, eval_hf_dir=str(tmp_path / "eval_hf"), eval_keep_snapshots=keep, eval_temperature=0.0)


def greedy_eval(policy, tok, eval_prompts: list[dict], max_tokens: int) -> tuple[dict, list]:
    """What an eval point of ``policy``'s weights must report, from align's own sampler: the greedy completions of
    the reverse task's ``eval_prompts`` scored with ``partial_credit`` (``score_completions``, avg@1); and the
    completions."""
    from align.eval.metrics import score_completions
    from align.rollout.native import generate
    from align.rollout.protocol import SamplingParams
    from align.run.policy import stop_ids

    stops = stop_ids(tok, policy.config)
    encoded = [tok.encode(r["prompt"]) for r in eval_prompts]
    comps = generate(policy, encoded, SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops))

    def reward(i, ids):
        text = tok.decode(ids[:-1] if ids and ids[-1] in stops else ids)
        return partial_credit(eval_prompts[i]["prompt"], text, answer=eval_prompts[i]["answer"])

    return score_completions(encoded, comps, reward, 1), comps


def char_moe_model(path) -> str:
    """The char task's shape as a Qwen3-MoE (every other layer sparse), random weights, saved at ``path``."""
    from align.model import ModelConfig, Transformer, save_pretrained
    from align.tasks import reverse

    d = {**vars(reverse.model_config(TOK)), "model_type": "qwen3_moe", "qkv_bias": False, "qk_norm": True}
    d.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=2)
    d.pop("hf_config"), d.pop("generation_config")
    return str(save_pretrained(Transformer(ModelConfig(**d)).init_weights(seed=0), path))


def two_turns(base_url: str, api_key: str, model: str, prompt: str, **row) -> float:
    """An agent written only against the ``openai`` client: the prompt, the reply, a user's "=" and a second reply."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6).choices[0].message
        messages += [{"role": "assistant", "content": reply.content or ""}, {"role": "user", "content": "="}]
    return (reply.content or "").count("a") / 6
