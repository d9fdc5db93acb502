"""Rollout backends. stdlib-only at import: ``protocol`` and ``spool`` must load with torch absent.

- ``align.rollout.protocol``: sampling params, completions and the spool's messages (stdlib only).
- ``align.rollout.spool``: the spool directory that carries them between trainer and worker (stdlib only).
- ``align.rollout.native``: the in-process torch sampler.
- ``align.rollout.client``: ``make_rollout_client("native" | "spool")`` and ``spawn_worker``.
"""
