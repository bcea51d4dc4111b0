"""What the policy benchmark measures on a live cluster: an open-loop replay of a trace
over gRPC, run in a process of its own, and every worker's KV over time.

    client process (replay_main,                  this process
    driven through ClientProcess)
    ─────────────────────────────                 ─────────────────────────────────────
    sleeps to each arrival on an absolute         KVRecorder: a router observer, one
    clock and starts its Generate call in a       sample per StepBatch of every worker
    task of its own (arrivals never wait for      (local cluster), or StatusPoller:
    responses); times every delta                 ClusterStatus every 100 ms (--address)

Every time is time.monotonic(): CLOCK_MONOTONIC is one clock for every process on the
machine, so the client's token times and the router's KV samples line up. summarize_run
turns one replay (a MeasuredRun) into the numbers of one row of loadtest.bench_policies.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import grpc

from loadtest.metrics import RequestTimeline, percentile, summarize
from loadtest.report import RequestLatency, Slo
from loadtest.router_probes import cpu_by_role
from loadtest.trace import TraceRequest
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

LONG_PROMPT_TOKENS = 512  # the mixed workload's long prompts are 512-1024 tokens, its short ones 16-64
TTFT_SLO_S = 2.0  # per request, for goodput: the first token within 2 s ...
MEAN_ITL_SLO_S = 0.2  # ... then 200 ms per token on average (CPU workers; loadtest.sim.run uses 1 s / 100 ms)
# A run is sustained when every request finished and 99% of them met both bounds.
SLO = Slo(ttft_s=TTFT_SLO_S, mean_itl_s=MEAN_ITL_SLO_S, percentile=99.0)


@dataclass
class RequestResult:
    """One request of the trace as its client saw it.

    outcome: "ok" (all max_tokens streamed and finished), a gRPC status code name
    ("RESOURCE_EXHAUSTED" for a rejection), "FINISH_REASON_..." for a stream that ended
    otherwise, or "incomplete": still running when the replay's drain time ran out (the
    call is then cancelled, which frees its KV)."""

    request_id: str
    is_long: bool
    output_len: int
    arrival_at: float  # when the trace says it arrives (monotonic): TTFT is measured from here
    sent_at: float = float("nan")
    token_times: list[float] = field(default_factory=list)  # one per token; a delta's tokens share its time
    worker_id: str = ""
    outcome: str = "incomplete"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def timeline(self) -> RequestTimeline:
        return RequestTimeline(self.arrival_at, list(self.token_times))


def generate_request(request_id: str, r: TraceRequest, max_tokens_factor: float = 1.0) -> pb.GenerateRequest:
    """Greedy with ignore_eos: every request streams exactly output_len tokens. With a
    max_tokens_factor above 1 it asks for ceil(factor x output_len) and the client ends
    the stream at output_len (_one), as an answer that stops at EOS well before max_tokens
    does: what a reservation against max_tokens then over-commits shows."""
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=list(r.prompt_ids)),
        sampling=pb.SamplingParams(max_tokens=math.ceil(max_tokens_factor * r.output_len), temperature=0.0,
                                   ignore_eos=True),
    )


def replay_main(conn: Connection) -> None:
    """The client process: ("replay", (address, trace, id_prefix, drain_s)) or ("closed",
    (address, trace, id_prefix, concurrency, timeout_s)) answers ("started", start) and then
    the list of RequestResults; ("stop", ()) ends it."""
    while True:
        command, args = conn.recv()
        if command == "stop":
            return
        if command == "replay":
            conn.send(asyncio.run(_replay(conn, *args)))
        elif command == "closed":
            conn.send(asyncio.run(_closed_loop(conn, *args)))


async def _replay(
    conn: Connection, address: str, trace: list[TraceRequest], id_prefix: str, drain_s: float,
    max_tokens_factor: float = 1.0,
) -> list[RequestResult]:
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = pb_grpc.KVServeStub(channel)
        start = time.monotonic() + 0.2
        conn.send(("started", start))
        results = [
            RequestResult(f"{id_prefix}-{r.request_id}", len(r.prompt_ids) >= LONG_PROMPT_TOKENS, r.output_len,
                          start + r.arrival_time)
            for r in trace
        ]
        tasks: list[asyncio.Task[None]] = []
        for r, result in zip(trace, results):
            delay = result.arrival_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            request = generate_request(result.request_id, r, max_tokens_factor)
            tasks.append(asyncio.create_task(_one(stub, request, result)))
        deadline = results[-1].arrival_at + drain_s if results else start
        pending: set[asyncio.Task[None]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in pending:
            task.cancel()  # the result stays "incomplete"; the router frees the request's KV
        if pending:
            await asyncio.wait(pending, timeout=10)
    return results


async def _closed_loop(
    conn: Connection, address: str, trace: list[TraceRequest], id_prefix: str, concurrency: int, timeout_s: float,
    max_tokens_factor: float = 1.0,
) -> list[RequestResult]:
    """The trace's requests in order, `concurrency` in flight at all times (its arrival times
    are ignored): each request "arrives" when the one before it in its lane finished."""
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = pb_grpc.KVServeStub(channel)
        start = time.monotonic()
        conn.send(("started", start))
        results: list[RequestResult] = []
        queue = list(reversed(trace))

        async def lane() -> None:
            while queue:
                r = queue.pop()
                result = RequestResult(f"{id_prefix}-{r.request_id}", len(r.prompt_ids) >= LONG_PROMPT_TOKENS,
                                       r.output_len, time.monotonic())
                results.append(result)
                await _one(stub, generate_request(result.request_id, r, max_tokens_factor), result)

        lanes = [asyncio.create_task(lane()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(lanes, timeout=timeout_s)
        for task in pending:
            task.cancel()  # its request stays "incomplete"
        if pending:
            await asyncio.wait(pending, timeout=10)
    return results


async def _one(stub: pb_grpc.KVServeStub, request: pb.GenerateRequest, result: RequestResult) -> None:
    result.sent_at = time.monotonic()
    call = stub.Generate(request)
    try:
        async for message in call:
            kind = message.WhichOneof("event")
            if kind == "started":
                result.worker_id = message.started.worker_id
            elif kind == "delta" and message.delta.token_ids:
                now = time.monotonic()
                result.token_times.extend([now] * len(message.delta.token_ids))
                if request.sampling.max_tokens > result.output_len and len(result.token_times) >= result.output_len:
                    # Its answer ends here (generate_request): cancelling the call frees it.
                    del result.token_times[result.output_len:]
                    result.outcome = "ok"
                    return
            elif kind == "finished":
                reason = message.finished.finish_reason
                if reason != pb.FINISH_REASON_LENGTH:
                    result.outcome, result.detail = pb.FinishReason.Name(reason), message.finished.error
                elif len(result.token_times) != result.output_len:
                    result.outcome = "BAD_STREAM"
                    result.detail = f"{len(result.token_times)} tokens streamed, max_tokens {result.output_len}"
                else:
                    result.outcome = "ok"
    except grpc.aio.AioRpcError as exc:
        result.outcome, result.detail = exc.code().name, exc.details() or ""
    finally:
        call.cancel()  # a no-op once done; frees the request when the replay gives up on it


class ClientProcess:
    """The load generator in a process of its own, so this process runs only the router."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=replay_main, args=(child,), name="bench-clients", daemon=True)
        self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def replay(
        self, address: str, trace: list[TraceRequest], id_prefix: str, drain_s: float, max_tokens_factor: float = 1.0
    ) -> tuple[float, list[RequestResult]]:
        """Replay `trace` from now; returns when it started (monotonic) and every request's result."""
        self._conn.send(("replay", (address, trace, id_prefix, drain_s, max_tokens_factor)))
        kind, start = self._conn.recv()
        assert kind == "started", kind
        results: list[RequestResult] = self._conn.recv()
        return start, results

    def closed_loop(
        self, address: str, trace: list[TraceRequest], id_prefix: str, concurrency: int, timeout_s: float,
        max_tokens_factor: float = 1.0,
    ) -> list[RequestResult]:
        """`trace`'s requests with `concurrency` always in flight; every request's result."""
        self._conn.send(("closed", (address, trace, id_prefix, concurrency, timeout_s, max_tokens_factor)))
        kind, _ = self._conn.recv()
        assert kind == "started", kind
        results: list[RequestResult] = self._conn.recv()
        return results

    def close(self) -> None:
        self._conn.send(("stop", ()))
        self.process.join(timeout=30)


class Replay(NamedTuple):
    """One replay of a trace, as replay_once returns it."""

    window: tuple[float, float]  # first arrival, last token (monotonic)
    results: list[RequestResult]
    cpu_share: dict[str, float]  # cores each kind of process used meanwhile
    seconds: float


def replay_once(
    client: ClientProcess, address: str, trace: list[TraceRequest], id_prefix: str, drain_s: float,
    max_tokens_factor: float = 1.0,
) -> Replay:
    """The trace through the cluster, with the CPU each kind of process used meanwhile."""
    before, clock = cpu_by_role(client.pid), time.monotonic()
    start, results = client.replay(address, trace, id_prefix, drain_s, max_tokens_factor)
    after, seconds = cpu_by_role(client.pid), time.monotonic() - clock
    end = max([start, *(r.token_times[-1] for r in results if r.token_times)])
    return Replay((start, end), results, {role: (after[role] - before[role]) / seconds for role in after}, seconds)


# -- KV over time ----------------------------------------------------------------------------


class KVSample(NamedTuple):
    """One worker's KV at one moment, as its report (or ClusterStatus) gave it."""

    at: float  # time.monotonic() in the router's process
    worker_id: str
    num_free_blocks: int
    num_total_blocks: int
    num_committed_blocks: int  # what its admitted requests hold at max_tokens; > total: over-committed
    num_preemptions: int  # the worker's counter since it started
    num_running: int
    num_waiting: int
    num_steps: int = -1  # the worker's engine steps so far; -1: not known (ClusterStatus)
    sent_at: float = float("nan")  # the worker's time.time() right after the step


class KVRecorder:
    """A router observer (call it on the router's loop): a KVSample per StepBatch, every
    rejection the router makes with its reason, and when each request was first placed."""

    def __init__(self) -> None:
        self.samples: list[KVSample] = []
        self.rejections: list[tuple[float, str]] = []
        self.placed_at: dict[str, float] = {}  # request id -> its first placement (monotonic)
        # request id -> the share of its max_tokens its first placement committed (1: all)
        self.committed_share: dict[str, float] = {}

    def __call__(self, name: str, payload: Any) -> None:
        if name == "report":
            view, batch = payload
            r = batch.report
            self.samples.append(KVSample(
                time.monotonic(), view.worker_id, r.num_free_blocks, r.num_total_blocks, r.num_committed_blocks,
                r.num_preemptions, r.num_running, r.num_waiting, r.num_steps, batch.sent_at,
            ))
        elif name == "rejected":
            self.rejections.append((time.monotonic(), payload[1]))
        elif name == "placed":
            tracker = payload[0]
            if tracker.request_id not in self.placed_at:
                self.placed_at[tracker.request_id] = time.monotonic()
                reserved = tracker.reserve_tokens
                self.committed_share[tracker.request_id] = (
                    1.0 if reserved is None else reserved / tracker.params.max_tokens)


class StatusPoller:
    """KV samples of a cluster in another process: ClusterStatus every `interval_s`.

    ClusterStatus gives the router's headroom (its view of uncommitted blocks, less what it
    placed since the last report), so committed reads as total - headroom here: in-flight
    placements count as committed a report early. Rejections are only seen by the client."""

    def __init__(self, address: str, interval_s: float = 0.1) -> None:
        self.samples: list[KVSample] = []
        self.rejections: list[tuple[float, str]] = []
        self._address = address
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with grpc.insecure_channel(self._address) as channel:
            stub = pb_grpc.KVServeStub(channel)
            while not self._stop.wait(self._interval_s):
                try:
                    status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=2)
                except grpc.RpcError:
                    continue
                now = time.monotonic()
                for w in status.workers:
                    if w.alive:
                        self.samples.append(KVSample(
                            now, w.worker_id, w.free_blocks, w.total_blocks, w.total_blocks - w.uncommitted_blocks,
                            w.preemptions, w.running, w.waiting,
                        ))


def preemptions_between(samples: list[KVSample], start: float, end: float) -> dict[str, int]:
    """Per worker, how much its preemption counter grew from the last sample before `start`
    (or the first after it) to the last sample before `end`."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for s in samples:
        if s.at <= start or s.worker_id not in first:
            first[s.worker_id] = s.num_preemptions
        if s.at <= end:
            last[s.worker_id] = s.num_preemptions
    return {w: last.get(w, first[w]) - first[w] for w in first}


def wait_idle(address: str, timeout_s: float = 120.0) -> bool:
    """Poll ClusterStatus until nothing is queued, running or committed on a live worker."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        while time.monotonic() < deadline:
            try:
                s = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
            except grpc.RpcError:
                time.sleep(0.2)
                continue
            live = [w for w in s.workers if w.alive]
            if live and s.queued == 0 and all(
                w.running == 0 and w.waiting == 0 and w.uncommitted_blocks == w.total_blocks for w in live
            ):
                return True
            time.sleep(0.1)
    return False


# -- one run: a policy at a rate, summarized ------------------------------------------------


def meets_slo(timeline: RequestTimeline) -> bool:
    """The goodput SLO of one finished request: first token in time, then fast enough on average."""
    return SLO.meets(RequestLatency.of(timeline))


def latency_of(result: RequestResult) -> RequestLatency:
    """What SLO judges of one request; a request that did not finish is not finished."""
    return RequestLatency.of(result.timeline(), finished=result.ok)


@dataclass(frozen=True)
class MeasuredRun:
    """One replay of the trace: what the client saw, and what the cluster reported meanwhile.

    window: from the first arrival to the last token (monotonic). samples and rejections
    may reach outside it (the recorder runs for the cluster's life); cpu_share is each kind
    of process's CPU during the replay in cores (loadtest.router_probes.cpu_by_role), over
    replay_s seconds."""

    policy: str
    rate: float
    results: list[RequestResult]
    window: tuple[float, float]
    samples: list[KVSample]
    rejections: list[tuple[float, str]]
    cpu_share: dict[str, float]
    replay_s: float = float("nan")
    placed_at: Mapping[str, float] = field(default_factory=dict)  # request id -> first placement (KVRecorder)
    committed_share: Mapping[str, float] = field(default_factory=dict)  # KVRecorder's, likewise


def ttft_by_kind(ok: list[RequestResult], placed_at: Mapping[str, float] | None = None) -> dict[str, dict[str, float]]:
    """TTFT p50/p99 (s) of the finished long requests and of the short ones, apart: which
    kind makes a policy's tail. With every one's first placement known (a local cluster's
    KVRecorder), also the part of it spent before that, in the router (`wait_p50`,
    `wait_p99`: from the request's arrival to its placement, the wait for KV room), so a
    tail reads as the router's queue or the worker's."""
    out = {}
    for kind, is_long in (("long", True), ("short", False)):
        of_kind = [r for r in ok if r.is_long == is_long]
        ttfts = [r.token_times[0] - r.arrival_at for r in of_kind]
        out[kind] = {"n": len(ttfts), "p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)}
        if placed_at and all(r.request_id in placed_at for r in of_kind):
            waits = [placed_at[r.request_id] - r.arrival_at for r in of_kind]
            out[kind] |= {"wait_p50": percentile(waits, 50), "wait_p99": percentile(waits, 99)}
    return out


def committed_share(results: list[RequestResult], shares: Mapping[str, float]) -> dict[str, float] | None:
    """What share of max_tokens the run's requests were committed at when first placed
    (the router's --kv-reserve-ratio, or where an adaptive one stood): p50, min and max
    over those placed. None when the run kept no shares (a cluster in another process)."""
    of_run = [shares[r.request_id] for r in results if r.request_id in shares]
    if not of_run:
        return None
    return {"p50": percentile(of_run, 50), "min": min(of_run), "max": max(of_run), "n": len(of_run)}


_NOT_FAILED = ("ok", "RESOURCE_EXHAUSTED", "incomplete")  # refused and unfinished are counted apart


def summarize_run(run: MeasuredRun) -> dict[str, Any]:
    """One table row, plus what the plots need (raw TTFTs, ITLs and KV samples of the window)."""
    results, samples, rejections = run.results, run.samples, run.rejections
    start, end = run.window
    ok = [r for r in results if r.ok]
    summary = summarize([r.timeline() for r in ok]) if ok else None
    makespan = summary.makespan if summary is not None else float("nan")
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    window_samples = [s for s in samples if start <= s.at <= end]
    peak: dict[str, float] = {}
    for s in window_samples:
        peak[s.worker_id] = max(peak.get(s.worker_id, 0.0), s.num_committed_blocks / s.num_total_blocks)
    placed: dict[str, dict[str, int]] = {}
    for r in results:
        if r.worker_id:
            counts = placed.setdefault(r.worker_id, {"requests": 0, "long": 0})
            counts["requests"] += 1
            counts["long"] += int(r.is_long)
    preempted = preemptions_between(samples, start, end)
    steps = step_times(window_samples)
    num_good = sum(meets_slo(r.timeline()) for r in ok)
    mean_itls = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                 for r in ok if len(r.token_times) > 1]
    return {
        "policy": run.policy,
        "rate": run.rate,
        "num_requests": len(results),
        "num_ok": len(ok),
        "outcomes": outcomes,
        "num_rejected": sum(n for o, n in outcomes.items() if o == "RESOURCE_EXHAUSTED"),
        "num_incomplete": outcomes.get("incomplete", 0),
        "num_failed": sum(n for o, n in outcomes.items() if o not in _NOT_FAILED),
        # What the first failed request was told: a run whose requests all fail says why.
        "first_failure": next((f"{r.outcome}: {r.detail}" for r in results if r.outcome not in _NOT_FAILED), ""),
        "rejections_by_reason": {reason: sum(1 for t, r in rejections if start <= t <= end and r == reason)
                                 for reason in sorted({r for _, r in rejections})},
        "summary": asdict(summary) if summary is not None else None,
        "mean_itl_p50": percentile(mean_itls, 50),
        "mean_itl_p99": percentile(mean_itls, 99),
        "requests_per_s": len(ok) / makespan if makespan > 0 else float("nan"),
        "goodput_rps": num_good / makespan if makespan > 0 else float("nan"),
        "goodput_fraction": num_good / len(results),
        "sustained": SLO.sustained([latency_of(r) for r in results]),
        "preemptions_per_worker": preempted,
        "num_preemptions": sum(preempted.values()),
        "peak_commit_ratio": peak,
        "placed": placed,
        "client_lag_max_s": max((r.sent_at - r.arrival_at for r in results if r.sent_at == r.sent_at), default=0.0),
        "cpu_share_of_one_core": run.cpu_share,
        "num_steps": steps.num_steps,
        "step_ms_p50": percentile(steps.busy_intervals, 50) * 1e3,
        "worker_cpu_ms_per_step": run.cpu_share.get("workers", math.nan) * run.replay_s / steps.num_steps * 1e3
        if steps.num_steps else math.nan,
        "ttft_by_kind": ttft_by_kind(ok, run.placed_at),
        "committed_share": committed_share(results, run.committed_share),
        "ttfts": [r.token_times[0] - r.arrival_at for r in ok],
        "itls": [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])],
        "latencies": [latency_of(r) for r in results],  # what SLO judges: pooled across rounds (policy_rounds)
        "kind_ttfts": {kind: [r.token_times[0] - r.arrival_at for r in ok if r.is_long == is_long]
                       for kind, is_long in (("short", False), ("long", True))},
        "kv": _kv_series(window_samples, start),
    }


class StepTimes(NamedTuple):
    num_steps: int  # engine steps of every worker between the first and the last sample
    busy_intervals: list[float]  # seconds from one step's report to the next's, while requests ran


def step_times(samples: list[KVSample]) -> StepTimes:
    """How long a worker's engine loop takes per step, read off consecutive reports: one
    report follows every step that has work, so two reports one step apart, the first with
    requests running, bracket exactly one turn of the loop (step, report, commands)."""
    num_steps = 0
    intervals: list[float] = []
    previous: dict[str, KVSample] = {}
    first: dict[str, int] = {}
    for s in samples:
        if s.num_steps < 0:
            continue
        first.setdefault(s.worker_id, s.num_steps)
        before = previous.get(s.worker_id)
        if before is not None and s.num_steps == before.num_steps + 1 and before.num_running > 0:
            intervals.append(s.sent_at - before.sent_at)
        previous[s.worker_id] = s
    num_steps = sum(previous[w].num_steps - first[w] for w in previous)
    return StepTimes(num_steps, intervals)


def _kv_series(samples: list[KVSample], start: float, step_s: float = 0.1) -> dict[str, dict[str, list[float]]]:
    """Per worker, KV used and committed as shares of its pool, at most one point per step_s."""
    out: dict[str, dict[str, list[float]]] = {}
    last: dict[str, float] = {}
    for s in samples:
        if s.at - last.get(s.worker_id, -math.inf) < step_s:
            continue
        last[s.worker_id] = s.at
        series = out.setdefault(s.worker_id, {"t": [], "used": [], "committed": [], "total_blocks": []})
        series["t"].append(round(s.at - start, 3))
        series["used"].append(round(1 - s.num_free_blocks / s.num_total_blocks, 4))
        series["committed"].append(round(s.num_committed_blocks / s.num_total_blocks, 4))
        series["total_blocks"] = [s.num_total_blocks]
    return out
