"""The model package against Hugging Face transformers, on tiny random checkpoints.

Every variant is saved with save_pretrained and read back through our loader, so the
tests cover the checkpoint format as well as the numerics: no-cache logits equal HF's,
the paged path (prefill, chunks, single-token decodes into a shuffled block table)
equals the no-cache path, batching changes nothing, and a wrong decode position is
caught rather than silently tolerated.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from workers.model.attention import AttentionBatch
from workers.model.config import ModelConfig, ModelLoadError, RopeScaling
from workers.model.device import (
    cuda_memory_info,
    dtype_bytes,
    kv_budget_from_device_memory,
    resolve_dtype,
    select_device,
)
from workers.model.llama import LlamaModel
from workers.model.loader import LoadedModel, load_checkpoint, load_model
from workers.model.presets import PRESETS, build_preset
from workers.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

CPU = torch.device("cpu")
VOCAB = 300
BLOCK_SIZE = 4
NUM_BLOCKS = 24
TOLERANCE = 1e-4
VARIANTS = ("llama_gqa", "llama_bias_tied", "qwen2", "mistral")


# ---------------------------------------------------------------- checkpoints


def _write_tokenizer(directory: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))


def _make_hf_model(variant: str) -> Any:
    import transformers

    torch.manual_seed(sum(map(ord, variant)))
    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
    )
    config: Any
    model: Any
    if variant == "llama_gqa":
        config = transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(config)
    elif variant == "llama_bias_tied":
        config = transformers.LlamaConfig(
            num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True,
            # original 64 puts head_dim 16's wavelengths in all three llama3 bands.
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    elif variant == "qwen2":
        common["eos_token_id"] = [2, 5]
        config = transformers.Qwen2Config(
            num_key_value_heads=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **common,
        )
        model = transformers.Qwen2ForCausalLM(config)
    elif variant == "mistral":
        config = transformers.MistralConfig(
            num_key_value_heads=2, head_dim=32, sliding_window=None, tie_word_embeddings=False, **common,
        )
        model = transformers.MistralForCausalLM(config)
    else:
        raise AssertionError(variant)
    # HF initialises norms to one and biases to zero; randomise them so a wrong
    # norm order or a dropped bias would show in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    return model.float().eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """variant -> (checkpoint directory, HF reference model)."""
    root = tmp_path_factory.mktemp("checkpoints")
    result: dict[str, tuple[Path, Any]] = {}
    for variant in VARIANTS:
        directory = root / variant
        hf_model = _make_hf_model(variant)
        # The GQA checkpoint is sharded so the index path is exercised too.
        shard = {"max_shard_size": "150KB"} if variant == "llama_gqa" else {}
        hf_model.save_pretrained(directory, **shard)
        _write_tokenizer(directory)
        result[variant] = (directory, hf_model)
    assert (root / "llama_gqa" / "model.safetensors.index.json").is_file()
    return result


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, tuple[Path, Any]]) -> dict[str, LoadedModel]:
    return {variant: load_checkpoint(path, CPU, torch.float32) for variant, (path, _) in checkpoints.items()}


def _hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = hf_model(torch.tensor([ids])).logits[0].float()
    return logits  # [T, vocab]


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


class PagedRun:
    """One model's paged KV caches and per-request shuffled block tables."""

    def __init__(self, model: LlamaModel, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = [torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))
                          for _ in range(model.config.num_layers)]
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)

    def new_table(self, num_tokens: int) -> tuple[int, ...]:
        count = -(-num_tokens // BLOCK_SIZE)
        table, self.free_blocks = self.free_blocks[:count], self.free_blocks[count:]
        return tuple(table)

    def step(
        self,
        chunks: list[tuple[list[int], int, tuple[int, ...]]],
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """chunks of (token_ids, start_position, block_table); logits of every row."""
        ids = torch.tensor([t for token_ids, _, _ in chunks for t in token_ids])  # [T]
        if positions is None:
            positions = torch.tensor([start + i for token_ids, start, _ in chunks
                                      for i in range(len(token_ids))])  # [T]
        batch = AttentionBatch.build([(start, len(token_ids), table) for token_ids, start, table in chunks],
                                     BLOCK_SIZE, CPU)
        with torch.no_grad():
            return self.model.compute_logits(self.model(ids, positions, batch, self.kv_caches))


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_cache_logits_equal_hf(variant: str, checkpoints: dict[str, tuple[Path, Any]],
                                  loaded: dict[str, LoadedModel]) -> None:
    model = loaded[variant].model
    for seed, length in enumerate((1, 9, 40)):
        ids = _prompt(length, seed)
        with torch.no_grad():
            ours = model.compute_logits(model(torch.tensor(ids), torch.arange(length)))
        reference = _hf_logits(checkpoints[variant][1], ids)
        assert ours.dtype == torch.float32 and ours.shape == (length, VOCAB)
        assert (ours - reference).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_prefill_chunks_and_decodes_equal_hf(variant: str, checkpoints: dict[str, tuple[Path, Any]],
                                                   loaded: dict[str, LoadedModel]) -> None:
    ids = _prompt(20, seed=11)
    reference = _hf_logits(checkpoints[variant][1], ids)
    run = PagedRun(loaded[variant].model, seed=3)
    table = run.new_table(len(ids))
    # prefill 5, a 3-token chunk, then one token at a time
    bounds = [0, 5, 8] + list(range(9, len(ids) + 1))
    for start, end in zip(bounds, bounds[1:]):
        logits = run.step([(ids[start:end], start, table)])
        assert (logits - reference[start:end]).abs().max().item() < TOLERANCE, (start, end)


def test_wrong_decode_position_changes_logits(loaded: dict[str, LoadedModel]) -> None:
    model = loaded["llama_gqa"].model
    ids = _prompt(12, seed=5)
    results = []
    for wrong in (False, True):
        run = PagedRun(model, seed=1)
        table = run.new_table(len(ids))
        run.step([(ids[:11], 0, table)])
        positions = torch.zeros(1, dtype=torch.int64) if wrong else None
        results.append(run.step([(ids[11:], 11, table)], positions=positions))
    assert (results[0] - results[1]).abs().max().item() > 1e-3


@pytest.mark.parametrize("variant", ("llama_gqa", "llama_bias_tied"))
def test_batched_requests_equal_each_alone(variant: str, loaded: dict[str, LoadedModel]) -> None:
    model = loaded[variant].model
    a, b, c = _prompt(7, seed=21), _prompt(6, seed=22), _prompt(10, seed=23)
    run = PagedRun(model, seed=4)
    table_a, table_b, table_c = run.new_table(8), run.new_table(6), run.new_table(10)
    run.step([(a, 0, table_a), (c[:4], 0, table_c)])
    # One step: a decodes, b prefills, c continues with a chunk.
    batched = run.step([([a[6]], 7, table_a), (b, 0, table_b), (c[4:], 4, table_c)])

    alone = []
    for ids, history in (([a[6]], a), (b, []), (c[4:], c[:4])):
        solo = PagedRun(model, seed=9)
        table = solo.new_table(len(history) + len(ids))
        if history:
            solo.step([(history, 0, table)])
        alone.append(solo.step([(ids, len(history), table)]))
    assert (batched - torch.cat(alone)).abs().max().item() < 1e-5


def test_attention_batch_indices() -> None:
    # request 0: 2 new tokens at positions 5, 6 with blocks (7, 2); request 1: 1 token at 0
    # with block (9,); request 2: 1 token at 4 with blocks (3, 1).
    batch = AttentionBatch.build([(5, 2, (7, 2)), (0, 1, (9,)), (4, 1, (3, 1))], block_size=4, device=CPU)
    assert batch.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 9 * 4, 1 * 4]
    decodes, chunk = batch.groups  # the decodes together, then the chunk alone
    assert decodes.rows.tolist() == [2, 3]
    assert decodes.query_index.tolist() == [[2], [3]]
    assert decodes.token_index.tolist() == [0, 1]
    assert decodes.block_tables.tolist() == [[9, 0], [3, 1]]
    assert decodes.mask[:, 0, 0].tolist() == [[True] + [False] * 7, [True] * 5 + [False] * 3]
    assert chunk.rows.tolist() == [0, 1]
    assert chunk.query_index.tolist() == [[0, 1]]
    assert chunk.block_tables.tolist() == [[7, 2]]
    assert chunk.mask[0, 0].tolist() == [[True] * 6 + [False] * 2, [True] * 7 + [False]]
    with pytest.raises(ValueError, match="block_table"):
        AttentionBatch.build([(5, 4, (7, 2))], block_size=4, device=CPU)


# ---------------------------------------------------------------- config and loader


def test_config_from_checkpoints(loaded: dict[str, LoadedModel]) -> None:
    gqa, tied, qwen, mistral = (loaded[v].config for v in VARIANTS)
    assert (gqa.num_kv_heads, gqa.head_dim, gqa.qkv_bias, gqa.o_bias) == (2, 16, False, False)
    assert not gqa.tie_word_embeddings
    assert (tied.num_kv_heads, tied.qkv_bias, tied.o_bias, tied.tie_word_embeddings) == (1, True, True, True)
    assert tied.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    assert (qwen.qkv_bias, qwen.o_bias, qwen.rope_theta, qwen.eos_token_ids) == (True, False, 1e6, (2, 5))
    assert (mistral.head_dim, mistral.eos_token_ids, mistral.bos_token_id) == (32, (2,), 1)
    for variant in VARIANTS:
        model = loaded[variant].model
        assert sum(p.numel() for p in model.parameters()) == loaded[variant].config.num_parameters()
        assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert gqa.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2


def test_config_legacy_format_and_validation() -> None:
    legacy = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0, "eos_token_id": [3, 4],
        "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }
    config = ModelConfig.from_hf_dict(legacy)
    assert (config.rope_theta, config.head_dim, config.num_kv_heads) == (500000.0, 4, 2)
    assert config.eos_token_ids == (3, 4)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0
    for change, field in (({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
                          ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_scaling"),
                          ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
                          ({"num_key_value_heads": 3}, "num_heads"),
                          ({"vocab_size": None}, "vocab_size")):
        with pytest.raises(ModelLoadError, match=field):
            ModelConfig.from_hf_dict({**legacy, **change}, source="x/config.json")
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=4, num_kv_heads=0, head_dim=2)


def _copy(checkpoints: dict[str, tuple[Path, Any]], variant: str, tmp_path: Path) -> Path:
    target = tmp_path / variant
    shutil.copytree(checkpoints[variant][0], target)
    return target


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_loader_errors_name_what_is_wrong(checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nowhere not found"):
        load_checkpoint(tmp_path / "nowhere", CPU, torch.float32)

    no_config = _copy(checkpoints, "llama_bias_tied", tmp_path / "a")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        load_checkpoint(no_config, CPU, torch.float32)

    gpt2 = _copy(checkpoints, "llama_bias_tied", tmp_path / "b")
    _edit_config(gpt2, model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"model_type 'gpt2' in .*config\.json is not supported"):
        load_checkpoint(gpt2, CPU, torch.float32)

    yarn = _copy(checkpoints, "llama_bias_tied", tmp_path / "c")
    _edit_config(yarn, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope_scaling type 'yarn'"):
        load_checkpoint(yarn, CPU, torch.float32)

    missing = _copy(checkpoints, "llama_bias_tied", tmp_path / "d")
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensors in checkpoint .*layers\.0\.mlp\.up_proj\.weight"):
        load_checkpoint(missing, CPU, torch.float32)

    no_tokenizer = _copy(checkpoints, "llama_bias_tied", tmp_path / "e")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json not found"):
        load_checkpoint(no_tokenizer, CPU, torch.float32)

    no_weights = _copy(checkpoints, "llama_bias_tied", tmp_path / "f")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights in"):
        load_checkpoint(no_weights, CPU, torch.float32)

    with pytest.raises(ModelLoadError, match="neither a preset .*tiny.*small"):
        load_model("no-such-model", CPU, torch.float32)
    with pytest.raises(ModelLoadError, match="unknown preset 'huge'"):
        build_preset("huge", CPU, torch.float32)


def test_loader_prints_shard_progress(checkpoints: dict[str, tuple[Path, Any]],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    result = load_model(str(checkpoints["llama_gqa"][0]), CPU, torch.float32)
    assert result.name == "llama_gqa"
    assert "loading shard 1/" in capsys.readouterr().err


def test_hf_tokenizer(loaded: dict[str, LoadedModel]) -> None:
    tokenizer = loaded["qwen2"].tokenizer
    assert isinstance(tokenizer, HFTokenizer) and isinstance(tokenizer, Tokenizer)
    assert tokenizer.encode("t5 t7 t42") == [5, 7, 42]
    assert tokenizer.decode([1, 5, 7, 2]) == "t5 t7"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.vocab_size) == (1, (2, 5), VOCAB)


# ---------------------------------------------------------------- presets and devices


def test_preset_sizes_and_determinism() -> None:
    assert 5_000_000 <= PRESETS["tiny"].num_parameters() <= 7_000_000
    assert PRESETS["small"].num_parameters() >= 100_000_000
    first = build_preset("tiny", CPU, torch.float32, seed=0)
    second = load_model("tiny", CPU, torch.float32, seed=0)
    other = build_preset("tiny", CPU, torch.float32, seed=1)
    assert sum(p.numel() for p in first.model.parameters()) == first.config.num_parameters()
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(tensor, second.model.state_dict()[name]), name
    assert not torch.equal(first.model.model.embed_tokens.weight, other.model.model.embed_tokens.weight)


def test_the_micro_preset_decodes_alike_through_the_native_kernels_and_aten() -> None:
    """bench-router's compute-free workers: one 64-wide layer (head_dim 32, shapes the native
    kernels meet nowhere else) gives the same greedy tokens natively as through aten."""
    from workers.config import EngineArgs
    from workers.engine.collect import PromptSpec, run_to_completion
    from workers.engine.sampling import SamplingParams
    from workers.model.build import create_engine, load

    assert PRESETS["micro"].num_parameters() < 100_000
    specs = [PromptSpec(tuple(range(i, 2 * i + 20)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
             for i in range(12)]
    outputs = []
    for backend in ("native", "aten"):
        args = EngineArgs(model="micro", device="cpu", linear_backend=backend, kv_cache_memory=16 * 2**20)
        engine = create_engine(args, load(args), quiet=True)
        outputs.append([o.output_ids for o in run_to_completion(engine, specs)])
    assert outputs[0] == outputs[1]
    assert len({tuple(o) for o in outputs[0]}) > 1  # the prompts lead to different outputs


def test_byte_tokenizer_round_trip() -> None:
    tokenizer = ByteTokenizer()
    text = "KV cache: memory for compute — ≈ 1 GB/8k tokens ✓"
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids) and tokenizer.decode(ids) == text
    assert tokenizer.decode([tokenizer.BOS, *ids, tokenizer.EOS]) == text
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # a cut character still decodes
    assert tokenizer.vocab_size == PRESETS["tiny"].vocab_size == 258


def test_bfloat16_on_cpu_builds_and_runs() -> None:
    reference = build_preset("tiny", CPU, torch.float32)
    half = build_preset("tiny", CPU, resolve_dtype(CPU, "bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in half.model.parameters())
    ids = torch.tensor(ByteTokenizer().encode("The KV cache is"))
    positions = torch.arange(len(ids))
    with torch.no_grad():
        logits32 = reference.model.compute_logits(reference.model(ids, positions))
        logits16 = half.model.compute_logits(half.model(ids, positions))
        caches = [torch.zeros(half.model.kv_cache_shape(8, BLOCK_SIZE), dtype=torch.bfloat16)
                  for _ in range(half.config.num_layers)]
        batch = AttentionBatch.build([(0, len(ids), tuple(range(8)))], BLOCK_SIZE, CPU)
        paged16 = half.model.compute_logits(half.model(ids, positions, batch, caches))
    assert logits16.dtype == torch.float32 and torch.isfinite(logits16).all()
    assert (logits16 - logits32).abs().max().item() < 0.5  # bf16 rounding, not a different model
    assert (paged16 - logits16).abs().max().item() < 0.1


def test_device_and_dtype_selection() -> None:
    assert select_device("cpu") == CPU
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be"):
        select_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            select_device("cuda:0")
    assert resolve_dtype(CPU) == torch.float32
    assert resolve_dtype(CPU, "float16") == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype(CPU, "int8")
    assert [dtype_bytes(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == [4, 2, 2]
    with pytest.raises(ValueError, match="CUDA device"):
        cuda_memory_info(CPU)


def test_kv_budget_arithmetic() -> None:
    gib = 1 << 30
    # 80 GiB device, 2 GiB held by others, 90% usable, 14 GiB weights, 4 GiB activations
    budget = kv_budget_from_device_memory(78 * gib, 80 * gib, 0.9, 14 * gib, 4 * gib)
    assert budget == int(0.9 * 80 * gib) - 2 * gib - 14 * gib - 4 * gib
    assert kv_budget_from_device_memory(10 * gib, 80 * gib, 0.5, 14 * gib, 0) == 0  # never negative
    with pytest.raises(ValueError, match="utilization"):
        kv_budget_from_device_memory(1, 2, 1.5, 0, 0)
    with pytest.raises(ValueError, match="weight_bytes"):
        kv_budget_from_device_memory(1, 2, 0.5, -1, 0)
