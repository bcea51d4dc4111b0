"""`kvserve up`: start a whole cluster and serve until Ctrl-C, then drain."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.client import TOKEN_ENV, load_auth_token
from cluster.local import (
    Cluster,
    ClusterConfig,
    StartInterrupted,
    default_state_dir,
    read_ray_address,
    redis_url_file,
    say,
)
from cluster.offline import add_engine_arguments, engine_args_from
from cluster.routers import REDIS_URL_ENV, RouterDidNotStart, RouterProcesses, router_flags
from cluster.state_dir import StateDirInUse, live_holder
from cluster.units import byte_size, byte_sizes
from router.core import QUEUE_ORDERS, RouterConfig
from router.ownership import OlderRouters, UnguardedBesideGuarded
from router.placement import POLICIES, PrefixWeights
from router.server import PortUnavailable, ServerConfig, check_tls_pair
from workers.cpus import parse_cpu_list
from workers.messages import WorkerLoadError
from router.state import StoreConfig, StoreRefused, redis_url_problem


def add_up_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("up", help="start Ray, Redis, workers and the router(s), and serve")
    add_engine_arguments(p)
    g = p.add_argument_group("cluster")
    g.add_argument("--ray-address", default=None, help="join a running Ray cluster ('auto'); default: start one")
    g.add_argument("--workers", type=_positive_int, default=None, help="number of workers (default: one per GPU, else 2)")
    g.add_argument("--worker-cpus", type=_positive_number, default=1.0, help="Ray CPUs per worker")
    g.add_argument("--worker-kv-cache-memory", type=byte_sizes, default=None,
                   help="comma-separated KV budget per worker, e.g. 64MiB,128MiB (unequal workers)")
    g.add_argument("--worker-resources", default=None,
                   help="comma-separated custom Ray resource per worker (1 unit each), e.g. node_a,node_b: "
                   "pins worker i to nodes started with that resource (default: Ray's SPREAD across nodes)")
    g.add_argument("--redis-url", default=None,
                   help=f"use this Redis instead of starting an embedded one (default: ${REDIS_URL_ENV}, which keeps "
                        f"its password out of ps)")
    g.add_argument("--state-dir", type=Path, default=None,
                   help="embedded Redis data and logs, relative to the working directory "
                        "(default: $XDG_STATE_HOME/kvserve, else ~/.local/state/kvserve)")
    g.add_argument("--worker-max-restarts", type=int, default=0,
                   help="Ray restarts of a crashed worker (-1: forever); a restarted worker rejoins")
    g.add_argument("--engine-cpus", type=_cpu_list, default=(),
                   help="CPUs for the workers' engine processes on each node, e.g. 2-7 or 1,3 (split between "
                        "its workers); kvserve's other processes keep off them (default: the OS decides)")
    g.add_argument("--routers", type=_positive_int, default=1,
                   help="router processes, on consecutive ports from --port (and --metrics-port), "
                        "sharing the workers and Redis; a client may call any of them")
    add_router_arguments(p)
    p.set_defaults(func=run_up)


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of one router: `kvserve up` passes them on to the routers it starts."""
    g = p.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="router bind address (0.0.0.0 to serve other machines)")
    g.add_argument("--port", type=_port, default=50051, help="the router's gRPC port (0: a free port)")
    g.add_argument("--policy", choices=POLICIES, default=RouterConfig.policy)
    g.add_argument("--prefix-weight", type=float, default=PrefixWeights.prefix_weight,
                   help="--policy prefix: weight of the share of the prompt a worker has cached")
    g.add_argument("--load-weight", type=float, default=PrefixWeights.load_weight,
                   help="--policy prefix: weight of the share of a worker's KV committed after placing")
    g.add_argument("--evict-weight", type=float, default=PrefixWeights.evict_weight,
                   help="--policy prefix: weight of the cached blocks of other prompts placing there would evict")
    g.add_argument("--balance-abs", type=int, default=PrefixWeights.balance_abs,
                   help="--policy prefix: place by kv when the best worker has this many more requests than the least loaded")
    g.add_argument("--balance-rel", type=float, default=PrefixWeights.balance_rel,
                   help="--policy prefix: ... and this many times as many")
    g.add_argument("--kv-reserve-ratio", type=_reserve_ratio, default=RouterConfig.kv_reserve_ratio,
                   help="kv-aware placement commits a request's prompt and this fraction of its max_tokens "
                        "(1: all of it, and no worker ever runs short; below: more requests run at once, and "
                        "a worker whose requests outgrow their reservations preempts)")
    g.add_argument("--kv-reserve-floor", type=_reserve_ratio, default=RouterConfig.kv_reserve_floor,
                   help="let the ratio adapt to how long answers are: it falls to --kv-reserve-ratio x the 90th "
                        "percentile of (output tokens / max_tokens) of the requests that ended, never below this "
                        "floor, and is back at --kv-reserve-ratio right after a worker preempts (default: fixed "
                        "at --kv-reserve-ratio)")
    g.add_argument("--kv-reserve-decay", type=_positive_seconds, default=RouterConfig.kv_reserve_decay_s,
                   help="seconds without a preemption for the adaptive ratio to fall from --kv-reserve-ratio to "
                        "what it learned")
    g.add_argument("--max-queue", type=int, default=RouterConfig.max_queue,
                   help="requests that may wait in the router for KV room or a sequence slot")
    g.add_argument("--max-queue-wait", type=float, default=30.0, help="seconds a request may wait for KV room")
    g.add_argument("--queue-order", choices=QUEUE_ORDERS, default=RouterConfig.queue_order,
                   help="fifo: nothing passes the request that waits longest; backfill: while it fits nowhere, "
                        "those behind it may go to any worker but the one it waits for")
    g.add_argument("--worker-timeout", type=float, default=RouterConfig.worker_timeout_s,
                   help="seconds of silence before a worker is dead (workers say alive every 0.25 s)")
    g.add_argument("--progress-timeout", type=float, default=RouterConfig.progress_timeout_s,
                   help="seconds a worker's engine may go without a step while it has requests")
    g.add_argument("--max-migrations", type=int, default=RouterConfig.max_migrations,
                   help="times a request may move off a dead worker before it fails")
    g.add_argument("--store-prefix", default=ClusterConfig.store_prefix,
                   help="Redis key prefix and worker-name prefix of the cluster (one Redis may hold several)")
    g.add_argument("--lease-ttl", type=float, default=RouterConfig.lease_ttl_s,
                   help="seconds a router may go without renewing its lease in Redis before its peers "
                        "adopt its requests")
    g.add_argument("--request-ttl", type=_positive_int, default=ClusterConfig.request_ttl_s,
                   help="seconds an ended request's record and token log stay in Redis (GetRequest, Stream "
                        "re-attach); give every router of a cluster the same")
    g.add_argument("--redis-timeout", type=_positive_seconds, default=StoreConfig.socket_timeout,
                   help="seconds a Redis command may take before the router answers UNAVAILABLE and keeps "
                        "its writes until Redis is back (raise it for a distant or busy Redis)")
    g.add_argument("--drain-grace", type=_seconds, default=30.0, help="seconds in-flight requests get on Ctrl-C")
    g.add_argument("--metrics-port", type=_metrics_port, default=9400,
                   help="Prometheus /metrics port on --host (0: a free port; 'off': no metrics)")
    s = p.add_argument_group("security and limits")
    s.add_argument("--tls-cert", type=Path, default=None, help="serve TLS with this certificate chain (PEM)")
    s.add_argument("--tls-key", type=Path, default=None, help="the --tls-cert private key (PEM)")
    s.add_argument("--auth-token-file", type=Path, default=None,
                   help=f"every call but health checks must send 'authorization: Bearer <token>' with the token "
                        f"on this file's first line (default: ${TOKEN_ENV} if set, else no auth)")
    s.add_argument("--max-streams-per-client", type=_positive_int, default=None,
                   help="Generate/Stream calls one client (token, or peer host without auth) may hold open")
    s.add_argument("--max-pending-tokens", type=_positive_int, default=ServerConfig.max_pending_tokens,
                   help="a Generate/Stream client's output not yet sent, in tokens, past which its call ends "
                        "RESOURCE_EXHAUSTED (the request runs on; re-attach with Stream)")
    s.add_argument("--stream-interval", type=_positive_int, default=ServerConfig.stream_interval,
                   help="after a stream's first delta, send the next once this many tokens wait or the request "
                        "ends: fewer gRPC messages for the router to send, burstier streams (1: every step's token "
                        "at once)")
    s.add_argument("--max-followers", type=_positive_int, default=StoreConfig.max_followers,
                   help="Stream calls of requests this router does not run that follow Redis live at once "
                        "(each holds a Redis connection; more: RESOURCE_EXHAUSTED)")
    s.add_argument("--max-message-bytes", type=byte_size, default=4 * 2**20,
                   help="largest request gRPC accepts, e.g. 4MiB (larger: RESOURCE_EXHAUSTED)")
    s.add_argument("--max-prompt-tokens", type=_positive_int, default=None,
                   help="refuse longer prompts (default: the model's max length)")
    s.add_argument("--max-tokens-limit", type=_positive_int, default=None, help="refuse a larger sampling.max_tokens")


def _redis_url(given: str | None) -> str | None:
    """--redis-url, else $KVSERVE_REDIS_URL, else None; ValueError naming both when redis-py
    cannot read it (it was read after Ray started, and the message quoted part of it)."""
    url = given or os.environ.get(REDIS_URL_ENV) or None
    problem = None if url is None else redis_url_problem(url)
    if problem is not None:
        raise ValueError(f"--redis-url (or ${REDIS_URL_ENV}): {problem}")
    return url


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    budgets = args.worker_kv_cache_memory
    resources = tuple(args.worker_resources.split(",")) if args.worker_resources else None
    engine = engine_args_from(args)
    return ClusterConfig(
        engine=engine,
        num_workers=args.workers if args.workers is not None else (
            len(budgets) if budgets else (len(resources) if resources else None)
        ),
        worker_cpus=args.worker_cpus,
        worker_kv_cache_memory=budgets,
        worker_resources=resources,
        ray_address=args.ray_address,
        redis_url=_redis_url(args.redis_url),
        state_dir=(args.state_dir or default_state_dir()).absolute(),
        router=router_config_from_args(args),
        server=server_config_from_args(args),
        max_followers=args.max_followers,
        redis_timeout_s=args.redis_timeout,
        metrics_port=args.metrics_port,
        worker_max_restarts=args.worker_max_restarts,
        store_prefix=args.store_prefix,
        engine_cpus=args.engine_cpus,
        num_routers=args.routers,
        request_ttl_s=args.request_ttl,
    )


def _cpu_list(value: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig that add_router_arguments' flags describe."""
    if args.kv_reserve_floor is not None and args.kv_reserve_floor > args.kv_reserve_ratio:
        raise ValueError(f"--kv-reserve-floor ({args.kv_reserve_floor:g}) must not be above "
                         f"--kv-reserve-ratio ({args.kv_reserve_ratio:g})")
    return RouterConfig(
        policy=args.policy,
        max_queue=args.max_queue,
        max_queue_wait_s=args.max_queue_wait,
        queue_order=args.queue_order,
        worker_timeout_s=args.worker_timeout,
        progress_timeout_s=args.progress_timeout,
        max_migrations=args.max_migrations,
        lease_ttl_s=args.lease_ttl,
        kv_reserve_ratio=args.kv_reserve_ratio,
        kv_reserve_floor=args.kv_reserve_floor,
        kv_reserve_decay_s=args.kv_reserve_decay,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        prefix_weights=PrefixWeights(
            prefix_weight=args.prefix_weight, load_weight=args.load_weight, evict_weight=args.evict_weight,
            balance_abs=args.balance_abs, balance_rel=args.balance_rel,
        ),
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig that add_router_arguments' flags describe."""
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not path.is_file():  # now, not after the model has loaded
            raise ValueError(f"{flag}: no file at {path}")
    if args.tls_cert is not None and args.tls_key is not None:
        check_tls_pair(args.tls_cert, args.tls_key)
    return ServerConfig(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        auth_token=load_auth_token(args.auth_token_file),
        max_streams_per_client=args.max_streams_per_client,
        max_pending_tokens=args.max_pending_tokens,
        stream_interval=args.stream_interval,
    )


def _number_type(parse: Callable[[str], Any], accept: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: the value parsed, or refused, naming what was expected (argparse
    prints `argument --flag: expected ..., got '...'` and exits 2)."""

    def check(value: str) -> Any:
        try:
            number = parse(value)
        except ValueError:
            number = None
        if number is None or not accept(number):  # NaN accepts nothing
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
        return number

    return check


_positive_int = _number_type(int, lambda n: n >= 1, "a whole number >= 1")
_positive_number = _number_type(float, lambda n: 0 < n < math.inf, "a number > 0")
_positive_seconds = _number_type(float, lambda n: 0 < n < math.inf, "a number of seconds > 0")
_seconds = _number_type(float, lambda n: 0 <= n < math.inf, "a number of seconds >= 0")
_port = _number_type(int, lambda n: 0 <= n < 65536, "a port number in 0-65535")
_reserve_ratio = _number_type(float, lambda n: 0 < n <= 1, "a fraction in (0, 1]")
_port_or_off = _number_type(int, lambda n: 0 <= n < 65536, "a port number in 0-65535 or 'off'")


def _metrics_port(value: str) -> int | None:
    return None if value.lower() in ("off", "none") else int(_port_or_off(value))


def run_up(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="[kvserve] %(message)s")
    config = cluster_config_from_args(args)
    return _run(config, args.drain_grace, router_flags(router_only_parser(), args))


def add_router_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router", help="add a router to a running cluster: it serves over the cluster's workers and Redis"
    )
    p.add_argument("--ray-address", required=True, help="the cluster's Ray (its GCS address, or 'auto' on a node)")
    p.add_argument("--redis-url", default=None,
                   help=f"the cluster's Redis (default: ${REDIS_URL_ENV}, else the embedded Redis of a kvserve up "
                        f"on this machine, from its --state-dir)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="a kvserve up's state directory on this machine, whose Redis to use when --redis-url is not "
                        "given (default: kvserve up's default)")
    add_router_arguments(p)
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="[kvserve] %(message)s")
    return _run(router_cluster_config_from_args(args), args.drain_grace, [])


def router_cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """What `kvserve router` serves: a router over a running cluster's workers and Redis."""
    redis_url = _redis_url(args.redis_url)
    ray_address, ray_auth_mode = args.ray_address, None
    if not redis_url:
        local = redis_url_file((args.state_dir or default_state_dir()).absolute())
        try:
            redis_url = local.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            redis_url = ""
        except (OSError, UnicodeDecodeError) as exc:  # e.g. 0600, and this is another user
            raise ValueError(
                f"--redis-url: the cluster's Redis is needed (or ${REDIS_URL_ENV}); {local} cannot be read: "
                f"{getattr(exc, 'strerror', None) or exc}"
            ) from None
        if not redis_url or live_holder(local.parent) is None:  # none, or a killed kvserve up's
            raise ValueError(
                f"--redis-url: the cluster's Redis is needed (or ${REDIS_URL_ENV}); no kvserve up "
                f"running on this machine keeps one in {local.parent} (--state-dir)"
            )
        local_ray = read_ray_address(local.parent)
        if ray_address == "auto":
            if local_ray is not None:
                # That kvserve up's Ray: `auto` alone finds the newest Ray on the machine, which
                # may be another kvserve up's (its workers, its model) beside this one's Redis.
                ray_address, ray_auth_mode = local_ray
        elif local_ray is not None and same_ray_address(ray_address, local_ray[0]):
            ray_auth_mode = local_ray[1]
        else:
            # Another cluster's Ray beside this machine's Redis: its workers would run this
            # Redis's requests (an adoption would take them there).
            raise ValueError(
                f"--redis-url: the Redis of the kvserve up in {local.parent} belongs to the Ray at "
                f"{local_ray[0] if local_ray else 'an address it did not record'}, not to --ray-address "
                f"{ray_address}; give that cluster's --redis-url (or ${REDIS_URL_ENV})"
            )
    return ClusterConfig(
        ray_address=ray_address,
        ray_auth_mode=ray_auth_mode,
        redis_url=redis_url,
        join_workers=True,
        router=router_config_from_args(args),
        server=server_config_from_args(args),
        max_followers=args.max_followers,
        redis_timeout_s=args.redis_timeout,
        metrics_port=args.metrics_port,
        store_prefix=args.store_prefix,
        request_ttl_s=args.request_ttl,
    )


def same_ray_address(given: str, recorded: str) -> bool:
    """Whether two host:port GCS addresses are one Ray: one port, and hosts that share an
    address or are both this machine. kvserve up records its Ray on the node's IP, and a
    user may type localhost, 127.0.0.1, [::1], the hostname or that IP for it."""
    (given_host, _, given_port), (recorded_host, _, recorded_port) = given.rpartition(":"), recorded.rpartition(":")
    if given_port != recorded_port:
        return False
    if given_host == recorded_host:
        return True
    given_ips, recorded_ips = _addresses(given_host), _addresses(recorded_host)
    if given_ips & recorded_ips:
        return True
    return any(map(_is_this_machine, given_ips)) and any(map(_is_this_machine, recorded_ips))


def _addresses(host: str) -> set[str]:
    """The IPv4 and IPv6 addresses a host name or literal (IPv6 with or without brackets) stands for."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()


def _is_this_machine(ip: str) -> bool:
    """Whether ip is an address of one of this machine's interfaces: only those can be bound
    (the hostname's entry in /etc/hosts is often 127.0.1.1, not the node's IP)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError:
        return False
    return True


def _program() -> str:
    """How this command was typed (`.venv/bin/kvserve`, or `kvserve` on PATH)."""
    typed = sys.argv[0] if sys.argv else ""
    return typed if Path(typed).name == "kvserve" else "kvserve"


def _try_it(config: ClusterConfig, port: int) -> str:
    """A command that calls this router, as the user would type it: with the TLS and token
    flags it needs, and, with TLS, at `localhost` (the name a local certificate is for)."""
    host = config.server.host
    if config.server.tls and host in ("127.0.0.1", "::1"):
        host = "localhost"
    flags = f" --address {host}:{port}"
    if config.server.tls:
        flags += " --tls-ca CERT.pem"
    if config.server.auth_token is not None:
        flags += " --auth-token-file TOKEN_FILE"
    return f"{_program()} generate{flags} \"Hello\""


def _another_router(config: ClusterConfig, extra_routers: int, flags: list[str]) -> str:
    """The `kvserve router` command that adds a router to this local cluster, as typed: its
    Ray and its Redis (the URL is in the state dir) are found on this machine, and it gets
    the router flags this one was given (TLS, token, host, policy...), as --routers N's do."""
    metrics = config.metrics_port
    command = [_program(), "router", "--ray-address", "auto", *flags,
               "--port", str(config.server.port + extra_routers + 1),
               "--metrics-port", "off" if metrics is None else str(metrics + extra_routers + 1 if metrics else 0)]
    if config.state_dir != default_state_dir().absolute():
        command += ["--state-dir", str(config.state_dir)]
    typed = shlex.join(command)
    if config.server.auth_token is not None and "--auth-token-file" not in flags:
        typed += f"   (with ${TOKEN_ENV} set, as here)"
    return typed


def router_only_parser() -> argparse.ArgumentParser:
    """A parser of add_router_arguments' flags only: router_flags reads which a router gets."""
    parser = argparse.ArgumentParser(add_help=False)
    add_router_arguments(parser)
    return parser


# A start that fails for one of these says why in one line and exits 1, without a traceback.
START_ERRORS = (StateDirInUse, OlderRouters, PortUnavailable, RouterDidNotStart, WorkerLoadError, StoreRefused,
                UnguardedBesideGuarded)
SECOND_SIGNAL_AFTER_S = 1.0  # a stop signal sooner than this after the first is the same one


def _run(config: ClusterConfig, drain_grace: float, flags: list[str]) -> int:
    host = config.server.host
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        if config.server.auth_token is None:
            say(f"warning: serving on {host} without --auth-token-file: anyone who reaches it can use it")
        elif config.server.tls_cert_file is None:
            say(f"warning: serving on {host} with a token but without --tls-cert: the token crosses the network "
                f"in the clear")
    try:
        return asyncio.run(_serve(config, drain_grace, flags))
    except START_ERRORS as exc:  # raised before _serve's own handling, e.g. by Cluster()
        say(f"error: {exc}")
        return 1


async def _serve(config: ClusterConfig, drain_grace: float, flags: list[str] | None = None) -> int:
    """Serve until Ctrl-C or SIGTERM (exit 0) or a fault the cluster gives up on (exit 1); drain either way.
    config.num_routers - 1 `kvserve router` processes start beside this one's, with flags."""
    extra_routers = config.num_routers - 1
    cluster = Cluster(config)
    routers = RouterProcesses()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    first_signal_at: list[float] = []

    def stop_draining() -> None:
        first_signal_at.append(time.monotonic())
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_draining)
    failure: asyncio.Task[str] | None = None
    supervising: asyncio.Task[None] | None = None
    failed: str | None = None
    draining = False

    async def start() -> None:
        nonlocal supervising
        await cluster.start()
        if extra_routers:
            assert cluster.redis_url is not None
            say(f"starting {extra_routers} more router(s) on the ports after {config.server.port}")
            await routers.start(extra_routers, cluster.ray_address, cluster.redis_url, flags or [],
                                config.server.port, config.metrics_port)
            say(f"routers listening on {', '.join([cluster.address, *routers.addresses])}")
            supervising = asyncio.create_task(routers.supervise())  # one that exits is started again

    try:
        # A stop signal while it starts (a model loading for minutes, a worker Ray cannot
        # place) ends the start and stops what started: it was heard only once serving.
        starting = asyncio.create_task(start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            starting.cancel()
        outcome = (await asyncio.gather(starting, return_exceptions=True))[0]
        if isinstance(outcome, (asyncio.CancelledError, StartInterrupted)):
            say("stopping before it was ready: a stop signal came while it started")
            return 0
        starting.result()
        assert cluster.server is not None
        say(f"ready: {_try_it(config, cluster.server.port)}   (Ctrl-C drains and stops)")
        if not config.join_workers and config.redis_url is None and config.server.port:
            say(f"another router: {_another_router(config, extra_routers, flags or [])}")
        failure = asyncio.create_task(cluster.wait_for_failure())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait((failure, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        draining = True
        if failure.done():
            failed = failure.result()
            then = "exiting" if cluster.ray_gone else "draining, then exiting"
            say(f"error: {failed.splitlines()[0]}; {then} with code 1")
        say("stopping")
    except START_ERRORS as exc:
        # Said before what started is stopped: the reason is the line a user reads, and
        # "stopped" after it says the exit is clean.
        failed = str(exc)
        say(f"error: {exc}")
    finally:
        if failure is not None:
            failure.cancel()
        if supervising is not None:
            supervising.cancel()
        # A Ray that is gone took the workers with it: nothing is left to drain.
        grace = drain_grace if draining and not cluster.ray_gone else 0.0

        def stop_now() -> None:  # a second Ctrl-C or SIGTERM: the drain ends
            if first_signal_at and time.monotonic() - first_signal_at[0] < SECOND_SIGNAL_AFTER_S:
                # The same Ctrl-C twice: a terminal's reaches every process of the group,
                # and `kvserve up` signals its routers as well.
                return
            say("stopping now: in-flight requests are cancelled")
            if cluster.router is not None:
                cluster.router.end_drain()
            routers.signal_stop()  # and theirs (a terminal's Ctrl-C reaches them too)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_now)
        routers.signal_stop()  # they drain beside this one; the workers and Redis stay until they are done
        await cluster.stop(grace_s=grace, others=routers.wait(grace + 20.0) if routers.started else None)
        say("stopped")
    return 0 if failed is None else 1
