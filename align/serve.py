"""``python -m align.serve --model DIR``: the gateway's OpenAI-compatible endpoints (``align.gateway.server``) over
the native sampler on a checkpoint, no training, so an agent or any client can be pointed at a trained model.

``GET /v1/models`` lists the model's name (the directory's name); any other name is a 404. On loopback any key is
accepted unless ``--api-key-file`` is given; another ``--host`` requires that file (a non-empty key), else the
server refuses to start. Sampling is the server's flags (``--temperature``, ``--top-p``, ``--top-k``); a request's
``max_tokens`` and ``stop`` shorten a reply within ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from align.errors import InputError

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m align.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="A Hugging Face checkpoint directory (with its tokenizer).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (another than loopback needs --api-key-file).")
    p.add_argument("--port", type=int, default=8000, help="Port to bind (0 = a free one, printed).")
    p.add_argument("--api-key-file", default=None, help="A file holding the one key clients must send.")
    p.add_argument("--max-tokens", type=int, default=512, help="Most tokens per reply.")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (0 = greedy).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    p.add_argument("--top-k", type=int, default=0, help="Top-k sampling (0 = off).")
    return p.parse_args(argv)


def read_key(args: argparse.Namespace) -> str | None:
    """The key clients must send (None: any, on loopback only); InputError before anything loads."""
    key = None
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--api-key-file {args.api_key_file}: cannot read it as UTF-8 text ({e})") from None
        if not key:
            raise InputError(f"--api-key-file {args.api_key_file} is empty: write a long random key into it")
    if args.host not in LOOPBACK and key is None:
        raise InputError(
            f"--host {args.host} reaches beyond this machine: give --api-key-file with a key (any key is accepted "
            "only on loopback)"
        )
    return key


def open_server(args: argparse.Namespace) -> Any:
    """The gateway over the checkpoint (the model loaded), serving in a background thread."""
    import torch

    from align.chat import TurnRenderer, load_tokenizer
    from align.gateway.server import Gateway
    from align.model import load_pretrained
    from align.rollout.client import NativeClient
    from align.rollout.protocol import SamplingParams

    key = read_key(args)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port}: a port is 0-65535 (0 = a free one)")
    try:  # the sampling flags, checked before the model loads (not at each request, as the client's fault)
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens)
    except ValueError as e:
        raise InputError(f"{e} (--temperature / --top-p / --top-k / --max-tokens)") from None
    if not Path(args.model).is_dir():
        raise InputError(f"--model {args.model}: no such directory (a Hugging Face checkpoint)")
    tok = load_tokenizer(args.model, args.model, flag="--model")
    model = load_pretrained(args.model, dtype=torch.float32)
    client = NativeClient(model)
    stops = list(getattr(tok, "eos_token_id", None) or [])
    lock = threading.Lock()

    def sample(ids: list[int], max_tokens: int, cap: Any) -> Any:
        params = SamplingParams(
            n=1,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=max_tokens,
            stop_token_ids=stops,
        )
        with lock:  # one generate at a time on the model
            return client.generate([ids], params)[0]

    def top(prompt_ids: list[int], token_ids: list[int], k: int) -> list:
        from align.gateway.agents import top_logprobs

        with lock:
            return top_logprobs(model, args.temperature, prompt_ids, token_ids, k)

    try:
        return Gateway(
            sample,
            lambda tools: TurnRenderer(tok, tools=tools),
            lambda ids: tok.decode(ids),
            Path(args.model).resolve().name,
            args.max_tokens,
            model.config.max_position_embeddings,
            host=args.host,
            port=args.port,
            top=top,
            accept=(lambda k: True) if key is None else (lambda k: hmac.compare_digest(k.encode(), key.encode())),
        )
    except OSError as e:  # the address is not this machine's, the port is taken, no IPv6 ...
        raise InputError(f"--host {args.host} --port {args.port}: cannot bind ({e})") from None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[align.serve] %(message)s")
    args = parse_args(argv)
    try:
        gw = open_server(args)
    except InputError as e:
        print(f"error: {e}", flush=True)
        return 2
    done = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: done.set())
    print(f"[align.serve] {gw.model} at {gw.base_url}", flush=True)
    done.wait()
    gw.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
