"""Build a tiny random-weight Qwen2 checkpoint with a locally trained BPE tokenizer, a Qwen3-style chat template,
and optionally a PEFT LoRA adapter. No downloads. Run under .venv-rollout (torch, transformers, tokenizers, peft).

usage: build_tiny.py MODEL_DIR [--adapter ADAPTER_DIR] [--corpus minif2f.jsonl]
The tokenizer vocab equals the model vocab (ids >= the tokenizer size would decode to garbage).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the tiny model's shape

from helpers_models import TINY

VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3-style: one turn = <|im_start|>{role}\n{content}<|im_end|>\n; assistant history keeps the text after the
# last </think>; generation prompt <|im_start|>assistant\n (no system prompt, no <think>).
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def corpus_lines(path: str | None) -> list[str]:
    lines = [
        "Complete the following Lean 4 code:",
        "Before producing the Lean 4 code to formally prove the theorem",
        "The proof (Round 0) is not correct. Error Message: unsolved goals",
        "```lean4",
        "theorem t := by simp",
    ]
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                lines += json.loads(line)["lean4_code"].split("\n")
    return lines * 2


def build(model_dir: str, adapter_dir: str | None, corpus: str | None) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(corpus_lines(corpus), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    n = len(tok)
    assert n <= VOCAB, n
    torch.manual_seed(0)
    ids = tok.convert_tokens_to_ids
    specials = {
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    # the tests' tiny Qwen2 shape, at transformers' default init scale, a longer context and this tokenizer's ids
    cfg = Qwen2Config(
        **{**TINY, "vocab_size": VOCAB, "initializer_range": 0.02, "max_position_embeddings": 2048, **specials}
    )
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    if adapter_dir:
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
        )
        pm = get_peft_model(model, lcfg)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        pm.save_pretrained(adapter_dir)
    print(json.dumps({"model": model_dir, "vocab": VOCAB, "tokenizer_size": n, "adapter": adapter_dir}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--corpus", default=None)
    a = ap.parse_args()
    build(a.model_dir, a.adapter, a.corpus)
