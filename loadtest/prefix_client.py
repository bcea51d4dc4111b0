"""bench-prefix's client, in a process of its own (so that its gRPC calls and timing do
not share a core's event loop with the benchmark's Ray driver).

It answers commands from a pipe: ("replay", ...) sends requests open loop at their arrival
times, ("closed", ...) keeps a number in flight; each answers one row per request (its
group, worker, when it was sent, TTFT, end to end, usage). ("stop", ()) ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from loadtest.prefix_workload import PrefixRequest

def client_main(conn: Any) -> None:
    """("replay", (address, requests, arrivals, max_tokens, drain_s)) or ("closed", (address,
    requests, concurrency, max_tokens, timeout_s)) answers one row per request; ("stop", ()) ends it."""
    while True:
        kind, payload = conn.recv()
        if kind == "stop":
            return
        if kind == "replay":
            conn.send(asyncio.run(_replay(*payload)))
        elif kind == "closed":
            conn.send(asyncio.run(_closed_loop(*payload)))


async def _replay(address: str, requests: list[PrefixRequest], arrivals: list[float], max_tokens: int,
                  drain_s: float) -> list[dict[str, Any]]:
    import grpc

    from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

    results: list[dict[str, Any]] = [{} for _ in requests]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        start = time.monotonic()

        async def one(index: int, request: PrefixRequest) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[index] - time.monotonic()))
            results[index] = await _generate(stub, request, max_tokens, start, arrivals[-1] + drain_s + 60)

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return results


async def _closed_loop(address: str, requests: list[PrefixRequest], concurrency: int, max_tokens: int,
                       timeout_s: float) -> list[dict[str, Any]]:
    """The requests in order, `concurrency` in flight at all times: each lane sends the next
    one as soon as its last one finished."""
    import grpc

    from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

    results: list[dict[str, Any]] = [{} for _ in requests]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVServeStub(channel)
        start = time.monotonic()
        order = iter(range(len(requests)))  # shared by the lanes: each takes the next index

        async def lane() -> None:
            for index in order:
                results[index] = await _generate(stub, requests[index], max_tokens, start, timeout_s)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return results


async def _generate(stub: Any, request: PrefixRequest, max_tokens: int, start: float,
                    timeout_s: float) -> dict[str, Any]:
    """One streamed Generate call: its group, worker, when it was sent (since start), TTFT, end
    to end, and its usage."""
    import grpc

    from protos.kvserve.v1 import serving_pb2 as pb

    message = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in request.messages]),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    sent = time.monotonic()
    row: dict[str, Any] = {"group": request.group, "sent": sent - start, "ok": False}
    try:
        async for event in stub.Generate(message, timeout=timeout_s):
            kind = event.WhichOneof("event")
            if kind == "started":
                row["worker"] = event.started.worker_id
            elif kind == "delta" and "ttft" not in row:
                row["ttft"] = time.monotonic() - sent
            elif kind == "finished":
                row["ok"] = event.finished.finish_reason == pb.FINISH_REASON_LENGTH
                row["prompt_tokens"] = event.finished.usage.prompt_tokens
                row["cached_tokens"] = event.finished.usage.cached_prompt_tokens
                row["output_tokens"] = event.finished.usage.completion_tokens
        row["e2e"] = time.monotonic() - sent
    except grpc.aio.AioRpcError as exc:
        row["error"] = exc.code().name
    return row


def replay(conn: Any, address: str, requests: list[PrefixRequest], arrivals: list[float],
           args: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests open loop at their arrival times (seconds from now), through the client process."""
    conn.send(("replay", (address, requests, arrivals, args.max_tokens, args.drain)))
    results: list[dict[str, Any]] = conn.recv()
    return results


def closed_loop(conn: Any, address: str, requests: list[PrefixRequest], concurrency: int,
                args: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests with `concurrency` always in flight, through the client process."""
    conn.send(("closed", (address, requests, concurrency, args.max_tokens, args.drain + 60)))
    results: list[dict[str, Any]] = conn.recv()
    return results
