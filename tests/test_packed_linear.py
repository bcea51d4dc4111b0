"""The CPU decode fast path: projections through oneDNN on packed weights, and through the
native kernel for calls of a few rows.

The engine picks both for float32 on CPU by default ("auto": native where its kernel
builds), so every other model and equivalence test (test_engine_equivalence, test_model,
test_real_model) already runs them against transformers; here: the choice and its errors,
the packed model against torch's own matmuls on the same weights, and what packing leaves
untouched. The kernel itself: test_native_linear.py.
"""

from __future__ import annotations

import pytest
import torch

from workers.config import EngineArgs
from workers.engine.collect import PromptSpec, run_to_completion
from workers.engine.sampling import SamplingParams
from workers.model.attention import AttentionBatch
from workers.model.build import create_engine, load
from workers.model.native_linear import native_linear_problem
from workers.model.packed_linear import PackedLinear, select_linear_backend
from workers.model.presets import build_preset

CPU = torch.device("cpu")


def test_backend_choice_and_errors_name_the_flag() -> None:
    auto = "native" if native_linear_problem() is None else "onednn"
    assert select_linear_backend(CPU, torch.float32) == auto
    assert select_linear_backend(CPU, torch.float32, "onednn") == "onednn"
    assert select_linear_backend(CPU, torch.float32, "aten") == "aten"
    # auto quietly keeps torch's matmul where oneDNN's packing does not apply...
    assert select_linear_backend(CPU, torch.bfloat16) == "aten"
    assert select_linear_backend(torch.device("cuda"), torch.float32) == "aten"
    # ...while asking for it there is an error that says why.
    with pytest.raises(ValueError, match="--linear-backend onednn: it packs float32 weights only"):
        select_linear_backend(CPU, torch.bfloat16, "onednn")
    with pytest.raises(ValueError, match="--linear-backend onednn: it runs on CPU only"):
        select_linear_backend(torch.device("cuda"), torch.float32, "onednn")
    with pytest.raises(ValueError, match="--linear-backend native: it packs float32 weights only"):
        select_linear_backend(CPU, torch.bfloat16, "native")
    with pytest.raises(ValueError, match="--linear-backend must be one of auto, native, onednn, aten, got 'mkl'"):
        select_linear_backend(CPU, torch.float32, "mkl")
    with pytest.raises(ValueError,
                       match="EngineArgs.linear_backend must be one of auto, native, onednn, aten, got 'fast'"):
        EngineArgs(linear_backend="fast")
    with pytest.raises(ValueError, match="PackedLinear needs a float32 CPU weight"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.bfloat16), None)


def test_packed_linear_equals_matmul_at_every_batch_size() -> None:
    generator = torch.Generator().manual_seed(0)
    weight_t = torch.randn(96, 40, generator=generator)  # [in, out]
    bias = torch.randn(40, generator=generator)
    packed = PackedLinear(weight_t, bias)
    for rows in (1, 3, 16, 70):
        x = torch.randn(rows, 96, generator=generator)
        torch.testing.assert_close(packed(x), torch.addmm(bias, x, weight_t), rtol=1e-5, atol=1e-5)
    # A strided view (a slice of a wider activation) is read correctly too.
    wide = torch.randn(5, 2, 96, generator=generator)
    torch.testing.assert_close(packed(wide[:, 1]), wide[:, 1] @ weight_t + bias, rtol=1e-5, atol=1e-5)


def test_packed_model_equals_torch_matmuls_and_keeps_its_parameters() -> None:
    plain = build_preset("tiny", CPU, torch.float32)
    packed = build_preset("tiny", CPU, torch.float32)
    before = {name: value.clone() for name, value in packed.model.state_dict().items()}
    packed.model.pack_linears()
    assert packed.model.packed and not plain.model.packed
    after = packed.model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], value) for name, value in before.items())

    config = plain.config
    block_size = 4
    with torch.inference_mode():
        for length in (1, 7, 33):
            ids = torch.arange(length) % config.vocab_size
            positions = torch.arange(length)
            reference = plain.model.compute_logits(plain.model(ids, positions))
            torch.testing.assert_close(packed.model.compute_logits(packed.model(ids, positions)), reference,
                                       rtol=1e-4, atol=1e-4)
        # The paged path, as the runner drives it: a prompt, then one decode.
        caches = [[torch.zeros(packed.model.kv_cache_shape(16, block_size)) for _ in range(config.num_layers)]
                  for _ in range(2)]
        table = list(range(10))
        prompt = torch.arange(9) % config.vocab_size
        for model, cache in zip((plain.model, packed.model), caches):
            model(prompt, torch.arange(9), AttentionBatch.build([(0, 9, table)], block_size, CPU), cache)
        step = AttentionBatch.build([(9, 1, table)], block_size, CPU)
        token = torch.tensor([5])
        decoded = [m.compute_logits(m(token, torch.tensor([9]), step, c)) for m, c in zip((plain.model, packed.model), caches)]
        torch.testing.assert_close(decoded[1], decoded[0], rtol=1e-4, atol=1e-4)


def test_engines_on_every_backend_give_the_same_greedy_tokens() -> None:
    """The tiny preset, eight requests batched with staggered lengths (so decode steps of
    1 to 8 rows: native and oneDNN calls both): the oneDNN and native engines' greedy tokens
    equal torch-matmul's (the transformers comparisons run the default)."""
    outputs = []
    backends = ("aten", "onednn") if native_linear_problem() else ("aten", "onednn", "native")
    for backend in backends:
        args = EngineArgs(model="tiny", device="cpu", kv_cache_memory=16 * 2**20, linear_backend=backend)
        loaded = load(args)
        assert loaded.model.packed == (backend != "aten")
        assert loaded.model.native_linear == (backend == "native")
        engine = create_engine(args, loaded, quiet=True)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = [tuple(range(3, 3 + n)) for n in (1, 5, 16, 17, 30, 2, 9, 40)]
        outputs.append([r.output_ids for r in run_to_completion(engine, [PromptSpec(p, params) for p in prompts])])
    assert all(output == outputs[0] for output in outputs[1:])
