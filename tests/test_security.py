"""Abuse and security: the router and the embedded Redis bind localhost; opt-in TLS and a
bearer token guard the API; one client's open streams are capped; oversize messages are
refused by gRPC. One real cluster (TLS + token + stream limit + embedded Redis) serves
every cluster check here."""

from __future__ import annotations

import asyncio
import csv
import contextlib
import dataclasses
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
import redis.exceptions
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.cli import build_parser, main
from cluster.client import TOKEN_ENV, load_auth_token
from cluster.local import ClusterConfig
from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from cluster.routers import router_flags
from cluster.up import cluster_config_from_args, router_cluster_config_from_args, router_only_parser
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc
from router.auth import StreamLimit, peer_host
from router.core import Router, RouterConfig
from router.server import STREAMING_METHODS, PortUnavailable, RouterServer, ServerConfig
from router.state import RequestStore, StoreConfig
from tests.certificates import Certificate, self_signed
from tests.cluster_harness import (
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    expect_error,
    greedy_request,
    parse_stream,
    read_deltas,
    wait_idle,
    wait_until,
)

TOKEN = "s3cret-token-for-the-security-tests"
MAX_STREAMS = 2
MAX_PENDING_TOKENS = 2000  # not the defaults: the running router must have these
MAX_FOLLOWERS = 64
MAX_MESSAGE_BYTES = 64 * 1024


# -- configuration, no cluster ---------------------------------------------------------------


def test_the_router_and_redis_bind_localhost_by_default(tmp_path: Path) -> None:
    assert ServerConfig().host == "127.0.0.1"
    assert ClusterConfig().server.host == "127.0.0.1"
    assert ClusterConfig().redis_url is None and ClusterConfig().redis_password is None  # embedded, generated
    assert RedisServerConfig(state_dir=tmp_path).bind == "127.0.0.1"
    up = cluster_config_from_args(build_parser().parse_args(["up"]))
    assert up.server.host == "127.0.0.1" and up.server.auth_token is None and not up.server.tls


def test_server_config_refuses_half_tls_weak_tokens_and_bad_limits(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ServerConfig.tls_key_file"):
        ServerConfig(tls_cert_file=tmp_path / "cert.pem")
    with pytest.raises(ValueError, match="ServerConfig.tls_cert_file"):
        ServerConfig(tls_key_file=tmp_path / "key.pem")
    for weak in ("short", "has a space in it, sadly", "non-ascii-token-é-here"):
        with pytest.raises(ValueError, match="ServerConfig.auth_token") as error:
            ServerConfig(auth_token=weak)
        assert weak not in str(error.value)  # a secret is never echoed
    with pytest.raises(ValueError, match="ServerConfig.max_streams_per_client"):
        ServerConfig(max_streams_per_client=0)
    with pytest.raises(ValueError, match="ServerConfig.max_pending_tokens"):
        ServerConfig(max_pending_tokens=0)
    with pytest.raises(ValueError, match="ServerConfig.stream_interval"):
        ServerConfig(stream_interval=0)
    assert TOKEN not in repr(ServerConfig(auth_token=TOKEN))


def test_up_flags_reach_the_server_and_router_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, certificate: Certificate
) -> None:
    token_file, cert, key = tmp_path / "token", tmp_path / "c.pem", tmp_path / "k.pem"
    token_file.write_text(f"{TOKEN}\n")
    cert.write_bytes(certificate.cert.read_bytes())
    args = build_parser().parse_args(
        [
            "up", "--host", "0.0.0.0", "--tls-cert", str(cert), "--tls-key", str(key),
            "--auth-token-file", str(token_file), "--max-streams-per-client", "3",
            "--max-message-bytes", "1MiB", "--max-prompt-tokens", "512", "--max-tokens-limit", "64",
            "--max-pending-tokens", "96", "--max-followers", "7", "--stream-interval", "4",
        ]
    )  # fmt: skip
    with pytest.raises(ValueError, match="--tls-key: no file at"):
        cluster_config_from_args(args)
    key.write_bytes(certificate.key.read_bytes())
    monkeypatch.setenv(TOKEN_ENV, "the-environment-token-loses")
    config = cluster_config_from_args(args)
    assert config.server.auth_token == TOKEN  # the file wins over the environment
    assert config.server.tls_cert_file == cert and config.server.tls_key_file == key
    assert config.server.max_streams_per_client == 3 and config.server.max_message_bytes == 2**20
    assert config.router.max_prompt_tokens == 512 and config.router.max_tokens_limit == 64
    assert config.server.max_pending_tokens == 96 and config.max_followers == 7
    assert config.server.stream_interval == 4
    assert config.store_config("redis://127.0.0.1:6390/0").max_followers == 7
    with pytest.raises(ValueError, match="ClusterConfig.max_followers"):
        dataclasses.replace(config, max_followers=0)
    defaults = cluster_config_from_args(build_parser().parse_args(["up"]))
    assert (defaults.server.max_pending_tokens, defaults.max_followers, defaults.server.stream_interval) == (4096, 256, 1)
    # The environment is read when the command runs, not when the module was imported.
    monkeypatch.setenv(TOKEN_ENV, "token-from-the-environment")
    assert cluster_config_from_args(build_parser().parse_args(["up"])).server.auth_token == "token-from-the-environment"
    monkeypatch.delenv(TOKEN_ENV)
    assert load_auth_token(None) is None
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="--auth-token-file"):
        load_auth_token(token_file)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--max-streams-per-client", "0"])


@pytest.mark.parametrize(("flag", "field", "default", "up_value", "router_value", "bad", "said", "config"), [
    ("--redis-timeout", "socket_timeout", 2.0, "7.5", "9", ("0", "-1", "soon", "inf"),
     "expected a number of seconds > 0", ("redis_timeout_s", "must be positive")),
    ("--request-ttl", "ttl_seconds", 3600, "600", "86400", ("0", "-1", "1.5", "soon"),
     "expected a whole number >= 1", ("request_ttl_s", "must be >= 1")),
], ids=["redis-timeout", "request-ttl"])  # fmt: skip
def test_a_store_flag_reaches_the_store_of_up_its_routers_and_a_joining_router(
    capsys: pytest.CaptureFixture[str], flag: str, field: str, default: float, up_value: str, router_value: str,
    bad: tuple[str, ...], said: str, config: tuple[str, str],
) -> None:
    """--redis-timeout: how long a Redis command may take before the router takes Redis for
    unavailable (the store's socket timeout). --request-ttl: how long an ended request
    stays in Redis (fixed at an hour before: an operator could not change it without code,
    an outside check noted)."""
    parser = build_parser()
    url = "redis://127.0.0.1:6390/0"
    assert getattr(cluster_config_from_args(parser.parse_args(["up"])).store_config(url), field) == default
    up_args = parser.parse_args(["up", flag, up_value, "--routers", "2"])
    assert getattr(cluster_config_from_args(up_args).store_config(url), field) == float(up_value)
    # The routers `kvserve up --routers 2` starts get it too.
    flags = router_flags(router_only_parser(), up_args)
    assert flags[flags.index(flag) + 1] == up_value
    joining = parser.parse_args(["router", "--ray-address", "auto", "--redis-url", url, flag, router_value])
    assert getattr(router_cluster_config_from_args(joining).store_config(url), field) == float(router_value)
    for value in bad:
        with pytest.raises(SystemExit):
            parser.parse_args(["up", flag, value])
        assert f"{flag}: {said}" in capsys.readouterr().err
    name, refusal = config
    with pytest.raises(ValueError, match=f"ClusterConfig.{name} {refusal}"):
        ClusterConfig(**{name: 0})


def test_peer_hosts() -> None:
    assert peer_host("ipv4:10.0.0.7:5312") == "10.0.0.7"
    assert peer_host("ipv6:[::1]:5312") == "::1"
    assert peer_host("unix:/tmp/router.sock") == "unix:/tmp/router.sock"


class _Hold(pb_grpc.KVServeServicer):
    """A KVServe whose Generate sends `started` and then holds the stream open until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(started=pb.Started(request_id=request.request_id))
        await self.release.wait()
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH))

    async def Submit(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.SubmitResponse:
        return pb.SubmitResponse(request_id=request.request_id, created=True)


def test_without_auth_the_stream_limit_counts_per_peer_host() -> None:
    """The limit's bookkeeping over real gRPC: a slot per open stream, freed when the stream
    ends or the client cancels; unary calls are never counted."""

    async def scenario() -> None:
        limit = StreamLimit(2, STREAMING_METHODS, by_token=False)
        servicer = _Hold()
        server = grpc.aio.server(interceptors=[limit])
        pb_grpc.add_KVServeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.KVServeStub(channel)
                calls = [stub.Generate(pb.GenerateRequest(request_id=f"r{i}")) for i in range(2)]
                for call in calls:
                    assert (await call.read()).WhichOneof("event") == "started"
                assert limit.open_streams("127.0.0.1") == 2
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(pb.GenerateRequest(request_id="r2")).read()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_streams_per_client" in (refused.value.details() or "")
                assert "127.0.0.1" in (refused.value.details() or "")
                assert (await stub.Submit(pb.GenerateRequest(request_id="unary"))).created
                calls[0].cancel()  # a client that leaves frees its slot ...
                await _until(lambda: limit.open_streams("127.0.0.1") == 1)
                servicer.release.set()  # ... and so does a stream that ends
                assert (await calls[1].read()).WhichOneof("event") == "finished"
                assert await calls[1].read() is grpc.aio.EOF
                await _until(lambda: limit.open_streams("127.0.0.1") == 0)
                again = stub.Generate(pb.GenerateRequest(request_id="r3"))
                assert [m.WhichOneof("event") async for m in again] == ["started", "finished"]
        finally:
            await server.stop(0)

    asyncio.run(scenario())


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "waited too long"
        await asyncio.sleep(0.01)


# -- one secured cluster -----------------------------------------------------------------------


def test_a_certificate_and_key_grpc_cannot_use_are_named_before_anything_starts(
    tmp_path: Path, certificate: Certificate, store_config: StoreConfig
) -> None:
    """gRPC refuses a bad pair only as it binds, with the error a taken port gets: `kvserve
    up` said "the port is taken (another kvserve up or kvserve router?)" for a garbage
    certificate, swapped --tls-cert/--tls-key, or another certificate's key, even on port 0
    (found by review). The flags are checked first now, and the server names them too."""
    other = self_signed(tmp_path)  # another pair: its key is not `certificate`'s
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot a cert\n-----END CERTIFICATE-----\n")
    cases = {
        "garbage": (garbage, certificate.key, "not a PEM certificate chain"),
        "swapped": (certificate.key, certificate.cert, "not a PEM certificate chain"),
        "another's key": (certificate.cert, other.key, "the key is not the certificate's"),
    }
    for cert, key, why in cases.values():
        args = build_parser().parse_args(["up", "--tls-cert", str(cert), "--tls-key", str(key)])
        with pytest.raises(ValueError, match=f"--tls-cert {cert} / --tls-key {key}: {why}"):
            cluster_config_from_args(args)

    async def start(cert: Path, key: Path) -> str:
        store = RequestStore(store_config)
        server = RouterServer(Router(RouterConfig(), store), ServerConfig(port=0, tls_cert_file=cert, tls_key_file=key))
        try:
            await server.start()
            await server.stop(0)
            return "started"
        except (ValueError, PortUnavailable) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            await store.close()

    assert asyncio.run(start(garbage, certificate.key)).startswith("ValueError: --tls-cert")
    assert asyncio.run(start(certificate.cert, certificate.key)) == "started"


def tls_channel(address: str, root_pem: bytes | None, token: str | None) -> grpc.Channel:
    """TLS trusting `root_pem` (None: the system's roots), sending `token` on every call."""
    credentials = grpc.ssl_channel_credentials(root_certificates=root_pem)
    if token is not None:
        credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(address, credentials)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, certificate: Certificate, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    """One worker, TLS, the token, two streams per client, 64 KiB messages, and its own
    embedded Redis (redis_url None: what `kvserve up` starts)."""
    base = cluster_config(redis_server.url, tmp_path_factory.mktemp("secure"), (16 * 2**20,))
    server = ServerConfig(
        port=0,
        tls_cert_file=certificate.cert,
        tls_key_file=certificate.key,
        auth_token=TOKEN,
        max_streams_per_client=MAX_STREAMS,
        max_message_bytes=MAX_MESSAGE_BYTES,
        max_pending_tokens=MAX_PENDING_TOKENS,
    )
    harness = ClusterHarness(
        dataclasses.replace(base, redis_url=None, server=server, max_followers=MAX_FOLLOWERS),
        open_channel=lambda address: tls_channel(address, certificate.pem, TOKEN),
    )
    try:
        yield harness
    finally:
        harness.stop()


def test_calls_without_the_right_token_are_unauthenticated(
    cluster: ClusterHarness, certificate: Certificate, reference_engine: ReferenceEngine
) -> None:
    address = cluster.cluster.address
    request = greedy_request([1, 2, 3], 4)
    for token, words in ((None, ("authorization", "missing")), ("not-the-token", ("authorization", "not valid"))):
        with tls_channel(address, certificate.pem, token) as channel:
            stub = pb_grpc.KVServeStub(channel)
            for rpc in (
                lambda: list(stub.Generate(request, timeout=10)),
                lambda: stub.Submit(request, timeout=10),
                lambda: list(stub.Stream(pb.StreamRequest(request_id="any"), timeout=10)),
                lambda: stub.Cancel(pb.CancelRequest(request_id="any"), timeout=10),
                lambda: stub.GetRequest(pb.GetRequestRequest(request_id="any"), timeout=10),
                lambda: stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10),
            ):
                expect_error(rpc, grpc.StatusCode.UNAUTHENTICATED, *words)
            # Reflection needs the token too; health checks stay open for probes.
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            list_services = reflection_pb2.ServerReflectionRequest(list_services="")
            expect_error(
                lambda: list(reflection.ServerReflectionInfo(iter([list_services]), timeout=10)),
                grpc.StatusCode.UNAUTHENTICATED,
            )
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    # Another scheme, or the token without its scheme, is no bearer token.
    with tls_channel(address, certificate.pem, None) as channel:
        stub = pb_grpc.KVServeStub(channel)
        for value in (f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"):
            expect_error(
                lambda: stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=(("authorization", value),)),
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization",
            )
        # The scheme is case-insensitive, as in HTTP.
        lower_case = (("authorization", f"bearer {TOKEN}"),)
        assert stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=lower_case).alive_workers == 1
    # With the token: served, and the output is the reference engine's.
    result = parse_stream(cluster.stub.Generate(greedy_request([5, 6, 7, 8], 6), timeout=60))
    assert result.token_ids == list(reference_engine.greedy([([5, 6, 7, 8], 6)])[0].output_ids)
    wait_idle(cluster.stub)


def test_tls_only_with_a_trusted_certificate(cluster: ClusterHarness, certificate: Certificate) -> None:
    address = cluster.cluster.address
    with grpc.insecure_channel(address) as plaintext:
        expect_error(
            lambda: pb_grpc.KVServeStub(plaintext).ClusterStatus(pb.ClusterStatusRequest(), timeout=5),
            grpc.StatusCode.UNAVAILABLE,
        )
    with tls_channel(address, None, TOKEN) as untrusted:  # the system's roots do not vouch for it
        expect_error(
            lambda: pb_grpc.KVServeStub(untrusted).ClusterStatus(pb.ClusterStatusRequest(), timeout=5),
            grpc.StatusCode.UNAVAILABLE,
        )
    with tls_channel(address, certificate.pem, TOKEN) as trusted:
        assert pb_grpc.KVServeStub(trusted).ClusterStatus(pb.ClusterStatusRequest(), timeout=5).alive_workers == 1


def test_the_cli_client_speaks_tls_with_the_token(
    cluster: ClusterHarness,
    certificate: Certificate,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, ca = cluster.cluster.address, str(certificate.cert)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert main(["status", "--address", address, "--tls-ca", ca, "--auth-token-file", str(token_file)]) == 0
    assert "1 alive" in capsys.readouterr().out
    assert main(["status", "--address", address, "--tls-ca", ca]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    code = main(["generate", "Hi", "--address", address, "--tls-ca", ca, "--max-tokens", "3", "--temperature", "0"])
    out, err = capsys.readouterr()
    # The text on stdout, ending its line there (a file or pipe gets a whole line); what
    # the request was and how it ended on stderr, each on a line of its own.
    assert code == 0 and out.endswith("\n"), (out, err)
    assert err.startswith("[") and err.endswith("\n[finish_reason=length, 3 tokens]\n"), err
    wait_idle(cluster.stub)


def test_one_client_holds_at_most_max_streams_per_client(cluster: ClusterHarness) -> None:
    """Generate and Stream each hold a slot while open; the next is RESOURCE_EXHAUSTED naming
    the limit; unary calls are not counted; a slot is free again once its stream ends."""
    stub = cluster.stub
    running = stub.Submit(greedy_request([9] * 8, 900), timeout=10)
    generate = stub.Generate(greedy_request([3] * 8, 900), timeout=120)
    read_deltas(generate, 1)
    stream = stub.Stream(pb.StreamRequest(request_id=running.request_id), timeout=120)
    assert next(stream).WhichOneof("event") == "started"
    for rpc in (
        lambda: list(stub.Generate(greedy_request([1], 2), timeout=10)),
        lambda: list(stub.Stream(pb.StreamRequest(request_id=running.request_id), timeout=10)),
    ):
        expect_error(rpc, grpc.StatusCode.RESOURCE_EXHAUSTED, "max_streams_per_client", f"limit is {MAX_STREAMS}")
    assert stub.GetRequest(pb.GetRequestRequest(request_id=running.request_id), timeout=10).request_id
    generate.cancel()  # frees its slot (and its request's KV) ...

    def one_more_is_served() -> bool:
        try:
            return parse_stream(stub.Generate(greedy_request([1], 2), timeout=30)).finished.usage.completion_tokens == 2
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            return False

    wait_until(one_more_is_served, timeout=10, what="a slot freed by the cancelled Generate")
    stub.Cancel(pb.CancelRequest(request_id=running.request_id), timeout=10)  # ... and the Stream ends with its request
    assert list(stream)[-1].finished.finish_reason == pb.FINISH_REASON_CANCELLED
    wait_until(one_more_is_served, timeout=10, what="both slots free")
    wait_idle(cluster.stub)


def test_the_configured_bounds_are_the_running_routers(cluster: ClusterHarness) -> None:
    running = cluster.cluster
    assert running.server is not None and running.store is not None
    assert running.server.service.max_pending_tokens == MAX_PENDING_TOKENS
    assert running.store.config.max_followers == MAX_FOLLOWERS


def test_an_oversize_message_is_refused_by_grpc(cluster: ClusterHarness) -> None:
    huge = pb.GenerateRequest(text="a" * MAX_MESSAGE_BYTES, sampling=pb.SamplingParams(max_tokens=1))
    for rpc in (lambda: list(cluster.stub.Generate(huge, timeout=10)), lambda: cluster.stub.Submit(huge, timeout=10)):
        expect_error(rpc, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    result = parse_stream(cluster.stub.Generate(greedy_request([1, 2], 2), timeout=30))
    assert result.finished.usage.completion_tokens == 2
    wait_idle(cluster.stub)


def test_the_embedded_redis_binds_localhost_and_needs_its_generated_password(cluster: ClusterHarness) -> None:
    embedded = cluster.cluster.redis
    assert embedded is not None and embedded.running
    config = embedded.config
    assert config.bind == "127.0.0.1"
    assert config.password is not None and len(config.password) == 32 and int(config.password, 16) >= 0
    conf = config.state_dir / "redis.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # it holds requirepass
    assert "bind 127.0.0.1\n" in conf.read_text()
    for password in (None, "not-the-password"):
        with redis.Redis(host="127.0.0.1", port=embedded.port, password=password, socket_timeout=5) as client:
            with pytest.raises(redis.exceptions.AuthenticationError):
                client.ping()
    with redis.Redis(host="127.0.0.1", port=embedded.port, password=config.password, socket_timeout=5) as client:
        assert client.ping()


def test_nothing_listens_beyond_loopback(cluster: ClusterHarness) -> None:
    """From this machine's own non-loopback address, neither the router nor Redis answers."""
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    assert cluster.cluster.server is not None and cluster.cluster.redis is not None
    for port in (cluster.cluster.server.port, cluster.cluster.redis.port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(2)
            with pytest.raises(ConnectionRefusedError):
                probe.connect((address, port))


def _non_loopback_address() -> str | None:
    """The address this host would send from (a UDP connect sends nothing)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as udp:
        try:
            udp.connect(("203.0.113.1", 9))  # TEST-NET-3: routed by the default route, never reached
        except OSError:
            return None
        address: str = udp.getsockname()[0]
    return None if address.startswith("127.") else address



def test_locust_drives_a_secured_router(cluster: ClusterHarness, certificate: Certificate, tmp_path: Path) -> None:
    """The load test speaks TLS and sends the token; without the token every request fails."""
    from tests.test_locust_smoke import run_locust

    def locust(env: dict[str, str], name: str) -> dict[str, str]:
        rows = run_locust(
            cluster.cluster.address, tmp_path / name, "-u", str(MAX_STREAMS), "-r", "10", "-t", "3s",
            "--max-tokens-scale", "0.25", "--tls-ca", str(certificate.cert), env=env, expect_success=False,
        )  # fmt: skip
        return rows["E2E"]

    with_token = locust({"KVSERVE_AUTH_TOKEN": TOKEN}, "ok")
    assert int(with_token["Request Count"]) > 0 and int(with_token["Failure Count"]) == 0, with_token
    without = locust({}, "refused")
    assert int(without["Failure Count"]) == int(without["Request Count"]) > 0, without
    with open(tmp_path / "refused_failures.csv", newline="") as f:
        errors = {row["Error"] for row in csv.DictReader(f)}
    assert errors and all(error.startswith("UNAUTHENTICATED") for error in errors), errors
    wait_idle(cluster.stub)


def test_kvserve_up_takes_an_external_redis_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvserve router` read $KVSERVE_REDIS_URL (a password kept out of `ps`); `kvserve up
    --redis-url` took the URL on its command line only (an outside security check). The
    flag wins over the environment."""
    from cluster.routers import REDIS_URL_ENV

    monkeypatch.setenv(REDIS_URL_ENV, "redis://:secret@127.0.0.1:6390/0")
    assert cluster_config_from_args(build_parser().parse_args(["up"])).redis_url == "redis://:secret@127.0.0.1:6390/0"
    given = build_parser().parse_args(["up", "--redis-url", "redis://127.0.0.1:6391/0"])
    assert cluster_config_from_args(given).redis_url == "redis://127.0.0.1:6391/0"
    monkeypatch.delenv(REDIS_URL_ENV)
    assert cluster_config_from_args(build_parser().parse_args(["up"])).redis_url is None


@pytest.mark.parametrize("token", [False, True], ids=["no-token", "token-without-tls"])
def test_kvserve_up_off_localhost_warns_of_what_is_missing(
    redis_server: EmbeddedRedis, tmp_path: Path, token: bool
) -> None:
    """Off localhost without a token anyone may call it; with a token but no TLS the token
    crosses the network in the clear (the README says to use both; only the first was said).
    The start then fails on a held port, before Ray: the warning comes first."""
    import os
    import sys

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        done = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "up", "--redis-url", redis_server.url, "--model", "tiny",
             "--host", "0.0.0.0", "--port", str(held.getsockname()[1]), "--metrics-port", "off",
             "--state-dir", str(tmp_path / "state"), *(["--auth-token-file", str(token_file)] if token else [])],
            capture_output=True, text=True, timeout=120,
            env={k: v for k, v in os.environ.items() if k != TOKEN_ENV},
        )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    warning = ("[kvserve] warning: serving on 0.0.0.0 with a token but without --tls-cert: the token crosses the "
               "network in the clear") if token else \
        "[kvserve] warning: serving on 0.0.0.0 without --auth-token-file: anyone who reaches it can use it"
    assert warning in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("warning: serving on") == 1, done.stderr[-2000:]


def test_a_router_without_the_token_does_not_join_routers_that_require_one(cluster: ClusterHarness) -> None:
    """A `kvserve router` started without the token flags beside routers that require a
    token served the same workers to anyone (an outside security check's note). Routers
    say in Redis whether they require one; a router without a token refuses to start beside
    a live one that does, naming it, before it joins a worker."""
    import os
    import sys

    import ray

    running = cluster.cluster
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env["KVSERVE_REDIS_URL"] = running.redis_url
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "router", "--ray-address", ray.get_runtime_context().gcs_address,
         "--store-prefix", running.config.store_prefix, "--port", "0", "--metrics-port", "off"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    said = done.stderr
    assert done.returncode == 1, said[-3000:]
    assert f"[kvserve] error: the cluster's router(s) {running.router.router_id} at {running.address} require a " \
           "bearer token, and this one has none" in said, said[-3000:]
    assert "running worker(s)" not in said and "Traceback" not in said, said[-3000:]
