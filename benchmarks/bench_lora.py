"""Full fine-tune vs LoRA: trainable parameters, optimizer bytes, training step time, and weight-sync cost.

    .venv/bin/python benchmarks/bench_lora.py                        # both shapes, train + sync parts
    .venv/bin/python benchmarks/bench_lora.py --part train --device cuda
    .venv/bin/python benchmarks/bench_lora.py --part sync --shape small

Random-weight Qwen2 models of the 31M shape and the Qwen2.5-0.5B shape (fp32, no downloads).
``train``: one AdamW step (forward, cross-entropy, backward, step) on a fixed batch, full vs LoRA r
(default 16, all decoder linears); the optimizer bytes are the AdamW state tensors actually allocated;
times are medians over repeats after a warm-up step.
``sync``: what the trainer does every ``--sync-every`` steps with ``--rollout spool``: export (full HF
snapshot vs PEFT adapter dir) + ``sync_weights`` round trip to the real vLLM CPU worker (``.venv-rollout``,
in-process engine; full: ``reload_weights``; adapter: a new ``LoRARequest``), median over repeats after one
untimed warm-up sync (first-use costs, paid once per run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from align import lora
from align.model import ModelConfig, Transformer, save_pretrained

SHAPES = {  # name: (config kwargs, batch rows, sequence length)
    "small": (
        {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False},
        8, 128,
    ),
    "qwen2.5-0.5b": (
        {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True},
        2, 128,
    ),
}  # fmt: skip


def build(name: str, rank: int, device: str = "cpu") -> Transformer:
    kw = SHAPES[name][0]
    cfg = ModelConfig(model_type="qwen2", qkv_bias=True, max_position_embeddings=512, **kw)
    model = Transformer(cfg).init_weights(seed=0).to(device)
    model.inv_freq = model.inv_freq.to(device)
    if rank:
        lora.apply_lora(model, lora.LoraConfig(rank=rank, alpha=2.0 * rank), base_model="bench", seed=0)
    return model


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Trainer:
    """One model (full or LoRA) with its AdamW and a fixed batch; ``step()`` times one optimizer step."""

    def __init__(self, name: str, rank: int, device: str, rows: int, seq: int) -> None:
        self.model = build(name, rank, device).train()
        self.params = lora.trainable_parameters(self.model)
        self.opt = torch.optim.AdamW(self.params, lr=1e-5)
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, self.model.config.vocab_size, (rows, seq + 1), generator=g).to(device)  # (B, T+1)
        self.name, self.rank, self.device, self.times = name, rank, device, []

    def step(self) -> float:
        sync_device(self.device)
        t0 = time.perf_counter()
        logits = self.model(self.ids[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), self.ids[:, 1:].flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync_device(self.device)
        return time.perf_counter() - t0

    def row(self) -> dict:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return {
            "shape": self.name, "mode": f"lora r={self.rank}" if self.rank else "full", "device": self.device,
            "total_params": sum(p.numel() for p in self.model.parameters()),
            "trainable_params": sum(p.numel() for p in self.params),
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in state), "step_s": statistics.median(self.times),
        }  # fmt: skip


def bench_train(name: str, rank: int, device: str, repeats: int, rows: int, seq: int, apart: bool) -> list[dict]:
    """Full and LoRA side by side, their steps interleaved (load on a shared machine hits both alike);
    ``apart``: one after the other (peak memory of one model: a 0.5B full fine-tune holds ~8 GB)."""
    if apart:
        out = []
        for r in (0, rank):
            t = Trainer(name, r, device, rows, seq)
            t.step()
            t.times = [t.step() for _ in range(repeats)]
            out.append(t.row())
            del t
        return out
    pair = [Trainer(name, 0, device, rows, seq), Trainer(name, rank, device, rows, seq)]
    for t in pair:
        t.step()  # warm-up: allocates the AdamW state
    for _ in range(repeats):
        for t in pair:
            t.times.append(t.step())
    return [t.row() for t in pair]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def bench_sync(name: str, rank: int, repeats: int, root: Path) -> list[dict]:
    from align.rollout.client import make_rollout_client, spawn_worker

    base = save_pretrained(build(name, 0), root / "base")
    model = build(name, rank)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained-looking adapter (B != 0); the cost does not depend on the values
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.01)
    plain = lora.merged_model(model)
    rows = []
    for mode, policy, extra in (("full", plain, []), (f"lora r={rank}", model, ["--max-lora-rank", str(rank)])):
        spool = root / f"spool-{len(rows)}"
        handle = spawn_worker(spool, model=base, log_path=root / f"worker-{len(rows)}.log", max_model_len=256,
                              dtype="float32", in_process=True, extra_args=extra, ready_timeout_s=900)  # fmt: skip
        try:
            client = make_rollout_client("spool", spool=spool, timeout_s=900, worker=handle)
            export_s, sync_s, total_s, nbytes, method = [], [], [], 0, ""
            for v in range(repeats + 1):  # v0: a warm-up sync (first-use costs), not timed
                t0 = time.perf_counter()
                snap = lora.save_policy(policy, root / f"snap-{mode[:4]}-v{v}")
                t1 = time.perf_counter()
                client.sync_weights(snap, v)
                t2 = time.perf_counter()
                if v:
                    export_s.append(t1 - t0)
                    sync_s.append(t2 - t1)
                    total_s.append(t2 - t0)
                nbytes, method = dir_bytes(snap), client.last_timings["sync_method"]
                if v:
                    shutil.rmtree(root / f"snap-{mode[:4]}-v{v - 1}")
        finally:
            handle.shutdown(grace_s=10)
        rows.append({"shape": name, "mode": mode, "method": method, "bytes": nbytes,
                     "export_s": statistics.median(export_s), "sync_s": statistics.median(sync_s),
                     "total_s": statistics.median(total_s)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--part", choices=["train", "sync", "all"], default="all")
    ap.add_argument("--device", default="cpu", help="device of the train part (cpu | cuda)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=0, help="train batch rows (0 = the shape's default)")
    ap.add_argument("--seq", type=int, default=0, help="train sequence length (0 = the shape's default)")
    ap.add_argument("--apart", action="store_true", help="train part: one model at a time (less memory)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    rows: list[dict] = []
    if args.part in ("train", "all"):
        print("| shape | mode | device | batch | trainable params | optimizer bytes | step s | step vs full |")
        print("|---|---|---|---|---|---|---|---|")
        for name in shapes:
            _, rows_, seq = SHAPES[name]
            full, lo = bench_train(
                name, args.rank, args.device, args.repeats, args.rows or rows_, args.seq or seq, args.apart
            )
            for r in (full, lo):
                share = r["trainable_params"] / r["total_params"]
                print(f"| {name} | {r['mode']} | {r['device']} | {args.rows or rows_}x{args.seq or seq} | {r['trainable_params']:,} ({share:.2%}) | "
                      f"{r['optimizer_bytes'] / 2**20:,.1f} MiB | {r['step_s']:.3f} | "
                      f"{r['step_s'] / full['step_s']:.2f}x |", flush=True)  # fmt: skip
            rows += [full, lo]
    if args.part in ("sync", "all"):
        print("| shape | mode | worker method | bytes | export s | sync s | export + sync s | vs full |")
        print("|---|---|---|---|---|---|---|---|")
        for name in shapes:
            with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
                full, lo = bench_sync(name, args.rank, args.repeats, Path(tmp))
            for r in (full, lo):
                print(f"| {name} | {r['mode']} | {r['method']} | {r['bytes'] / 2**20:,.2f} MiB | {r['export_s']:.3f} | "
                      f"{r['sync_s']:.3f} | {r['total_s']:.3f} | {r['total_s'] / full['total_s']:.3f}x |", flush=True)  # fmt: skip
            rows += [full, lo]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
