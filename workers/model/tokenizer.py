"""Tokenizers: a byte-level one for the random-weight presets, and HF tokenizer.json.

Both encode without adding special tokens: the engine decides whether a prompt starts
with BOS, and a tokenizer that adds one silently would shift every position by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as _HFTokenizerImpl


@runtime_checkable
class Tokenizer(Protocol):
    """What the serving stack needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of ids encode() can produce."""
        ...

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, if the model has one."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens left out."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is BOS, 257 is EOS.

    Every id decodes (a cut-off multi-byte character becomes U+FFFD), which is what a
    random-weight model needs: whatever it samples is printable.
    """

    BOS = 256
    EOS = 257

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer.json; BOS/EOS come from the model config, not the file."""

    def __init__(
        self,
        tokenizer_json: str | Path,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None = None,
    ) -> None:
        self._tokenizer = _HFTokenizerImpl.from_file(str(tokenizer_json))
        self._bos_token_id = bos_token_id
        self._eos_token_ids = eos_token_ids
        self._chat_template = chat_template

    @classmethod
    def from_json_str(
        cls,
        text: str,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None = None,
    ) -> HFTokenizer:
        """Rebuild from to_json_str(): how a router on another node gets a worker's tokenizer."""
        return cls.from_tokenizers(_HFTokenizerImpl.from_str(text), bos_token_id, eos_token_ids, chat_template)

    @classmethod
    def from_tokenizers(
        cls,
        tokenizer: _HFTokenizerImpl,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None = None,
    ) -> HFTokenizer:
        """Wrap a `tokenizers.Tokenizer` built in memory (e.g. from a GGUF file's metadata)."""
        wrapped = cls.__new__(cls)
        wrapped._tokenizer = tokenizer
        wrapped._bos_token_id = bos_token_id
        wrapped._eos_token_ids = eos_token_ids
        wrapped._chat_template = chat_template
        return wrapped

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template (GGUF metadata or tokenizer_config.json), if it has one."""
        return self._chat_template

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary string of one id (e.g. "<|im_end|>"), for chat templates' bos/eos names."""
        text = self._tokenizer.id_to_token(token_id)
        return None if text is None else str(text)

    def to_json_str(self) -> str:
        return str(self._tokenizer.to_str())

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: tokenizers' encode holds the GIL for the whole text, so a
        # long prompt encoded in a thread would still stall the router's event loop;
        # encode_batch lets go of it while it works.
        return list(self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as plain data, to send across processes: tokenizer_json None is the byte tokenizer."""

    tokenizer_json: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenizerSpec:
        if isinstance(tokenizer, HFTokenizer):
            return cls(tokenizer.to_json_str(), tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.chat_template)
        return cls(None, tokenizer.bos_token_id, tokenizer.eos_token_ids)

    def build(self) -> Tokenizer:
        if self.tokenizer_json is None:
            return ByteTokenizer()
        return HFTokenizer.from_json_str(self.tokenizer_json, self.bos_token_id, self.eos_token_ids, self.chat_template)
