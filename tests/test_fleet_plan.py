"""The placement planner (extras/vllm_rollout/placement.py, stdlib only) and ``fleet.py plan`` under plain python.

Seed 000: eval bundles are appended past every other region, so trainer (and rollout) offsets never shift when
an eval fleet is added, in the separate and the colocated layout.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLEET = ROOT / "extras" / "vllm_rollout" / "fleet.py"


def _load_placement():
    spec = importlib.util.spec_from_file_location("placement", ROOT / "extras" / "vllm_rollout" / "placement.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["placement"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


placement = _load_placement()

# (train_gpus, engines, gpus_per_engine, colocate) -> expected trainer and rollout bundles
LAYOUTS = [
    ((2, 2, 1, False), [0, 1], [2, 3]),
    ((4, 2, 2, False), [0, 1, 2, 3], [4, 5, 6, 7]),
    ((0, 3, 1, False), [], [0, 1, 2]),
    ((4, 2, 2, True), [0, 1, 2, 3], [0, 1, 2, 3]),
    ((2, 4, 1, True), [0, 1], [0, 1, 2, 3]),  # rollout larger than the trainer: the shared block is 4 wide
    ((4, 1, 2, True), [0, 1, 2, 3], [0, 1]),
]
EVALS = [(0, 1), (1, 1), (2, 1), (4, 2), (2, 2)]


@pytest.mark.parametrize(("args", "trainer", "rollout"), LAYOUTS)
@pytest.mark.parametrize(("eval_gpus", "eval_per_engine"), EVALS)
def test_eval_bundles_never_shift_trainer_or_rollout(args, trainer, rollout, eval_gpus, eval_per_engine):
    train_gpus, engines, per_engine, colocate = args
    base = placement.plan(train_gpus, engines, per_engine, colocate=colocate)
    p = placement.plan(train_gpus, engines, per_engine, eval_gpus, eval_per_engine, colocate=colocate)
    assert (base.trainer, base.rollout) == (trainer, rollout)
    assert (p.trainer, p.rollout, p.rollout_engines) == (base.trainer, base.rollout, base.rollout_engines)
    shared_end = max(trainer + rollout, default=-1) + 1
    assert p.eval == list(range(shared_end, shared_end + eval_gpus))  # appended after every other region
    assert p.num_bundles == base.num_bundles + eval_gpus
    assert p.rollout_engines == [rollout[i : i + per_engine] for i in range(0, len(rollout), per_engine)]
    assert p.eval_engines == [p.eval[i : i + eval_per_engine] for i in range(0, eval_gpus, eval_per_engine)]
    if not colocate:
        assert not set(p.trainer) & set(p.rollout)
    assert not set(p.eval) & set(p.trainer + p.rollout)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"eval_num_gpus": 3, "eval_num_gpus_per_engine": 2}, ["3", "not divisible", "2"]),
        ({"available_gpus": 5, "eval_num_gpus": 2}, ["needs 6 GPUs", "only 5"]),
        ({"available_gpus": 3, "colocate": True, "rollout_engines": 4}, ["needs 4 GPUs", "only 3"]),
        ({"train_gpus": 0, "colocate": True}, ["colocate", "train_gpus"]),
        ({"rollout_engines": 0}, ["rollout_engines", "0"]),
        ({"rollout_gpus_per_engine": 0}, ["GPUs per engine", "0"]),
        ({"eval_num_gpus": -2}, ["eval_num_gpus", "-2"]),
    ],
)
def test_invalid_combinations_raise_with_the_numbers(kwargs, words):
    args = {"train_gpus": 2, "rollout_engines": 2, "rollout_gpus_per_engine": 1, **kwargs}
    with pytest.raises(ValueError) as err:
        placement.plan(**args)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_a_layout_that_fits_exactly_is_accepted():
    p = placement.plan(2, 2, 1, eval_num_gpus=2, available_gpus=6)
    assert p.num_bundles == 6


def test_one_gpu_engines_spread_over_nodes_and_tensor_parallel_ones_pack():
    """SPREAD (soft) puts one-GPU engines on distinct nodes where it can and lets Ray re-place a dead node's bundles;
    a tensor-parallel engine (in either region) keeps its bundles packed."""
    assert placement.pg_strategy(placement.plan(0, 2, 1, eval_num_gpus=1)) == "SPREAD"
    assert placement.pg_strategy(placement.plan(0, 2, 2)) == "PACK"
    assert placement.pg_strategy(placement.plan(0, 2, 1, eval_num_gpus=2, eval_num_gpus_per_engine=2)) == "PACK"


PROBE = """
import runpy, sys
fleet = sys.argv[1]
sys.argv = [fleet, "plan", *sys.argv[2:]]
rc = 0
try:
    runpy.run_path(fleet, run_name="__main__")
except SystemExit as e:
    rc = e.code
print("RAY_IMPORTED" if "ray" in sys.modules else "NO_RAY", file=sys.stderr)
sys.exit(rc)
"""


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60, env=env)


def _run_plan(*args: str) -> subprocess.CompletedProcess:
    """``fleet.py plan`` under the rollout venv's python (where ray is importable), reporting whether it was."""
    rollout = ROOT / ".venv-rollout" / "bin" / "python"
    if not rollout.exists():
        pytest.skip("needs .venv-rollout (with ray) to show that the plan command does not import it")
    return _run([str(rollout), "-c", PROBE, str(FLEET), *args])


def test_plan_command_prints_json_without_ray():
    r = _run_plan("--train-gpus", "4", "--rollout-engines", "2", "--rollout-gpus-per-engine", "2",
                  "--eval-num-gpus", "2", "--eval-num-gpus-per-engine", "1", "--colocate")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["trainer"], out["rollout"], out["eval"]) == ([0, 1, 2, 3], [0, 1, 2, 3], [4, 5])
    assert "NO_RAY" in r.stderr
    control = _run([str(ROOT / ".venv-rollout" / "bin" / "python"), "-c", "import ray; " + PROBE, str(FLEET)])
    assert "RAY_IMPORTED" in control.stderr  # negative control: the probe does see an import of ray


def test_plan_command_under_plain_python3_fails_with_the_numbers():
    """Plain system python3 (no venv, no torch, no ray): the command still runs."""
    plain = {"PATH": "/usr/bin:/bin"}
    r = _run(["python3", str(FLEET), "plan", "--train-gpus", "2", "--rollout-engines", "1",
              "--eval-num-gpus", "3", "--eval-num-gpus-per-engine", "2"], env=plain)  # fmt: skip
    assert r.returncode == 2
    assert "--eval-num-gpus 3 is not divisible by --eval-num-gpus-per-engine 2" in r.stderr
    ok = _run(["python3", str(FLEET), "plan", "--train-gpus", "2", "--rollout-engines", "2"], env=plain)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["rollout"] == [2, 3]


def spawn_worker_keywords(monkeypatch, cfg, model) -> dict:
    """The keywords ``train(cfg)`` on the reverse task passes spawn_worker, which is replaced by a recorder that
    stops the run (the real fleet start is tests/test_fleet.py's)."""
    from align.rollout import client as client_mod
    from align.tasks import reverse
    from align.train import train

    class Stop(Exception):
        pass

    seen: dict = {}

    def record(spool, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(client_mod, "spawn_worker", record)
    with pytest.raises(Stop):
        train(
            cfg,
            model=str(model),
            tokenizer=reverse.tokenizer(),
            prompts=reverse.prompts(4, "train"),
            reward=lambda *a, **k: 0.0,
        )
    return seen


def test_rollout_num_engines_flag_reaches_spawn_worker(tmp_path, monkeypatch, reverse_model):
    """``--rollout-num-engines`` / ``--rollout-engine-restarts`` go from the CLI through train() to spawn_worker.
    spawn_worker is replaced by a recorder that stops the run (``spawn_worker_keywords``)."""
    from align.run.cli import parse
    from align.train import CLI_PREFIXES, TrainConfig

    argv = ["--out", str(tmp_path / "run"), "--rollout", "spool", "--rollout-num-engines", "2",
            "--rollout-engine-restarts", "3", "--steps", "1", "--eval-interval", "0"]  # fmt: skip
    cfg = parse(TrainConfig, argv, CLI_PREFIXES)
    assert (cfg.rollout_num_engines, cfg.rollout_engine_restarts) == (2, 3)
    seen = spawn_worker_keywords(monkeypatch, cfg, reverse_model)
    assert (seen["engines"], seen["engine_restarts"]) == (2, 3)
    with pytest.raises(ValueError, match="rollout-num-engines must be >= 1, got 0"):
        TrainConfig(rollout_num_engines=0)


def test_spawn_worker_rejects_a_bad_fleet_size(tmp_path):
    from align.rollout.client import spawn_worker

    venv = ROOT / ".venv-rollout"
    if not (venv / "bin" / "python").exists():
        pytest.skip("spawn_worker checks the rollout venv first")
    with pytest.raises(ValueError, match="engines >= 1"):
        spawn_worker(tmp_path / "spool", model=tmp_path, engines=0, venv=venv)


def test_the_worker_hooks_the_fleet_overrides_exist():
    """fleet.py reuses rollout_worker.Worker by subclassing it: its loop calls these methods, which the fleet
    overrides (driver) or relies on (engine actors). A rename in rollout_worker.py must fail here, in seconds,
    not only in the slow real-Ray tests."""
    import inspect

    sys.path.insert(0, str(FLEET.parent))
    try:
        import fleet
        import rollout_worker as rw
    finally:
        sys.path.remove(str(FLEET.parent))
    assert issubclass(fleet.FleetWorker, rw.Worker)
    hooks = {"build_engine": ["model_dir"], "drop_engine": [], "serve_generate": ["batch"], "serve_sync": ["msg"],
             "next_batch": [], "answer": ["msg"], "heartbeat": [], "check_generate": ["prompts", "params"],
             "set_state": ["state", "error"], "run": [], "close": ["error"]}  # fmt: skip
    for name, params in hooks.items():
        assert callable(getattr(rw.Worker, name, None)), f"rollout_worker.Worker.{name} is gone"
        assert list(inspect.signature(getattr(rw.Worker, name)).parameters)[1:] == params, name
    assert callable(rw.parse_args) and callable(rw.lock_spool) and callable(rw.sample_seed)
    src = inspect.getsource(rw.Worker.run)
    for call in ("self.build_engine(", "self.next_batch(", "self.serve_generate(", "self.serve_sync("):
        assert call in src, f"Worker.run no longer calls {call}...): the fleet's overrides would be bypassed"


@pytest.mark.parametrize(
    ("flags", "fleet", "eval_engines"),
    [
        (["--rollout-ray"], True, 1),  # one rollout engine on Ray: the eval engine joins its placement group
        (["--rollout-num-engines", "2"], True, 1),
        (["--ray-address", "10.0.0.1:6379"], True, 1),
        ([], False, 0),  # the plain worker: --eval-num-gpus keeps its separate spool-worker eval fleet
    ],
)
def test_eval_on_ray_flags_reach_spawn_worker(tmp_path, monkeypatch, flags, fleet, eval_engines, reverse_model):
    """``--eval-num-gpus`` with the Ray fleet asks spawn_worker for the eval engines and the eval spool (the real
    run is tests/test_fleet_eval_train.py's); spawn_worker is replaced by a recorder that stops the run."""
    from align.run.cli import parse
    from align.train import CLI_PREFIXES, TrainConfig

    run = tmp_path / "run"
    argv = ["--out", str(run), "--rollout", "spool", "--steps", "1", "--eval-interval", "2", "--eval-num-gpus", "1",
            "--eval-hf-dir", str(tmp_path / "eval_hf"), *flags]  # fmt: skip
    cfg = parse(TrainConfig, argv, CLI_PREFIXES)
    model = reverse_model
    seen = spawn_worker_keywords(monkeypatch, cfg, model)
    assert seen["use_fleet"] is fleet and seen["eval_engines"] == eval_engines
    assert seen["eval_spool"] == (run / "eval_spool" if fleet else None)
    # the eval engines start on the base model as version 0 (the run deletes its rollout snapshots as it goes)
    assert (str(seen["eval_model"]), seen["eval_weights_version"]) == (str(model), 0)
    assert seen["ray_address"] == (flags[1] if flags[:1] == ["--ray-address"] else None)


def test_router_client_version_is_every_eval_engines_read_back(tmp_path):
    """The pin's version read-back through the eval router: one common version, or the list of all of them (never
    equal to a pinned version) when an engine is stale or not ready."""
    from types import SimpleNamespace

    from align.eval.fleet import RouterClient
    from align.rollout.spool import Spool

    spool = Spool(tmp_path / "eval_spool").ensure()
    client = RouterClient(SimpleNamespace(spool=spool))
    cases = [
        ([("ready", 5), ("ready", 5)], 5),
        ([("ready", 5), ("ready", 4)], [5, 4]),  # negative control: one stale engine
        ([("ready", 5), ("dead", 5)], [5, "dead"]),  # a dead engine is no read-back
        ([], []),
    ]
    for engines, expected in cases:
        spool.write_heartbeat(
            "ready", engines=[{"index": i, "state": s, "version": v} for i, (s, v) in enumerate(engines)]
        )
        assert client.weights_version() == expected, engines
