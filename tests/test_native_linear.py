"""The native kernels (workers/model/native_linear.c): x @ W.T (+ bias) (+ residual) for a
few rows, on torch's OpenMP threads, and RMSNorm.

Compared with torch on every shape class the kernel has a branch for: widths with and
without an 8-lane tail, output counts below, at and past a 4-row block and a thread's
share, 1 to 5 rows, with and without bias and residual, on 1 and 2 threads; strided
inputs; two Python threads calling at once; and a build from scratch into an empty cache.
The model and engine comparisons against transformers run it by default (test_real_model,
test_engine_equivalence, test_packed_linear).
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from workers.model import native_linear as native_module
from workers.model.native_linear import NativeLinear, blocked, native_linear, native_linear_problem, unblocked
from workers.model.llama import RMSNorm
from workers.model.packed_linear import NATIVE_MAX_ROWS, PackedLinear
from workers.model.presets import build_preset

if native_module._compiler() is None:
    pytest.skip("no C compiler on PATH: the engine uses oneDNN alone here", allow_module_level=True)


@pytest.fixture()
def kernel() -> NativeLinear:
    assert native_linear_problem() is None, native_linear_problem()
    return native_linear()


@pytest.fixture()
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    if bias is not None:
        out = out + bias.double()
    if residual is not None:
        out = out + residual.double()
    return out.float()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_torch_on_every_branch(kernel: NativeLinear, threads: int) -> None:
    generator = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for in_features in (5, 8, 13, 64, 576, 1541):
            for out_features in (1, 3, 4, 7, 9, 40, 97):
                w = torch.randn(out_features, in_features, generator=generator)  # [out, in]
                bias = torch.randn(out_features, generator=generator)
                for rows in (1, 2, 5):
                    x = torch.randn(rows, in_features, generator=generator)
                    residual = torch.randn(rows, out_features, generator=generator)
                    for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
                        got = kernel.linear(x, blocked(w), b, r)
                        assert got.shape == (rows, out_features)
                        torch.testing.assert_close(got, _reference(x, w, b, r), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_the_rms_norm_equals_torchs(kernel: NativeLinear) -> None:
    generator = torch.Generator().manual_seed(5)
    for n in (3, 8, 13, 576, 1541):
        for rows in (1, 2, 7):
            x = torch.randn(rows, n, generator=generator) * 3
            weight = torch.randn(n, generator=generator)
            expected = torch.nn.functional.rms_norm(x.double(), (n,), weight.double(), 1e-5).float()
            torch.testing.assert_close(kernel.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)
    # A strided input (a slice of a wider activation) and a large eps (the eps is used).
    wide = torch.randn(4, 2, 16, generator=generator)
    torch.testing.assert_close(kernel.rms_norm(wide[:, 0], torch.ones(16), 10.0),
                               torch.nn.functional.rms_norm(wide[:, 0], (16,), torch.ones(16), 10.0))


def test_a_native_model_runs_its_norms_natively() -> None:
    loaded = build_preset("tiny", torch.device("cpu"), torch.float32)
    loaded.model.pack_linears(native=True)
    norms = [m for m in loaded.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel == native_linear().rms_norm for m in norms)


def test_a_native_model_keeps_its_blocked_weights_in_one_huge_page_tensor() -> None:
    """Every projection's and the head's blocked copy is a 64-byte aligned view of one
    tensor (madvised onto 2 MiB pages) holding the weights it copies; a tied head's copy
    is the embedding's, which stays row-major and unchanged for its lookups."""
    loaded = build_preset("tiny", torch.device("cpu"), torch.float32)
    model = loaded.model
    embedding_before = model.model.embed_tokens.weight.detach().clone()
    model.pack_linears(native=True)
    layers = list(model.model.layers)
    packs = [p for layer in layers for p in (layer.self_attn.qkv_packed, layer.self_attn.o_packed,  # type: ignore[union-attr]
                                             layer.mlp.gate_up_packed, layer.mlp.down_packed)]  # type: ignore[union-attr]
    packs.append(model.head_packed)
    storages = {p.blocked.untyped_storage().data_ptr() for p in packs}
    assert len(storages) == 1
    assert all(p.blocked.data_ptr() % 64 == 0 and p.blocked.is_contiguous() for p in packs)
    for layer in layers:
        assert torch.equal(layer.mlp.gate_up_packed.blocked, blocked(layer.mlp.gate_up_t.t()))
        assert torch.equal(unblocked(layer.self_attn.qkv_packed.blocked), layer.self_attn.qkv_t.t())
    assert model.config.tie_word_embeddings
    assert torch.equal(unblocked(model.head_packed.blocked), model.model.embed_tokens.weight)
    assert torch.equal(model.model.embed_tokens.weight, embedding_before)


def test_the_plain_sum_reads_every_element_once(kernel: NativeLinear, two_threads: None) -> None:
    generator = torch.Generator().manual_seed(13)
    for numel in (1, 31, 32, 33, 1000, 100_003):
        x = torch.randn(numel, generator=generator)
        assert kernel.sum(x) == pytest.approx(float(x.double().sum()), rel=1e-4, abs=1e-3)
    ones = torch.ones(3 * 2**20 + 7)
    assert kernel.sum(ones) == 3 * 2**20 + 7
    with pytest.raises(ValueError, match="contiguous float32"):
        kernel.sum(torch.ones(8, 8).t())


def test_huge_page_tensor_is_the_size_asked_for() -> None:
    for numel in (1, 1000, (2 << 20) // 4, 3 * (2 << 20) // 4 + 5):
        tensor = native_module.huge_page_tensor(numel)
        assert tensor.shape == (numel,) and tensor.dtype == torch.float32 and tensor.is_contiguous()
        tensor.fill_(1.5)  # every element writable
        assert float(tensor.sum()) == 1.5 * numel


def test_strided_rows_and_residuals_are_read_correctly(kernel: NativeLinear) -> None:
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(24, 32, generator=generator)
    wide = torch.randn(3, 2, 32, generator=generator)  # rows of x are every other [32] slice
    residual = torch.randn(24, 3, generator=generator).t()  # [3, 24], not contiguous
    torch.testing.assert_close(kernel.linear(wide[:, 1], blocked(w), None, residual),
                               _reference(wide[:, 1], w, None, residual), rtol=1e-5, atol=1e-4)


def test_packed_linear_sends_a_few_rows_to_the_kernel_and_more_to_onednn(kernel: NativeLinear) -> None:
    generator = torch.Generator().manual_seed(3)
    weight_t = torch.randn(96, 40, generator=generator)  # [in, out]
    bias = torch.randn(40, generator=generator)
    both = PackedLinear(weight_t, bias, native=True)
    onednn = PackedLinear(weight_t, bias)
    assert both.blocked is not None
    for rows in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 16):
        x = torch.randn(rows, 96, generator=generator)
        residual = torch.randn(rows, 40, generator=generator)
        expected = kernel.linear(x, both.blocked, bias) if rows <= NATIVE_MAX_ROWS else onednn(x)
        assert torch.equal(both(x), expected)
        expected_add = kernel.linear(x, both.blocked, bias, residual) if rows <= NATIVE_MAX_ROWS else onednn.add(x, residual)
        assert torch.equal(both.add(x, residual), expected_add)
        torch.testing.assert_close(both(x), x @ weight_t + bias, rtol=1e-5, atol=1e-4)


def test_blocked_interleaves_each_block_of_four_rows_and_leaves_the_rest() -> None:
    w = torch.arange(6 * 12, dtype=torch.float32).reshape(6, 12)  # [out 6, in 12]: one block, 2 rows past it
    got = blocked(w)
    first_block = torch.cat([w[0, :8], w[1, :8], w[2, :8], w[3, :8], w[0, 8:], w[1, 8:], w[2, 8:], w[3, 8:]])
    assert torch.equal(got[:4].reshape(-1), first_block)
    assert torch.equal(got[4:], w[4:])
    for out_features, in_features in ((1, 5), (4, 8), (7, 13), (9, 576), (40, 1541)):
        weight = torch.randn(out_features, in_features)
        assert torch.equal(unblocked(blocked(weight)), weight)
    embedding = torch.randn(50, 16)  # [vocab, hidden]: a tied head's copy, the embedding untouched
    before = embedding.clone()
    head = PackedLinear(embedding.t(), None, native=True)
    assert head.blocked is not None and head.blocked.data_ptr() != embedding.data_ptr()
    assert torch.equal(unblocked(head.blocked), embedding) and torch.equal(embedding, before)


def test_two_python_threads_calling_at_once_each_get_their_own_answer(kernel: NativeLinear, two_threads: None) -> None:
    generator = torch.Generator().manual_seed(11)
    jobs = [(torch.randn(1 + i % 3, 576, generator=generator), torch.randn(960, 576, generator=generator))
            for i in range(4)]
    expected = [_reference(x, w, None, None) for x, w in jobs]
    jobs = [(x, blocked(w)) for x, w in jobs]
    failures: list[str] = []

    def run(index: int) -> None:
        x, w = jobs[index]
        for _ in range(200):
            got = kernel.linear(x, w)
            if not torch.allclose(got, expected[index], rtol=1e-5, atol=1e-4):
                failures.append(f"thread {index}: max error {(got - expected[index]).abs().max():.3g}")
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_the_kernel_runs_on_torchs_own_openmp_runtime(kernel: NativeLinear) -> None:
    """One libgomp in the process: the kernel's threads are torch's (native_linear.c says why)."""
    kernel.linear(torch.randn(1, 64), torch.randn(64, 64))
    loaded = set(re.findall(r"\S*libgomp\S*", Path("/proc/self/maps").read_text()))
    assert len(loaded) == 1, loaded


def test_a_fresh_cache_builds_the_library_once_and_it_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert native_module.cache_dir() == tmp_path / "cache"
    compiler = native_module._compiler()
    libgomp = native_module._torch_libgomp()
    assert compiler is not None and libgomp is not None
    target = tmp_path / "cache" / "native" / "native_linear-test.so"
    assert native_module._build(compiler, libgomp, target) is None
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary left behind
    built = NativeLinear(target)
    x, w = torch.randn(2, 20), torch.randn(9, 20)
    torch.testing.assert_close(built.linear(x, blocked(w)), _reference(x, w, None, None), rtol=1e-5, atol=1e-4)
    # A compiler that fails leaves no library and says what it said.
    broken = tmp_path / "cc-broken"
    broken.write_text("#!/bin/sh\necho 'no such luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    problem = native_module._build(str(broken), libgomp, tmp_path / "cache" / "native" / "other.so")
    assert problem is not None and "no such luck" in problem
    assert not (tmp_path / "cache" / "native" / "other.so").exists()
    shutil.rmtree(tmp_path / "cache")
