"""Rollout backends. stdlib-only at import: ``protocol`` must load with torch absent.

- ``align.rollout.protocol``: sampling params, completions and the spool file protocol (stdlib only).
- ``align.rollout.native``: the in-process torch sampler.
- ``align.rollout.client``: ``make_rollout_client("native" | "spool")`` and ``spawn_worker``.
"""
