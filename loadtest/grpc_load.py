"""gRPC load for the router benchmark, run in a process of its own (client_main): one
timed request at a time, or many streaming clients at once against a fixed window."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import grpc

from loadtest.trace import TraceRequest
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc


@dataclass
class Timeline:
    """One request seen by its caller: seconds from sending it to its first token, the
    gaps between later tokens (0 for tokens that arrive together), and the tokens."""

    ttft: float = float("nan")
    itls: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sent_wall: float = 0.0  # time.time(), to line up with the router's and the worker's clocks
    first_token_wall: float = 0.0


def record_tokens(timeline: Timeline, sent_at: float, last_at: float | None, now: float, ids: list[int]) -> float:
    """Note tokens that arrived at `now` (perf_counter); returns the time of the last arrival."""
    if not ids:
        return last_at if last_at is not None else sent_at
    if last_at is None:
        timeline.ttft = now - sent_at
        timeline.first_token_wall = time.time()
    else:
        timeline.itls.append(now - last_at)
    timeline.itls.extend([0.0] * (len(ids) - 1))
    timeline.token_ids.extend(ids)
    return now


def generate_request(r: TraceRequest, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=list(r.prompt_ids)),
        sampling=pb.SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
    )


def client_main(conn: Connection, address: str) -> None:
    """Runs in a process of its own, so the router's process does no client work."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        while True:
            command, args = conn.recv()
            if command == "stop":
                return
            if command == "one":
                conn.send(_one(stub, *args))
            elif command == "saturate":  # (trace, concurrency, warmup_s, window_s[, addresses])
                trace, concurrency, warmup_s, window_s, *more = args
                addresses = more[0] if more else [address]
                conn.send(asyncio.run(_saturate(conn, addresses, trace, concurrency, warmup_s, window_s)))


def _one(stub: pb_grpc.KVServeStub, r: TraceRequest, request_id: str) -> Timeline:
    """One Generate call, timed from sending it to each delta."""
    timeline = Timeline(sent_wall=time.time())
    sent_at = time.perf_counter()
    last_at = None
    for message in stub.Generate(generate_request(r, request_id), timeout=120):
        if message.WhichOneof("event") == "delta":
            last_at = record_tokens(timeline, sent_at, last_at, time.perf_counter(), list(message.delta.token_ids))
    return timeline


async def _saturate(
    conn: Connection, addresses: list[str], trace: list[TraceRequest], concurrency: int, warmup_s: float,
    window_s: float,
) -> dict[str, Any]:
    """`concurrency` clients each stream requests back to back; count what lands in the window.
    Client k calls the router at addresses[k % len(addresses)].

    The window is [start + warmup_s, start + warmup_s + window_s] on CLOCK_MONOTONIC, which
    every process on the machine shares, so the parent can measure CPU over the same span."""
    tokens_in_window = 0
    tokens_by_router = [0] * len(addresses)
    completed_in_window = 0
    errors: list[str] = []
    channels = [grpc.aio.insecure_channel(address) for address in addresses]
    try:
        for channel in channels:
            await channel.channel_ready()
        stubs = [pb_grpc.KVServeStub(channel) for channel in channels]
        start = time.monotonic()
        window_start, window_end = start + warmup_s, start + warmup_s + window_s
        conn.send(("started", start))

        async def client(first: int) -> None:
            nonlocal tokens_in_window, completed_in_window
            index = first
            stub = stubs[first % len(stubs)]
            while time.monotonic() < window_end:
                call = stub.Generate(generate_request(trace[index % len(trace)]))
                index += concurrency
                try:
                    async for message in call:
                        now = time.monotonic()
                        if now >= window_end:
                            return
                        kind = message.WhichOneof("event")
                        if kind == "delta" and now >= window_start:
                            tokens_in_window += len(message.delta.token_ids)
                            tokens_by_router[first % len(stubs)] += len(message.delta.token_ids)
                        elif kind == "finished" and now >= window_start:
                            completed_in_window += 1
                except grpc.aio.AioRpcError as exc:
                    errors.append(f"{exc.code().name}: {exc.details()}")
                    await asyncio.sleep(0.05)
                finally:
                    call.cancel()

        await asyncio.gather(*(client(k) for k in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close()
    return {
        "tokens_in_window": tokens_in_window,
        "tokens_by_router": tokens_by_router,
        "completed_in_window": completed_in_window,
        "num_errors": len(errors),
        "first_error": errors[0] if errors else "",
    }
