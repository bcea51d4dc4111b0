"""The GPU check: the engine's numerics and speed on one CUDA device, in one run.

    python -m loadtest.gpu_check                        # on a GPU (make gpu-check), < 5 minutes
    python -m loadtest.gpu_check --device cpu --smoke   # seconds, on CPU: what the suite runs

1. Equivalence. A tiny random Llama checkpoint (GQA, untied head) is saved with
   transformers and loaded through kvserve's loader in bfloat16 on the device. The
   engine decodes greedily with continuous batching and chunked prefill. bf16 rounding
   may flip a near tie, so the rule is on log-probabilities, not tokens: under the
   float32 transformers reference, given the same prefix, every token the engine picked
   is within --logprob-tolerance nats of the reference's best token.
2. Benchmark. A random-weight model of Llama-3.2-1B's shape sized by
   --gpu-memory-utilization (the KV pool is what the weights and a profiled step leave),
   then decode tokens/s at batch 1, 8 and 64, and MBU: the bytes a decode step must read
   (weights + the batch's KV) over the step time, against the device's bandwidth
   measured in the same run by a large device-to-device copy.

Prints a table and writes results.json under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from workers.config import EngineArgs
from workers.engine.collect import PromptSpec, run_to_completion
from workers.engine.sampling import SamplingParams
from workers.model.build import create_engine, kv_pool_size, load
from workers.model.device import dtype_bytes


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    source = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * source.numel() * source.element_size() / times[len(times) // 2]


# ---------------------------------------------------------------- 1. equivalence


def _write_checkpoint(directory: Path) -> Any:
    """A tiny random Llama (4 heads over 2 KV heads, untied head) and a word tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(300)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return model


def check_equivalence(device: str, smoke: bool, tolerance: float, enforce_eager: bool = False) -> dict[str, Any]:
    num_new = 8 if smoke else 48
    lengths = (5, 17, 33) if smoke else (1, 5, 15, 16, 17, 31, 32, 33, 64, 100)
    with tempfile.TemporaryDirectory() as tmp:
        reference = _write_checkpoint(Path(tmp))
        dtype = "float32" if device == "cpu" else "bfloat16"
        # max_num_batched_tokens=48: chunked prefill of the longer prompts
        args = EngineArgs(model=tmp, device=device, dtype=dtype, kv_cache_memory=64 * 2**20,
                          max_num_batched_tokens=48, enforce_eager=enforce_eager)
        loaded = load(args)
        engine = create_engine(args, loaded, quiet=True)
    generator = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in lengths]
    greedy = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    outputs = run_to_completion(engine, [PromptSpec(tuple(p), greedy) for p in prompts])

    worst_gap, num_match, num_tokens = 0.0, 0, 0
    for prompt, output in zip(prompts, outputs):
        sequence = torch.tensor([prompt + output.output_ids])
        with torch.no_grad():
            logits = reference(sequence).logits[0].float()  # [len, vocab]
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [num_new, vocab]: predicts each output
        picked = torch.tensor(output.output_ids)
        gaps = logprobs.max(dim=-1).values - logprobs.gather(1, picked[:, None])[:, 0]  # [num_new]
        worst_gap = max(worst_gap, float(gaps.max()))
        num_match += int((logprobs.argmax(dim=-1) == picked).sum())
        num_tokens += len(output.output_ids)
    return {
        "dtype": dtype,
        "enforce_eager": enforce_eager,
        "outputs": [output.output_ids for output in outputs],
        "num_requests": len(prompts),
        "num_tokens": num_tokens,
        "argmax_match_fraction": num_match / num_tokens,
        "worst_logprob_gap": worst_gap,
        "tolerance": tolerance,
        "passed": worst_gap <= tolerance,
    }


# ---------------------------------------------------------------- 2. benchmark


def _weight_bytes_per_step(loaded: Any) -> int:
    """Bytes a decode step reads from weights: all of them, but only a row of an untied embedding."""
    total = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    if not loaded.config.tie_word_embeddings:
        embed = loaded.model.get_parameter("model.embed_tokens.weight")
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total


def decode_rate(engine: Any, batch: int, prompt_len: int, num_steps: int) -> float:
    """Median seconds of a decode step with `batch` requests decoding at once."""
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"b{batch}-{index}", [(index * 7 + j) % 250 for j in range(prompt_len)], params)
    produced: dict[str, int] = {}
    while len(produced) < batch or min(produced.values()) < 2:  # every prompt prefilled
        for event in engine.step():
            produced[event.request_id] = produced.get(event.request_id, 0) + len(event.token_ids)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished:
        engine.step()
    times.sort()
    return times[len(times) // 2]


def benchmark(device: str, smoke: bool, utilization: float | None, enforce_eager: bool) -> dict[str, Any]:
    model = "tiny" if smoke else "llama-3.2-1b"
    batches = (1, 4) if smoke else (1, 8, 64)
    prompt_len, num_steps = (16, 8) if smoke else (128, 64)
    args = EngineArgs(
        model=model, device=device, max_num_seqs=max(batches), enforce_eager=enforce_eager,
        kv_cache_memory=64 * 2**20 if device == "cpu" else None,
        gpu_memory_utilization=None if device == "cpu" else utilization,
    )
    log(f"building {model} on {device}" + (", eager" if enforce_eager else ""))
    loaded = load(args)
    started = time.perf_counter()
    engine = create_engine(args, loaded)
    build_s = time.perf_counter() - started
    graphs = getattr(engine.runner, "graphs", None)
    pool = kv_pool_size(args, loaded)
    param = next(loaded.model.parameters())
    torch_device = param.device
    bandwidth = measure_bandwidth(torch_device, (64 if smoke else 1024) * 2**20)
    weight_bytes = _weight_bytes_per_step(loaded)
    kv_per_token = loaded.config.kv_bytes_per_token(dtype_bytes(param.dtype))
    rows = []
    decode_rate(engine, 1, prompt_len, 4)  # warm-up: compilation, cuBLAS handles, allocator
    for batch in batches:
        step_s = decode_rate(engine, batch, prompt_len, num_steps)
        context = prompt_len + num_steps // 2  # the median step's context per request
        step_bytes = weight_bytes + batch * context * kv_per_token
        rows.append({
            "batch": batch,
            "step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s,
            "bytes_per_step": step_bytes,
            "mbu": step_bytes / step_s / bandwidth,
        })
        log(f"batch {batch}: {step_s * 1e3:.2f} ms/step, {batch / step_s:,.0f} tok/s")
    return {
        "model": model,
        "dtype": str(param.dtype).removeprefix("torch."),
        "attention_backend": engine.runner.attention_backend,
        "compiled": torch_device.type == "cuda" and not enforce_eager,
        "num_graphs": 0 if graphs is None else graphs.num_graphs,
        "capture_s": build_s if graphs is not None else 0.0,
        "num_parameters": loaded.config.num_parameters(),
        "weight_bytes_per_step": weight_bytes,
        "kv_pool_bytes": pool.num_blocks * pool.block_bytes,
        "kv_pool_blocks": pool.num_blocks,
        "kv_pool_tokens": pool.num_blocks * args.block_size,
        "bandwidth_gb_s": bandwidth / 1e9,
        "decode": rows,
    }


def _release(device: str) -> None:
    """Give the last engine's device memory back before the next one sizes its KV pool."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda[:N], or cpu (with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="small models and batches: seconds, for the test suite")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="only the eager engine (no torch.compile, no step graphs); by default both, side by side")
    parser.add_argument("--logprob-tolerance", type=float, default=None,
                        help="nats (default: 0.1 in bfloat16, 1e-4 in float32)")
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check"))
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; on CPU run --device cpu --smoke", file=sys.stderr)
        return 2
    tolerance = args.logprob_tolerance or (1e-4 if args.device == "cpu" else 0.1)

    started = time.perf_counter()
    log("equivalence against transformers, with step graphs" + (" off" if args.enforce_eager else ""))
    equivalence = check_equivalence(args.device, args.smoke, tolerance, args.enforce_eager)
    if not args.enforce_eager:
        log("equivalence again, eager (--enforce-eager): the same prompts")
        eager = check_equivalence(args.device, args.smoke, tolerance, enforce_eager=True)
        same = sum(a == b for a, b in zip(equivalence["outputs"], eager["outputs"]))
        equivalence["eager"] = {k: v for k, v in eager.items() if k != "outputs"}
        equivalence["requests_equal_to_eager"] = same
        equivalence["passed"] = equivalence["passed"] and eager["passed"]
    log("benchmark")
    bench = benchmark(args.device, args.smoke, args.gpu_memory_utilization, args.enforce_eager)
    if not args.enforce_eager:
        _release(args.device)
        log("benchmark again, eager (--enforce-eager)")
        bench["eager"] = benchmark(args.device, args.smoke, args.gpu_memory_utilization, True)
    report = {
        "date": datetime.date.today().isoformat(),
        "device": device_name(args.device),
        "torch": torch.__version__,
        "smoke": args.smoke,
        "seconds": time.perf_counter() - started,
        "equivalence": equivalence,
        "benchmark": bench,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print_report(report)
    return 0 if equivalence["passed"] else 1


def print_report(report: dict[str, Any]) -> None:
    e, b = report["equivalence"], report["benchmark"]
    print(f"GPU check, {report['date']}, {report['device']}, torch {report['torch']}, {report['seconds']:.0f} s")
    print(
        f"equivalence ({e['dtype']}, {e['num_requests']} requests, {e['num_tokens']} tokens): "
        f"{e['argmax_match_fraction']:.1%} equal the float32 reference's argmax; worst log-prob gap "
        f"{e['worst_logprob_gap']:.4f} nats (tolerance {e['tolerance']:g}): {'PASS' if e['passed'] else 'FAIL'}"
    )
    if "eager" in e:
        g = e["eager"]
        print(
            f"  eager engine on the same prompts: {g['argmax_match_fraction']:.1%} argmax, worst gap "
            f"{g['worst_logprob_gap']:.4f} nats; {e['requests_equal_to_eager']}/{e['num_requests']} requests "
            f"token-identical to the graphed engine's"
        )
    print(
        f"{b['model']} ({b['num_parameters'] / 1e9:.2f}B, {b['dtype']}, decode attention {b['attention_backend']}, "
        f"compiled {'yes' if b['compiled'] else 'no'}): KV pool {b['kv_pool_bytes'] / 2**30:.2f} GiB = "
        f"{b['kv_pool_blocks']:,} blocks = {b['kv_pool_tokens']:,} tokens; bandwidth {b['bandwidth_gb_s']:.0f} GB/s"
    )
    if "eager" not in b:
        print("| batch | ms/step | tokens/s | MBU |")
        print("|---|---|---|---|")
        for row in b["decode"]:
            print(f"| {row['batch']} | {row['step_ms']:.2f} | {row['tokens_per_s']:,.0f} | {row['mbu']:.0%} |")
        return
    print(f"step graphs: {b.get('num_graphs', 0)} captured in {b.get('capture_s', 0.0):.1f} s")
    print("| batch | eager ms/step | graphs ms/step | graphs / eager tokens/s | eager MBU | graphs MBU |")
    print("|---|---|---|---|---|---|")
    for row, eager in zip(b["decode"], b["eager"]["decode"]):
        print(f"| {row['batch']} | {eager['step_ms']:.2f} | {row['step_ms']:.2f} | "
              f"{row['tokens_per_s'] / eager['tokens_per_s']:.2f}x | {eager['mbu']:.0%} | {row['mbu']:.0%} |")


if __name__ == "__main__":
    sys.exit(main())
