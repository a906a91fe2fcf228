"""Byte-level tokenizer of the `tiny-moe` preset: ids 0..255 are bytes, then BOS, EOS, PAD.

It exists so the embedded default runs with no download; real checkpoints bring their own
tokenizer (the engine works in token ids and never needs one).
"""
from __future__ import annotations


class ByteTokenizer:
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 260

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
