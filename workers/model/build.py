"""From command-line style arguments to a running engine: load, size the KV pool, build."""

from __future__ import annotations

import sys
from typing import Literal

import torch

from workers.engine.config import SchedulerConfig
from workers.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineArgs
from workers.engine.engine import KVPool, LLMEngine, ModelLimits
from workers.model.device import (
    cuda_memory_info,
    dtype_bytes,
    kv_budget_from_device_memory,
    resolve_dtype,
    select_device,
)
from workers.model.loader import LoadedModel, load_model
from workers.model.runner import ModelRunner, NaiveRunner, kv_block_bytes

EngineKind = Literal["batched", "cached-serial", "naive"]


def load(args: EngineArgs) -> LoadedModel:
    """Load the model named by args on the chosen device and dtype."""
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    device = select_device(args.device)
    dtype = resolve_dtype(device, args.dtype)
    return load_model(args.model, device, dtype, seed=args.seed)


def kv_pool_size(args: EngineArgs, loaded: LoadedModel) -> KVPool:
    """How many KV blocks fit in the budget (given, or from free CUDA memory)."""
    param = next(loaded.model.parameters())
    block_bytes = kv_block_bytes(loaded.config, args.block_size, param.dtype)
    budget = args.kv_cache_memory
    if budget is None:
        if param.device.type == "cuda":
            free, total = cuda_memory_info(param.device)
            # The weights are already resident, so they are counted inside total - free.
            budget = kv_budget_from_device_memory(free, total, args.gpu_memory_utilization, 0, 0)
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {budget} bytes is smaller than one KV block ({block_bytes} bytes)")
    return KVPool(num_blocks=num_blocks, block_bytes=block_bytes)


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
    )
    runner = NaiveRunner(loaded.model) if kind == "naive" else ModelRunner(
        loaded.model, loaded.config, pool.num_blocks, args.block_size
    )
    if not quiet:
        report_kv_pool(loaded, args.block_size, pool)
    limits = ModelLimits(
        vocab_size=loaded.config.vocab_size,
        max_model_len=loaded.config.max_position_embeddings,
        eos_token_ids=loaded.tokenizer.eos_token_ids,
    )
    return LLMEngine(runner, config, pool, limits, decoder=loaded.tokenizer, seed=args.seed)


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
