"""The router process's gRPC server: KVServe, standard health checking, and reflection."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.core import Router
from router.service import KVServeService

log = logging.getLogger("kvserve.router")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVServe"].full_name


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # localhost by default; 0.0.0.0 to serve other machines
    port: int = 50051  # 0 picks a free port
    max_message_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in [0, 65536), got {self.port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"ServerConfig.max_message_bytes must be >= 1024, got {self.max_message_bytes}")


class RouterServer:
    """Serves a Router over gRPC; health reports SERVING while at least one worker is alive."""

    def __init__(self, router: Router, config: ServerConfig) -> None:
        self.router = router
        self.config = config
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
            ]
        )
        self.service = KVServeService(router)
        pb_grpc.add_KVServeServicer_to_server(self.service, self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port = 0
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind the router to {self.config.host}:{self.config.port}")
        await self.server.start()
        self._health_task = asyncio.create_task(self._track_health())
        return self.port

    async def _track_health(self) -> None:
        serving = None
        while True:
            now = bool(self.router.alive_workers) and not self.router.draining
            if now != serving:
                status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
                await self.health.set("", status)
                await self.health.set(SERVICE_NAME, status)
                serving = now
            await asyncio.sleep(0.2)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.server.stop(grace_s)
