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
                                        <-  StepBatch, StepBatch, ...   (the actor's events(router_id))
    AddRequest                          ->  add_request
                                        <-  AddAnswer (None: taken, or the AddRefused)
    frame: 4-byte big-endian length, then the pickled message

An AddRequest rides here too: it is on the way to every first token, and a Ray actor call
took ~2 ms there. Its answer comes back between the batches, after the actor has queued the
request for its engine, so an abort sent (over Ray) once the answer is in reaches the
engine after the request.

The token travels only inside WorkerInfo, over Ray: whoever reads the stream got it from
the cluster's own Ray, as with Ray's own ports. The stream's memory is bounded in bytes,
7 to 9 x BUFFER_BYTES on the way: the actor's transport pauses at BUFFER_BYTES queued (its
events() then merges the steps it makes, workers/actor.py), each end's socket buffer is
set to BUFFER_BYTES (the kernel doubles it), and the router's reader stops reading at
2 x BUFFER_BYTES it has not taken, which the read that crosses it can pass by up to what
the kernel held (454 KiB waited in one run, 7.1 x).

A worker whose process dies closes its end (the router reads EOF at once); a worker whose
node is gone goes silent, and the router's liveness timeout says so.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from workers.messages import AddRefused, AddRequest, StepBatch

BUFFER_BYTES = 64 * 1024
_HEADER = 4
MAX_FRAME_BYTES = 1 << 30  # a frame past this is a broken stream, not a batch


class BadHello(Exception):
    pass


@dataclass(frozen=True)
class AddAnswer:
    """The actor's answer to an AddRequest that came over the wire."""

    request_id: str
    refused: AddRefused | None


def encode(message: StepBatch | AddRequest | AddAnswer) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(payload).to_bytes(_HEADER, "big") + payload


async def read_frame(reader: asyncio.StreamReader, source: str) -> Any:
    size = int.from_bytes(await reader.readexactly(_HEADER), "big")
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"events connection with {source}: a frame of {size} bytes")
    return pickle.loads(await reader.readexactly(size))  # noqa: S301 - both ends hold the token from Ray


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


class EventsConnection:
    """A router's end: the worker's batches (batches()), and AddRequests sent to it
    (add_request()), answered in between."""

    def __init__(self, address: str, token: str, router_id: str) -> None:
        self.address = address
        self._token = token
        self._router_id = router_id
        self._writer: asyncio.StreamWriter | None = None
        self._answers: dict[str, asyncio.Future[AddRefused | None]] = {}
        self.closed = False

    async def batches(self) -> AsyncIterator[StepBatch]:
        """Connect, then the worker's batches until the stream ends (ConnectionError,
        asyncio.IncompleteReadError or OSError when the worker is gone)."""
        host, _, port = self.address.rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port), limit=BUFFER_BYTES)
            self._writer = writer
            set_buffers(writer)
            writer.write(f"{self._token} {self._router_id}\n".encode())
            await writer.drain()
            while True:
                message = await read_frame(reader, self.address)
                if isinstance(message, AddAnswer):
                    answer = self._answers.pop(message.request_id, None)
                    if answer is not None and not answer.done():
                        answer.set_result(message.refused)
                elif isinstance(message, StepBatch):
                    yield message
                else:
                    raise ConnectionError(f"events connection with {self.address}: a {type(message).__name__}")
        finally:
            self.close()

    def add_request(self, request: AddRequest) -> asyncio.Future[AddRefused | None]:
        """Send it; the future is the worker's answer, or ConnectionError if the
        connection ends first (the request may or may not have reached the worker)."""
        answer: asyncio.Future[AddRefused | None] = asyncio.get_running_loop().create_future()
        if self.closed or self._writer is None:
            answer.set_exception(ConnectionError(f"no events connection with {self.address}"))
            return answer
        self._answers[request.request_id] = answer
        self._writer.write(encode(request))
        return answer

    @property
    def open(self) -> bool:
        return self._writer is not None and not self.closed

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._writer is not None:
            self._writer.close()
        answers, self._answers = self._answers, {}
        for answer in answers.values():
            if not answer.done():
                answer.set_exception(ConnectionError(f"the events connection with {self.address} ended"))


async def read_batches(address: str, token: str, router_id: str) -> AsyncIterator[StepBatch]:
    """The worker's batches for router_id, until the stream ends."""
    async for batch in EventsConnection(address, token, router_id).batches():
        yield batch
