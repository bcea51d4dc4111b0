"""Measuring a running router from the inside: its hops per request, CPU by process, and
the cost of its metrics observer and of its own Python on the token path."""

from __future__ import annotations

import time
from typing import Any

from loadtest.grpc_load import Timeline
from loadtest.metrics import percentile


class HopClock:
    """A router observer that timestamps each request's hops (time.time(), which the
    client and the worker's KV reports also use):

        client sends ─> router places ─> engine sends the step ─> actor hands it out ─> router has it ─> client has it
                 ingress      dispatch + prefill     engine -> actor         events connection      gRPC out

    The engine's clock is its batch's sent_at, taken right after the step; the actor's is
    handed_at, as its stream hands the batch to its router's events connection."""

    def __init__(self) -> None:
        self.placed_at: dict[str, float] = {}
        self.placed_on: dict[str, str] = {}  # request_id -> worker_id
        self.worker_sent: dict[str, list[float]] = {}  # per token event, the step's sent_at
        self.router_got: dict[str, list[float]] = {}
        self.actor_handed: dict[str, float] = {}  # the first token's batch's handed_at
        self.engine_step: dict[str, list[float]] = {}  # per token event, its step's own time in the engine
        self._sent_at: dict[str, tuple[float, float, float]] = {}  # worker_id -> the batch being handled's stamps

    def observe(self, name: str, payload: Any) -> None:
        if name == "report":
            view, batch = payload
            self._sent_at[view.worker_id] = (batch.sent_at, batch.handed_at, batch.step_s)
        elif name == "placed":
            tracker, view = payload
            self.placed_at[tracker.request_id] = time.time()
            self.placed_on[tracker.request_id] = view.worker_id
        elif name == "tokens":
            nan = float("nan")
            for tracker, _ in payload:
                rid = tracker.request_id
                sent_at, handed_at, step_s = self._sent_at.get(self.placed_on.get(rid, ""), (nan, nan, nan))
                self.actor_handed.setdefault(rid, handed_at)
                self.engine_step.setdefault(rid, []).append(step_s)
                self.worker_sent.setdefault(rid, []).append(sent_at)
                self.router_got.setdefault(rid, []).append(time.time())

    def breakdown(self, timelines: list[Timeline]) -> dict[str, float]:
        """p50 of each hop of the first token, and of the gap between two token steps as
        the worker sent them, as the router got them, and as the client got them (ms)."""
        hops: dict[str, list[float]] = {
            k: [] for k in ("ingress", "dispatch_and_prefill", "engine_to_actor", "events_wire", "grpc_out")
        }
        worker_itl: list[float] = []
        router_itl: list[float] = []
        engine_steps: list[float] = []  # the steps after the first token's (decode steps)
        for index, t in enumerate(timelines):
            rid = f"serial-{index}"
            sent, got = self.worker_sent.get(rid), self.router_got.get(rid)
            if rid not in self.placed_at or not sent or not got:
                continue
            hops["ingress"].append(self.placed_at[rid] - t.sent_wall)
            hops["dispatch_and_prefill"].append(sent[0] - self.placed_at[rid])
            hops["engine_to_actor"].append(self.actor_handed[rid] - sent[0])
            hops["events_wire"].append(got[0] - self.actor_handed[rid])
            hops["grpc_out"].append(t.first_token_wall - got[0])
            worker_itl.extend(b - a for a, b in zip(sent, sent[1:]))
            engine_steps.extend(self.engine_step[rid][1:])
            router_itl.extend(b - a for a, b in zip(got, got[1:]))
        out = {f"ttft_{k}_p50_ms": percentile(v, 50) * 1e3 for k, v in hops.items()}
        out["itl_worker_p50_ms"] = percentile(worker_itl, 50) * 1e3
        out["itl_at_router_p50_ms"] = percentile(router_itl, 50) * 1e3
        out["engine_step_p50_ms"] = percentile(engine_steps, 50) * 1e3
        return out


def cpu_by_role(client_pid: int | None = None, router_pids: tuple[int, ...] = ()) -> dict[str, float]:
    """CPU seconds so far: this process (the router), each kind of descendant, and the rest.
    router_pids: other router processes (`kvserve router`), each a role "router 2", "router 3"..."""
    import psutil

    totals = {"router": time.process_time(), "clients": 0.0, "workers": 0.0, "redis": 0.0, "ray daemons": 0.0}
    for number, _ in enumerate(router_pids, start=2):
        totals[f"router {number}"] = 0.0
    machine = psutil.cpu_times()
    busy = machine.user + machine.nice + machine.system + getattr(machine, "irq", 0.0)
    busy += getattr(machine, "softirq", 0.0)  # not guest (inside user already) nor steal (not ours)
    children = psutil.Process().children(recursive=True)
    actors = set()  # worker actors, whose engine processes count as workers too
    for p in children:
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::WorkerActor"):
                actors.add(p.pid)
        except psutil.Error:
            continue
    for p in children:
        try:
            t = p.cpu_times()
            name = p.name()
            cmdline = p.cmdline()
            parent = p.ppid()
        except psutil.Error:
            continue
        if parent in actors:
            cmdline = ["ray::WorkerActor engine process"]
        if p.pid == client_pid:
            role = "clients"
        elif p.pid in router_pids:
            role = f"router {router_pids.index(p.pid) + 2}"
        elif "redis-server" in name:
            role = "redis"
        elif cmdline and cmdline[0].startswith("ray::WorkerActor"):
            role = "workers"
        else:
            role = "ray daemons"
        totals[role] += t.user + t.system
    # Whatever else ran on the machine meanwhile (another user's job skews every number here).
    totals["other processes"] = busy - sum(totals.values())
    return totals


def metrics_cost_us(num_events: int = 100_000) -> float | None:
    """Microseconds the metrics observer spends on one token event (64 requests in turn, told
    of in batches of 32, as a worker's step of 32 requests is)."""
    try:
        from router.metrics import RouterMetrics
    except ImportError:
        return None
    from router.tracker import RequestTracker
    from workers.engine.plan import TokenEvent
    from workers.engine.sampling import SamplingParams

    class _NoRouter:
        observers: list[Any] = []
        workers: dict[str, Any] = {}

    metrics = RouterMetrics(_NoRouter())  # type: ignore[arg-type]
    trackers = [RequestTracker(f"r{i}", (1,), SamplingParams(max_tokens=8), 1) for i in range(64)]
    events = [(t, TokenEvent(t.request_id, (7,), "x", 0)) for t in trackers]
    batches = [events[:32], events[32:]]
    num_batches = num_events // 32
    start = time.perf_counter()
    for i in range(num_batches):
        metrics.observe("tokens", batches[i % 2])
    return (time.perf_counter() - start) / (num_batches * 32) * 1e6


def token_path_cost_us(num_streams: int = 32, num_steps: int = 300) -> tuple[float, float]:
    """Microseconds of the router's own Python per token, in this process, with no gRPC and
    no Redis I/O: (the token flow: a step's events applied to the requests, published to
    their listeners, and the step's Redis write built and encoded, up to the script call,
    which does nothing here; the streams: each listener's delta taken and made into the
    GenerateResponse that Generate yields). One token per request per step, num_streams
    requests, as at saturation with --stream-interval 1. What the router spends above this,
    the metrics observer and the grpc.aio floor is the event loop's, gRPC's and redis-py's
    per-message work, and caches that a whole router's footprint keeps colder."""
    import asyncio

    from router.service import _live  # the Generate stream's body
    from router.state import RequestStore, StoreConfig
    from router.token_flow import TokenFlow
    from router.tracker import RequestTracker
    from workers.engine.plan import TokenEvent
    from workers.engine.sampling import SamplingParams

    class _NoScripts(RequestStore):
        async def _run_scripts(self, calls: Any) -> list[Any]:
            return [""]  # no write fenced

    class _Collect:
        def __init__(self) -> None:
            self.ops: list[Any] = []
            self.num_ops = 0

        def submit(self, ops: Any) -> Any:
            self.ops.extend(ops)
            self.num_ops += len(ops)
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

    async def run() -> tuple[float, float]:
        trackers = {f"r{i}": RequestTracker(f"r{i}", tuple(range(40)), SamplingParams(max_tokens=10**6), 3)
                    for i in range(num_streams)}
        recorder = _Collect()
        flow = TokenFlow(_NoScripts(StoreConfig()), recorder, trackers,  # type: ignore[arg-type]
                         lambda _name, _payload: None, lambda *_: None)
        listeners = [t.subscribe() for t in trackers.values()]
        streams = [_live(listener, t, 0) for listener, t in zip(listeners, trackers.values())]
        flow_s = stream_s = 0.0
        num_tokens = 0
        for step in range(num_steps):
            events = [TokenEvent(rid, (1000 + step % 500,), "ab", step) for rid in trackers]
            began = time.perf_counter()
            flow.apply(None, events)
            for op in recorder.ops:
                await op()
            recorder.ops.clear()
            applied = time.perf_counter()
            if any(listener.num_pending_tokens != 1 for listener in listeners):
                raise RuntimeError(f"step {step}: a listener did not get its token (a stream would wait for ever)")
            streaming = time.perf_counter()
            for stream in streams:
                num_tokens += len((await stream.__anext__()).delta.token_ids)
            stream_s += time.perf_counter() - streaming
            flow_s += applied - began
        expected = num_streams * num_steps
        if num_tokens != expected or recorder.num_ops != num_steps:
            raise RuntimeError(f"the probe's streams took {num_tokens} of {expected} tokens, "
                               f"its flow wrote {recorder.num_ops} of {num_steps} steps")
        return flow_s / expected * 1e6, stream_s / expected * 1e6

    return asyncio.run(run())


class CpuPhase:
    """CPU that processes outside this benchmark used during a phase: the noise gauge of a
    shared machine."""

    def __init__(self, client_pid: int | None = None) -> None:
        self.client_pid = client_pid
        self.start = time.monotonic()
        self.before = cpu_by_role(client_pid)

    def others_share(self) -> float:
        after = cpu_by_role(self.client_pid)
        return (after["other processes"] - self.before["other processes"]) / (time.monotonic() - self.start)
