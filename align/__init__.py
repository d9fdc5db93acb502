"""align: a minimal, dependency-firewalled GRPO library.

Nothing is imported here on purpose: ``import align`` is stdlib-only and cheap, so the
vLLM rollout venv can import ``align.rollout.protocol`` without torch. Import the module
you need (``align.model``, ``align.grpo``, ``align.train``, ...).
"""

__version__ = "0.1.0"
