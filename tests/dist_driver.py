"""Driver of tests/test_dist.py (not a test): ``train()`` on a tiny model, run as one process or under torchrun.

argv[1]: JSON {"cfg": TrainConfig fields, "model": dir, "calls": path, "per_rank_normaliser": bool, "hang": {rank,
after_calls}, "kill_in_save": {rank, call}, "eval": bool (held-out prompts, cfg["eval"] kept), "agent": "global" |
"rank_local" (the episodes are ``drive`` runs through the gateway; "rank_local": seeded by rank-local index)}. Rank 0
writes the (prompt, completion) pairs the reward saw, in call order, to "calls"; with a --teacher (cfg["distill"])
each rank writes the teacher's parameter count it holds and the whole count to "calls" + ".teacher{rank}.json"; with
"agent" each rank writes the gateway URL of each agent run it ran to "calls" + ".agents{rank}.json". With "runs"
(a list of such specs): each in turn in this one launch (``batch``), which saves a torchrun and a torch import per
run. With "sft": tests/test_sft.py's runs (``sft``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request

import torch
from helpers_train import PROMPTS, TOK

from align import dist
from align.envs import Step
from align.eval import CheckpointEvalFn
from align.gateway import agents
from align.lean.env import LeanEnv
from align.tasks.agent import ChatCharTokenizer
from align.train import TrainConfig, train

EVAL_PROMPTS = [{"prompt": w + "="} for w in ("ca", "dba", "a")]
CALLS: list[list[str]] = []


class WeightSum(CheckpointEvalFn):
    """The snapshot-eval test's CheckpointEvalFn: the sum of |w| over the exported snapshot."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input) -> dict[str, float]:
        from safetensors.torch import load_file

        weights = load_file(f"{checkpoint_dir}/model.safetensors")
        return {"weight_sum": sum(float(t.double().abs().sum()) for t in weights.values())}


HANG = {}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = (f"{sys.executable} {ROOT}/extras/vllm_rollout/lean_repl_standin.py --replies "
           f"{ROOT}/tests/lean_fixtures/standin_replies.json")  # fmt: skip
STATEMENT = "theorem t : 1 + 1 = 2 := by\n"
PROOFS = (
    "```lean4\ntheorem t : 1 + 1 = 2 := by\n  norm_num\n```",
    "```lean4\ntheorem t : 1 + 1 = 2 := by\n  simp\n```",
)


class Retry(LeanEnv):
    """The environment of the multi-turn run, on --env lean's stage (each rank's own LeanVerifier pool over the REPL
    stand-in, verdict rewards, lean/* metrics): a completion with two or more 'a's stands for a proof the stand-in
    accepts (reward 1, the episode ends), any other for one it answers with compiler errors, whose correction
    feedback the char task reads as '=' (its tokenizer has no chat template) before it tries again."""

    check_rows = staticmethod(lambda rows: None)  # the char task's rows are words, not Lean problems

    def __init__(self, prompt: str, **_):
        super().__init__(name=prompt, formal_statement=STATEMENT)
        self.prompt = prompt

    def reset(self) -> str:
        return self.prompt

    def step(self, completion: str) -> Step:
        st = super().step(PROOFS[completion.count("a") < 2])
        return st if st.observation is None else st._replace(observation="=")


CHAT_TOK = ChatCharTokenizer(TOK.alphabet)  # TOK's ids, with the agent task's tiny chat template (gateway requests)
AGENT_RUNS: list[str] = []  # the gateway URL of each agent run of this rank


def drive(base_url: str, api_key: str, model: str, prompt: str, **_) -> float:
    """The agent of the agent runs, stdlib only (urllib, as align/tasks/agent.py's): the prompt, then '=' after each
    reply, two requests (the second extends the first: one trajectory); its reward the replies' share of 'a's."""
    AGENT_RUNS.append(base_url)
    messages, replies = [{"role": "user", "content": prompt}], []
    for _ in range(2):
        req = urllib.request.Request(
            base_url + "/chat/completions",
            data=json.dumps({"model": model, "messages": messages}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            replies.append(json.loads(resp.read())["choices"][0]["message"]["content"])
        messages += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": "="}]
    return "".join(replies).count("a") / 8


def reward(prompt: str, completion: str, **_) -> float:
    CALLS.append([prompt, completion])
    if HANG and dist.rank() == HANG["rank"] and len(CALLS) > HANG["after_calls"]:
        time.sleep(3600)  # a rank that hangs (tests/test_dist.py: the others must fail within --dist-timeout-s)
    return completion.count("a") / 4


def sft(spec: dict) -> None:
    """tests/test_sft.py: ``align.sft.train`` once per entry of spec["sft"] ({"cfg": SFTConfig fields,
    "per_rank_normaliser": bool}) on spec["rows"] / spec["eval_rows"], in this one launch, in a process group this
    driver owns (train() uses it and leaves it)."""
    from align.sft import SFTConfig
    from align.sft import train as sft_train

    torch.distributed.init_process_group("gloo")
    stock = dist.reduce_counts
    for run in spec["sft"]:
        # the negative control: each rank divides by its own target count (at least 1, so that a rank without rows
        # still runs its padding forward/backward and the collectives stay aligned)
        own = lambda counts: (max(counts[0], 1), counts[1])
        dist.reduce_counts = own if run.get("per_rank_normaliser") else stock
        sft_train(SFTConfig(**run["cfg"]), model=spec["model"], tokenizer=TOK, rows=spec["rows"],
                  eval_rows=spec["eval_rows"])  # fmt: skip
    torch.distributed.barrier()  # as batch(): no rank tears the group down while the other still uses it
    torch.distributed.destroy_process_group()


def record_teacher_shards(path: str) -> None:
    """Wrap ``open_teacher`` (as align.run.policy calls it) to write this rank's share of the in-process teacher's
    parameters: FSDP2 leaves a rank 1/world of each (DTensor shards), one process all of them."""
    from align.run import policy

    stock = policy.open_teacher

    def opened(*args):
        teacher = stock(*args)
        params = list(teacher.model.parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        with open(f"{path}.teacher{dist.rank()}.json", "w") as fh:
            json.dump({"local": local, "total": sum(p.numel() for p in params)}, fh)
        return teacher

    policy.open_teacher = opened


def run(spec: dict, owns_group: bool) -> None:
    """One ``train()`` of ``spec``, its patches undone after it. ``owns_group``: train() creates and must end the
    process group (one run per launch); else it runs in the group ``batch`` made and must leave it."""
    from align.run import policy

    stock_counts, stock_teacher, stock_seed = dist.reduce_counts, policy.open_teacher, agents.request_seed
    CALLS.clear()
    HANG.clear()
    AGENT_RUNS.clear()
    if spec.get("agent") == "rank_local":  # the negative control: a request seeded by its episode's rank-local index
        jobs = spec["cfg"]["prompts_per_step"] * spec["cfg"]["group_size"]
        agents.request_seed = lambda seed, i, requests: stock_seed(seed, i - dist.share(jobs)[0], requests)
    if spec.get("per_rank_normaliser"):  # the negative control: each rank divides by its own counts
        dist.reduce_counts = lambda counts: counts
    HANG.update(spec.get("hang", {}))
    if kill := spec.get("kill_in_save"):  # kill -9 of one rank after its DCP shards, before the commit marker
        import torch.distributed.checkpoint as dcp

        stock, calls = dcp.save, []

        def save(*args, **kwargs):
            out = stock(*args, **kwargs)
            calls.append(1)
            if dist.rank() == kill["rank"] and len(calls) == kill["call"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        dcp.save = save
    if spec["cfg"].get("distill", {}).get("teacher"):
        record_teacher_shards(spec["calls"])
    cfg = TrainConfig(**spec["cfg"])
    cfg.lean.repl, cfg.lean.workers = STANDIN, 2  # the verifier of the environment case (Retry)
    if not spec.get("eval"):
        cfg.eval.eval_interval = 0
    cfg.log.log_completions_every = 0
    agent = drive if spec.get("agent") else None
    try:
        train(
            cfg,
            model=spec["model"],
            tokenizer=CHAT_TOK if agent else TOK,
            prompts=PROMPTS,
            reward=reward,
            eval_prompts=EVAL_PROMPTS if spec.get("eval") else None,
            env=Retry if spec.get("env") else None,
            agent=agent,
        )
    finally:
        dist.reduce_counts, policy.open_teacher, agents.request_seed = stock_counts, stock_teacher, stock_seed
    if agent:
        with open(f"{spec['calls']}.agents{dist.rank()}.json", "w") as fh:
            json.dump(AGENT_RUNS, fh)
    # tests/test_dist.py: every torchrun run checks train() ended the group it created and left the caller's
    if owns_group and torch.distributed.is_initialized():
        sys.exit("train() returned with its process group still initialised")
    if not owns_group and dist.env_world_size() > 1 and not torch.distributed.is_initialized():
        sys.exit("train() ended a process group it did not create")
    if dist.is_main():  # torchrun's RANK once the group is gone
        with open(spec["calls"], "w") as fh:
            json.dump(CALLS, fh)


def batch(specs: list[dict]) -> None:
    """Every spec in turn in this one launch; under torchrun in one process group this driver owns (train() uses it
    and leaves it, as a caller's group)."""
    grouped = dist.env_world_size() > 1
    if grouped:
        torch.distributed.init_process_group("gloo")
    for spec in specs:
        run(spec, owns_group=False)
    if grouped:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def main() -> None:
    spec = json.loads(sys.argv[1])
    if "sft" in spec:
        return sft(spec)
    if "runs" in spec:
        return batch(spec["runs"])
    run(spec, owns_group=True)


if __name__ == "__main__":
    main()
    # Results are written and the group is gone: skip interpreter finalization, where under load a rank sometimes
    # aborted ("terminate called without an active exception", exit -6) after a complete run (gloo threads torn down
    # during finalization, cf. pytorch/pytorch#179291); a failure above still exits non-zero through its exception.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
