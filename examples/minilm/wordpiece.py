"""A minimal BERT (uncased) WordPiece tokenizer over vocab.txt, used when `tokenizers` is absent.

Basic tokenisation (clean control characters, lower-case, strip accents, split on whitespace,
punctuation and CJK characters) then greedy longest-match-first WordPiece with ``##`` pieces.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B81F or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F
    )  # fmt: skip


class WordPiece:
    def __init__(self, vocab_file: Path, max_chars_per_word: int = 100) -> None:
        tokens = vocab_file.read_text(encoding="utf-8").splitlines()
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.max_chars = max_chars_per_word
        self.cls, self.sep, self.unk = self.vocab["[CLS]"], self.vocab["[SEP]"], self.vocab["[UNK]"]

    def _basic(self, text: str) -> list[str]:
        out: list[str] = []
        for ch in text:
            cp = ord(ch)
            if (
                cp == 0
                or cp == 0xFFFD
                or (unicodedata.category(ch).startswith("C") and ch not in "\t\n\r")
            ):
                continue
            out.append(f" {ch} " if _is_cjk(cp) else (" " if ch.isspace() else ch))
        text = unicodedata.normalize("NFD", "".join(out).lower())
        text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
        words: list[str] = []
        for word in text.split():
            current = ""
            for ch in word:
                if _is_punctuation(ch):
                    if current:
                        words.append(current)
                    words.append(ch)
                    current = ""
                else:
                    current += ch
            if current:
                words.append(current)
        return words

    def _pieces(self, word: str) -> list[int]:
        if len(word) > self.max_chars:
            return [self.unk]
        ids: list[int] = []
        start = 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else f"##{word[start:end]}"
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    break
                end -= 1
            else:
                return [self.unk]
            start = end
        return ids

    def encode(self, text: str, max_length: int) -> list[int]:
        ids = [i for word in self._basic(text) for i in self._pieces(word)]
        return [self.cls, *ids[: max_length - 2], self.sep]
