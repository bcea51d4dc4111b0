"""Tiny random Hugging Face checkpoints, written to disk by the tests with `transformers`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 300

# ids 0..4, in this order: make_checkpoint's config says bos 1 ("<s>") and eos 2 ("</s>"), so
# the template's end of turn "<|im_end|>" (4) is not an EOS id: the case where the router must
# add it to a chat request's stops.
CHAT_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
IM_END_ID = 4
# ChatML with a BOS, a refusal through raise_exception, and tojson.
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a conversation cannot start with a tool message') }}"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'tool' %}{{ {'result': message['content']} | tojson }}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "You are a helpful assistant. Answer briefly.",
    "The KV cache holds the keys and values of every token so far.",
    "Hello! How are you today? What is a paged attention block?",
    "Unicode too: café, naïve, système, Grüße, 日本語, emoji 🙂.",
)


def write_word_tokenizer(directory: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """A tokenizer.json whose words t0..tN map to ids 0..N, separated by whitespace."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))


def write_chat_tokenizer(directory: Path, chat_template: str = CHATML_TEMPLATE) -> Any:
    """A byte-level BPE tokenizer of VOCAB_SIZE ids (trained on a few sentences, so it has merges)
    with CHAT_SPECIAL_TOKENS as its special tokens, saved by transformers with `chat_template`
    (tokenizer.json, tokenizer_config.json, chat_template.jinja). Returns the transformers tokenizer."""
    import transformers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE and tokenizer.token_to_id("<|im_end|>") == IM_END_ID
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    wrapped.chat_template = chat_template
    directory.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(directory)
    return wrapped


def make_chat_checkpoint(directory: Path, seed: int = 0) -> Any:
    """make_checkpoint's gqa Llama with write_chat_tokenizer's tokenizer and template; returns the
    transformers tokenizer."""
    make_checkpoint(directory, "gqa", seed=seed)
    return write_chat_tokenizer(directory)


def make_checkpoint(directory: Path, variant: str, seed: int = 0, max_shard_size: str | None = None) -> Any:
    """Save a random-weight model of the given variant; return the transformers model (eval, float32).

    gqa:   Llama, 4 heads over 2 KV heads, untied output head.
    mqa:   Llama, 1 KV head, q/k/v/o bias, tied embeddings, llama3 rope scaling.
    qwen2: Qwen2, q/k/v bias, 2 KV heads.
    """
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    if variant == "gqa":
        config = transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(config)
    elif variant == "mqa":
        config = transformers.LlamaConfig(
            num_key_value_heads=1,
            attention_bias=True,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    elif variant == "qwen2":
        config = transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    model = model.float().eval()
    directory.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    write_word_tokenizer(directory)
    return model


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face generate(do_sample=False), EOS disabled so exactly max_new_tokens come out."""
    generation_config = copy.deepcopy(model.generation_config)
    # Like ignore_eos: an id outside the vocabulary, because generate() fills a None from the model's config.
    generation_config.eos_token_id = [model.config.vocab_size + 1]
    generation_config.pad_token_id = 0
    generation_config.do_sample = False
    generation_config.max_new_tokens = max_new_tokens
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config)
    tokens = [int(t) for t in out[0, len(prompt_ids) :]]
    assert len(tokens) == max_new_tokens, "the reference stopped early"
    return tokens


def config_json(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "config.json").read_text()))
