"""Bring-up: Ray, Redis, workers and the router, in this process or joining a Ray cluster."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.processes import command_line, descendants
from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from cluster.redis_supervisor import RedisSupervisor, SupervisionConfig
from cluster.state_dir import LeftoverRecord, StateDirLock, write_private
from router.core import Router, RouterConfig
from router.server import PortUnavailable, RouterServer, ServerConfig, grpc_port_unavailable, probe_port
from router.state import RequestStore, StoreConfig, StoreUnavailable, mask_url
from workers.config import EngineArgs, WorkerConfig
from workers.cpus import engine_slice, keep_off, set_process_cpus
from workers.messages import WorkerLoadError

if TYPE_CHECKING:
    from router.metrics import RouterMetrics

log = logging.getLogger("kvserve.cluster")


@dataclass(frozen=True)
class ClusterConfig:
    """What `kvserve up` starts. Per-worker KV budgets (worker_kv_cache_memory) make
    workers of unequal capacity, for placement tests and benchmarks."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    num_workers: int | None = None  # None: one per GPU, else 2 CPU workers
    worker_cpus: float = 1.0
    worker_kv_cache_memory: tuple[int, ...] | None = None
    worker_resources: tuple[str, ...] | None = None  # a custom Ray resource per worker, 1 unit each
    ray_address: str | None = None  # None: start a local Ray; "auto": join a running one
    # RAY_AUTH_MODE to join ray_address with, unless the environment sets it: a local kvserve
    # up's (`auto` turns Ray's token auth on by itself where ~/.ray/auth_token exists; an
    # address given does not, and the GCS then refuses the join).
    ray_auth_mode: str | None = None
    redis_url: str | None = None  # None: an embedded redis-server under state_dir
    redis_password: str | None = None  # embedded Redis: None generates one
    redis_supervision: SupervisionConfig = field(default_factory=SupervisionConfig)  # embedded Redis only
    state_dir: Path = field(default_factory=lambda: default_state_dir())
    router: RouterConfig = field(default_factory=RouterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    store_prefix: str = "kvserve"
    request_ttl_s: int = 3600
    max_followers: int = StoreConfig.max_followers  # Stream calls following Redis live at once
    redis_timeout_s: float = StoreConfig.socket_timeout  # a Redis command slower than this: Redis is unavailable
    report_interval_s: float = 0.1
    worker_max_restarts: int = 0
    metrics_port: int | None = 9400  # Prometheus /metrics on server.host; 0: a free port; None: off
    # Routers on this host (`kvserve up --routers N`): this process's, and N - 1 `kvserve
    # router`s on the ports after server.port and metrics_port; all are probed before Ray starts.
    num_routers: int = 1
    # A router only (`kvserve router`): serve over the workers a running cluster's Ray holds
    # (found by name), and start or stop none of them; ray_address and redis_url say where.
    join_workers: bool = False
    # workers/cpus.py: CPUs for the engine processes on each node, split between its
    # workers; this process and the worker actors keep off them. Empty: the OS decides.
    engine_cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"ClusterConfig.metrics_port must be in [0, 65536) or None, got {self.metrics_port}")
        if self.request_ttl_s < 1:
            raise ValueError(f"ClusterConfig.request_ttl_s must be >= 1, got {self.request_ttl_s}")
        if self.num_routers < 1:
            raise ValueError(f"ClusterConfig.num_routers must be >= 1, got {self.num_routers}")
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"ClusterConfig.num_workers must be >= 1, got {self.num_workers}")
        if self.worker_kv_cache_memory is not None and self.num_workers is not None:
            if len(self.worker_kv_cache_memory) != self.num_workers:
                raise ValueError(
                    f"ClusterConfig.worker_kv_cache_memory has {len(self.worker_kv_cache_memory)} budgets "
                    f"for {self.num_workers} workers"
                )
        if self.worker_resources is not None:
            if self.num_workers is not None and len(self.worker_resources) != self.num_workers:
                raise ValueError(
                    f"ClusterConfig.worker_resources names {len(self.worker_resources)} resources "
                    f"for {self.num_workers} workers"
                )
            if not all(self.worker_resources):
                raise ValueError(f"ClusterConfig.worker_resources has an empty name: {self.worker_resources}")
        if self.max_followers < 1:
            raise ValueError(f"ClusterConfig.max_followers must be >= 1, got {self.max_followers}")
        if not self.redis_timeout_s > 0:
            raise ValueError(f"ClusterConfig.redis_timeout_s must be positive, got {self.redis_timeout_s}")
        if self.engine_cpus and self.join_workers:
            raise ValueError("ClusterConfig.engine_cpus is for a cluster that starts its workers, not join_workers")
        if self.join_workers and (self.ray_address is None or self.redis_url is None):
            raise ValueError("ClusterConfig.join_workers needs ray_address and redis_url: the cluster it joins")

    def store_config(self, redis_url: str) -> StoreConfig:
        """The request store's configuration on the Redis at redis_url."""
        return StoreConfig(
            url=redis_url, prefix=self.store_prefix, ttl_seconds=self.request_ttl_s, max_followers=self.max_followers,
            socket_timeout=self.redis_timeout_s,
        )


class Cluster:
    """Starts and stops everything a cluster needs; run it inside one asyncio loop.

    A cluster that runs something out of `state_dir` (the embedded Redis, or a Ray it starts
    itself) holds the directory's lock for its life (cluster/state_dir.py): a second one on
    the same directory fails at once. Taking the lock, it stops what a killed predecessor
    left running there: the recorded Ray processes here, an orphaned redis-server in
    EmbeddedRedis.start.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_supervisor: RedisSupervisor | None = None
        self.store: RequestStore | None = None
        self.router: Router | None = None
        self.server: RouterServer | None = None
        self.metrics: RouterMetrics | None = None
        self.handles: list[Any] = []
        self.stop_timings: dict[str, float] = {}  # seconds per step of the last stop()
        self._started_ray = False
        # A Ray this cluster joined (ray_address given) whose GCS went away: nothing it serves
        # from is left, so a stop does not drain (wait_for_failure).
        self.ray_gone = False
        self.gcs_answered = False  # whether the GCS of a Ray it joined took a connection at its start
        self._cpus_before: set[int] | None = None  # this process's CPUs before engine_cpus moved it
        self.redis_url: str | None = None  # the Redis it serves from, once started
        self._lock = StateDirLock(config.state_dir)
        self._leftovers = LeftoverRecord(config.state_dir)

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"{self.config.server.host}:{self.server.port}"

    async def start(self) -> None:
        if self.config.ray_auth_mode:
            # Before Ray is imported: its config reads the environment once, then.
            os.environ.setdefault(RAY_AUTH_MODE_ENV, self.config.ray_auth_mode)
        import ray

        c = self.config
        if c.engine_cpus:
            missing = set(c.engine_cpus) - os.sched_getaffinity(0)
            if missing and c.ray_address is None:  # the workers run here
                raise ValueError(f"--engine-cpus: no CPU {sorted(missing)} here (this process may use "
                                 f"{sorted(os.sched_getaffinity(0))})")
            # Before Ray and Redis start: the processes they start inherit it.
            self._cpus_before = os.sched_getaffinity(0)
            keep_off(c.engine_cpus, "--engine-cpus")
        starts_local_ray = c.ray_address is None and not ray.is_initialized()
        if c.redis_url is None or starts_local_ray:
            self._lock.acquire()
            stopped = await asyncio.to_thread(self._leftovers.stop_leftovers)
            if stopped:
                say(f"stopped {len(stopped)} process(es) a killed kvserve up left running: {'; '.join(stopped)}")
        # After the state dir's lock (a second kvserve up on it is told that, with the pid
        # that holds it, not that its port is taken), before Ray and Redis start.
        check_ports(c)
        if not ray.is_initialized():
            say("starting Ray" if c.ray_address is None else f"joining Ray at {c.ray_address}")
            # ray.init puts in a SIGTERM handler of its own, which dumps a C++ stack and ends
            # in a segfault: `kvserve up` then never drained on a SIGTERM (what systemd,
            # Docker and Kubernetes send). The handler that was there before goes back.
            on_sigterm = signal.getsignal(signal.SIGTERM)
            self._started_ray = True  # stop() shuts down what an interrupted ray.init started too
            try:
                # One namespace, so a restarted router finds the named workers of the one before.
                ray.init(
                    address=c.ray_address,
                    namespace="kvserve",
                    include_dashboard=False,
                    log_to_driver=True,
                    logging_level=logging.WARNING,
                )
            except SystemExit:
                # Ray's handler, in place while ray.init runs, made a SIGTERM this: a stop.
                raise StartInterrupted("a stop signal came while Ray started") from None
            finally:
                if on_sigterm is not None and threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, on_sigterm)
            if starts_local_ray:
                self._record_ray_processes()
                keep_ray_token_private()
        if c.ray_address is not None:  # what _ray_gone judges from: it did answer, here and now
            self.gcs_answered = await _gcs_answer(self.ray_address) is None
        redis_url = c.redis_url
        if redis_url is None:
            password = c.redis_password or secrets.token_hex(16)
            # exit_with_parent: a SIGKILLed `kvserve up` takes its redis-server with it (its
            # Ray agents it cannot: the next start stops those, see cluster/state_dir.py).
            redis_config = RedisServerConfig(state_dir=c.state_dir / "redis", password=password, exit_with_parent=True)
            self.redis = EmbeddedRedis(redis_config)
            redis_url = await asyncio.to_thread(self.redis.start)
            self.redis_supervisor = RedisSupervisor(self.redis, c.redis_supervision)
            self.redis_supervisor.start()
            say(f"embedded redis-server on 127.0.0.1:{self.redis.port} (AOF, data in {self.redis.config.state_dir})")
            # Its Ray's address, then its Redis's: `kvserve router --ray-address auto` on this
            # machine joins this Ray, not whichever Ray `auto` finds (another kvserve up's, on
            # another state dir), and a router that finds the Redis URL finds the address too.
            # With the auth mode it runs (ray.init put "token" in the environment where it
            # turned token auth on).
            write_private(ray_address_file(c.state_dir), f"{self.ray_address}\n{os.environ.get(RAY_AUTH_MODE_ENV, '')}\n")
            write_redis_url(c.state_dir, redis_url)
        elif not c.join_workers:
            # Said, since $KVSERVE_REDIS_URL left exported in a shell gives it too.
            say(f"Redis at {mask_url(redis_url)} (--redis-url or $KVSERVE_REDIS_URL), not an embedded one")
        self.redis_url = redis_url
        self.store = RequestStore(c.store_config(redis_url))
        # A router serving a fixed port keeps its id across restarts (host:port), so a
        # restarted one takes back its own requests at once rather than after their lease.
        router_id = f"{socket.gethostname()}:{c.server.port}" if c.server.port else None
        self.router = Router(c.router, self.store, router_id)
        # Bound first: a taken port fails the start now, and before this router takes over
        # any request (a second router on this host and port would otherwise adopt them).
        self.server = RouterServer(self.router, c.server)
        await self.server.start()
        if c.metrics_port is not None:
            self.metrics = _start_metrics(self.router, c.server.host, c.metrics_port)
        await self.router.check_store_at_start(guarded=c.server.auth_token is not None)  # before the model loads
        if c.join_workers:
            self.handles = await self._find_workers()
            say(f"joining {len(self.handles)} running worker(s)")
        else:
            self.handles = self._spawn_workers(starts_local_ray)
            say(f"loading the model on {len(self.handles)} worker(s)")
        start = time.monotonic()
        joined = []
        for index, handle in enumerate(self.handles):
            try:
                info = await self._worker_joined(handle, index)
            except WorkerLoadError as exc:
                why = WorkerLoadError.why(exc)
                if not c.join_workers:
                    raise WorkerLoadError(why) from None
                # Another's worker, restarted by Ray into a model that did not load: the
                # others serve without it.
                say(f"not joining a worker that is not serving: {why}")
                continue
            joined.append(handle)
            say(
                f"worker {info.worker_id} ready on {info.device} ({info.dtype}): {info.num_blocks} KV blocks "
                f"of {info.block_size} tokens = {info.num_blocks * info.block_bytes / 2**20:.1f} MiB "
                f"[{index + 1}/{len(self.handles)}, {time.monotonic() - start:.1f} s]"
            )
        if not joined:
            raise WorkerLoadError(f"none of the {len(self.handles)} running worker(s) has its model loaded")
        self.handles = joined
        # Its lease before anything else: requests it creates name it as their owner.
        await self.router.start_ownership(self.address)
        try:
            adopted = await self.router.adopt(include_own=True)
        except StoreUnavailable as exc:
            say(f"Redis is unavailable: requests a previous router left running are adopted once it is back ({exc})")
            self.router.adopt_when_redis_returns()
        else:
            if adopted:
                say(f"adopted {adopted} in-flight request(s) left by a previous router; clients re-attach with Stream")
        await self.server.judge_health()  # SERVING now that workers have joined, not a tick later
        self.server.ready()
        if starts_local_ray:
            self._record_ray_processes()  # again: Ray starts some of its processes lazily
        # What start-up made (Ray's modules, the tokenizer, protobuf descriptors) lives as
        # long as the process: out of the collector's sight, a collection walks only what
        # serving allocates (it took 8% of the router's CPU at saturation, walking all this).
        gc.collect()
        gc.freeze()
        say(f"router listening on {self.address} (policy {c.router.policy}, id {self.router.router_id})")

    @property
    def ray_address(self) -> str:
        """The GCS address another process joins this cluster's Ray at."""
        import ray

        return str(ray.get_runtime_context().gcs_address)

    async def _find_workers(self, timeout_s: float = 120.0) -> list[Any]:
        """The running workers of this store prefix, by their actor names; waits for one."""
        import ray

        prefix = f"kvserve-{self.config.store_prefix}-"
        deadline = time.monotonic() + timeout_s
        while True:
            names = sorted(n for n in await asyncio.to_thread(ray.util.list_named_actors) if n.startswith(prefix))
            if names:
                return [ray.get_actor(name) for name in names]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker named {prefix}* in Ray's namespace 'kvserve' within {timeout_s:.0f} s")
            say(f"waiting for the cluster's workers ({prefix}*) to appear in Ray")
            await asyncio.sleep(2.0)

    async def wait_for_failure(self) -> str:
        """Wait until the cluster meets a fault it does not recover from by itself; return
        what happened. Today: the embedded Redis crashing too often to restart, and the GCS
        of a Ray this cluster joined (`kvserve router`, or `--ray-address`) refusing
        connections for RAY_GONE_AFTER_S: that cluster was stopped, and Ray's driver would end
        this process ~60 s later without a word (found in stop 47)."""
        watches: list[asyncio.Task[str]] = []
        if self.redis_supervisor is not None:
            watches.append(asyncio.create_task(self._redis_given_up()))
        if self.config.ray_address is not None:
            watches.append(asyncio.create_task(self._ray_gone(self.ray_address)))
        if self.router is not None:
            watches.append(asyncio.create_task(self._unguarded()))
        if not watches:
            await asyncio.Event().wait()  # nothing here gives up
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
            return done.pop().result()
        finally:
            for watch in watches:
                watch.cancel()

    async def _unguarded(self) -> str:
        """Returns once this router, without a bearer token, finds a peer that requires one
        (one that started later, or one Redis hid at this router's start)."""
        assert self.router is not None
        await self.router.unguarded.wait()
        return self.router.unguarded_problem

    async def _redis_given_up(self) -> str:
        assert self.redis_supervisor is not None
        await self.redis_supervisor.gave_up.wait()
        return self.redis_supervisor.error or "the embedded redis-server was given up"

    async def _ray_gone(self, gcs_address: str) -> str:
        """Returns once the GCS at gcs_address has refused (or not answered) a TCP connection
        for RAY_GONE_AFTER_S in a row while no worker is alive. Not if it never answered
        this process (self.gcs_answered is its answer at the start: a GCS it cannot reach
        directly, as through Ray Client, is never judged), not while a worker lives (a GCS
        restarting under fault tolerance leaves the workers serving), and a probe this
        process could not even send (out of file descriptors: the busiest router) counts
        for nothing (a review's finds)."""
        answered = self.gcs_answered
        refused_since: float | None = None
        while True:
            await asyncio.sleep(RAY_PROBE_INTERVAL_S)
            answer = await _gcs_answer(gcs_address)
            if answer is None:
                answered, refused_since = True, None
                continue
            if answer == "":  # this process's trouble, not the GCS's
                continue
            if not answered or (self.router is not None and self.router.alive_workers):
                refused_since = None
                continue
            now = time.monotonic()
            refused_since = refused_since if refused_since is not None else now
            if now - refused_since >= RAY_GONE_AFTER_S:
                self.ray_gone = True
                return (f"the cluster's Ray is gone: its GCS at {gcs_address} has refused connections for "
                        f"{now - refused_since:.0f} s, and no worker is left ({answer}; was its kvserve up stopped?)")

    def _record_ray_processes(self) -> None:
        """Write down the processes under this one (Ray's: redis-server is found by its directory),
        so that the next cluster on the state directory can stop them if this one is SIGKILLed:
        Ray's agents outlive their raylet."""
        redis_pid = self.redis.pid if self.redis is not None else None
        self._leftovers.write(p for p in descendants(os.getpid()) if p.pid != redis_pid and _is_ray_process(p.pid))

    async def _worker_joined(self, handle: Any, index: int) -> Any:
        """router.add_worker(handle), saying what Ray has free while it is not placed: an
        actor that asks for more than Ray has waits for it without a word (a Ray cluster
        that an autoscaler grows places it later; Ctrl-C stops the wait)."""
        joining = asyncio.ensure_future(self.router.add_worker(handle))
        try:
            done, _ = await asyncio.wait([joining], timeout=PLACEMENT_NOTICE_S)
            if not done:
                say(f"worker w{index} is not ready after {PLACEMENT_NOTICE_S:g} s: its model may still be loading, "
                    f"or Ray cannot place it yet ({self._resources_free()}); waiting (Ctrl-C stops)")
            return await joining
        finally:
            joining.cancel()

    def _resources_free(self) -> str:
        import ray

        c = self.config
        free, total = ray.available_resources(), ray.cluster_resources()
        said = f"{free.get('CPU', 0):g} of its {total.get('CPU', 0):g} CPUs are free, a worker asks for {c.worker_cpus:g}"
        for resource in sorted(set(c.worker_resources or ())):
            said += f", and {resource!r} ({free.get(resource, 0):g} free of {total.get(resource, 0):g})"
        return said

    def _check_resources(self, count: int, num_gpus: int) -> None:
        """On a Ray this process started (no node joins it): the workers must fit, or an
        actor waits for ever (an outside check's `--workers 3` on two cores hung, deaf to
        Ctrl-C)."""
        import ray

        c = self.config
        total = ray.cluster_resources()
        cpus = total.get("CPU", 0.0)
        if num_gpus and count > num_gpus:
            raise ValueError(f"--workers: {count} workers of one GPU each do not fit the {num_gpus} GPUs here")
        if round(count * c.worker_cpus, 4) > cpus:  # Ray counts CPUs in steps of 0.0001; 25 x 0.56 > 14.0
            raise ValueError(f"--workers: {count} workers of {c.worker_cpus:g} CPUs each (--worker-cpus) do not fit "
                             f"the {cpus:g} CPUs of the Ray this started; give fewer workers or a smaller --worker-cpus")
        for resource in set(c.worker_resources or ()):
            if total.get(resource, 0.0) < (c.worker_resources or ()).count(resource):
                raise ValueError(f"--worker-resources: the Ray this started has no resource {resource!r} (it pins a "
                                 f"worker to nodes started with it: give --ray-address of a cluster that has them)")

    def _spawn_workers(self, starts_local_ray: bool = False) -> list[Any]:
        import ray

        from cluster.workers import spawn_worker  # imports torch: only where workers start

        c = self.config
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        count = c.num_workers or (num_gpus if num_gpus > 0 else 2)
        if starts_local_ray:
            self._check_resources(count, num_gpus)
        budgets = c.worker_kv_cache_memory or (c.engine.kv_cache_memory,) * count
        handles = []
        for index in range(count):
            engine = replace(c.engine, kv_cache_memory=budgets[index])
            worker = WorkerConfig(worker_id=f"w{index}", engine=engine, report_interval_s=c.report_interval_s,
                                  engine_cpus=engine_slice(c.engine_cpus, index, count), reserved_cpus=c.engine_cpus)
            name = f"kvserve-{c.store_prefix}-{worker.worker_id}"
            if _actor_exists(name):
                say(f"worker {worker.worker_id} is still running from a previous router: reusing it ({name})")
            handles.append(
                spawn_worker(
                    worker,
                    num_cpus=c.worker_cpus,
                    num_gpus=1 if num_gpus > 0 else 0,
                    resources={c.worker_resources[index]: 1.0} if c.worker_resources else None,
                    max_restarts=c.worker_max_restarts,
                    name=name,
                    # On a Ray cluster the workers outlive a crashed router, whose successor
                    # adopts them; a local Ray dies with this process anyway.
                    detached=c.ray_address is not None,
                )
            )
        return handles

    async def stop(self, grace_s: float = 0.0, others: Any = None) -> None:
        """Drain for up to grace_s, then stop every part, each step bounded (STOP_STEP_S):
        a step still running then is logged and left behind, so the whole stop takes at
        most grace_s plus a few bounded steps. Blocking calls (ray.kill, SHUTDOWN of Redis)
        run in threads, never on the loop that also serves gRPC; stop_timings has each
        step's seconds. others: an awaitable (the other routers' stop) awaited after the
        drain, before the workers and Redis they serve from go."""
        import ray

        timings = self.stop_timings = {}
        began = time.monotonic()
        if self.router is not None and grace_s > 0:
            say(f"draining: in-flight requests get up to {grace_s:g} s")
            # A router that joined workers it did not start leaves what still runs to a peer
            # (the workers live on); one that stops its workers cancels it.
            await _bounded(self.router.drain(grace_s, hand_over=self.config.join_workers), "the drain", timings,
                           grace_s + STOP_STEP_S)
        if others is not None:
            await _bounded(others, "the other routers' stop", timings, grace_s + 2 * STOP_STEP_S + 20.0)
        if self.server is not None:
            await _bounded(self.server.stop(0.5), "the gRPC server's stop", timings)
        if self.metrics is not None:
            await _bounded(asyncio.to_thread(self.metrics.stop_http), "the metrics server's stop", timings)
        if self.router is not None:
            await _bounded(self.router.close(), "the router's close", timings)
        if self.handles and not self.config.join_workers:
            await _bounded(asyncio.to_thread(_kill_actors, self.handles), "killing the workers", timings)
        if self.store is not None:
            await _bounded(self.store.close(), "closing the Redis connections", timings)
        if self.redis_supervisor is not None:
            # First, or it would restart the server stopped next.
            await _bounded(self.redis_supervisor.stop(), "the Redis supervisor's stop", timings)
        if self.redis is not None:
            redis_url_file(self.config.state_dir).unlink(missing_ok=True)
            ray_address_file(self.config.state_dir).unlink(missing_ok=True)
            await _bounded(asyncio.to_thread(self.redis.stop), "the embedded Redis's stop", timings)
        if self._started_ray and not self.ray_gone:  # a Ray that is gone has nothing to shut down, and may hang it
            # On this thread, where ray.init ran; everything that serves has stopped already.
            started = time.monotonic()
            ray.shutdown()
            timings["ray.shutdown"] = time.monotonic() - started
        if self._lock.held:
            # ray.shutdown stops what it started; anything of ours that outlived it goes now.
            stopped = await asyncio.to_thread(self._leftovers.stop_leftovers)
            if stopped:
                log.warning("stop: stopped %d process(es) that outlived ray.shutdown: %s", len(stopped), stopped)
            self._lock.release()
        if self._cpus_before is not None:
            set_process_cpus(self._cpus_before)  # a process that goes on (a test, a benchmark) gets them back
            self._cpus_before = None
        timings["total"] = time.monotonic() - began


# What a Ray process's command line holds: its workers and agents (ray::...), its binaries
# (gcs_server, raylet) and its Python services (under .../ray/...). Anything else under
# this process (a benchmark's own client, say) is not the cluster's to stop.
_RAY_MARKS = ("ray::", "/ray/", "gcs_server", "raylet")


def _is_ray_process(pid: int) -> bool:
    line = command_line(pid)
    return any(mark in line for mark in _RAY_MARKS)


class StartInterrupted(Exception):
    """A stop signal (SIGTERM) came while the start could not hear it the usual way."""


STOP_STEP_S = 10.0  # the longest one step of a stop may take before it is left behind
PLACEMENT_NOTICE_S = 30.0  # a worker not ready by then: say what Ray has free
RAY_PROBE_INTERVAL_S = 2.0  # how often a cluster that joined a Ray checks that its GCS is there
RAY_GONE_AFTER_S = 10.0  # refused that long: that Ray is gone (Ray's driver gives up at 60 s)


async def _gcs_answer(gcs_address: str) -> str | None:
    """Whether the GCS at host:port takes a TCP connection: None if it does; why not, if it
    refuses, resets or does not answer within RAY_PROBE_INTERVAL_S, or its host is
    unreachable; "" if this process could not even try (EMFILE, ENOBUFS...)."""
    host, _, port = gcs_address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), RAY_PROBE_INTERVAL_S)
        writer.close()
        return None
    except (TimeoutError, ConnectionError) as exc:  # refused, reset, or no answer
        return exc.strerror if isinstance(exc, OSError) and exc.strerror else "no answer"
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return exc.strerror or str(exc)
        return ""


def _kill_actors(handles: list[Any]) -> None:
    import ray

    for handle in handles:
        try:
            ray.kill(handle)
        except Exception:  # noqa: BLE001 - already gone
            pass


async def _bounded(step: Any, what: str, timings: dict[str, float], timeout_s: float = STOP_STEP_S) -> None:
    """One step of a stop, at most timeout_s; past that it is logged and the stop goes on
    (asyncio.wait, not wait_for: wait_for would wait on for the cancelled step to end).
    Its duration goes into timings."""
    started = time.monotonic()
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    timings[what] = seconds = time.monotonic() - started
    if not done:
        task.cancel()
        log.warning("stop: %s took over %.0f s; going on without it", what, timeout_s)
    elif task.exception() is not None:
        log.warning("stop: %s failed: %s", what, task.exception())
    elif seconds > 2.0:
        log.warning("stop: %s took %.1f s", what, seconds)


def default_state_dir() -> Path:
    """Where `kvserve up` keeps the embedded Redis's data when --state-dir is not given:
    the XDG state directory ($XDG_STATE_HOME/kvserve, else ~/.local/state/kvserve), the
    same from any working directory, so a second `kvserve up` finds the first one's data."""
    base = os.environ.get("XDG_STATE_HOME") or ""
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".local" / "state"
    return root / "kvserve"


def redis_url_file(state_dir: Path) -> Path:
    """Where a running `kvserve up` keeps its embedded Redis's URL (password included, so
    only its owner may read it): `kvserve router` on the same machine reads it from there."""
    return state_dir / "redis-url"


RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"


def ray_address_file(state_dir: Path) -> Path:
    """Where a running `kvserve up` keeps its Ray's GCS address and RAY_AUTH_MODE (a line
    each), beside redis_url_file."""
    return state_dir / "ray-address"


def read_ray_address(state_dir: Path) -> tuple[str, str | None] | None:
    """A running `kvserve up`'s Ray: (GCS address, RAY_AUTH_MODE or None), or None."""
    try:
        lines = ray_address_file(state_dir).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    if not lines or not lines[0].strip():
        return None
    mode = lines[1].strip() if len(lines) > 1 else ""
    return lines[0].strip(), mode or None


def write_redis_url(state_dir: Path, url: str) -> None:
    write_private(redis_url_file(state_dir), url + "\n")


def _actor_exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name)  # in the job's namespace, "kvserve" for `kvserve up`
    except ValueError:
        return False
    return True


def metrics_port_unavailable(host: str, port: int, why: OSError, flag: str = "--metrics-port") -> str:
    return (f"could not serve metrics on {host}:{port} ({flag}; another kvserve up or kvserve router "
            f"on this machine? give each its own, or off): {why.strerror or why}")


def check_ports(config: ClusterConfig) -> None:
    """Raise PortUnavailable for a --port or --metrics-port that cannot be bound now, each
    router's of --routers N: before Ray and Redis start (~10 s; the extra routers start only
    once the model has loaded), and before gRPC logs its own line about it."""
    host, count = config.server.host, config.num_routers
    for flag, first in (("--port", config.server.port), ("--metrics-port", config.metrics_port)):
        if first and first + count - 1 > 65535:
            raise PortUnavailable(f"--routers {count} serve on {flag} {first} and the {count - 1} port(s) after it: "
                                  f"past 65535")
    for index in range(count):
        suffix = "" if index == 0 else f" + {index}: router {index + 1} of --routers {count}"
        if config.server.port:
            port = config.server.port + index
            if probe_port(host, port) is not None:
                raise PortUnavailable(grpc_port_unavailable(f"{host}:{port}", f"--port{suffix}"))
        if config.metrics_port:
            port = config.metrics_port + index
            why = probe_port(host, port)
            if why is not None:
                raise PortUnavailable(metrics_port_unavailable(host, port, why, f"--metrics-port{suffix}"))


def _start_metrics(router: Router, host: str, port: int) -> RouterMetrics | None:
    """Attach Prometheus metrics to the router and serve /metrics; before any model loads,
    so a taken port fails the start at once."""
    try:
        from router.metrics import RouterMetrics
    except ImportError as exc:
        # prometheus-client is a declared dependency; a venv made before it was added
        # lacks it. Serving matters more than its metrics, so say so loudly and go on.
        say(f"metrics are off: {exc} (make venv installs prometheus-client)")
        return None
    metrics = RouterMetrics(router)
    try:
        bound = metrics.start_http(port, host)
    except OSError as exc:
        raise PortUnavailable(metrics_port_unavailable(host, port, exc)) from exc
    say(f"metrics on http://{host}:{bound}/metrics")
    return metrics


def keep_ray_token_private() -> None:
    """Make Ray's token file (~/.ray/auth_token) its owner's alone. Ray's ports listen on
    every interface and its token auth (on by default) is what guards them; ray.init writes
    the token with the process umask (0644), so on a host whose home directories others
    may enter, any local user could join the cluster and run code as this one (an outside
    security check did). A file another user owns is left alone."""
    token = Path.home() / ".ray" / "auth_token"
    try:
        info = token.stat()
        if info.st_uid == os.getuid() and info.st_mode & 0o077:
            token.chmod(0o600)
            say(f"made Ray's token file {token} readable by its owner only (it was {oct(info.st_mode & 0o777)})")
    except OSError:
        pass  # none (RAY_AUTH_MODE=disabled), or not ours to change


def say(message: str) -> None:
    """Progress for people: bring-up takes seconds to minutes (model loads)."""
    print(f"[kvserve] {message}", file=sys.stderr, flush=True)


__all__ = ["Cluster", "ClusterConfig"]
