"""align.chat.ChatTemplate against transformers, byte for byte, on the real chat templates of 13 model families
(tests/fixtures/chat_templates, sources in its README.md): system messages, multi-turn, tools (a JSON schema, an
assistant tool_calls message, a tool message), documents, add_generation_prompt on and off, enable_thinking.
Also: named templates picked as transformers picks them, any template failure an InputError naming the template,
and decode's clean_up_tokenization_spaces as transformers 5 applies it (WordPiece yes, BPE no)."""

from __future__ import annotations

import json

import pytest
from helpers_tokenizer import chat_template, make_bpe_tokenizer

from align.data import ChatTemplate, HFTokenizer, InputError, to_record

LLAMA = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
CHATML = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
FAMILIES = {  # fixture -> (special tokens as tokenizer_config.json names them, renders tools=, extra template kwargs)
    "qwen2.5": (CHATML, True, [{}]),
    "qwen3": (CHATML, True, [{}, {"enable_thinking": False}, {"enable_thinking": True}]),
    "qwen2": (CHATML, False, [{}]),
    "llama3": (LLAMA, False, [{}]),
    "llama3.1": (LLAMA, True, [{}, {"date_string": "01 Jan 2025"}, {"tools_in_user_message": False}]),
    "mistral-v0.3": ({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, True, [{}]),
    "phi3": ({"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"}, False, [{}]),
    "gemma": ({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}, False, [{}]),
    "hermes2": ({"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "</s>"}, False, [{}]),
    "tinyllama": ({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, False, [{}]),
    "deepseek-r1-distill-qwen": (
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
        False,  # renders tool_calls and tool messages but not the tools= list
        [{}],
    ),
    "granite3": ({"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"}, True, [{}]),
    "command-r7b-tool_use": (
        {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>"},
        True,
        [{}, {"enable_citations": True}],
    ),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CHATS = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi there  "}],
    "multi": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nb"},
        {"role": "user", "content": "c"},
    ],
    "tools": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp_c": 21}'},
    ],
}
CHATS["tools_str"] = [{**m, "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": '{"city": "Paris"}'}}]}
                      if m.get("tool_calls") else m for m in CHATS["tools"]]  # fmt: skip  # OpenAI's JSON-string arguments
DOCS = [{"title": "Paris", "text": "Paris is the capital of France."}]


def reference(source: str, specials: dict, messages, gen: bool, tools=None, documents=None, **kwargs):
    """transformers' own render (what apply_chat_template calls once it has the template), or the exception."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        out, _ = render_jinja_template(conversations=[messages], tools=tools, documents=documents,
                                       chat_template=source, add_generation_prompt=gen, **{**specials, **kwargs})  # fmt: skip
        return out[0]
    except Exception as e:  # noqa: BLE001 - a template refusing the conversation: ours must refuse it too
        return e


def cases(family: str):
    _, tools_ok, kwargs_list = FAMILIES[family]
    for kwargs in kwargs_list:
        for chat in CHATS:
            for gen in (True, False):
                tools = [WEATHER] if chat.startswith("tools") and tools_ok else None
                yield chat, gen, tools, kwargs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_real_templates_render_byte_equal_to_transformers(family):
    source, (specials, tools_ok, _) = chat_template(family), FAMILIES[family]
    ours = ChatTemplate(source, specials, name=f"T[{family}]")
    rendered = 0
    for chat, gen, tools, kwargs in cases(family):
        messages = json.loads(json.dumps(CHATS[chat]))  # a fresh copy: a template must not see another's edits
        documents = DOCS if family.startswith("command-r") and chat.startswith("tools") else None
        want = reference(source, specials, messages, gen, tools, documents, **kwargs)
        if isinstance(want, Exception):
            with pytest.raises(InputError, match=rf"^T\[{family}\] failed on these messages"):
                ours.render(messages, gen, tools=tools, documents=documents, **kwargs)
            continue
        assert ours.render(messages, gen, tools=tools, documents=documents, **kwargs) == want, (chat, gen, kwargs)
        rendered += 1
    assert rendered >= 4  # the comparison is not vacuous: most cases render in both
    if tools_ok:  # negative control: tools= reaches the template (the tool's description is in the text)
        with_tools = ours.render(CHATS["user"], tools=[WEATHER])
        assert "The current weather in a city." in with_tools and with_tools != ours.render(CHATS["user"])


def test_enable_thinking_and_documents_reach_the_template():
    """User kwargs and documents= are template variables (negative controls: each changes the text)."""
    qwen3 = ChatTemplate(chat_template("qwen3"), CHATML)
    assert qwen3.render(CHATS["user"], enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert not qwen3.render(CHATS["user"]).endswith("</think>\n\n")
    cmdr = ChatTemplate(chat_template("command-r7b-tool_use"), FAMILIES["command-r7b-tool_use"][0])
    assert "Paris is the capital of France." in cmdr.render(CHATS["user"], tools=[WEATHER], documents=DOCS)
    assert "Paris is the capital" not in cmdr.render(CHATS["user"], tools=[WEATHER])
    with pytest.raises(InputError, match=r"documents= must be a list of JSON objects"):
        cmdr.render(CHATS["user"], documents=["not a dict"])
    with pytest.raises(InputError, match=r"tools= must be a list of JSON objects"):
        cmdr.render(CHATS["user"], tools=[len])


def test_openai_list_content_is_an_input_error_naming_template_and_row():
    """A TypeError inside the template (str + list) is an InputError naming the template; the loader adds the row."""
    qwen = ChatTemplate(chat_template("qwen2.5"), CHATML, name="T[qwen2.5]")
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(InputError, match=r"^T\[qwen2.5\] failed on these messages \(TypeError: "):
        qwen.render(parts)
    with pytest.raises(InputError, match=r"^data.jsonl:3: T\[qwen2.5\] failed on these messages \(TypeError"):
        to_record({"messages": parts}, "data.jsonl:3", "prompt", qwen)
    assert to_record({"messages": CHATS["user"]}, "data.jsonl:3", "prompt", qwen)["prompt"]  # control: a str renders


def _named_dir(tmp_path, layout: str):
    d = make_bpe_tokenizer(tmp_path / layout, template=None)
    default, tool_use = chat_template("qwen2.5"), chat_template("command-r7b-tool_use")
    if layout == "config_list":
        config = json.loads((d / "tokenizer_config.json").read_text())
        config["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    else:  # chat_template.jinja + additional_chat_templates/tool_use.jinja (transformers' saved layout)
        (d / "chat_template.jinja").write_text(default, encoding="utf-8")
        (d / "additional_chat_templates").mkdir()
        (d / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use, encoding="utf-8")
    return d


@pytest.mark.parametrize("layout", ["config_list", "jinja_files"])
def test_named_templates_are_picked_as_transformers_picks_them(tmp_path, layout):
    """tools= picks 'tool_use', no tools picks 'default' (before: always 'default'), from either layout."""
    import transformers

    d = _named_dir(tmp_path, layout)
    ours, ref = HFTokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))
    for tools in (None, [WEATHER]):
        want = ref.apply_chat_template(CHATS["user"], tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(CHATS["user"], tools=tools) == want
    assert "<|START_OF_TURN_TOKEN|>" in ours.render_chat(CHATS["user"], tools=[WEATHER])  # control: they differ
    assert "<|START_OF_TURN_TOKEN|>" not in ours.render_chat(CHATS["user"])


def test_several_templates_without_a_default_is_an_input_error(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "t", template=None)
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(chat_template("qwen2.5"), encoding="utf-8")
    tok = HFTokenizer(d)
    assert tok.render_chat(CHATS["user"], tools=[WEATHER])  # tool_use exists: tools= renders
    with pytest.raises(InputError, match=r"has several chat templates \['tool_use'\] and none named 'default'"):
        tok.render_chat(CHATS["user"])


def _wordpiece_dir(path, clean_up: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "hello", ",", "world", "!", "it", "'", "s", "n't", "do", "?", "."]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": clean_up,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("model", ["bpe", "wordpiece", "bpe_forced"])
def test_decode_cleans_up_spaces_as_transformers_does(tmp_path, model):
    """clean_up_tokenization_spaces=True: transformers 5 applies it to WordPiece and skips it for BPE (it deleted
    real spaces before punctuation in BPE text) unless the config forces it; ours follows."""
    import transformers

    if model == "wordpiece":
        d, text = _wordpiece_dir(tmp_path / "wp", clean_up=True), "hello , world ! it ' s"
    else:
        d, text = make_bpe_tokenizer(tmp_path / "bpe"), "Hello , world ! It 's 3 , 4 ."
        config = json.loads((d / "tokenizer_config.json").read_text())
        config["clean_up_tokenization_spaces"] = True
        if model == "bpe_forced":
            config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = HFTokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))
    ids = ref.encode(text, add_special_tokens=False)
    want = ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == want
    raw = ref.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert (want != raw) == (model != "bpe")  # negative control: the cleanup changes these texts where applied
