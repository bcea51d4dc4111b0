"""Starting worker actors on Ray: one per GPU, or CPU workers with a set thread count."""

from __future__ import annotations

from typing import Any

from workers.actor import WorkerActor
from workers.config import WorkerConfig


def spawn_worker(
    config: WorkerConfig,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    resources: dict[str, float] | None = None,
    max_restarts: int = 0,
    scheduling_strategy: str = "SPREAD",
    name: str | None = None,
    detached: bool = False,
) -> Any:
    """Create one WorkerActor; returns its handle (it loads the model in the background).

    A named worker that already exists is reused, not created: a restarted router finds
    the workers of the one before it (detached ones outlive the process that made them)."""
    import ray

    actor_class = ray.remote(WorkerActor)
    return actor_class.options(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=resources or {},
        max_restarts=max_restarts,
        max_concurrency=64,
        scheduling_strategy=scheduling_strategy,  # SPREAD: workers on as many nodes as fit
        name=name,
        get_if_exists=name is not None,
        lifetime="detached" if detached else None,
    ).remote(config)
