"""Requests at the engine boundary: bad input, stops, logprobs, abort — on the tiny preset."""

from __future__ import annotations

import pytest

from workers.engine.collect import PromptSpec, RequestOutput, run_to_completion
from workers.engine.engine import LLMEngine, ModelLimits
from workers.engine.errors import InvalidRequestError, RequestTooLargeError
from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams
from workers.model.build import EngineArgs, create_engine, kv_pool_size, load
from workers.model.loader import LoadedModel
from workers.model.runner import ModelRunner

ARGS = EngineArgs(model="tiny", device="cpu", kv_cache_memory=64 * 128 * 1024, max_model_len=256)
PROMPT = list(b"The KV cache is")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load(ARGS)


@pytest.fixture
def engine(tiny: LoadedModel) -> LLMEngine:
    return create_engine(ARGS, tiny, quiet=True)


def _run(engine: LLMEngine, params: SamplingParams, prompt: list[int] = PROMPT) -> RequestOutput:
    return run_to_completion(engine, [PromptSpec(tuple(prompt), params)])[0]


BAD_REQUESTS = [
    ("prompt", [], {}),
    ("prompt", [65] * 257, {}),
    ("prompt_ids", [65, 258], {}),
    ("prompt_ids", [65, -1], {}),
    ("max_tokens", PROMPT, {"max_tokens": 250}),
    ("stop_token_ids", PROMPT, {"stop_token_ids": (9999,)}),
]


@pytest.mark.parametrize("field,prompt,overrides", BAD_REQUESTS)
def test_bad_request_names_its_field_and_costs_nothing(
    engine: LLMEngine, field: str, prompt: list[int], overrides: dict[str, object]
) -> None:
    engine.add_request("good", PROMPT, SamplingParams(max_tokens=20, temperature=0.0))
    engine.step()
    free_before = engine.stats().num_free_blocks
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, SamplingParams(**overrides))  # type: ignore[arg-type]
    assert info.value.field == field
    assert field in str(info.value)
    assert engine.stats().num_free_blocks == free_before
    # The engine keeps serving the request it had.
    events = []
    while engine.has_unfinished:
        events += engine.step()
    assert [e.finish_reason for e in events if e.finish_reason] == [FinishReason.LENGTH]
    assert sum(len(e.token_ids) for e in events) == 19  # one came out of the first step


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("max_tokens", {"max_tokens": 0}),
        ("temperature", {"temperature": -0.5}),
        ("temperature", {"temperature": float("nan")}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -1}),
        ("logprobs", {"logprobs": 100}),
        ("seed", {"seed": -3}),
        ("stop", {"stop": ("",)}),
    ],
)
def test_bad_sampling_values_name_their_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_a_request_that_can_never_fit_the_pool_is_refused_at_once(tiny: LoadedModel) -> None:
    args = EngineArgs(model="tiny", device="cpu", kv_cache_memory=4 * kv_pool_size(ARGS, tiny).block_bytes)
    small = create_engine(args, tiny, quiet=True)
    total = small.stats().num_total_blocks
    assert total == 4
    fits = 4 * 16 - len(PROMPT) + 1  # prompt + max_tokens - 1 tokens of KV == 4 full blocks
    small.add_request("fits", PROMPT, SamplingParams(max_tokens=fits))
    with pytest.raises(RequestTooLargeError, match="whole pool has 4") as info:
        small.add_request("too-big", PROMPT, SamplingParams(max_tokens=fits + 1))
    assert info.value.field == "max_tokens"


def test_duplicate_request_id_is_refused(engine: LLMEngine) -> None:
    engine.add_request("same", PROMPT)
    with pytest.raises(InvalidRequestError, match="already"):
        engine.add_request("same", PROMPT)


def test_abort_frees_blocks_immediately(engine: LLMEngine) -> None:
    engine.add_request("a", PROMPT * 3, SamplingParams(max_tokens=50))
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    used_by_a = len(engine.scheduler.block_table("a"))
    free_before = engine.stats().num_free_blocks
    event = engine.abort("a")
    assert event is not None and event.finish_reason is FinishReason.CANCELLED
    assert engine.stats().num_free_blocks == free_before + used_by_a
    assert engine.abort("a") is None
    while engine.has_unfinished:
        engine.step()
    assert engine.stats().free_kv_bytes == engine.stats().total_kv_bytes


def test_stop_strings_stop_token_ids_and_eos(engine: LLMEngine, tiny: LoadedModel) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = _run(engine, greedy)
    assert full.finish_reason is FinishReason.LENGTH and len(full.output_ids) == 40

    # A stop token id: generation ends on its first occurrence, the token included.
    stop_token = full.output_ids[7]
    first = full.output_ids.index(stop_token)
    stopped = _run(engine, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_token,)))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_ids == full.output_ids[: first + 1]

    # A stop string found on the detokenized text: the text ends right before it.
    text = full.output_text
    stop = text[10:13]
    assert stop
    cut = _run(engine, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,)))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.output_text == text[: text.index(stop)]

    # EOS: an engine whose model declares that token as EOS stops there unless ignore_eos.
    pool = kv_pool_size(ARGS, tiny)
    runner = ModelRunner(tiny.model, tiny.config, pool.num_blocks, ARGS.block_size)
    limits = ModelLimits(tiny.config.vocab_size, tiny.config.max_position_embeddings, (stop_token,))
    eos_engine = LLMEngine(runner, engine.config, pool, limits, decoder=tiny.tokenizer)
    at_eos = _run(eos_engine, SamplingParams(max_tokens=40, temperature=0.0))
    assert at_eos.finish_reason is FinishReason.EOS
    assert at_eos.output_ids == full.output_ids[: first + 1]
    assert _run(eos_engine, greedy).output_ids == full.output_ids


def test_logprobs_come_with_every_token(engine: LLMEngine) -> None:
    out = _run(engine, SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))
    assert len(out.logprobs) == 8
    for token_id, sampled in zip(out.output_ids, out.logprobs):
        assert sampled.token_id == token_id and sampled.logprob is not None
        assert len(sampled.top_logprobs) == 3
        assert sampled.top_logprobs[0].token_id == token_id  # greedy picks the most likely
        assert sampled.logprob <= 0.0


def test_text_and_token_id_prompts_agree(engine: LLMEngine, tiny: LoadedModel) -> None:
    assert tiny.tokenizer.encode("The KV cache is") == PROMPT
    out = _run(engine, SamplingParams(max_tokens=12, temperature=0.0))
    assert out.output_text == tiny.tokenizer.decode(out.output_ids)


class _FailingOnce:
    """A runner whose next forward fails (say, a CUDA OOM), then recovers."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.fail_next = False

    def execute(self, plan):  # type: ignore[no-untyped-def]
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("out of memory")
        return self.inner.execute(plan)


def test_a_failed_forward_fails_its_requests_with_error_and_frees_their_blocks(tiny: LoadedModel) -> None:
    pool = kv_pool_size(ARGS, tiny)
    runner = _FailingOnce(ModelRunner(tiny.model, tiny.config, pool.num_blocks, ARGS.block_size))
    limits = ModelLimits(tiny.config.vocab_size, tiny.config.max_position_embeddings, tiny.tokenizer.eos_token_ids)
    engine = LLMEngine(runner, create_engine(ARGS, tiny, quiet=True).config, pool, limits, decoder=tiny.tokenizer)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=10, temperature=0.0))
    engine.step()
    runner.fail_next = True
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("a", FinishReason.ERROR)]
    assert events[0].error is not None and "out of memory" in events[0].error
    assert engine.stats().free_kv_bytes == engine.stats().total_kv_bytes
    # The engine still serves.
    out = _run(engine, SamplingParams(max_tokens=5, temperature=0.0))
    assert out.finish_reason is FinishReason.LENGTH and len(out.output_ids) == 5
