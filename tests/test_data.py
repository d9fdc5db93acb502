"""align.data against transformers: BPE encode/decode, chat templates (Qwen2.5, Qwen3, Llama-3) byte for byte,
stop tokens; and the data loaders' errors, each naming the file/line/flag."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers_models import make_tiny_qwen2, require_rollout_venv
from helpers_tokenizer import chat_template, make_bpe_tokenizer

from align.data import ChatPrompt, ChatTemplate, DataConfig, HFTokenizer, InputError, load_data, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "Hello, world!",
    "  two  spaces and a tab\t",
    "The answer is \\boxed{42}.",
    "héllo wörld ✓ 日本",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    "banana" * 20,
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi there  "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nok"},
        {"role": "user", "content": "again"},
    ],
]


def hf_tokenizer(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    return {
        "plain": make_bpe_tokenizer(base / "plain"),
        "bos": make_bpe_tokenizer(base / "bos", bos=True),
        "other": make_bpe_tokenizer(base / "other", vocab_size=320),
    }


@pytest.mark.parametrize("kind", ["plain", "bos"])
def test_encode_decode_match_transformers(tok_dirs, kind):
    ours, ref = HFTokenizer(tok_dirs[kind]), hf_tokenizer(tok_dirs[kind])
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
        assert ours.encode(text) == ref(text)["input_ids"]  # the default: as tokenizer(text)
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.vocab_size == len(ref)
    # negative control: another BPE (smaller vocabulary) splits the same text differently
    other = HFTokenizer(tok_dirs["other"])
    assert other.encode(TEXTS[2]) != ref.encode(TEXTS[2])
    # the BOS post-processor is what distinguishes the two configurations
    if kind == "bos":
        assert ours.encode("hi")[0] == ref.bos_token_id and ours.encode(ChatPrompt("hi"))[0] != ref.bos_token_id


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "llama3"])
def test_chat_template_is_byte_equal_to_apply_chat_template(tmp_path, name):
    d = make_bpe_tokenizer(
        tmp_path / name,
        template=name,
        bos=name == "llama3",
        eos_token="<|eot_id|>" if name == "llama3" else "<|im_end|>",
    )
    ours, ref = HFTokenizer(d), hf_tokenizer(d)
    for chat in CHATS:
        want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        got = ours.render_chat(chat)
        assert got == want, (name, chat)
        assert isinstance(got, ChatPrompt)
        want_ids = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert ours.encode(got) == want_ids  # no second BOS on a rendered chat
        assert ours.render_chat(chat, add_generation_prompt=False) == ref.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=False
        )
    if name == "qwen3":  # template kwargs reach the template, as in transformers
        kw = {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False}
        assert ours.render_chat(CHATS[0], enable_thinking=False) == ref.apply_chat_template(CHATS[0], **kw)
        assert "<think>\n\n</think>" in ours.render_chat(CHATS[0], enable_thinking=False)
    # negative controls: another model's template, or a changed message, renders differently
    other = "qwen3" if name != "qwen3" else "llama3"
    assert ChatTemplate(chat_template(other), {"bos_token": "<|begin_of_text|>"}).render(
        CHATS[0]
    ) != ref.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    changed = [dict(m) for m in CHATS[1]]
    changed[-1]["content"] += "!"
    assert ours.render_chat(changed) != ref.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)


def test_environment_matches_transformers_whitespace_and_filters(tmp_path):
    # A template whose output depends on trim_blocks / lstrip_blocks, loop controls and the tojson override.
    source = textwrap.dedent("""\
        {% for m in messages %}
            {% if m.role == 'skip' %}{% continue %}{% endif %}
          <{{ m.role }}>{{ m.content | tojson }}
        {% endfor %}
        {% if add_generation_prompt %}
        <assistant>
        {% endif %}""")
    chat = [{"role": "user", "content": "<b>&'\"é"}, {"role": "skip", "content": "x"}, {"role": "user", "content": "y"}]
    ref = hf_tokenizer(make_bpe_tokenizer(tmp_path / "t", template=None))
    want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, chat_template=source)
    assert ChatTemplate(source).render(chat) == want
    import jinja2
    import jinja2.ext

    plain = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).from_string(source)
    assert plain.render(messages=chat, add_generation_prompt=True) != want  # negative control


def test_template_sources_and_helpers(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "jinja_file", template="qwen2.5", template_in_config=False)
    assert HFTokenizer(d).render_chat(CHATS[0]) == hf_tokenizer(d).apply_chat_template(
        CHATS[0], tokenize=False, add_generation_prompt=True
    )
    t = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(InputError, match="no system role"):
        t.render(CHATS[0])
    t = ChatTemplate("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}")
    assert t.render([{"role": "user", "content": "<é>"}]) == '[{"role": "user", "content": "<é>"}]|4'
    none = make_bpe_tokenizer(tmp_path / "none", template=None)
    with pytest.raises(InputError, match="no chat template"):
        HFTokenizer(none).render_chat(CHATS[0])


def test_stop_tokens_from_generation_config_and_tokenizer_config(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "t", generation_eos=[6, 0])
    tok = load_tokenizer(d)
    assert tok.eos_token_id == [6, 0, tok.token_to_id("<|im_end|>")]
    model = tmp_path / "m"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert load_tokenizer(d, model_dir=model).eos_token_id == [4, 6, 0, tok.token_to_id("<|im_end|>")]


# ------------------------------------------------------------------------------------------------ loaders


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = make_tiny_qwen2(tmp_path_factory.mktemp("m") / "m", max_position_embeddings=64)
    make_bpe_tokenizer(d)
    return d


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_rows_prompts_chats_and_fields(tmp_path, model_dir):
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": "4"},
            "",
            {"messages": [{"role": "user", "content": "Hi"}], "answer": "hello", "meta": {"k": [1]}},
        ],
    )
    _, train, evals = load_data(DataConfig(train_data=data, eval_data=data), str(model_dir), max_tokens=8)
    assert train == evals and len(train) == 2
    assert train[0] == {"prompt": "What is 2+2?", "answer": "4"} and not isinstance(train[0]["prompt"], ChatPrompt)
    assert isinstance(train[1]["prompt"], ChatPrompt) and train[1]["prompt"].endswith("<|im_start|>assistant\n")
    assert train[1]["answer"] == "hello" and train[1]["meta"] == {"k": [1]} and "messages" not in train[1]
    renamed = write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?", "id": 3}])
    _, rows, _ = load_data(DataConfig(train_data=renamed, prompt_key="question"), str(model_dir), 8)
    assert rows == [{"prompt": "Why?", "id": 3}]
    chat_key = write_jsonl(tmp_path / "c.jsonl", [{"conv": [{"role": "user", "content": "x"}]}])
    _, rows, _ = load_data(DataConfig(train_data=chat_key, prompt_key="conv"), str(model_dir), 8)
    assert isinstance(rows[0]["prompt"], ChatPrompt)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"prompt": "ok"}, "{not json"], r"d.jsonl:2: not valid JSON"),
        (["[1, 2]"], r"d.jsonl:1: a JSONL row must be a JSON object"),
        ([{"prompt": "ok"}, {"question": "x"}], r"d.jsonl:2: the row has no 'prompt' \(or 'messages'\).*--prompt-key"),
        ([{"prompt": 3}], r"d.jsonl:1: 'prompt' must be a string or a list"),
        ([{"messages": []}], r"d.jsonl:1: a chat prompt must be a non-empty list"),
        ([{"prompt": "x", "completion": "y"}], r"clash with the reward's"),
        ([{"prompt": "word " * 60}], r"d.jsonl:1: the prompt is \d+ tokens; with --max-tokens 8 it does not fit"),
        ([], r"has no rows"),
    ],
)
def test_bad_data_is_named_with_file_and_line(tmp_path, model_dir, rows, match):
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(InputError, match=match):
        load_data(DataConfig(train_data=data), str(model_dir), max_tokens=8)


def test_bad_paths_and_tokenizers(tmp_path, model_dir):
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(InputError, match="--train-data .*nope.jsonl: no such file"):
        load_data(DataConfig(train_data=str(tmp_path / "nope.jsonl")), str(model_dir), 8)
    with pytest.raises(InputError, match="--eval-data .*nope.jsonl: no such file"):
        load_data(DataConfig(train_data=ok, eval_data=str(tmp_path / "nope.jsonl")), str(model_dir), 8)
    empty = tmp_path / "empty_tok"
    empty.mkdir()
    with pytest.raises(InputError, match="--tokenizer .*empty_tok: no tokenizer.json"):
        load_data(DataConfig(train_data=ok, tokenizer=str(empty)), str(model_dir), 8)
    no_template = make_bpe_tokenizer(tmp_path / "nt", template=None)
    with pytest.raises(InputError, match="ok.jsonl:1: a chat prompt .* needs a chat template"):
        load_data(DataConfig(train_data=ok, tokenizer=str(no_template)), str(model_dir), 8)
    small = tmp_path / "small_vocab"  # a config-only model dir: the loaders read config.json, never the weights
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"vocab_size": 100, "max_position_embeddings": 64}))
    text = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "banana answer capital"}])
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        load_data(DataConfig(train_data=text, tokenizer=str(model_dir)), str(small), 8)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, model_dir):
    pytest.importorskip("torch")  # always there; the point is the next line: pyarrow is absent in the core venv
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.fail("pyarrow is installed in the core venv; this test checks the message when it is absent")
    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(InputError, match=r"needs the optional package 'pyarrow': pip install 'align\[parquet\]'"):
        load_data(DataConfig(train_data=str(p)), str(model_dir), 8)


def test_parquet_rows_in_a_venv_with_pyarrow(tmp_path):
    venv = require_rollout_venv()  # the rollout venv has pyarrow; align.data itself is stdlib-only to import
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        import pyarrow as pa, pyarrow.parquet as pq
        from align.data import read_rows, to_record
        pq.write_table(pa.table({{"question": ["a?", "b?"], "answer": [1, 2]}}), {str(tmp_path / "d.parquet")!r})
        rows = read_rows({str(tmp_path / "d.parquet")!r})
        print(json.dumps([to_record(r, w, "question", None) for w, r in rows]))
    """)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [{"prompt": "a?", "answer": 1}, {"prompt": "b?", "answer": 2}]


def test_parquet_rows_are_streamed_a_batch_at_a_time(tmp_path):
    """The first row of a 5000-row file arrives after one batch was decoded (pq.read_table held the whole file as
    Python objects); every row still arrives, in order, named by its row number."""
    venv = require_rollout_venv()
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        import pyarrow as pa, pyarrow.parquet as pq
        from align import data
        path = {str(tmp_path / "big.parquet")!r}
        pq.write_table(pa.table({{"prompt": [f"q{{i}}" for i in range(5000)]}}), path, row_group_size=500)
        decoded = []
        stock = pq.ParquetFile.iter_batches

        def counted(self, *a, **k):
            for b in stock(self, *a, **k):
                decoded.append(b.num_rows)
                yield b

        pq.ParquetFile.iter_batches = counted
        it = data.iter_rows(path)
        first = next(it)
        after_first = sum(decoded)
        rest = list(it)
        print(json.dumps([first[0], after_first, len(rest) + 1, rest[-1][1]["prompt"]]))
    """)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    where, after_first, n, last = json.loads(out.stdout.splitlines()[-1])
    assert where.endswith("big.parquet:row 0") and n == 5000 and last == "q4999"
    assert after_first <= 1024  # one batch of PARQUET_BATCH_ROWS, not the file


def test_missing_hf_extra_names_it(tmp_path, monkeypatch):
    d = make_bpe_tokenizer(tmp_path / "t")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import raises ImportError, as when not installed
    with pytest.raises(InputError, match=r"needs the optional package 'tokenizers': pip install 'align\[hf\]'"):
        HFTokenizer(d)
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(InputError, match=r"needs the optional package 'jinja2': pip install 'align\[hf\]'"):
        ChatTemplate("{{ messages }}")


# ------------------------------------------------------------------------------------------------ bounded work


def test_a_line_longer_than_the_cap_is_refused_while_reading(tmp_path, monkeypatch):
    """A 2 GB file without newlines was read as one line; now at most MAX_LINE_BYTES + 1 bytes of a line are read."""
    import align.data as D

    row = json.dumps({"prompt": "x" * 200})
    monkeypatch.setattr(D, "MAX_LINE_BYTES", len(row), raising=False)
    ok = tmp_path / "ok.jsonl"
    ok.write_text(row + "\n" + row)  # negative control: rows exactly at the cap, with or without the newline
    assert len(D.read_rows(ok)) == 2
    long = tmp_path / "long.jsonl"
    long.write_text(row + "\n" + row[:-1] + ' "}')  # line 2 is one byte over and has no newline
    read: list[int] = []
    real_open = open

    class Counted:  # the reader's reads: bounded by the cap, never the whole line
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.fh.close()

        def readline(self, size=-1):
            read.append(size)
            return self.fh.readline(size)

        def __iter__(self):  # the old reader iterated the file: whole lines
            return (read.append(-1) or line for line in self.fh)

    monkeypatch.setattr(D, "open", lambda *a, **k: Counted(real_open(*a, **k)), raising=False)
    with pytest.raises(InputError, match=rf"long.jsonl:2: the line is longer than {len(row)} bytes"):
        D.read_rows(long)
    assert read and all(0 < n <= len(row) + 1 for n in read), read


def test_a_prompt_too_many_bytes_for_the_context_is_refused_without_tokenizing(tmp_path, model_dir, monkeypatch):
    """A 100 MB prompt was tokenized in full (~300 bytes of RAM per byte) before the length check."""
    tok = HFTokenizer(model_dir)
    bound = 64 * tok.max_token_bytes  # the model's context is 64 tokens
    encoded: list[int] = []
    real = HFTokenizer.encode
    monkeypatch.setattr(HFTokenizer, "encode", lambda self, text, *a: encoded.append(len(text)) or real(self, text, *a))
    big = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "é" * (bound // 2 + 1)}])  # 2 bytes a char: 1 over
    with pytest.raises(InputError, match=rf"big.jsonl:1: the prompt is {bound + 2} bytes; .* context of 64 tokens"):
        load_data(DataConfig(train_data=big), str(model_dir), max_tokens=8)
    assert encoded == [], "the over-long prompt was tokenized"
    fits = write_jsonl(tmp_path / "fits.jsonl", [{"prompt": "é" * (bound // 2)}])  # negative control: at the bound
    with pytest.raises(InputError, match=r"fits.jsonl:1: the prompt is \d+ tokens; with --max-tokens 8"):
        load_data(DataConfig(train_data=fits), str(model_dir), max_tokens=8)  # tokenized, then too many tokens
    assert encoded == [bound // 2]


def test_each_row_is_tokenized_once_and_the_ids_reach_the_trainer(tmp_path, model_dir, monkeypatch):
    """load_data tokenized every prompt to check it and the trainer tokenized it again."""
    from helpers_train import cfg_for

    from align.run.task import resolve_task

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"What is {i}+{i}?"} for i in range(5)])
    calls: list[str] = []
    real = HFTokenizer.encode
    monkeypatch.setattr(HFTokenizer, "encode", lambda self, text, *a: calls.append(text) or real(self, text, *a))
    cfg = cfg_for(tmp_path / "run", model=str(model_dir))
    cfg.data.train_data, cfg.data.eval_data, cfg.max_tokens = data, data, 8
    cfg.rewards.reward = ["align.rewards:exact_match"]
    task, _ = resolve_task(cfg)
    assert len(calls) == 10  # each train row and each eval row once
    ids, eval_ids = task.encoded
    tok = HFTokenizer(model_dir)
    assert ids == eval_ids == [real(tok, r["prompt"]) for r in task.prompts]
    assert ids[0] != ids[1]  # negative control: the ids are the rows', in order


def test_a_chat_template_render_is_bounded_in_time_and_size(monkeypatch):
    """Nested range(99999) loops hung data loading and {{ 'x' * 10**10 }} allocated 10 GB: both end in an
    InputError naming the template (bounds patched small here: nothing big is built)."""
    import align.chat as D

    monkeypatch.setattr(D, "RENDER_MAX_SECONDS", 0.5, raising=False)
    monkeypatch.setattr(D, "RENDER_MAX_CHARS", 1000, raising=False)
    msgs = [{"role": "user", "content": "hi"}]
    loops = D.ChatTemplate("{% for i in range(999) %}{% for j in range(999) %}{% for k in range(999) %}"
                           "{% endfor %}{% endfor %}{% endfor %}", name="T1")  # fmt: skip
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=_catch(lambda: loops.render(msgs))), daemon=True)
    t.start()
    t.join(10.0)
    assert not t.is_alive(), "the nested loops were not stopped"
    assert isinstance(result["out"], InputError) and re.match(
        r"T1: the render was stopped: it ran past", str(result["out"])
    )
    for i, source in enumerate(["{{ 'x' * 1001 }}", "{{ 'x' | center(1001) }}", "{{ 'x'.ljust(1001) }}",
                                "{% for i in range(300) %}{{ 'abcd' }}{% endfor %}"]):  # fmt: skip
        with pytest.raises(InputError, match=rf"T{i}: the render was stopped"):
            D.ChatTemplate(source, name=f"T{i}").render(msgs)
    # negative controls: at the bounds, and a real template's loops, render as before
    assert D.ChatTemplate("{{ 'x' * 1000 }}").render(msgs) == "x" * 1000
    assert (
        D.ChatTemplate("{% for i in range(3) | reverse %}{{ i }}{% endfor %}{{ range(4) | length }}").render(msgs)
        == "2104"
    )


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported by the assertion that reads it
        return e
