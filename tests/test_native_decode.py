"""The whole-step native decode (workers/model/native_decode.c): every layer of a decode-only
step of up to NATIVE_DECODE_MAX_ROWS requests in one call.

Compared with the eager path (the same model with the native decoder switched off) on
shapes that reach every branch: head dims with and without an 8-lane tail, GQA and MQA,
q/k/v and o biases, llama3 rope scaling, contexts that straddle block edges, 1 to 40 rows
(x-row tiles of 3 with tails of 1 and 2; past 4 rows only the first tile prefetches),
1 and 2 threads. The transformers comparisons (test_real_model, test_engine_equivalence,
test_packed_linear) run it by default: their engines are native wherever it builds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch

from workers.config import EngineArgs
from workers.engine.collect import PromptSpec, run_to_completion
from workers.engine.sampling import SamplingParams
from workers.model import native_linear as native_module
from workers.model.attention import AttentionBatch
from workers.model.build import create_engine, load
from workers.model.config import RopeScaling
from workers.model.llama import LlamaModel, build_empty_model
from workers.model.native_decode import NATIVE_DECODE_MAX_ROWS, PHASES, NativeDecoder
from workers.model.presets import PRESETS

if native_module._compiler() is None:
    pytest.skip("no C compiler on PATH: the engine uses oneDNN alone here", allow_module_level=True)

BLOCK_SIZE = 16
# Prompt lengths around block edges (15/16/17, 31/32/33) and short ones; row b of a step is
# request b % len(...), so 16 rows repeat some lengths with other tokens.
PROMPT_LENGTHS = (15, 16, 17, 1, 31, 32, 33, 5)

TINY = PRESETS["tiny"]
SHAPES = {
    # SmolLM2's head layout in small: 64-wide heads, 2 query heads per KV head.
    "gqa": TINY,
    # Every tail: head dim 12 (8 + 4), hidden 60, intermediate 100; one KV head; biases;
    # llama3 rope scaling.
    "mqa-bias-tails": dataclasses.replace(
        TINY, hidden_size=60, intermediate_size=100, num_layers=3, num_heads=5, num_kv_heads=1, head_dim=12,
        qkv_bias=True, o_bias=True,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64),
    ),
}


def _model(name: str) -> LlamaModel:
    """Random weights (norm weights near 1, biases too) packed for the native kernels."""
    config = SHAPES[name]
    model = build_empty_model(config).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=generator)
    model.requires_grad_(False)
    model.eval()
    model.fuse_projections()
    model.pack_linears(native=True)
    assert model.native_decoder is not None
    return model


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request: pytest.FixtureRequest) -> LlamaModel:
    return _model(request.param)


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


class Prefilled:
    """`rows` requests prefilled by the eager path into a fresh cache, each on its own
    blocks (in an order that is not sorted), ready for one decode step."""

    def __init__(self, model: LlamaModel, rows: int, seed: int = 0) -> None:
        config = model.config
        generator = torch.Generator().manual_seed(seed)
        self.lengths = [PROMPT_LENGTHS[b % len(PROMPT_LENGTHS)] for b in range(rows)]
        num_blocks = 1 + sum(length // BLOCK_SIZE + 1 for length in self.lengths)
        self.caches = [torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE)) for _ in range(config.num_layers)]
        free = torch.randperm(num_blocks - 1, generator=generator).add(1).tolist()  # block 0: padding
        self.tables = []
        for length in self.lengths:
            needed = length // BLOCK_SIZE + 1  # room for the decoded token
            self.tables.append([free.pop() for _ in range(needed)])
        with torch.inference_mode():
            for length, table in zip(self.lengths, self.tables):
                ids = torch.randint(0, config.vocab_size, (length,), generator=generator)
                model(ids, torch.arange(length), AttentionBatch.build([(0, length, table)], BLOCK_SIZE, "cpu"),
                      self.caches)
        self.tokens = torch.randint(0, config.vocab_size, (rows,), generator=generator)

    def decode(self, model: LlamaModel, native: bool,
               rows: list[int] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One decode step of the given requests (default: all) on a copy of the caches:
        (final hidden rows, the caches after the step)."""
        rows = list(range(len(self.lengths))) if rows is None else rows
        caches = [c.clone() for c in self.caches]
        batch = AttentionBatch.build([(self.lengths[b], 1, self.tables[b]) for b in rows], BLOCK_SIZE, "cpu")
        decoder = model.native_decoder
        if not native:
            model.native_decoder = None
        try:
            with torch.inference_mode():
                hidden = model(self.tokens[rows], torch.tensor([self.lengths[b] for b in rows]), batch, caches)
        finally:
            model.native_decoder = decoder
        return hidden, caches


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_a_decode_step_equals_the_eager_path(model: LlamaModel, threads: int, rows: int) -> None:
    """The final hidden rows, the logits' argmax and every cache entry (the new K/V where
    the step wrote it, the rest untouched) equal the eager step's."""
    state = Prefilled(model, rows, seed=rows)
    native_hidden, native_caches = state.decode(model, native=True)
    eager_hidden, eager_caches = state.decode(model, native=False)
    torch.testing.assert_close(native_hidden, eager_hidden, rtol=1e-5, atol=2e-5)
    assert torch.equal(model.compute_logits(native_hidden).argmax(-1), model.compute_logits(eager_hidden).argmax(-1))
    for layer, (native_cache, eager_cache, before) in enumerate(zip(native_caches, eager_caches, state.caches)):
        torch.testing.assert_close(native_cache, eager_cache, rtol=1e-5, atol=2e-5, msg=f"layer {layer}")
        written = (native_cache != before).any(dim=-1).sum().item()  # (K or V, head, slot) rows changed
        assert 0 < written <= 2 * model.config.num_kv_heads * rows, f"layer {layer}"


def test_a_request_gets_the_same_bits_alone_and_in_a_batch(model: LlamaModel, threads: int) -> None:
    """Each (request, head) is attended on its own and every projection sums in one order,
    so batching never changes a request's numbers: the determinism a user checks by
    replaying one request."""
    state = Prefilled(model, 40, seed=11)
    batched, _ = state.decode(model, native=True)
    for row in (0, 5, 39):
        alone, _ = state.decode(model, native=True, rows=[row])
        assert torch.equal(alone[0], batched[row]), row


def test_only_decode_steps_of_a_few_rows_go_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills and decode steps of more than NATIVE_DECODE_MAX_ROWS rows stay on the eager
    path (and still equal it: the engine tests); a decode of NATIVE_DECODE_MAX_ROWS rows is
    one call."""
    model = _model("gqa")
    calls: list[int] = []
    original = NativeDecoder.forward

    def counted(self: NativeDecoder, hidden: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return original(self, hidden, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(NativeDecoder, "forward", counted)
    state = Prefilled(model, NATIVE_DECODE_MAX_ROWS + 1)
    # Prefills of more than one token are eager; a one-token prompt is a decode-only step.
    assert calls == [1] * state.lengths.count(1)
    calls.clear()
    state.decode(model, native=True)
    assert calls == []
    state.decode(model, native=True, rows=list(range(NATIVE_DECODE_MAX_ROWS)))
    assert calls == [NATIVE_DECODE_MAX_ROWS]


def test_engines_sharing_a_model_each_decode_in_their_own_pool() -> None:
    """Two engines on one loaded model (one native decoder, two KV pools), stepped in turn,
    give the tokens each gives alone."""
    args = EngineArgs(model="tiny", device="cpu", kv_cache_memory=8 * 2**20, linear_backend="native")
    loaded = load(args)
    assert loaded.model.native_decoder is not None
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = {"a": [tuple(range(3, 3 + n)) for n in (4, 17, 9)], "b": [tuple(range(40, 40 + n)) for n in (30, 2)]}
    alone = {name: [r.output_ids for r in run_to_completion(create_engine(args, loaded, quiet=True),
                                                               [PromptSpec(p, params) for p in ps])]
             for name, ps in prompts.items()}
    engines = {name: create_engine(args, loaded, quiet=True) for name in prompts}
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in prompts}
    for name, engine in engines.items():
        for index, prompt in enumerate(prompts[name]):
            engine.add_request(str(index), list(prompt), params)
    while any(engine.has_unfinished for engine in engines.values()):
        for name, engine in engines.items():
            for event in engine.step():
                outputs[name].setdefault(event.request_id, []).extend(event.token_ids)
    for name in prompts:
        assert [outputs[name][str(i)] for i in range(len(prompts[name]))] == alone[name], name


def test_caches_that_share_the_first_and_last_layers_addresses_get_their_own_pointers() -> None:
    """A decode into caches whose first and last layers are the previous call's tensors and
    whose middle layers are new writes into the new layers, not the old ones (the pointers
    were once checked by the first and last layers' addresses only: clones that reused
    them read and wrote freed memory, a flaky mismatch in the batch test above)."""
    model = _model("gqa")
    state = Prefilled(model, 3)
    old = [c.clone() for c in state.caches]
    batch = AttentionBatch.build([(n, 1, t) for n, t in zip(state.lengths, state.tables)], BLOCK_SIZE, "cpu")
    positions = torch.tensor(state.lengths)
    with torch.inference_mode():
        model(state.tokens, positions, batch, old)
        old_after = [c.clone() for c in old]
        new = [old[0], *(c.clone() for c in state.caches[1:-1]), old[-1]]
        model(state.tokens, positions, AttentionBatch.build([(n, 1, t) for n, t in zip(state.lengths, state.tables)],
                                                            BLOCK_SIZE, "cpu"), new)
    for layer in range(1, len(new) - 1):
        assert torch.equal(old[layer], old_after[layer]), f"layer {layer} of the old caches was written"
        assert torch.equal(new[layer], old_after[layer]), f"layer {layer} of the new caches was not"


def test_phase_seconds_add_up_for_the_profile() -> None:
    """profile_decode's split of the native call: every phase timed, the projections the
    bulk of it; without phase_seconds nothing is recorded."""
    model = _model("gqa")
    state = Prefilled(model, 4)
    model.native_decoder.phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)  # type: ignore[union-attr]
    state.decode(model, native=True)
    state.decode(model, native=True)
    seconds = dict(zip(PHASES, model.native_decoder.phase_seconds.tolist()))  # type: ignore[union-attr]
    model.native_decoder.phase_seconds = None  # type: ignore[union-attr]
    assert all(value >= 0 for value in seconds.values()), seconds
    assert seconds["gate/up projection"] > 0 and seconds["attention"] > 0, seconds
    state.decode(model, native=True)  # no profile buffer: no write anywhere


def test_a_model_without_native_projections_has_no_native_decoder() -> None:
    for backend in ("onednn", "aten"):
        loaded = load(EngineArgs(model="tiny", device="cpu", linear_backend=backend))
        assert loaded.model.native_decoder is None, backend
    layer = load(EngineArgs(model="tiny", device="cpu", linear_backend="onednn")).model.model.layers[0]
    with pytest.raises(ValueError, match="pack_linears\\(native=True\\) first"):
        layer.native_weights()
