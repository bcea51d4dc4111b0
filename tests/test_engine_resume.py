"""A request resumed on another engine from its output so far goes on exactly as if it had
never moved: the engine half of migration. On the tiny preset, whose byte tokenizer gives
text, stop strings and multi-byte characters."""

from __future__ import annotations

import pytest

from workers.engine.collect import PromptSpec, RequestOutput, run_to_completion
from workers.engine.engine import LLMEngine
from workers.engine.errors import InvalidRequestError
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason, Resume
from workers.engine.sampling import SamplingParams
from workers.model.build import EngineArgs, create_engine, load
from workers.model.loader import LoadedModel

ARGS = EngineArgs(model="tiny", device="cpu", kv_cache_memory=64 * 128 * 1024, max_model_len=256)
PROMPT = tuple(b"Paged attention keeps the KV cache in blocks")

CASES = {
    "greedy": SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, seed=2024, ignore_eos=True),
    "seeded-logprobs": SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=7, logprobs=2, ignore_eos=True),
}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load(ARGS)


def _engine(tiny: LoadedModel) -> LLMEngine:
    return create_engine(ARGS, tiny, quiet=True)


def _events_until(engine: LLMEngine, request_id: str, num_tokens: int) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    while sum(len(e.token_ids) for e in events) < num_tokens:
        events += [e for e in engine.step() if e.request_id == request_id]
    return events


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 15, 16, 30])
def test_resumed_output_equals_the_uninterrupted_run(tiny: LoadedModel, name: str, cut: int) -> None:
    params = CASES[name]
    whole = run_to_completion(_engine(tiny), [PromptSpec(PROMPT, params)])[0]

    # The first engine runs `cut` tokens (alongside another request), then "dies".
    first = _engine(tiny)
    first.add_request("other", tuple(b"something else entirely"), CASES["greedy"])
    first.add_request("r", PROMPT, params)
    before = _events_until(first, "r", cut)
    had = RequestOutput("r", PROMPT)
    for event in before:
        had.apply(event)

    # A second engine, busy with other work, takes it from there.
    second = _engine(tiny)
    second.add_request("busy", tuple(b"a third prompt"), CASES["seeded"])
    second.step()
    second.add_request("r", PROMPT, params, resume=Resume(tuple(had.output_ids), len(had.output_text)))
    after = RequestOutput("r", PROMPT)
    after.output_ids = list(had.output_ids)  # offsets go on from the cut
    while second.has_unfinished:
        for event in second.step():
            if event.request_id == "r":
                assert event.offset >= len(had.output_ids) or not event.token_ids
                after.apply(event)

    assert after.output_ids == whole.output_ids
    assert had.output_text + after.output_text == whole.output_text
    assert after.finish_reason == whole.finish_reason == FinishReason.LENGTH
    if params.logprobs is not None:
        assert [s.token_id for s in had.logprobs + after.logprobs] == whole.output_ids
        for got, want in zip(had.logprobs + after.logprobs, whole.logprobs):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_a_resumed_request_still_finds_a_stop_string_that_spans_the_cut(tiny: LoadedModel) -> None:
    greedy = CASES["greedy"]
    free_run = run_to_completion(_engine(tiny), [PromptSpec(PROMPT, greedy)])[0].output_text
    stop = free_run[20:24]  # four characters the greedy output is known to produce
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=(stop,))
    whole = run_to_completion(_engine(tiny), [PromptSpec(PROMPT, params)])[0]
    assert whole.finish_reason == FinishReason.STOP

    first = _engine(tiny)
    first.add_request("r", PROMPT, params)
    had = RequestOutput("r", PROMPT)
    for event in _events_until(first, "r", 22):  # the cut falls inside the stop string
        had.apply(event)
    second = _engine(tiny)
    second.add_request("r", PROMPT, params, resume=Resume(tuple(had.output_ids), len(had.output_text)))
    after = RequestOutput("r", PROMPT)
    after.output_ids = list(had.output_ids)
    while second.has_unfinished:
        for event in second.step():
            after.apply(event)
    assert had.output_text + after.output_text == whole.output_text
    assert after.output_ids == whole.output_ids and after.finish_reason == FinishReason.STOP


@pytest.mark.parametrize(
    "resume,field",
    [
        (Resume(tuple([65] * 48)), "resume.output_ids"),  # already at max_tokens
        (Resume((65, 999)), "resume.output_ids"),
        (Resume((65,), num_text_chars=-1), "resume.num_text_chars"),
    ],
)
def test_a_bad_resume_names_its_field_and_costs_nothing(tiny: LoadedModel, resume: Resume, field: str) -> None:
    engine = _engine(tiny)
    free = engine.stats().num_free_blocks
    with pytest.raises(InvalidRequestError) as raised:
        engine.add_request("r", PROMPT, CASES["greedy"], resume=resume)
    assert raised.value.field == field
    assert engine.stats().num_free_blocks == free and engine.stats().num_committed_blocks == 0
    assert not engine.has_unfinished
