"""What `kvserve up` tells a user to type next works as typed, and `kvserve router` finds a
local cluster's Redis by itself.

A first-time user following the README found that `kvserve up` printed
`kvserve generate --address 127.0.0.1:50051` (not on PATH in a venv; without the TLS and
token flags the router needed, and at an address its certificate is not for), and that
nothing said where `kvserve router`'s --redis-url comes from: the embedded Redis has a
generated password and a new port at each start.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import build_parser
from cluster.local import ClusterConfig, redis_url_file, write_redis_url
from cluster.routers import REDIS_URL_ENV
from cluster.up import _try_it, router_cluster_config_from_args
from router.server import ServerConfig

URL = "redis://:secret@127.0.0.1:6390/0"


def test_kvserve_router_takes_the_redis_of_the_kvserve_up_in_its_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    router = ["router", "--ray-address", "auto", "--state-dir", str(state_dir)]
    with pytest.raises(ValueError, match=rf"--redis-url: .*no kvserve up on this machine keeps one in {state_dir}"):
        router_cluster_config_from_args(build_parser().parse_args(router))
    write_redis_url(state_dir, URL)
    assert redis_url_file(state_dir).stat().st_mode & 0o777 == 0o600
    assert router_cluster_config_from_args(build_parser().parse_args(router)).redis_url == URL
    write_redis_url(state_dir, URL.replace("6390", "6391"))  # a later start: the file is replaced
    assert router_cluster_config_from_args(build_parser().parse_args(router)).redis_url.endswith(":6391/0")
    # The environment, then the flag, win over the file.
    monkeypatch.setenv(REDIS_URL_ENV, "redis://env:1/0")
    assert router_cluster_config_from_args(build_parser().parse_args(router)).redis_url == "redis://env:1/0"
    flagged = build_parser().parse_args([*router, "--redis-url", "redis://flag:1/0"])
    assert router_cluster_config_from_args(flagged).redis_url == "redis://flag:1/0"


def test_the_ready_line_names_the_flags_this_router_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", [".venv/bin/kvserve", "up"])
    plain = ClusterConfig(state_dir=tmp_path)
    assert _try_it(plain, 50051) == '.venv/bin/kvserve generate --address 127.0.0.1:50051 "Hello"'
    secured = ClusterConfig(state_dir=tmp_path, server=ServerConfig(
        tls_cert_file=tmp_path / "c.pem", tls_key_file=tmp_path / "k.pem", auth_token="t" * 32))
    assert _try_it(secured, 50051) == (
        '.venv/bin/kvserve generate --address localhost:50051 --tls-ca CERT.pem --auth-token-file TOKEN_FILE "Hello"'
    )
    monkeypatch.setattr("sys.argv", ["/usr/lib/python3/cluster/cli.py", "up"])  # python -m cluster.cli
    assert _try_it(plain, 7).startswith("kvserve generate --address 127.0.0.1:7 ")
