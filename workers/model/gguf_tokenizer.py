"""A `tokenizers` tokenizer rebuilt from a GGUF file's `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges and the
special ids as metadata. What we build from them must give exactly the ids that
transformers' GGUF tokenizer gives (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`),
because that is the reference the model is checked against, so where transformers and
llama.cpp read a field differently this module follows transformers:

- `tokenizer.ggml.pre` picks a split regex only for the names transformers knows; every
  other name gets GPT-2's byte-level regex. For SmolLM's "smollm" llama.cpp (and the
  model's own tokenizer.json) first splits off each digit; with SmolLM2's vocabulary,
  which has no multi-digit tokens, that changes ids only where two or more spaces come
  before a digit: "a  1" is a, Ġ, Ġ, 1 here and a, ĠĠ, 1 in llama.cpp.
- Control tokens (token_type 3) are special and matched whole in text; user-defined
  ones (type 4, e.g. "<think>") are matched whole too but are not special, so decode
  keeps them. In a byte-level vocabulary a control token spelled outside the byte
  alphabet is a llama.cpp mislabel and is left as an ordinary entry.

Two vocabularies are supported: "gpt2" (byte-level BPE with merges) and "llama"
(SentencePiece BPE: merges recovered from the token scores, byte fallback).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from workers.model.config import ModelLoadError
from workers.model.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from workers.model.gguf_checkpoint import GGUFMetadata

__all__ = ["SpecialTokenIds", "special_token_ids", "tokenizer_from_gguf"]

_CONTROL = 3
_USER_DEFINED = 4
_SPM_SPACE = "\u2581"  # SentencePiece's visible space

# Split regexes of the `tokenizer.ggml.pre` names transformers maps (for the llama and
# qwen2 architectures). They differ in how digits group: Llama 3 keeps up to three
# together, Qwen2 and Tekken split each one.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}


class SpecialTokenIds(NamedTuple):
    """The ids GGUF metadata names. eos_token_ids: eos, then eot if it differs (both end a turn)."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    unknown_token_id: int | None
    padding_token_id: int | None


def special_token_ids(metadata: GGUFMetadata) -> SpecialTokenIds:
    """bos/eos/eot/unknown/padding ids from `tokenizer.ggml.*_token_id`, each optional."""
    eos = metadata.optional_int("tokenizer.ggml.eos_token_id")
    eot = metadata.optional_int("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    return SpecialTokenIds(
        bos_token_id=metadata.optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        unknown_token_id=metadata.optional_int("tokenizer.ggml.unknown_token_id"),
        padding_token_id=metadata.optional_int("tokenizer.ggml.padding_token_id"),
    )


def tokenizer_from_gguf(metadata: GGUFMetadata) -> HFTokenizer:
    """The tokenizer `metadata` describes, with its special ids and chat template.

    Raises ModelLoadError naming the key when a required key is missing or malformed,
    or when `tokenizer.ggml.model` is neither "gpt2" nor "llama".
    """
    kind = metadata.require_str("tokenizer.ggml.model")
    tokens = metadata.require_strings("tokenizer.ggml.tokens")
    token_types = metadata.optional_ints("tokenizer.ggml.token_type")
    if token_types is not None and len(token_types) != len(tokens):
        raise ModelLoadError(
            f"metadata key 'tokenizer.ggml.token_type' in {metadata.source} has {len(token_types)} entries, "
            f"'tokenizer.ggml.tokens' has {len(tokens)}"
        )
    types = token_types if token_types is not None else [1] * len(tokens)
    ids = special_token_ids(metadata)
    for key, token_id in (("bos", ids.bos_token_id), ("unknown", ids.unknown_token_id),
                          ("padding", ids.padding_token_id), *(("eos/eot", i) for i in ids.eos_token_ids)):
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ModelLoadError(
                f"metadata 'tokenizer.ggml.{key}_token_id' {token_id} in {metadata.source} "
                f"is outside the vocabulary of {len(tokens)} tokens"
            )

    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens)
        alphabet = frozenset(_byte_alphabet().values())
        control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(metadata, tokens)
        control = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    else:
        raise ModelLoadError(
            f"tokenizer model {kind!r} (metadata 'tokenizer.ggml.model') in {metadata.source} "
            f"is not supported (gpt2, llama)"
        )
    named = [tokens[i] for i in (ids.bos_token_id, ids.unknown_token_id, ids.padding_token_id, *ids.eos_token_ids)
             if i is not None]
    special = list(dict.fromkeys([*control, *named]))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    user_defined = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    if user_defined:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
    return HFTokenizer.from_tokenizers(
        tokenizer, ids.bos_token_id, ids.eos_token_ids, metadata.optional_str("tokenizer.chat_template")
    )


def _byte_level_bpe(metadata: GGUFMetadata, tokens: Sequence[str]) -> RawTokenizer:
    """GPT-2 style BPE over the byte alphabet (SmolLM, Llama 3, Qwen2)."""
    spelling = _byte_alphabet()
    alphabet = frozenset(spelling.values())
    # A token spelled outside the byte alphabet (some converters store raw UTF-8) is
    # respelled byte by byte, as the merges spell it.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges = _split_merges(metadata, metadata.require_strings("tokenizer.ggml.merges"))
    tokenizer = RawTokenizer(models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False,
    ))
    split = _PRE_TOKENIZER_SPLITS.get(metadata.optional_str("tokenizer.ggml.pre") or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(metadata: GGUFMetadata, tokens: Sequence[str]) -> RawTokenizer:
    """SentencePiece BPE (Llama 1/2, Mistral v0.1): "▁" for spaces, a "▁" before the first
    word, unknown bytes as <0xNN> tokens. Merges come from the file or, as SentencePiece
    files store none, from the scores: a token that two vocabulary pieces spell is their
    merge, ranked by the token's score."""
    vocab = {token: index for index, token in enumerate(tokens)}
    listed = metadata.optional_strings("tokenizer.ggml.merges")
    if listed is not None:
        merges = _split_merges(metadata, listed)
    else:
        scores = metadata.optional_floats("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(
                f"metadata key 'tokenizer.ggml.scores' in {metadata.source} is required for a 'llama' "
                f"tokenizer without merges, one score per token"
            )
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    tokenizer = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary pieces, best score first;
    ties go to the shorter left piece, then the shorter right piece, then file order."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for token, score in scores.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted((p for p in pairs if p[0] in vocab and p[1] in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]]))
        for left, right in pairs:
            ranked.append((score, len(left), len(right), len(ranked), left, right))
    # Descending on (score, len(left), len(right)); the running index keeps ties stable.
    ranked.sort(key=lambda r: (-r[0], -r[1], -r[2], r[3]))
    return [(left, right) for *_, left, right in ranked]


def _split_merges(metadata: GGUFMetadata, merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for index, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ModelLoadError(
                f"metadata 'tokenizer.ggml.merges'[{index}] in {metadata.source} is {merge!r}, "
                f"not two pieces separated by one space"
            )
        pairs.append((parts[0], parts[1]))
    return pairs


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters: printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, soft hyphen) become chr(256), chr(257), ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(b for b in range(256) if b not in spelling):
        spelling[byte] = chr(256 + offset)
    return spelling
