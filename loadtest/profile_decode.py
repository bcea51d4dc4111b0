"""Where a decode step's time goes on the real model: aten ops per step and a profile by category.

    python -m loadtest.profile_decode [--model smollm2-135m-instruct] [--batches 1,16]
                                      [--baseline GIT_REV] [--rounds 6] [--steps 12]

For each batch size, `batch` greedy requests (prompts of mixed lengths) are prefilled and
then stepped through `engine.step()`, the real step: scheduling, the runner, sampling,
detokenizing. The script prints

* aten ops per decode step, counted two ways: every op the dispatcher sees from Python
  (a TorchDispatchMode: composite ops appear as what they decompose into, views
  included) and every aten/oneDNN event torch.profiler records (ops called inside other
  ops included). Op counts do not depend on the load, so on a shared machine they are
  the reliable measure of per-op overhead;
* a per-category table of one profiled step (self CPU time of each op, by what it does,
  and the Python between ops as what remains of the step);
* the minimum step time over rounds x steps unprofiled steps.

With --no-matmul every oneDNN projection and the output head return zeros of their
shape instead of reading their weights (one op each, as before): the step that remains
is the overhead alone, which the memory bandwidth of a busy machine does not hide. The
tokens are then meaningless, the op counts unchanged.

With --baseline REV the model code (workers/model/{attention,backends,llama,packed_linear,
rope,runner,sampler}.py) as it was at REV is loaded beside the working tree's under its
own package name, given the same weights, and run interleaved with it, step for step, so
both sides see the same load: timings on a 2-core machine shared with other work are
comparable only that way, and only their minimums.
"""

from __future__ import annotations

import argparse
import os
import importlib
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from workers.config import EngineArgs
from workers.engine.sampling import SamplingParams
from workers.model.build import create_engine, load
from workers.model.loader import LoadedModel
from workers.model.named_models import DEFAULT_MODEL
from workers.model.native_decode import PHASES as NATIVE_PHASES

PROMPT = "Explain, in a few paragraphs, why a KV cache makes decoding faster."
BASELINE_MODULES = ("attention", "backends", "llama", "packed_linear", "rope", "runner", "sampler")
# Far more new tokens than any run takes, so no request finishes while it is measured.
MAX_TOKENS = 4000

# Record-function labels the runner's phases are wrapped in while profiling; an op is
# charged to the innermost phase it ran in, or by its name when it ran in none.
PHASES = {"## index building": "index building", "## sampling": "sampling", "## output head": "output head"}
OP_PREFIXES = ("aten::", "mkldnn::", "native::")  # profiler events that are ops
CATEGORIES = (
    "matmuls (projections)", "output head", "attention", "RMSNorm", "rotary, SwiGLU, residual",
    "KV write + gather", "allocation", "views, slices, copies", "index building", "sampling", "other ops",
    "Python between ops",
)


def log(message: str) -> None:
    print(f"[profile] {message}", file=sys.stderr, flush=True)


# The native decode call's phases (native_decode.PHASES) by table row.
NATIVE_PHASE_CATEGORY = {
    "rotary tables": "rotary, SwiGLU, residual", "input norm": "RMSNorm", "q/k/v projection": "matmuls (projections)",
    "rotary + KV write": "rotary, SwiGLU, residual", "attention": "attention", "o projection": "matmuls (projections)",
    "post-attention norm": "RMSNorm", "gate/up projection": "matmuls (projections)",
    "SiLU x up": "rotary, SwiGLU, residual", "down projection": "matmuls (projections)", "final norm": "RMSNorm",
}


def op_category(name: str) -> str:
    """The table row of one aten/oneDNN op, by name."""
    if name.startswith("mkldnn::") or name in ("native::linear", "aten::mm", "aten::addmm", "aten::linear",
                                               "aten::matmul", "aten::bmm", "aten::_mkl_linear"):
        return "matmuls (projections)"
    if "scaled_dot_product" in name or name in ("aten::_softmax", "aten::softmax", "aten::logical_not",
                                                "aten::masked_fill", "aten::masked_fill_"):
        return "attention"
    if "rms_norm" in name or name in ("aten::rsqrt", "aten::mean", "aten::pow"):
        return "RMSNorm"
    if name in ("aten::index_copy_", "aten::index_copy", "aten::index_select", "aten::stack", "aten::index",
                "aten::index_put_"):
        return "KV write + gather"
    if name in ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zero_",
                "aten::new_empty", "aten::new_zeros", "aten::resize_", "aten::full", "aten::fill_"):
        return "allocation"
    if name in ("aten::roll", "aten::mul", "aten::mul_", "aten::addcmul", "aten::silu", "aten::silu_",
                "aten::add", "aten::add_", "aten::neg", "aten::cos", "aten::sin", "aten::embedding"):
        return "rotary, SwiGLU, residual"
    if name in ("aten::view", "aten::slice", "aten::select", "aten::transpose", "aten::unsqueeze",
                "aten::as_strided", "aten::reshape", "aten::t", "aten::permute", "aten::chunk", "aten::split",
                "aten::narrow", "aten::expand", "aten::_unsafe_view", "aten::alias", "aten::unbind",
                "aten::detach", "aten::squeeze", "aten::contiguous", "aten::copy_", "aten::clone",
                "aten::cat", "aten::to", "aten::_to_copy", "aten::lift_fresh", "aten::item",
                "aten::_local_scalar_dense", "aten::flatten", "aten::expand_as", "aten::view_as"):
        return "views, slices, copies"
    return "other ops"


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched from Python (composites as their parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- the baseline's model code


def import_baseline(rev: str) -> dict[str, ModuleType]:
    """The model modules as they were at `rev`, importable beside the working tree's.

    Each file is read with `git show`, its imports of the other baseline modules pointed at
    the copies, and written under a fresh package; everything else (config, the engine's
    plan) is the working tree's, which the baseline must still fit.
    """
    package = "kvserve_baseline_model"
    root = Path(tempfile.mkdtemp(prefix="profile_decode_"))
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    for name in BASELINE_MODULES:
        source = subprocess.run(["git", "show", f"{rev}:workers/model/{name}.py"], check=True,
                                capture_output=True, text=True).stdout
        for other in BASELINE_MODULES:
            source = source.replace(f"workers.model.{other} ", f"{package}.{other} ")
            source = source.replace(f"workers.model.{other}\n", f"{package}.{other}\n")
        (root / package / f"{name}.py").write_text(source)
    sys.path.insert(0, str(root))
    return {name: importlib.import_module(f"{package}.{name}") for name in BASELINE_MODULES}


def baseline_engine(engine_args: EngineArgs, loaded: LoadedModel, modules: dict[str, ModuleType]) -> Any:
    """An engine like create_engine's whose model and runner are the baseline's code on the
    same weights (its own fused and packed copies of them)."""
    llama = modules["llama"]
    model = llama.build_empty_model(loaded.config)
    model.load_state_dict(loaded.model.state_dict(), strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.fuse_projections()
    if loaded.model.packed:
        model.pack_linears()
    baseline_loaded = LoadedModel(model=model, config=loaded.config, tokenizer=loaded.tokenizer,
                                  name=f"{loaded.name} (baseline)")
    engine = create_engine(engine_args, baseline_loaded, quiet=True)
    runner = engine.runner
    engine.runner = modules["runner"].ModelRunner(model, loaded.config, runner.kv_pool.shape[3],
                                                  runner.block_size, runner.attention_backend)
    del runner
    return engine


# ---------------------------------------------------------------- stepping


def without_matmuls(modules: dict[str, ModuleType]) -> None:
    """Make the modules' PackedLinear return zeros of its output shape (see --no-matmul)."""
    packed = modules["packed_linear"].PackedLinear

    def zeros(self: Any, x: torch.Tensor, *residual: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.out_features)  # [T, out]

    packed.__call__ = zeros
    if hasattr(packed, "add"):
        packed.add = zeros


def start_decoding(engine: Any, prompt_ids: list[int], batch: int, tag: str) -> None:
    """Add `batch` greedy requests with prompts of mixed lengths and step until every one
    has its first token, so that each later step is a decode-only step of `batch` rows."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"{tag}-{batch}-{index}", prompt_ids + prompt_ids[: index * 3], params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(event.request_id for event in engine.step())


def abort_all(engine: Any) -> None:
    """End every request the engine still holds, freeing its blocks for the next batch size."""
    for request_id in list(engine._outputs):
        engine.abort(request_id)


@contextmanager
def phases_recorded(modules: dict[str, ModuleType], engine: Any) -> Iterator[None]:
    """Wrap the runner's phases in record_function labels (PHASES) for the profiler."""
    attention, runner, llama = modules["attention"], modules["runner"], modules["llama"]
    originals: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str, static: bool = False) -> None:
        original = owner.__dict__[name]
        function = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return function(*args, **kwargs)

        originals.append((owner, name, original))
        setattr(owner, name, classmethod(lambda cls, *a, **k: wrapped(cls, *a, **k))
                if isinstance(original, classmethod) else wrapped)

    # The native kernels (ctypes calls, invisible to the profiler) show as ops of their own.
    native = sys.modules.get("workers.model.native_linear")
    norms: list[tuple[Any, Any]] = []
    if native is not None:
        wrap(native.NativeLinear, "linear", "native::linear")
        wrap(native.NativeLinear, "rms_norm", "native::rms_norm")
        # RMSNorm modules hold the kernel's bound method: bind them to the wrapped one.
        for module in engine.runner.model.modules():
            kernel = getattr(module, "kernel", None)
            if isinstance(getattr(kernel, "__self__", None), native.NativeLinear) and kernel.__name__ == "rms_norm":
                norms.append((module, kernel))
                module.kernel = kernel.__self__.rms_norm
    decoder = sys.modules.get("workers.model.native_decode")
    if decoder is not None:
        wrap(decoder.NativeDecoder, "forward", "native::decode")
    wrap(attention.AttentionBatch, "build", "## index building")
    wrap(runner, "sample_next_tokens", "## sampling")
    wrap(llama.LlamaModel, "compute_logits", "## output head")
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)
        for module, kernel in norms:
            module.kernel = kernel


def count_ops(engine: Any) -> tuple[int, int, Counter[str]]:
    """(dispatched ops, profiler op events, dispatched ops by name) of one decode step."""
    counter = OpCounter()
    with counter:
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    events = sum(1 for e in prof.events() if e.name.startswith(("aten::", "mkldnn::")))
    return sum(counter.counts.values()), events, counter.counts


def profile_step(engine: Any, modules: dict[str, ModuleType], steps: int) -> dict[str, float]:
    """ms per step by category: the best of `steps` profiled steps, category by category
    summed over one step's ops (self time), and the step's own wall time under the profiler."""
    best: dict[str, float] = {}
    decoder = getattr(engine.runner.model, "native_decoder", None)
    with phases_recorded(modules, engine):
        for _ in range(steps):
            if decoder is not None:
                decoder.phase_seconds = torch.zeros(len(NATIVE_PHASES), dtype=torch.float64)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with record_function("## step"):
                    engine.step()
            totals = categorise(prof.events(), None if decoder is None else decoder.phase_seconds.tolist())
            if decoder is not None:
                decoder.phase_seconds = None
            if not best or totals["step, profiled"] < best["step, profiled"]:
                best = totals
    return best


def categorise(events: Any, native_phases: list[float] | None = None) -> dict[str, float]:
    """Self time of every op, charged to the phase it ran in or else to the category of the
    outermost op it ran under (SDPA's inner transposes are attention, rms_norm's inner
    pow and mean are the norm); what the step took beyond its ops is Python. The native
    decode call is split by the seconds of its phases (native_phases, native_decode.PHASES
    order); what it took beyond them is "other ops"."""
    totals: dict[str, float] = defaultdict(float)
    step_us = 0.0
    ops_us = 0.0
    for event in events:
        if event.name == "## step":
            step_us = event.cpu_time_total
            continue
        if not event.name.startswith(OP_PREFIXES):
            continue
        ops_us += event.self_cpu_time_total
        if event.name == "native::decode" and native_phases is not None:
            for phase, seconds in zip(NATIVE_PHASES, native_phases):
                totals[NATIVE_PHASE_CATEGORY[phase]] += seconds * 1e6
            totals["other ops"] += event.self_cpu_time_total - sum(native_phases) * 1e6
            continue
        outermost, phase, parent = event, None, event.cpu_parent
        while parent is not None and phase is None:
            if parent.name in PHASES:
                phase = PHASES[parent.name]
            elif parent.name.startswith(OP_PREFIXES):
                outermost = parent
            parent = parent.cpu_parent
        totals[phase if phase is not None else op_category(outermost.name)] += event.self_cpu_time_total
    result = {name: totals.get(name, 0.0) / 1e3 for name in CATEGORIES}
    result["Python between ops"] = (step_us - ops_us) / 1e3
    result["step, profiled"] = step_us / 1e3
    return result


def min_step_ms(engines: dict[str, Any], rounds: int, steps: int) -> dict[str, float]:
    """Minimum step time of each engine, interleaved step by step over rounds."""
    best = {name: float("inf") for name in engines}
    for _ in range(rounds):
        for _ in range(steps):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--baseline", default=None, help="a git revision whose model code runs beside this one")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12, help="steps per round (and profiled steps)")
    parser.add_argument("--top", type=int, default=0, help="also print the N most frequent dispatched ops")
    parser.add_argument("--linear-backend", default="auto")
    parser.add_argument("--no-matmul", action="store_true", help="projections return zeros: the overhead alone")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]

    engine_args = EngineArgs(model=args.model, device="cpu", dtype="float32", num_threads=args.threads,
                             kv_cache_memory=512 * 2**20, max_num_seqs=max(64, max(batches)),
                             linear_backend=args.linear_backend)
    log(f"loading {args.model} (float32, {args.threads} threads)")
    loaded = load(engine_args)
    prompt_ids = loaded.tokenizer.encode(PROMPT)
    current = {name: importlib.import_module(f"workers.model.{name}") for name in BASELINE_MODULES}
    engines: dict[str, tuple[Any, dict[str, ModuleType]]] = {"current": (create_engine(engine_args, loaded, quiet=True),
                                                                          current)}
    if args.baseline:
        log(f"loading the model code of {args.baseline} beside it")
        modules = import_baseline(args.baseline)
        engines = {"baseline": (baseline_engine(engine_args, loaded, modules), modules), **engines}

    if args.no_matmul:
        for _, modules in engines.values():
            without_matmuls(modules)
    for batch in batches:
        for name, (engine, _) in engines.items():
            start_decoding(engine, prompt_ids, batch, name)
            for _ in range(3):  # oneDNN's first calls at this batch size, page faults
                engine.step()
        print(f"\n== batch {batch}: decode-only steps, prompts of {len(prompt_ids)} to "
              f"{len(prompt_ids) + 3 * (batch - 1)} tokens")
        counts = {name: count_ops(engine) for name, (engine, _) in engines.items()}
        profiles = {name: profile_step(engine, modules, args.steps) for name, (engine, modules) in engines.items()}
        minimum = min_step_ms({name: engine for name, (engine, _) in engines.items()}, args.rounds, args.steps)
        names = list(engines)
        print(f"{'':32}" + "".join(f"{name:>12}" for name in names))
        print(f"{'aten ops per step (dispatched)':32}" + "".join(f"{counts[n][0]:>12,}" for n in names))
        print(f"{'aten ops per step (profiler)':32}" + "".join(f"{counts[n][1]:>12,}" for n in names))
        print(f"{'min step ms, unprofiled':32}" + "".join(f"{minimum[n]:>12.2f}" for n in names))
        print(f"-- ms per step, best of {args.steps} profiled steps (the profiler adds ~1-2 us per op)")
        for category in (*CATEGORIES, "step, profiled"):
            print(f"{category:32}" + "".join(f"{profiles[n][category]:>12.2f}" for n in names))
        if args.top:
            for name in names:
                print(f"-- {name}: most frequent dispatched ops")
                for op, count in counts[name][2].most_common(args.top):
                    print(f"   {count:>6} {op}")
        for engine, _ in engines.values():
            abort_all(engine)
    print(f"\nload average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
