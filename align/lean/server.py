"""A kimina-lean-server client: ``POST /verify`` (batched, retried with backoff) and ``GET /health``.

The request and reply shapes are kimina-lean-server's backward-compatible ``/verify`` route
(project-numina/kimina-lean-server ``server/routers/backward.py``): the body is
``{"codes": [{"custom_id": ID, "proof": CODE}], "timeout": S, "infotree_type": null, "disable_cache": false}``,
the reply ``{"results": [{"custom_id": ID, "error": str | null, "response": REPL reply | null}]}`` where the REPL
reply is the leanprover-community/repl JSON (``env``, ``messages``, ``sorries``) or ``{"message": ...}``.
An API key, when the server wants one, is read from ``LEAN_SERVER_API_KEY`` (header ``X-Auth-Token``, as the
kimina client sends it), never from a config file.

Submissions queue up; ``workers`` sender threads each take what is waiting (up to ``batch`` codes) as one
request, so batches grow under load without a linger timer. stdlib only (``urllib``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request

from align.errors import InputError

HEALTH_TIMEOUT_S = 10.0


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
        headers = {"Content-Type": "application/json"}
        key = os.environ.get("LEAN_SERVER_API_KEY")
        if key:
            headers["X-Auth-Token"] = key
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers=headers, method="GET" if body is None else "POST"
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            reply = json.loads(resp.read().decode("utf-8"))
        if not isinstance(reply, dict):
            raise TypeError(f"reply is not a JSON object: {str(reply)[:200]}")
        return reply

    def health(self) -> None:
        """``GET /health`` must answer ``{"status": "ok"}``; else an ``InputError`` naming ``--lean-server``."""
        try:
            reply = self._request("/health", None, HEALTH_TIMEOUT_S)
        except (OSError, ValueError, TypeError) as e:  # URLError, HTTPError, timeouts, bad JSON
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
            self._send(batch)

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
                reply = self._request("/verify", body, self.timeout_s * len(batch) + 30)
                results = {str(r["custom_id"]): r for r in reply["results"]}
                break
            except (OSError, ValueError, KeyError, TypeError) as e:
                last = f"{type(e).__name__}: {e}"
        else:
            for _, _, fut in batch:
                fut.set_exception(ServerError(f"POST {self.url}/verify failed {self.retries + 1} times: {last}"))
            return
        for cid, _, fut in batch:
            r = results.get(cid)
            if r is None:
                fut.set_exception(ServerError(f"POST /verify reply has no result for custom_id {cid}"))
            elif r.get("error") or not isinstance(r.get("response"), dict):
                fut.set_exception(ServerError(f"the server could not check it: {r.get('error') or r}"))
            else:
                fut.set_result(r["response"])

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=self.timeout_s + 60)
