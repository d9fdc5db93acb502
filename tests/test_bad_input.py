"""Bad input gets one named error, before the model loads (issue 30): files that are not UTF-8, chat messages and
templates, empty prompts and files, --config, --out, --logger, a hand-edited checkpoint or lean_gen manifest. One
table per area; each row is an input that gave a raw traceback (or wrote into a model dir) before, and the message
it gives now, naming the file / line / row / flag."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_models import make_tiny_qwen2, require_rollout_venv
from helpers_tokenizer import make_bpe_tokenizer
from helpers_train import PROMPTS, ROOT, TOK, a_reward, cfg_for, run_cli, tree_digest

from align.data import DataConfig, InputError, load_data
from align.run import checkpoint as ckpt
from align.run.presets import parse
from align.train import CLI_PREFIXES, TrainConfig, train

USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = make_tiny_qwen2(tmp_path_factory.mktemp("m") / "m", max_position_embeddings=64)
    make_bpe_tokenizer(d, template_in_config=False)  # the template in chat_template.jinja
    return d


def tokenizer_with(d: Path, model_dir: Path, files: dict[str, bytes | None]) -> str:
    """A copy of the model's tokenizer files at ``d`` with ``files`` (name -> bytes; None: removed) over them."""
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / f, d / f)
    for name, data in files.items():
        if data is None:
            (d / name).unlink()
        else:
            (d / name).write_bytes(data)
    return str(d)


def jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


TEMPLATE = "chat_template.jinja"
DATA_CASES = [  # (name, data file bytes, tokenizer files, the error)
    (
        "jsonl not utf-8",
        jsonl({"prompt": "ok"}, b'{"prompt": "caf\xe9"}'),
        {},
        r"d\.jsonl:2: not UTF-8 text \(byte b'\\xe9'",
    ),
    (
        "tokenizer_config.json not utf-8",
        jsonl({"prompt": "ok"}),
        {"tokenizer_config.json": b'{\n"eos_token": "\xff"}'},
        r"tokenizer_config\.json:2: not UTF-8 text",
    ),
    ("chat_template.jinja not utf-8", jsonl({"prompt": "ok"}), {TEMPLATE: b"ok\n\xfe"}, r"jinja:2: not UTF-8 text"),
    (
        "content is a dict",
        jsonl({"messages": [{"role": "user", "content": {"text": "hi"}}]}),
        {},
        r"d\.jsonl:1: message 0 \(user\) has dict content; .*must be a string",
    ),
    (
        "content is null",
        jsonl({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": None}]}),
        {},
        r"d\.jsonl:1: message 1 \(user\) has null content",
    ),
    (
        "template syntax error",
        jsonl({"messages": [USER]}),
        {TEMPLATE: b"{% for m in messages %}\n{{ m.content }\n{% endfor %}"},
        r"chat_template\.jinja: line 2: template syntax error",
    ),
    (
        "syntax error in tokenizer_config's template",
        jsonl({"messages": [USER]}),
        {"tokenizer_config.json": json.dumps({"chat_template": "{{ messages }"}).encode(), TEMPLATE: None},
        r"the chat template in .*tokenizer_config\.json: line 1: template syntax error",
    ),
    (
        "range(10**9)",
        jsonl({"prompt": "ok"}, {"messages": [USER]}),
        {TEMPLATE: b"{% for i in range(10**9) %}x{% endfor %}"},
        r"d\.jsonl:2: .*chat_template\.jinja failed on these messages \(OverflowError: .*range",
    ),
    (
        "{% include %}",
        jsonl({"prompt": "ok"}),
        {TEMPLATE: b"{{ messages[0].content }}\n{% include 'system.jinja' %}"},
        r"chat_template\.jinja: line 2: include / import / extends loads another template file",
    ),
    (
        "{% extends %}",
        jsonl({"prompt": "ok"}),
        {TEMPLATE: b"{% extends 'base.jinja' %}"},
        r"chat_template\.jinja: line 1: include / import / extends",
    ),
    ("empty prompt", jsonl({"prompt": "ok"}, {"prompt": ""}), {}, r"d\.jsonl:2: 'prompt' is an empty string"),
    (
        "template renders to nothing",
        jsonl({"messages": [USER]}),
        {TEMPLATE: b"{% if false %}x{% endif %}"},
        r"d\.jsonl:1: .*chat_template\.jinja renders these messages to an empty prompt",
    ),
]


@pytest.mark.parametrize("name,data,files,match", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_tokenizer_and_template_are_named(tmp_path, model_dir, name, data, files, match):
    tok = tokenizer_with(tmp_path / "tok", model_dir, files)
    (tmp_path / "d.jsonl").write_bytes(data)
    with pytest.raises(InputError, match=match):
        load_data(DataConfig(train_data=str(tmp_path / "d.jsonl"), tokenizer=tok), str(model_dir), max_tokens=8)
    # negative control: good rows (a prompt, a chat) with an unedited copy of the tokenizer load
    (tmp_path / "ok.jsonl").write_bytes(jsonl({"prompt": "ok"}, {"messages": [USER]}))
    stock = tokenizer_with(tmp_path / "stock", model_dir, {})
    load_data(DataConfig(train_data=str(tmp_path / "ok.jsonl"), tokenizer=stock), str(model_dir), max_tokens=8)


def test_parquet_with_no_rows_is_named(tmp_path):
    venv = require_rollout_venv()  # the rollout venv has pyarrow (the core venv does not)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import pyarrow as pa, pyarrow.parquet as pq
        from align.data import InputError, read_rows
        for name, table in (("empty", pa.table({{"prompt": pa.array([], pa.string())}})), ("one", pa.table({{"prompt": ["a"]}}))):
            path = {str(tmp_path)!r} + "/" + name + ".parquet"
            pq.write_table(table, path)
            try:
                print(name, len(read_rows(path)))
            except InputError as e:
                print(name, "InputError", e)
    """)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"empty InputError --train-data .*empty\.parquet: the file has no rows", lines[0]), lines
    assert lines[1] == "one 1"  # negative control: a table with a row reads


# ------------------------------------------------------------------------------------------------ --config


@pytest.mark.parametrize(
    "content,match",
    [
        (b'{"steps": 3,\n "out": "caf\xe9"}', r"--config .*c\.json:2: not UTF-8 text \(byte b'\\xe9'\)"),
        (b'[{"steps": 3}]', r"--config .*c\.json: the top level must be a JSON object .* got a list"),
        (b'{"steps": 3,\n}', r"--config .*c\.json:2: not valid JSON"),
    ],
    ids=["not utf-8", "a list", "not json"],
)
def test_bad_config_file_is_one_argparse_error(tmp_path, capsys, content, match):
    f = tmp_path / "c.json"
    f.write_bytes(content)
    for preset in ([], ["--preset", "dr_grpo"]):  # what main() runs: presets.parse, then cli.parse
        with pytest.raises(SystemExit) as e:
            parse(TrainConfig, ["--config", str(f), *preset], CLI_PREFIXES)
        err = capsys.readouterr().err
        assert e.value.code == 2 and re.search(match, err), err
    f.write_bytes(b'{"steps": 3}')  # negative control
    assert parse(TrainConfig, ["--config", str(f)], CLI_PREFIXES).steps == 3


# ------------------------------------------------------------------------------------------------ --out, --logger


def no_model_load(monkeypatch) -> None:
    import align.model

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(align.model, "load_pretrained", no_load)


def test_bad_run_paths_and_loggers_fail_before_the_model_loads(tmp_path, char_model, monkeypatch):
    tok = make_bpe_tokenizer(tmp_path / "tok")  # an HF tokenizer dir (tokenizer.json, tokenizer_config.json)
    other_model = tmp_path / "other_model"
    shutil.copytree(char_model, other_model)
    shutil.copy(tok / "tokenizer.json", other_model / "tokenizer.json")
    (tmp_path / "a_file").write_text("x")
    tb_file = tmp_path / "tb_file"
    tb_file.mkdir()
    (tb_file / "tensorboard").write_text("x")
    cases = [  # (out, cfg changes, the error)
        (tok, {"tokenizer": str(tok)}, r"--tokenizer .*tok is the run dir --out .*overwrite the model's config\.json"),
        (tok / "run", {"tokenizer": str(tok)}, r"--tokenizer .*tok contains the run dir --out .*tok/run"),
        (tok, {}, r"--out .*tok holds a Hugging Face model or tokenizer \(tokenizer\.json, tokenizer_config\.json\)"),
        (other_model, {}, r"--out .*other_model holds a Hugging Face model or tokenizer \(tokenizer\.json, model\.s"),
        (tmp_path / "a_file" / "run", {}, r"--out .*a_file/run: the run dir cannot be written \(Not a directory"),
        (
            tb_file,
            {"logger": "tensorboard"},
            r"--logger tensorboard writes its events to .*tb_file/tensorboard, which is a file",
        ),
        (
            tmp_path / "wb",
            {"logger": "wandb"},
            r"--logger wandb needs the optional package 'wandb': pip install 'align\[wandb\]'",
        ),
    ]
    before = {p: tree_digest(p) for p in (tok, other_model)}
    monkeypatch.setitem(sys.modules, "wandb", None)  # import raises ImportError, as when not installed
    no_model_load(monkeypatch)
    for out, change, match in cases:
        cfg = cfg_for(out)
        cfg.data.tokenizer = change.get("tokenizer")
        cfg.log.logger = change.get("logger", "none")
        with pytest.raises(InputError, match=match):
            train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    assert {p: tree_digest(p) for p in (tok, other_model)} == before  # nothing written into either dir
    # negative control: a fresh --out beside them gets past every check, to the model load
    with pytest.raises(AssertionError, match="the model was loaded"):
        train(cfg_for(tmp_path / "fresh"), model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)


def test_a_token_budget_below_one_prompt_and_completion_fails_before_the_model_loads(tmp_path, char_model, monkeypatch):
    """--micro-batch-tokens smaller than the longest prompt + --max-tokens - 1 (a packed segment of one completion is
    as long as its padded row): an InputError naming the flag and the size needed, packed or not."""
    no_model_load(monkeypatch)
    longest = max(len(TOK.encode(r["prompt"])) for r in PROMPTS) + 4 - 1  # TRAIN_BASE max_tokens 4
    for pack in (True, False):
        cfg = cfg_for(tmp_path / f"run{pack}", micro_batch_tokens=longest - 1, pack_sequences=pack)
        with pytest.raises(InputError, match=rf"--micro-batch-tokens {longest - 1} .* raise it to >= {longest}"):
            train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)
    # negative control: the size it names gets past the check, to the model load
    cfg = cfg_for(tmp_path / "fits", micro_batch_tokens=longest)
    with pytest.raises(AssertionError, match="the model was loaded"):
        train(cfg, model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)


def test_out_on_a_read_only_filesystem_is_one_line(tmp_path, char_model):
    ro = tmp_path / "ro"
    ro.mkdir()
    if shutil.which("unshare") is None:
        pytest.fail("needs unshare (util-linux) to mount a read-only tmpfs in a private mount namespace")
    args = ["--steps", "1", "--model", char_model]
    for out in (ro, ro / "run"):
        cmd = [sys.executable, "-m", "align.train", "--out", str(out), *args]
        script = f"mount -t tmpfs -o ro none {ro} && exec " + " ".join(f"'{c}'" for c in cmd)
        proc = subprocess.run(
            ["unshare", "-rm", "sh", "-c", script],
            check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert re.fullmatch(
            rf"align\.train: error: --out {out}: the run dir cannot be written \(Read-only file system.*", lines[-1]
        ), proc.stderr
        assert "Traceback" not in proc.stderr
    # negative control: the same command on the writable dir gets past --out (to the built-in task's model check)
    proc = run_cli(["--out", str(ro / "run"), *args])
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and "is not a model of the built-in 'reverse' task" in text, text


# ------------------------------------------------------------------------------------------------ a checkpoint


def test_hand_edited_checkpoint_is_named_with_the_way_out(tmp_path, char_model):
    def run(out: Path, **kw) -> dict:
        return train(cfg_for(out, **kw), model=char_model, tokenizer=TOK, prompts=PROMPTS, reward=a_reward)

    lora_run, full_run = tmp_path / "lora", tmp_path / "full"
    run(lora_run, steps=2, checkpoint_every=1, lora={"rank": 4, "alpha": 8.0})
    run(full_run, steps=2, checkpoint_every=1)
    adapter = lora_run / "checkpoints" / "step_2" / "adapter"

    def corrupt_weights() -> None:
        data = (adapter / "adapter_model.safetensors").read_bytes()
        (adapter / "adapter_model.safetensors").write_bytes(data[:8] + b"{not a header" + data[21:])

    def alpha_x() -> None:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": "x"}))

    def step_two() -> None:
        f = full_run / "checkpoints" / "step_2" / "trainer_state.pt"
        state = torch.load(f, weights_only=True)
        torch.save({**state, "step": "two"}, f)

    cases = [
        (corrupt_weights, lora_run, r"(?s)step_2/adapter cannot be loaded .*safetensors is not a readable.*step_1"),
        (alpha_x, lora_run, r"(?s)step_2/adapter cannot be loaded .*lora_alpha='x' must be a number.*step_1"),
        (step_two, full_run, r"(?s)step_2/trainer_state\.pt has values align never writes \(step='two'.*step_1"),
    ]
    for i, (edit, out, match) in enumerate(cases):
        backup = tmp_path / f"backup{i}"
        shutil.copytree(out / "checkpoints" / "step_2", backup)
        edit()
        extra = {"lora": {"rank": 4, "alpha": 8.0}} if out == lora_run else {}
        with pytest.raises(ckpt.CheckpointError, match=match):
            run(out, steps=3, checkpoint_every=1, **extra)
        shutil.rmtree(out / "checkpoints" / "step_2")
        shutil.copytree(backup, out / "checkpoints" / "step_2")
    # negative control: the restored checkpoints resume
    assert run(lora_run, steps=3, checkpoint_every=1, lora={"rank": 4, "alpha": 8.0})["steps"] == 3
    assert run(full_run, steps=3, checkpoint_every=1)["steps"] == 3


# ------------------------------------------------------------------------------------------------ lean_gen manifest


def test_hand_edited_lean_gen_manifest_is_named(tmp_path):
    sys.path.insert(0, str(ROOT / "extras" / "vllm_rollout"))
    try:
        import lean_records
    finally:
        sys.path.pop(0)
    plan = {"model": "m", "k": 2}
    out = str(tmp_path / "gen.jsonl")
    good = {"out": out, "plan": plan, "sessions": [{"index": 0}]}
    cases = [
        ([good], r"not a lean_gen manifest \(the top level is a list, not an object\)"),
        ({k: v for k, v in good.items() if k != "sessions"}, r"'sessions' is None, not a list of session objects"),
        ({**good, "sessions": {"0": {}}}, r"'sessions' is \{'0': \{\}\}, not a list"),
        ({**good, "sessions": [3]}, r"'sessions' is \[3\], not a list"),
        ({**good, "plan": [1]}, r"'plan' is \[1\], not an object"),
        (b'{"plan": "\xff"}', r"not a lean_gen manifest \('utf-8' codec can't decode"),
        (b'{"plan": ', r"not a lean_gen manifest \(Expecting value"),
    ]
    path = tmp_path / "gen.jsonl.manifest.json"
    for data, match in cases:
        path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
        with pytest.raises(
            ValueError, match=rf"gen\.jsonl\.manifest\.json: .*{match}.*restore the file, or use a new --out"
        ):
            lean_records.Manifest.open(out, plan)
    path.write_text(json.dumps(good))  # negative control
    assert lean_records.Manifest.open(out, plan).sessions == [{"index": 0}]


def test_config_that_does_not_match_the_weights_is_refused_before_building(tmp_path, char_model, monkeypatch):
    """num_hidden_layers 10**6 over a 1-layer file built meta layers for minutes; negative sizes were a torch
    traceback. Both are a ValueError naming the key, before any layer is built."""
    from align import model as M

    built: list[int] = []
    real_init = M.Transformer.__init__
    monkeypatch.setattr(M.Transformer, "__init__", lambda self, cfg: built.append(1) or real_init(self, cfg))
    hf = json.loads((Path(char_model) / "config.json").read_text())
    for i, (edit, match) in enumerate(
        (
            ({"num_hidden_layers": 3}, r"config.json says num_hidden_layers 3.*the weights hold 1 layers"),
            ({"num_hidden_layers": 10**6}, r"config.json says num_hidden_layers 1000000.*the weights hold 1 layers"),
            ({"vocab_size": hf["vocab_size"] + 1}, r"the weights hold 1 layers, embed_tokens \["),
            ({"hidden_size": -8}, r"config.json hidden_size is -8: it must be a positive integer"),
            ({"num_key_value_heads": -2}, r"config.json num_key_value_heads is -2: it must be a positive integer"),
            ({"intermediate_size": "64"}, r"config.json intermediate_size is '64'"),
        )
    ):
        d = tmp_path / f"m{i}"
        shutil.copytree(char_model, d)
        d.chmod(0o755)
        (d / "config.json").chmod(0o644)
        (d / "config.json").write_text(json.dumps({**hf, **edit}))
        with pytest.raises(ValueError, match=match):
            M.load_pretrained(d)
        assert built == [], f"{edit}: a model was built before the check"
    assert M.load_pretrained(char_model).config.num_hidden_layers == 1 and built == [1]  # negative control


def test_builtin_max_tokens_that_cannot_fit_is_refused_before_the_warm_start(tmp_path, char_model, monkeypatch):
    """--max-tokens 100000 on the built-in task was refused only after the 800-step warm start (or the model load)."""
    from align.tasks import reverse

    no_model_load(monkeypatch)
    monkeypatch.setattr(reverse, "warm_start", lambda *a, **k: pytest.fail("the warm start ran before the check"))
    for model in (None, char_model):  # warm-started here, or an existing built-in model
        with pytest.raises(ValueError, match=r"--max-tokens 100000: the built-in task's prompts .* at most \d+"):
            train(cfg_for(tmp_path / f"out{model is None}", model=model, max_tokens=100000))
    context = reverse.model_config(reverse.tokenizer()).max_position_embeddings
    longest = max(len(reverse.tokenizer().encode(p["prompt"])) for p in reverse.prompts(5000, "train"))
    reverse.check_sizes(reverse.prompts(5000, "train"), reverse.tokenizer(), context - longest)  # negative control


def test_step_too_large_to_sample_is_refused_by_the_flags(capsys):
    """--group-size 3000000 (or a huge --prompts-per-step x --group-size) passed every check and failed after the
    model loaded, as a multi-GB allocation in the sampler: now the flag parser refuses it from the sizes alone."""
    from align.run.config import MAX_STEP_TOKENS

    for argv, flag in (
        (["--group-size", "3000000"], "--group-size 3000000"),
        (["--prompts-per-step", "100000", "--group-size", "3000"], "--prompts-per-step 100000"),
    ):
        with pytest.raises(SystemExit) as e:
            parse(TrainConfig, argv, CLI_PREFIXES)
        err = capsys.readouterr().err
        assert e.value.code == 2 and re.search(rf"{flag} is invalid: .* over the cap .* lower --group-size", err), err
    # negative controls: the largest step under the cap, and a DAPO-sized step (512 prompts x 16 x 20k tokens)
    assert TrainConfig(prompts_per_step=2**8, group_size=2**10, max_tokens=2**10).group_size == 2**10
    assert 2**8 * 2**10 * 2**10 == MAX_STEP_TOKENS
    TrainConfig(prompts_per_step=512, group_size=16, max_tokens=20480)
    with pytest.raises(ValueError, match="--group-size 1025 is invalid"):
        TrainConfig(prompts_per_step=2**8, group_size=2**10 + 1, max_tokens=2**10)
