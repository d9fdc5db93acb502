"""A kimina-lean-server client: ``POST /verify`` (batched, retried with backoff) and ``GET /health``.

The request and reply shapes are kimina-lean-server's backward-compatible ``/verify`` route
(project-numina/kimina-lean-server ``server/routers/backward.py``): the body is
``{"codes": [{"custom_id": ID, "proof": CODE}], "timeout": S, "infotree_type": null, "disable_cache": false}``,
the reply ``{"results": [{"custom_id": ID, "error": str | null, "response": REPL reply | null}]}`` where the REPL
reply is the leanprover-community/repl JSON (``env``, ``messages``, ``sorries``) or ``{"message": ...}``.
An API key, when the server wants one, is read from ``LEAN_SERVER_API_KEY`` (header ``X-Auth-Token``, as the
kimina client sends it), never from a config file.

Submissions queue up; ``workers`` sender threads each take what is waiting (up to ``batch`` codes) as one
request, so batches grow under load without a linger timer. stdlib only (``http.client``).

A server is not trusted to behave (issue 42): every request has a **total** deadline (a watchdog shuts the socket
down when it passes, so a server dripping one byte at a time cannot outlive it; a socket timeout alone is per
read), a body over ``MAX_BODY_BYTES`` is refused (by its Content-Length, or as soon as that many bytes arrived),
and whatever a request raises (``BadStatusLine``, ``IncompleteRead``, ``RecursionError`` on a deep JSON,
``MemoryError``, a reply of the wrong shape) fails that batch's futures with a ``ServerError``: no future is left
unresolved and no sender thread dies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import queue
import socket
import threading
import time
import urllib.parse

from align.errors import InputError

HEALTH_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 16 << 20  # one reply body; a real /verify reply is KBs per proof (infotrees off)
READ_CHUNK = 1 << 16
SLACK_S = 30.0  # a /verify request's total deadline: timeout_s per proof in the batch + this


class ServerError(RuntimeError):
    """A request that failed all its retries, or a reply that is not the kimina shape; the message says which."""


class LeanServer:
    """``submit(code) -> Future[dict]``: the REPL reply of one code (raises ``ServerError`` in the future)."""

    def __init__(
        self,
        url: str,
        workers: int = 4,
        batch: int = 8,
        timeout_s: float = 300.0,
        retries: int = 1,
        backoff_s: float = 1.0,
    ) -> None:
        self.url, self.batch, self.timeout_s = url.rstrip("/"), batch, timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self.requests = 0  # HTTP requests sent (tests, logs)
        self._queue: queue.Queue = queue.Queue()
        self._ids = iter(range(1 << 62))
        self._lock = threading.Lock()
        self.health()
        self._threads = [threading.Thread(target=self._sender, daemon=True) for _ in range(workers)]
        for t in self._threads:
            t.start()

    def _request(self, path: str, body: dict | None, timeout: float) -> dict:
        """One HTTP request: its JSON object reply, within ``timeout`` seconds in all and ``MAX_BODY_BYTES``."""
        headers = {"Content-Type": "application/json"}
        key = os.environ.get("LEAN_SERVER_API_KEY")
        if key:
            headers["X-Auth-Token"] = key
        url = urllib.parse.urlsplit(self.url + path)
        conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(url.hostname, url.port, timeout=timeout)
        expired = threading.Event()

        sock: list[socket.socket] = []

        def expire() -> None:  # the total deadline: a blocked read returns at once
            expired.set()
            with contextlib.suppress(OSError):
                sock[0].shutdown(socket.SHUT_RDWR)  # (conn drops its own reference once the reply's headers are in)

        try:
            conn.connect()
            sock.append(conn.sock)
            watchdog = threading.Timer(timeout, expire)
            watchdog.daemon = True
            watchdog.start()
            try:
                data = None if body is None else json.dumps(body).encode()
                target = url.path + (f"?{url.query}" if url.query else "")
                conn.request("GET" if body is None else "POST", target, body=data, headers=headers)
                resp = conn.getresponse()
                raw = _read_body(resp)
            finally:
                watchdog.cancel()
            if expired.is_set():  # the read ended because the watchdog shut the socket
                raise TimeoutError
        except Exception:
            if expired.is_set():
                raise TimeoutError(f"no complete reply within {timeout:g} s (total deadline)") from None
            raise
        finally:
            conn.close()
        if resp.status != 200:
            raise ServerError(f"HTTP {resp.status} {resp.reason}: {raw[:200]!r}")
        reply = json.loads(raw.decode("utf-8"))
        if not isinstance(reply, dict):
            raise TypeError(f"reply is not a JSON object: {str(reply)[:200]}")
        return reply

    def health(self) -> None:
        """``GET /health`` must answer ``{"status": "ok"}``; else an ``InputError`` naming ``--lean-server``."""
        try:
            reply = self._request("/health", None, HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - refused, timed out, bad HTTP, bad JSON: the flag is named
            raise InputError(
                f"--lean-server {self.url}: the health check GET /health failed ({e}); start kimina-lean-server "
                "there (see docs/lean.md) or fix the URL"
            ) from None
        if reply.get("status") != "ok":
            raise InputError(f"--lean-server {self.url}: GET /health answered {reply}, not {{'status': 'ok'}}")

    def submit(self, code: str) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            cid = str(next(self._ids))
        self._queue.put((cid, code, fut))
        return fut

    def _sender(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # leave the stop signal for this thread's next loop
                    break
                batch.append(item)
            try:
                self._send(batch)
            except BaseException as e:
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(ServerError(f"the kimina client failed: {type(e).__name__}: {e}"[:500]))
                if not isinstance(e, Exception):
                    raise

    def _send(self, batch: list) -> None:
        body = {
            "codes": [{"custom_id": cid, "proof": code} for cid, code, _ in batch],
            "timeout": self.timeout_s,
            "infotree_type": None,
            "disable_cache": False,
        }
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            with self._lock:
                self.requests += 1
            try:
                reply = self._request("/verify", body, self.timeout_s * len(batch) + SLACK_S)
                results = {str(r["custom_id"]): r for r in reply["results"]}
                break
            except Exception as e:  # noqa: BLE001 - any failure of the request or its shape is retried
                last = f"{type(e).__name__}: {e}"[:500]
        else:
            for _, _, fut in batch:
                fut.set_exception(ServerError(f"POST {self.url}/verify failed {self.retries + 1} times: {last}"))
            return
        for cid, _, fut in batch:
            r = results.get(cid)
            if not isinstance(r, dict):
                fut.set_exception(ServerError(f"POST /verify reply has no result for custom_id {cid}"))
            elif r.get("error") or not isinstance(r.get("response"), dict):
                fut.set_exception(ServerError(f"the server could not check it: {r.get('error') or r}"[:500]))
            else:
                fut.set_result(r["response"])

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=self.timeout_s + 60)


def _read_body(resp: http.client.HTTPResponse) -> bytes:
    """The body, at most ``MAX_BODY_BYTES`` (refused by its Content-Length first), read in chunks."""
    length = resp.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > MAX_BODY_BYTES:
        raise ServerError(f"the reply body is {int(length)} bytes, over the client's cap of {MAX_BODY_BYTES}")
    out = bytearray()
    while chunk := resp.read(READ_CHUNK):
        out += chunk
        if len(out) > MAX_BODY_BYTES:
            raise ServerError(f"the reply body passed the client's cap of {MAX_BODY_BYTES} bytes")
    if length is not None and length.strip().isdigit() and len(out) < int(length):  # the server hung up early
        raise http.client.IncompleteRead(bytes(out[:100]), int(length) - len(out))
    return bytes(out)
