"""An OpenAI-compatible gateway over the policy's sampler (stdlib ``http.server``; no web framework), so an agent
program written against a provider's client trains unchanged.

Endpoints: ``POST /v1/chat/completions`` (messages with string or list content, ``tools``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``n=1``, ``tool_choice`` (``tool_choice()``), ``logprobs`` / ``top_logprobs``
(``top``), ``stream`` as server-sent events ending with a usage chunk) and
``GET /v1/models``. Replies follow OpenAI's schema: ``tool_calls`` parsed from the sampled text in the template
family's format (``align.envs.tools.parse_tool_calls``: Hermes / Qwen ``<tool_call>`` blocks, Llama-3.1 JSON),
``finish_reason`` (``stop``, ``length``, ``tool_calls``) and ``usage``. Errors are OpenAI error objects: 400 a
malformed body, 401 an unknown key, 404 an unknown model or path, 413 a body over the cap, 503 while closing.

Sampling stays the policy's: a request's ``temperature`` / ``top_p`` are not applied (counted per episode, said once
in the log); its ``max_tokens`` and ``stop`` only shorten a turn. A stop string cuts the turn after the token that
completes it (the returned text ends before it); the ids kept are the sampled ones.

Security: binds 127.0.0.1 on a free port; each episode gets a random key (``secrets``) that expires with it and is
never logged; bodies are capped; nothing received is run. Slow clients (slowloris): at most ``max_connections``
connections are served at once (one more is answered 503 and closed by the accepting thread, which reads nothing
from it), and a request's headers and body must arrive within ``read_timeout_s`` of its first byte, however slowly
they drip (else the connection is closed unanswered); a kept-alive connection waits ``IDLE_TIMEOUT_S`` for its next
request.
"""

from __future__ import annotations

import io
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from align.errors import InputError
from align.gateway import messages
from align.gateway.capture import Capture, template_messages, text_of

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 60.0  # a kept-alive connection's wait for its next request's first byte; each write's too
BUSY = "the gateway serves {} connections at once (--gateway-max-connections); retry when one closes"


def send_json(handler: BaseHTTPRequestHandler, status: int, body: dict) -> None:
    """Answer ``handler``'s request: ``status`` and ``body`` as JSON, its length set (tests' stand-in servers too)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


def reply_message(text: str, parse: bool = True) -> tuple[dict, list[dict]]:
    """(the OpenAI assistant message for the sampled ``text``, its readable tool calls as template messages' calls);
    ``parse`` False (``tool_choice: "none"``): the text as it is, no tool calls."""
    from align.envs.tools import parse_tool_calls

    calls = [c for c in parse_tool_calls(text) if "error" not in c] if parse else []
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        before = text.split("<tool_call>")[0].strip() if "<tool_call>" in text else ""
        msg["content"] = before or None
        msg["tool_calls"] = [
            {
                "id": "call_" + secrets.token_hex(8),
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for c in calls
        ]
    return msg, calls


MAX_TOP_LOGPROBS = 20  # OpenAI's cap
MAX_RENDERERS = 64  # distinct tool sets whose renderers are kept
PROBE = "ALIGN_TOOL_PROBE"  # a function name no template edits, to find how the template opens a call


def tool_choice(body: dict, tools: list | None, renderer: Any) -> tuple[bool, str]:
    """(parse the reply for tool calls, the text the gateway writes at the start of the reply) for the request's
    ``tool_choice``. ``auto`` (the default): as sampled. ``none``: the tools stay in the prompt (the same ids as
    ``auto``, as vLLM renders it) and the reply is not parsed. ``required`` / ``{"type": "function", "function":
    {"name": N}}``: the opening of a call in the template's own format (``<tool_call>\n`` / ``<tool_call>\n{"name":
    "N", "arguments": ``) is written into the reply as context (masked, never trained) and the policy samples the
    rest, so the logprobs stay the policy's; a template that does not write calls as ``<tool_call>`` blocks cannot be
    forced this way and the request is refused. (Sampling is never constrained: a call the policy then writes badly
    comes back as text.)"""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return True, ""
    if not tools:
        raise ApiError(400, f"tool_choice {choice!r} needs tools: give the request's tools, or drop tool_choice")
    if choice == "none":
        return False, ""
    if choice == "required":
        name = None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        names = [t.get("function", t).get("name") for t in tools if isinstance(t, dict)]
        if name not in names:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools {names}")
    else:
        raise ApiError(
            400, f'tool_choice must be "auto", "none", "required" or {{"type": "function", ...}}, got {choice!r}'
        )
    probe = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": PROBE, "arguments": {}}}],
    }
    try:
        text = renderer.template.render([{"role": "user", "content": "x"}, probe], False, tools=tools)
    except Exception:  # noqa: BLE001 -- no template, or one that cannot render a call: refused below
        text = ""
    name_at = text.find(f'"{PROBE}"')
    at = text.rfind("<tool_call>", 0, max(name_at, 0))  # the call's own (a system prompt may show the format too)
    if at < 0 or name_at < at or text.find("{}", name_at) < 0:
        raise ApiError(
            400,
            f"tool_choice {choice!r}: {getattr(renderer, 'name', 'the template')} does not write tool calls as "
            "<tool_call> blocks, so the gateway cannot open a call for the policy to complete (it never constrains "
            'sampling): use tool_choice "auto" and check the reply',
        )
    if name is None:
        return True, text[at : text.index("{", at)]
    return True, text[at:name_at] + json.dumps(name) + text[name_at + len(PROBE) + 2 : text.find("{}", name_at)]


def cut_at_stop(ids: list[int], decode: Callable[[list[int]], str], stops: list[str]) -> tuple[int, str] | None:
    """(how many ids to keep, the text before the stop) at the first stop string the ids' text reaches, else None."""
    if not stops:
        return None
    full = decode(ids)
    hits = [p for s in stops if (p := full.find(s)) >= 0]
    if not hits:
        return None
    at = min(hits)
    for k in range(1, len(ids) + 1):  # the first token whose text reaches past the stop's start + its length
        t = decode(ids[:k])
        if any(t.find(s) == at for s in stops if t.find(s) >= 0):
            return k, full[:at]
    return len(ids), full[:at]


class _DeadlineReader(io.RawIOBase):
    """A connection's socket as the raw stream under the handler's ``rfile``: the first byte of a request arms a
    deadline ``limit_s`` ahead and every later read of that request waits only for what is left of it (a client
    dripping a byte a second is cut off at the deadline, not served forever); ``done()`` once the request is read."""

    def __init__(self, sock: socket.socket, limit_s: float) -> None:
        self.sock, self.limit_s, self.deadline = sock, limit_s, None

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.deadline is None:  # between requests: wait for the next one's first byte
            n = self.sock.recv_into(b)
            self.deadline = time.monotonic() + self.limit_s
            return n
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {self.limit_s} s")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)

    def done(self) -> None:
        self.deadline = None
        self.sock.settimeout(IDLE_TIMEOUT_S)


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once."""

    max_connections = 512
    request_queue_size = 256  # the listen backlog (socketserver's 5 resets connections when many agents start at once)

    def server_bind(self) -> None:
        self.active, self.count_lock = 0, threading.Lock()
        super().server_bind()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.count_lock:
            full = self.active >= self.max_connections
            self.active += not full
        if not full:
            try:
                return super().process_request(request, client_address)
            except BaseException:  # no thread started: nothing will count it down
                with self.count_lock:
                    self.active -= 1
                raise
        err = {"message": BUSY.format(self.max_connections), "type": "server_error", "param": None}
        data = json.dumps({"error": {**err, "code": "too_many_connections"}}).encode()
        head = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        try:
            request.settimeout(1.0)  # the accepting thread never waits long on one client
            request.sendall(f"{head}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.count_lock:
                self.active -= 1


class _Server6(_Server):
    address_family = socket.AF_INET6


class Gateway:
    """The gateway's state: episodes by key, the sampler. ``sample(prompt_ids, max_tokens, capture) -> Completion``
    (the run's sampling params; an episode's capture may carry its own ``sample`` / ``top``, which win: a training
    step's agents and an eval point's run side by side on one gateway, each on its own backend);
    ``renderer(tools) -> TurnRenderer``; ``decode(ids) -> text`` without the stop token;
    ``context``: the model's; ``max_tokens``: the run's per-turn cap."""

    def __init__(
        self,
        sample: Callable[..., Any] | None,
        renderer: Callable[[Any], Any],
        decode: Callable[[list[int]], str],
        model: str,
        max_tokens: int,
        context: int,
        max_body_mb: float = 8.0,
        host: str = "127.0.0.1",
        port: int = 0,
        episode_tokens: int = 0,
        accept: Callable[[str], bool] | None = None,
        max_connections: int = 512,
        read_timeout_s: float = 30.0,
        top: Callable[[list[int], list[int], int], list] | None = None,
    ) -> None:
        self.sample, self.decode, self.model = sample, decode, model
        self.make_renderer, self.renderers = renderer, {}  # one TurnRenderer per tool set, reused (it caches its end)
        self.max_tokens, self.context, self.max_body = max_tokens, context, int(max_body_mb * 2**20)
        self.episode_tokens = episode_tokens  # --max-episode-tokens: a trajectory's tokens after its first prompt
        self.accept = accept  # align.serve: keys outside any episode it accepts (each request a capture of its own)
        self.episodes: dict[str, Capture] = {}
        self.closing = False
        self.warned_sampling = False
        self.lock = threading.Lock()
        gw = self

        self.read_timeout_s = read_timeout_s
        # top(prompt_ids, token_ids, k) -> per token its k most likely (id, logprob) in the training basis; None: the
        # backend cannot give them (top_logprobs is refused)
        self.top = top

        class Handler(_Handler):
            gateway = gw

        server = type("Server", (_Server6 if ":" in host else _Server,), {"max_connections": max_connections})
        self.httpd = server((host, port), Handler)  # ::1 is IPv6
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="align-gateway", daemon=True)
        self.thread.start()

    def renderer(self, tools: list | None) -> Any:
        """The renderer of a request's ``tools`` (made once per distinct tool set: agents reuse a handful)."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        r = self.renderers.get(key)
        if r is None:
            if len(self.renderers) >= MAX_RENDERERS:  # an agent inventing tool sets cannot grow it without bound
                self.renderers.clear()
            r = self.renderers[key] = self.make_renderer(tools)
        return r

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"

    def open_episode(self) -> str:
        key = "sk-align-" + secrets.token_urlsafe(24)
        with self.lock:
            self.episodes[key] = Capture(self.renderer)
        return key

    def close_episode(self, key: str) -> Capture:
        """The episode's capture; its key stops working."""
        with self.lock:
            return self.episodes.pop(key)

    def close(self) -> None:
        self.closing = True
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ a chat completion

    def _top_k(self, body: dict, top: Any) -> int:
        k = body.get("top_logprobs")
        if k is None:
            return 0
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {k!r}")
        if k and not body.get("logprobs"):
            raise ApiError(400, "top_logprobs needs logprobs: true")
        if k and top is None:
            raise ApiError(400, "top_logprobs: this gateway's sampler returns only the sampled token's logprob")
        return k

    def _logprobs(self, body: dict, c: Any, prompt_ids: list[int], k: int, top: Any) -> dict | None:
        if not body.get("logprobs"):
            return None
        tok = getattr(self.renderer(None), "tok", None)
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=False)) if tok is not None else self.decode
        return _token_logprobs(decode, c, top(prompt_ids, c.token_ids, k) if k else None)

    def chat(self, cap: Capture, body: dict) -> dict:
        """One request of an episode -> the OpenAI response (a dict; the handler streams it when asked)."""
        if body.get("n", 1) != 1:
            raise ApiError(
                400, f"n must be 1 (one sample per request; a group is G runs of the agent), got {body['n']}"
            )
        asked = any(body.get(k) is not None for k in ("temperature", "top_p"))
        if asked:
            cap.overridden += 1
            if not self.warned_sampling:
                self.warned_sampling = True
                log.info("the agent asked for its own temperature / top_p: not applied (the run's sampling is)")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "tools must be a list of function schemas")
        parse, opening = tool_choice(body, tools, self.renderer(tools)) if "tool_choice" in body else (True, "")
        top = cap.top or self.top
        k_top = self._top_k(body, top)
        cap_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap_tokens is not None and (not isinstance(cap_tokens, int) or cap_tokens < 1):
            raise ApiError(400, f"max_tokens must be a positive integer, got {cap_tokens!r}")
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, "stop must be a string or a list of non-empty strings")
        try:
            messages = template_messages(body.get("messages"))
            with cap.lock:
                plan = cap.plan(messages, tools)
                if opening:  # tool_choice required / a named function: the call's opening, as context
                    plan.force(self.renderer(tools).encode_text(opening))
                room = self.context - len(plan.prompt_ids)
                if self.episode_tokens:
                    root = plan.new.prompt_ids if plan.new else cap.branches[plan.branch].prompt_ids
                    room = min(room, self.episode_tokens - (len(plan.prompt_ids) - len(root)))
                if room < 1:
                    raise ApiError(
                        400,
                        f"the prompt has {len(plan.prompt_ids)} tokens: no room left in the context of {self.context}"
                        f" or --max-episode-tokens {self.episode_tokens}",
                        code="context_length_exceeded",
                    )
                budget = min(self.max_tokens, room, cap_tokens or self.max_tokens)
                c = (cap.sample or self.sample)(plan.prompt_ids, budget, cap)
                cap.requests += 1
                finish = c.finish_reason
                ended = finish == "stop"
                cut, hit = cut_at_stop(c.token_ids, self.decode, stops), None
                if cut is not None:
                    k, text = cut
                    hit = next((s for s in stops if self.decode(c.token_ids[:k]).find(s) == len(text)), None)
                    c.token_ids, c.logprobs = c.token_ids[:k], c.logprobs[:k]
                    c.sampled_logprobs = (c.sampled_logprobs or c.logprobs)[:k]
                    finish, ended = "stop", False
                else:
                    text = self.decode(c.token_ids)
                msg, calls = reply_message(opening + text, parse)
                cap.record(plan, c, template_messages([msg])[0], ended, finish)
                cap.log[-1]["overridden_sampling"] = asked
        except ValueError as e:  # InputError included: messages or tools the template cannot render, ids past the vocab
            raise ApiError(400, str(e)) from e
        reason = "tool_calls" if calls and finish == "stop" else finish
        prompt_n, out_n = len(plan.prompt_ids), len(c.token_ids)
        return {
            "id": "chatcmpl-" + secrets.token_hex(12),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": msg,
                    "finish_reason": reason,
                    "logprobs": self._logprobs(body, c, plan.prompt_ids, k_top, top),
                }
            ],
            "usage": {"prompt_tokens": prompt_n, "completion_tokens": out_n, "total_tokens": prompt_n + out_n},
            "stop_sequence": hit,  # not OpenAI's: Anthropic's row reads it (OPENAI drops it)
        }


class Api(NamedTuple):
    """One provider API the gateway speaks: its body -> the chat-completions body, the chat completion -> its reply,
    -> its stream events ``(event name or None, data)``, the end of its stream, an ``ApiError`` -> its error object."""

    request: Callable[[dict], dict]
    response: Callable[[dict], dict]
    events: Callable[[dict], list]
    done: bytes
    error: Callable[[ApiError], dict]


def _openai_error(e: ApiError) -> dict:
    return {"error": {"message": str(e), "type": e.kind, "param": None, "code": e.code}}


def _openai_response(resp: dict) -> dict:
    return {k: v for k, v in resp.items() if k != "stop_sequence"}


def _token_logprobs(decode: Callable[..., str], c: Any, tops: list | None = None) -> dict:
    """OpenAI's ``logprobs.content``: each sampled token's logprob in the training basis (``log_softmax(logits / T)``
    of the run's sampling) and, with ``tops`` (per token its ``(id, logprob)`` most likely, best first), its
    ``top_logprobs`` (else empty)."""

    def entry(t: int, lp: float) -> dict:
        text = decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    out = []
    for i, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        out.append({**entry(t, lp), "top_logprobs": [entry(j, v) for j, v in tops[i]] if tops else []})
    return {"content": out}


def _chunks(resp: dict) -> list:
    """A chat completion as the stream's chunks: the role, the content, each tool call, the finish, the usage."""
    msg, choice = resp["choices"][0]["message"], resp["choices"][0]
    base = {k: resp[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("content"):
        out.append(chunk({"content": msg["content"]}))
    for i, tc in enumerate(msg.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, **tc}]}))
    out.append(chunk({}, choice["finish_reason"]))
    out.append(base | {"choices": [], "usage": resp["usage"]})
    return [(None, c) for c in out]


APIS = {  # path -> the API spoken there
    "/v1/chat/completions": Api(lambda b: b, _openai_response, _chunks, b"data: [DONE]\n\n", _openai_error),
    "/v1/messages": Api(
        messages.request, messages.response, messages.events, b"", lambda e: messages.error(e.status, str(e))
    ),
}


class _Handler(BaseHTTPRequestHandler):
    gateway: Gateway
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    # a response leaves in one send (headers and body buffered, flushed by handle_one_request), with Nagle off: as
    # two sends on a kept-alive connection the body waited for the client's delayed ACK, ~40 ms a request
    wbufsize = 1 << 16

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile.close()  # the socket's own reader: ours replaces it (closed, so the socket's close is real)
        self.reader = _DeadlineReader(self.connection, self.gateway.read_timeout_s)
        self.rfile = io.BufferedReader(self.reader)

    def handle_expect_100(self) -> bool:
        ok = super().handle_expect_100()
        self.wfile.flush()  # the client waits for its "100 Continue" before it sends the body
        return ok

    def handle_one_request(self) -> None:
        self.reader.done()  # the next request's first byte arms its deadline
        super().handle_one_request()  # a TimeoutError while reading closes the connection unanswered

    def log_message(self, format: str, *args: Any) -> None:  # keys travel in headers, never logged
        log.debug("gateway: %s %s", self.command, self.path.split("?")[0])

    def _error(self, e: ApiError) -> None:
        send_json(self, e.status, APIS.get(self.path.rstrip("/"), APIS["/v1/chat/completions"]).error(e))

    def _auth(self) -> Capture:
        gw = self.gateway
        if gw.closing:
            raise ApiError(503, "the trainer is shutting down", "server_error")
        auth = self.headers.get("Authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else self.headers.get("x-api-key", "")
        with gw.lock:
            cap = gw.episodes.get(key)
        if cap is None and gw.accept is not None and gw.accept(key):
            cap = Capture(gw.renderer)
        if cap is None:
            raise ApiError(
                401,
                "unknown API key (each agent run gets its own; it expires with the episode)",
                "authentication_error",
                "invalid_api_key",
            )
        return cap

    def do_GET(self) -> None:
        self.reader.done()
        try:
            self._auth()
            if self.path.rstrip("/") != "/v1/models":
                raise ApiError(404, f"no route {self.path}", code="not_found")
            m = {"id": self.gateway.model, "object": "model", "created": 0, "owned_by": "align"}
            send_json(self, 200, {"object": "list", "data": [m]})
        except ApiError as e:
            self._error(e)

    def do_POST(self) -> None:
        try:
            length = (self.headers.get("Content-Length") or "0").strip()
            if not length.isdecimal():  # "-1" would read until the client closes: past the cap, before the key
                self.close_connection = True
                raise ApiError(400, f"Content-Length must be a non-negative integer, got {length[:40]!r}")
            size = int(length)
            if size > self.gateway.max_body:
                self.close_connection = True  # the body is not read
                raise ApiError(
                    413, f"the body has {size} bytes, over --gateway-max-body-mb ({self.gateway.max_body} bytes)"
                )
            self.close_connection = True  # until the key is known: a refused request's body is never read
            cap = self._auth()
            self.close_connection = False
            try:
                raw = self.rfile.read(size)  # within --gateway-read-timeout-s of the request's first byte
            except TimeoutError:
                self.close_connection = True  # too slow: closed unanswered
                return
            self.reader.done()
            api = APIS.get(self.path.rstrip("/"))
            if api is None:
                raise ApiError(404, f"no route {self.path}", code="not_found")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise ApiError(400, f"the body is not valid JSON ({e})") from e
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object")
            try:  # a lone surrogate ("\\ud800") parses but no tokenizer encodes it
                json.dumps(body, ensure_ascii=False).encode()
            except UnicodeEncodeError as e:
                raise ApiError(400, f"the body holds text that is not valid Unicode ({e.reason} at {e.start})") from e
            try:
                body = api.request(body)
            except InputError as e:
                raise ApiError(400, str(e)) from e
            if body.get("model") != self.gateway.model:
                raise ApiError(
                    404,
                    f"model {body.get('model')!r} does not exist; the model is {self.gateway.model!r}",
                    code="model_not_found",
                )
            resp = self.gateway.chat(cap, body)
        except ApiError as e:
            return self._error(e)
        except Exception as e:  # the sampler failed (a dead worker): the request gets a 500, the trainer's log the why
            log.exception("gateway: the request failed")
            return self._error(ApiError(500, f"the sampler failed: {type(e).__name__}: {e}", "server_error"))
        if not body.get("stream"):
            return send_json(self, 200, api.response(resp))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for event, data in api.events(resp):
            self.wfile.write(
                (f"event: {event}\n" if event else "").encode() + b"data: " + json.dumps(data).encode() + b"\n\n"
            )
        self.wfile.write(api.done)
        self.wfile.flush()


__all__ = ["ApiError", "Gateway", "text_of"]
