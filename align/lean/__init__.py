"""Lean 4 proving: the Goedel-Prover-V2 logic and the proof verifier (the ``--env lean`` reward).

Nothing is imported here; every module is stdlib-only, so ``extras/vllm_rollout`` (the rollout venv) imports
them without torch:

- ``goedel``: Goedel-Prover-V2 prompts, code extraction, error feedback, REPL verdicts (byte-identical to it);
- ``config``: ``LeanConfig``, the ``--lean-*`` flags;
- ``repl``: one leanprover-community/repl process (JSON on stdin/stdout), restarted on crash, hang, bad JSON,
  ``--lean-max-uses`` and ``--lean-memory-mb``;
- ``server``: the kimina-lean-server ``POST /verify`` client;
- ``guards``: the reward-hacking guards (statement changed, axioms, sorry, banned words, format, length);
- ``verify``: ``LeanVerifier`` (a pool over either) -> ``Verdict``.
"""
