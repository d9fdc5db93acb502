"""A character-level tokenizer: the built-in tasks' (any object with ``encode``/``decode`` works in align)."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """ids 0..2 are <pad>, <bos>, <eos>; then one id per character of ``alphabet``."""

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet {alphabet!r} has repeated characters")
        self.alphabet = alphabet
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet {self.alphabet!r}") from None
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i < len(SPECIALS):
                if not skip_special_tokens:
                    out.append(SPECIALS[i])
            else:
                out.append(self.alphabet[i - len(SPECIALS)])
        return "".join(out)

    def save(self, path: str | Path) -> None:
        (Path(path) / "align_tokenizer.json").write_text(json.dumps({"type": "char", "alphabet": self.alphabet}))

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        return cls(json.loads((Path(path) / "align_tokenizer.json").read_text())["alphabet"])
