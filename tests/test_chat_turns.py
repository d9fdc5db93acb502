"""align.chat.TurnRenderer: token-in/token-out turns. The ids accumulated turn by turn (first prompt + the policy's
sampled ids ending with its stop token + each environment suffix) equal the whole conversation rendered at once for
append-only templates (Qwen2.5, Llama-3.1), over 3-turn conversations with tool and user messages; Qwen's "\\n"
junction after <|im_end|> is on the environment's side (negative control: the usual diff-the-renders suffix misses
it and the comparator catches it); Qwen3 (drops earlier <think>) is reported.

Tokenizers: a byte-level BPE trained in the test (tests/helpers_tokenizer.py) whose added tokens are the Qwen and
Llama-3 specials, paired with each family's real template (tests/fixtures/chat_templates) and its stop token."""

from __future__ import annotations

import pytest
from helpers_tokenizer import make_bpe_tokenizer

from align.char_tokenizer import CharTokenizer
from align.chat import MARK, PREFIX, TurnRenderer
from align.data import HFTokenizer, InputError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
FIRST = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris?"},
]
EPISODE = [  # (the policy's message, the environment's reply or None: the episode ends with the policy)
    ({"role": "assistant", "content": "", "tool_calls": [CALL]}, [{"role": "tool", "content": '{"temp_c": 21}'}]),
    ({"role": "assistant", "content": "<think>\nhm\n</think>\n\nIt is 21 C."}, [{"role": "user", "content": "And tomorrow?"}]),
    ({"role": "assistant", "content": "The same, 21 C."}, None),
]  # fmt: skip
FAMILIES = {"qwen2.5": "<|im_end|>", "llama3.1": "<|eot_id|>", "qwen3": "<|im_end|>"}


@pytest.fixture(scope="module")
def renderers(tmp_path_factory):
    base = tmp_path_factory.mktemp("turns")
    out = {}
    for family, eos in FAMILIES.items():
        d = make_bpe_tokenizer(base / family, template=family, bos=family.startswith("llama"), eos_token=eos)
        out[family] = TurnRenderer(HFTokenizer(d), tools=[WEATHER])
    return out


def sampled(r: TurnRenderer, history: list[dict], message: dict) -> list[int]:
    """What a policy trained on this template samples for ``message``: the text the template puts between the
    generation prompt and the assistant's stop token, encoded, then the stop id (as the engine returns it)."""
    prompt = r.template.render(history, True, tools=r.tools)
    after = r.template.render([*history, message], False, tools=r.tools)
    assert after.startswith(prompt)
    stop_id = r.tok.eos_token_id[0]
    text = after[len(prompt) :].split(r.tok.decode([stop_id], skip_special_tokens=False))[0]
    return r.tok.encode(text, add_special_tokens=False) + [stop_id]


def play(r: TurnRenderer, suffix=None, end_with_env: bool = False) -> tuple[list[dict], list[int]]:
    """The episode turn by turn: (its messages in order, the accumulated ids)."""
    suffix = suffix or r.suffix
    messages, ids = list(FIRST), r.first(FIRST)
    for policy, reply in EPISODE:
        ids += sampled(r, messages, policy)
        messages.append(policy)
        if reply is None and end_with_env:
            reply = [{"role": "user", "content": "Thanks."}]
        if reply is not None:
            ids += suffix(reply)
            messages += reply
    return messages, ids


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.1"])
@pytest.mark.parametrize("end_with_env", [False, True])
def test_append_only_templates_accumulate_the_whole_conversation(renderers, family, end_with_env):
    r = renderers[family]
    messages, ids = play(r, end_with_env=end_with_env)
    whole = r.template.render(messages, end_with_env, tools=r.tools)
    if not end_with_env:  # the conversation ends at the policy's stop token (its junction belongs to a next turn)
        stop = r.tok.decode([r.tok.eos_token_id[0]], skip_special_tokens=False)
        whole = whole[: whole.rindex(stop) + len(stop)]
    assert ids == r.tok.encode(whole, add_special_tokens=False)
    assert r.check_append_only(messages, ids) is None
    bad = ids[:5] + [ids[6], ids[5]] + ids[7:]  # negative control: two tokens swapped are reported at token 5
    assert r.check_append_only(messages, bad).startswith(f"{r.name}: the turn-by-turn ids ({len(ids)}) differ")
    assert " at token 5: " in r.check_append_only(messages, bad)


def test_qwen_junction_is_on_the_environment_side(renderers):
    """Qwen's "\\n" after <|im_end|> is never sampled: it opens the suffix. The usual suffix, the text after
    render(history, add_generation_prompt=False), leaves it out, and the comparator catches it."""
    r = renderers["qwen2.5"]
    obs = [{"role": "user", "content": "And tomorrow?"}]
    assert r.suffix_text(obs) == "\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n"
    assert renderers["llama3.1"].suffix_text(obs).startswith("<|start_header_id|>user")  # no junction in Llama-3

    def naive(reply: list[dict]) -> list[int]:
        history = [*PREFIX, {"role": "assistant", "content": MARK}]
        text = r.template.render([*history, *reply], True, tools=r.tools)
        return r.tok.encode(text[len(r.template.render(history, False, tools=r.tools)) :], add_special_tokens=False)

    messages, ids = play(r, suffix=naive)
    report = r.check_append_only(messages, ids)
    assert report is not None and "'\\n" in report.split(" vs ")[1]  # the all-at-once side has the "\n" there


def test_qwen3_is_not_append_only_and_says_where(renderers):
    """Qwen3 drops the <think> of earlier turns when it renders a conversation at once: the suffix still works
    (the assistant's end is stable), and the comparator reports the first difference, naming the template."""
    r = renderers["qwen3"]
    messages, ids = play(r)
    report = r.check_append_only(messages, ids)
    assert report is not None and report.startswith(r.template.name)
    ours, whole = report.split(" vs ")  # the turn-by-turn side still holds the first turn's (empty) think block
    assert "think>" in ours.rsplit(": ", 1)[1] and "think>" not in whole


def test_tools_and_template_kwargs_reach_the_first_prompt(renderers):
    r = renderers["qwen3"]
    assert "get_weather" in r.tok.decode(r.first(FIRST))
    off = TurnRenderer(r.tok, template_kwargs={"enable_thinking": False})
    assert off.tok.decode(off.first(FIRST), skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert "get_weather" not in off.tok.decode(off.first(FIRST))  # control: no tools given, none rendered


def test_templates_whose_assistant_end_moves_are_refused(renderers):
    tok = renderers["qwen2.5"].tok
    drops = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.last %}<|im_end|>{% endif %}"
             "\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
    from align.chat import ChatTemplate

    tok.chat_template, keep = ChatTemplate(drops, name="T[drops-eos]"), tok.chat_template
    try:
        with pytest.raises(InputError, match=r"^T\[drops-eos\] is not append-only at the assistant's end"):
            TurnRenderer(tok).suffix([{"role": "user", "content": "x"}])
        tok.chat_template = ChatTemplate(drops.replace("<|im_end|>", "</s>"), name="T[no-stop]")
        with pytest.raises(InputError, match=r"^T\[no-stop\]: an assistant message does not end with one of"):
            TurnRenderer(tok).suffix([{"role": "user", "content": "x"}])
    finally:
        tok.chat_template = keep
    assert TurnRenderer(tok).suffix([{"role": "user", "content": "x"}])  # control: the real template works


def test_plain_strings_for_a_tokenizer_without_a_template():
    tok = CharTokenizer("abcd=")
    r = TurnRenderer(tok)
    assert r.first("ab=") == tok.encode("ab=") and r.first("ab=")[0] == tok.bos_token_id
    assert r.suffix("cd=") == tok.encode("cd=", add_bos=False)  # mid-sequence: no BOS
    with pytest.raises(InputError, match=r"chat messages need a chat template"):
        r.suffix([{"role": "user", "content": "ab"}])
