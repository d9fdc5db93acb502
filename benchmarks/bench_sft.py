"""SFT of the built-in reverse task's warm-started model on correct completions: held-out pass@1 before -> after, and
the wall time (issue 29, measured (a)).

The warm start is the main job's (``align.tasks.reverse.warm_start``, 800 steps: it mostly copies, pass@1 ~0.34).
The correct completions come from ``--source``:

- ``self`` (default): expert iteration from the warm-started model itself: ``--samples`` completions per training
  prompt sampled at T = 1, the correct ones kept (at most one per prompt), their sampled ids as they are;
- ``reference``: the task's reference answers (the reversed word) as the completions.

A GRPO-trained model's completions would be the issue's source; both here are cheaper stand-ins (a correct
completion of this task is the reversed word whoever samples it). Eval: the main job's, 200 held-out words, 4
samples per prompt at T = 1, pass@1.

    python benchmarks/bench_sft.py --out runs/bench_sft [--source self|reference] [--rows 1024] [--epochs 1]
        [--no-pack-sequences] [--compare-packing]

``--compare-packing`` also times the loss alone (``align.learner.nll_backward``, forward + backward, no optimizer),
packed vs padded alternating in this process on the same batches, median after a warm-up round: on the SFT rows
with the warm model (short rows of even length), and on 16-row batches of ragged random rows (16..512 tokens,
random-weight model of the same width and depth).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from common import numeric_flags


def correct_rows(model_dir: Path, words: list[dict], source: str, samples: int, seed: int) -> list[dict]:
    """SFT rows {"prompt", "completion", "answer"} of correct completions for ``words``."""
    if source == "reference":
        return [{"prompt": w["prompt"], "completion": w["answer"], "answer": w["answer"]} for w in words]
    from align.model import load_pretrained
    from align.rollout.native import generate
    from align.rollout.protocol import SamplingParams
    from align.tasks import reverse

    tok, model = reverse.tokenizer(), load_pretrained(model_dir)
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=10, stop_token_ids=[tok.eos_token_id], seed=seed)
    comps = generate(model, [tok.encode(w["prompt"]) for w in words], params)
    rows, done = [], set()
    for c in comps:
        w = words[c.prompt_index]
        text = tok.decode(c.token_ids[:-1] if c.token_ids[-1:] == [tok.eos_token_id] else c.token_ids)
        if c.prompt_index not in done and reverse.reward(w["prompt"], text, w["answer"]) == 1.0:
            done.add(c.prompt_index)
            rows.append({"prompt": w["prompt"], "completion": text, "answer": w["answer"]})
    return rows


def interleaved_ms(model, batches: list[tuple], rounds: int = 3) -> dict[str, float]:
    """Median ms of one ``nll_backward`` per batch, packed and padded alternating; the first round is a warm-up."""
    import statistics

    from align import learner
    from align.sft import SFTConfig

    cfgs = {"packed": SFTConfig(pack_sequences=True), "padded": SFTConfig(pack_sequences=False)}
    times: dict[str, list[float]] = {k: [] for k in cfgs}
    for r in range(rounds):
        for b in batches:
            for k, c in cfgs.items():
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                learner.nll_backward(model, c, *b)
                if r:
                    times[k].append(time.perf_counter() - t0)
    tokens = {"padded": sum(b[0].shape[0] * max(learner.row_lengths(b[2])) for b in batches),
              "packed": sum(r.tokens for b in batches for r in learner.plan_micro_batches(b[0], b[2], cfgs["packed"]))}  # fmt: skip
    out = {f"{k}_ms": round(statistics.median(v) * 1e3, 1) for k, v in times.items()}
    return {**out, "time packed/padded": round(out["packed_ms"] / out["padded_ms"], 2),
            "decoder tokens padded/packed": f"{tokens['padded']}/{tokens['packed']}"}  # fmt: skip


def compare_packing(model_dir: Path, rows: list[dict], batch_size: int) -> dict:
    """``--compare-packing``: packed vs padded loss time on the SFT rows and on ragged random rows."""
    import torch

    from align.model import Transformer, load_pretrained
    from align.sft.data import Example, Renderers, render_row
    from align.sft.run import tensors
    from align.tasks import reverse

    model, rs = load_pretrained(model_dir), Renderers(reverse.tokenizer())
    ex = [render_row(r, f"row {i}", rs, "all") for i, r in enumerate(rows)]
    task = [tensors(ex[s : s + batch_size], "cpu") for s in range(0, len(ex), batch_size)]
    ragged_model = Transformer(replace(model.config, vocab_size=512, max_position_embeddings=1024)).init_weights(seed=0)
    g = torch.Generator().manual_seed(0)

    def ragged() -> Example:
        n, p = int(torch.randint(16, 513, (1,), generator=g)), int(torch.randint(4, 16, (1,), generator=g))
        return Example(torch.randint(0, 512, (n,), generator=g).tolist(), [False] * p + [True] * (n - p), "", p)

    batches = [tensors([ragged() for _ in range(16)], "cpu") for _ in range(6)]
    return {"task rows": interleaved_ms(model, task), "ragged rows": interleaved_ms(ragged_model, batches)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench_sft")
    ap.add_argument("--source", choices=("self", "reference"), default="self")
    ap.add_argument("--rows", type=int, default=1024, help="training prompts the correct completions come from")
    ap.add_argument("--samples", type=int, default=4, help="--source self: samples per prompt")
    numeric_flags(ap, epochs=1, batch_size=32, lr=1e-3, threads=0)
    ap.add_argument("--pack-sequences", action=argparse.BooleanOptionalAction, default=True,
                    help="the learner's packed rows (align.sft's default); --no-pack-sequences pads every row")  # fmt: skip
    ap.add_argument("--compare-packing", action="store_true", help="also time the loss packed vs padded (above)")
    ap.add_argument("--eval-interval", type=int, default=1000, help="eval points besides before/after (default none)")
    args = ap.parse_args()

    from align.sft import SFTConfig, train
    from align.tasks import reverse

    out = Path(args.out)
    t0 = time.monotonic()
    base = out / "base_model"
    if not (base / "config.json").is_file():
        reverse.warm_start(base, steps=800, seed=0, log=lambda line: print(f"[bench] {line}", flush=True))
    t_warm = time.monotonic() - t0
    words = reverse.prompts(args.rows, "train", seed=0)
    t1 = time.monotonic()
    rows = correct_rows(base, words, args.source, args.samples, seed=1)
    t_rows = time.monotonic() - t1
    print(f"[bench] {len(rows)} SFT rows ({args.source}) in {t_rows:.0f} s", flush=True)
    held_out = [{"prompt": w["prompt"], "completion": w["answer"], "answer": w["answer"]}
                for w in reverse.prompts(200, "eval", seed=0)]  # fmt: skip
    cfg = SFTConfig(out=str(out / f"sft_{args.source}_{'packed' if args.pack_sequences else 'padded'}"),
                    epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, warmup_steps=3, threads=args.threads,
                    checkpoint_every=0, max_tokens=10, pack_sequences=args.pack_sequences)  # fmt: skip
    cfg.eval.eval_interval, cfg.eval.eval_n = args.eval_interval, 4
    t2 = time.monotonic()
    s = train(cfg, model=str(base), tokenizer=reverse.tokenizer(), rows=rows, eval_rows=held_out,
              reward=reverse.reward)  # fmt: skip
    t_sft = time.monotonic() - t2
    records = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    result = {
        "source": args.source,
        "pack_sequences": args.pack_sequences,
        "sft_rows": len(rows),
        "steps": s["steps"],
        "pass@1_before": s["eval_start"],
        "pass@1_after": s["eval_end"],
        "eval_loss_before": s["eval_loss_start"],
        "eval_loss_after": s["eval_loss_end"],
        "warm_start_s": round(t_warm, 1),
        "rows_s": round(t_rows, 1),
        "sft_s (with its evals)": round(t_sft, 1),
        "train_steps_s (step_time summed)": round(sum(r.get("step_time", 0.0) for r in records), 2),
    }
    if args.compare_packing:
        result["nll_backward packed vs padded"] = compare_packing(base, rows, args.batch_size)
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
