"""`kvserve up` and `kvserve router` refuse a bad flag at once, naming it (argparse: exit 2).

An outside check typed these and got, after Ray and Redis had started, messages in the
names of the configs (`ClusterConfig.num_workers must be >= 1, got 0`), argparse's
`invalid parse_bytes value: '0'`, or nothing at all (`--drain-grace -1` served)."""

from __future__ import annotations

import pytest

from cluster.cli import main


@pytest.mark.parametrize(("args", "said"), [
    (["up", "--workers", "0"], "argument --workers: expected a whole number >= 1, got '0'"),
    (["up", "--port", "99999"], "argument --port: expected a port number in 0-65535, got '99999'"),
    (["up", "--metrics-port", "70000"], "argument --metrics-port: expected a port number in 0-65535 or 'off'"),
    (["up", "--kv-cache-memory", "0"], "argument --kv-cache-memory: byte size must be at least 1 byte, got '0'"),
    (["up", "--worker-kv-cache-memory", "64MiB,abc"], "argument --worker-kv-cache-memory: not a byte size: 'abc'"),
    (["up", "--drain-grace", "-1"], "argument --drain-grace: expected a number of seconds >= 0, got '-1'"),
    (["up", "--worker-cpus", "0"], "argument --worker-cpus: expected a number > 0, got '0'"),
    (["router", "--ray-address", "auto", "--port", "-5"], "argument --port: expected a port number in 0-65535"),
    (["offline", "--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a byte size: 'lots'"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v[:2] if v[0] != "router" else v[3:4]))
def test_a_bad_flag_is_refused_naming_it_before_anything_starts(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and said in err, err


def test_good_flags_parse_to_what_the_cluster_is_given() -> None:
    from cluster.cli import build_parser
    from cluster.up import cluster_config_from_args

    args = build_parser().parse_args(["up", "--worker-kv-cache-memory", "64MiB,128MiB", "--port", "0",
                                      "--metrics-port", "off", "--drain-grace", "0", "--state-dir", "/tmp/unused"])
    config = cluster_config_from_args(args)
    assert (config.num_workers, config.worker_kv_cache_memory) == (2, (64 * 2**20, 128 * 2**20))
    assert (config.server.port, config.metrics_port, args.drain_grace) == (0, None, 0.0)
