"""Engine benchmark: the seed chapter's trace through four engines, and decode MBU on `small`.

    python -m loadtest.bench_engine [--num-requests 64] [--out results/bench_engine]

Engines, side by side on the same weights and requests, in one run:
  naive          no KV cache, recompute the whole sequence each step, one request at a time
  cached-serial  paged KV cache, one request at a time
  batched        paged KV cache with continuous batching (the kvserve engine)
  hf-static-N    Hugging Face generate() in static batches of up to N (the peer a user would
                 reach for), with N = 16 and N = 64 (the batched engine's max_num_seqs)
Prints a table; writes results.json, output.txt (the table) and bench_engine.png.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from loadtest.metrics import RequestTimeline, Summary, summarize
from loadtest.replay import replay_engine, replay_hf_static
from loadtest.report import Column, RequestLatency, Slo, Table, figure, log, write_results
from loadtest.trace import poisson_trace
from workers.model.build import EngineArgs, EngineKind, create_engine, load
from workers.model.loader import LoadedModel

ENGINES: tuple[str, ...] = ("naive", "cached-serial", "batched", "hf-static-16", "hf-static-64")
SWEEP_RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
SLO = Slo(ttft_s=1.0, percentile=99)  # a rate is sustained when 99% of its requests see TTFT < 1 s
SWEEP_SECONDS = 10.0  # each sweep point lasts at least this long, so a backlog can build
TABLE = Table((
    Column("engine", 14, align="<"),
    Column("TTFT p50", 10, ".1f", scale=1e3),
    Column("TTFT p99", 10, ".1f", scale=1e3),
    Column("ITL p50", 9, ".2f", scale=1e3),
    Column("ITL p99", 9, ".2f", scale=1e3),
    Column("tok/s", 8, ".0f"),
    Column("sat tok/s", 11, ".0f"),
    Column("max rate", 10, "g"),
))


def to_hf_llama(loaded: LoadedModel) -> Any:
    """The same weights as a transformers LlamaForCausalLM (our parameter names are HF's)."""
    import transformers

    c = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_config).float().eval()
    missing, unexpected = model.load_state_dict(loaded.model.state_dict(), strict=False)
    # Tied weights: lm_head.weight is embed_tokens.weight in both models, loaded once.
    missing = [k for k in missing if "rotary" not in k and not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weights did not map onto transformers: missing {missing}, unexpected {unexpected}")
    return model


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine_args = EngineArgs(
            model="tiny", device="cpu", kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs
        )
        log("loading the tiny preset")
        self.loaded = load(self.engine_args)
        self.hf_model = to_hf_llama(self.loaded)

    def run(self, engine: str, rate: float, num_requests: int | None = None) -> Summary:
        return summarize(self.timelines(engine, rate, num_requests))

    def timelines(self, engine: str, rate: float, num_requests: int | None = None) -> list[RequestTimeline]:
        trace = poisson_trace(num_requests or self.args.num_requests, rate, seed=7)
        if engine.startswith("hf-static-"):
            return replay_hf_static(self.hf_model, trace, int(engine.removeprefix("hf-static-")))
        kind: EngineKind = engine  # type: ignore[assignment]
        llm = create_engine(self.engine_args, self.loaded, kind, quiet=True)
        return replay_engine(llm, trace)


def max_sustained_rate(bench: Bench, engine: str, at_rate: dict[float, Summary]) -> float:
    """Highest rate of the sweep that SLO sustains (0 if none); the sweep stops at the first miss."""
    best = 0.0
    for rate in SWEEP_RATES:
        num_requests = max(bench.args.num_requests, math.ceil(rate * SWEEP_SECONDS))
        timelines = bench.timelines(engine, rate, num_requests)
        at_rate[rate] = summary = summarize(timelines)
        log(f"  {engine:>13} @ {rate:6.1f} req/s: p99 TTFT {summary.ttft_p99 * 1e3:8.1f} ms")
        if not SLO.sustained([RequestLatency.of(t) for t in timelines]):
            break
        best = rate
    return best


def measure_bandwidth(num_rows: int = 8192, repeats: int = 20) -> float:
    """Memory bandwidth as torch sees it: a large fp32 matrix-vector product (bytes/s)."""
    weight = torch.randn(num_rows, num_rows)  # [8192, 8192] fp32 = 256 MiB
    vector = torch.randn(num_rows)
    for _ in range(3):
        torch.mv(weight, vector)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(weight, vector)
        times.append(time.perf_counter() - start)
    times.sort()
    return weight.numel() * weight.element_size() / times[len(times) // 2]


def median_decode_step_s(engine: Any, prompt_ids: list[int], decode_steps: int = 48) -> float:
    """The median time of one decode step of a lone greedy request (its prefill not counted)."""
    from workers.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    engine.add_request("mbu", list(prompt_ids), params)
    engine.step()  # prefill
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def decode_read_bytes(loaded: LoadedModel) -> int:
    """Bytes a batch-1 decode step reads: every weight once, except the embedding table, of
    which it reads one row (with tied embeddings the output head reads the table whole)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    if loaded.config.tie_word_embeddings:
        return weight_bytes
    embed = loaded.model.get_parameter("model.embed_tokens.weight")
    return weight_bytes - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()


def measure_mbu(decode_steps: int = 48) -> dict[str, float]:
    """Decode step time at batch 1 on `small` against weight bytes / measured bandwidth."""
    args = EngineArgs(model="small", device="cpu", kv_cache_memory=256 * 2**20)
    log("building the small preset for MBU")
    loaded = load(args)
    engine = create_engine(args, loaded, quiet=True)
    step_time = median_decode_step_s(engine, list(range(32)), decode_steps)
    params = list(loaded.model.named_parameters())
    weight_bytes = decode_read_bytes(loaded)
    bandwidth = measure_bandwidth()
    floor = weight_bytes / bandwidth
    return {
        "weight_bytes_per_step": float(weight_bytes),
        "bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": floor * 1e3,
        "step_ms": step_time * 1e3,
        "mbu": floor / step_time,
        "num_parameters": float(sum(p.numel() for _, p in params)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="the headline arrival rate (req/s)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=128 * 2**20)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--skip-mbu", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("results/bench_engine"))
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    bench = Bench(args)

    headline: dict[str, Summary] = {}
    saturation: dict[str, Summary] = {}
    sustained: dict[str, float] = {}
    sweeps: dict[str, dict[float, Summary]] = {}
    for engine in engines:
        log(f"{engine}: trace at {args.rate} req/s")
        headline[engine] = bench.run(engine, args.rate)
        log(f"{engine}: saturation (all {args.num_requests} requests at t=0)")
        saturation[engine] = bench.run(engine, math.inf)
        sweeps[engine] = {}
        log(f"{engine}: rate sweep for {SLO.describe_sustained()}")
        sustained[engine] = max_sustained_rate(bench, engine, sweeps[engine])

    mbu = None if args.skip_mbu else measure_mbu()
    report = build_report(args, engines, headline, saturation, sustained, sweeps, mbu)
    write_results(args.out, report, lambda: print_table(report), {"bench_engine.png": lambda p: plot(report, p)})
    return 0


def build_report(
    args: argparse.Namespace,
    engines: list[str],
    headline: dict[str, Summary],
    saturation: dict[str, Summary],
    sustained: dict[str, float],
    sweeps: dict[str, dict[float, Summary]],
    mbu: dict[str, float] | None,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "conditions": {
            "model": "tiny preset (random weights)",
            "num_parameters": bench_params(),
            "trace": f"poisson, prompt 32-96, output 16-48, seed 7, {args.num_requests} requests",
            "headline_rate": args.rate,
            "sweep": f"each rate runs max({args.num_requests}, rate x {SWEEP_SECONDS:g} s) requests",
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
            "torch": torch.__version__,
            "clock": "virtual: advanced by measured step compute time, idle gaps skipped",
            "max_rate": f"the highest rate of the sweep with {SLO.describe_sustained()}",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "engines": {
            e: {
                "at_rate": asdict(headline[e]),
                "saturation": asdict(saturation[e]),
                "max_rate_p99_ttft_under_1s": sustained[e],
                "sweep": {str(rate): asdict(s) for rate, s in sorted(sweeps[e].items())},
            }
            for e in engines
        },
        "mbu": mbu,
        "targets": {},
    }
    t = report["targets"]
    if "naive" in headline and "cached-serial" in headline:
        ratio = headline["cached-serial"].itl_p50 / headline["naive"].itl_p50
        t["cached_itl_over_naive_itl"] = {"value": ratio, "target": "<= 0.333", "met": ratio <= 1 / 3}
    hf = [e for e in saturation if e.startswith("hf-static-")]
    if "batched" in saturation and hf:
        # Against the best of the static batch sizes: the comparison a skeptic would pick.
        best = max(hf, key=lambda e: saturation[e].output_tokens_per_s)
        ratio = saturation["batched"].output_tokens_per_s / saturation[best].output_tokens_per_s
        t[f"batched_over_{best}_tokens_per_s_at_saturation"] = {
            "value": ratio, "target": ">= 2.0", "met": ratio >= 2.0
        }
    if mbu is not None:
        t["mbu_small_batch1"] = {"value": mbu["mbu"], "target": ">= 0.70", "met": mbu["mbu"] >= 0.70}
    return report


def bench_params() -> int:
    from workers.model.presets import PRESETS

    return PRESETS["tiny"].num_parameters()


def print_table(report: dict[str, Any]) -> None:
    c = report["conditions"]
    print(f"\nEngine benchmark — {c['model']}, {c['num_parameters'] / 1e6:.2f}M params, {c['trace']}")
    print(f"{c['machine']}, torch {c['torch']}, {c['clock']}\n")
    print(f"at {c['headline_rate']:g} req/s (times in ms); saturation = all requests at t=0; "
          f"max rate = {SLO.describe_sustained()}")
    rows = [
        (engine, r["at_rate"]["ttft_p50"], r["at_rate"]["ttft_p99"], r["at_rate"]["itl_p50"], r["at_rate"]["itl_p99"],
         r["at_rate"]["output_tokens_per_s"], r["saturation"]["output_tokens_per_s"], r["max_rate_p99_ttft_under_1s"])
        for engine, r in report["engines"].items()
    ]
    print("\n".join(TABLE.lines(rows)))
    if report["mbu"] is not None:
        m = report["mbu"]
        print(
            f"\nDecode MBU, small preset ({m['num_parameters'] / 1e6:.0f}M params, fp32) at batch 1: "
            f"step {m['step_ms']:.2f} ms vs floor {m['floor_ms']:.2f} ms "
            f"({m['weight_bytes_per_step'] / 2**20:.0f} MiB at {m['bandwidth_gb_s']:.1f} GB/s) -> MBU {m['mbu']:.0%}"
        )
    print("\nTargets:")
    for name, t in report["targets"].items():
        print(f"  {name:<38} {t['value']:.3f}  (target {t['target']}) {'MET' if t['met'] else 'MISSED'}")


def plot(report: dict[str, Any], path: Path) -> None:
    engines = list(report["engines"])
    rate = report["conditions"]["headline_rate"]
    mbu = report["mbu"]
    subtitle = f" — decode MBU on small at batch 1: {mbu['mbu']:.0%}" if mbu else ""
    title = f"kvserve engine benchmark ({report['conditions']['trace']}){subtitle}"
    with figure(path, 2, 2, title=title, figsize=(12, 9)) as (_, axes):
        _draw(report, engines, rate, axes)


def _draw(report: dict[str, Any], engines: list[str], rate: float, axes: Any) -> None:
    x = range(len(engines))
    for ax, metric, title in (
        (axes[0][0], "ttft", f"TTFT at {rate:g} req/s (ms, log)"),
        (axes[0][1], "itl", f"ITL at {rate:g} req/s (ms, log)"),
    ):
        p50 = [report["engines"][e]["at_rate"][f"{metric}_p50"] * 1e3 for e in engines]
        p99 = [report["engines"][e]["at_rate"][f"{metric}_p99"] * 1e3 for e in engines]
        ax.bar([i - 0.2 for i in x], p50, width=0.4, label="p50")
        ax.bar([i + 0.2 for i in x], p99, width=0.4, label="p99")
        ax.set_xticks(list(x), engines)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
    ax = axes[1][0]
    for e in engines:
        sweep = report["engines"][e]["sweep"]
        rates = sorted(float(r) for r in sweep)
        ax.plot(rates, [sweep[str(r)]["ttft_p99"] for r in rates], marker="o", label=e)
    ax.axhline(SLO.ttft_s, color="gray", linestyle="--", label=f"{SLO.ttft_s:g} s SLO")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("p99 TTFT (s)")
    ax.set_title("p99 TTFT against arrival rate")
    ax.legend()
    ax = axes[1][1]
    at = [report["engines"][e]["at_rate"]["output_tokens_per_s"] for e in engines]
    sat = [report["engines"][e]["saturation"]["output_tokens_per_s"] for e in engines]
    ax.bar([i - 0.2 for i in x], at, width=0.4, label=f"at {rate:g} req/s")
    ax.bar([i + 0.2 for i in x], sat, width=0.4, label="saturation")
    ax.set_xticks(list(x), engines)
    ax.set_title("output tokens/s")
    ax.legend()


if __name__ == "__main__":
    sys.exit(main())
