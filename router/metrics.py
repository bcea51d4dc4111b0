"""Prometheus metrics of one router: worker KV state, request latencies, admission.

RouterMetrics is a Router observer (Router.observers): the router calls it on its own
event loop with (event name, payload), and it only updates prometheus_client values,
which are thread-safe, so /metrics is served by prometheus_client's own HTTP server thread. Every
RouterMetrics owns a CollectorRegistry of its own (never the global default), so many
routers can live in one process, as they do in the tests.

Latencies are measured where the router sees them:

    created_at ──────── first token ── token ── token ─ ... ── finished
    |<────── TTFT ─────>|<── ITL ──>|<─ ITL ─>|
    |<──────────────────── end-to-end ──────────────────────────────>|

TTFT and end-to-end start at the request's creation in the router (wall clock, the
timestamps that also go to Redis). ITL is the gap between two token arrivals of one
request at the router (monotonic clock); tokens that arrive together in one event are
0 s apart, so the ITL count is always the number of tokens minus the number of requests.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from router.core import Router
from router.placement import WorkerView
from router.tracker import RequestTracker
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason
from workers.messages import StepBatch

# 1 ms to 60 s, roughly three per decade.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)
_COMPLETED = frozenset({FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS})


@dataclass(frozen=True)
class _WorkerGauges:
    """One worker's labelled children, looked up once instead of per report."""

    free_kv_bytes: Any
    total_kv_bytes: Any
    kv_usage: Any
    uncommitted_blocks: Any
    running: Any
    waiting: Any
    preemptions: Any
    alive: Any
    evictable_blocks: Any
    prefix_hit_rate: Any


class RouterMetrics:
    """The router's Prometheus metrics; attaches itself to `router` as an observer."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.registry = CollectorRegistry()
        r = self.registry

        def per_worker(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, ("worker",), registry=r)

        def latency(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, buckets=LATENCY_BUCKETS, registry=r)

        self.worker_free_kv_bytes = per_worker(
            "kvserve_worker_free_kv_bytes", "Free KV cache bytes on the worker, from its last report."
        )
        self.worker_total_kv_bytes = per_worker(
            "kvserve_worker_total_kv_bytes", "KV cache bytes the worker's pool holds."
        )
        self.worker_kv_usage = per_worker(
            "kvserve_worker_kv_usage_ratio", "Share of the worker's KV cache in use: 1 - free/total."
        )
        self.worker_uncommitted_blocks = per_worker(
            "kvserve_worker_uncommitted_blocks",
            "KV blocks the router may still promise on the worker (headroom: uncommitted minus in-flight placements).",
        )
        self.worker_running = per_worker(
            "kvserve_worker_running_requests", "Requests running (holding KV) on the worker."
        )
        self.worker_waiting = per_worker(
            "kvserve_worker_waiting_requests", "Requests waiting in the worker's scheduler."
        )
        self.worker_preemptions = per_worker(
            "kvserve_worker_preemptions", "Preemptions the worker's engine has made since it started."
        )
        self.worker_alive = per_worker("kvserve_worker_alive", "1 while the worker reports, 0 once it is dead.")
        self.worker_evictable_blocks = per_worker(
            "kvserve_worker_evictable_blocks", "KV blocks cached by the worker's prefix cache that no request holds."
        )
        self.worker_prefix_hit_rate = per_worker(
            "kvserve_worker_prefix_cache_hit_rate",
            "Prompt tokens the worker found in its prefix cache over prompt tokens it looked up, since it started.",
        )
        self.worker_report_age = per_worker(
            "kvserve_worker_report_age_seconds", "Seconds since the worker's last report reached the router."
        )
        self.ttft = latency(
            "kvserve_time_to_first_token_seconds", "From the request's creation in the router to its first token."
        )
        self.queue_time = latency(
            "kvserve_request_queue_time_seconds",
            "From the request's creation in the router to its placement on the first worker that took it: the wait "
            "for KV room in the admission queue (again after a worker refused it), and placing it.",
        )
        self.itl = latency(
            "kvserve_inter_token_latency_seconds", "Between consecutive tokens of a request, as they reach the router."
        )
        self.e2e = latency(
            "kvserve_e2e_request_latency_seconds",
            "From creation to the end, for requests that completed (finish reason length, stop or eos).",
        )
        self.output_tokens = Counter("kvserve_output_tokens", "Output tokens delivered by workers.", registry=r)
        self.requests_finished = Counter(
            "kvserve_requests_finished", "Requests that ended, by finish reason.", ("reason",), registry=r
        )
        self.requests_rejected = Counter(
            "kvserve_requests_rejected",
            "Requests refused at admission: queue_full, queue_timeout, deadline.", ("reason",), registry=r,
        )
        self.placements = Counter("kvserve_placements", "Requests placed, by worker.", ("worker",), registry=r)
        self.migrations = Counter(
            "kvserve_migrations", "Requests moved off a worker that died (or adopted), by the worker left.",
            ("from_worker",), registry=r,
        )
        self.adoptions = Counter(
            "kvserve_adoptions",
            "Requests this router took over, by the router that owned them: one whose lease ended, or this "
            "router's own id for those its previous run left.", ("from_router",), registry=r,
        )
        self.refusals = Counter(
            "kvserve_worker_refusals",
            "Requests a worker refused because it could not commit their KV (another router's requests "
            "took the room this router saw); each is placed again. By worker.", ("worker",), registry=r,
        )
        self.queue_length = Gauge("kvserve_admission_queue_length", "Requests waiting for KV room.", registry=r)
        self.backfilled = Counter(
            "kvserve_admission_backfilled", "Requests placed ahead of a queue head that fit nowhere "
            "(--queue-order backfill).", registry=r)
        self.reserve_ratio = Gauge(
            "kvserve_kv_reserve_ratio",
            "The share of max_tokens a kv-aware placement commits now (--kv-reserve-ratio; with --kv-reserve-floor "
            "it adapts to how long answers are).",
            registry=r,
        )
        self.reserve_ratio.set_function(lambda: router.reserve.at(time.monotonic()))

        self._workers: dict[str, _WorkerGauges] = {}
        self._finished: dict[FinishReason, Any] = {}
        self._last_token_at: dict[str, float] = {}  # request_id -> monotonic time of its last token
        self._handlers: dict[str, Callable[[Any], None]] = {
            "tokens": self._on_tokens,
            "report": self._on_report,
            "placed": self._on_placed,
            "accepted": self._on_accepted,
            "finished": self._on_finished,
            "queued": self._on_queued,
            "backfilled": self._on_backfilled,
            "rejected": self._on_rejected,
            "worker_dead": self._on_worker_dead,
            "migrated": self._on_migrated,
            "refused": self._on_refused,
            "adopted": self._on_adopted,
        }
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None
        router.observers.append(self.observe)

    @property
    def port(self) -> int | None:
        """The port /metrics is served on, once start_http has run."""
        return self._http.server_port if self._http is not None else None

    # -- observing the router -----------------------------------------------------------

    def observe(self, name: str, payload: Any) -> None:
        handler = self._handlers.get(name)
        if handler is not None:
            handler(payload)

    def _on_tokens(self, payload: list[tuple[RequestTracker, TokenEvent]]) -> None:
        # The per-token path: one clock read and one counter per batch; a dict lookup and
        # one histogram per token.
        now = time.monotonic()
        last_token_at = self._last_token_at
        num_tokens = 0
        for tracker, event in payload:
            n = len(event.token_ids)
            num_tokens += n
            last = last_token_at.get(tracker.request_id)
            if last is not None:
                self.itl.observe(now - last)
            elif event.offset == 0:  # not an adopted request's first here: its TTFT was its first router's
                self.ttft.observe(tracker.first_token_at - tracker.created_at)
            for _ in range(n - 1):
                self.itl.observe(0.0)
            last_token_at[tracker.request_id] = now
        self.output_tokens.inc(num_tokens)

    def _on_refused(self, payload: tuple[RequestTracker, WorkerView]) -> None:
        self.refusals.labels(payload[1].worker_id).inc()

    def _on_finished(self, tracker: RequestTracker) -> None:
        self._last_token_at.pop(tracker.request_id, None)
        reason = tracker.finish_reason
        if reason is None:
            return
        counter = self._finished.get(reason)
        if counter is None:
            counter = self._finished[reason] = self.requests_finished.labels(reason.value)
        counter.inc()
        if reason in _COMPLETED:
            self.e2e.observe(time.time() - tracker.created_at)

    def _on_report(self, payload: tuple[WorkerView, StepBatch]) -> None:
        view, batch = payload
        report = batch.report
        g = self._gauges(view)
        total = report.total_kv_bytes
        free = report.free_kv_bytes
        g.free_kv_bytes.set(free)
        g.total_kv_bytes.set(total)
        g.kv_usage.set(1.0 - free / total if total else 0.0)
        g.uncommitted_blocks.set(view.headroom_blocks)
        g.running.set(report.num_running)
        g.waiting.set(report.num_waiting)
        g.preemptions.set(report.num_preemptions)
        g.alive.set(1 if view.alive else 0)
        g.evictable_blocks.set(report.num_evictable_blocks)
        g.prefix_hit_rate.set(report.prefix_cache_hit_rate or 0.0)

    def _on_placed(self, payload: tuple[RequestTracker, WorkerView]) -> None:
        _, view = payload
        self.placements.labels(view.worker_id).inc()
        self._gauges(view).uncommitted_blocks.set(view.headroom_blocks)

    def _on_accepted(self, tracker: RequestTracker) -> None:
        # To the placement its first worker took (once a request: accepted_at was 0 until
        # then): the wait after a refusal is a wait for room too (it was counted as the
        # worker's part of TTFT). An adopted request that no worker had taken counts here.
        self.queue_time.observe(max(0.0, tracker.accepted_at - tracker.created_at))

    def _on_queued(self, queue_length: int) -> None:
        self.queue_length.set(queue_length)

    def _on_backfilled(self, num_requests: int) -> None:
        self.backfilled.inc(num_requests)

    def _on_rejected(self, payload: tuple[RequestTracker, str]) -> None:
        _, reason = payload
        self.requests_rejected.labels(reason).inc()

    def _on_worker_dead(self, view: WorkerView) -> None:
        # Not its last report's load: it runs nothing and holds nothing now (its requests
        # moved), and has no room to place in. Its next report, if it comes back, sets them.
        g = self._gauges(view)
        g.alive.set(0)
        for gauge in (g.kv_usage, g.free_kv_bytes, g.uncommitted_blocks, g.running, g.waiting, g.evictable_blocks):
            gauge.set(0)

    def _on_adopted(self, payload: tuple[RequestTracker, str]) -> None:
        _, from_router = payload
        self.adoptions.labels(from_router or "none").inc()

    def _on_migrated(self, payload: tuple[RequestTracker, str]) -> None:
        _, from_worker = payload
        self.migrations.labels(from_worker or "none").inc()

    def _gauges(self, view: WorkerView) -> _WorkerGauges:
        g = self._workers.get(view.worker_id)
        if g is None:
            w = view.worker_id
            g = _WorkerGauges(
                free_kv_bytes=self.worker_free_kv_bytes.labels(w),
                total_kv_bytes=self.worker_total_kv_bytes.labels(w),
                kv_usage=self.worker_kv_usage.labels(w),
                uncommitted_blocks=self.worker_uncommitted_blocks.labels(w),
                running=self.worker_running.labels(w),
                waiting=self.worker_waiting.labels(w),
                preemptions=self.worker_preemptions.labels(w),
                alive=self.worker_alive.labels(w),
                evictable_blocks=self.worker_evictable_blocks.labels(w),
                prefix_hit_rate=self.worker_prefix_hit_rate.labels(w),
            )
            g.total_kv_bytes.set(view.info.num_blocks * view.info.block_bytes)
            g.alive.set(1 if view.alive else 0)
            self.worker_report_age.labels(w).set_function(lambda: self._report_age(w))
            self._workers[w] = g
        return g

    def _report_age(self, worker_id: str) -> float:
        # Runs in the scrape thread: reads one float that the router's loop replaces.
        view = self.router.workers.get(worker_id)
        return time.monotonic() - view.last_report_at if view is not None else float("nan")

    # -- serving /metrics ---------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)

    def start_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve this registry on host:port (prometheus_client's own server, in a daemon
        thread); port 0 picks a free one. Returns the port. Raises OSError (e.g. the port
        is taken) if it cannot bind."""
        if self._http is not None:
            raise RuntimeError(f"metrics are already served on port {self.port}")
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is None:
            return
        self._http.shutdown()
        self._http.server_close()
        if self._http_thread is not None:
            self._http_thread.join(timeout=5)
        self._http = None
        self._http_thread = None


__all__ = ["LATENCY_BUCKETS", "RouterMetrics"]
