"""The Locust load test against a real cluster, run headless the way users run it.

Two CPU workers, the session's redis-server, gRPC on loopback, and Locust as a
subprocess. Each run's CSV must show TTFT, ITL and E2E with no failures, and the E2E
count must equal the requests the router recorded as finished in Redis.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cluster.local import ClusterConfig
from cluster.redis_server import EmbeddedRedis
from router.core import RouterConfig
from router.server import ServerConfig
from tests.cluster_harness import TEST_REDIS_TIMEOUT_S, ClusterHarness
from workers.config import EngineArgs

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


class SmokeCluster:
    def __init__(self, harness: ClusterHarness, redis_url: str, prefix: str) -> None:
        self.harness = harness
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.prefix = prefix

    def num_finished(self) -> int:
        """Requests whose hash in Redis says FINISHED (ran to max_tokens)."""
        keys = list(self.redis.scan_iter(match=f"{self.prefix}:req:*", count=1000))
        return sum(1 for key in keys if self.redis.hget(key, "status") == "FINISHED")


@pytest.fixture(scope="module")
def cluster(ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmokeCluster]:
    prefix = f"locust-{uuid.uuid4().hex[:12]}"
    config = ClusterConfig(
        engine=EngineArgs(model="tiny", kv_cache_memory=16 * 2**20, num_threads=1),
        num_workers=2,
        worker_cpus=1,
        state_dir=tmp_path_factory.mktemp("locust-cluster"),
        server=ServerConfig(port=0),
        # On a busy shared machine a step of several 512-token prefills can keep a worker
        # silent for seconds; this test is about the load tester, not about liveness.
        router=RouterConfig(worker_timeout_s=30.0),
        report_interval_s=0.05,
        redis_url=redis_server.url,
        store_prefix=prefix,
        metrics_port=None,  # not 9400, the README's: another pytest-xdist process may be running its commands
        redis_timeout_s=TEST_REDIS_TIMEOUT_S,
    )
    harness = ClusterHarness(config)
    smoke = SmokeCluster(harness, redis_url=redis_server.url, prefix=prefix)
    try:
        yield smoke
    finally:
        smoke.redis.close()
        harness.stop()


def run_locust(
    address: str, csv_prefix: Path, *args: str, env: dict[str, str] | None = None, expect_success: bool = True
) -> dict[str, dict[str, str]]:
    """Run the locustfile headless against a router; return run_stats.csv's rows by name.
    Locust exits 1 when a request failed: expect_success=False allows that."""
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE),
        "--host", address,
        "--headless", "--only-summary", "--csv", str(csv_prefix),
        "--stop-timeout", "15",  # let running requests finish, so every one is counted
        *args,
    ]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")} | (env or {})
    result = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=150)
    assert result.returncode in ((0,) if expect_success else (0, 1)), (
        f"locust exited {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    )
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def check_run(rows: dict[str, dict[str, str]], num_finished: int) -> None:
    assert int(rows["Aggregated"]["Failure Count"]) == 0, rows["Aggregated"]
    assert int(rows["Aggregated"]["Request Count"]) > 0
    for name in ("TTFT", "ITL", "E2E"):
        assert rows[name]["Type"] == "grpc"
        assert int(rows[name]["Request Count"]) > 0, name
        assert int(rows[name]["Failure Count"]) == 0, name
    # Every request that got a first token ran to its end, and the router agrees.
    assert int(rows["E2E"]["Request Count"]) == int(rows["TTFT"]["Request Count"]) == num_finished
    assert float(rows["E2E"]["Average Content Size"]) >= 1.0  # output tokens per request


def test_closed_loop_users(cluster: SmokeCluster, tmp_path: Path) -> None:
    before = cluster.num_finished()
    rows = run_locust(cluster.harness.cluster.address, tmp_path / "run", "-u", "2", "-r", "2", "-t", "8s", "--max-tokens-scale", "0.5")
    check_run(rows, cluster.num_finished() - before)


def test_open_loop_poisson_arrivals_chosen_by_environment(cluster: SmokeCluster, tmp_path: Path) -> None:
    before = cluster.num_finished()
    rows = run_locust(
        cluster.harness.cluster.address, tmp_path / "run", "--arrival-rate", "4", "-u", "2", "-r", "2", "-t", "4s", "--max-tokens-scale", "0.5",
        env={"KVSERVE_SHAPE": "poisson", "KVSERVE_WORKLOAD": "shared-prefix"},
    )  # fmt: skip
    check_run(rows, cluster.num_finished() - before)


@pytest.mark.parametrize("shape", [
    ("--load-shape", "poisson", "--arrival-rate", "2", "-t", "4s"),
    ("--load-shape", "step", "--arrival-rate", "1", "--step-rate", "1", "--step-time", "2", "--step-count", "2"),
], ids=["poisson", "step"])  # fmt: skip
def test_processes_let_open_loop_requests_running_at_the_end_finish(cluster: SmokeCluster, tmp_path: Path,
                                                                      shape: tuple[str, ...]) -> None:
    """--processes 2 and -s: the open-loop requests still running when the schedule ends
    finish and are counted. Each process reported 0 users while its users' requests ran,
    and the master quit then, cancelling them: TTFT 6, E2E 2 in an outside check. The
    outputs here (320-960 tokens, seconds on two tiny workers of 128 blocks) outlast the
    schedule."""
    before = cluster.num_finished()
    port = str(_free_port())  # not Locust's 5557: another suite on this machine may hold it
    rows = run_locust(cluster.harness.cluster.address, tmp_path / "run", "--processes", "2", "-u", "2", "-r", "2",
                      "--master-bind-port", port, "--master-port", port,
                      "--max-tokens-scale", "20", "--stop-timeout", "60", *shape)
    counted, started = int(rows["E2E"]["Request Count"]), int(rows["TTFT"]["Request Count"])
    assert counted == started == cluster.num_finished() - before, \
        f"TTFT {started}, E2E {counted}, FINISHED in Redis {cluster.num_finished() - before}"


# -- what an outside check found: bad values refused at start, and the web UI's form ------------

NO_ROUTER = "127.0.0.1:1"  # nothing listens: a bad value must be refused before any call


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _headless(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
               "--host", NO_ROUTER, "-t", "3s", *args]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    return subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("args", "said"), [
    (("--tls-ca", "missing.pem"), "--tls-ca: cannot read missing.pem"),
    (("--auth-token-file", "missing-token"), "--auth-token-file: cannot read missing-token"),
    (("-u", "0"), "num_users must be >= 1, got 0"),  # it ran one user
    (("--request-timeout", "0"), "--request-timeout must be a number of seconds > 0, got 0"),
    (("--request-timeout", "-1"), "--request-timeout must be a number of seconds > 0, got -1"),
], ids=["tls-ca", "auth-token-file", "zero-users", "zero-timeout", "negative-timeout"])  # fmt: skip
def test_a_bad_value_is_refused_at_start_naming_it(args: tuple[str, ...], said: str) -> None:
    """Before: a missing --tls-ca or token file killed each user in on_start with a traceback
    and the test ran its -t with no request; -u 0 ran one user; --request-timeout 0 or -1
    failed every request with DEADLINE_EXCEEDED."""
    result = _headless(*args)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and said in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


class WebUI:
    """The locustfile's web UI on a free port, driven over HTTP as its page drives it."""

    def __init__(self, host: str, base_path: str = "", *extra: str, web_host: str | None = "127.0.0.1") -> None:
        self.port = _free_port()
        self.base = base_path
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVSERVE_", "LOCUST_"))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", host,
             *(["--web-host", web_host] if web_host else []), "--web-port", str(self.port),
             *(["--web-base-path", base_path] if base_path else []), *extra],
            cwd=REPO, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                self.stats()
                return
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, "the web UI did not come up"
                time.sleep(0.2)

    def swarm(self, **fields: object) -> dict[str, object]:
        data = urllib.parse.urlencode({"user_count": 2, "spawn_rate": 2} | fields).encode()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.base}/swarm", data=data, timeout=10) as reply:
            answer: dict[str, object] = json.loads(reply.read())
        return answer

    def stats(self) -> dict[str, object]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.base}/stats/requests", timeout=10) as reply:
            stats: dict[str, object] = json.loads(reply.read())
        return stats

    def e2e(self) -> int:
        return next((int(s["num_requests"]) for s in self.stats()["stats"] if s["name"] == "E2E"), 0)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_the_web_ui_runs_a_second_burst(cluster: SmokeCluster) -> None:
    """KVServeShape reads its schedule at the start of every test. A second burst from the
    web UI ended at once, sending nothing: its first tick read the first burst's E2E count,
    before the start cleared the stats."""
    ui = WebUI(cluster.harness.cluster.address)
    try:
        for size in (8, 4):
            before = cluster.num_finished()
            assert ui.swarm(load_shape="burst", burst_size=size, max_tokens_scale=0.25)["success"]
            deadline = time.monotonic() + 60
            while (cluster.num_finished() - before, ui.e2e(), ui.stats()["state"]) != (size, size, "stopped"):
                assert time.monotonic() < deadline, \
                    f"burst of {size}: the router finished {cluster.num_finished() - before}, the UI shows E2E {ui.e2e()}"
                time.sleep(0.3)
    finally:
        ui.close()


@pytest.mark.parametrize("fields", [
    {"load_shape": "bogus"}, {"load_shape": "poisson", "arrival_rate": "-1"}, {"workload": "bogus"},
    {"max_tokens_scale": "0"}, {"step_count": "two"}, {"user_count": "0"}, {"request_timeout": "0"},
], ids=["shape", "rate", "workload", "scale", "not-a-number", "users", "timeout"])  # fmt: skip
@pytest.mark.parametrize("base_path", ["", "/locust"], ids=["root", "base-path"])
def test_the_web_ui_refuses_a_form_it_cannot_run(fields: dict[str, str], base_path: str) -> None:
    """/swarm answered success for these, then the shape died in a greenlet or every user in
    on_start, the UI back at ready or left running with no user; now it answers as for a
    bad user_count: success false and the reason. Under --web-base-path too, where the
    page is <base>/swarm (a review's find: the first fix matched "/swarm" only)."""
    ui = WebUI(NO_ROUTER, base_path)
    try:
        answer = ui.swarm(**fields)
        assert answer["success"] is False and answer["message"], answer
        assert ui.stats()["state"] == "ready", "nothing started"
    finally:
        ui.close()


class _CapturingServer:
    """A gRPC server that answers every call UNAVAILABLE and records the `authorization`
    metadata it is sent: a host someone typed into the web UI's form."""

    def __init__(self) -> None:
        import concurrent.futures
        import threading

        import grpc

        self.seen: list[str] = []
        lock = threading.Lock()
        seen = self.seen

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
                with lock:
                    seen.extend(str(v) for k, v in details.invocation_metadata if k == "authorization")

                def refuse(request: bytes, context: grpc.ServicerContext) -> None:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "not a router")

                return grpc.unary_stream_rpc_method_handler(refuse)

        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((Handler(),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


@pytest.mark.parametrize("form", ["host", "host-and-a-file"])
def test_the_web_ui_sends_the_token_to_no_host_and_reads_no_file_its_form_names(tmp_path: Path, form: str) -> None:
    """docs/deploy.md served the web UI (no login) on every interface with --auth-token-file.
    Locust copies any form field onto the option of its name: a form with another `host`
    sent the cluster's bearer token there, and one with `auth_token_file` sent the first
    line of any file this process could read (an outside security check received the state
    dir's redis-url). With a token set the test runs against --host only, files are named
    at start only, and the form says why, with nothing started."""
    token_file = tmp_path / "kvserve-token"
    token_file.write_text("KVSERVE-TOKEN-of-the-real-cluster-123456\n")
    other_file = tmp_path / "redis-url"
    other_file.write_text("redis://:f00dfacef00dfacef00dfacef00dface@127.0.0.1:6379/0\n")
    capture = _CapturingServer()
    ui = WebUI(f"127.0.0.1:{_free_port()}", "", "--auth-token-file", str(token_file))
    try:
        fields: dict[str, object] = {"host": f"127.0.0.1:{capture.port}", "user_count": 1, "spawn_rate": 1}
        if form == "host-and-a-file":
            fields["auth_token_file"] = str(other_file)
        answer = ui.swarm(**fields)
        assert answer["success"] is False, answer
        said = str(answer["message"])
        assert said.startswith("auth_token_file: set at start only (--auth-token-file)" if form == "host-and-a-file"
                               else "host: with a bearer token"), said
        time.sleep(2.0)  # what a started test would have sent by now
        assert capture.seen == [], capture.seen
        assert ui.stats()["state"] == "ready", "nothing started"
    finally:
        ui.close()
        capture.stop()


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* gives them) listening on port."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_the_web_ui_listens_on_this_machine_only_unless_asked() -> None:
    """Locust binds its web UI on every interface by default; the locustfile's default is
    127.0.0.1 (--web-host says otherwise)."""
    ui = WebUI(NO_ROUTER, web_host=None)
    try:
        assert _listening_addresses(ui.port) == {"0100007F"}  # 127.0.0.1
    finally:
        ui.close()


def test_the_web_ui_form_sets_no_option_of_locust_s_own_such_as_a_report_file(tmp_path: Path) -> None:
    """Locust copies every form field onto the option of its name, its own included: a
    /swarm naming `json_file` made Locust create the directories and write its report there
    when it stopped (a review's find; `html_file` the same). Only the run's own fields pass."""
    target = tmp_path / "made-by-a-form" / "written"
    ui = WebUI(NO_ROUTER)
    try:
        answer = ui.swarm(json_file=str(target))
        assert answer["success"] is False and str(answer["message"]).startswith("json_file: set at start only"), answer
    finally:
        ui.close()  # SIGTERM: Locust's shutdown writes json_file (+ ".json"), had the form set it
    assert not (tmp_path / "made-by-a-form").exists(), sorted(str(p) for p in tmp_path.rglob("*"))


def test_a_worker_process_sends_its_token_only_to_its_own_host(tmp_path: Path) -> None:
    """Locust's distributed mode: a `--worker` holding a token ($KVSERVE_AUTH_TOKEN) gets its
    host from the master. The master, holding none, let a form's host through, and every
    worker sent its token there (a review's find: 3,904 calls). A process sends its token
    only to its own --host; this worker has none, so it sends nothing."""
    capture = _CapturingServer()
    master_port = _free_port()
    ui = WebUI(NO_ROUTER, "", "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(master_port))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSERVE_", "LOCUST_"))}
    env["KVSERVE_AUTH_TOKEN"] = "KVSERVE-TOKEN-of-the-real-cluster-123456"
    worker = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", "127.0.0.1",
         "--master-port", str(master_port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ui.stats().get("workers"):
            assert time.monotonic() < deadline and worker.poll() is None, "the worker did not connect"
            time.sleep(0.3)
        answer = ui.swarm(host=f"127.0.0.1:{capture.port}", user_count=1, spawn_rate=1)
        assert answer["success"] is True, answer  # the master holds no token: its form may say where
        time.sleep(3.0)  # what a started user would have sent by now
        assert capture.seen == [], capture.seen[:1]
    finally:
        worker.terminate()
        try:
            _, err = worker.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            _, err = worker.communicate()
        ui.close()
        capture.stop()
    # Said once, and the refused user stops quietly: it raised StopUser in on_start, which
    # Locust logs with a traceback, and on_stop then failed on the channel never opened.
    assert err.count("not sending this process's bearer token to 127.0.0.1:") == 1, err[-2000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_burst_whose_users_are_all_refused_ends_and_says_so() -> None:
    """Headless, distributed: every user of the only worker is refused (its token is not
    for the master's host). The burst waited for --burst-size answers that could not come,
    until -t (for ever without it), and the run looked like one that had sent nothing
    (a review's find). Each refused user counts as one failed request: the burst ends at
    once, the report says why, and the run exits 1."""
    master_port, router_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSERVE_", "LOCUST_"))}
    master = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--master", "--headless", "--master-bind-host",
         "127.0.0.1", "--master-bind-port", str(master_port), "--expect-workers", "1",
         "--host", f"127.0.0.1:{router_port}", "--load-shape", "burst", "--burst-size", "2", "-t", "90s"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", "127.0.0.1",
         "--master-port", str(master_port)],
        cwd=REPO, env=dict(env, KVSERVE_AUTH_TOKEN="KVSERVE-TOKEN-of-the-real-cluster-123456"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        output, _ = master.communicate(timeout=60)  # -t is 90 s: it ended by itself, or it failed here
    finally:
        for proc in (master, worker):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert master.returncode == 1, output[-3000:]
    assert "CLIENT_ERROR: this process's bearer token goes only to its own --host" in output, output[-3000:]
