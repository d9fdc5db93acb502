"""align.sft: the targets are exactly the assistant's tokens, the loss is the whole batch's mean token NLL whatever the
micro-batching and the number of torchrun ranks, a kill -9 resumes exactly, --from-verified keeps the sampled ids,
and bad input fails before the model loads.

Models: the char task's random-weight model (tests/helpers_train.py) and a random-weight model over a byte-level BPE
trained in the test with Qwen2.5's real chat template (tests/helpers_tokenizer.py). The Lean driver's verification
records are written here with the fields ``pipeline_gen_verify.verify_record`` writes (there is no Lean here); the
generation records come from the driver's own ``lean_records.make_record``."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_tokenizer import make_bpe_tokenizer
from helpers_train import TOK, comparable, records, run_cli, wait_for

from align import learner, lora, packing
from align.attention import PackedLayout, Segment
from align.data import HFTokenizer
from align.model import ModelConfig, Transformer, load_pretrained, save_pretrained
from align.run.checkpoint import committed
from align.sft import SFTConfig, main, train
from align.sft.data import Renderers, render_row, verified_examples
from align.sft.run import tensors

ROOT = Path(__file__).resolve().parents[1]
LOSS_TOL = 1e-5  # losses and gradients: the same terms summed in another order
PARAM_TOL = 1e-5  # parameters after the last step, 1 vs 2 ranks
CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "Reverse the word abcd."},
        {"role": "assistant", "content": "dcba"},
    ]
}
WORDS = ("ab", "cd", "bca", "dd", "abc", "cab", "dab", "bb", "dcab")
ROWS = [{"prompt": w + "=", "completion": w[::-1], "answer": w[::-1]} for w in WORDS]  # 9 rows of 3 to 5 targets


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[HFTokenizer, str]:
    """(the BPE tokenizer with Qwen2.5's template, a random-weight model dir over its vocabulary with its files)."""
    d = make_bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "tok", template="qwen2.5", eos_token="<|im_end|>")
    tok = HFTokenizer(d)
    cfg = ModelConfig(model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, qkv_bias=True,
                      max_position_embeddings=512, eos_token_id=tok.eos_token_id[0])  # fmt: skip
    model = save_pretrained(Transformer(cfg).init_weights(seed=0), d.parent / "model")
    for f in d.iterdir():
        shutil.copy(f, model / f.name)
    return tok, str(model)


def char_model_dir(tmp_path: Path, char_model: str) -> str:
    """The char model with its tokenizer files beside it (what ``--model`` alone needs)."""
    d = tmp_path / "char"
    shutil.copytree(char_model, d)
    TOK.save(d)
    return str(d)


def runs_of(mask: list[bool], ids: list[int]) -> list[list[int]]:
    """The ids of each maximal run of True in ``mask``."""
    out: list[list[int]] = []
    for i, (m, prev) in enumerate(zip(mask, [False, *mask])):
        if m:
            (out.append([]) if not prev else None, out[-1].append(ids[i]))
    return out


def nll_sum(model: Transformer, ids: list[int], mask: list[bool]) -> torch.Tensor:
    """Summed token NLL over ``mask`` of one row alone, from the full (L, V) logits: the plain reference."""
    logits = model(torch.tensor([ids[:-1]]))[0].float()  # (L, V)
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # (L,)
    return -lp[torch.tensor(mask[1:])].sum()


def reference_nll(model: Transformer, ids: list[int], mask: list[bool]) -> torch.Tensor:
    """Mean token NLL over ``mask`` of one row."""
    return nll_sum(model, ids, mask) / sum(mask[1:])


def test_the_loss_counts_exactly_the_assistant_tokens(bpe):
    tok, model_dir = bpe
    ex = render_row(CHAT, "t.jsonl:1", Renderers(tok), "all")
    whole = tok.chat_template.render(CHAT["messages"], add_generation_prompt=False)
    assert ex.ids == tok.encode(whole[: whole.rindex("<|im_end|>") + len("<|im_end|>")])  # token-in/token-out
    spans = [tok.decode(r, skip_special_tokens=False) for r in runs_of(ex.mask, ex.ids)]
    assert spans == ["The answer is 42.<|im_end|>", "dcba<|im_end|>"]  # Qwen's "\n" junction is context
    last = render_row(CHAT, "t.jsonl:1", Renderers(tok), "last")
    assert last.ids == ex.ids and [tok.decode(r, skip_special_tokens=False) for r in runs_of(last.mask, last.ids)] == [
        "dcba<|im_end|>"
    ]
    model = load_pretrained(model_dir)
    cfg = SFTConfig(micro_batch_size=1)
    inputs, targets, mask = tensors([ex], "cpu")
    with torch.no_grad():
        got = learner.nll_backward(model, cfg, inputs, targets, mask, backward=False)
        want = reference_nll(model, ex.ids, ex.mask)
        assert got["num_tokens"] == sum(ex.mask) and abs(got["loss"] - float(want)) <= LOSS_TOL
        # negative control: one user token counted too (the first token after the system turn) changes the loss
        wrong = list(ex.mask)
        wrong[ex.mask.index(True) - 3] = True
        bad = learner.nll_backward(model, cfg, *tensors([type(ex)(ex.ids, wrong, "", 0)], "cpu"), backward=False)
        assert abs(bad["loss"] - float(want)) > 100 * LOSS_TOL


def test_micro_batches_give_the_whole_batch_gradient(char_model):
    model = load_pretrained(char_model)
    rows = [render_row(r, f"r:{i}", Renderers(TOK), "all") for i, r in enumerate(ROWS)]
    batch = tensors(rows, "cpu")

    def grads(**kw) -> tuple[float, dict]:
        model.zero_grad(set_to_none=True)
        stats = learner.nll_backward(model, SFTConfig(**kw), *batch)
        return stats["loss"], {k: p.grad.clone() for k, p in model.named_parameters()}

    loss, whole = grads(micro_batch_size=len(rows))
    for kw in ({"micro_batch_size": 1}, {"micro_batch_size": 4}, {"micro_batch_tokens": 14}):
        split_loss, split = grads(**kw)
        assert abs(split_loss - loss) <= LOSS_TOL, kw
        for k in whole:
            torch.testing.assert_close(split[k], whole[k], atol=1e-7, rtol=1e-5)
    # negative control: each micro-batch normalised by its own target count (the common bug) is another gradient
    local = {k: torch.zeros_like(v) for k, v in whole.items()}
    for s in range(0, len(rows), 4):
        model.zero_grad(set_to_none=True)
        learner.nll_backward(model, SFTConfig(), *tensors(rows[s : s + 4], "cpu"))
        for k, p in model.named_parameters():
            local[k] += p.grad
    assert max(float((local[k] - whole[k]).abs().max()) for k in whole) > 1e-4


def grads_of(model: Transformer) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def packing_rows(tok: HFTokenizer) -> list:
    """Rows that exercise the packed layout: a two-turn chat (context between its targets), the same chat with only
    its last turn a target, two rows with the same prompt (one shared copy), a chat prompt, ragged lengths."""
    rs = Renderers(tok)
    raw = [(CHAT, "all"), (CHAT, "last"), ({"prompt": "2+3=", "completion": "5"}, "all"),
           ({"prompt": "2+3=", "completion": "five, said the model"}, "all"),
           ({"prompt": CHAT["messages"][:2], "completion": "42"}, "all"), (ROWS[3], "all")]  # fmt: skip
    return [render_row(r, f"p:{i}", rs, on) for i, (r, on) in enumerate(raw)]


def test_packed_rows_give_the_plain_loop_loss_and_gradient(bpe, monkeypatch):
    """The plain loop (each row alone, full logits, the summed NLL over the whole batch's target count) vs
    ``nll_backward`` packed (one row; a token budget: several) and padded. Controls: a packed row whose rows see
    each other (one causal span, positions running on), and each packed row normalised by its own target count."""
    tok, model_dir = bpe
    model, rows = load_pretrained(model_dir), packing_rows(tok)
    model.zero_grad(set_to_none=True)
    want = sum(nll_sum(model, e.ids, e.mask) for e in rows) / sum(sum(e.mask[1:]) for e in rows)
    want.backward()
    want, ref = float(want.detach()), grads_of(model)
    batch = tensors(rows, "cpu")
    longest = max(len(e.ids) - 1 for e in rows)

    def nll(**kw) -> tuple[float, dict]:
        model.zero_grad(set_to_none=True)
        return learner.nll_backward(model, SFTConfig(**kw), *batch)["loss"], grads_of(model)

    budget = {"micro_batch_tokens": longest + 8}
    mbs = learner.plan_micro_batches(batch[0], batch[2], SFTConfig(**budget))
    assert len(mbs) > 1 and all(isinstance(r, packing.PackedRow) and r.tokens <= longest + 8 for r in mbs)
    one = learner.plan_micro_batches(batch[0], batch[2], SFTConfig())
    # one row; one copy of a shared context: the chat and the chat prompt (its first turns), the two "2+3=" rows
    assert len(one) == 1 and [m for _, m in one[0].groups] == [[0, 4], [1], [2, 3], [5]]
    pairs = learner.plan_micro_batches(batch[0], batch[2], SFTConfig(micro_batch_size=2))  # rows 0-1, 2-3, 4-5
    calls, _ = packing.build(*batch, pairs[0]).layout.sdpa_calls(torch.device("cpu"))
    assert len(calls) == 1 and calls[0][0] is None  # two one-sequence rows of similar length: one causal call
    for kw in ({}, budget, {"micro_batch_size": 2}, {"pack_sequences": False}, {"pack_sequences": False, **budget}):
        loss, got = nll(**kw)
        assert abs(loss - want) <= LOSS_TOL and max_diff(got, ref) <= LOSS_TOL, kw
    # control 1: each packed row as its own batch (its own target count) is another gradient
    model.zero_grad(set_to_none=True)
    for r in mbs:
        learner.nll_backward(model, SFTConfig(**budget), *tensors([rows[i] for i in r.rows], "cpu"))
    assert max_diff(grads_of(model), ref) > 100 * LOSS_TOL
    # control 2: the rows of a packed row laid end to end as one causal sequence (no segment isolation)
    real = packing.build

    def unisolated(*a, **k) -> packing.Packed:
        pk = real(*a, **k)
        n = pk.layout.length
        pk.layout, pk.positions = PackedLayout([Segment(0, n)], n, pk.layout.backend), torch.arange(n)[None]
        return pk

    monkeypatch.setattr(packing, "build", unisolated)
    loss, got = nll()
    assert abs(loss - want) > 100 * LOSS_TOL and max_diff(got, ref) > 100 * LOSS_TOL


def test_two_torchrun_ranks_give_the_single_process_result(tmp_path, char_model):
    """One launch of 2 ranks (tests/dist_driver.py) runs the SFT twice: as it is, and with each rank normalising by
    its own target count (the negative control); one process here. 9 rows in batches of 4: the last step gives
    rank 0 one row and rank 1 none (its padding forward/backward)."""
    base = {"steps": 0, "batch_size": 4, "lr": 1e-2, "warmup_steps": 0, "micro_batch_size": 1, "device": "cpu",
            "threads": 1, "checkpoint_every": 0, "eval": {"eval_interval": 3}}  # fmt: skip
    runs = {name: {**base, "out": str(tmp_path / name), "save_hf": str(tmp_path / f"{name}.hf")}
            for name in ("one", "two", "bad")}  # fmt: skip
    train(SFTConfig(**runs["one"]), model=char_model, tokenizer=TOK, rows=ROWS, eval_rows=ROWS[:3])
    spec = {"model": char_model, "rows": ROWS, "eval_rows": ROWS[:3],
            "sft": [{"cfg": runs["two"]}, {"cfg": runs["bad"], "per_rank_normaliser": True}]}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "dist_driver.py"), json.dumps(spec)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3, 3]  # eval at 0 and 3
    for a, b in zip(one, two):
        assert a.get("num_tokens") == b.get("num_tokens") and a.get("eval/tokens") == b.get("eval/tokens")
        for k in ("loss", "grad_norm", "eval/loss"):
            assert abs(a.get(k, 0) - b.get(k, 0)) <= LOSS_TOL, (a["step"], k, a.get(k), b.get(k))
    params = {n: dict(load_pretrained(tmp_path / f"{n}.hf").named_parameters()) for n in runs}
    start = dict(load_pretrained(char_model).named_parameters())

    def diff(a: dict, b: dict) -> float:
        return max(float((a[k] - b[k]).detach().abs().max()) for k in a)

    assert diff(params["one"], start) > 100 * PARAM_TOL  # it trained
    assert diff(params["one"], params["two"]) <= PARAM_TOL
    assert diff(params["one"], params["bad"]) > PARAM_TOL  # negative control: per-rank normalisers are caught


def test_lora_sft_trains_only_the_adapters_and_exports_them(tmp_path, char_model, monkeypatch):
    """``--lora-rank``: after the steps every base weight is bit-identical and only the adapters moved, the eval loss
    on the (tiny, overfit) training rows goes down, the checkpoint holds the adapter only, and ``--save-hf``'s adapter
    dir loads onto the base (``align.lora.load_adapter``) as the trained policy. Control: the full fine-tune, same
    run otherwise, moves the base weights."""
    import align.sft.run as sft_run

    model = char_model_dir(tmp_path, char_model)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    real, runs = sft_run.open_sft, []
    monkeypatch.setattr(sft_run, "open_sft", lambda *a, **k: runs.append(real(*a, **k)) or runs[-1])  # keep the run

    def sft(name: str, *extra: str) -> dict[str, torch.Tensor]:
        args = ["--model", model, "--train-data", str(data), "--eval-data", str(data), "--out", str(tmp_path / name),
                "--steps", "6", "--batch-size", "9", "--lr", "1e-2", "--warmup-steps", "0", "--eval-interval", "6",
                "--checkpoint-every", "6", "--threads", "1", *extra]  # fmt: skip
        assert main(args) == 0
        return {k: p.detach().clone() for k, p in runs[-1].policy.named_parameters()}

    base = load_pretrained(model).state_dict()
    trained = sft("lora", "--lora-rank", "4", "--lora-alpha", "8", "--save-hf", str(tmp_path / "adapter"))
    assert all(torch.equal(trained[k], base[k]) for k in base)  # the base, bit for bit
    adapters = sorted(k for k in trained if k not in base)
    assert len(adapters) == 2 * 7 and all(".lora_" in k for k in adapters)  # A and B of the one layer's 7 linears
    assert {k for k, p in runs[-1].policy.named_parameters() if p.requires_grad} == set(adapters)
    assert all(float(trained[k].abs().max()) > 0 for k in adapters if "lora_B" in k)  # B left its zero init
    evals = [r["eval/loss"] for r in records(tmp_path / "lora") if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < 0.7 * evals[0]  # it learned the rows
    step = tmp_path / "lora" / "checkpoints" / "step_6"
    assert (step / "adapter" / "adapter_model.safetensors").is_file() and not (step / "model").exists()
    assert lora.adapter_base(tmp_path / "adapter") == model
    loaded = lora.load_adapter(load_pretrained(model), tmp_path / "adapter")
    ids = torch.tensor([TOK.encode("abc=cba")])
    with torch.no_grad():
        want, got = runs[-1].policy(ids), loaded(ids)
        assert float((got - want).abs().max()) <= LOSS_TOL < float((load_pretrained(model)(ids) - want).abs().max())
    full = sft("full")  # control: without --lora-rank the base weights move
    assert max(float((full[k] - base[k]).abs().max()) for k in base) > 1e-3


def sft_args(out: Path, model: str, rows: Path, *extra: str) -> list[str]:
    """A CLI run: 9 rows x 12 epochs in batches of 3 (36 steps), a checkpoint every 4, eval (loss, pass@k of the
    exact-match reward beside ``rows``) every 12."""
    return ["--model", model, "--train-data", str(rows), "--eval-data", str(rows), "--out", str(out), "--epochs",
            "12", "--batch-size", "3", "--lr", "1e-2", "--warmup-steps", "0", "--checkpoint-every", "4",
            "--eval-interval", "12", "--eval-n", "2", "--max-tokens", "5", "--threads", "1", "--reward",
            f"{rows.parent / 'rewards.py'}:exact", *extra]  # fmt: skip


def test_kill_9_then_rerun_resumes_exactly(tmp_path, char_model):
    model = char_model_dir(tmp_path, char_model)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "rewards.py").write_text(
        "def exact(prompt, completion, answer, **_):\n    return float(completion == answer)\n"
    )
    whole = tmp_path / "whole"
    assert main(sft_args(whole, model, rows)) == 0
    out = tmp_path / "killed"
    proc = run_cli(sft_args(out, model, rows), module="align.sft")
    wait_for(lambda: (out / "checkpoints" / "step_4").is_dir(), proc)
    proc.kill()
    assert proc.wait() == -9  # killed mid-run, not finished
    assert main(sft_args(out, model, rows)) == 0  # the rerun resumes the last committed checkpoint
    assert comparable(out) == comparable(whole)
    assert [r["step"] for r in records(whole) if "eval/pass@1" in r] == [0, 12, 24, 36]
    # negative control: another seed (data order, eval samples) logs otherwise
    other = tmp_path / "seed1"
    assert main(sft_args(other, model, rows, "--seed", "1", "--steps", "2")) == 0
    assert comparable(other)[1] != comparable(whole)[1]


def test_a_batch_larger_than_the_data_is_bounded_by_it_and_sigterm_stops_the_run(tmp_path, char_model):
    """Issue 42: --batch-size 1000000000 never finished a step (the data cursor drew a billion rows, memory growing)
    and SIGTERM, waiting for the step's end, was ignored. A step now takes at most every row once."""
    import signal

    from align.train import SIGNAL_EXIT

    model = char_model_dir(tmp_path, char_model)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "run"
    args = ["--model", model, "--train-data", str(rows), "--out", str(out), "--batch-size", "1000000000",
            "--steps", "100000", "--threads", "1", "--eval-interval", "0", "--checkpoint-every", "0"]  # fmt: skip
    proc = run_cli(args, module="align.sft")
    wait_for(lambda: (out / "metrics.jsonl").is_file() and len(records(out)) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert rc == SIGNAL_EXIT[signal.SIGTERM], proc.stdout.read()[-3000:]
    steps = [r for r in records(out) if "rows" in r]
    assert 2 <= len(steps) < 100000 and all(r["rows"] == len(ROWS) for r in steps)  # bounded by the data
    assert [n for n, _ in committed(out / "checkpoints")] == [steps[-1]["step"]]  # the signal's checkpoint
    # control: a batch within the data is taken as it is
    assert main(["--model", model, "--train-data", str(rows), "--out", str(tmp_path / "small"), "--batch-size", "4",
                 "--steps", "2", "--threads", "1", "--eval-interval", "0"]) == 0  # fmt: skip
    assert [r["rows"] for r in records(tmp_path / "small") if "rows" in r] == [4, 4]


def _load_extra(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "extras" / "vllm_rollout" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def lean_files(tmp_path: Path, tok: HFTokenizer) -> tuple[Path, Path, list[dict]]:
    """A GEN file of lean_records.make_record records (problem p: 4 samples, two with one proof; problem q: 1, not
    accepted) whose completion ids are a non-canonical tokenization, and its VERIF file."""
    lr = _load_extra("lean_records")
    stmt = "theorem t (a : Nat) : a = a := by sorry"
    problems = {pid: {"problem_id": pid, "lean4_code": stmt} for pid in ("p", "q")}
    proofs = ["rfl", "rfl", "simp", "omega", "rfl"]
    items = lr.plan_round0({"p": problems["p"]}, 4, 0) + lr.plan_round0({"q": problems["q"]}, 1, 0)
    gens = []
    for item, proof in zip(items, proofs):
        text = f"Plan.\n```lean4\n{stmt.replace('sorry', proof)}\n```"
        ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)] + [tok.eos_token_id[0]]
        gens.append(lr.make_record(item, prompt_ids=tok.encode(tok.render_chat(item["messages"])),
                                   completion_ids=ids, completion_text=text, finish_reason="stop",
                                   budget=lr.token_budget(64, 512, 3), cap_tokens=64, sampling={}, model_rev="m",
                                   adapter=None, trajectory_cap=None, session=0))  # fmt: skip
    accepted = [True, True, False, True, False]
    verifs = [{"sample_id": g["sample_id"], "problem_id": g["problem_id"], "round": 0, "accepted": a,
               "reasons": [] if a else ["lean_errors"]} for g, a in zip(gens, accepted)]  # fmt: skip
    gen, verif = tmp_path / "gen_r0.jsonl", tmp_path / "verif_r0.jsonl"
    gen.write_text("".join(json.dumps(g) + "\n" for g in gens))
    verif.write_text("".join(json.dumps(v) + "\n" for v in verifs))
    return gen, verif, gens


def test_from_verified_keeps_the_sampled_ids(tmp_path, bpe):
    tok, model_dir = bpe
    gen, verif, gens = lean_files(tmp_path, tok)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    kept = verified_examples([str(gen), str(verif)], 2, config)
    # p_g0 and p_g3 (p_g1 repeats p_g0's proof; p_g2 and q_g0 were not accepted); at most 2 for p
    assert [e.where for e in kept] == [f"{gen}:1", f"{gen}:4"]
    for e, g in zip(kept, (gens[0], gens[3])):
        assert e.ids == g["prompt_ids"] + g["completion_ids"] and e.prompt == len(g["prompt_ids"])
        assert e.mask == [False] * len(g["prompt_ids"]) + [True] * len(g["completion_ids"])
        # the control: re-tokenizing the recorded text would have given other ids
        assert tok.encode(g["completion_text"], add_special_tokens=False) != g["completion_ids"][:-1]
    assert len(verified_examples([str(gen), str(verif)], 1, config)) == 1
    assert len(verified_examples([str(gen), str(verif)], 0, config)) == 2  # only two distinct accepted proofs of p
    s = train(SFTConfig(out=str(tmp_path / "run"), steps=2, batch_size=2, micro_batch_size=1, threads=1,
                        data={"from_verified": [str(gen), str(verif)]}), model=model_dir)  # fmt: skip
    assert s["steps"] == 2 and records(tmp_path / "run")[0]["num_tokens"] == sum(len(g["completion_ids"]) for g in
                                                                                  (gens[0], gens[3]))  # fmt: skip


def test_bad_input_is_named_before_the_model_loads(tmp_path, bpe, monkeypatch, capsys):
    tok, model_dir = bpe

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr("align.model.load_pretrained", no_load)
    data = tmp_path / "rows.jsonl"
    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    ends_with_user = {"messages": [*CHAT["messages"], {"role": "user", "content": "Thanks."}]}
    gen, verif, _ = lean_files(tmp_path, tok)
    other = tmp_path / "other_gen.jsonl"
    other.write_text(gen.read_text().replace('"sample_id": "p_g3"', '"sample_id": "p_g9"'))
    cases = [
        ([CHAT, user_only], [], f"{data}:2: the row has no assistant turn"),
        ([CHAT, {"prompt": "2+2=", "completion": ""}], [], f"{data}:2: 'completion' must be a non-empty string"),
        ([CHAT, ends_with_user], ["--train-on", "last"], f"{data}:2: --train-on last trains on the last turn"),
        (None, ["--from-verified", str(other), str(verif)], f"{verif}:4: sample_id 'p_g3' is not in {other}"),
        (None, ["--from-verified", str(gen)], "--from-verified takes GEN.jsonl VERIF.jsonl pairs"),
    ]
    for rows, flags, message in cases:
        if rows is not None:
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            flags = ["--train-data", str(data), *flags]
        argv = ["--model", model_dir, "--out", str(tmp_path / "run"), *flags]
        if "pairs" in message:  # a config value: argparse's usage error
            with pytest.raises(SystemExit) as e:
                main(argv)
            assert e.value.code == 2
        else:
            assert main(argv) == 2
        assert message in capsys.readouterr().err, message
    # the control: the good rows pass the checks and reach the model load
    data.write_text(json.dumps(CHAT) + "\n")
    with pytest.raises(AssertionError, match="the model was loaded"):
        train(SFTConfig(out=str(tmp_path / "run"), data={"train_data": str(data)}), model=model_dir)
