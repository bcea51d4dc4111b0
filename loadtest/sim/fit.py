"""Fit the simulator's step cost model to the real engine, timed step by step.

    python -m loadtest.sim.fit [--repeats 3] [--out results/sim] [--update-default]

Runs the real engine in this process (the `tiny` preset on one CPU thread, as a CPU
worker that gets one core) through scenarios chosen to span the shapes a serving step
takes: decode batches of 1 to 64 at short and long contexts, lone prefills of 16 to
2000 tokens, long prompts prefilled in chunks, and a few streams of mixed steps. Each
engine.step() is timed whole (scheduling and output processing included, as a worker
pays them) and its plan's shape is recorded by a runner wrapper. The time fitted is the
stepping thread's CPU time: with one torch thread every kernel runs on that thread, so
on a quiet machine it equals wall time, and on a shared one other processes cannot
inflate it (wall time is recorded alongside, and the report gives their ratio). Every
scenario runs `repeats` times on a fresh engine and each step keeps its least time
over the passes (interference only ever adds time).

Then it checks the fitted model end to end (loadtest.sim.validate). Writes the
coefficients, R^2 and every sample to results/sim/cost_model.json; with
--update-default also the coefficients to loadtest/sim/cost_model_cpu_tiny.json, the
model the simulator uses unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from loadtest.sim.cost_model import (
    DEFAULT_COST_MODEL,
    CostModel,
    ModelFacts,
    StepShape,
    fit_least_squares,
    shape_of,
)
from loadtest.sim.validate import KV_CACHE_MEMORY, PlanRecorder, print_validation, validate
from workers.config import EngineArgs
from workers.engine.engine import LLMEngine
from workers.engine.sampling import SamplingParams


def log(message: str) -> None:
    print(f"[fit] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Scenario:
    """Requests added at given step indices to an engine with a given token budget."""

    name: str
    arrivals: tuple[tuple[int, int, int], ...]  # (at step index, prompt tokens, max_tokens)
    max_num_batched_tokens: int = 2048


def _batch(name: str, batch: int, prompt: int, max_tokens: int = 16, budget: int = 2048) -> Scenario:
    return Scenario(name, tuple((0, prompt, max_tokens) for _ in range(batch)), budget)


def scenarios() -> list[Scenario]:
    decode = [
        _batch(f"decode b={b} p={p}", b, p)
        for b, p in (
            (1, 32), (1, 512), (1, 1500), (4, 128), (8, 32), (8, 512), (8, 1024),
            (16, 128), (32, 64), (32, 192), (64, 32), (64, 128),
        )
    ]
    prefill = [_batch(f"prefill p={p}", 1, p, max_tokens=1) for p in (16, 64, 256, 1024, 2000)]
    chunked = [_batch(f"chunked p=1536 budget={b}", 1, 1536, max_tokens=4, budget=b) for b in (256, 512)]
    # Serving-like streams: arrivals every few steps, so decodes of assorted contexts
    # share steps with prefill chunks. Steps like these run slower than the same shapes
    # repeated (the caches hold something else each step), and they are what a
    # simulated worker runs, so there are three, sparse to dense.
    streams = [
        _stream("stream sparse", seed=12, gaps=(2, 3, 5, 8)),
        _stream("stream", seed=11, gaps=(0, 1, 2, 3, 5)),
        _stream("stream dense", seed=13, gaps=(0, 0, 1, 2)),
    ]
    return decode + prefill + chunked + streams


def _stream(name: str, seed: int, gaps: tuple[int, ...], num_requests: int = 64) -> Scenario:
    """The seed trace's shapes (prompts 32-96, outputs 16-48) arriving every `gaps` steps."""
    shapes = random.Random(seed)
    arrivals = []
    step = 0
    for _ in range(num_requests):
        arrivals.append((step, shapes.randint(32, 96), shapes.randint(16, 48)))
        step += shapes.choice(gaps)
    return Scenario(name, tuple(arrivals))


@dataclass(frozen=True)
class Sample:
    scenario: str
    shape: StepShape
    seconds: float  # CPU time of the stepping thread
    wall_seconds: float


class _Timed(NamedTuple):
    shape: StepShape
    cpu_s: float
    wall_s: float


def run_scenario(make_engine: Callable[[int], LLMEngine], scenario: Scenario) -> list[_Timed]:
    """One pass: the shape and times of every engine step, in order."""
    engine = make_engine(scenario.max_num_batched_tokens)
    recorder = PlanRecorder(engine.runner)
    engine.runner = recorder
    pending = sorted(enumerate(scenario.arrivals), key=lambda item: item[1][0])
    steps: list[_Timed] = []
    index = 0
    step = 0
    while index < len(pending) or engine.has_unfinished:
        while index < len(pending) and pending[index][1][0] <= step:
            number, (_, num_prompt, max_tokens) = pending[index]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{scenario.name}-{number}", [7] * num_prompt, params)
            index += 1
        step += 1
        if not engine.has_unfinished:
            continue
        recorder.last_plan = None
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        if recorder.last_plan is not None:
            steps.append(_Timed(shape_of(recorder.last_plan), cpu, wall))
    return steps


def measure(make_engine: Callable[[int], LLMEngine], repeats: int) -> list[Sample]:
    run_scenario(make_engine, _batch("warm-up", 8, 64))
    samples: list[Sample] = []
    for scenario in scenarios():
        passes = [run_scenario(make_engine, scenario) for _ in range(repeats)]
        shapes = [step.shape for step in passes[0]]
        for other in passes[1:]:
            assert [step.shape for step in other] == shapes, f"{scenario.name}: plans differ between passes"
        for i, shape in enumerate(shapes):
            cpu = min(p[i].cpu_s for p in passes)
            wall = min(p[i].wall_s for p in passes)
            samples.append(Sample(scenario.name, shape, cpu, wall))
        mine = [s for s in samples if s.scenario == scenario.name]
        log(f"{scenario.name:<28} {len(shapes):>4} steps, {sum(s.seconds for s in mine) * 1e3:8.1f} ms CPU, "
            f"{sum(s.wall_seconds for s in mine) * 1e3:8.1f} ms wall per pass")
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/sim"))
    parser.add_argument("--update-default", action="store_true", help=f"also write {DEFAULT_COST_MODEL}")
    args = parser.parse_args(argv)

    import torch

    from workers.model.build import create_engine, kv_pool_size, load

    base = EngineArgs(model="tiny", device="cpu", kv_cache_memory=KV_CACHE_MEMORY, num_threads=1)
    log("loading the tiny preset on one CPU thread")
    loaded = load(base)

    def make_engine(budget: int) -> LLMEngine:
        engine_args = EngineArgs(
            model="tiny", device="cpu", kv_cache_memory=KV_CACHE_MEMORY, num_threads=1, max_num_batched_tokens=budget
        )
        return create_engine(engine_args, loaded, quiet=True)

    samples = measure(make_engine, args.repeats)
    fit = fit_least_squares([s.shape for s in samples], [s.seconds for s in samples])
    probe = make_engine(base.max_num_batched_tokens)
    facts = ModelFacts(
        model="tiny",
        device="cpu",
        num_threads=torch.get_num_threads(),
        vocab_size=probe.limits.vocab_size,
        max_model_len=probe.config.max_model_len,
        block_size=probe.config.block_size,
        block_bytes=kv_pool_size(base, loaded).block_bytes,
        max_num_seqs=probe.config.max_num_seqs,
        max_num_batched_tokens=probe.config.max_num_batched_tokens,
    )
    model = CostModel(fit.coefficients, facts, fit.r2, len(samples))
    report = build_report(model, samples, fit.predictions, torch.__version__)
    report["validation"] = validate(make_engine, model, kv_pool_size(base, loaded).num_blocks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost_model.json").write_text(json.dumps(report, indent=2))
    print_fit(report)
    print_validation(report["validation"])
    if args.update_default:
        shipped = {**model.to_json(), "measured": report["measured"], "validation": report["validation"]}
        DEFAULT_COST_MODEL.write_text(json.dumps(shipped, indent=2) + "\n")
        log(f"wrote {DEFAULT_COST_MODEL}")
    log(f"wrote {args.out / 'cost_model.json'}")
    return 0


def build_report(
    model: CostModel, samples: list[Sample], predictions: list[float], torch_version: str
) -> dict[str, Any]:
    by_scenario: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(s.scenario for s in samples):
        pairs = [(s.seconds, p) for s, p in zip(samples, predictions) if s.scenario == name]
        measured = sum(m for m, _ in pairs)
        predicted = sum(p for _, p in pairs)
        by_scenario[name] = {
            "num_steps": len(pairs),
            "measured_s": measured,
            "predicted_s": predicted,
            "total_error": predicted / measured - 1.0,
            "median_step_error": statistics.median(p / m - 1.0 for m, p in pairs),
        }
    return {
        **model.to_json(),
        "measured": {
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "torch": torch_version,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "timing": "each engine.step() whole (scheduling and output processing included): the least "
            "CPU time of the stepping thread over the passes",
            "median_wall_over_cpu": statistics.median(s.wall_seconds / s.seconds for s in samples),
            "median_abs_step_error": statistics.median(abs(p / s.seconds - 1.0) for s, p in zip(samples, predictions)),
        },
        "by_scenario": by_scenario,
        "samples": [
            {"scenario": s.scenario, **s.shape._asdict(), "seconds": s.seconds, "wall_seconds": s.wall_seconds,
             "predicted_s": p}
            for s, p in zip(samples, predictions)
        ],
    }


def print_fit(report: dict[str, Any]) -> None:
    m = report["measured"]
    print(f"\nStep cost model, {report['facts']['model']} on {report['facts']['device']} "
          f"({report['facts']['num_threads']} thread): R^2 = {report['r2']:.4f} over {report['num_samples']} steps; "
          f"median |step error| {m['median_abs_step_error']:.1%}; median wall/CPU {m['median_wall_over_cpu']:.2f}")
    units = {"intercept": "ms", "per_prefill_token": "us", "per_prefill_chunk": "ms", "per_prefill_pair": "ns",
             "per_decode": "us", "per_decode_context": "ns", "per_torch_step": "ms", "per_mixed_decode": "us"}
    factor = {"ms": 1e3, "us": 1e6, "ns": 1e9}
    for name, value in report["coefficients_s"].items():
        unit = units[name]
        print(f"  {name:<20} {value * factor[unit]:10.3f} {unit}")
    print(f"\n{'scenario':<28}{'steps':>6}{'measured ms':>13}{'predicted ms':>14}{'total err':>11}"
          f"{'median step err':>17}")
    for name, row in report["by_scenario"].items():
        print(f"{name:<28}{row['num_steps']:>6}{row['measured_s'] * 1e3:>13.1f}{row['predicted_s'] * 1e3:>14.1f}"
              f"{row['total_error']:>+11.1%}{row['median_step_error']:>+17.1%}")


if __name__ == "__main__":
    sys.exit(main())
