"""Engine CPUs: keep each worker's engine process on cores nothing else of kvserve uses.

On a small model most of a step is the engine's own Python and op dispatch, and a step
slows by whatever shares its core. Measured on a 2-core machine (`make bench-router`):
an engine process took 3.32 ms per decode step where the same engine alone took 2.42 ms,
while the router, the worker actor and the client woke on every step and the scheduler put
them on its core; with the engine on one core and everything else on the other, 2.47 ms.

With `--engine-cpus 2-7` (taskset's list syntax), the engines on a node split those CPUs
(worker i of n takes the i-th slice; fewer CPUs than workers: all share them all), and the
`kvserve up` process (its router, the Redis and Ray it starts) and each worker actor keep
to the CPUs left. Affinity is per thread on Linux: a process's threads are set one by one,
and the threads it starts later inherit the setting of the one that starts them.
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0,2-4' -> (0, 2, 3, 4); ValueError saying what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"expected CPU numbers like 1 or 2-7, comma-separated; got {text!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"expected CPU numbers like 1 or 2-7, comma-separated; got {text!r}")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def engine_slice(cpus: tuple[int, ...], index: int, count: int) -> tuple[int, ...]:
    """Worker index of count's share of the engine CPUs: a slice of its own when there
    are enough to go round, else all of them."""
    if len(cpus) < count:
        return cpus
    return cpus[index * len(cpus) // count : (index + 1) * len(cpus) // count]


def keep_off(reserved: tuple[int, ...], what: str) -> None:
    """Move every thread of this process off the reserved CPUs; ValueError if that leaves
    none."""
    allowed = os.sched_getaffinity(0) - set(reserved)
    if not allowed:
        raise ValueError(f"{what}: the engine CPUs {list(reserved)} leave no CPU of "
                         f"{sorted(os.sched_getaffinity(0))} for the rest of kvserve")
    set_process_cpus(allowed)


def set_process_cpus(cpus: set[int] | tuple[int, ...]) -> None:
    """Every thread of this process onto cpus."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
