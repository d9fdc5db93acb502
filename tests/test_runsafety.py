"""Run safety (issue 19): resume never unpickles code, unreadable checkpoints are named with a way out,
--config types and values are checked before anything runs, a resumed run never ignores a changed setting,
and no path combination lets a run overwrite or delete data it did not create."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_train import PROMPTS, TOK, a_reward, cfg_for, records

from align.data import InputError
from align.rollout.engines import check_weights_version
from align.run import checkpoint as ckpt
from align.run.cli import from_dict, parse
from align.run.safety import EXPORT_MARKER, RUN_ID_FILE
from align.train import CLI_PREFIXES, TrainConfig, train


def run(cfg: TrainConfig, model: str) -> dict:
    return train(cfg, model=model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ trainer state


class MakesMarker:
    """A pickle payload: unpickling it calls open(marker, 'w'), i.e. runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_trainer_state_is_plain_data_and_rng_round_trips(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian in the numpy state
    state = ckpt.rng_state()
    want = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    torch.save({"rng": state}, tmp_path / "s.pt")
    ckpt.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == want
    # negative control: other draws after a different state
    np.random.seed(0)
    assert np.random.standard_normal(3).tolist() != want[1]


def test_pickle_payload_in_trainer_state_is_refused_and_never_runs(tmp_path, char_model):
    out = tmp_path / "run"
    run(cfg_for(out, steps=2, checkpoint_every=1), char_model)
    state_file = out / "checkpoints" / "step_2" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)  # what align writes loads without unpickling
    assert set(state) >= {"optimizer", "scheduler", "rng", "cursor", "step"}
    marker = tmp_path / "pwned"
    state["cursor"] = MakesMarker(marker)
    torch.save(state, state_file)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"(?s)step_2/trainer_state.pt holds objects other than.*"
        r"--resume-from step_1",
    ):
        run(cfg_for(out, steps=3, checkpoint_every=1), char_model)
    assert not marker.exists()
    # negative control: the payload is real, an unrestricted load would have run it
    torch.load(state_file, weights_only=False)
    assert marker.exists()


def two_checkpoints(tmp_path, char_model) -> Path:
    out = tmp_path / "run"
    run(cfg_for(out, steps=4, checkpoint_every=2), char_model)
    assert [d.name for _, d in ckpt.committed(out / "checkpoints")] == ["step_2", "step_4"]
    return out


def test_an_out_inside_another_runs_tree_is_refused(tmp_path, char_model):
    """Issue 42: --out inside another run's checkpoints/step_N was accepted; that run's retention deleted it."""
    other = two_checkpoints(tmp_path, char_model)
    before = tree(other)
    for inside in (other / "checkpoints" / "step_2" / "mine", other / "sub"):
        with pytest.raises(InputError, match=rf"--out {inside} is inside {other}, the run dir of another run"):
            run(cfg_for(inside, steps=1), char_model)
        assert not inside.exists()  # refused before anything was written
    assert tree(other) == before
    run(cfg_for(tmp_path / "sibling", steps=1), char_model)  # control: beside it is fine


def test_a_step_dir_that_is_not_this_runs_is_never_resumed_nor_deleted(tmp_path, char_model):
    """Issue 42: a checkpoints/step_N symlink to another run's checkpoint was resumed from silently, then retention
    deleted the run's own checkpoints and crashed on rmtree of the symlink. A copied checkpoint of another run (its
    marker carries that run's id) is refused the same way."""
    other = tmp_path / "other"
    run(cfg_for(other, steps=6, checkpoint_every=2, keep_checkpoints=0), char_model)
    out = two_checkpoints(tmp_path, char_model)  # step_2, step_4
    mine = tree(out / "checkpoints")
    theirs = tree(other / "checkpoints")
    link = out / "checkpoints" / "step_6"
    link.symlink_to(other / "checkpoints" / "step_6")
    copied = out / "checkpoints" / "step_8"
    for step_dir, why in ((link, r"a symlink \(to "), (copied, r"a checkpoint of another run \([0-9a-f]{32}\)")):
        if step_dir == copied:
            link.unlink()
            shutil.copytree(other / "checkpoints" / "step_6", copied)
        with pytest.raises(ckpt.CheckpointError, match=rf"{step_dir} is {why}.*not a checkpoint of this run"):
            run(cfg_for(out, steps=10, checkpoint_every=2, keep_checkpoints=1), char_model)
        assert tree(out / "checkpoints") == {**mine, **tree_under(step_dir, out / "checkpoints")}  # nothing deleted
        assert tree(other / "checkpoints") == theirs
    # retention (keep-last-K) leaves another run's step dirs alone, a symlink included; its own it prunes
    link.symlink_to(other / "checkpoints" / "step_4")
    model = ckpt.load_model(out / "checkpoints" / "step_4", torch.float32)
    state = ckpt.load_state(out / "checkpoints" / "step_4")
    ckpt.save_full(out / "checkpoints", 10, model, state, keep=1)
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert left == ["step_10", "step_6", "step_8"], left  # step_2 and step_4 (this run's) pruned
    assert tree(other / "checkpoints") == theirs
    assert [d.name for _, d in ckpt.committed(out / "checkpoints")] == ["step_10"]
    # control: without them the run resumes from its own latest checkpoint
    link.unlink()
    shutil.rmtree(copied)
    run(cfg_for(out, steps=12, checkpoint_every=2), char_model)
    assert [r["step"] for r in records(out) if "reward_mean" in r][-2:] == [11, 12]


def tree_under(path: Path, root: Path) -> dict[str, bytes]:
    """``tree`` of ``path`` keyed relative to ``root`` (a symlinked dir: nothing of its own)."""
    if path.is_symlink():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("victim", ["trainer_state.pt", "model/model.safetensors"])
def test_truncated_latest_checkpoint_is_named_and_resume_from_previous_works(tmp_path, char_model, victim):
    out = two_checkpoints(tmp_path, char_model)
    truncate(out / "checkpoints" / "step_4" / victim)
    with pytest.raises(
        ckpt.CheckpointError, match=rf"(?s)step_4/{victim} cannot be read.*truncated or corrupt.*--resume-from step_2"
    ):
        run(cfg_for(out, steps=6, checkpoint_every=2), char_model)
    run(cfg_for(out, steps=6, checkpoint_every=2, resume_from="step_2"), char_model)
    assert [r["step"] for r in records(out) if "reward_mean" in r] == [1, 2, 3, 4, 5, 6]
    assert [d.name for _, d in ckpt.committed(out / "checkpoints")] == ["step_4", "step_6"]
    assert [p.name.split(".")[0] for p in (out / "checkpoints").iterdir() if p.name.startswith("abandoned_")] == [
        "abandoned_step_4"
    ]  # the broken checkpoint is kept aside, never deleted
    with pytest.raises(ValueError, match=r"--resume-from 'step_3': no committed checkpoint.*step_4, step_6"):
        run(cfg_for(out, steps=7, checkpoint_every=2, resume_from="step_3"), char_model)


def test_optimizer_state_of_another_model_is_named(tmp_path, char_model):
    out = two_checkpoints(tmp_path, char_model)
    f = out / "checkpoints" / "step_4" / "trainer_state.pt"
    state = torch.load(f, weights_only=True)
    first = next(iter(state["optimizer"]["state"]))
    state["optimizer"]["state"][first]["exp_avg"] = torch.zeros(3, 3)
    torch.save(state, f)
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer state 'exp_avg'.*trainer_state.pt has shape \(3, 3\)"):
        run(cfg_for(out, steps=6), char_model)
    del state["optimizer"]["state"][first]
    state["optimizer"]["param_groups"][0]["params"].pop()
    torch.save(state, f)
    with pytest.raises(ckpt.CheckpointError, match=r"is for \d+ parameters, the model has \d+"):
        run(cfg_for(out, steps=6), char_model)


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "data,key,expected",
    [
        ({"loss": {"use_rho_correction": "false"}}, "loss.use_rho_correction", "bool"),
        ({"steps": 2.5}, "steps", "int"),
        ({"steps": True}, "steps", "int"),
        ({"steps": "3"}, "steps", "int"),
        ({"lr": "1e-3"}, "lr", "float"),
        ({"lr": False}, "lr", "float"),
        ({"gradient_checkpointing": 1}, "gradient_checkpointing", "bool"),
        ({"out": 3}, "out", "str"),
        ({"model": 1}, "model", "str or null"),
        ({"adam_betas": 0.9}, "adam_betas", "list of float"),
        ({"adam_betas": [0.9, "0.99"]}, "adam_betas[1]", "float"),
        ({"loss": 3}, "loss", "object"),  # a string is the flag --loss NAME in a --config file (flat keys)
        ({"adv": {"filter_zero_variance": "yes"}}, "adv.filter_zero_variance", "bool"),
        ({"eval": {"eval_interval": 1.0}}, "eval.eval_interval", "int"),
        ({"eval": {"eval_temperature": "0"}}, "eval.eval_temperature", "float or null"),
    ],
)
def test_config_json_types_are_checked(tmp_path, capsys, data, key, expected):
    with pytest.raises(ValueError) as e:
        from_dict(TrainConfig, data)
    msg = str(e.value)
    value = data[key.split(".")[0].split("[")[0]]
    while isinstance(value, dict):
        value = next(iter(value.values()))
    if isinstance(value, list):
        value = value[1]
    assert f"{key!r}" in msg and f"must be {expected}" in msg and repr(value) in msg, msg
    f = tmp_path / "c.json"
    f.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as e:
        parse(TrainConfig, ["--config", str(f)], CLI_PREFIXES)
    assert e.value.code == 2 and f"{key!r}" in capsys.readouterr().err


def test_config_json_valid_types_still_load(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(
        json.dumps(
            {
                "lr": 1,
                "steps": 3,
                "model": None,
                "adam_betas": [0.9, 1 / 2],
                "loss": {"use_rho_correction": True, "dual_clip_c": 3},
                "eval": {"eval_temperature": 0},
            }
        )
    )
    cfg = parse(TrainConfig, ["--config", str(f)], CLI_PREFIXES)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.steps == 3 and cfg.loss.use_rho_correction is True
    assert cfg.loss.dual_clip_c == 3.0 and cfg.eval.eval_temperature == 0.0 and cfg.adam_betas == [0.9, 0.5]


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--top-p", "0"], r"--top-p 0.0 is invalid: the nucleus mass must be in \(0, 1\]"),
        (["--top-p", "1.5"], r"--top-p 1.5 is invalid"),
        (["--lr", "nan"], r"--lr nan is invalid: must be a finite number > 0"),
        (["--lr", "inf"], r"--lr inf is invalid"),
        (["--temperature", "inf"], r"--temperature inf is invalid"),
        (["--temperature", "nan"], r"--temperature nan is invalid"),
        (
            ["--group-size", "1"],
            r"(?s)--group-size 1 is invalid:.*every group-relative advantage is exactly 0.*\(mean, rloo\)",
        ),
        (["--grad-clip", "nan"], r"--grad-clip nan is invalid"),
        (["--adam-betas", "0.9", "1.0"], r"--adam-betas \[0.9, 1.0\] is invalid"),
        (["--min-lr-ratio", "2"], r"--min-lr-ratio 2.0 is invalid"),
        (["--top-k", "-1"], r"--top-k -1 is invalid"),
        (["--rollout-timeout-s", "0"], r"--rollout-timeout-s 0.0 is invalid"),
        (["--adv-overlong-buffer", "20", "--max-tokens", "10"], r"--adv-overlong-buffer 20 is invalid"),
        (["--resume-from", "latest"], r"--resume-from 'latest' is invalid"),
        (["--eval-temperature", "nan"], r"--eval-temperature nan is invalid"),
        (["--eval-prompts", "0", "--eval-interval", "5"], r"--eval-prompts 0 is invalid: --eval-interval 5 needs"),
        (["--save-hf", "exports/step_{step}"], r"--save-hf 'exports/step_\{step\}' is a template"),
    ],
)
def test_bad_values_fail_before_anything_runs(capsys, flags, match):
    import re

    with pytest.raises(SystemExit) as e:
        parse(TrainConfig, flags, CLI_PREFIXES)  # what main() runs first, before any file is written
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)


TIMEOUT_FLAGS = ["--env-timeout-s", "--reward-timeout-s", "--lean-timeout-s", "--lean-import-timeout-s",
                 "--lean-retry-backoff-s", "--eval-timeout-s", "--dist-timeout-s", "--rollout-timeout-s"]  # fmt: skip


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
@pytest.mark.parametrize("flag", TIMEOUT_FLAGS)
def test_a_timeout_that_is_not_finite_is_refused_by_its_flag(capsys, flag, value):
    """Issue 42: inf passed every check, then every call failed with OverflowError (reported as the user's code
    raising or as a verifier_error)."""
    with pytest.raises(SystemExit) as e:
        parse(TrainConfig, [flag, value], CLI_PREFIXES)
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and "finite" in err, err
    if flag == "--dist-timeout-s":  # align.sft shares it
        from align.sft import CLI_PREFIXES as SFT_PREFIXES
        from align.sft import SFTConfig

        with pytest.raises(SystemExit):
            parse(SFTConfig, ["--model", "m", "--train-data", "d", flag, value], SFT_PREFIXES)
        assert flag in capsys.readouterr().err


def test_finite_timeouts_and_zero_for_none_are_accepted():
    from align.envs.tools import load_tools, make_tool_env

    zero = parse(TrainConfig, ["--env-timeout-s", "0", "--reward-timeout-s", "0"], CLI_PREFIXES)  # 0 = none
    assert zero.envs.env_timeout_s == 0 and zero.rewards.reward_timeout_s == 0
    parse(TrainConfig, [x for f in TIMEOUT_FLAGS for x in (f, "1e6")], CLI_PREFIXES)
    make_tool_env(load_tools(["python"]), timeout_s=0)  # the tools' timeout: 0 = none for user tools
    with pytest.raises(ValueError, match="tool timeout_s must be a finite number"):
        make_tool_env(load_tools(["python"]), timeout_s=math.inf)


def test_group_size_two_and_edge_values_are_accepted():
    TrainConfig(group_size=2, top_p=1.0, lr=1e-9, temperature=0.01, min_lr_ratio=0.0, top_k=0)


# ------------------------------------------------------------------------------------------------ resume settings


def test_resume_refuses_changed_math_with_a_diff(tmp_path, char_model):
    out = tmp_path / "run"
    run(cfg_for(out, steps=2, checkpoint_every=1), char_model)
    saved = (out / "config.json").read_text()
    with pytest.raises(
        ValueError,
        match=r"(?s)cannot resume .*lr: 0.01 -> 0.02.*loss.kl_coef: 0.0 -> 0.1.*"
        r"start a fresh run with a new --out",
    ):
        cfg = cfg_for(out, steps=3, lr=0.02)
        cfg.loss.kl_coef = 0.1
        run(cfg, char_model)
    other = tmp_path / "other_model"
    shutil.copytree(char_model, other)
    with pytest.raises(ValueError, match=r"(?s)model: '.*' -> '.*other_model'"):
        run(cfg_for(out, steps=3), str(other))
    assert (out / "config.json").read_text() == saved  # nothing recorded that the run did not use
    assert [r["step"] for r in records(out)] == [1, 2]


def test_resume_applies_and_logs_operational_changes(tmp_path, char_model, capsys):
    out = tmp_path / "run"
    run(cfg_for(out, steps=2, checkpoint_every=1), char_model)
    cfg = cfg_for(out, steps=3, checkpoint_every=3, keep_checkpoints=1, micro_batch_size=3, dp_replicate=2)
    cfg.eval.eval_n = 2  # (dp_replicate: the torchrun layout; one process ignores it)
    run(cfg, str(Path(char_model) / "sub" / ".."))  # the same model dir, spelled differently
    log = capsys.readouterr().out
    for change in (
        "steps: 2 -> 3",
        "checkpoint_every: 1 -> 3",
        "keep_checkpoints: 2 -> 1",
        "micro_batch_size: 8 -> 3",
        "eval.eval_n: 4 -> 2",
        "dp_replicate: 1 -> 2",
    ):
        assert f"applying changed setting {change}" in log, change
    saved = json.loads((out / "config.json").read_text())
    assert saved["steps"] == 3 and saved["eval"]["eval_n"] == 2
    assert [d.name for _, d in ckpt.committed(out / "checkpoints")] == ["step_3"]


# ------------------------------------------------------------------------------------------------ paths


def test_out_equal_to_or_overlapping_the_model_is_refused(tmp_path, char_model):
    model = tmp_path / "m"
    shutil.copytree(char_model, model)
    before = tree(model)
    for out in (model, model / "run"):
        with pytest.raises(ValueError, match=r"--model .* the run dir --out .*overwrite the model's config.json"):
            run(cfg_for(out), str(model))
    assert tree(model) == before and not (model / "run").exists()
    outer = tmp_path / "outer"
    inner = outer / "checkpoints" / "step_2" / "model"
    shutil.copytree(char_model, inner)
    with pytest.raises(ValueError, match=r"is inside the run dir"):
        run(cfg_for(outer), str(inner))
    assert not (outer / "config.json").exists()


def test_eval_hf_dir_inside_checkpoints_is_refused(tmp_path, char_model):
    out = tmp_path / "run"
    for d in (out / "checkpoints", out / "checkpoints" / "eval"):
        cfg = cfg_for(out)
        cfg.eval.eval_hf_dir = str(d)
        with pytest.raises(ValueError, match=r"--eval-hf-dir .* inside .*checkpoints: eval snapshots named step_N"):
            run(cfg, char_model)
    assert not out.exists()
    cfg = cfg_for(out, steps=1)
    cfg.eval.eval_hf_dir = str(tmp_path / "eval_hf")  # beside the run: fine
    run(cfg, char_model)


def test_save_hf_refuses_foreign_data_and_replaces_its_own_export(tmp_path, char_model):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me too")
    for target, what in ((foreign, "not an align export of this run"), (a_file, "a file, not a directory")):
        with pytest.raises(ValueError, match=rf"--save-hf .* exists and is {what}.*--overwrite"):
            run(cfg_for(tmp_path / "run", steps=1, save_hf=str(target)), char_model)
    assert (foreign / "precious.txt").read_text() == "keep me" and a_file.read_text() == "keep me too"
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step
    # overlap with --out / --model
    for target, flag in (
        (tmp_path / "run", "--out"),
        (tmp_path / "run" / "export", "--out"),
        (Path(char_model), "--model"),
        (Path(char_model) / "export", "--model"),
    ):
        with pytest.raises(ValueError, match=rf"--save-hf .* overlaps {flag}"):
            run(cfg_for(tmp_path / "run", steps=1, save_hf=str(target)), char_model)
    # a fresh dir, then the same run's export is replaced on resume, without --overwrite
    export = tmp_path / "export"
    run(cfg_for(tmp_path / "run", steps=1, save_hf=str(export)), char_model)
    rid = (tmp_path / "run" / RUN_ID_FILE).read_text().strip()
    marker = json.loads((export / EXPORT_MARKER).read_text())
    assert (marker["run_id"], marker["step"]) == (rid, 1)
    run(cfg_for(tmp_path / "run", steps=2, save_hf=str(export)), char_model)
    assert json.loads((export / EXPORT_MARKER).read_text())["step"] == 2
    from align.model import load_pretrained

    load_pretrained(export, require_marker=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export.")]  # no temp / old leftovers
    # another run's export is foreign too
    with pytest.raises(ValueError, match=rf"an export of another run \({rid}\)"):
        run(cfg_for(tmp_path / "run2", steps=1, save_hf=str(export)), char_model)
    # --overwrite forces it
    run(cfg_for(tmp_path / "run3", steps=1, save_hf=str(foreign), overwrite=True), char_model)
    assert not (foreign / "precious.txt").exists() and (foreign / EXPORT_MARKER).is_file()


def test_rollouts_from_other_weights_are_refused():
    from align.rollout.protocol import Completion

    comps = [Completion(0, i, [1], [0.0], "stop", weights_version=v) for i, v in enumerate((3, 3, 2))]
    with pytest.raises(RuntimeError, match=r"weights version\(s\) \[2\], this run published version 3"):
        check_weights_version(comps, 3, "spool")
    check_weights_version(comps[:2], 3, "spool")  # control: all from the published version


# ------------------------------------------------------------------------------------------------ issue 30: runs


def test_eval_hf_dir_holding_another_runs_step_dirs_is_refused(tmp_path, char_model):
    """--eval-hf-dir at another run's checkpoints/ (or a shared dir): its step_N would be replaced and deleted."""
    from helpers_train import tree_digest

    from align.run.safety import write_export_marker

    shared = tmp_path / "shared"
    (shared / "step_2").mkdir(parents=True)
    (shared / "step_2" / "model.safetensors").write_text("another run's committed step 2")
    (shared / "notes").mkdir()  # other names are not ours to judge
    before = tree_digest(shared)
    for owner in (None, "another-run"):
        if owner:
            write_export_marker(shared / "step_2", owner, 2)
            before = tree_digest(shared)
        cfg = cfg_for(tmp_path / "run", steps=1)
        cfg.eval.eval_hf_dir = str(shared)
        with pytest.raises(ValueError, match=r"--eval-hf-dir .* holds step_2, which this run did not export"):
            run(cfg, char_model)
        assert tree_digest(shared) == before and not (tmp_path / "run").exists()  # before anything is written
    # control: the same run's own snapshot (a resumed run keeps {out}/run_id) is accepted
    cfg = cfg_for(tmp_path / "run", steps=1)
    cfg.eval.eval_hf_dir = str(tmp_path / "own")
    run(cfg, char_model)
    (tmp_path / "own" / "step_1").mkdir(parents=True)
    write_export_marker(tmp_path / "own" / "step_1", (tmp_path / "run" / RUN_ID_FILE).read_text().strip(), 1)
    cfg = cfg_for(tmp_path / "run", steps=2)
    cfg.eval.eval_hf_dir = str(tmp_path / "own")
    run(cfg, char_model)


def test_save_hf_never_replaces_foreign_files_whatever_its_marker_says(tmp_path, char_model):
    """A copied run_id or a planted .align-export.json let a run replace a dir holding files no export writes."""
    export = tmp_path / "export"
    run(cfg_for(tmp_path / "run", steps=1, save_hf=str(export)), char_model)
    (export / "README.md").write_text("the user's notes")  # added to the export afterwards
    with pytest.raises(ValueError, match=r"holds README.md, which the export did not write.*--overwrite"):
        run(cfg_for(tmp_path / "run", steps=2, save_hf=str(export)), char_model)
    foreign = tmp_path / "foreign"
    shutil.copytree(char_model, foreign)
    (foreign / "precious.txt").write_text("keep me")
    shutil.copy(export / EXPORT_MARKER, foreign / EXPORT_MARKER)  # a planted marker with this run's id
    shutil.copytree(tmp_path / "run", tmp_path / "copy", ignore=shutil.ignore_patterns("checkpoints", ".align*"))
    for out in ("run", "copy"):  # this run, and a new run with the copied run_id
        with pytest.raises(ValueError, match=r"not an untouched export of this run"):
            run(cfg_for(tmp_path / out, steps=2, save_hf=str(foreign)), char_model)
    assert (foreign / "precious.txt").read_text() == "keep me"
    (export / "README.md").unlink()  # control: the untouched export of this run is replaced
    run(cfg_for(tmp_path / "run", steps=2, save_hf=str(export)), char_model)
    assert json.loads((export / EXPORT_MARKER).read_text())["step"] == 2


HOLDER = """import fcntl, os, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.truncate(0); f.write(f"pid {os.getpid()}\\n"); f.flush()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_the_same_out_is_refused_with_the_holders_pid(tmp_path, char_model):
    """Two runs on one --out both ran to rc 0 and interleaved metrics.jsonl."""
    import subprocess
    import sys

    from align.run.safety import LOCK_FILE

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=rf"--out .* is in use by another run \(pid {holder.pid}"):
            run(cfg_for(out, steps=1), char_model)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # refused before anything was written
    finally:
        holder.kill()
        holder.wait()
    run(cfg_for(out, steps=1), char_model)  # control: once the holder is gone the run starts
    run(cfg_for(out, steps=2), char_model)  # and a finished run released the lock
    assert [r["step"] for r in records(out) if "reward_mean" in r] == [1, 2]


def test_the_cli_refuses_a_held_out_with_one_error_line(tmp_path):
    """Regression (issue 42): the RuntimeError of atomic.hold_lock escaped align.train.main as a raw traceback."""
    import subprocess
    import sys

    from align.run.safety import LOCK_FILE

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        argv = ["--out", str(out), "--steps", "1", "--device", "cpu"]
        cmd = [sys.executable, "-m", "align.train", *argv]
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert p.returncode == 2, p.stderr
    assert errors == [line for line in errors if line.startswith("align.train: error: --out ")], p.stderr
    assert len(errors) == 1 and f"in use by another run (pid {holder.pid}" in errors[0], p.stderr
    assert sorted(x.name for x in out.iterdir()) == [LOCK_FILE]  # refused before anything was written


def test_killed_save_hf_temps_are_removed_by_the_next_run_of_the_same_run_only(tmp_path, char_model):
    from align.run.safety import clean_stale_exports, run_id

    out, export = tmp_path / "run", tmp_path / "export"
    out.mkdir()
    rid = run_id(out)
    mine = [tmp_path / f".export.tmp-{rid}-1a2b3c4d", tmp_path / f"..export.tmp-{rid}-1a2b3c4d.tmp-5e6f7a8b"]
    theirs = [tmp_path / ".export.tmp-0123456789abcdef-1a2b3c4d", tmp_path / ".export.tmp-1a2b3c4d"]
    for d in mine + theirs:  # what kill -9 during --save-hf leaves (and another run's / the old naming's)
        d.mkdir()
        (d / "model.safetensors").write_text("392 MB")
    run(cfg_for(out, steps=1, save_hf=str(export)), char_model)
    assert not any(d.exists() for d in mine) and all(d.exists() for d in theirs)
    old = tmp_path / f".export.old-{rid}-1a2b3c4d"  # killed between the two renames: the last export is put back
    export.rename(old)
    assert clean_stale_exports(export, rid) == [] and export.is_dir() and not old.exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exports_get_the_umasks_modes(tmp_path, char_model, umask):
    """Exports were written 0600 (safetensors), unreadable to a server running as another user."""
    import os
    import stat

    old = os.umask(umask)
    try:
        export = tmp_path / "export"
        cfg = cfg_for(tmp_path / "run", steps=1, save_hf=str(export))
        run(cfg, char_model)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in export.iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask, modes  # the 0o077 case is the control: umask, not 0644
    assert set(modes.values()) == {0o666 & ~umask}, modes
