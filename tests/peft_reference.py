"""The peft side of the LoRA parity tests, run in a venv that has peft + transformers (test-only).

``python peft_reference.py SPEC.json``; SPEC: ``{"base": hf_dir, "ids": [[...]], "out": file.safetensors,
"load": {key: adapter_dir}, "make": adapter_dir | null}``. For each ``load`` entry it writes the logits of
``PeftModel.from_pretrained(base, adapter_dir)`` under ``key``; with ``make`` it builds a PEFT LoRA model
(r=8, alpha=16, q_proj/v_proj/down_proj, random A and B), saves it there and writes its logits as ``made``.
"""

import json
import sys

import peft
import torch
import transformers
from safetensors.torch import save_file


def base(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    torch.set_num_threads(1)
    ids = torch.tensor(spec["ids"])
    out = {}
    with torch.no_grad():
        for key, adapter in spec["load"].items():
            out[key] = peft.PeftModel.from_pretrained(base(spec["base"]), adapter).eval()(ids).logits
        if spec.get("make"):
            cfg = peft.LoraConfig(
                r=8,
                lora_alpha=16,
                target_modules=["q_proj", "v_proj", "down_proj"],
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
            )
            model = peft.get_peft_model(base(spec["base"]), cfg)
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            model.eval().save_pretrained(spec["make"])
            out["made"] = model(ids).logits
    save_file({k: v.float().contiguous() for k, v in out.items()}, spec["out"])


if __name__ == "__main__":
    main()
