"""The worker -> router event stream over a TCP connection of its own.

A router used to read each worker's StepBatches as a Ray streaming generator. Ray then
served every batch with an object per item, a report RPC from the actor to the router and
a deserialisation through its object layer: 1.8 ms from the actor's hand-out to the
router at concurrency 1, and in the router about an eighth of its CPU at saturation
(Ray's io thread alone took 8% of a core, `make bench-router`, 2026-12-02). Ray stays the
control plane (info, add_request, abort, kv_snapshot, liveness of the actor); the events
go over this wire:

    router                                  worker actor (its asyncio loop)
    connect(WorkerInfo.events_address)  ->  accept
    hello: token, router id, newline    ->  checked against WorkerInfo.events_token
                                        <-  frame, frame, ...   (the actor's events(router_id))
    frame: 4-byte big-endian length, then the pickled StepBatch

The token travels only inside WorkerInfo, over Ray: whoever reads the stream got it from
the cluster's own Ray, as with Ray's own ports. The stream's memory is bounded in bytes,
about 7 x BUFFER_BYTES on the way: the actor's transport pauses at BUFFER_BYTES queued (its
events() then merges the steps it makes, workers/actor.py), each end's socket buffer is
set to BUFFER_BYTES (the kernel doubles it), and the router's reader stops reading at
2 x BUFFER_BYTES it has not taken.

A worker whose process dies closes its end (the router reads EOF at once); a worker whose
node is gone goes silent, and the router's liveness timeout says so.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import socket
from collections.abc import AsyncIterator

from workers.messages import StepBatch

BUFFER_BYTES = 64 * 1024
_HEADER = 4
MAX_FRAME_BYTES = 1 << 30  # a frame past this is a broken stream, not a batch


class BadHello(Exception):
    pass


def encode(batch: StepBatch) -> bytes:
    payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    return len(payload).to_bytes(_HEADER, "big") + payload


async def read_hello(reader: asyncio.StreamReader, token: str) -> str:
    """The router id a connecting router names, once its token is checked."""
    line = await reader.readline()
    given, _, router_id = line.decode("utf-8", "replace").rstrip("\n").partition(" ")
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise BadHello("wrong or missing events token")
    return router_id


def set_buffers(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.transport.set_write_buffer_limits(high=BUFFER_BYTES)


async def read_batches(address: str, token: str, router_id: str) -> AsyncIterator[StepBatch]:
    """The worker's batches for router_id, until the stream ends (ConnectionError,
    asyncio.IncompleteReadError or OSError when the worker is gone)."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port), limit=BUFFER_BYTES)
    try:
        set_buffers(writer)
        writer.write(f"{token} {router_id}\n".encode())
        await writer.drain()
        while True:
            size = int.from_bytes(await reader.readexactly(_HEADER), "big")
            if size > MAX_FRAME_BYTES:
                raise ConnectionError(f"events stream from {address}: a frame of {size} bytes")
            batch = pickle.loads(await reader.readexactly(size))  # noqa: S301 - the worker, reached through Ray
            if not isinstance(batch, StepBatch):
                raise ConnectionError(f"events stream from {address}: a {type(batch).__name__}, not a StepBatch")
            yield batch
    finally:
        writer.close()
