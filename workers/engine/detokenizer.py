"""Incremental detokenization and stop strings, one request at a time.

Text is produced as deltas. Two things are held back until they are safe to emit:
bytes that do not yet form a whole character (a token can end mid UTF-8 sequence, which
decodes as U+FFFD), and the last len(longest stop string) - 1 characters, which could be
the start of a stop string that the next token completes.
"""

from __future__ import annotations

from typing import Protocol, Sequence

# A few prompt tokens give the first output tokens their left context, so tokenizers
# that drop a leading space when a token is decoded alone still decode it right.
_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Feeds on output tokens; returns text deltas; finds stop strings on the decoded output."""

    def __init__(self, decoder: Decoder, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        # ids[prefix_offset:read_offset] decode to text already accounted for.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # the whole output text so far (stop string excluded once found)
        self._num_emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> None:
        """Add one output token; sets `stopped` when a stop string completes."""
        if self.stopped:
            return
        self._ids.append(token_id)
        prefix_text = self._decoder.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decoder.decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return  # an incomplete character: wait for the next token
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._append(new_text)

    def _append(self, new_text: str) -> None:
        old_len = len(self.text)
        self.text += new_text
        if not self._stop:
            return
        # Only a stop string that overlaps the new text can be new.
        search_from = max(0, old_len - self._holdback)
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def finish(self) -> None:
        """The request ended: flush what was held back for an incomplete character."""
        if not self.stopped and self._read_offset < len(self._ids):
            prefix_text = self._decoder.decode(self._ids[self._prefix_offset : self._read_offset])
            full_text = self._decoder.decode(self._ids[self._prefix_offset :])
            self._read_offset = len(self._ids)
            self._append(full_text[len(prefix_text) :])

    def skip_emitted(self, num_chars: int) -> None:
        """Count the first num_chars of the text as already emitted (a resumed request)."""
        self._num_emitted = min(num_chars, len(self.text))

    def take_delta(self, final: bool) -> str:
        """Text not yet emitted; keeps back a possible stop-string prefix unless final."""
        limit = len(self.text) if final or self.stopped else max(self._num_emitted, len(self.text) - self._holdback)
        delta = self.text[self._num_emitted : limit]
        self._num_emitted = limit
        return delta
