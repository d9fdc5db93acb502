"""``python -m align.serve``: the gateway's endpoints over the native sampler on a checkpoint (a random-weight tiny
Qwen2 with a BPE tokenizer and the stored Qwen2.5 template, built in the test), driven by the real ``openai``
client; the reply's ids are the sampler's (greedy, compared with transformers' argmax decoding); bad flags refused
before the model loads."""

from __future__ import annotations

import shutil

import pytest
from helpers_models import greedy_ids, load_hf, make_tiny_qwen2
from helpers_tokenizer import make_bpe_tokenizer

from align.chat import TurnRenderer, load_tokenizer
from align.errors import InputError
from align.serve import open_server, parse_args, read_key

openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = make_tiny_qwen2(tmp_path_factory.mktemp("serve") / "tiny-policy", vocab_size=400)
    tok = make_bpe_tokenizer(tmp_path_factory.mktemp("tok"), template="qwen2.5")
    for f in tok.iterdir():
        shutil.copy(f, d / f.name)
    return d


def test_serve_answers_with_the_models_greedy_tokens(model_dir):
    gw = open_server(parse_args(["--model", str(model_dir), "--port", "0", "--temperature", "0", "--max-tokens", "8"]))
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key="anything", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-policy"]
        msgs = [{"role": "user", "content": "What is 12 + 30?"}]
        r = client.chat.completions.create(model="tiny-policy", messages=msgs)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=msgs)
    finally:
        gw.close()
    tok = load_tokenizer(model_dir, model_dir)
    prompt = TurnRenderer(tok).first(msgs)
    ref = greedy_ids(load_hf(model_dir), prompt, 8)
    stops = set(tok.eos_token_id)
    ref = ref[: next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ref)
    assert r.choices[0].message.content == tok.decode(ref)
    assert tok.decode(ref) != tok.decode(greedy_ids(load_hf(model_dir), prompt[:-1], 8))  # control: another prompt


def test_top_logprobs_are_the_models_own_at_each_sampled_token(model_dir):
    """``top_logprobs`` through the real client == transformers' ``log_softmax(logits / T)`` top-k at each position
    of the sampled reply (T = 0.7, sampled); control: the positions shifted by one differ."""
    import torch

    argv = ["--model", str(model_dir), "--port", "0", "--temperature", "0.7", "--max-tokens", "6"]
    gw = open_server(parse_args(argv))
    sampled, real = [], gw.sample
    gw.sample = lambda *a: sampled.append(c := real(*a)) or c  # the sampled ids, as the gateway got them
    msgs = [{"role": "user", "content": "What is 12 + 30?"}]
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key="anything", max_retries=0)
        r = client.chat.completions.create(model="tiny-policy", messages=msgs, logprobs=True, top_logprobs=3, seed=1)
    finally:
        gw.close()
    tok = load_tokenizer(model_dir, model_dir)
    prompt = TurnRenderer(tok).first(msgs)
    content = r.choices[0].logprobs.content
    ids = sampled[0].token_ids
    assert len(ids) == r.usage.completion_tokens == len(content)
    with torch.no_grad():
        logits = load_hf(model_dir)(torch.tensor([prompt + ids])).logits[0].float()
    ref = (logits / 0.7).log_softmax(-1).topk(3, -1).values  # (len, 3): row i predicts token i + 1
    got = torch.tensor([[t.logprob for t in c.top_logprobs] for c in content])
    n = len(ids)
    assert torch.allclose(got, ref[len(prompt) - 1 : len(prompt) - 1 + n], atol=1e-4)
    assert all(c.logprob <= c.top_logprobs[0].logprob + 1e-4 for c in content)  # the sampled token's is no higher
    assert not torch.allclose(got, ref[len(prompt) : len(prompt) + n], atol=1e-4)  # control: one position later


def test_serve_refuses_a_public_host_without_a_key(tmp_path):
    with pytest.raises(InputError, match="--api-key-file"):
        read_key(parse_args(["--model", "x", "--host", "0.0.0.0"]))
    empty = tmp_path / "key"
    empty.write_text("\n")
    with pytest.raises(InputError, match="is empty"):
        read_key(parse_args(["--model", "x", "--host", "0.0.0.0", "--api-key-file", str(empty)]))
    empty.write_text("s3cret-key\n")
    assert read_key(parse_args(["--model", "x", "--host", "0.0.0.0", "--api-key-file", str(empty)])) == "s3cret-key"
    assert read_key(parse_args(["--model", "x"])) is None  # loopback: any key


def test_serve_with_a_key_file_refuses_other_keys(model_dir, tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret-key\n")
    gw = open_server(parse_args(["--model", str(model_dir), "--port", "0", "--api-key-file", str(key)]))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gw.base_url, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=gw.base_url, api_key="s3cret-key", max_retries=0).models.list().data
    finally:
        gw.close()


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--port", "99999"], "--port 99999"),  # was a raw OverflowError from bind()
        (["--max-tokens", "-5"], "max_tokens"),  # was a server whose every request got a 400
        (["--top-p", "7"], "top_p"),
        (["--temperature", "nan"], "temperature"),  # was a server sampling from nan probabilities
        (["--host", "192.0.2.1", "--api-key-file", "KEY"], "cannot bind"),  # not this machine's: was an OSError
        (["--api-key-file", "BINARY"], "UTF-8"),  # was a raw UnicodeDecodeError
    ],
)
def test_serve_refuses_bad_flags_with_an_input_error(model_dir, tmp_path, flags, match):
    (tmp_path / "KEY").write_text("s3cret\n")
    (tmp_path / "BINARY").write_bytes(b"\xff\xfe")
    flags = [str(tmp_path / f) if f in ("KEY", "BINARY") else f for f in flags]
    with pytest.raises(InputError, match=match):
        open_server(parse_args(["--model", str(model_dir), *flags])).close()


def test_serve_cli_error_is_one_line(model_dir, capsys):
    from align.serve import main

    assert main(["--model", str(model_dir), "--port", "-3"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: --port -3") and out.count("\n") == 1


def test_serve_binds_ipv6_loopback(model_dir):
    gw = open_server(parse_args(["--model", str(model_dir), "--host", "::1", "--port", "0"]))  # was a gaierror
    try:
        assert gw.base_url.startswith("http://[::1]:")
        assert openai.OpenAI(base_url=gw.base_url, api_key="any", max_retries=0).models.list().data
    finally:
        gw.close()
