"""The floor under the router's token path: the CPU a bare grpc.aio server spends per
streamed message, on this machine, with nothing of kvserve in it.

A server in this process (an event loop in a thread of its own, like the router's) holds
`num_streams` server-streaming calls from a client in another process. Every `step_s`
(a worker's step) a producer puts one message on each call's queue, and each call's
handler yields it: the router's shape, one GenerateResponse of one token per stream per
step, minus everything the router does besides. The figure is this process's CPU time
while the steps stream, over the messages sent.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

_METHOD = "/kvserve.floor.Floor/Stream"


def _message(index: int) -> Any:
    from protos.kvserve.v1 import serving_pb2 as pb

    return pb.GenerateResponse(delta=pb.TokenDelta(token_ids=[index % 50_000], text="ab", offset=index))


def _client(address: str, num_streams: int) -> None:
    """The other process: num_streams calls read to the end."""
    import grpc

    async def read_all() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_stream(_METHOD, request_serializer=bytes, response_deserializer=bytes)

            async def one() -> None:
                async for _ in call(b""):
                    pass

            await asyncio.gather(*(one() for _ in range(num_streams)))

    asyncio.run(read_all())


def floor_us(num_streams: int = 64, num_steps: int = 300, step_s: float = 0.004) -> float:
    """Microseconds of this process's CPU per message streamed."""
    import grpc
    from protos.kvserve.v1 import serving_pb2 as pb

    messages = [_message(i) for i in range(num_steps)]
    queues: list[asyncio.Queue[Any]] = []
    ready = asyncio.Event()

    async def stream(request: bytes, context: Any) -> AsyncIterator[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queues.append(queue)
        if len(queues) == num_streams:
            ready.set()
        while (message := await queue.get()) is not None:
            yield message

    async def run() -> float:
        handler = grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=bytes, response_serializer=pb.GenerateResponse.SerializeToString
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kvserve.floor.Floor",
                                                                              {"Stream": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = multiprocessing.get_context("spawn").Process(
            target=_client, args=(f"127.0.0.1:{port}", num_streams), name="grpc-floor-client", daemon=True
        )
        client.start()
        try:
            await asyncio.wait_for(ready.wait(), timeout=120)
            start = time.process_time()
            for message in messages:
                for queue in queues:
                    queue.put_nowait(message)
                await asyncio.sleep(step_s)
            for queue in queues:
                queue.put_nowait(None)
            while any(queue.qsize() for queue in queues):
                await asyncio.sleep(0.005)
            await asyncio.get_running_loop().run_in_executor(None, client.join, 60)
            spent = time.process_time() - start
            if client.exitcode != 0:
                raise RuntimeError(f"the floor's client process ended with exit code {client.exitcode}")
            return spent / (num_steps * num_streams) * 1e6
        finally:
            await server.stop(None)
            if client.is_alive():
                client.kill()

    result: list[float] = []
    errors: list[BaseException] = []

    def thread() -> None:
        event_loop = asyncio.new_event_loop()
        try:
            result.append(event_loop.run_until_complete(run()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            errors.append(error)
        finally:
            event_loop.close()

    worker = threading.Thread(target=thread, name="grpc-floor")
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    return result[0]
