"""align: a minimal, dependency-firewalled GRPO library.

Nothing but ``os`` and ``sys`` is imported here on purpose: ``import align`` is stdlib-only and cheap, so the
vLLM rollout venv can import ``align.rollout.protocol`` without torch; it sets one default, OpenMP's wait
policy (below). Import the module
you need (``align.model``, ``align.grpo``, ``align.train``, ...).

Where things live, by floor, top first (a module imports modules of its own floor or lower, never higher, and no
import circle anywhere: ``FLOORS`` in ``tests/test_layout.py`` lists every module and checks both):

- entry points: ``align.train``: ``train()``, the step's stages on one page; ``main(argv)``, the CLI. ``align.sft``
  beside it: supervised fine-tuning (``config``, ``data``: rows and ``--from-verified``, ``run``: its setup on
  ``align.run``).
- ``align.run``: a run directory and its life: ``config`` (TrainConfig), ``cli`` (+ ``help``: grouped ``--help``,
  one-line errors; ``config_file``: ``--config`` TOML / YAML / JSON), ``presets``, ``advice`` (warnings), ``build``
  (``open_run() -> Run``), ``parts`` (``Run``, ``Learner``, ``Checkpointer``), ``checkpoint`` (single-process and DCP), ``safety``, ``log``, ``plot``, ``task``,
  ``teacher`` (on-policy distillation's teacher), ``watchdog`` (``--stall-timeout-s``).
- ``align.eval``: held-out evaluation (blocking, snapshot dispatch, fleets, pinned epochs) and its metrics.
- ``align.tasks``: the built-in tasks and environments (``TASKS``, ``ENVIRONMENTS``, the ``TaskModule`` protocol; ``reverse``, ``multiturn``, ``agent``) and their warm
  start.
- environments: ``align.envs`` (the environment API and its hooks; ``runner``: its episodes in
  process or in worker processes; ``sampler``: a run's one sampling seam, single-turn and episodes; ``episodes``,
  ``tools``, ``sandbox``) and ``align.lean`` (the Lean environment, its verifier and correction queue).
- ``align.rollout``: prompts -> scored groups: ``process``, ``message`` (one spool message, stdlib), ``spool`` (its
  transport, stdlib), ``protocol`` (the data contract, stdlib: the vLLM worker's one import, re-exporting both),
  ``native`` (the sampler), ``cpu_kernel``, ``sessions``, ``client``, ``backends`` (the ``BACKENDS``
  table), ``teacher_logprobs`` (the ``score`` request,
  stdlib), ``watcher``, ``deadlines`` (``--group-timeout-s``), ``groups`` (``Episode``, ``Groups``), ``engines``, ``pipeline``.
- what goes in: ``data``, ``chat`` (HF tokenizer, chat template, turns), ``char_tokenizer``, ``specs`` (loading
  ``module:name`` / ``file.py:name``), ``rewards`` (+ ``reward_pool``: the worker processes;
  ``reward_calls``: TRL-shaped batch and ``async`` calls), ``verifiers``.
- the algorithm, no run state: ``model`` (+ ``attention``, ``moe``: experts, routing, replay), ``packing``, ``kernels``, ``lora``, ``grpo``,
  ``advantages``, ``learner``, ``device``, ``dist``; beneath them the CPU paths: ``cpu_linear`` (fp32 GEMMs on oneDNN
  on AMD CPUs), ``fused_cpu`` (C++ RMSNorm, RoPE, SwiGLU, grouped GEMMs), ``cxx`` (building them).
- stdlib base: ``atomic`` (atomic files and the commit marker), ``child`` (one child process in its own group, JSON
  over pipes, deadlines, bounded reads), ``errors`` (``InputError``, ``Interrupted``), ``heartbeat`` (progress beats
  for the watchdog).
"""

import os as _os
import sys as _sys

__version__ = "0.2.0"

# OpenMP worker threads that sleep when idle (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning ~300k iterations
# between parallel regions (libgomp's default). A decode step is ~40 small parallel regions: on a machine whose cores
# other processes share, spinning workers keep a core busy and each region waits for a descheduled sibling; the
# native sampler's 31M call went from 39-150 s to 2.1-6.4 s on 2 threads at load 7-24 (docs/performance.md). libgomp
# reads it once, when torch loads it: set here, before align imports torch; a value of your own (OMP_WAIT_POLICY or
# GOMP_SPINCOUNT) wins, and a process that imported torch first keeps libgomp's default.
if "torch" not in _sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys():
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
