"""The fitted cost model checked end to end: the real engine against a one-worker simulation.

    python -m loadtest.sim.validate [--cost-model loadtest/sim/cost_model_cpu_tiny.json]

The seed trace (64 requests) at two rates is replayed through the real engine in this
process, its virtual clock advanced by each step's CPU time (bench_engine's replay does
the same with wall time, which another process on a shared machine would inflate), and
through the simulator with one worker of the same KV pool and no message latency. The
two sets of TTFT/ITL percentiles and tokens/s are printed side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.metrics import RequestTimeline, summarize
from loadtest.sim.cost_model import DEFAULT_COST_MODEL, CostModel, load_cost_model, shape_of
from loadtest.sim.simulator import ClusterConfig, simulate
from loadtest.trace import TraceRequest, poisson_trace
from workers.config import EngineArgs
from workers.engine.engine import LLMEngine, Runner
from workers.engine.plan import SampledToken, StepPlan
from workers.engine.sampling import SamplingParams

KV_CACHE_MEMORY = 256 * 2**20  # the engine fit and validation both measure

class PlanRecorder:
    """Wraps the real runner to keep the plan of the step being timed."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.last_plan: StepPlan | None = None

    def execute(self, plan: StepPlan) -> Mapping[str, SampledToken]:
        self.last_plan = plan
        return self.runner.execute(plan)


VALIDATION_RATES = (8.0, 24.0)  # the seed trace's rate, and near one worker's saturation


def replay_cpu_clock(
    engine: LLMEngine, trace: list[TraceRequest], model: CostModel
) -> tuple[list[RequestTimeline], float]:
    """loadtest.replay.replay_engine with the clock advanced by each step's CPU time; also
    the median over steps of measured / predicted time (how this run's steps compare to
    the ones the model was fitted on)."""
    recorder = PlanRecorder(engine.runner)
    engine.runner = recorder
    ratios: list[float] = []
    timelines = {r.request_id: RequestTimeline(r.arrival_time) for r in trace}
    index = 0
    clock = 0.0
    while index < len(trace) or engine.has_unfinished:
        while index < len(trace) and trace[index].arrival_time <= clock:
            r = trace[index]
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(r.request_id, r.prompt_ids, params, arrival_time=r.arrival_time)
            index += 1
        if not engine.has_unfinished:
            clock = trace[index].arrival_time
            continue
        recorder.last_plan = None
        start = time.thread_time()
        events = engine.step()
        seconds = time.thread_time() - start
        clock += seconds
        if recorder.last_plan is not None:
            ratios.append(seconds / model.step_seconds(shape_of(recorder.last_plan)))
        for event in events:
            timelines[event.request_id].token_times.extend([clock] * len(event.token_ids))
    return [timelines[r.request_id] for r in trace], statistics.median(ratios)


def validate(make_engine: Callable[[int], LLMEngine], model: CostModel, num_blocks: int) -> dict[str, Any]:
    """The real engine and the simulator on the same trace: (real, simulated) summaries per rate."""
    result: dict[str, Any] = {}
    for rate in VALIDATION_RATES:
        trace = poisson_trace(64, rate, seed=7)
        timelines, step_ratio = replay_cpu_clock(make_engine(model.facts.max_num_batched_tokens), trace, model)
        real = summarize(timelines)
        config = ClusterConfig((num_blocks,), "kv", report_latency_s=0.0, dispatch_latency_s=0.0)
        simulated = summarize(list(simulate(trace, config, model).timelines.values()))
        result[f"{rate:g}"] = {
            "real": asdict(real),
            "simulated": asdict(simulated),
            "median_real_over_predicted_step": step_ratio,
        }
        print(
            f"[validate] at {rate:g} req/s: real vs simulated p99 TTFT "
            f"{real.ttft_p99 * 1e3:.1f} / {simulated.ttft_p99 * 1e3:.1f} ms",
            file=sys.stderr,
        )
    return result


def print_validation(validation: dict[str, Any]) -> None:
    print("\nEnd to end, seed trace (64 requests): real engine (CPU-time clock) vs simulator (1 worker, no latency)")
    head = f"{'req/s':>6}{'':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'tok/s':>8}"
    print(head + "   (ms)")
    for rate, pair in validation.items():
        for name in ("real", "simulated"):
            s = pair[name]
            print(f"{rate:>6}{name:>11}{s['ttft_p50'] * 1e3:>10.1f}{s['ttft_p99'] * 1e3:>10.1f}"
                  f"{s['itl_p50'] * 1e3:>9.2f}{s['itl_p99'] * 1e3:>9.2f}{s['output_tokens_per_s']:>8.0f}")
    ratios = ", ".join(
        f"{pair['median_real_over_predicted_step']:.2f} at {rate} req/s" for rate, pair in validation.items()
    )
    print(f"median real step / cost-model step in these runs: {ratios}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost-model", type=Path, default=DEFAULT_COST_MODEL)
    args = parser.parse_args(argv)
    model = load_cost_model(args.cost_model)

    from workers.model.build import create_engine, kv_pool_size, load

    engine_args = EngineArgs(model="tiny", device="cpu", kv_cache_memory=KV_CACHE_MEMORY, num_threads=1)
    loaded = load(engine_args)
    num_blocks = kv_pool_size(engine_args, loaded).num_blocks
    print_validation(validate(lambda _: create_engine(engine_args, loaded, quiet=True), model, num_blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
