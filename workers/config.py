"""Engine arguments: plain, torch-free configuration, so the router and CLI can import it."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 1024**2
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
ATTENTION_BACKENDS = ("auto", "sdpa", "flashinfer")
LINEAR_BACKENDS = ("auto", "native", "onednn", "aten")


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine.

    KV pool size: kv_cache_memory bytes when given; else on CUDA what is left of
    gpu_memory_utilization (default 0.9) of the device after the weights and a profiled
    step at max_num_batched_tokens; else 256 MiB on CPU. gpu_memory_utilization on a
    device without CUDA is an error (kv_pool_size raises it, naming the flag).
    enforce_eager: never torch.compile nor CUDA graphs (on CUDA the dense parts of a layer
    are compiled, and decode-only steps replay from graphs recorded at start-up).
    attention_backend: "auto" (FlashInfer for decodes on CUDA when importable, else
    SDPA), "sdpa", or "flashinfer" (an error where it cannot run).
    linear_backend: the projections' matmuls: "auto" (for float32 on CPU, "native" where
    its kernel builds, else "onednn"; else torch's own), "native" (oneDNN on reordered
    weights, and our AVX2 kernel for calls of a few rows: decode), "onednn", "aten". An
    explicit choice that cannot run here is an error.
    enable_prefix_caching: reuse the KV of full blocks earlier requests computed for the
    same tokens (SchedulerConfig.enable_prefix_caching; always off for the naive runner).
    """

    model: str = "tiny"
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    enforce_eager: bool = False
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"EngineArgs.kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.gpu_memory_utilization is not None:
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                raise ValueError(
                    f"EngineArgs.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
                )
            if self.kv_cache_memory is not None:
                raise ValueError(
                    "EngineArgs: give kv_cache_memory or gpu_memory_utilization, not both "
                    f"(got {self.kv_cache_memory} and {self.gpu_memory_utilization})"
                )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"EngineArgs.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"EngineArgs.linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {self.linear_backend!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineArgs.max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineArgs.num_threads must be >= 1, got {self.num_threads}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"EngineArgs.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    engine: EngineArgs = field(default_factory=EngineArgs)
    # How often an engine with nothing to emit looks whether its report changed, and sends
    # it if so (every step that emits sends one). An idle engine sends nothing new.
    report_interval_s: float = 0.1
    # The actor's event loop says "alive" this often even while a step runs, so silence
    # means a dead or frozen process, and a slow step is told apart by its progress.
    heartbeat_interval_s: float = 0.25
    # workers/cpus.py: the CPUs its engine process runs on, and those every engine on the
    # node has (the actor keeps off them). Empty: wherever the OS puts them.
    engine_cpus: tuple[int, ...] = ()
    reserved_cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("WorkerConfig.worker_id must not be empty")
        if not set(self.engine_cpus) <= set(self.reserved_cpus):
            raise ValueError(f"WorkerConfig.engine_cpus {self.engine_cpus} must be among reserved_cpus "
                             f"{self.reserved_cpus}")
        for name in ("report_interval_s", "heartbeat_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkerConfig.{name} must be positive, got {getattr(self, name)}")
