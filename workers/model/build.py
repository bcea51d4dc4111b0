"""From command-line style arguments to a running engine: load, size the KV pool, build."""

from __future__ import annotations

import sys
import time
from typing import Literal

import torch

from workers.engine.config import SchedulerConfig
from workers.config import DEFAULT_CPU_KV_CACHE_MEMORY, DEFAULT_GPU_MEMORY_UTILIZATION, EngineArgs
from workers.engine.engine import KVPool, LLMEngine, ModelLimits
from workers.model.backends import select_attention_backend
from workers.model.device import dtype_bytes, resolve_dtype, select_device
from workers.model.loader import LoadedModel, load_model
from workers.model.llama import LlamaModel
from workers.model.native_decode import NATIVE_DECODE_MAX_ROWS
from workers.model.native_linear import native_linear_problem
from workers.model.packed_linear import NATIVE_MAX_ROWS, select_linear_backend
from workers.model.memory import MemoryProfile, describe_budget, kv_budget_from_profile, profile_cuda_memory
from workers.model.runner import ModelRunner, NaiveRunner, StepGraphLimits, kv_block_bytes

EngineKind = Literal["batched", "cached-serial", "naive"]
# Decode steps whose longest context is past this many tokens run eagerly: a graph's
# padded gather is batch x context, and graphs past it would cost more memory than launches.
GRAPH_MAX_CONTEXT = 4096


def load(args: EngineArgs) -> LoadedModel:
    """Load the model named by args on the chosen device and dtype."""
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    device = select_device(args.device)
    dtype = resolve_dtype(device, args.dtype)
    loaded = load_model(args.model, device, dtype, seed=args.seed)
    linear_backend = select_linear_backend(device, dtype, args.linear_backend)
    if linear_backend in ("native", "onednn"):
        loaded.model.pack_linears(native=linear_backend == "native")
    if device.type == "cuda" and not args.enforce_eager:
        loaded.model.compile_dense()
    return loaded


def kv_pool_size(args: EngineArgs, loaded: LoadedModel) -> KVPool:
    """How many KV blocks fit in the budget: kv_cache_memory, or on CUDA what a profiled
    step leaves of gpu_memory_utilization of the device, or 256 MiB on CPU. Asking again
    gives the same answer (the profile is measured once per model and step shape)."""
    param = next(loaded.model.parameters())
    block_bytes = kv_block_bytes(loaded.config, args.block_size, param.dtype)
    budget = args.kv_cache_memory
    if budget is None:
        if param.device.type == "cuda":
            budget = _profiled_kv_budget(args, loaded)
        elif args.gpu_memory_utilization is not None:
            raise ValueError(
                f"--gpu-memory-utilization (EngineArgs.gpu_memory_utilization) sizes the KV pool from a CUDA "
                f"device's memory; this engine runs on {param.device}: give --kv-cache-memory instead"
            )
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {budget} bytes is smaller than one KV block ({block_bytes} bytes)")
    return KVPool(num_blocks=num_blocks, block_bytes=block_bytes)


def _profiled_kv_budget(args: EngineArgs, loaded: LoadedModel) -> int:
    """KV bytes from a profile of the largest step this engine's scheduler can plan."""
    utilization = args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    key = (args.max_num_batched_tokens, args.max_num_seqs)
    profile: MemoryProfile | None = loaded.memory_profiles.get(key)
    if profile is None:
        profile = profile_cuda_memory(loaded.model, args.max_num_batched_tokens, args.max_num_seqs, args.block_size)
        loaded.memory_profiles[key] = profile
        print(describe_budget(kv_budget_from_profile(profile, utilization), profile, utilization), file=sys.stderr)
    return kv_budget_from_profile(profile, utilization).kv_bytes


def create_engine(args: EngineArgs, loaded: LoadedModel, kind: EngineKind = "batched", quiet: bool = False) -> LLMEngine:
    """Build an engine around an already loaded model (engines can share one model)."""
    pool = kv_pool_size(args, loaded)
    max_model_len = args.max_model_len or loaded.config.max_position_embeddings
    if kind == "batched":
        max_num_seqs, max_num_batched_tokens = args.max_num_seqs, args.max_num_batched_tokens
    else:
        # The one-at-a-time baselines prefill a whole prompt in one step.
        max_num_seqs, max_num_batched_tokens = 1, max(args.max_num_batched_tokens, max_model_len)
    config = SchedulerConfig(
        max_model_len=max_model_len,
        block_size=args.block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        # The naive runner keeps no KV, so it cannot start a request past position 0.
        enable_prefix_caching=args.enable_prefix_caching and kind != "naive",
    )
    device = next(loaded.model.parameters()).device
    backend = select_attention_backend(device, args.attention_backend)
    graphs = None
    if device.type == "cuda" and not args.enforce_eager and kind == "batched":
        graphs = StepGraphLimits(max_num_seqs, min(max_model_len, GRAPH_MAX_CONTEXT))
    runner = NaiveRunner(loaded.model) if kind == "naive" else ModelRunner(
        loaded.model, loaded.config, pool.num_blocks, args.block_size, backend.name, graphs
    )
    if not quiet:
        report_kv_pool(loaded, args.block_size, pool)
    graph_line = "off"
    if graphs is not None and isinstance(runner, ModelRunner) and runner.graphs is not None:
        started = time.perf_counter()
        say = (lambda _: None) if quiet else (lambda line: print(f"[kvserve] {line}", file=sys.stderr, flush=True))
        count = runner.capture_graphs(say)
        graph_line = (f"{count} captured in {time.perf_counter() - started:.1f} s (decode-only steps up to "
                      f"{graphs.max_batch} requests and {graphs.max_context} tokens)")
    if not quiet and kind != "naive":
        compiled = device.type == "cuda" and not args.enforce_eager
        print(
            f"[kvserve] decode attention: {runner.attention_backend} ({backend.reason}); "
            f"torch.compile of norms and MLP: {'on' if compiled else 'off'}; CUDA graphs: {graph_line}; "
            f"projections: {_describe_projections(loaded.model)}",
            file=sys.stderr,
        )
    limits = ModelLimits(
        vocab_size=loaded.config.vocab_size,
        max_model_len=loaded.config.max_position_embeddings,
        eos_token_ids=loaded.tokenizer.eos_token_ids,
    )
    return LLMEngine(runner, config, pool, limits, decoder=loaded.tokenizer, seed=args.seed)


def _describe_projections(model: LlamaModel) -> str:
    if model.native_linear:
        return (f"decode-only steps of up to {NATIVE_DECODE_MAX_ROWS} requests in one native call (every layer, "
                f"attention included), other calls native up to {NATIVE_MAX_ROWS} rows and oneDNN on packed "
                f"weights above")
    if not model.packed:
        return "torch matmul"
    problem = native_linear_problem()
    return "oneDNN on packed weights" + (f" (no native kernel: {problem})" if problem else "")


def report_kv_pool(loaded: LoadedModel, block_size: int, pool: KVPool) -> None:
    """Print the KV arithmetic at start-up: the numbers every later decision is made from."""
    param = next(loaded.model.parameters())
    per_token = loaded.config.kv_bytes_per_token(dtype_bytes(param.dtype))
    c = loaded.config
    print(
        f"[kvserve] model {loaded.name}: {c.num_parameters() / 1e6:.1f}M params, {param.dtype} on {param.device}\n"
        f"[kvserve] KV bytes per token: 2 x {c.num_layers} layers x {c.num_kv_heads} kv heads x "
        f"{c.head_dim} head dim x {dtype_bytes(param.dtype)} B = {per_token} B\n"
        f"[kvserve] KV block: {block_size} tokens = {pool.block_bytes} B; "
        f"{pool.num_blocks} blocks = {pool.num_blocks * pool.block_bytes / 2**20:.1f} MiB; "
        f"{pool.num_blocks * block_size} tokens fit",
        file=sys.stderr,
    )
