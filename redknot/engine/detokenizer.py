"""Incremental detokenisation: each new token costs the decode of a few tokens, not of the whole
output (the way vLLM does it). The emitted pieces concatenate to the decode of every output token."""

from __future__ import annotations

_INCOMPLETE = "\ufffd"  # a byte-level token that ends inside a UTF-8 character


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, lazy: bool = False):
        """``lazy``: nobody reads text before the end (no streaming, no stop strings): tokens are
        only collected, and ``flush`` decodes them once."""
        self.tokenizer, self.skip, self.lazy = tokenizer, skip_special_tokens, lazy
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already emitted
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token: int) -> str:
        """Append a token; returns the text it completes (may be empty while a character is split)."""
        self.ids.append(token)
        if self.lazy:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_INCOMPLETE):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def pending(self) -> str:
        """Text of the tokens held back so far (may end in an unfinished character)."""
        full = self._decode(self.ids[self.prefix_offset:])
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return full[len(prefix):] if len(full) > len(prefix) else ""

    def flush(self) -> str:
        """Text of tokens held back (an unfinished character at the end): emitted as it decodes."""
        delta = self.pending()
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
