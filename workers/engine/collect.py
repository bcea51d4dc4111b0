"""Run an engine to completion and collect whole outputs: offline mode, tests, benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workers.engine.engine import LLMEngine
from workers.engine.errors import InvalidRequestError
from workers.engine.plan import SampledToken, TokenEvent
from workers.engine.request import FinishReason
from workers.engine.sampling import SamplingParams


@dataclass
class RequestOutput:
    """Everything one request produced."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[SampledToken] = field(default_factory=list)

    def apply(self, event: TokenEvent) -> None:
        assert event.offset == len(self.output_ids) or not event.token_ids, "token events arrived out of order"
        self.output_ids.extend(event.token_ids)
        self.output_text += event.text
        self.logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event.error


@dataclass(frozen=True)
class PromptSpec:
    """One request for run_to_completion."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str | None = None


def run_to_completion(
    engine: LLMEngine,
    prompts: Sequence[PromptSpec],
    on_event: Callable[[TokenEvent], None] | None = None,
) -> list[RequestOutput]:
    """Add every prompt, step until all finish, and return outputs in prompt order."""
    outputs: dict[str, RequestOutput] = {}
    order: list[str] = []
    for index, spec in enumerate(prompts):
        request_id = spec.request_id if spec.request_id is not None else f"offline-{index}"
        output = RequestOutput(request_id, spec.prompt_ids)
        order.append(request_id)
        try:
            engine.add_request(request_id, spec.prompt_ids, spec.params)
        except InvalidRequestError as exc:
            # A refused request is reported on its own; the others still run.
            output.finish_reason = FinishReason.ERROR
            output.error = str(exc)
        outputs.setdefault(request_id, output)
    while engine.has_unfinished:
        for event in engine.step():
            outputs[event.request_id].apply(event)
            if on_event is not None:
                on_event(event)
    return [outputs[request_id] for request_id in order]
