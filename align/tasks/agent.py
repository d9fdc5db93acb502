"""The built-in agent task (``--task agent``): the multiturn task (``align.tasks.multiturn``) played by an agent
PROGRAM through the OpenAI-compatible gateway (``align.gateway``), so the gateway's path trains with no files.

``play`` is the agent: stdlib only (``urllib`` against the gateway's ``POST /v1/chat/completions``, no ``openai``
package), it sends the prompt as a user message, reads the reply, asks the task's rules (``multiturn.Env``) what the
environment would answer, sends that back as the next user message and returns the reward. The environment's
information (the hidden letter) is behind a call the agent makes after a wrong answer, so the first answer has the
multiturn ceiling ``FIRST_TURN_CEILING`` = 1/8. An answer cut by ``--max-tokens`` ends the episode, as the
environment path ends it.

The character tokenizer has no chat template, and the gateway speaks chat messages; ``tokenizer()`` gives it the
smallest template that renders an episode as the multiturn environment's token sequence::

    <bos> c a ? d =  d f a c <eos>  | b =  d b a c <eos>
    (user)           (assistant)    (user) (assistant)

(user and system content as is, assistant content then ``<eos>``, no generation prompt), so what the gateway captures
is what ``--task multiturn`` trains, token for token (``tests/test_agent_task.py`` checks it against the environment
path), and the learning curves are the same problem's. Everything else (prompts, warm start, model shape, sizes)
is the multiturn task's.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from typing import Any

from align.char_tokenizer import SPECIALS, CharTokenizer
from align.gateway.agents import bind
from align.tasks import multiturn, warm

FIRST_TURN_CEILING = multiturn.FIRST_TURN_CEILING
# multiturn's settings; the gateway batches the agents' concurrent requests into one generate (else one per request):
# a batch goes out once every running agent has a request in it, the window only bounds the wait for a slow one (a
# request's draws do not depend on its batch: the run is deterministic whatever the window, align.gateway.agents)
TRAIN_DEFAULTS = {**multiturn.TRAIN_DEFAULTS, "envs.gateway_batch_ms": 500.0}
reward = None  # the agent's return value is the reward
REQUEST_TIMEOUT_S = 300.0  # one request to the gateway (a step's batch of generates included)
BUSY_RETRIES, BUSY_WAIT_S = 4, 0.05  # a refused connection (503, all open) is retried, as the openai client does

prompts = multiturn.prompts
model_config = multiturn.model_config
check_sizes = multiturn.check_sizes
warm_example = multiturn.warm_example


class Template:
    """The chat template of the task's tokenizer (the ``render`` of ``align.chat.ChatTemplate``): ``<bos>``, then each
    message's content, an assistant's followed by ``<eos>``; the generation prompt is empty. Tools are refused."""

    name = "the agent task's template"

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: Any = None, **_: Any) -> str:
        if tools:
            raise ValueError(f"{self.name} has no tool-call format: send the request without tools")
        out = [SPECIALS[1]]
        for m in messages:
            content = m.get("content") or ""
            out.append(content + SPECIALS[2] if m.get("role") == "assistant" else content)
        return "".join(out)


class ChatCharTokenizer(CharTokenizer):
    """The multiturn alphabet with ``Template`` as its chat template; ``encode`` reads the special tokens' texts
    (``<bos>``, ``<eos>``) as their ids, as a Hugging Face tokenizer reads a rendered template (none of ``<>`` is in
    the alphabet, so a text never means both)."""

    chat_template = Template()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = [self.bos_token_id] if add_bos else []
        i = 0
        while i < len(text):
            special = next((k for k, s in enumerate(SPECIALS) if text.startswith(s, i)), None)
            if special is None:
                j = min((p for s in SPECIALS if (p := text.find(s, i)) >= 0), default=len(text))
                ids += super().encode(text[i:j], add_bos=False)
                i = j
            else:
                ids.append(special)
                i += len(SPECIALS[special])
        return ids


def tokenizer() -> ChatCharTokenizer:
    if any(c in multiturn.ALPHABET for c in "<>"):
        raise AssertionError("the special tokens' texts would be ambiguous")
    return ChatCharTokenizer(multiturn.ALPHABET)


def _chat(base_url: str, api_key: str, model: str, messages: list[dict]) -> dict:
    body = json.dumps({"model": model, "messages": messages}).encode()
    req = urllib.request.Request(
        base_url + "/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    for attempt in range(BUSY_RETRIES + 1):
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                return json.loads(resp.read())["choices"][0]
        except urllib.error.URLError as e:
            # every connection busy (one still closing as this one opened): a 503, or the pipe closed on the body
            busy = e.code == 503 if isinstance(e, urllib.error.HTTPError) else isinstance(e.reason, ConnectionError)
            if not busy or attempt == BUSY_RETRIES:
                raise
            time.sleep(BUSY_WAIT_S * 2**attempt)
    raise AssertionError("unreachable")


def play(base_url: str, api_key: str, model: str, prompt: str, answer: str, **row: Any) -> float:
    """The agent: one episode of the multiturn task over HTTP; its reward (1.0 for the exact answer, else 0.0)."""
    env = multiturn.Env(prompt, answer)
    messages = [{"role": "user", "content": env.reset()}]
    while True:
        choice = _chat(base_url, api_key, model, messages)
        reply = choice["message"]["content"] or ""
        step = env.step(reply)
        if step.done or choice["finish_reason"] == "length":  # a cut answer is scored, then the episode ends
            return step.reward
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": step.observation}]


Env = bind(play)  # the agent as an environment class (align.gateway.agents): its run_episodes hook drives the gateway

# the steps, batch, lr, seed and log of align.tasks.warm.warm_start, on this module's warm_example
warm_start = partial(warm.warm_start, sys.modules[__name__])
