"""``--model org/name``: resolved from a Hugging Face cache laid out here (tmp HF_HOME), offline, stdlib only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from align.errors import InputError
from align.hub import resolve_model, resolve_tokenizer
from align.train import main

ROOT = Path(__file__).resolve().parents[1]


def lay_out_cache(hf_home: Path, repo_id: str, model_dir: str, commit: str = "0" * 40) -> Path:
    """The layout ``huggingface-cli download`` writes: blobs, a snapshot of links into them, refs/main."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(Path(model_dir).iterdir())):
        if f.is_file():
            blob = repo / "blobs" / f"blob{i}"
            shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_hub_id_resolves_from_the_cache_without_huggingface_hub(tmp_path, monkeypatch, builtin_model):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    snap = lay_out_cache(tmp_path / "hf", "Org/Tiny-Reverse", builtin_model)
    assert resolve_model("Org/Tiny-Reverse") == str(snap)
    assert resolve_model(f"Org/Tiny-Reverse@{'0' * 40}") == str(snap)
    code = "import sys; from align.hub import resolve_model as r; print(r('Org/Tiny-Reverse'), 'huggingface_hub' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == [str(snap), "False"]  # the cache read by hand: huggingface_hub never imported
    # negative controls: another revision, another id, a local dir of that name wins over the cache
    with pytest.raises(InputError, match="huggingface-cli download Org/Tiny-Reverse --revision v2"):
        resolve_model("Org/Tiny-Reverse@v2")
    with pytest.raises(InputError, match="download it once with: huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct"):
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Org" / "Tiny-Reverse").mkdir(parents=True)
    assert resolve_model("Org/Tiny-Reverse") == "Org/Tiny-Reverse"
    assert resolve_model(None) is None and resolve_model("./missing") == "./missing"


def test_cli_trains_a_cached_hub_id_and_names_the_download_before_loading(tmp_path, monkeypatch, builtin_model, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snap = lay_out_cache(tmp_path / "hf", "Org/Tiny-Reverse", builtin_model)
    argv = ["--prompts-per-step", "2", "--group-size", "2", "--steps", "1", "--eval-interval", "0", "--threads", "1"]
    assert main(["--model", "Org/Tiny-Reverse", "--out", str(tmp_path / "run"), *argv]) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"] == str(snap)
    import align.model

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the hub id was checked")

    monkeypatch.setattr(align.model, "load_pretrained", no_load)
    assert main(["--model", "Org/Not-Cached", "--out", str(tmp_path / "run2"), *argv]) == 2
    err = capsys.readouterr().err
    assert "--model Org/Not-Cached" in err and "huggingface-cli download Org/Not-Cached" in err
    assert "hf download Org/Not-Cached" in err


def test_a_ref_naming_a_path_does_not_leave_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs" / "main").write_text("../../../outside\n")  # was resolved: a snapshot outside the cache
    with pytest.raises(InputError, match="no complete snapshot"):
        resolve_model("org/name")
    with pytest.raises(InputError, match="no complete snapshot"):
        resolve_model("org/name@..")
    (repo / "refs" / "main").write_text("abc123\n")
    assert resolve_model("org/name") == str(repo / "snapshots" / "abc123")  # control: a commit-hash ref resolves


def test_teacher_tokenizer_and_sft_model_take_hub_ids(tmp_path, monkeypatch, builtin_model, char_model, capsys):
    """--teacher and --tokenizer (align.train) and align.sft's --model / --tokenizer resolve from the cache like
    --model; an id that is not cached names the download command before any model loads."""
    from align import sft

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snap = lay_out_cache(tmp_path / "hf", "Org/Tiny-Reverse", builtin_model)
    argv = ["--prompts-per-step", "2", "--group-size", "2", "--steps", "1", "--eval-interval", "0", "--threads", "1"]
    run = tmp_path / "distill"
    assert main(["--model", builtin_model, "--teacher", "Org/Tiny-Reverse", "--out", str(run), *argv]) == 0
    assert json.loads((run / "config.json").read_text())["distill"]["teacher"] == str(snap)
    assert "distill/reverse_kl_mean" in (run / "metrics.jsonl").read_text()  # the cached teacher scored the step
    # a tokenizer-only repo (no config.json) is a --tokenizer, not a --model (the negative control)
    tok_snap = lay_out_cache(
        tmp_path / "hf", "Org/Tok-Only", _only(tmp_path / "tok", builtin_model, "align_tokenizer.json")
    )
    assert resolve_tokenizer("Org/Tok-Only") == str(tok_snap)
    with pytest.raises(InputError, match="--model Org/Tok-Only: .*huggingface-cli download Org/Tok-Only"):
        resolve_model("Org/Tok-Only")
    # align.sft: --model and --tokenizer as hub ids, one step trained
    char = lay_out_cache(tmp_path / "hf", "Org/Char", _with_tokenizer(tmp_path / "char", char_model))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "abc", "completion": "cba"}) + "\n")
    sft_argv = [
        "--train-data",
        str(rows),
        "--steps",
        "1",
        "--eval-interval",
        "0",
        "--threads",
        "1",
        "--max-tokens",
        "4",
    ]
    out = tmp_path / "sft"
    assert sft.main(["--model", "Org/Char", "--tokenizer", "Org/Char", "--out", str(out), *sft_argv]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model"], saved["data"]["tokenizer"]) == (str(char), str(char))
    import align.model

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the hub id was checked")

    monkeypatch.setattr(align.model, "load_pretrained", no_load)
    capsys.readouterr()
    for module, flags, name in (
        (main, ["--model", builtin_model, "--teacher", "Org/Teacher-Not-Cached"], "--teacher Org/Teacher-Not-Cached"),
        (main, ["--model", builtin_model, "--train-data", str(rows), "--tokenizer", "Org/Tok"], "--tokenizer Org/Tok"),
        (sft.main, ["--model", "Org/Sft-Not-Cached", *sft_argv], "--model Org/Sft-Not-Cached"),
        (sft.main, ["--model", "Org/Char", "--tokenizer", "Org/Tok", *sft_argv], "--tokenizer Org/Tok"),
    ):
        assert module([*flags, "--out", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert f"{name}: not a local directory" in err and f"huggingface-cli download {name.split()[1]}" in err, err


def _only(d: Path, src: str, name: str) -> str:
    d.mkdir()
    shutil.copyfile(Path(src) / name, d / name)
    return str(d)


def _with_tokenizer(d: Path, model: str) -> str:
    from helpers_train import TOK

    shutil.copytree(model, d)
    TOK.save(d)
    return str(d)
