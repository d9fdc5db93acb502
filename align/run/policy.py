"""The learning side of a run, shared by ``align.train`` and ``align.sft``: the policy loaded (resumed, LoRA,
sharded), its optimizer and schedule, the data cursor a checkpoint stores, and ``Learner``, the GRPO run's part
that owns them (``Learner.open``: the policy, its frozen reference, the teacher; ``update(batch)``: one step).
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from align import dist, heartbeat, lora
from align import learner as learner_lib
from align import model as model_lib
from align.learner import StepBatch, Update, make_batch, optimize
from align.run import checkpoint as ckpt
from align.run.config import lr_lambda
from align.run.teacher import open_teacher


def stop_ids(tokenizer: Any, model_cfg: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = model_cfg.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def completion_text(tokenizer: Any, stops: list[int], ids: list[int]) -> str:
    """A completion's text: its ids decoded, the stop token that ended it dropped."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] in stops else ids)


def batch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
    return order


class DataCursor:
    """Which prompts come next: epochs of a seeded shuffle. ``state`` ({"epoch", "index"}) is what a checkpoint
    stores; the rollout pipeline reads it (under its lock) on the producer thread with K >= 1."""

    def __init__(self, n: int, seed: int, state: dict | None = None) -> None:
        self.n, self.seed = n, seed
        self.state = dict(state) if state else {"epoch": 0, "index": 0}

    def next_prompts(self, k: int) -> list[int]:
        order = batch_order(self.n, self.seed, self.state["epoch"])
        idx = []
        while len(idx) < k:
            if self.state["index"] >= len(order):
                self.state["epoch"] += 1
                self.state["index"] = 0
                order = batch_order(self.n, self.seed, self.state["epoch"])
            idx.append(order[self.state["index"]])
            self.state["index"] += 1
        return idx


def load_policy(cfg: Any, place: Any, model_path: str, out: Path) -> tuple[torch.nn.Module, tuple | None, dict | None]:
    """(policy, the checkpoint to resume or None, its trainer state or None): the model of ``model_path`` (LoRA:
    frozen base + trainable adapters; a LoRA checkpoint holds only the adapter), or a resumed single-process
    checkpoint's; a sharded (torchrun) checkpoint is loaded into it after sharding (``open_optimizer``). Sets
    gradient checkpointing and the CPU threads."""
    from align.device import resolve_threads

    load = model_lib.load_pretrained  # looked up at call time (tests patch align.model.load_pretrained)
    resume = dist.main_first(partial(ckpt.pick, out / "checkpoints", cfg.resume_from))  # rank 0 moves later ones aside
    if cfg.lora.enabled:
        policy = load(model_path, dtype=place.param_dtype, device=place.device)
        lora.apply_lora(policy, cfg.lora, base_model=model_path, seed=cfg.seed)
        if resume:
            ckpt.load_adapter(policy, resume[1])
    elif resume and not ckpt.is_sharded(resume[1]):
        policy = ckpt.load_model(resume[1], place.param_dtype, device=place.device)
    else:
        policy = load(model_path, dtype=place.param_dtype, device=place.device)
    state = ckpt.load_state(resume[1]) if resume else None
    if resume and ckpt.is_sharded(resume[1]):  # on every rank, before any collective
        ckpt.check_model_config(resume[1], state, policy)
    policy.gradient_checkpointing = cfg.gradient_checkpointing
    torch.set_num_threads(resolve_threads(cfg.threads))  # --threads 0: OMP_NUM_THREADS, else every CPU
    return policy, resume, state


def open_optimizer(
    cfg: Any, policy: torch.nn.Module, place: Any, resume: tuple | None, state: dict | None
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW on the trainable parameters and the LR schedule (``lr_lambda``) of the (sharded) policy; resuming, their
    states (and a sharded checkpoint's weights) restored: any world size resumes any checkpoint (DCP resharding, or
    the full single-process state)."""
    from align.device import make_optimizer

    opt = make_optimizer(
        lora.trainable_parameters(policy), place, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    if resume:
        ckpt.restore_any(resume[1], state, policy, opt)
        sched.load_state_dict(state["scheduler"])
    return opt, sched


class Start(NamedTuple):
    """Where a run starts: step 0 at the data's start, or a checkpoint's step, data cursor state and (K >= 1)
    pending batches."""

    step: int
    cursor: dict | None
    pending: list
    resumed: bool
    carried: list  # --partial-rollouts: the cut groups carried into the next generate call (align.rollout.partial)


class Learner:
    """The trainable side of a run: the policy, its frozen reference (or None), the optimizer and its schedule, the
    teacher (on-policy distillation, or None), the non-finite step count. ``update(batch)`` is one step's learning."""

    def __init__(
        self, policy: Any, ref_model: Any, opt: Any, sched: Any, cfg: Any, place: Any, teacher: Any, nonfinite: Any
    ) -> None:
        self.policy, self.ref_model, self.opt, self.sched = policy, ref_model, opt, sched
        self.cfg, self.place, self.teacher, self.nonfinite = cfg, place, teacher, nonfinite
        self.mcfg = policy.config

    @classmethod
    def open(cls, cfg: Any, place: Any, model_path: str, encoded: list[list[int]], out: Path) -> tuple[Learner, Start]:
        """The policy (resumed, LoRA, sharded), reference, optimizer, schedule and teacher of ``model_path``; where
        the run starts. ``encoded``: every prompt's ids (training, then held-out), checked against the context."""
        learner_lib.check_token_budget(cfg, [len(ids) for ids in encoded])  # before the model loads
        cfg.moe.check_run(cfg.rollout, model_path)  # --routing-replay: a MoE model and the native rollout
        load = model_lib.load_pretrained  # looked up at call time (tests patch align.model.load_pretrained)
        policy, resume, state = load_policy(cfg, place, model_path, out)
        cfg.moe.prepare(policy)  # MoE: --freeze-router, before the optimizer takes the trainable parameters
        mcfg = policy.config
        ref_model = None
        if cfg.loss.kl_coef > 0 and cfg.lora.enabled:  # the policy with its adapters off is the frozen base
            ref_model = policy  # (align.learner.reference_logprobs runs it inside align.lora.adapters_disabled)
        elif cfg.loss.kl_coef > 0:
            ref_model = load(model_path, dtype=place.frozen_dtype, device=place.device).requires_grad_(False)
        for i, ids in enumerate(encoded):
            if len(ids) + cfg.max_tokens > mcfg.max_position_embeddings:
                raise ValueError(
                    f"prompt {i} ({len(ids)} tokens) + --max-tokens {cfg.max_tokens} does not fit the model's context "
                    f"of {mcfg.max_position_embeddings}; shorten it or lower --max-tokens"
                )
        policy, ref_model = dist.shard(policy, place.precision), ref_model and dist.shard(ref_model, place.precision)
        opt, sched = open_optimizer(cfg, policy, place, resume, state)
        step, cursor, pending, carried = 0, None, [], []
        if resume:
            step, cursor, pending = state["step"], state["cursor"], state.get("pending_batches", [])
            carried = state.get("carry") or []
            print(f"[align] resuming from {resume[1]} (step {step})", flush=True)
        nonfinite = learner_lib.NonFiniteSteps(cfg.max_nonfinite_steps, (state or {}).get("nonfinite_steps", 0))
        teacher = open_teacher(cfg, place, out)  # --teacher: frozen like the reference, or a vLLM worker
        if not resume:
            torch.manual_seed(cfg.seed)
        learner = cls(policy, ref_model, opt, sched, cfg, place, teacher, nonfinite)
        return learner, Start(step, cursor, pending, bool(resume), carried)

    def update(self, batch: StepBatch) -> Update:
        """The step's batch on ``place.device``, ``align.learner.optimize`` (micro-batches, global normalisers), then
        the schedule's step."""
        on_device = make_batch(batch, self.cfg, self.place.device)
        with heartbeat.working("learner"):
            upd = optimize(self.policy, self.ref_model, self.opt, self.cfg, self.place, on_device, self.teacher)
        self.sched.step()
        return upd

    def close(self) -> None:
        if self.teacher is not None:
            self.teacher.close()
            self.teacher = None
