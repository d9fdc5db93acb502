"""Multi-turn sampling on the native sampler: each live episode keeps its KV cache between turns, so a turn
prefills only the environment's new tokens (the policy's own tokens are in the cache from sampling them).

Key decisions
- One cache of R rows (the episodes) with one shared write index, as ``align.rollout.native``: a turn's new tokens
  (different lengths per row) are left-padded to the longest, the padding slots invalid (``KVCache.valid``), and each
  row keeps its own positions (its real token count), so padding never shifts RoPE.
- No compaction inside a turn (a row that stopped keeps decoding into slots that are then marked invalid); between
  turns the cache keeps only the rows that go on, and grows to fit the next turn.
- Per-row token budgets (``max_new`` per row): the runner clamps each turn to the episode's and the context's remainder.
- The uniforms of every step are drawn for all of the session's original rows and indexed by row id (as
  ``native.sample_next`` does), and each turn has its own generator (seeded by the seed and the turn), so a row
  samples the same tokens whichever other rows are live or how long their earlier turns ran; ``total_rows`` and
  ``row_ids`` make these rows a part of a larger session (``align.dist``: one rank's share of a step's episodes).
- ``stop`` (``--partial-rollouts``, ``align.envs.partial``): called at each token step where rows ended their turn,
  with those rows' turns; when it answers True the rows still sampling are cut at that token boundary (their turn
  so far, ``finish_reason == "cut"``), so a call stops inside a turn as the single-turn sampler does.

Shapes: R live rows, S cache slots, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import NamedTuple

import torch

from align import heartbeat
from align.model import KVCache, Transformer
from align.rollout.native import packed_weights, sample_next, validate_prompts
from align.rollout.protocol import SamplingParams


class Turn(NamedTuple):
    """One row's sampled turn."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_logprobs: list[float]
    finish_reason: str  # "stop" (ends with a stop token) | "length" (its budget or the context ran out) | "cut"


Stop = Callable[[list[tuple[int, Turn]]], bool]  # the turns that just ended (row id, turn) -> cut the rest now


class Session:
    """The KV caches of a set of episodes across turns. ``start`` samples the first turn of ``n`` episodes per
    prompt (one shared prefill per prompt); ``next`` appends each continuing row's new tokens and samples its next
    turn. Rows are named by their index in ``start``'s output (prompt-major)."""

    def __init__(
        self, model: Transformer, params: SamplingParams, pack_weights: bool = True, total_rows: int | None = None
    ) -> None:
        self.model, self.params = model, params
        self.context = model.config.max_position_embeddings
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        if torch.is_autocast_enabled(self.device.type):
            self.dtype = torch.get_autocast_dtype(self.device.type)
        self.pack_weights, self.total_rows, self.turn = pack_weights, total_rows, 0
        self.cache: KVCache | None = None
        self.rows: list[int] = []  # original row id of each cache row
        self.pos: torch.Tensor | None = None  # (R,) each row's next position (its real token count)
        self.last: list[int] = []  # each cache row's last token (sampled, not yet in the cache)
        self.total = 0

    def _packed(self, rows: int):
        return packed_weights(self.model, rows) if self.pack_weights else contextlib.nullcontext()

    def start(
        self,
        prompts: list[list[int]],
        n: int,
        max_new: list[int],
        row_ids: list[int] | None = None,
        stop: Stop | None = None,
    ) -> list[Turn]:
        """The first turn: ``n`` rows per prompt; ``max_new`` per row (``len(prompts) * n``, each >= 1). ``row_ids``
        names the rows (default 0, 1, ...; each < ``total_rows``): a row's draws depend only on its id. ``stop``: see
        the module docstring."""
        if len(max_new) != len(prompts) * n or min(max_new) < 1:
            raise ValueError(f"max_new needs one budget >= 1 per row ({len(prompts) * n} rows), got {max_new}")
        cfg = self.model.config
        validate_prompts(prompts, cfg.vocab_size, self.context)
        P, dev = len(prompts), self.device
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        L = int(lens.max())
        with torch.inference_mode(), self._packed(P * n):
            cache = KVCache(cfg, P, L + max(max_new), self.dtype, dev)
            ids = torch.zeros(P, L, dtype=torch.long, device=dev)  # (P, L) left-padded
            for i, p in enumerate(prompts):
                ids[i, L - len(p) :] = torch.tensor(p, device=dev)
            pad = L - lens
            cache.valid[:, :L] = torch.arange(L, device=dev)[None] >= pad[:, None]
            positions = (torch.arange(L, device=dev)[None] - pad[:, None]).clamp(min=0)
            hidden = self.model(ids, positions=positions, cache=cache, return_hidden=True)[:, -1:]
            logits = self.model.lm_head(hidden)[:, 0]  # (P, V)
            cache.length = L
            rows = torch.arange(P, device=dev).repeat_interleave(n)
            cache.select(rows)
            ids = list(range(P * n)) if row_ids is None else list(row_ids)
            self.total = self.total_rows if self.total_rows is not None else P * n
            if len(ids) != P * n or len(set(ids)) != len(ids) or not all(0 <= i < self.total for i in ids):
                raise ValueError(f"row_ids must name the {P * n} rows uniquely in [0, {self.total}), got {row_ids}")
            self.cache = cache
            self.rows, self.pos = ids, lens[rows].clone()
            return self._decode(logits[rows], max_new, stop)

    def next(
        self, rows: list[int], new_ids: list[list[int]], max_new: list[int], stop: Stop | None = None
    ) -> list[Turn]:
        """Keep only ``rows`` (original row ids, in this order), prefill each one's ``new_ids`` after its last sampled
        token, and sample its next turn (``max_new`` tokens at most per row)."""
        if self.cache is None:
            raise RuntimeError("Session.next before Session.start")
        if not (len(rows) == len(new_ids) == len(max_new)) or not rows or min(max_new) < 1:
            raise ValueError("next() needs one new-token list and one budget >= 1 per row, and at least one row")
        where = {r: i for i, r in enumerate(self.rows)}
        missing = [r for r in rows if r not in where]
        if missing:
            raise ValueError(f"rows {missing} are not live in this session")
        dev, cache = self.device, self.cache
        keep = torch.tensor([where[r] for r in rows], device=dev)
        cache.select(keep)
        self.pos = self.pos[keep]
        last = [self.last[where[r]] for r in rows]
        self.rows = list(rows)
        # the new block per row: the last sampled token (not yet cached) + the environment's tokens, left-padded
        blocks = [[t, *ids] for t, ids in zip(last, new_ids)]
        T = max(len(b) for b in blocks)
        over = [r for r, b, m, p in zip(rows, blocks, max_new, self.pos.tolist()) if p + len(b) - 1 + m > self.context]
        if over:
            raise ValueError(f"rows {over}: the new tokens and max_new do not fit the context of {self.context}")
        R = len(rows)
        with torch.inference_mode(), self._packed(R):
            self._grow(T + max(max_new))
            s0 = cache.length
            ids = torch.zeros(R, T, dtype=torch.long, device=dev)
            positions = torch.zeros(R, T, dtype=torch.long, device=dev)
            for i, b in enumerate(blocks):
                ids[i, T - len(b) :] = torch.tensor(b, device=dev)
                positions[i, T - len(b) :] = torch.arange(len(b), device=dev) + self.pos[i]
                cache.valid[i, s0 + T - len(b) : s0 + T] = True  # the padding slots stay invalid
            hidden = self.model(ids, positions=positions, cache=cache, return_hidden=True)[:, -1:]
            logits = self.model.lm_head(hidden)[:, 0]  # (R, V)
            cache.length = s0 + T
            self.pos = self.pos + torch.tensor([len(b) for b in blocks], device=dev)
            return self._decode(logits, max_new, stop)

    def _grow(self, extra: int) -> None:
        c = self.cache
        need = c.length + extra
        if need <= c.max_len:
            return
        grow = need - c.max_len
        pad = (0, 0, 0, grow)  # the S axis of (L, B, K, S, D)
        c.k = torch.nn.functional.pad(c.k, pad)
        c.v = torch.nn.functional.pad(c.v, pad)
        c.valid = torch.nn.functional.pad(c.valid, (0, grow))

    def _decode(self, logits: torch.Tensor, max_new: list[int], stop: Stop | None) -> list[Turn]:
        rows = self._decode_rows(logits, max_new, stop is not None)
        answer = None
        with contextlib.closing(rows):  # an environment's stop that raises closes the decode loop at once
            while True:
                with heartbeat.working("sampler", engine="native session", rows=len(self.rows)):  # for the watchdog
                    try:
                        ended = rows.send(answer)
                    except StopIteration as finished:
                        return finished.value
                answer = stop(ended)  # outside the sampler's call: a stuck environment step is named as the environment

    def _decode_rows(self, logits: torch.Tensor, max_new: list[int], asks: bool) -> Generator:
        """Sample until every row stopped or used its budget; the slots a row wrote after its end become invalid.
        ``asks``: at each token step where rows ended their turn, yield those turns ``[(row id, Turn)]`` and, sent
        True, cut the rows still sampling. Returns every row's turn."""
        params, cache, dev = self.params, self.cache, self.device
        R = len(self.rows)
        generator = None
        if params.seed is not None:  # one stream per turn: earlier turns' lengths never shift a later turn's draws
            generator = torch.Generator(device=dev).manual_seed(params.seed * 1_000_003 + self.turn)
        self.turn += 1
        budget = torch.tensor(max_new, device=dev)
        room = self.context - self.pos  # (R,) positions left: the last token needs none after it
        budget = torch.minimum(budget, room)
        steps = int(budget.max())
        row_id = torch.tensor(self.rows, device=dev)
        out_tok = torch.zeros(R, steps, dtype=torch.long, device=dev)
        out_lp = torch.zeros(R, steps, device=dev)
        out_slp = torch.zeros(R, steps, device=dev)
        length = budget.clone()
        stopped = torch.zeros(R, dtype=torch.bool, device=dev)
        cut = torch.zeros(R, dtype=torch.bool, device=dev)
        done = budget <= 0
        stop_ids = torch.tensor(params.stop_token_ids, device=dev) if params.stop_token_ids else None
        start = cache.length
        tok = torch.zeros(R, dtype=torch.long, device=dev)
        for t in range(steps):
            tok, lp, slp = sample_next(logits, params, generator, row_id, self.total)
            heartbeat.beat("sampler")  # a token per row: progress for the watchdog (align.run.watchdog)
            out_tok[:, t], out_lp[:, t], out_slp[:, t] = tok, lp, slp
            hit = torch.isin(tok, stop_ids) if stop_ids is not None else torch.zeros_like(done)
            hit &= ~done
            ends = (t + 1 >= budget) & ~done
            finished = hit | ends
            length = torch.where(finished, torch.full_like(length, t + 1), length)
            stopped |= hit
            done |= finished
            if asks and bool(finished.any()):
                ended = [(i, self._turn(out_tok, out_lp, out_slp, i, t + 1, bool(hit[i]))) for i in _where(finished)]
                if (yield [(self.rows[i], turn) for i, turn in ended]) and not bool(done.all()):
                    cut = ~done  # the rows still sampling: cut after this token
                    length = torch.where(cut, torch.full_like(length, t + 1), length)
                    break
            if bool(done.all()) or t == steps - 1:
                break
            cache.valid[:, cache.length] = True
            logits = self.model(tok[:, None], positions=(self.pos + t)[:, None], cache=cache)[:, -1]
            cache.length += 1
        lengths = length.tolist()
        # a row's cache holds its tokens up to (not including) its last one; later slots are another row's steps
        for i, k in enumerate(lengths):
            cache.valid[i, start + max(k - 1, 0) : cache.length] = False
        toks, lps, slps, st, ct = out_tok.tolist(), out_lp.tolist(), out_slp.tolist(), stopped.tolist(), cut.tolist()
        self.last = [toks[i][k - 1] if k else 0 for i, k in enumerate(lengths)]
        self.pos = self.pos + length - 1  # the last token is not cached yet: ``next`` prefills it first
        return [
            Turn(toks[i][:k], lps[i][:k], slps[i][:k], "cut" if ct[i] else "stop" if st[i] else "length")
            for i, k in enumerate(lengths)
        ]

    @staticmethod
    def _turn(tok: torch.Tensor, lp: torch.Tensor, slp: torch.Tensor, i: int, k: int, hit: bool) -> Turn:
        """Row ``i``'s turn of ``k`` tokens from the (R, steps) outputs."""
        return Turn(tok[i, :k].tolist(), lp[i, :k].tolist(), slp[i, :k].tolist(), "stop" if hit else "length")


def _where(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().squeeze(-1).tolist()
