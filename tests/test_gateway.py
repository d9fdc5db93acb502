"""The gateway (align.gateway) driven by the real ``openai`` client against a real chat template (a BPE tokenizer
trained in the test with the stored Qwen2.5 template): the OpenAI schema streaming and not, tool calls, errors with
their status, and the token-exact capture compared with a plain turn loop (``TurnRenderer.first`` + sampled ids +
``TurnRenderer.suffix``), with negative controls (re-tokenizing the decoded history gives other ids; an edited
history makes a second branch).

The policy here is scripted (``Scripted``: it "samples" given texts as one token per character, a tokenization the
BPE never produces on its own): a random-weight model cannot be made to write a tool call, and the per-character ids
are what make re-tokenization visible. The real sampler is covered by tests/test_agent.py."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import urllib.error
import urllib.request

import pytest
from helpers_tokenizer import make_bpe_tokenizer

from align.chat import HFTokenizer, TurnRenderer
from align.gateway.agents import _Agents
from align.gateway.server import Gateway
from align.rollout.protocol import Completion

openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>'
MODEL = "policy"


class Scripted:
    """Samples the given texts in order, one token per character, then the stop token."""

    def __init__(self, tok: HFTokenizer, stop: int, texts: list[str]) -> None:
        self.tok, self.stop, self.texts, self.prompts = tok, stop, list(texts), []

    def __call__(self, prompt_ids: list[int], max_tokens: int, cap: object) -> Completion:
        self.prompts.append(list(prompt_ids))
        ids = [i for ch in self.texts.pop(0) for i in self.tok.encode(ch)] + [self.stop]
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        lps = [-0.01 * (k + 1) - len(self.prompts) for k in range(len(ids))]
        return Completion(0, 0, ids, lps, finish, list(lps), 7)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return HFTokenizer(make_bpe_tokenizer(tmp_path_factory.mktemp("tok"), template="qwen2.5"))


def _gateway(tok: HFTokenizer, texts: list[str], **kw) -> tuple[Gateway, Scripted, str]:
    stop = TurnRenderer(tok).stop_id()
    s = Scripted(tok, stop, texts)
    gw = Gateway(
        s,
        lambda tools: TurnRenderer(tok, tools=tools),
        lambda ids: tok.decode(ids),
        MODEL,
        max_tokens=kw.pop("max_tokens", 400),
        context=4096,
        **kw,
    )
    return gw, s, gw.open_episode()


def test_tool_loop_with_the_openai_client_is_token_exact(tok):
    gw, s, key = _gateway(tok, [CALL, "The answer is 42."])
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        msgs = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 12 + 30?"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], temperature=1.3, logprobs=True)
        ch = r.choices[0]
        assert [x.logprob for x in ch.logprobs.content] == [-0.01 * (k + 1) - 1 for k in range(len(CALL) + 1)]
        assert "".join(x.token for x in ch.logprobs.content) == CALL + "<|im_end|>"  # the sampled tokens, the stop too
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 12, "b": 30}
        msgs += [ch.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        stream = client.chat.completions.create(
            model=MODEL, messages=msgs, tools=[TOOL], stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "The answer is 42."
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == len("The answer is 42.") + 1
    finally:
        gw.close()
    cap = gw.close_episode(key)
    assert cap.requests == 2 and cap.overridden == 1 and len(cap.branches) == 1
    (b,) = cap.branches
    # the plain turn loop: first prompt, sampled ids, the tool message as a suffix, sampled ids
    r = TurnRenderer(tok, tools=[TOOL])
    first = r.first([{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 12 + 30?"}])
    s1 = [i for ch in CALL for i in tok.encode(ch)] + [r.stop_id()]
    suffix = r.suffix([{"role": "tool", "content": "42"}])
    s2 = [i for ch in "The answer is 42." for i in tok.encode(ch)] + [r.stop_id()]
    assert b.prompt_ids == first and b.token_ids == s1 + suffix + s2
    assert b.mask == [True] * len(s1) + [False] * len(suffix) + [True] * len(s2)
    assert b.logprobs[: len(s1)] == [-0.01 * (k + 1) - 1 for k in range(len(s1))]
    assert b.logprobs[len(s1) : len(s1) + len(suffix)] == [0.0] * len(suffix)
    assert s.prompts[1] == first + s1 + suffix  # what the sampler was given: the same ids
    # negative control: the history re-rendered from its text (the agent's messages through the template) is other ids
    rerendered = r.first(
        [
            {"role": "system", "content": "You add."},
            {"role": "user", "content": "What is 12 + 30?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "add", "arguments": {"a": 12, "b": 30}}}],
            },
            {"role": "tool", "content": "42"},
        ]
    )
    assert rerendered != s.prompts[1]
    assert tok.decode(rerendered, skip_special_tokens=False).endswith("assistant\n")  # a real prompt, not garbage


def test_edited_history_starts_a_new_branch_and_going_back_forks(tok):
    _branching(tok)


def _branching(tok: HFTokenizer) -> tuple:
    """An episode of four requests: a turn, its extension, an edited history (a new branch), a return to turn 1 (a fork)."""
    gw, s, key = _gateway(tok, ["one", "two", "three", "four"])
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        u = [{"role": "user", "content": "Hello"}]
        a1 = client.chat.completions.create(model=MODEL, messages=u).choices[0].message.content
        h = [*u, {"role": "assistant", "content": a1}, {"role": "user", "content": "more"}]
        client.chat.completions.create(model=MODEL, messages=h)
        edited = [{"role": "user", "content": "Hello (summary)"}, *h[1:]]
        client.chat.completions.create(model=MODEL, messages=edited)  # no turn matches: from scratch
        back = [*u, {"role": "assistant", "content": a1}, {"role": "user", "content": "other"}]
        client.chat.completions.create(model=MODEL, messages=back)  # extends turn 1, not the tip: a fork
    finally:
        gw.close()
    cap = gw.close_episode(key)
    assert [len(b.turns) for b in cap.branches] == [2, 1, 1]
    assert [(r["request"], r["branch"], r["parent"]) for r in cap.log] == [
        (0, 0, None),
        (1, 0, 0),
        (2, 1, None),
        (3, 2, 0),
    ]
    assert [r["new_messages"] for r in cap.log[1:]] == [h[2:], edited, back[2:]]
    assert [r["reply"]["content"] for r in cap.log] == ["one", "two", "three", "four"]
    assert cap.branches[1].parent is None and cap.branches[2].parent == 0
    r = TurnRenderer(tok)
    assert cap.branches[1].prompt_ids == r.first(edited)  # re-rendered, and counted
    assert cap.rerendered == len(r.first(u)) + len(r.first(edited))
    one = [i for ch in "one" for i in tok.encode(ch)] + [r.stop_id()]
    assert cap.branches[2].prompt_ids == r.first(u) + one + r.suffix([{"role": "user", "content": "other"}])
    assert sum(sum(b.mask) for b in cap.branches) == sum(len(x) + 1 for x in ("one", "two", "three", "four"))
    # control: the edited history rendered from text differs from the first branch's ids for the same turn
    assert cap.branches[1].prompt_ids != cap.branches[0].prompt_ids + cap.branches[0].token_ids[: len(s.prompts[1])]
    return cap, u, h, edited, back


def test_every_branch_of_an_episode_trains_with_its_advantage(tok):
    """The learner's rows for a branching episode == a plain loop over its three trajectories (ids, masks, sampled
    logprobs, the episode's advantage on each); control: the last request's trajectory alone (the episode without its
    branches) trains fewer tokens than were sampled."""
    import dataclasses
    import types

    import torch

    from align.learner import StepBatch, make_batch
    from align.rollout.groups import Episode, trajectories

    cap, u, h, edited, back = _branching(tok)
    done: cf.Future = cf.Future()
    done.set_result(1.0)
    ep = _Agents.episode(cap, done, True, 0, 0)
    r = TurnRenderer(tok)

    def sampled(text: str, request: int) -> tuple[list[int], list[float]]:  # Scripted's ids and logprobs
        ids = [i for ch in text for i in tok.encode(ch)] + [r.stop_id()]
        return ids, [-0.01 * (k + 1) - request for k in range(len(ids))]

    (one, lp1), (two, lp2), (three, lp3), (four, lp4) = (
        sampled(x, k + 1) for k, x in enumerate(("one", "two", "three", "four"))
    )
    more = r.suffix(h[2:])
    loop = [  # (prompt, tokens, mask, logprobs) of each trajectory, the last request's first
        (r.first(u) + one + r.suffix(back[2:]), four, [True] * len(four), lp4),
        (
            r.first(u),
            one + more + two,
            [True] * len(one) + [False] * len(more) + [True] * len(two),
            lp1 + [0.0] * len(more) + lp2,
        ),
        (r.first(edited), three, [True] * len(three), lp3),
    ]
    trajs = trajectories([ep])
    assert len(trajs) == 3 and all((t.prompt_index, t.sample_index) == (0, 0) for t in trajs)
    assert [t["trained"] for t in ep.turns] == [True] * 4
    cfg = types.SimpleNamespace(group_size=1, behaviour_logprobs="sampled")
    adv, valid = torch.tensor([[0.7]]), torch.tensor([[True]])
    batch = make_batch(StepBatch([[]], trajs, adv, valid), cfg, torch.device("cpu"))
    for row, (prompt, ids, mask, lps) in enumerate(loop):
        seq, n = prompt + ids, len(prompt + ids) - 1
        assert batch.inputs[row, :n].tolist() == seq[:-1] and batch.targets[row, :n].tolist() == seq[1:]
        want = [False] * (len(prompt) - 1) + mask
        assert batch.mask[row, :n].tolist() == want and not batch.mask[row, n:].any()
        assert batch.behav[row, :n].tolist() == pytest.approx([0.0] * (len(prompt) - 1) + lps)
    assert batch.advantages.tolist() == pytest.approx([0.7] * 3)
    assert int(batch.mask.sum()) == len(one + two + three + four)  # every sampled token once
    # control: the episode without its branches (the last request's trajectory only) leaves sampled tokens untrained
    alone = make_batch(StepBatch([[]], [dataclasses.replace(ep, branches=[])], adv, valid), cfg, torch.device("cpu"))
    assert int(alone.mask.sum()) == len(four) < int(batch.mask.sum())
    # an unscorable episode trains none of its trajectories
    assert not make_batch(StepBatch([[]], trajs, adv, ~valid), cfg, torch.device("cpu")).mask.any()
    # a checkpoint's pending batch (K >= 1) keeps the branches: plain dicts back to Episodes
    again = Episode(**dataclasses.asdict(ep))
    assert again.branches == ep.branches and isinstance(again.branches[0], Episode)
    m = _Agents.metrics([ep])
    assert m["agent/requests_mean"] == 4 and m["agent/branches_mean"] == 3
    assert m["agent/rerendered_tokens"] == len(r.first(edited))  # the edited history; the first prompt is none
    assert m["agent/branch_tokens"] == len(one + two + three)


def test_stop_and_max_tokens_shorten_a_turn(tok):
    gw, _, key = _gateway(tok, ["abc STOP def", "abcdefgh"])
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        u = [{"role": "user", "content": "Hi"}]
        r = client.chat.completions.create(model=MODEL, messages=u, stop=["STOP"])
        assert r.choices[0].message.content == "abc " and r.choices[0].finish_reason == "stop"
        h = [*u, {"role": "assistant", "content": "abc "}, {"role": "user", "content": "go"}]
        r2 = client.chat.completions.create(model=MODEL, messages=h, max_tokens=3)
        assert r2.choices[0].finish_reason == "length" and r2.usage.completion_tokens == 3
    finally:
        gw.close()
    cap = gw.close_episode(key)
    (b,) = cap.branches  # the cut turn matched as returned; the template's stop token closes it as context
    n1 = len("abc STOP")  # kept up to the token that completes the stop string
    stop = TurnRenderer(tok).stop_id()
    assert b.mask[:n1] == [True] * n1 and b.token_ids[n1] == stop and b.mask[n1] is False


def _post(url: str, data: bytes, key: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, data, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_errors_are_openai_error_objects(tok):
    gw, _, key = _gateway(tok, ["x"], max_body_mb=0.01)
    url = gw.base_url + "/chat/completions"
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gw.base_url, api_key="sk-wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
            )
        status, body = _post(url, b"{not json", key)
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = _post(url, b'{"model": "policy", "messages": "' + b"a" * 20000 + b'"}', key)
        assert status == 413 and body["error"]["type"] == "invalid_request_error"
        ok, _ = _post(url, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode(), key)
        assert ok == 200  # control: the same key and route work
        gw.close_episode(key)
        assert _post(url, b"{}", key)[0] == 401  # the key expired with its episode
        gw.closing = True
        assert _post(url, b"{}", key)[0] == 503
    finally:
        gw.close()


def test_a_streamed_tool_call_and_the_episode_token_budget(tok):
    suffix = TurnRenderer(tok, tools=[TOOL]).suffix([{"role": "tool", "content": "42"}])
    gw, _, key = _gateway(tok, [CALL, "x" * 50], episode_tokens=len(CALL) + 1 + len(suffix) + 10)
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": "What is 12 + 30?"}]
        chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], stream=True))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("add", {"a": 12, "b": 30})]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        msgs += [
            {
                "role": "assistant",
                "tool_calls": [{"id": calls[0].id, "type": "function", "function": calls[0].function.model_dump()}],
            },
            {"role": "tool", "tool_call_id": calls[0].id, "content": "42"},
        ]
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL])
        assert r.choices[0].finish_reason == "length"  # the episode's budget, not the turn's: the 10 tokens left
        assert r.usage.completion_tokens == 10
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
        with pytest.raises(openai.BadRequestError, match="max-episode-tokens"):  # nothing left: refused, not cut
            client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL])
    finally:
        gw.close()
    assert len(gw.close_episode(key).branches) == 1


def test_anthropic_messages_with_a_tool_use_round_trip_is_one_trajectory(tok):
    anthropic = pytest.importorskip("anthropic", reason="the test extra: pip install -e '.[test]'")
    gw, _, key = _gateway(tok, [CALL, "The answer is 42."])
    tool = {"name": "add", "description": "Add two numbers.", "input_schema": TOOL["function"]["parameters"]}
    try:
        client = anthropic.Anthropic(base_url=gw.base_url.removesuffix("/v1"), api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": [{"type": "text", "text": "What is 12 + 30?"}]}]
        r = client.messages.create(model=MODEL, max_tokens=200, system="You add.", messages=msgs, tools=[tool])
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
        use = r.content[0]
        assert use.name == "add" and use.input == {"a": 12, "b": 30}
        msgs += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
        ]
        with client.messages.stream(model=MODEL, max_tokens=200, system="You add.", messages=msgs, tools=[tool]) as st:
            final = st.get_final_message()
        assert final.content[0].text == "The answer is 42." and final.stop_reason == "end_turn"
        assert final.usage.output_tokens == len("The answer is 42.") + 1
        with pytest.raises(anthropic.NotFoundError):
            client.messages.create(model="claude-9", max_tokens=5, messages=msgs)
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=client.base_url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=5, messages=msgs
            )
    finally:
        gw.close()
    cap = gw.close_episode(key)
    (b,) = cap.branches  # the tool_use block sent back matched the reply as returned: one trajectory
    r = TurnRenderer(tok, tools=[TOOL])
    first = r.first([{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 12 + 30?"}])
    s1 = [i for ch in CALL for i in tok.encode(ch)] + [r.stop_id()]
    suffix = r.suffix([{"role": "tool", "content": "42"}])
    assert b.prompt_ids == first and b.token_ids[: len(s1) + len(suffix)] == s1 + suffix
    assert b.mask.count(False) == len(suffix)


def _raw(gw: Gateway, head: bytes, body: bytes = b"") -> bytes:
    """One request written on a socket, the body sent in full and the write side closed; the reply's status line."""
    host, port = gw.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(head + b"\r\n\r\n")
        try:
            s.sendall(body)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed without reading the body
            pass
        return s.recv(200).split(b"\r\n")[0]


def test_a_bad_content_length_or_text_is_a_400_not_a_read_past_the_cap(tok):
    gw, _, key = _gateway(tok, ["x"], max_body_mb=0.01)
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
    try:
        # "-1" read until the client closed: 12x the cap read before any key or size check
        assert _raw(gw, post + b"\r\nContent-Length: -1", b"x" * 120_000) == b"HTTP/1.1 400 Bad Request"
        assert _raw(gw, post + b"\r\nContent-Length: abc") == b"HTTP/1.1 400 Bad Request"  # was a 500
        assert _raw(gw, post + b"\r\nContent-Length: 120000") == b"HTTP/1.1 413 Request Entity Too Large"  # control
        lone = b'{"model": "policy", "messages": [{"role": "user", "content": "\\ud800"}]}'
        status, body = _post(gw.base_url + "/chat/completions", lone, key)
        assert status == 400 and "not valid Unicode" in body["error"]["message"]  # was a 500 from the tokenizer
        ok = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\u00e9"}]}).encode()
        assert _post(gw.base_url + "/chat/completions", ok, key)[0] == 200  # control: valid non-ASCII text
    finally:
        gw.close()


def test_a_request_without_a_key_is_refused_before_its_body_is_read(tok):
    gw, _, key = _gateway(tok, ["x"])
    host, port = gw.httpd.server_address[:2]
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nAuthorization: Bearer "
    try:
        for k, status in ((b"sk-wrong", b"401"), (key.encode(), None)):
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(head + k + b"\r\n\r\n")  # the body never comes
                try:
                    first = s.recv(100)
                except TimeoutError:  # waiting for the body (the server's read timeout is 60 s)
                    first = b""
            if status:  # was a wait for 100 kB an unauthenticated client never sends
                assert first.startswith(b"HTTP/1.1 " + status)
            else:  # control: with the key the server waits for the body
                assert first == b""
    finally:
        gw.close()


def test_a_response_arrives_whole_and_100_continue_is_not_held_back(tok):
    """A response leaves in one send: on a kept-alive connection the first read after each request holds its headers
    and its whole body (sent as two writes, the body waited for the client's delayed ACK, ~40 ms a request). The
    buffered writer still answers ``Expect: 100-continue`` before the body is sent (curl asks it for bodies > 1 kB)."""
    import re

    gw, _, key = _gateway(tok, ["hi"])
    host, port = gw.httpd.server_address[:2]
    try:
        with socket.create_connection((host, port), timeout=30) as s:
            for _ in range(5):
                s.sendall(_models(key))
                got = s.recv(65536)
                head, _, body = got.partition(b"\r\n\r\n")
                size = int(re.search(rb"Content-Length: (\d+)", head).group(1))
                assert head.startswith(b"HTTP/1.1 200") and len(body) == size, got
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}).encode()
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nAuthorization: Bearer "
                + key.encode()
                + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue")  # the body is not sent yet
            s.sendall(body)
            got = s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200") and b'"content": "hi"' in got, got
    finally:
        gw.close()


def _wait_until(cond, what: str, limit_s: float = 20.0) -> None:
    import time

    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"not within {limit_s} s: {what}"
        time.sleep(0.01)


def _models(key: str) -> bytes:
    return f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()


def test_connections_past_the_cap_get_a_503_and_a_freed_slot_serves_again(tok):
    gw, _, key = _gateway(tok, [], max_connections=2)
    addr = gw.httpd.server_address[:2]
    try:
        idle = [socket.create_connection(addr, timeout=10) for _ in range(2)]  # each holds a handler, sends nothing
        _wait_until(lambda: gw.httpd.active == 2, "both idle connections accepted")
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(_models(key))
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
            assert s.recv(100) == b""  # and closed
        idle.pop().close()
        _wait_until(lambda: gw.httpd.active == 1, "the closed connection's handler gone")
        with socket.create_connection(addr, timeout=10) as s:  # control: under the cap a request is served
            s.sendall(_models(key))
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        for s in idle:
            s.close()
    finally:
        gw.close()


def test_a_request_dripping_its_headers_or_body_is_cut_off_at_the_read_deadline(tok):
    """Slowloris: a byte every 0.1 s never trips a per-read timeout, but the whole request has read_timeout_s from its
    first byte; control: the same request dripped faster than the deadline is served."""
    import time

    limit = 2.0
    gw, _, key = _gateway(tok, [], read_timeout_s=limit)
    addr = gw.httpd.server_address[:2]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    post = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    def drip(data: bytes, whole: bytes, gap_s: float) -> tuple[bytes, float]:
        """``whole`` sent at once, then ``data`` a byte per ``gap_s`` until the server closes or answers."""
        with socket.create_connection(addr, timeout=limit + 20) as s:
            t0 = time.monotonic()
            s.sendall(whole)
            try:
                for b in data:
                    s.sendall(bytes([b]))
                    time.sleep(gap_s)
                    if time.monotonic() - t0 > limit + 20:
                        raise AssertionError("still reading past the deadline")
                return s.recv(4096), time.monotonic() - t0
            except (BrokenPipeError, ConnectionResetError):
                return b"", time.monotonic() - t0

    try:
        got, took = drip(_models(key)[1:], _models(key)[:1], 0.1)  # the headers dripped: ~90 bytes, ~9 s
        assert got == b"" and took >= limit
        got, took = drip(body, post, 0.1)  # the headers at once, the body dripped
        assert got == b"" and took >= limit
        got, _ = drip(_models(key)[1:], _models(key)[:1], 0.0)  # control: all within the deadline
        assert got.startswith(b"HTTP/1.1 200")
    finally:
        gw.close()


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("gateway_max_connections", 0, "--gateway-max-connections"), ("gateway_read_timeout_s", 0.0, "--gateway-read-")],
)
def test_bad_gateway_limits_are_refused_by_name(field, value, flag):
    from align.envs.config import EnvConfig

    EnvConfig(agent="a.py:run").check(64)  # control: the defaults pass
    with pytest.raises(ValueError, match=flag):
        EnvConfig(agent="a.py:run", **{field: value}).check(64)


def test_tool_choice_none_required_and_named_with_the_openai_client(tok):
    """``none``: the same prompt ids as ``auto``, the reply not parsed; ``required`` / a named function: the
    template's call opening written into the reply as masked context, the policy samples the rest, and the next
    request extends the same trajectory. Controls: ``auto`` parses the same text; the opening is not sampled."""
    rest = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    args = '{"a": 3, "b": 4}}\n</tool_call>'
    gw, s, key = _gateway(tok, [CALL, CALL, rest, "3", args])
    r = TurnRenderer(tok, tools=[TOOL])
    msgs = [{"role": "user", "content": "add"}]
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        none = client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], tool_choice="none")
        auto = client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], tool_choice="auto")
        assert none.choices[0].message.content == CALL and not none.choices[0].message.tool_calls
        assert none.choices[0].finish_reason == "stop" and auto.choices[0].finish_reason == "tool_calls"  # control
        assert s.prompts[0] == s.prompts[1] == r.first(msgs)  # the tools stay in the prompt
        req = client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], tool_choice="required")
        (call,) = req.choices[0].message.tool_calls
        assert req.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
        opening = r.encode_text("<tool_call>\n")
        assert s.prompts[2] == r.first(msgs) + opening  # written, not sampled
        h = [*msgs, req.choices[0].message.model_dump(exclude_none=True)]
        h.append({"role": "tool", "tool_call_id": call.id, "content": "3"})
        client.chat.completions.create(model=MODEL, messages=h, tools=[TOOL])  # extends the forced turn
        named = {"type": "function", "function": {"name": "add"}}
        n = client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], tool_choice=named)
        assert json.loads(n.choices[0].message.tool_calls[0].function.arguments) == {"a": 3, "b": 4}
        assert s.prompts[4] == r.first(msgs) + r.encode_text('<tool_call>\n{"name": "add", "arguments": ')
        for bad, why in (
            ({"type": "function", "function": {"name": "mul"}}, "not among the tools"),
            ("sometimes", "tool_choice must be"),
        ):
            with pytest.raises(openai.BadRequestError, match=why):
                client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], tool_choice=bad)
        with pytest.raises(openai.BadRequestError, match="needs tools"):
            client.chat.completions.create(model=MODEL, messages=msgs, tool_choice="required")
    finally:
        gw.close()
    cap = gw.close_episode(key)
    forced = next(b for b in cap.branches if b.prompt_ids == r.first(msgs) + opening)
    sampled = [i for ch in rest for i in tok.encode(ch)] + [r.stop_id()]
    assert forced.token_ids[: len(sampled)] == sampled and all(forced.mask[: len(sampled)])
    assert len(forced.turns) == 2  # the tool result extended the forced turn's trajectory


def test_tool_choice_required_is_refused_on_a_template_without_tool_call_blocks(tmp_path):
    llama = HFTokenizer(make_bpe_tokenizer(tmp_path, template="llama3", bos=True, eos_token="<|eot_id|>"))
    gw, _, key = _gateway(llama, ["x"])
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": "add"}]
        with pytest.raises(openai.BadRequestError, match="<tool_call>"):
            client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], tool_choice="required")
        client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL], tool_choice="none")  # control
    finally:
        gw.close()


def test_top_logprobs_come_from_the_backend_and_are_bounded(tok):
    seen: list = []

    def top(prompt_ids, token_ids, k):
        seen.append((list(prompt_ids), list(token_ids), k))
        return [[(t, -0.5), (t + 1, -1.5)][:k] for t in token_ids]

    gw, s, key = _gateway(tok, ["ab", "cd"], top=top)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        rsp = client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=2)
        content = rsp.choices[0].logprobs.content
        assert [[x.logprob for x in c.top_logprobs] for c in content] == [[-0.5, -1.5]] * 3
        assert [c.top_logprobs[0].token for c in content] == [c.token for c in content]
        assert seen == [(s.prompts[0], seen[0][1], 2)] and len(seen[0][1]) == 3
        for k, flags, why in ((21, {"logprobs": True}, "0 to 20"), (2, {}, "needs logprobs")):
            with pytest.raises(openai.BadRequestError, match=why):
                client.chat.completions.create(model=MODEL, messages=msgs, top_logprobs=k, **flags)
        zero = client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=0)
        assert all(c.top_logprobs == [] for c in zero.choices[0].logprobs.content) and len(seen) == 1  # control
    finally:
        gw.close()
    gw, _, key = _gateway(tok, ["ab"])  # a backend without them: refused by name
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="only the sampled token"):
            client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=1)
    finally:
        gw.close()


def test_anthropic_tool_choice_any_tool_and_none(tok):
    anthropic = pytest.importorskip("anthropic", reason="the test extra: pip install -e '.[test]'")
    rest = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    gw, s, key = _gateway(tok, [rest, '{"a": 5, "b": 6}}\n</tool_call>', CALL])
    tool = {"name": "add", "description": "Add two numbers.", "input_schema": TOOL["function"]["parameters"]}
    msgs = [{"role": "user", "content": "add"}]
    try:
        client = anthropic.Anthropic(base_url=gw.base_url.removesuffix("/v1"), api_key=key, max_retries=0)
        kw = {"model": MODEL, "max_tokens": 200, "messages": msgs, "tools": [tool]}
        anyone = client.messages.create(**kw, tool_choice={"type": "any"})
        assert anyone.stop_reason == "tool_use" and anyone.content[0].input == {"a": 1, "b": 2}
        named = client.messages.create(**kw, tool_choice={"type": "tool", "name": "add"})
        assert named.content[0].name == "add" and named.content[0].input == {"a": 5, "b": 6}
        none = client.messages.create(**kw, tool_choice={"type": "none"})
        assert none.stop_reason == "end_turn" and none.content[0].text == CALL  # not parsed
        with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
            client.messages.create(**kw, tool_choice={"type": "sometimes"})
    finally:
        gw.close()
    r = TurnRenderer(tok, tools=[TOOL])
    assert s.prompts[0] == r.first(msgs) + r.encode_text("<tool_call>\n") and s.prompts[2] == r.first(msgs)


def test_a_batch_goes_out_once_every_running_agent_has_a_request_in_it():
    """``--gateway-batch-ms``: with a 60 s window, three requests from the three running agents go out at once as
    one generate (not after the window); control: with a fourth agent running, the window runs out first."""
    import threading
    import time

    from align.gateway.agents import Batcher

    def generate(prompts, budgets, seed, draws):
        return [Completion(0, 0, [1] * k, [0.0] * k, "length", None, 0) for k in budgets]

    for running, window_ms in ((3, 60_000), (4, 500)):
        b = Batcher(generate, window_ms, lambda r=running: r)
        t0 = time.monotonic()
        threads = [threading.Thread(target=b, args=([1, 2], 2, 0)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        took = time.monotonic() - t0
        b.close()
        assert not any(t.is_alive() for t in threads), "a request still waits"
        if running == 3:
            assert took < 30 and b.batches == [3]  # one generate, long before the window
        else:
            assert took >= 0.5 and sum(b.batches) == 3


def test_a_training_step_and_an_eval_point_share_the_gateway_each_on_its_own_backend(tok):
    """An eval point on the eval fleet runs its agents (on the dispatcher's thread) while a training step runs its own
    on the same gateway: each request must go to its own episode's backend. Both calls' agents send a first
    request, wait until every agent of both calls has, then send a second: every reply an episode trained holds
    only its own backend's tokens (the gateway used to keep one sampler, the last call's, for every episode)."""
    import contextlib
    import threading
    import types

    from align.envs.config import EnvConfig
    from align.rollout.protocol import SamplingParams

    stop = TurnRenderer(tok).stop_id()
    both_started = threading.Barrier(4, timeout=30)

    class Backend:
        model = None  # a worker's client: its requests go out as they arrive

        def __init__(self, text: str) -> None:
            self.ids = [i for ch in text for i in tok.encode(ch)] + [stop]

        def generate(self, prompts: list, params: SamplingParams) -> list[Completion]:
            return [Completion(0, 0, list(self.ids), [-0.5] * len(self.ids), "stop", [-0.5] * len(self.ids), 0)]

    def agent(base_url: str, api_key: str, model: str, prompt: str) -> float:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        for turn in range(2):
            reply = client.chat.completions.create(model=model, messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
            if turn == 0:
                both_started.wait()
        return 0.0

    sampler = types.SimpleNamespace(
        renderer=types.SimpleNamespace(tok=tok), decode=tok.decode, cfg=types.SimpleNamespace(max_tokens=20),
        context=4096, autocast=contextlib.nullcontext,
    )  # fmt: skip
    agents = type("Agent", (_Agents,), {"fn": staticmethod(agent), "spec": None, "cfg": EnvConfig(), "state": {}})
    train, held_out = Backend("train"), Backend("eval")
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            calls = [
                pool.submit(agents.run_share, sampler, b, [{"prompt": "hi"}], 2, SamplingParams(max_tokens=20, seed=0))
                for b in (train, held_out)
            ]
            eps = [c.result(timeout=60) for c in calls]
    finally:
        agents.close()
    for backend, episodes in zip((train, held_out), eps):
        assert [e.error for e in episodes] == [None, None]
        for e in episodes:
            sampled = [t for t, m in zip(e.token_ids, e.mask) if m]
            assert sampled == backend.ids * 2, (tok.decode(sampled), tok.decode(backend.ids))


def test_a_batched_request_samples_the_same_tokens_whatever_shares_its_batch():
    """``--gateway-batch-ms`` is deterministic: a request's tokens depend on its seed and draw row
    (``batch_draw``: the step's seed, its episode, its request number), not on the batch it went out in. Five
    requests of different lengths and budgets on a real model: alone (five generates), all together, and in
    another order give the same tokens (logprobs within float summation order), each cut at its own budget;
    control: drawing by batch position (the old first-request seed) changes the tokens with the batch."""
    import torch
    from helpers_learner import tiny

    from align.gateway.agents import DRAWS, batch_draw, sample_rows
    from align.rollout.protocol import SamplingParams

    model = tiny(False, vocab=40).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (3, 7, 5, 2, 6)]
    budgets = [12, 4, 12, 9, 12]
    reqs = [batch_draw(7, i, r) for i, r in ((0, 0), (0, 1), (3, 0), (2, 1), (4, 9))]
    total = 5 * DRAWS

    def run(order, draws=None):
        out = {}
        for seed in dict.fromkeys(reqs[i][0] for i in order):  # one generate per seed, as the Batcher sends them
            part = [i for i in order if reqs[i][0] == seed]
            p = SamplingParams(max_tokens=max(budgets[i] for i in part), seed=seed)
            rows = [reqs[i][1] for i in part] if draws is None else [draws[i] for i in part]
            for i, c in zip(
                part, sample_rows(model, [prompts[i] for i in part], p, [budgets[i] for i in part], rows, total)
            ):
                out[i] = c
        return out

    alone = {i: run([i])[i] for i in range(5)}
    for other in (run([0, 1, 2, 3, 4]), run([4, 2, 0, 3, 1])):
        for i in range(5):
            assert other[i].token_ids == alone[i].token_ids
            assert max(abs(a - b) for a, b in zip(other[i].logprobs, alone[i].logprobs)) < 1e-5
    assert [len(alone[i].token_ids) for i in range(5)] == budgets  # no stop token given: each ends at its budget
    assert all(alone[i].finish_reason == "length" for i in range(5))
    assert reqs[4][0] != reqs[0][0]  # request 9 draws under the next seed block
    # control: rows by position in the batch (what a seed per batch gives) make a request's tokens its batch's
    together = run([0, 1, 2, 3, 4], draws=[0, 1, 2, 3, 0])
    shuffled = run([4, 2, 0, 3, 1], draws=[2, 4, 1, 3, 0])
    assert any(together[i].token_ids != shuffled[i].token_ids for i in range(4))
