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
from align.hub import resolve_model
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
