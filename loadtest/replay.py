"""Replay a trace through an engine on a virtual clock driven by measured compute time.

The clock advances by the wall time each engine step really takes, and jumps over idle
gaps to the next arrival. On a machine where the engine is the only thing computing this
gives the latencies a real-time replay would, without waiting through idle time, so a
sweep over many arrival rates stays affordable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from loadtest.metrics import RequestTimeline
from loadtest.trace import TraceRequest
from workers.engine.engine import LLMEngine
from workers.engine.sampling import SamplingParams


def _params(request: TraceRequest) -> SamplingParams:
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)


def replay_engine(engine: LLMEngine, trace: Sequence[TraceRequest]) -> list[RequestTimeline]:
    """Feed arrivals as the virtual clock passes them; timestamp every token."""
    timelines = {r.request_id: RequestTimeline(r.arrival_time) for r in trace}
    pending = sorted(trace, key=lambda r: r.arrival_time)
    next_index = 0
    clock = 0.0
    while next_index < len(pending) or engine.has_unfinished:
        while next_index < len(pending) and pending[next_index].arrival_time <= clock:
            r = pending[next_index]
            engine.add_request(r.request_id, r.prompt_ids, _params(r), arrival_time=r.arrival_time)
            next_index += 1
        if not engine.has_unfinished:
            clock = pending[next_index].arrival_time
            continue
        start = time.perf_counter()
        events = engine.step()
        clock += time.perf_counter() - start
        for event in events:
            timelines[event.request_id].token_times.extend([clock] * len(event.token_ids))
    return [timelines[r.request_id] for r in trace]


class _StepClock:
    """A transformers StoppingCriteria that only records when each generated token lands."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def replay_hf_static(hf_model: Any, trace: Sequence[TraceRequest], batch_size: int) -> list[RequestTimeline]:
    """Hugging Face generate in static batches: whoever has arrived (up to batch_size)
    runs together until the longest is done; later arrivals wait for the next batch."""
    import transformers

    timelines = {r.request_id: RequestTimeline(r.arrival_time) for r in trace}
    pending = sorted(trace, key=lambda r: r.arrival_time)
    next_index = 0
    clock = 0.0
    while next_index < len(pending):
        if pending[next_index].arrival_time > clock:
            clock = pending[next_index].arrival_time
        batch = []
        while next_index < len(pending) and pending[next_index].arrival_time <= clock and len(batch) < batch_size:
            batch.append(pending[next_index])
            next_index += 1
        width = max(len(r.prompt_ids) for r in batch)
        # Left padding, as decoder-only generation needs. [batch, width]
        input_ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in batch])
        attention_mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        step_clock = _StepClock()
        generation_config = transformers.GenerationConfig(
            do_sample=False,
            max_new_tokens=max(r.output_len for r in batch),
            eos_token_id=None,
            pad_token_id=0,
        )
        start = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(
                input_ids,
                attention_mask=attention_mask,
                generation_config=generation_config,
                stopping_criteria=transformers.StoppingCriteriaList([step_clock]),
            )
        for r in batch:
            timelines[r.request_id].token_times = [clock + t - start for t in step_clock.times[: r.output_len]]
        clock += time.perf_counter() - start
    return [timelines[r.request_id] for r in trace]
