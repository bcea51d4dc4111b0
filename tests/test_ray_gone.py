"""When a router that joined a Ray takes that Ray for gone (cluster/local.py, _ray_gone):
the GCS refusing for RAY_GONE_AFTER_S with no worker left, and nothing else. The probe's
socket is replaced here; tests/test_state_dir_ownership.py runs the real thing (a joined
`kvserve router` whose `kvserve up` stops)."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

import cluster.local as local


class _Writer:
    def close(self) -> None:
        pass


def _probes(monkeypatch: pytest.MonkeyPatch, answers: Callable[[int], BaseException | None]) -> None:
    """Probe n answers answers(n): None connects, an exception is raised."""
    count = iter(range(10**9))

    async def open_connection(*_: Any, **__: Any) -> tuple[None, _Writer]:
        failure = answers(next(count))
        if failure is not None:
            raise failure
        return None, _Writer()

    monkeypatch.setattr(local, "RAY_PROBE_INTERVAL_S", 0.01)
    monkeypatch.setattr(local, "RAY_GONE_AFTER_S", 0.1)
    monkeypatch.setattr(asyncio, "open_connection", open_connection)


def _judged(workers_alive: bool = False, answered_at_start: bool = False) -> str | None:
    """What _ray_gone says within a second (None: still watching)."""
    cluster = local.Cluster.__new__(local.Cluster)
    cluster.router = SimpleNamespace(alive_workers=["w0"] if workers_alive else [])
    cluster.ray_gone = False
    cluster.gcs_answered = answered_at_start

    async def watch() -> str | None:
        try:
            return await asyncio.wait_for(cluster._ray_gone("10.0.0.5:6379"), 1.0)
        except TimeoutError:
            return None

    said = asyncio.run(watch())
    assert cluster.ray_gone == (said is not None)
    return said


def test_a_gcs_that_answered_then_refuses_with_no_worker_left_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    _probes(monkeypatch, lambda n: None if n < 2 else ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    said = _judged()
    assert said is not None and said.startswith("the cluster's Ray is gone: its GCS at 10.0.0.5:6379 has refused")


def test_no_answer_counts_as_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    _probes(monkeypatch, lambda n: None if n < 1 else TimeoutError())
    assert _judged() is not None


def test_a_probe_this_process_cannot_send_counts_for_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE: a router at its file-descriptor limit (the busiest one) took Ray for gone,
    and exited with no drain, cutting every stream (a review's find)."""
    _probes(monkeypatch, lambda n: None if n < 1 else OSError(errno.EMFILE, "Too many open files"))
    assert _judged() is None


def test_a_gcs_never_reached_is_never_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GCS this process cannot reach directly (joined through Ray Client, say) refuses
    from the first probe: that says nothing of the cluster."""
    _probes(monkeypatch, lambda n: ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    assert _judged() is None


def test_a_gcs_that_answered_at_the_start_and_refuses_from_the_first_probe_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its cluster stopped before the watch's first probe (a joined router that had just
    become ready: the suite's run hit it): the start's own probe is the answer."""
    _probes(monkeypatch, lambda n: ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    assert _judged(answered_at_start=True) is not None


def test_a_gcs_restarting_while_workers_serve_is_not_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """With GCS fault tolerance a restart can take longer than RAY_GONE_AFTER_S, and the
    workers serve on (their streams do not go through the GCS): no router stops for it."""
    _probes(monkeypatch, lambda n: None if n < 1 else ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert _judged(workers_alive=True) is None
