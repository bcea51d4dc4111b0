"""The --redis-url an operator types: its password never printed, in whatever form it is
given, and credentials Redis refuses fail a start in one line instead of a cluster that
says "ready" and never serves (an outside check against an operator's own Redis)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from router.state import (
    RequestRecord, RequestStatus, RequestStore, StepWrite, StoreConfig, StoreRefused, StoreUnavailable, mask_url,
)

SECRET = "s3cretQueryPw"


@pytest.mark.parametrize(("url", "masked"), [
    (f"redis://127.0.0.1:6379/0?password={SECRET}", "redis://127.0.0.1:6379/0?password=***"),
    (f"redis://kv@127.0.0.1:6379/0?password={SECRET}", "redis://kv@127.0.0.1:6379/0?password=***"),
    (f"unix:///var/run/redis/redis.sock?db=0&password={SECRET}", "unix:///var/run/redis/redis.sock?db=0&password=***"),
    (f"redis://kv:{SECRET}@[::1]:6379/2", "redis://kv:***@[::1]:6379/2"),
    ("redis://127.0.0.1:6379/0?db=3", "redis://127.0.0.1:6379/0?db=3"),
], ids=["query", "user-and-query", "unix-socket", "user-info", "none"])  # fmt: skip
def test_a_password_is_masked_in_the_user_info_and_in_the_query(url: str, masked: str) -> None:
    """redis-py also takes `?password=` (the usual form for a unix socket); it went into every
    'Redis at ... is unavailable' line as given."""
    assert mask_url(url) == masked


def _refused(config: StoreConfig, call: Callable[[RequestStore], Awaitable[object]]) -> StoreUnavailable:
    """What call(a store on config) raised: it must raise StoreUnavailable (or a subclass)."""

    async def run() -> StoreUnavailable:
        store = RequestStore(config)
        try:
            with pytest.raises(StoreUnavailable) as caught:
                await call(store)
            return caught.value
        finally:
            await store.close()

    return asyncio.run(run())


def test_credentials_redis_refuses_are_told_apart_from_an_outage_and_never_printed(tmp_path: Path) -> None:
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis", password="right-password")) as server:

        def refused(url: str) -> StoreUnavailable:
            return _refused(StoreConfig(url=url, socket_timeout=2.0), RequestStore.active_ids)

        wrong = refused(f"redis://127.0.0.1:{server.port}/0?password={SECRET}")
        missing = refused(f"redis://127.0.0.1:{server.port}/0")
        port = server.port
    down = refused(f"redis://:{SECRET}@127.0.0.1:{port}/0")  # stopped: an outage
    for error in (wrong, missing):
        assert isinstance(error, StoreRefused), error
        assert "refused the credentials in its URL" in str(error) and SECRET not in str(error), error
    assert not isinstance(down, StoreRefused) and SECRET not in str(down), down


def test_kvserve_up_on_a_redis_that_refuses_its_password_fails_in_one_line(tmp_path: Path) -> None:
    """README: a start that fails says why in one line and exits 1. It logged the refusal,
    loaded the model, said "ready", and retried leases and adoptions twice a second with
    health NOT_SERVING until stopped. Before any model loads now."""
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis", password="right-password")) as server:
        done = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "up", "--redis-url", f"redis://:wrong-password@127.0.0.1:{server.port}/0",
             "--model", "tiny", "--port", "0", "--metrics-port", "off", "--state-dir", str(tmp_path / "state")],
            capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_DEDUP_LOGS": "0"},
        )  # fmt: skip
    said = done.stderr
    assert done.returncode == 1, said[-3000:]
    assert f"[kvserve] error: Redis at redis://:***@127.0.0.1:{server.port}/0 refused the credentials in its URL" \
        in said, said[-3000:]
    assert "wrong-password" not in said and "right-password" not in said
    # Which Redis, said: $KVSERVE_REDIS_URL left exported in a shell gives one too.
    assert f"[kvserve] Redis at redis://:***@127.0.0.1:{server.port}/0 (--redis-url or $KVSERVE_REDIS_URL), " \
        "not an embedded one" in said, said[-3000:]
    assert "loading the model" not in said and "ready:" not in said and "Traceback" not in said, said[-3000:]
    assert said.rstrip().endswith("[kvserve] stopped"), said[-3000:]


def test_a_redis_user_with_the_rights_the_readme_names_serves_and_one_without_channels_is_refused_at_start(
    ray_session: None, tmp_path: Path
) -> None:
    """README, Redis: a user needs the keys and the channels of the prefix, and +@all
    -@dangerous. A user without channels (what Redis 7's acl-pubsub-default gives
    `~prefix:*`) logged a broken cancel subscription twice a second for ever, and a Cancel
    through a peer answered INTERNAL with a Lua error (an outside check); it is refused at
    the start now, naming what it lacks. One with the named rights serves, cancels and
    streams from Redis."""
    import dataclasses

    import grpc

    from protos.kvserve.v1 import serving_pb2 as pb
    from tests.cluster_harness import (
        cluster_config, greedy_request, parse_stream, request_info, running_cluster, wait_for,
    )

    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis", password="admin-password")) as server:
        import redis

        config = cluster_config(server.url, tmp_path)
        prefix = config.store_prefix
        with redis.Redis.from_url(server.url) as admin:
            admin.execute_command("ACL", "SETUSER", "narrow", "on", ">narrow-password", f"~{prefix}:*",
                                  "resetchannels", "+@all", "-@dangerous")
            admin.execute_command("ACL", "SETUSER", "noscripts", "on", ">noscripts-password", f"~{prefix}:*",
                                  "resetchannels", f"&{prefix}:*", "+@all", "-@dangerous", "-@scripting")
            admin.execute_command("ACL", "SETUSER", "kvserve", "on", ">kvserve-password", f"~{prefix}:*",
                                  "resetchannels", f"&{prefix}:*", "+@all", "-@dangerous")

        narrow = StoreConfig(url=f"redis://narrow:narrow-password@127.0.0.1:{server.port}/0", prefix=prefix)
        refused = _refused(narrow, RequestStore.check_rights)
        assert isinstance(refused, StoreRefused), refused
        error = str(refused)
        assert "does not let this user do what a router needs" in error and f"&{prefix}:*" in error, error
        noscripts = StoreConfig(url=f"redis://noscripts:noscripts-password@127.0.0.1:{server.port}/0", prefix=prefix)
        refused = _refused(noscripts, RequestStore.check_rights)
        assert isinstance(refused, StoreRefused) and "script" in str(refused).lower(), refused
        url = f"redis://kvserve:kvserve-password@127.0.0.1:{server.port}/0"
        with running_cluster(dataclasses.replace(config, redis_url=url)) as harness:
            stub = harness.stub
            result = parse_stream(stub.Generate(greedy_request([5, 6, 7, 8], 6), timeout=60))
            assert len(result.token_ids) == 6
            streamed = parse_stream(stub.Stream(pb.StreamRequest(request_id=result.started.request_id), timeout=30))
            assert streamed.token_ids == result.token_ids  # from Redis
            submitted = stub.Submit(greedy_request([5, 6, 7, 8], 2000), timeout=10).request_id
            assert stub.Cancel(pb.CancelRequest(request_id=submitted), timeout=10)
            wait_for(lambda: request_info(stub, submitted).status, lambda s: s == pb.REQUEST_STATUS_CANCELLED,
                     timeout=20, what="the cancelled request recorded")
            with pytest.raises(grpc.RpcError):
                stub.Cancel(pb.CancelRequest(request_id="no-such-request"), timeout=10)


CUT = [
    "redis://:2024#Secure@myredis:6379/0",
    "redis://:2024?Secure@myredis:6379/0",
    "redis://:2024/Secure@myredis:6379/0",
    "redis://:2024?Secure=1@myredis:6379/0",
    "redis://:?Secure=1@myredis:6379/0",
]


@pytest.mark.parametrize("url", CUT)
def test_a_password_an_unencoded_character_cut_into_a_port_is_refused_and_never_printed(url: str) -> None:
    """Python reads `:2024` as a port when a '#', '?' or '/' follows it: redis-py took such a
    URL as localhost:2024 with no password, and mask_url printed it whole (a review's find)."""
    from router.state import redis_url_problem

    problem = redis_url_problem(url)
    assert problem is not None and "percent-encode" in problem and "Secure" not in problem
    assert mask_url(url) == "redis://***"
    assert redis_url_problem("redis://:p%40ss%232024@myredis:6379/0") is None  # encoded, it is read as meant
    for fine in ("unix:///run/redis.sock?db=2&password=p@ss", "unix:///run/redis@main/redis.sock?password=x",
                 "redis://my-redis:6379/0?password=p@ss", "rediss://:pw@my-redis:6380/0?ssl_cert_reqs=none"):
        assert redis_url_problem(fine) is None, fine  # an '@' in a socket's path or a query value is fine
        assert mask_url(fine) != "redis://***"


@pytest.mark.parametrize("command", ["up", "router"])
@pytest.mark.parametrize(("url", "said"), [
    ("redis://:ab/cd@wx@127.0.0.1:6379/0", "a special character cuts it where it should not be cut: percent-encode"),
    ("http://127.0.0.1:6379/0", "it is not a Redis URL (redis://, rediss:// or unix://)"),
    ("redis://127.0.0.1:99999/0", "its host and port cannot be read: percent-encode"),
], ids=["unencoded-password", "scheme", "port"])  # fmt: skip
def test_a_redis_url_redis_py_cannot_read_is_refused_as_an_argument_without_quoting_it(
    command: str, url: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A password with an unencoded '/' or '@' is cut into host and port: the start went
    through Ray, then ended with exit 2 and redis-py's `Port could not be cast to integer
    value as 'w'`, a piece of the password (an outside check). It is refused with the
    arguments now, naming the flag and the fix, quoting nothing of the URL."""
    from cluster.cli import main

    extra = ["--ray-address", "auto"] if command == "router" else []
    assert main([command, "--redis-url", url, *extra]) == 2
    err = capsys.readouterr().err
    assert f"kvserve {command}: --redis-url (or $KVSERVE_REDIS_URL): {said}" in err, err
    assert "cd@wx" not in err and "starting Ray" not in err, err



@pytest.mark.parametrize(("lacks", "refused"), [("eval", False), ("script", True), ("evalsha", True)])
def test_check_rights_probes_the_commands_a_router_sends(tmp_path: Path, lacks: str, refused: bool) -> None:
    """A router runs its scripts by SCRIPT LOAD and EVALSHA, never EVAL. The first probe sent
    EVAL: it refused a user without EVAL that serves (create and a step write work), and let
    through one without SCRIPT, whose script calls then failed with NOPERM (a review's find)."""
    prefix = "rights"
    with EmbeddedRedis(RedisServerConfig(state_dir=tmp_path / "redis", password="admin-password")) as server:
        import redis

        with redis.Redis.from_url(server.url) as admin:
            admin.execute_command("ACL", "SETUSER", "kv", "on", ">kv-password", f"~{prefix}:*", "resetchannels",
                                  f"&{prefix}:*", "+@all", "-@dangerous", f"-{lacks}")
        config = StoreConfig(url=f"redis://kv:kv-password@127.0.0.1:{server.port}/0", prefix=prefix)
        if refused:
            assert isinstance(_refused(config, RequestStore.check_rights), StoreRefused)
            return

        async def serves() -> None:
            store = RequestStore(config)
            try:
                await store.check_rights()
                record = RequestRecord("r1", RequestStatus.QUEUED, prompt_ids=[1, 2, 3], sampling={}, created_at=1.0)
                assert await store.create(record) is None
                assert await store.write_step([StepWrite("r1", None, {"status": RequestStatus.RUNNING.value})]) == []
            finally:
                await store.close()

        asyncio.run(serves())
