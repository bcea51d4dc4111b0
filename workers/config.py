"""Engine arguments: plain, torch-free configuration, so the router and CLI can import it."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 1024**2


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine. kv_cache_memory None: 256 MiB on CPU, a
    gpu_memory_utilization share of the device on CUDA."""

    model: str = "tiny"
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"EngineArgs.kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"EngineArgs.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineArgs.max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineArgs.num_threads must be >= 1, got {self.num_threads}")


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    engine: EngineArgs = field(default_factory=EngineArgs)
    report_interval_s: float = 0.1

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("WorkerConfig.worker_id must not be empty")
        if not self.report_interval_s > 0:
            raise ValueError(f"WorkerConfig.report_interval_s must be positive, got {self.report_interval_s}")
