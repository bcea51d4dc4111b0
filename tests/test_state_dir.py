"""`--state-dir` relative or absolute, from any working directory, and its default."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from cluster.cli import build_parser
from cluster.local import default_state_dir
from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from cluster.up import cluster_config_from_args


def test_a_relative_state_dir_is_taken_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug a fresh clone hit: redis-server ran in state/redis and was given the config as
    state/redis/redis.conf, which it looked for at state/redis/state/redis/redis.conf."""
    monkeypatch.chdir(tmp_path)
    server = EmbeddedRedis(RedisServerConfig(state_dir=Path("state/redis"), password="relative-dir-test"))
    assert server.config.state_dir == tmp_path / "state" / "redis"
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert Path(client.config_get("dir")["dir"]) == (tmp_path / "state" / "redis").resolve()
        client.close()
        monkeypatch.chdir("/")  # a restart from elsewhere finds the same directory and data
        server.restart()
        client = redis.Redis.from_url(server.url)
        assert client.get("k") == b"v"
        client.close()
    finally:
        server.stop()
    assert (tmp_path / "state" / "redis" / "redis.conf").is_file()


def test_the_default_state_dir_is_the_users_state_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "kvserve"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")  # the spec says: absolute paths only
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "kvserve"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "kvserve"


def test_up_resolves_its_state_dir_when_it_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    default = cluster_config_from_args(build_parser().parse_args(["up", "--model", "tiny"]))
    assert default.state_dir == tmp_path / "xdg" / "kvserve"
    relative = cluster_config_from_args(build_parser().parse_args(["up", "--model", "tiny", "--state-dir", "here"]))
    assert relative.state_dir == tmp_path / "here"


def test_only_rays_own_processes_are_recorded_as_the_clusters() -> None:
    """A killed `kvserve up`'s Ray processes are stopped by the next start; a process of the
    program that started the cluster (a benchmark's client, say) is not Ray's to stop."""
    import subprocess

    from cluster.local import _is_ray_process

    client = subprocess.Popen(["sleep", "30"])
    try:
        assert not _is_ray_process(client.pid)
    finally:
        client.kill()
        client.wait()
    ray_like = subprocess.Popen(["bash", "-c", "exec -a ray::DashboardAgent sleep 30"])
    try:
        import time

        time.sleep(0.2)  # the exec
        assert _is_ray_process(ray_like.pid)
    finally:
        ray_like.kill()
        ray_like.wait()


def test_what_the_state_dir_holds_is_its_owners_alone(tmp_path: Path) -> None:
    """The embedded Redis's data holds every prompt, output and tenant cache_salt: its
    directory is 0700 and what redis-server writes there is 0600 (the AOF was 0644 in 0755
    directories, readable by any local user: an outside security check), also where an
    older kvserve left them open. A state dir kvserve creates is 0700; the files it writes
    there (ray-address, the process record) 0600."""
    import stat
    import time

    from cluster.local import write_redis_url
    from cluster.state_dir import LeftoverRecord, StateDirLock

    state_dir = tmp_path / "state"
    # What an older kvserve left: its redis dir 0755 (here a symlink to a bigger disk, say),
    # its AOF 0644, and Redis 7's appendonlydir with its files 0644 (a second review's finds).
    elsewhere = tmp_path / "bigger-disk" / "redis"
    elsewhere.mkdir(parents=True, mode=0o755)
    state_dir.mkdir()
    (state_dir / "redis").symlink_to(elsewhere)
    (elsewhere / "appendonly.aof").write_text("")
    (elsewhere / "appendonlydir").mkdir(mode=0o755)
    for name in ("appendonly.aof", "appendonlydir/appendonly.aof.1.base.rdb"):
        (elsewhere / name).write_text("")
        (elsewhere / name).chmod(0o644)
    lock = StateDirLock(state_dir)
    lock.acquire()
    try:
        salt = "tenant-a-secret-salt"
        with EmbeddedRedis(RedisServerConfig(state_dir=state_dir / "redis")) as server, \
                redis.Redis.from_url(server.url) as client:
            client.hset("kvserve:req:r1", mapping={"cache_salt": salt, "prompt": "a secret prompt"})
            time.sleep(1.5)  # appendfsync everysec
            write_redis_url(state_dir, server.url)
            LeftoverRecord(state_dir).write([])
            written = [p for p in (*state_dir.rglob("*"), *elsewhere.rglob("*")) if p.is_file()]
            assert any(salt.encode() in p.read_bytes() for p in written), "the salt is in the AOF"
            modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
        assert all(not int(mode, 8) & 0o077 for mode in modes.values()), str(modes)
        for directory in (elsewhere, elsewhere / "appendonlydir"):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    finally:
        lock.release()
    # A state dir kvserve makes is 0700 (one that exists, as above, keeps its mode: it may be
    # the user's; what kvserve keeps in it is private either way).
    fresh = StateDirLock(tmp_path / "fresh" / "state")
    fresh.acquire()
    try:
        assert stat.S_IMODE((tmp_path / "fresh" / "state").stat().st_mode) == 0o700
    finally:
        fresh.release()
