"""The deterministic byte/word tokenizer of kvdrain's HTTP front (text prompts). Runs in: frontend process.

kvdrain's models have no real vocabulary, so text is mapped to token ids by a tiny,
documented, reversible rule (no downloads, same ids in every process and run):
- text is split on whitespace into words;
- a word `w<N>` (N a decimal without leading zeros, N < vocab_size) is the one token N;
- any other word is its UTF-8 bytes, one token per byte (ids 0-255).
`decode` writes every token as its word `w<N>`, joined by single spaces, so
`encode(decode(ids)) == ids` for any ids below vocab_size: a replay can send prompts
as text to a server that wants text and the engine sees exactly the synthesised ids.
The reverse is not an identity (`"hi"` encodes to [104, 105], which decodes to
`"w104 w105"`). Text prompts need vocab_size >= 256 (every byte must be a token).
"""

from __future__ import annotations

import re

NUM_BYTE_TOKENS = 256
_WORD = re.compile(r"w(0|[1-9][0-9]*)")


class WordTokenizer:
    def __init__(self, vocab_size: int) -> None:
        if vocab_size < NUM_BYTE_TOKENS:
            raise ValueError(
                f"vocab_size: text prompts need at least {NUM_BYTE_TOKENS} "
                f"tokens (one per byte), got {vocab_size}"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """The token ids of text; with a limit, stops once past it (limit + 1 ids then, so
        a caller refusing long prompts never tokenises more than it needs to refuse)."""
        words = text.split() if limit is None else text.split(maxsplit=limit)
        ids: list[int] = []
        for word in words:
            match = _WORD.fullmatch(word)
            if match is not None and len(word) <= 12 and int(match[1]) < self.vocab_size:
                ids.append(int(match[1]))
            elif limit is None:
                ids.extend(word.encode("utf-8"))
            else:  # each character is at least one byte
                ids.extend(word[: limit + 1 - len(ids)].encode("utf-8"))
            if limit is not None and len(ids) > limit:
                return ids[: limit + 1]
        return ids

    @staticmethod
    def decode(token_ids: list[int], first: bool = True) -> str:
        """The text of token_ids; first=False continues a text (a leading space)."""
        text = " ".join(f"w{t}" for t in token_ids)
        return text if first or not text else " " + text
