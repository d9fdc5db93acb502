"""Write a tiny random-weight Qwen2 model with its own BPE tokenizer and a ChatML chat template to DIR.

    python examples/own_data/make_tiny.py runs/tiny_model

The tokenizer is trained on this directory's train.jsonl (the ``tokenizers`` package: pip install 'align[hf]');
the model is align's own Qwen2 decoder, random weights, saved in Hugging Face format (config.json,
model.safetensors, generation_config.json) beside tokenizer.json and tokenizer_config.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from align.model import ModelConfig, Transformer, save_pretrained

HERE = Path(__file__).resolve().parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def main(out: str) -> None:
    rows = [json.loads(line) for line in (HERE / "train.jsonl").read_text().splitlines() if line.strip()]
    corpus = [m["content"] for r in rows for m in r.get("messages", [])] + [r.get("prompt", "") for r in rows]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        corpus * 10,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    eos = tok.token_to_id("<|im_end|>")
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention refuses head_dim 16 (32, 64, ... run)
        qkv_bias=True,
        max_position_embeddings=256,
        eos_token_id=eos,
        pad_token_id=0,
    )
    path = save_pretrained(Transformer(cfg).init_weights(std=0.2, seed=0), out)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            },
            indent=2,
        )
    )
    print(
        f"wrote {path}: {sum(p.numel() for p in Transformer(cfg).parameters()) / 1e6:.2f}M parameters, "
        f"vocab {cfg.vocab_size}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny_model")
