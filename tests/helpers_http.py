"""Stand-in HTTP servers for tests (a real ``http.server`` on 127.0.0.1): the server on an ephemeral port serving
from a daemon thread, and a quiet request handler that answers JSON."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from align.gateway.server import send_json


class LocalServer(ThreadingHTTPServer):
    """``handler`` on 127.0.0.1, an ephemeral port; ``url`` its address; ``start()`` serves from a daemon thread."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, daemon=True).start()


class QuietHandler(BaseHTTPRequestHandler):
    """Logs nothing; ``send_json(status, obj)`` answers ``obj`` as JSON with its length."""

    def log_message(self, *args) -> None:  # quiet
        pass

    def send_json(self, status: int, obj: dict) -> None:
        send_json(self, status, obj)
