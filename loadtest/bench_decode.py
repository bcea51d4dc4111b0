"""Decode speed on a real model: `kvserve offline`'s engine beside llama.cpp on the same weights.

    python -m loadtest.bench_decode [--model smollm2-135m-instruct] [--streams 1,4,16,64]
    make bench-decode

Decode tokens/s is measured by difference, so prefill drops out: each configuration runs
once to `--short` and once to `--long` new tokens (greedy, EOS ignored), and

    decode tokens/s = streams x (long - short) / (time(long) - time(short))

Each configuration runs once untimed first (page faults, oneDNN's first calls, llama.cpp's
mmap'd weights paged in), so neither engine's short run carries start-up costs that the
difference would turn into speed.

kvserve runs twice on the same weights, interleaved stream count by stream count: as
shipped (--linear-backend auto: decode-sized projections through the native kernel, larger
ones through oneDNN on packed weights) and with a baseline backend (--baseline-backend,
default onednn: what auto was before the native kernel; aten is torch's own matmul), so the
gain is measured side by side under the same load. With llama.cpp present every stream
count is run --rounds times (default 2) on each engine (llama.cpp on --peer-streams),
interleaved, and each keeps its best run: on a shared machine the memory bandwidth moves
by 20% from minute to minute, and a slow moment should not land on one side of a ratio
only.

For kvserve, `streams` requests go through the engine together (continuous batching);
llama.cpp's Python binding decodes one sequence at a time, so its N-stream figure is N
requests one after another (its aggregate equals its single-stream rate).

The peer runs on an f32 GGUF written here from the same file, every tensor dequantized
(quantized GGUFs crash llama-cpp-python 0.3.36 built from source on this machine's CPU);
kvserve runs in float32 too, so both read the same weight bytes per token. llama.cpp runs
only when `llama_cpp` is importable; it is not part of `make venv` (it compiles for ~5
minutes): `.venv/bin/pip install llama-cpp-python==0.3.36`.

MBU at batch 1 is the weight bytes one decode step reads over its time, against the
memory bandwidth measured in the same run: the fastest of the reads of a 256 MiB fp32
matrix as wide as the model (torch.mv, torch's sum, the native kernel's sum, a oneDNN and
a native batch-1 linear), so no slow read flatters the MBU. The step times and the reads
are measured in turn, twice, each keeping its best. (On the 2-core EPYC the native
batch-1 linear reads its blocked matrix faster than either sum reads the same bytes.)

Writes docs/benchmarks/bench_decode/{output.txt,results.json,bench_decode.png} and prints
the table; the F32 GGUF for llama.cpp is cached under results/bench_decode/.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_engine import decode_read_bytes, median_decode_step_s
from workers.config import LINEAR_BACKENDS, EngineArgs
from workers.engine.sampling import SamplingParams
from workers.model.build import create_engine, load
from workers.model.named_models import DEFAULT_MODEL
from workers.model.packed_linear import select_linear_backend

PROMPT = "Explain, in a few paragraphs, why a KV cache makes decoding faster."


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)




def kvserve_decode(engine: Any, prompt_ids: list[int], streams: int, short: int, long: int) -> dict[str, float]:
    """Seconds to `short` and to `long` new tokens for `streams` concurrent requests
    (after one untimed run to `short`)."""
    seconds = {}
    for new_tokens in (0, short, long):
        label = new_tokens or short
        params = SamplingParams(max_tokens=label, temperature=0.0, ignore_eos=True)
        for index in range(streams):
            engine.add_request(f"s{streams}-{new_tokens}-{index}", list(prompt_ids), params)
        start = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        seconds[new_tokens] = time.perf_counter() - start
    rate = streams * (long - short) / (seconds[long] - seconds[short])
    return {"tokens_per_s": rate, "seconds_short": seconds[short], "seconds_long": seconds[long]}


def write_f32_gguf(source: Path, target: Path) -> Path:
    """The same model as an all-F32 GGUF: metadata copied, every tensor dequantized."""
    import gguf
    import numpy as np

    from workers.model.gguf_checkpoint import open_gguf

    reader = open_gguf(source).reader  # gguf's reader, 4.1 -> 1.4 s on SmolLM2's metadata
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # The reader's shape is in GGUF order (fastest dimension first); numpy wants it reversed.
        writer.add_tensor(tensor.name, values.reshape(list(reversed([int(d) for d in tensor.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return target


def load_llama_cpp(path: Path, threads: int) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)


def llama_cpp_decode(model: Any, prompt_ids: list[int], streams: int, short: int, long: int) -> dict[str, float]:
    seconds = {}
    for new_tokens in (0, short, long):  # 0: one untimed run to `short`, pages the weights in
        start = time.perf_counter()
        for _ in range(streams if new_tokens else 1):
            model.reset()
            produced = 0
            for token in model.generate(list(prompt_ids), temp=0.0, top_k=1, reset=True):
                produced += 1
                if produced >= (new_tokens or short):
                    break
        seconds[new_tokens] = time.perf_counter() - start
    rate = streams * (long - short) / (seconds[long] - seconds[short])
    return {"tokens_per_s": rate, "seconds_short": seconds[short], "seconds_long": seconds[long]}


def best_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the highest rate, with how many runs it was chosen from: on a shared
    machine a slow moment only ever lowers a rate."""
    best = max(runs, key=lambda run: run["tokens_per_s"])
    return {**best, "runs": len(runs)}


def measure_read_bandwidth(width: int, num_bytes: int = 256 * 2**20, repeats: int = 20) -> dict[str, float]:
    """Bytes/s of reads of one [num_bytes / 4 / width, width] fp32 matrix (256 MiB; width:
    the model's hidden size, the width of the step's projections): torch.mv (MKL here), a
    torch sum, the native kernel's plain sum, a oneDNN batch-1 linear on a packed copy, and
    the native kernel's batch-1 linear on a blocked copy, where it builds. Each the median
    of `repeats`, interleaved. The fastest is the bandwidth MBU is measured against: no
    slow read flatters the MBU."""
    from workers.model.native_linear import blocked, native_linear, native_linear_problem
    from workers.model.packed_linear import PackedLinear

    weight = torch.randn(num_bytes // 4 // width, width)  # [rows, width]
    vector = torch.randn(width)
    packed = PackedLinear(weight.t(), None)
    row = vector[None, :]  # [1, width]
    reads = {"torch.mv": lambda: torch.mv(weight, vector), "sum": lambda: weight.sum(),
             "onednn linear": lambda: packed(row)}
    if native_linear_problem() is None:
        kernel = native_linear()
        weight_blocked = blocked(weight)  # the layout the kernel reads
        reads["native sum"] = lambda: kernel.sum(weight)
        reads["native linear"] = lambda: kernel.linear(row, weight_blocked)
    times: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(3):
        for read in reads.values():
            read()
    for _ in range(repeats):  # interleaved, so a burst of load hits every method alike
        for name, read in reads.items():
            start = time.perf_counter()
            read()
            times[name].append(time.perf_counter() - start)
    read_bytes = weight.numel() * weight.element_size()
    return {name: read_bytes / sorted(t)[len(t) // 2] for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--streams", default="1,4,16,64")
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=272)
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    parser.add_argument("--peer-streams", default="1,4", help="llama.cpp runs (one sequence at a time)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each count llama.cpp runs too (best kept)")
    parser.add_argument("--baseline-backend", default="onednn", choices=[b for b in LINEAR_BACKENDS if b != "auto"],
                        help="the --linear-backend kvserve also runs with, side by side")
    parser.add_argument("--no-baseline", action="store_true", help="run kvserve as shipped only")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/bench_decode"))
    parser.add_argument("--cache", type=Path, default=Path("results/bench_decode"), help="where the F32 GGUF is kept")
    args = parser.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",") if s]
    args.out.mkdir(parents=True, exist_ok=True)
    baseline = f"kvserve-{args.baseline_backend}"
    variants = {"kvserve": "auto"} if args.no_baseline else {"kvserve": "auto", baseline: args.baseline_backend}

    engines: dict[str, Any] = {}
    load_s = 0.0
    loaded: Any = None
    for name, backend in variants.items():
        engine_args = EngineArgs(model=args.model, device="cpu", dtype="float32", num_threads=args.threads,
                                 kv_cache_memory=512 * 2**20, max_num_seqs=max(64, max(streams)),
                                 linear_backend=backend)
        log(f"{name}: loading {args.model} (float32, {args.threads} threads, --linear-backend {backend})")
        start = time.perf_counter()
        loaded = load(engine_args)
        load_s = max(load_s, time.perf_counter() - start)
        engines[name] = (create_engine(engine_args, loaded, quiet=True), loaded)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    shipped_backend = select_linear_backend(torch.device("cpu"), torch.float32, "auto")
    prompt_ids = loaded.tokenizer.encode(PROMPT)
    log(f"loaded in {load_s:.1f} s: {weight_bytes / 2**20:.0f} MiB of weights; prompt {len(prompt_ids)} tokens")

    peer_streams = [int(s) for s in args.peer_streams.split(",") if s]
    peer_model: Any = None
    peer_note = ""
    if args.no_peer:
        peer_note = "not run (--no-peer)"
    else:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            peer_note = "not run: llama_cpp is not importable (.venv/bin/pip install llama-cpp-python==0.3.36)"
        else:
            from workers.model.named_models import resolve_named_model

            source = resolve_named_model(args.model) if not args.model.endswith(".gguf") else Path(args.model)
            args.cache.mkdir(parents=True, exist_ok=True)
            f32 = args.cache / "model-f32.gguf"
            if not f32.exists():
                log(f"writing {f32} (every tensor of {source.name} dequantized to F32)")
                write_f32_gguf(Path(source), f32)
            log(f"llama.cpp: loading {f32}")
            peer_model = load_llama_cpp(f32, args.threads)

    # Each stream count on every engine back to back, repeated --rounds times (when
    # llama.cpp runs), interleaved, and each engine's best run kept, so a slow moment of
    # the machine does not land on one side of a ratio only: the 16-stream ratio divides
    # by llama.cpp's best single stream, so kvserve's 16 streams get as many tries.
    runs: dict[str, dict[int, list[dict[str, float]]]] = {name: {} for name in [*engines, "llama.cpp"]}
    for count in streams:
        rounds = args.rounds if peer_model is not None else 1
        for round_index in range(rounds):
            for name, (engine, _) in engines.items():
                log(f"{name}: {count} stream(s), {args.short} and {args.long} new tokens "
                    f"(round {round_index + 1} of {rounds})")
                run = kvserve_decode(engine, prompt_ids, count, args.short, args.long)
                runs[name].setdefault(count, []).append(run)
                log(f"  {run['tokens_per_s']:.1f} tokens/s")
            if peer_model is not None and count in peer_streams:
                log(f"llama.cpp: {count} stream(s), one at a time (round {round_index + 1} of {rounds})")
                runs["llama.cpp"].setdefault(count, []).append(
                    llama_cpp_decode(peer_model, prompt_ids, count, args.short, args.long))
                log(f"  {runs['llama.cpp'][count][-1]['tokens_per_s']:.1f} tokens/s")
    kvserve = {name: {count: best_of(r) for count, r in runs[name].items()} for name in engines}
    peer = {count: best_of(r) for count, r in runs["llama.cpp"].items()}
    # The batch-1 step and the reads in turn, twice, each keeping its best: the bandwidth
    # moves from minute to minute, and a fast minute should not land on one side only.
    step_ms: dict[str, float] = {}
    reads: dict[str, float] = {}
    for round_index in range(2):
        log(f"batch-1 step times and read bandwidth (round {round_index + 1} of 2)")
        for name, (engine, _) in engines.items():
            step_ms[name] = min(step_ms.get(name, float("inf")), median_decode_step_s(engine, prompt_ids) * 1e3)
        for method, rate in measure_read_bandwidth(loaded.config.hidden_size).items():
            reads[method] = max(reads.get(method, 0.0), rate)
    read_bytes = decode_read_bytes(loaded)
    bandwidth = max(reads.values())
    floor_ms = read_bytes / bandwidth * 1e3

    report = {
        "conditions": {
            "model": args.model, "dtype": "float32", "threads": args.threads, "short": args.short, "long": args.long,
            "prompt_tokens": len(prompt_ids), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "linear_backends": variants, "shipped_backend": shipped_backend,
        },
        "load_seconds": load_s,
        "weight_bytes": weight_bytes,
        "kvserve": {str(k): v for k, v in kvserve["kvserve"].items()},
        "baseline_backend": args.baseline_backend,
        "kvserve_baseline": {str(k): v for k, v in kvserve.get(baseline, {}).items()},
        "llama_cpp": {str(k): v for k, v in peer.items()},
        "llama_cpp_note": peer_note,
        "bandwidth_reads_gb_s": {name: rate / 1e9 for name, rate in reads.items()},
        "batch1": {"step_ms": step_ms["kvserve"], "read_bytes": read_bytes, "bandwidth_gb_s": bandwidth / 1e9,
                   "floor_ms": floor_ms, "mbu": floor_ms / step_ms["kvserve"],
                   "baseline_step_ms": step_ms.get(baseline)},
    }  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    table = format_table(report)
    print(table)
    (args.out / "output.txt").write_text(table + "\n")
    plot(report, args.out / "bench_decode.png")
    log(f"wrote {args.out / 'output.txt'}, {args.out / 'results.json'} and {args.out / 'bench_decode.png'}")
    return 0


def format_table(report: dict[str, Any]) -> str:
    c = report["conditions"]
    lines = [
        f"Decode tokens/s, {c['model']} in {c['dtype']}, {c['threads']} threads, "
        f"by difference of {c['long']} and {c['short']} new tokens (prompt {c['prompt_tokens']} tokens)",
        f"weights as loaded: {report['weight_bytes'] / 2**20:.0f} MiB ({report['weight_bytes']:,} B), "
        f"loaded in {report['load_seconds']:.1f} s",
    ]
    peer = report["llama_cpp"]
    base = report.get("kvserve_baseline", {})
    base_name = f"kvserve-{report['baseline_backend']} tok/s"
    single_peer = peer.get("1", {}).get("tokens_per_s")
    lines.append(f"kvserve as shipped: --linear-backend auto = {c['shipped_backend']}")
    lines.append(f"{'streams':>8} {'kvserve tok/s':>14} {'llama.cpp tok/s':>16} {'ratio':>7} "
                 f"{base_name:>21} {'gain':>6}")
    for streams, result in report["kvserve"].items():
        rate = result["tokens_per_s"]
        peer_rate = peer.get(streams, {}).get("tokens_per_s")
        # llama.cpp decodes one sequence at a time: its N-stream aggregate is its single rate.
        basis = peer_rate if peer_rate is not None else single_peer
        ratio = f"{rate / basis:.2f}x" if basis else "-"
        shown = f"{peer_rate:.1f}" if peer_rate is not None else (f"({single_peer:.1f})" if single_peer else "-")
        base_rate = base.get(streams, {}).get("tokens_per_s")
        base_shown = f"{base_rate:.1f}" if base_rate else "-"
        gain = f"{rate / base_rate:.2f}x" if base_rate else "-"
        lines.append(f"{streams:>8} {rate:>14.1f} {shown:>16} {ratio:>7} {base_shown:>21} {gain:>6}")
    repeated = sorted(int(k) for k, r in report["kvserve"].items() if r.get("runs", 1) > 1)
    if repeated:
        most = max(r.get("runs", 1) for r in report["kvserve"].values())
        lines.append(f"streams {', '.join(map(str, repeated))}: best of {most} interleaved runs of each engine")
    if report["llama_cpp_note"]:
        lines.append(f"llama.cpp: {report['llama_cpp_note']}")
    b = report["batch1"]
    reads = ", ".join(f"{name} {rate:.1f}" for name, rate in report["bandwidth_reads_gb_s"].items())
    lines.append(f"read bandwidth, GB/s: {reads} (the fastest is the floor's)")
    base_step = f"; {report['baseline_backend']} {b['baseline_step_ms']:.1f} ms" if b.get("baseline_step_ms") else ""
    lines.append(f"batch 1: {b['step_ms']:.1f} ms per step{base_step}; floor {b['floor_ms']:.1f} ms "
                 f"({b['read_bytes'] / 2**20:.0f} MiB at {b['bandwidth_gb_s']:.1f} GB/s) -> MBU {b['mbu']:.0%}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    c = report["conditions"]
    for key, label, style in (("kvserve", f"kvserve offline (as shipped: {c['shipped_backend']})", "o-"),
                              ("kvserve_baseline", f"kvserve offline ({report['baseline_backend']})", "o--")):
        runs = report.get(key) or {}
        if runs:
            streams = [int(s) for s in runs]
            ax.plot(streams, [runs[str(s)]["tokens_per_s"] for s in streams], style, label=label)
    if report["llama_cpp"]:
        single = report["llama_cpp"].get("1", {}).get("tokens_per_s")
        measured = sorted(int(s) for s in report["llama_cpp"])
        ax.plot(measured, [report["llama_cpp"][str(s)]["tokens_per_s"] for s in measured], "s-",
                label="llama.cpp (one sequence at a time)")
        if single:
            ax.axhline(single, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("decode tokens/s (aggregate)")
    ax.set_title(f"{c['model']}, {c['dtype']}, {c['threads']} threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
