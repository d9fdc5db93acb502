"""One GPU shared by the trainer and the vLLM worker (``--colocate``, ``--rollout-gpu-memory-utilization``): the
flags' rules, refused before anything loads where the run cannot work (the CPU build of vLLM has no sleep mode); the
``sleep`` / ``wake_up`` requests (protocol minor 3, align/rollout/sleep_mode.py) and an older worker refused before
anything is sent; the colocated run itself on a GPU (marked ``gpu``: ``bash scripts/gpu_check.sh``). The real vLLM
CPU worker's answer to ``sleep`` (``unsupported``) is tested in tests/test_spool_worker.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from align.rollout.backends import worker_gpu_args
from align.run.presets import parse
from align.train import CLI_PREFIXES, TrainConfig, main

GPU = ["--rollout", "spool", "--rollout-gpu", "0"]


def _parse(argv):
    return parse(TrainConfig, argv, CLI_PREFIXES, log=lambda _: None)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--rollout", "spool", "--colocate"], "the CPU build of vLLM does not have: pass --rollout-gpu N"),
        (["--colocate"], "--colocate is for the vLLM worker (--rollout spool)"),
        (["--rollout-gpu-memory-utilization", "0.3"], "--rollout-gpu-memory-utilization is for the vLLM worker"),
        (["--rollout", "spool", "--rollout-gpu-memory-utilization", "0.3"], "applies to a GPU worker"),
        ([*GPU, "--rollout-gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        ([*GPU, "--colocate", "--max-async-steps", "1"], "drop --max-async-steps > 0"),
        ([*GPU, "--colocate", "--rollout-num-engines", "2"], "drop a Ray fleet"),
        ([*GPU, "--colocate", "--no-spawn-worker"], "drop --no-spawn-worker"),
        ([*GPU, "--colocate", "--rollout-sleep-level", "2", "--sync-every", "2"], "needs --sync-every 1"),
        ([*GPU, "--colocate", "--rollout-sleep-level", "2", "--lora-rank", "8"], "drops the base weights a LoRA"),
        ([*GPU, "--colocate", "--rollout-sleep-level", "3"], "--rollout-sleep-level must be 1 or 2"),
    ],
)
def test_colocate_is_refused_where_it_cannot_run(argv, error, capsys):
    with pytest.raises(SystemExit):
        _parse(argv)
    assert error in capsys.readouterr().err


def test_a_colocated_config_passes_its_flags_to_the_worker_and_sleeps_its_engine(tmp_path, monkeypatch, capsys):
    """The control: on a GPU the same flags parse; the spawned worker gets vLLM's memory fraction and sleep mode, the
    synchronous engine sleeps at the chosen level. Through main(), the CPU-build refusal comes before any model load."""
    cfg = _parse([*GPU, "--colocate", "--rollout-gpu-memory-utilization", "0.3", "--rollout-sleep-level", "2"])
    assert worker_gpu_args(cfg) == ["--gpu-memory-utilization", "0.3", "--enable-sleep-mode"]
    assert worker_gpu_args(_parse(GPU)) == []
    fleet = _parse(["--rollout", "spool", "--rollout-num-engines", "2", "--rollout-gpu-memory-utilization", "0.5"])
    assert worker_gpu_args(fleet) == ["--gpu-memory-utilization", "0.5"]  # a Ray fleet places its engines itself
    from align.rollout.backends import SpoolOpened  # what the spool row's open() returns; its engine for K = 0

    assert SpoolOpened(client=object(), policy=None).engine(cfg, 0, tmp_path).sleep_level == 2
    assert SpoolOpened(client=object(), policy=None).engine(_parse(GPU), 0, tmp_path).sleep_level == 0
    import align.model

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before --colocate was refused")

    monkeypatch.setattr(align.model, "load_pretrained", no_load)
    with pytest.raises(SystemExit) as exit_:
        main(["--rollout", "spool", "--colocate", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    assert "--colocate needs vLLM's sleep mode" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_sleep_requests_round_trip_and_an_older_worker_is_refused_before_anything_is_sent(tmp_path):
    from align.rollout.client import SpoolClient
    from align.rollout.protocol import PROTOCOL, Message
    from align.rollout.sleep_mode import SLEEP_MINOR, sleep, sleep_request, wake_up
    from align.rollout.spool import Spool
    from align.rollout.teacher_logprobs import WorkerTooOldError, worker_minor

    msg = sleep_request(2)
    assert Message.from_json(msg.to_json()).body == {"level": 2}
    with pytest.raises(ValueError, match="sleep level 0"):
        sleep_request(0)
    spool = Spool(tmp_path / "spool").ensure()
    spool.write_heartbeat("ready")
    assert worker_minor(spool.read_heartbeat()) >= SLEEP_MINOR  # control: this checkout's worker serves them
    old = {"protocol": PROTOCOL, "version": 1, "minor": 1, "kind": "heartbeat", "state": "ready", "pid": 1}
    spool.heartbeat_path.write_text(json.dumps({**old, "host": "h", "time": 1e9}))
    client = SpoolClient(spool.root, timeout_s=5)
    for ask in (lambda: sleep(client, 1), lambda: wake_up(client)):
        with pytest.raises(WorkerTooOldError, match=r"speaks align-spool 1\.1; sleep / wake_up .* need 1\.3"):
            ask()
    assert not list(spool.requests.iterdir())  # nothing was sent


def _vllm_sleeps(venv: Path) -> bool:
    code = "from vllm.platforms import current_platform as p; print(p.is_sleep_mode_available())"
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    return done.stdout.strip().endswith("True")


@pytest.mark.gpu
def test_a_colocated_run_sleeps_the_worker_through_each_update(tmp_path):
    """``--rollout spool --rollout-gpu 0 --colocate --rollout-gpu-memory-utilization 0.3`` on one GPU, 3 steps: the
    worker (a CUDA build of vLLM in .venv-rollout) sleeps after each step's rollouts, freeing GPU memory, and wakes
    before each weight sync; the run's rollouts keep matching the trainer's logprobs. Without sleep mode in the rollout
    venv (the CPU build) it skips, by name."""
    from helpers_models import require_rollout_venv

    venv = require_rollout_venv()
    if not _vllm_sleeps(venv):
        pytest.skip(f"{venv} has no vLLM with sleep mode (the CPU build): install a CUDA build of vLLM there")
    import importlib.util

    ex = Path(__file__).resolve().parents[1] / "examples" / "own_data"
    spec = importlib.util.spec_from_file_location("make_tiny", ex / "make_tiny.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    make_tiny.main(str(tmp_path / "tiny_model"))
    out = tmp_path / "run"
    argv = ["--model", str(tmp_path / "tiny_model"), "--train-data", str(ex / "train.jsonl"), "--out", str(out)]
    argv += ["--reward", f"{ex / 'rewards.py'}:short", *GPU, "--colocate", "--rollout-gpu-memory-utilization", "0.3"]
    argv += ["--steps", "3", "--prompts-per-step", "2", "--group-size", "2", "--max-tokens", "8"]
    argv += ["--eval-interval", "0", "--device", "cuda", "--precision", "fp32"]
    assert main(argv) == 0
    log = (out / "rollout_worker.log").read_text()
    freed = [float(g) for g in re.findall(r"asleep \(level 1\) in [\d.]+ s, ([\d.]+) GiB freed", log)]
    assert len(freed) == 3 and min(freed) > 0, log[-2000:]  # after each step's rollouts, memory really freed
    assert len(re.findall(r"awake in [\d.]+ s", log)) == 3
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["mismatch_abs_max"] < 1e-2 for r in recs)
