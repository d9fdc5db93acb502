"""align: a minimal, dependency-firewalled GRPO library.

Nothing is imported here on purpose: ``import align`` is stdlib-only and cheap, so the
vLLM rollout venv can import ``align.rollout.protocol`` without torch. Import the module
you need (``align.model``, ``align.grpo``, ``align.train``, ...).

Where things live, by floor (imports point down only; ``tests/test_layout.py`` checks it):

- ``align.train``: ``train()``, the step's stages on one page; ``main(argv)``, the CLI. ``align.sft`` beside it:
  supervised fine-tuning (``config``, ``data``: rows and ``--from-verified``, ``run``: its setup on ``align.run``).
- ``align.run``: a run directory and its life: ``config`` (TrainConfig), ``cli``, ``presets``, ``build``
  (``open_run() -> Run``), ``checkpoint`` (single-process and DCP), ``safety``, ``log``, ``plot``, ``teacher``
  (on-policy distillation's teacher).
- ``align.eval``: held-out evaluation (blocking, snapshot dispatch, fleets, pinned epochs) and its metrics.
- ``align.rollout``: prompts -> scored groups: ``protocol`` (the spool contract, stdlib), ``spool`` (its
  transport, stdlib), ``process``, ``native`` (the sampler), ``cpu_kernel``, ``client``, ``scoring`` (the ``score``
  request, stdlib), ``watcher``, ``groups``, ``engines``, ``pipeline``.
- what goes in: ``data``, ``rewards`` (+ ``reward_pool``: the worker processes), ``verifiers``, ``tasks``, ``envs``
  (the environment API; ``runner``: its episodes in process or in worker processes).
- the algorithm, no run state: ``model`` (+ ``attention``, ``moe``: experts, routing, replay), ``packing``,
  ``kernels``, ``lora``, ``grpo``, ``advantages``, ``learner``, ``device``, ``dist``; ``atomic`` (stdlib: atomic files and the commit marker) under everything.
"""

__version__ = "0.2.0"
