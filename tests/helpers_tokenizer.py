"""A byte-level BPE tokenizer trained in the test (the ``tokenizers`` package, no downloads), saved as a Hugging
Face tokenizer directory that transformers' ``AutoTokenizer`` and ``align.data.HFTokenizer`` both load."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CORPUS = [
    "What is 12 + 30? The answer is 42.",
    "Reverse the word abcd: dcba. Count the letters in banana.",
    "You are a helpful assistant. Think step by step, then put the answer in \\boxed{}.",
    "Hello, world! It's 3/4 of 1,000, i.e. 750; -5 is negative.",
    "<think>\nLet me think.\n</think>\n\nThe capital of France is Paris.",
] * 20


def chat_template(name: str) -> str:
    """A stored chat template text: 'qwen2.5', 'qwen3' or 'llama3' (tests/fixtures/chat_templates)."""
    return (FIXTURES / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def make_bpe_tokenizer(
    path: str | Path,
    vocab_size: int = 400,
    template: str | None = "qwen2.5",
    bos: bool = False,
    eos_token: str = "<|im_end|>",
    template_in_config: bool = True,
    generation_eos: list[int] | None = None,
    corpus: list[str] | None = None,
) -> Path:
    """Train a byte-level BPE on ``CORPUS`` and write tokenizer.json + tokenizer_config.json (+ chat template).

    ``bos`` adds a post-processor that prepends <|begin_of_text|> (as Llama-3's tokenizer does);
    ``template_in_config=False`` writes the template to chat_template.jinja instead of tokenizer_config.json;
    ``corpus`` replaces ``CORPUS`` (text the tests' prompts are made of tokenizes into fewer, longer tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS if corpus is None else corpus, trainer)
    if bos:
        bos_id = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A $B",
            special_tokens=[("<|begin_of_text|>", bos_id)],
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": "<|endoftext|>",
        "bos_token": "<|begin_of_text|>" if bos else None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
    }
    if template is not None:
        if template_in_config:
            config["chat_template"] = chat_template(template)
        else:
            (path / "chat_template.jinja").write_text(chat_template(template), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


# The tool-use task of tests/test_tool_train.py and tests/test_agent.py: a ChatML-like template that lists the tools,
# one question, the tool call that answers it and the final answer.
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools: ' }}{% for t in tools %}{{ t['function']['name'] + ' ' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QUESTION = "What is 2 + 3?"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."


TOOL_WARM_STEPS = (
    150  # the two targets memorised (loss ~1e-3 per token): most T=1 samples are the call, then the answer
)


def warm_tool_model(tmp_path_factory, tools: list, name: str) -> tuple[Path, list[int], list[int], list[int]]:
    """A tiny qwen2 model warm-started on the tool-use turns (``QUESTION`` -> ``CALL``; the tool's result -> ``ANSWER``)
    with ``tools`` in its prompt: (the model dir with its tokenizer, the first prompt's ids, the suffix ids of the
    tool's result "5", those of a wrong result "6")."""
    import shutil
    import types

    from helpers_models import SMALL

    from align.chat import TurnRenderer
    from align.data import load_tokenizer
    from align.model import ModelConfig
    from align.tasks.warm import supervised

    tok_dir = make_bpe_tokenizer(tmp_path_factory.mktemp("tok"))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    tok = load_tokenizer(str(tok_dir), str(tok_dir))
    stop = tok.encode("<|im_end|>")
    renderer = TurnRenderer(tok, tools=tools)
    first = renderer.first([{"role": "user", "content": QUESTION}])
    call, answer = tok.encode(CALL) + stop, tok.encode(ANSWER) + stop
    suffix, wrong = (renderer.suffix([{"role": "tool", "name": "add", "content": r}]) for r in ("5", "6"))
    batch = [_example(first, call), _example(first + call + suffix, answer)]
    cfg = ModelConfig(**SMALL, vocab_size=400, max_position_embeddings=256, eos_token_id=stop[0], pad_token_id=0)
    with_tokenizer = types.SimpleNamespace(save=lambda p: shutil.copytree(tok_dir, p, dirs_exist_ok=True))
    model = tmp_path_factory.mktemp(name) / "m"
    path = supervised(model, with_tokenizer, cfg, lambda rng: batch, steps=TOOL_WARM_STEPS, lr=1e-2, seed=0, log=None)
    return path, first, suffix, wrong


def _example(prompt: list[int], target: list[int]) -> tuple[list[int], list[int]]:
    return prompt + target, [-100] * (len(prompt) - 1) + target + [-100]
