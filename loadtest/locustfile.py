"""Locust load test of a kvserve router: streaming Generate calls, timed token by token.

Start a cluster (`make serve`, router on localhost:50051), then from the repo root:

    .venv/bin/locust -f loadtest/locustfile.py --host localhost:50051     # web UI on :8089

Headless, with CSV and HTML reports (run_stats.csv, run_stats_history.csv, run_failures.csv):

    .venv/bin/locust -f loadtest/locustfile.py --host localhost:50051 \\
        --headless -u 8 -r 2 -t 60s --csv results/locust/run --html results/locust/run.html

Workloads (--workload, or the KVSERVE_WORKLOAD environment variable; loadtest/workloads.py):

    --workload trace           the seed trace: prompts 32-96 tokens, outputs 16-48 (default)
    --workload mixed           80% short (16-64 / 8-32), 20% long (512-1024 / 128-256)
    --workload shared-prefix   8 groups x 512-token system prompt + 16-64 token suffix
    --max-tokens-scale 0.25    shorter outputs (or longer, > 1); prompt + output <= --max-model-len
    --seed 7                   the trace's seed and the shared prefixes; users draw from it

Load shapes (--load-shape, or KVSERVE_SHAPE; loadtest/shapes.py has the schedules):

    --load-shape users      closed loop, plain Locust (default): -u users each send a request,
                            wait for its last token, send the next; -r spawn rate; -t run time
        .venv/bin/locust -f loadtest/locustfile.py --host localhost:50051 --headless -u 8 -r 8 -t 60s
    --load-shape poisson    open loop: --arrival-rate requests/s whatever the latency; the -u
                            users only generate arrivals (each at arrival-rate/u, never waiting
                            for a response), so -u sets how the client work is spread, not the load
        ... --load-shape poisson --arrival-rate 6 -u 4 -r 4 -t 2m
    --load-shape step       open loop from --arrival-rate, +--step-rate every --step-time s,
                            --step-count steps
        ... --load-shape step --arrival-rate 2 --step-rate 2 --step-time 30 --step-count 5 -u 4 -r 4
    --load-shape burst      --burst-size requests at the same instant, one per user; the test
                            ends once all have answered (or at -t)
        ... --load-shape burst --burst-size 64 -t 5m

Several processes (--processes N, or -1 for one per core) work with every shape: each
process opens its own channels after the fork, and the master sends the open-loop rate
to every process once a second (the rate per user, so the total stays --arrival-rate).
Use -u >= N with the open-loop shapes so every process has a generator.

Events (request type "grpc"; loadtest/timed_generate.py): TTFT (to the first token),
ITL (one per gap between token deltas), E2E (whole request, size column = output tokens).

A router started with TLS or a token (`kvserve up --tls-cert ... --auth-token-file ...`):
pass --tls-ca cert.pem and --auth-token-file token (or KVSERVE_TLS_CA, and
KVSERVE_AUTH_TOKEN_FILE or KVSERVE_AUTH_TOKEN).
A failed request is one E2E failure whose error starts with its gRPC status code name,
e.g. "RESOURCE_EXHAUSTED: ...".

When a shape's schedule (or -t) ends, requests still running get -s/--stop-timeout
seconds to finish and are counted (give one, e.g. -s 30): the closed-loop users are
stopped, the open-loop generators stop arriving and the test ends once no process has a
request in flight; the rest are cancelled, which frees their KV, and are not reported. Locust's --help
does not list the flags above (it is printed before a locustfile loads); the web UI
shows them as form fields.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import gevent
import gevent.pool
import grpc
import grpc.experimental.gevent
import locust.stats
from locust import LoadTestShape, User, constant, events, task
from locust.exception import StopUser
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from cluster.client import call_metadata, load_auth_token
from loadtest.shapes import LOAD_SHAPES, PoissonArrivals, ShapeConfig, stage_at
from loadtest.timed_generate import E2E, REQUEST_TYPE, failure_of, timed_generate
from loadtest.workloads import WORKLOADS, WorkloadConfig, WorkloadRequest, make_workload
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

# gRPC must wait the gevent way (yielding to other greenlets), and this has to be set
# before the first channel exists anywhere in the process.
grpc.experimental.gevent.init_gevent()

RATE_MESSAGE = "kvserve_rate_per_user"
IN_FLIGHT_MESSAGE = "kvserve_in_flight"  # a --processes worker's open-loop requests running, to the master
IN_FLIGHT_REPORT_S = 0.5
MAX_ARRIVAL_WAIT_S = 0.25  # an arrival generator re-reads the rate at least this often
DRAIN_SPAWN_RATE = 1e6  # users stopped per second when the schedule ends: all at once


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="trace", env_var="KVSERVE_WORKLOAD",
                        help="what to send: trace, mixed or shared-prefix [env KVSERVE_WORKLOAD]")
    parser.add_argument("--max-tokens-scale", type=float, default=1.0,
                        help="multiply every output length by this")
    parser.add_argument("--seed", type=int, default=7, help="seed of the trace, the prefixes and the users' draws")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="the served model's limit on prompt + output tokens")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="gRPC deadline of one request, s")
    # Files are named at start only, never in the web UI's form (check_form_targets).
    parser.add_argument("--tls-ca", default="", env_var="KVSERVE_TLS_CA", include_in_web_ui=False,
                        help="connect with TLS, trusting this CA certificate (PEM) (kvserve up --tls-cert)")
    parser.add_argument("--auth-token-file", default="", env_var="KVSERVE_AUTH_TOKEN_FILE", include_in_web_ui=False,
                        help="send the bearer token on this file's first line (default: $KVSERVE_AUTH_TOKEN); "
                             "sent to --host only: the web UI cannot point the test elsewhere while a token is set")
    parser.add_argument("--load-shape", choices=LOAD_SHAPES, default="users", env_var="KVSERVE_SHAPE",
                        help="users (closed loop), poisson, step or burst [env KVSERVE_SHAPE]")
    parser.add_argument("--arrival-rate", type=float, default=4.0,
                        help="poisson/step: requests per second over all users and processes")
    parser.add_argument("--step-rate", type=float, default=2.0, help="step: requests/s added at every step")
    parser.add_argument("--step-time", type=float, default=30.0, help="step: seconds per step")
    parser.add_argument("--step-count", type=int, default=5, help="step: number of steps")
    parser.add_argument("--burst-size", type=int, default=32, help="burst: requests sent at once")
    # Locust's web UI has no login and binds every interface by default: anyone who reached
    # it could run load with this machine's token. This machine only, unless --web-host says.
    parser.set_defaults(web_host="127.0.0.1")


def workload_config(options: Any) -> WorkloadConfig:
    return WorkloadConfig(
        name=options.workload,
        max_tokens_scale=float(options.max_tokens_scale),
        seed=int(options.seed),
        max_model_len=int(options.max_model_len),
    )


def shape_config(options: Any) -> ShapeConfig:
    return ShapeConfig(
        name=options.load_shape,
        num_users=1 if options.num_users is None else int(options.num_users),  # -u 0 is refused, not 1
        spawn_rate=float(options.spawn_rate or 1.0),
        run_time=float(options.run_time) if options.run_time else None,
        arrival_rate=float(options.arrival_rate),
        step_rate=float(options.step_rate),
        step_time=float(options.step_time),
        step_count=int(options.step_count),
        burst_size=int(options.burst_size),
    )


def check_options(options: Any) -> None:
    """Raise ValueError, naming the flag, for the first value the test could not run with:
    at start (the command line), and at every start from the web UI's form."""
    workload_config(options)
    shape_config(options)
    timeout = float(options.request_timeout)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"--request-timeout must be a number of seconds > 0, got {options.request_timeout}")
    if options.tls_ca:
        try:
            Path(options.tls_ca).read_bytes()
        except OSError as exc:
            raise ValueError(f"--tls-ca: cannot read {options.tls_ca}: {exc.strerror}") from None
    load_auth_token(Path(options.auth_token_file) if options.auth_token_file else None)


# The web UI's form fields the test reads: the flags above and -r under their own names, -u
# as user_count.
_FORM_FIELDS = ("spawn_rate", "workload", "max_tokens_scale", "seed", "max_model_len", "request_timeout",
                "load_shape", "arrival_rate", "step_rate", "step_time", "step_count", "burst_size")
# What a /swarm form may set: Locust's own run fields, and the test's (_FORM_FIELDS). Locust
# copies any form field onto the option of its name: a form naming --auth-token-file made
# this process read that file and send its first line as the bearer token (an outside check
# sent the state dir's redis-url to a host of its own), and one naming Locust's json_file or
# html_file made it write there when it stopped (a review). Every other option is set at
# start only.
_LOCUST_FORM_FIELDS = ("user_count", "spawn_rate", "host", "run_time", "profile", "user_classes", "shape_class")


def form_options(options: Any, form: Any) -> argparse.Namespace:
    """options as a /swarm form would leave them (Locust converts each field to the type of
    the option it replaces); ValueError naming a field that does not convert."""
    merged = argparse.Namespace(**vars(options))
    for key, value in form.items():
        name = "num_users" if key == "user_count" else key
        if name != "num_users" and name not in _FORM_FIELDS:
            continue
        current = getattr(merged, name, None)
        kind: type = {"user_count": int, "spawn_rate": float}.get(key, str if current is None else type(current))
        try:
            setattr(merged, name, kind(value))
        except ValueError:
            raise ValueError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    return merged


def check_form_targets(options: Any, start_host: str | None, form: Any) -> None:
    """ValueError for a /swarm form that sets an option other than the run's own fields
    (files among them: --auth-token-file, --tls-ca, Locust's report files), or that points
    the test at another host than --host while a bearer token is set (the token would go
    there: an outside check's server received it)."""
    for name in form:
        if name not in _LOCUST_FORM_FIELDS and name not in _FORM_FIELDS and hasattr(options, name):
            raise ValueError(f"{name}: set at start only (--{name.replace('_', '-')}); the web UI's form sets the "
                             f"run's own fields, never a file")
    host = form.get("host")
    if host is not None and host != (start_host or "") and load_auth_token(
            Path(options.auth_token_file) if options.auth_token_file else None) is not None:
        raise ValueError(f"host: with a bearer token (--auth-token-file or $KVSERVE_AUTH_TOKEN) the test runs "
                         f"against --host {start_host} only, where the token is meant to go; start Locust again "
                         f"with --host to test another router")


def _refuse_a_bad_swarm(environment: Environment) -> Any:
    """A before-request hook of the web UI: a /swarm whose form the test could not run with
    (or that would send the token elsewhere: check_form_targets) is answered as Locust
    answers a bad user_count (success false, the reason), before anything starts. Locust
    itself copies our fields unchecked and starts the shape, which then died in a greenlet
    (a bad shape field) or left users dying in on_start."""
    from flask import jsonify, request

    def check() -> Any:
        # Under --web-base-path the page is <base>/swarm.
        if not request.path.rstrip("/").endswith("/swarm") or request.method != "POST" \
                or environment.parsed_options is None:
            return None
        try:
            check_form_targets(environment.parsed_options, environment.kvserve_start_host, request.form)
            check_options(form_options(environment.parsed_options, request.form))
        except ValueError as exc:
            return jsonify({"success": False, "message": str(exc), "host": environment.host})
        return None

    return check


class ArrivalRate:
    """This process's copy of the rate each arrival generator draws its gaps at. The shape
    sets it, from the master (or from this process when it runs alone), once a second."""

    def __init__(self) -> None:
        self.per_user = 0.0

    def on_message(self, environment: Environment, msg: Any, **_: Any) -> None:
        self.per_user = float(msg.data["rate_per_user"])


class InFlight:
    """The open-loop requests running: this process's, and under --processes each worker
    process's as it last reported (the master's shape ends a drained test only once none
    is left, within --stop-timeout: a worker reports 0 users while its users' requests still
    run, and a master that quit then cancelled them)."""

    def __init__(self) -> None:
        self.here = 0
        self.reported: dict[str, tuple[int, float]] = {}  # worker process -> (requests, when)

    def on_message(self, environment: Environment, msg: Any, **_: Any) -> None:
        self.reported[msg.node_id] = (int(msg.data["in_flight"]), time.monotonic())

    def report_to_master(self, runner: WorkerRunner) -> None:
        while True:
            runner.send_message(IN_FLIGHT_MESSAGE, {"in_flight": self.here})
            gevent.sleep(IN_FLIGHT_REPORT_S)

    def none_since(self, runner: Any, since: float) -> bool:
        """Whether no request runs, by reports newer than since where other processes run them."""
        if not isinstance(runner, MasterRunner):
            return self.here == 0
        reports = (self.reported.get(node_id, (1, 0.0)) for node_id in runner.clients)  # none yet: not known
        return all(when > since and count == 0 for count, when in reports)


@events.init.add_listener
def on_init(environment: Environment, web_ui: Any = None, **_: Any) -> None:
    if environment.parsed_options is not None:
        try:  # refuse bad flags at start, not at the first request
            check_options(environment.parsed_options)
        except ValueError as exc:
            raise SystemExit(f"loadtest/locustfile.py: {exc}") from None
    # Where this process's bearer token may go: its own --host (check_form_targets, on_start).
    environment.kvserve_start_host = environment.host  # type: ignore[attr-defined]
    if web_ui is not None:
        web_ui.app.before_request(_refuse_a_bad_swarm(environment))
    environment.kvserve_arrivals = ArrivalRate()  # type: ignore[attr-defined]
    environment.kvserve_in_flight = in_flight = InFlight()  # type: ignore[attr-defined]
    runner = environment.runner
    if runner is not None and not isinstance(runner, MasterRunner):
        runner.register_message(RATE_MESSAGE, environment.kvserve_arrivals.on_message)  # type: ignore[attr-defined]
    if isinstance(runner, MasterRunner):
        runner.register_message(IN_FLIGHT_MESSAGE, in_flight.on_message)
    elif isinstance(runner, WorkerRunner):
        gevent.spawn(in_flight.report_to_master, runner)


class _KVServeUser(User):
    """A client of the router with a channel of its own, opened in on_start: after
    --processes has forked, and one TCP connection per user (a local subchannel pool)."""

    abstract = True
    _next_index = itertools.count()

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.workload = make_workload(workload_config(options))
        self.timeout = float(options.request_timeout)
        # Each user's draws are its own and reproducible: (seed, process, user in process).
        worker_index = getattr(self.environment.runner, "worker_index", 0)
        self.rng = random.Random(f"{options.seed}:{worker_index}:{next(_KVServeUser._next_index)}")
        token = load_auth_token(Path(options.auth_token_file) if options.auth_token_file else None)
        start_host = getattr(self.environment, "kvserve_start_host", None)
        self.channel: grpc.Channel | None = None
        # The host came from elsewhere (a master's form, when the token is this process's
        # alone): the master's check cannot see a worker's token (a review's find). Said once;
        # the user stops at its first task (a StopUser raised here, Locust logs with a traceback).
        self.refused = token is not None and self.host != start_host
        if self.refused:
            _say_once(f"not sending this process's bearer token to {self.host}: it goes only to this process's own "
                      f"--host ({start_host or 'none given'}); start it with --host")
            return
        self.channel = _open_channel(_target(self.host), options.tls_ca)
        self.stub = pb_grpc.KVServeStub(self.channel)
        self.metadata = call_metadata(token)

    def stop_if_refused(self) -> None:
        """At the top of every task: a user refused in on_start stops here, quietly, as one
        failed request: the report shows why, the run exits 1, and a burst waiting for its
        answers ends (it waited for answers that could not come: a review's find)."""
        if self.refused:
            self.environment.events.request.fire(
                request_type=REQUEST_TYPE, name=E2E, response_time=0.0, response_length=0, context={},
                exception=failure_of("CLIENT_ERROR", "this process's bearer token goes only to its own --host"),
            )
            raise StopUser()

    def on_stop(self) -> None:
        if self.channel is not None:
            self.channel.close()

    def next_request(self) -> WorkloadRequest:
        return self.workload.sample(self.rng)

    def generate(self, request: WorkloadRequest) -> None:
        timed_generate(self.stub, request, self.environment.events.request.fire, self.timeout, self.metadata)


class GenerateUser(_KVServeUser):
    """Closed loop: one request at a time, the next as soon as the last has finished."""

    wait_time = constant(0)

    @task
    def generate_one(self) -> None:
        self.stop_if_refused()
        self.generate(self.next_request())


class ArrivalUser(_KVServeUser):
    """Open loop: a Poisson arrival generator. Locust's wait_time sleeps until the next
    arrival (PoissonArrivals keeps the schedule), and the task starts the request in a
    greenlet of its own and returns at once, so a slow response never delays the next
    arrival."""

    def on_start(self) -> None:
        super().on_start()
        self.arrivals = PoissonArrivals(random.Random(self.rng.random()), MAX_ARRIVAL_WAIT_S)
        self.arrival_due = False
        self.in_flight = gevent.pool.Group()

    def wait_time(self) -> float:
        rate = self.environment.kvserve_arrivals.per_user
        seconds, self.arrival_due = self.arrivals.wait(time.monotonic(), rate)
        return seconds

    @task
    def arrive(self) -> None:
        self.stop_if_refused()
        if self.arrival_due:
            self.arrival_due = False
            self.arrivals.arrived()
            self.in_flight.spawn(self._counted, self.next_request())

    def _counted(self, request: WorkloadRequest) -> None:
        counter: InFlight = self.environment.kvserve_in_flight
        counter.here += 1
        try:
            self.generate(request)
        finally:
            counter.here -= 1

    def on_stop(self) -> None:
        try:
            self.in_flight.join(timeout=self.environment.stop_timeout or 0)
        finally:
            self.in_flight.kill(block=True)  # cancels their calls; they report nothing
            super().on_stop()


class BurstUser(_KVServeUser):
    """Sends one request as soon as it starts, then idles until the shape ends the test."""

    def on_start(self) -> None:
        super().on_start()
        self.sent = False

    def wait_time(self) -> float:
        return 1.0 if self.sent else 0.0

    @task
    def burst(self) -> None:
        self.stop_if_refused()
        if not self.sent:
            self.sent = True
            self.generate(self.next_request())


USER_CLASSES: dict[str, type[User]] = {"closed": GenerateUser, "open": ArrivalUser, "burst": BurstUser}


class KVServeShape(LoadTestShape):
    """The one shape Locust sees: --load-shape picks the schedule from loadtest/shapes.py,
    read at the start of every test, so the web UI's form can change it between runs.
    It also honours -u, -r and -t (use_common_options).

    When a closed-loop or burst schedule ends it first stops the users, which gives
    requests in flight --stop-timeout seconds to finish, and only ends the test once no
    user is left: a master that quits at once waits just 0.5 s for its workers' last
    numbers. An open-loop schedule ends as _drain_arrivals says."""

    use_common_options = True

    def __init__(self) -> None:
        super().__init__()
        self.config: ShapeConfig | None = None
        self.last_tick: tuple[int, float, list[type[User]]] | None = None
        self.drain_began: float | None = None

    def reset_time(self) -> None:
        super().reset_time()
        self.config = None
        self.drain_began = None

    def tick(self) -> tuple[int, float, list[type[User]]] | None:
        runner = self.runner
        assert runner is not None
        config, num_answered = self.config, 0
        if config is None:
            # The first tick of a test runs before the start clears the last test's stats:
            # none of this test's requests has answered yet (a second burst from the web UI
            # read the first's count and ended at once).
            config = self.config = shape_config(runner.environment.parsed_options)
            self.last_tick = None
        else:
            e2e = runner.stats.entries.get((E2E, REQUEST_TYPE))
            num_answered = e2e.num_requests if e2e is not None else 0
        stage = stage_at(config, self.get_run_time(), num_answered)
        if stage is None:
            if self.last_tick is None:
                return None
            if self.last_tick[2] == [ArrivalUser]:
                return self._drain_arrivals(runner)
            if runner.user_count == 0:
                return None
            return 0, DRAIN_SPAWN_RATE, self.last_tick[2]
        if stage.user_kind == "open":
            runner.send_message(RATE_MESSAGE, {"rate_per_user": stage.rate_per_user})
        self.last_tick = (stage.num_users, stage.spawn_rate, [USER_CLASSES[stage.user_kind]])
        return self.last_tick

    def _drain_arrivals(self, runner: Any) -> tuple[int, float, list[type[User]]] | None:
        """The open-loop schedule's end: no more arrivals (rate 0), the generators kept, and
        the test ends once no request runs, or --stop-timeout after the end (quitting
        cancels what still runs). Not by stopping the users: under --processes a worker
        reports 0 users while their requests still run, and a master that quit then
        cancelled them; and each spawn message costs a worker seconds of Locust's own
        argument parsing at once (runners.py, default_args_dict() per option), which
        missed its heartbeats, and the master took the workers for lost."""
        now = time.monotonic()
        if self.drain_began is None:
            self.drain_began = now
        runner.send_message(RATE_MESSAGE, {"rate_per_user": 0.0})
        stop_timeout = runner.environment.stop_timeout or 0.0
        if now - self.drain_began >= stop_timeout:
            return None
        if runner.environment.kvserve_in_flight.none_since(runner, self.drain_began):
            return None
        return self.last_tick


@events.quitting.add_listener
def let_csv_catch_up(environment: Environment, **_: Any) -> None:
    """Locust rewrites --csv files once a second and not at exit, so requests that ended
    in the last second would be missing from them (locustio/locust#1806, #2299); the
    printed summary and --html have them. One more interval puts them in the CSV too."""
    options = environment.parsed_options
    if options is not None and options.csv_prefix and not isinstance(environment.runner, WorkerRunner):
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.2)


def _open_channel(target: str, tls_ca: str) -> grpc.Channel:
    options = [("grpc.use_local_subchannel_pool", 1)]
    if not tls_ca:
        return grpc.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
    return grpc.secure_channel(target, credentials, options=options)


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """An error for the log, once per process (every user of the process meets it)."""
    if message not in _SAID:
        _SAID.add(message)
        logging.getLogger("kvserve.locust").error(message)


def _target(host: str | None) -> str:
    """Locust's --host as a gRPC target: host:port, with any scheme the UI added dropped."""
    if not host:
        raise ValueError("--host is required: the router's host:port, e.g. localhost:50051")
    return host.split("://", 1)[-1].rstrip("/")
