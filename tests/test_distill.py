"""On-policy distillation (``--teacher``, align/run/teacher.py): the per-token reverse-KL signal against a loop
reference (gradient included, with rho correction), teacher == student giving no signal and no gradient, the vLLM
worker a ``--teacher-worker`` run spawns against native teacher logprobs, an older worker refused, a mismatched
tokenizer and bad flags refused before the model loads."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers_models import require_rollout_venv
from helpers_train import POLL_S, PROMPTS, TOK, a_reward, build_char_model, cfg_for, records

from align.advantages import add_teacher_signal
from align.char_tokenizer import CharTokenizer
from align.data import InputError
from align.grpo import LossConfig, policy_loss

SIGNAL_TOL = 1e-6  # fp32 tensor code vs a float64 loop
SCORE_TOL = 1e-4  # vLLM CPU fp32 vs align's fused head, per token (the bound)
ZERO_GRAD_TOL = 1e-4  # teacher == student: the sampler's vs the trainer's fp32 logprobs differ by rounding only


def _model_with_tokenizer(path, layers=1, tok=TOK) -> str:
    d = build_char_model(path, layers=layers)
    tok.save(d)
    return d


def _loop_loss(lp, old, behav, teacher, adv, mask, coef, cfg):
    """token_mean PPO-clip with token_tis, written per token from the formulas (float64 scalars, autograd on lp)."""
    total = int(mask.sum())
    loss = torch.zeros((), dtype=torch.float64)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            a = float(adv[i]) - coef * (float(behav[i, t]) - float(teacher[i, t]))  # A_i - c (log mu - log pi_T)
            r = torch.exp(lp[i, t].double() - float(old[i, t]))
            clipped = torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high)
            w = min(math.exp(float(old[i, t]) - float(behav[i, t])), cfg.rho_cap)  # pi_old / mu, capped
            loss = loss + w * torch.maximum(-a * r, -a * clipped)
    return loss / total


@pytest.mark.parametrize("wrong", [None, "sign", "coef"])
def test_signal_and_gradient_equal_a_loop_reference(wrong):
    """adv_t = A_i - coef (log mu - log pi_T) through PPO-clip and token_tis equals the loop; the negative controls
    (the opposite sign, the coefficient left out) do not."""
    g = torch.Generator().manual_seed(0)
    N, L, coef = 3, 5, 0.7
    mask = torch.rand(N, L, generator=g) > 0.3
    behav = -torch.rand(N, L, generator=g) * 3
    teacher = -torch.rand(N, L, generator=g) * 3
    old = behav + 0.3 * torch.randn(N, L, generator=g)  # rho = pi_old / mu != 1: the correction acts
    adv = torch.randn(N, generator=g)
    lp = (old + 0.4 * torch.randn(N, L, generator=g)).requires_grad_(True)  # some ratios outside the clip range
    cfg = LossConfig(use_rho_correction=True, rho_cap=1.5)
    per_token, stats = add_teacher_signal(adv, mask, behav, teacher, coef)
    loss, _ = policy_loss(cfg, lp, old, per_token, mask, behav_logprobs=behav, total_tokens=int(mask.sum()),
                          total_seqs=int(mask.any(1).sum()))  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    ref_coef = {None: coef, "sign": -coef, "coef": 1.0}[wrong]
    lp_ref = lp.detach().clone().requires_grad_(True)
    ref = _loop_loss(lp_ref, old, behav, teacher, adv, mask, ref_coef, cfg)
    (ref_grad,) = torch.autograd.grad(ref, lp_ref)
    close = (
        abs(float(loss.detach()) - float(ref.detach())) < SIGNAL_TOL
        and float((grad - ref_grad).abs().max()) < SIGNAL_TOL
    )
    assert close == (wrong is None), (float(loss), float(ref))
    n = int(mask.sum())
    assert stats["distill/reverse_kl_mean"] == pytest.approx(float((behav - teacher)[mask].sum()) / n, abs=1e-6)
    assert stats["distill/teacher_logprob_mean"] == pytest.approx(float(teacher[mask].mean()), abs=1e-6)
    assert stats["distill/student_logprob_mean"] == pytest.approx(float(behav[mask].mean()), abs=1e-6)


@pytest.mark.parametrize("same", [True, False])
def test_teacher_equal_to_student_gives_no_signal_and_no_gradient(tmp_path, same):
    """--distill-only with the student as its own teacher: reverse KL ~0 and gradient ~0 at step 1 (the sampler's
    and the trainer's logprobs agree to rounding); a different teacher (negative control) gives both."""
    student = _model_with_tokenizer(tmp_path / "s")
    teacher = student if same else _model_with_tokenizer(tmp_path / "t", layers=2)
    from align.train import train

    cfg = cfg_for(tmp_path / "run", steps=1)
    cfg.distill.teacher, cfg.distill.distill_only = teacher, True
    train(cfg, model=student, tokenizer=TOK, prompts=PROMPTS, reward=None)  # no reward at all: --distill-only
    (rec,) = records(tmp_path / "run")
    assert rec["reward_mean"] == 0.0 and rec["adv_abs_max"] == 0.0  # no reward was computed: zero group advantages
    kl, grad = abs(rec["distill/reverse_kl_mean"]), rec["grad_norm"]
    assert (kl < ZERO_GRAD_TOL and grad < ZERO_GRAD_TOL) == same, (kl, grad)
    assert rec["distill/teacher_logprob_mean"] < 0 and rec["distill/student_logprob_mean"] < 0


def test_mismatched_tokenizer_is_refused(tmp_path):
    """A teacher whose tokenizer maps the same characters to other ids (same vocabulary size) is refused naming
    both dirs; the student's own tokenizer (negative control) passes the same check."""
    from align.run.teacher import check_tokenizers

    student = _model_with_tokenizer(tmp_path / "s")
    other = CharTokenizer("bacd=")  # same size, 'a' and 'b' swapped
    teacher = _model_with_tokenizer(tmp_path / "t", tok=other)
    texts = ["ab=", "cd="]
    check_tokenizers(student, student, TOK, TOK, texts)
    with pytest.raises(InputError, match=r"--teacher .*/t does not tokenize as the student .*/s: 'ab=' encodes"):
        check_tokenizers(student, teacher, TOK, other, texts)
    bigger = _model_with_tokenizer(tmp_path / "b", tok=CharTokenizer("abcde="))
    with pytest.raises(InputError, match="vocabulary sizes differ"):
        check_tokenizers(student, bigger, TOK, CharTokenizer("abcde="), texts)


def test_bad_teacher_flags_fail_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """--distill-only without --teacher is a flag error; a --teacher that is not an HF checkpoint and a teacher with
    another tokenizer are InputErrors (exit 2) raised before any model loads."""
    from align import model as model_lib
    from align.train import main

    student = _model_with_tokenizer(tmp_path / "s")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    base = ["--model", student, "--train-data", str(tmp_path / "rows.jsonl"), "--tokenizer", student, "--steps", "1",
            "--eval-interval", "0", "--max-tokens", "4"]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main([*base, "--out", str(tmp_path / "r0"), "--distill-only"])
    assert e.value.code == 2 and "--distill-only needs --teacher DIR" in capsys.readouterr().err

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(model_lib, "load_pretrained", no_load)
    (tmp_path / "not_hf").mkdir()
    assert main([*base, "--out", str(tmp_path / "r1"), "--distill-only", "--teacher", str(tmp_path / "not_hf")]) == 2
    assert "--teacher" in (err := capsys.readouterr().err) and "no config.json: not an HF checkpoint" in err
    other = _model_with_tokenizer(tmp_path / "t", tok=CharTokenizer("bacd="))
    assert main([*base, "--out", str(tmp_path / "r2"), "--distill-only", "--teacher", other]) == 2
    assert "does not tokenize as the student" in capsys.readouterr().err


def _with_header(src: Path, dst: Path, extra: dict, total: int | None = None) -> None:
    """``dst``: safetensors file ``src`` with ``extra`` tensors added to its header and cut or extended (sparse, no
    disk used) to ``total`` bytes (None: the data as it is)."""
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = {**json.loads(raw[8 : 8 + n]), **extra}
    text = json.dumps(header).encode()
    with open(dst, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + raw[8 + n :])
        if total is not None:
            f.truncate(total(8 + len(text)) if callable(total) else total)


def test_a_truncated_or_too_large_teacher_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """Issue 42: a truncated teacher safetensors file was a raw traceback after the student loaded, naming neither the
    file nor --teacher; a teacher larger than memory a bare MemoryError after the student loaded. Both are named from
    the files' headers before anything loads."""
    from align import model as model_lib
    from align.train import main

    student = _model_with_tokenizer(tmp_path / "s")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    base = ["--model", student, "--train-data", str(tmp_path / "rows.jsonl"), "--tokenizer", student, "--steps", "1",
            "--eval-interval", "0", "--device", "cpu", "--distill-only", "--max-tokens", "4"]  # fmt: skip

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the bad teacher was refused")

    monkeypatch.setattr(model_lib, "load_pretrained", no_load)
    weights = Path(student) / "model.safetensors"
    cut = Path(shutil.copytree(student, tmp_path / "cut"))
    (cut / "model.safetensors").write_bytes(weights.read_bytes()[:-100])  # the header intact, the last tensor short
    assert main([*base, "--out", str(tmp_path / "r1"), "--teacher", str(cut)]) == 2
    err = capsys.readouterr().err
    assert f"--teacher {cut}: {cut / 'model.safetensors'} is truncated" in err, err
    huge = Path(shutil.copytree(student, tmp_path / "huge"))  # + a 2**38-element fp32 tensor: 1 TiB, sparse on disk
    end = weights.stat().st_size - 8 - int.from_bytes(weights.read_bytes()[:8], "little")
    extra = {"model.extra.weight": {"dtype": "F32", "shape": [2**38], "data_offsets": [end, end + 2**40]}}
    _with_header(weights, huge / "model.safetensors", extra, total=lambda data_start: data_start + end + 2**40)
    assert main([*base, "--out", str(tmp_path / "r2"), "--teacher", str(huge)]) == 2
    err = capsys.readouterr().err
    assert f"--teacher {huge}: its weights (274,878," in err and "1024.0 GiB as float32" in err, err
    # control: a whole teacher of a size that fits passes every check and reaches the model load
    with pytest.raises(AssertionError, match="a model was loaded"):
        main([*base, "--out", str(tmp_path / "r3"), "--teacher", str(Path(shutil.copytree(student, tmp_path / "ok")))])


def test_an_older_worker_is_refused_with_a_clear_message(tmp_path):
    """A worker from before minor versions (its heartbeat has no "minor") is refused before any request is sent;
    the heartbeat of this checkout's worker (negative control) announces a minor that serves score."""
    from align.rollout.client import SpoolClient
    from align.rollout.protocol import PROTOCOL
    from align.rollout.spool import Spool
    from align.rollout.teacher_logprobs import SCORE_MINOR, WorkerTooOldError, score, worker_minor

    spool = Spool(tmp_path / "spool").ensure()
    spool.write_heartbeat("ready")
    assert worker_minor(spool.read_heartbeat()) >= SCORE_MINOR
    old = {"protocol": PROTOCOL, "version": 1, "kind": "heartbeat", "state": "ready", "pid": 1, "host": "h",
           "time": 1e9}  # fmt: skip
    spool.heartbeat_path.write_text(json.dumps(old))
    client = SpoolClient(spool.root, timeout_s=5)
    with pytest.raises(WorkerTooOldError, match=r"speaks align-spool 1\.0; the score request .* needs 1\.1"):
        score(client, [[1, 3, 4]], [1])
    assert not list(spool.requests.iterdir())  # nothing was sent


@pytest.mark.rollout
@pytest.mark.e2e
def test_teacher_worker_run_trains_on_the_teachers_exact_logprobs(tmp_path, monkeypatch):
    """``train()`` with ``--teacher DIR --teacher-worker`` (2 steps) spawns the vLLM CPU worker (fp32) through the
    run's own code path, and the logprobs its ``score`` answers give the run equal, per token, the in-process
    teacher's of the same batches within 1e-4 (a torchrun rank's rows alike); another model's (negative control) do
    not. metrics.jsonl logs each step's distill figures of exactly those logprobs, and the worker is gone after the
    run. The student's context (64) is longer than the teacher's (32): the worker gets the teacher's."""
    require_rollout_venv()
    from align.model import load_pretrained
    from align.run import teacher as teacher_mod
    from align.train import train

    student = _model_with_tokenizer(tmp_path / "s")
    conf = json.loads((tmp_path / "s" / "config.json").read_text())
    (tmp_path / "s" / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 64}))
    teacher_dir = _model_with_tokenizer(tmp_path / "t", layers=2)
    seen = []  # (batch, the worker's logprobs, those of rows 0, 5, 7 alone, the worker handle) per step
    served = teacher_mod.WorkerTeacher.__call__

    def spy(self, batch, cfg, place, rows):  # the real call, recorded; the run gets its answer unchanged
        out = served(self, batch, cfg, place, rows)
        part = served(self, batch, cfg, place, torch.tensor([0, 5, 7]))
        seen.append((type(batch)(*(t if t is None else t.clone() for t in batch)), out.clone(), part, self.worker))
        return out

    monkeypatch.setattr(teacher_mod.WorkerTeacher, "__call__", spy)
    cfg = cfg_for(tmp_path / "run", steps=2, checkpoint_every=0, rollout_in_process=True)
    cfg.distill.teacher, cfg.distill.teacher_worker = teacher_dir, True
    train(cfg, model=student, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    assert len(seen) == 2 and (tmp_path / "run" / "teacher_worker.log").is_file()
    worker = seen[0][3]
    deadline = time.monotonic() + 30
    while worker.alive() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert not worker.alive(), "the teacher worker outlived its run"
    native_teacher, other = load_pretrained(teacher_dir), load_pretrained(student)
    for (batch, lp, part, _), rec in zip(seen, [r for r in records(tmp_path / "run") if "reward_mean" in r]):
        m, rows = batch.mask, torch.tensor([0, 5, 7])
        native = teacher_mod.InProcessTeacher(native_teacher)(batch, cfg, None, None)
        assert float((lp - native)[m].abs().max()) <= SCORE_TOL
        assert float((part[rows] - native[rows])[m[rows]].abs().max()) <= SCORE_TOL
        wrong = teacher_mod.InProcessTeacher(other)(batch, cfg, None, None)
        assert float((lp - wrong)[m].abs().max()) > 100 * SCORE_TOL
        t, s = float(lp[m].mean()), float(batch.behav[m].mean())
        assert rec["distill/teacher_logprob_mean"] == pytest.approx(t, abs=1e-6)
        assert rec["distill/student_logprob_mean"] == pytest.approx(s, abs=1e-6)
        assert rec["distill/reverse_kl_mean"] == pytest.approx(s - t, abs=1e-6)
        assert abs(rec["distill/teacher_logprob_mean"] - float(native[m].mean())) <= SCORE_TOL


def test_special_tokens_with_other_ids_are_refused(tmp_path):
    """Two BPE tokenizers that encode plain text alike but swap the ids of two special tokens: refused (the special
    tokens are among the checked strings); an unchanged copy (negative control) passes, chat template included."""
    from helpers_tokenizer import make_bpe_tokenizer

    from align.chat import load_tokenizer
    from align.run.teacher import SAMPLE_TEXTS, check_tokenizers

    s = make_bpe_tokenizer(tmp_path / "s")
    spec = json.loads((s / "tokenizer.json").read_text())
    for d in ("same", "swapped"):
        shutil.copytree(s, tmp_path / d)
    ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
    a, b = "<|begin_of_text|>", "<|start_header_id|>"  # neither a stop token nor in the qwen2.5 template
    for t in spec["added_tokens"]:
        t["id"] = {a: ids[b], b: ids[a]}.get(t["content"], t["id"])
    spec["model"]["vocab"][a], spec["model"]["vocab"][b] = ids[b], ids[a]
    (tmp_path / "swapped" / "tokenizer.json").write_text(json.dumps(spec))
    toks = {d: load_tokenizer(tmp_path / d) for d in ("s", "same", "swapped")}
    for d, tok in toks.items():
        (tmp_path / d / "config.json").write_text(json.dumps({"vocab_size": tok.vocab_size}))
    texts = list(SAMPLE_TEXTS)
    assert all(toks["s"].encode(x) == toks["swapped"].encode(x) for x in texts)  # plain text cannot tell them apart
    check_tokenizers(str(s), str(tmp_path / "same"), toks["s"], toks["same"], texts)
    with pytest.raises(InputError, match=r"swapped does not tokenize as the student .*'<\|begin_of_text\|>' encodes"):
        check_tokenizers(str(s), str(tmp_path / "swapped"), toks["s"], toks["swapped"], texts)
