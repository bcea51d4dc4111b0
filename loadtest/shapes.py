"""Load shapes: how many Locust users run, and how fast requests arrive, over time.

    users    closed loop, Locust's own model: -u users spawned at -r per second, each
             sends a request, waits for its last token and sends the next. The offered
             load falls as the server slows down.
    poisson  open loop: requests arrive at --arrival-rate per second whatever the server
             does. The -u users are only arrival generators: each draws exponential gaps
             at arrival_rate / num_users and never waits for a response (the request runs
             in a greenlet of its own), and the merge of independent Poisson streams is a
             Poisson stream at the total rate.
    step     open loop at --arrival-rate, rising by --step-rate every --step-time seconds,
             for --step-count steps.
    burst    --burst-size requests at the same instant (one user each, all spawned at
             once), then the test ends when every one has answered.

-t/--run-time bounds every shape. Plain Python, no Locust: the locustfile's shape class
reads a Stage from here once a second, and each arrival generator keeps a PoissonArrivals.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple

LOAD_SHAPES = ("users", "poisson", "step", "burst")
USER_KINDS = ("closed", "open", "burst")


@dataclass(frozen=True)
class ShapeConfig:
    name: str = "users"
    num_users: int = 1  # -u: closed-loop users, or arrival generators for open-loop shapes
    spawn_rate: float = 1.0  # -r
    run_time: float | None = None  # -t, seconds; None runs until stopped (or the shape ends)
    arrival_rate: float = 4.0  # requests/s over all users and processes (poisson, step)
    step_rate: float = 2.0  # added to the rate at every step
    step_time: float = 30.0  # seconds per step
    step_count: int = 5
    burst_size: int = 32

    def __post_init__(self) -> None:
        if self.name not in LOAD_SHAPES:
            raise ValueError(f"ShapeConfig.name must be one of {', '.join(LOAD_SHAPES)}, got {self.name!r}")
        for field_name in ("num_users", "step_count", "burst_size"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"ShapeConfig.{field_name} must be >= 1, got {getattr(self, field_name)}")
        for field_name in ("spawn_rate", "step_time"):
            if not (getattr(self, field_name) > 0 and math.isfinite(getattr(self, field_name))):
                raise ValueError(f"ShapeConfig.{field_name} must be positive, got {getattr(self, field_name)}")
        if self.name in ("poisson", "step") and not (self.arrival_rate > 0 and math.isfinite(self.arrival_rate)):
            raise ValueError(f"ShapeConfig.arrival_rate must be positive, got {self.arrival_rate}")
        if not (self.step_rate >= 0 and math.isfinite(self.step_rate)):
            raise ValueError(f"ShapeConfig.step_rate must be >= 0, got {self.step_rate}")
        if self.run_time is not None and not self.run_time > 0:
            raise ValueError(f"ShapeConfig.run_time must be positive, got {self.run_time}")


@dataclass(frozen=True)
class Stage:
    """What runs at one moment of a test."""

    num_users: int
    spawn_rate: float
    user_kind: str  # one of USER_KINDS
    arrival_rate: float = 0.0  # requests/s over all users; only for "open" users

    @property
    def rate_per_user(self) -> float:
        """The Poisson rate each arrival generator draws its gaps at."""
        return self.arrival_rate / self.num_users


def stage_at(config: ShapeConfig, elapsed: float, num_answered: int) -> Stage | None:
    """The stage `elapsed` seconds into the test, or None when the test is over.

    num_answered counts the requests that have ended (successes and failures); only the
    burst shape looks at it."""
    if config.run_time is not None and elapsed >= config.run_time:
        return None
    match config.name:
        case "users":
            return Stage(config.num_users, config.spawn_rate, "closed")
        case "poisson":
            return Stage(config.num_users, config.spawn_rate, "open", config.arrival_rate)
        case "step":
            step = int(elapsed // config.step_time)
            if step >= config.step_count:
                return None
            return Stage(config.num_users, config.spawn_rate, "open", config.arrival_rate + step * config.step_rate)
        case "burst":
            if num_answered >= config.burst_size:
                return None
            # Every user at once: the spawn rate is the whole burst.
            return Stage(config.burst_size, float(config.burst_size), "burst")
    raise AssertionError(config.name)  # __post_init__ checked the name


class ArrivalWait(NamedTuple):
    seconds: float  # how long to sleep now
    arrival_due: bool  # whether an arrival is due when the sleep ends


class PoissonArrivals:
    """One generator's arrival times: a Poisson process on an absolute clock.

    Each arrival is scheduled from the previous one's scheduled time, not from when the
    sleep before it really ended, so a late wake-up (a busy CPU, a slow greenlet switch)
    makes the next gap shorter instead of shifting every later arrival: the count over
    a run stays rate x time. Sleeps are cut to max_wait so that a new rate is seen soon;
    when the rate changes the next arrival is drawn afresh from now, which is exact
    because the exponential is memoryless.
    """

    def __init__(self, rng: random.Random, max_wait: float) -> None:
        self.rng = rng
        self.max_wait = max_wait
        self.rate = 0.0
        self.next_at = math.inf

    def wait(self, now: float, rate: float) -> ArrivalWait:
        if rate != self.rate:
            self.rate = rate
            self.next_at = now + self.rng.expovariate(rate) if rate > 0 else math.inf
        seconds = max(0.0, self.next_at - now)
        return ArrivalWait(min(seconds, self.max_wait), seconds <= self.max_wait)

    def arrived(self) -> None:
        """The due arrival was sent: schedule the next one."""
        self.next_at += self.rng.expovariate(self.rate)
