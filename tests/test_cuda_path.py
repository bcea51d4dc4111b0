"""The CUDA path's logic, on CPU: KV sizing from a memory profile, the decode-attention
backend choice and its fall back, the compiled dense parts, and the 1B preset's shape.

The CUDA calls themselves (torch.cuda memory stats, FlashInfer, inductor) run in
`make gpu-check` on a GPU; here the pure parts run on given numbers and the hooks run
with reference kernels written in plain torch.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from workers.config import EngineArgs
from workers.model.attention import AttentionBatch, paged_attention
from workers.model.backends import check_decode_kernel, make_decode_kernel, select_attention_backend
from workers.model.build import _profiled_kv_budget, create_engine, kv_pool_size, load
from workers.model.llama import build_empty_model
from workers.model.memory import (
    MemoryProfile,
    describe_budget,
    kv_budget_from_profile,
    profile_cuda_memory,
    run_profiling_step,
)
from workers.model.presets import PRESETS, build_preset

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device value only; nothing here runs on it
GIB = 2**30


def _profile(**overrides: int) -> MemoryProfile:
    values = dict(total_bytes=80 * GIB, used_bytes=6 * GIB, torch_reserved_bytes=5 * GIB,
                  weight_bytes=3 * GIB, peak_torch_bytes=4 * GIB, profiled_tokens=2048)
    values.update(overrides)
    return MemoryProfile(**values)


# ---------------------------------------------------------------- KV sizing


def test_kv_budget_from_profile_arithmetic() -> None:
    # 80 GiB device at 0.9: 72 GiB allowed; 1 GiB not torch (6 used - 5 torch reserved);
    # torch peaked at 4 GiB (3 weights + 1 activations) -> 67 GiB for KV.
    budget = kv_budget_from_profile(_profile(), 0.9)
    assert budget.allowed_bytes == int(0.9 * 80 * GIB)
    assert budget.non_torch_bytes == 1 * GIB
    assert budget.weight_bytes == 3 * GIB and budget.activation_bytes == 1 * GIB
    assert budget.kv_bytes == int(0.9 * 80 * GIB) - 1 * GIB - 4 * GIB
    # Another process holding 70 GiB leaves nothing, never a negative pool.
    assert kv_budget_from_profile(_profile(used_bytes=75 * GIB), 0.9).kv_bytes == 0
    line = describe_budget(budget, _profile(), 0.9)
    assert "0.9 x 80.00 GiB" in line and "profiled step of 2048 tokens" in line and "67.00 GiB for the KV pool" in line
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_from_profile(_profile(), 1.5)
    with pytest.raises(ValueError, match="used_bytes"):
        _profile(used_bytes=81 * GIB)
    with pytest.raises(ValueError, match="peak_torch_bytes"):
        _profile(peak_torch_bytes=1 * GIB)


def test_profiled_budget_is_measured_once_and_reused() -> None:
    """The worker sizes its pool twice (create_engine, then its info): the second answer
    must come from the same profile, not from a device the first pool already fills."""
    loaded = build_preset("tiny", CPU, torch.float32)
    args = EngineArgs(device="cpu", gpu_memory_utilization=0.5, max_num_batched_tokens=512, max_num_seqs=8)
    loaded.memory_profiles[(512, 8)] = _profile()  # as if measured on a GPU
    expected = kv_budget_from_profile(_profile(), 0.5).kv_bytes
    assert _profiled_kv_budget(args, loaded) == expected == _profiled_kv_budget(args, loaded)


def test_profiling_step_runs_the_largest_step_and_cuda_profile_needs_cuda() -> None:
    loaded = build_preset("tiny", CPU, torch.float32)
    run_profiling_step(loaded.model, num_tokens=100, num_sampled=64, block_size=16)  # 100: not a block multiple
    with pytest.raises(ValueError, match="CUDA device"):
        profile_cuda_memory(loaded.model, 100, 64, 16)


def test_gpu_memory_utilization_without_cuda_is_an_error_naming_the_flag() -> None:
    args = EngineArgs(model="tiny", device="cpu", gpu_memory_utilization=0.8)
    loaded = load(args)
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*--kv-cache-memory"):
        kv_pool_size(args, loaded)
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(kv_cache_memory=2**20, gpu_memory_utilization=0.8)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(attention_backend="flash")
    # Without the flag CPU keeps its fixed default.
    assert kv_pool_size(EngineArgs(device="cpu"), loaded).num_blocks * 131072 == 256 * 2**20


# ---------------------------------------------------------------- decode attention backends


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_attention_backend(CPU).name == "sdpa"
    assert select_attention_backend(CUDA, "sdpa").name == "sdpa"
    with pytest.raises(ValueError, match="--attention-backend flashinfer needs a CUDA device"):
        select_attention_backend(CPU, "flashinfer")

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises: not installed
    assert select_attention_backend(CUDA) == ("sdpa", "flashinfer is not installed")
    with pytest.raises(ValueError, match="not importable"):
        select_attention_backend(CUDA, "flashinfer")

    monkeypatch.setitem(sys.modules, "flashinfer", ModuleType("flashinfer"))  # importable
    assert select_attention_backend(CUDA).name == "flashinfer"
    assert select_attention_backend(CUDA, "flashinfer").name == "flashinfer"
    assert select_attention_backend(CPU).name == "sdpa"  # never on CPU, installed or not


class ReferenceDecode:
    """A plain-torch decode kernel with FlashInferDecode's plan/run contract."""

    def __init__(self, block_size: int, scale: float, wrong: bool = False) -> None:
        self.block_size, self.scale, self.wrong = block_size, scale, wrong
        self.planned: list[tuple[int, Sequence[int]]] = []

    def plan(self, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None:
        self.planned = list(zip(context_lens, block_tables))

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert q.shape[0] == len(self.planned)
        rows = []
        for b, (length, table) in enumerate(self.planned):
            blocks = torch.tensor(list(table[: math.ceil(length / self.block_size)]))
            kv = kv_cache[:, :, blocks].flatten(2, 3)[:, :, :length]  # [2, KVH, length, D]
            repeat = q.shape[1] // kv.shape[1]
            keys, values = kv[0].repeat_interleave(repeat, 0), kv[1].repeat_interleave(repeat, 0)
            scores = torch.einsum("hd,hld->hl", q[b], keys) * self.scale  # [H, length]
            rows.append(torch.einsum("hl,hld->hd", scores.softmax(-1), values))  # [H, D]
        out = torch.stack(rows)  # [B, H, D]
        return out + 1.0 if self.wrong else out


def test_decode_kernel_hook_equals_sdpa_in_mixed_and_decode_only_steps() -> None:
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    cache = torch.randn(2, kv_heads, 12, block, dim, generator=generator)
    # A prefill chunk between two decodes: decode rows 0 and 4, chunk rows 1..3.
    sequences = [(6, 1, (3, 8)), (0, 3, (5,)), (9, 1, (0, 11, 2))]
    q = torch.randn(5, heads, dim, generator=generator)
    k, v = torch.randn(5, kv_heads, dim, generator=generator), torch.randn(5, kv_heads, dim, generator=generator)
    scale = dim ** -0.5
    reference = paged_attention(q, k, v, cache.clone(), AttentionBatch.build(sequences, block, CPU), scale)
    kernel = ReferenceDecode(block, scale)
    kernel.plan([7, 10], [(3, 8), (0, 11, 2)])
    fused = paged_attention(q, k, v, cache.clone(), AttentionBatch.build(sequences, block, CPU, decode_kernel=kernel),
                            scale)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)

    decode_only = [sequences[0], sequences[2]]
    rows = torch.tensor([0, 4])
    reference = paged_attention(q[rows], k[rows], v[rows], cache.clone(),
                                AttentionBatch.build(decode_only, block, CPU), scale)
    fused = paged_attention(q[rows], k[rows], v[rows], cache.clone(),
                            AttentionBatch.build(decode_only, block, CPU, decode_kernel=kernel), scale)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)


def test_a_kernel_that_disagrees_or_cannot_build_falls_back_to_sdpa(capsys: pytest.CaptureFixture[str]) -> None:
    config = PRESETS["tiny"]
    scale = config.head_dim ** -0.5
    assert check_decode_kernel(ReferenceDecode(16, scale), config, 16, torch.float32, CPU) is None
    problem = check_decode_kernel(ReferenceDecode(16, scale, wrong=True), config, 16, torch.float32, CPU)
    assert problem is not None and "difference from SDPA" in problem
    # FlashInfer cannot build here (not installed, no GPU): the runner keeps SDPA and says why.
    choice = make_decode_kernel("flashinfer", config, 16, torch.float32, CPU)
    assert choice.kernel is None and choice.name == "sdpa"
    assert "flashinfer decode attention is off, using SDPA" in capsys.readouterr().err


def test_cpu_engine_selects_sdpa_and_eager() -> None:
    args = EngineArgs(model="tiny", device="cpu", kv_cache_memory=2**20)
    loaded = load(args)
    engine = create_engine(args, loaded, quiet=True)
    assert engine.runner.attention_backend == "sdpa" and engine.runner.decode_kernel is None
    assert all(layer.mlp.kernel.__name__ == "swiglu" for layer in loaded.model.model.layers)
    # float32 on CPU: the projections go through oneDNN on packed weights (packed_linear.py).
    assert loaded.model.packed


# ---------------------------------------------------------------- compiled dense parts, the 1B preset


def test_compiled_dense_parts_equal_eager() -> None:
    """compile_dense's wiring (one compiled function per kind, weights as arguments,
    dynamic sizes) under dynamo's eager backend: the same numbers, any step size."""
    eager = build_preset("tiny", CPU, torch.float32)
    compiled = build_preset("tiny", CPU, torch.float32)
    compiled.model.compile_dense(backend="eager")
    with torch.inference_mode():
        for length in (1, 7, 33):
            ids = torch.arange(length) % 250
            positions = torch.arange(length)
            torch.testing.assert_close(compiled.model(ids, positions), eager.model(ids, positions), atol=0, rtol=0)


def test_llama_3_2_1b_preset_has_the_real_shape() -> None:
    c = PRESETS["llama-3.2-1b"]
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (
        2048, 16, 32, 8, 8192, 128256)
    assert c.head_dim == 64 and c.tie_word_embeddings and c.rope_theta == 500000.0
    assert c.rope_scaling is not None and c.rope_scaling.factor == 32.0
    assert c.kv_bytes_per_token(2) == 32768  # 2 x 16 layers x 8 heads x 64 x 2 B: 32 KiB per token in bf16
    model = build_empty_model(c)  # on the meta device: no memory
    assert sum(p.numel() for p in model.parameters()) == c.num_parameters() == 1_235_814_400


def test_gpu_check_smoke_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make gpu-check`'s script, reduced to seconds on CPU: equivalence passes in float32
    with exact argmax agreement, for the engine with step graphs and the eager one (the
    same engine on CPU: graphs are recorded on CUDA only), and the benchmark reports every
    batch for both, side by side, and the KV pool."""
    from loadtest.gpu_check import main

    assert main(["--device", "cpu", "--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    equivalence, bench = report["equivalence"], report["benchmark"]
    assert equivalence["passed"] and equivalence["argmax_match_fraction"] == 1.0
    assert [row["batch"] for row in bench["decode"]] == [1, 4]
    assert all(row["tokens_per_s"] > 0 and 0 < row["mbu"] for row in bench["decode"])
    assert bench["kv_pool_bytes"] == 64 * 2**20 and bench["attention_backend"] == "sdpa"
    assert equivalence["eager"]["passed"] and equivalence["requests_equal_to_eager"] == equivalence["num_requests"]
    assert [row["batch"] for row in bench["eager"]["decode"]] == [1, 4] and bench["num_graphs"] == 0
    assert "| batch | eager ms/step | graphs ms/step | graphs / eager tokens/s |" in capsys.readouterr().out
