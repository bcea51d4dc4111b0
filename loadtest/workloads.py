"""What a load test sends: request shapes drawn from seeded generators.

Every request is token ids (the presets' byte vocabulary, ids in [0, 256)) with a fixed
output length; the locustfile sends it greedy with ignore_eos, so each request produces
exactly `max_tokens` tokens and the offered work is the workload's, not the model's.

    trace          the seed chapter's trace (loadtest/trace.py): prompts 32-96, outputs 16-48
    mixed          80% short (prompts 16-64, outputs 8-32), 20% long (512-1024, 128-256)
    shared-prefix  8 groups, each a fixed 512-token system prompt + a 16-64 token suffix;
                   outputs 16-48

Plain Python: no Locust or gRPC here, so the shapes can be checked on their own.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Protocol

from loadtest.trace import poisson_trace

WORKLOADS = ("trace", "mixed", "shared-prefix")
VOCAB_SIZE = 256  # the presets' byte-level vocabulary
TRACE_POOL_SIZE = 1024  # requests of the seed trace that users draw from


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "trace"
    max_tokens_scale: float = 1.0  # output lengths are multiplied by this (at least 1 token)
    seed: int = 7  # the seed trace's seed; also fixes the shared prefixes
    max_model_len: int = 2048  # the tiny preset's; prompt + max_tokens never exceed it

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"WorkloadConfig.name must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        if not (self.max_tokens_scale > 0 and math.isfinite(self.max_tokens_scale)):
            raise ValueError(f"WorkloadConfig.max_tokens_scale must be positive, got {self.max_tokens_scale}")
        if self.max_model_len <= _LONGEST_PROMPT[self.name]:
            raise ValueError(
                f"WorkloadConfig.max_model_len must exceed the {self.name} workload's longest prompt "
                f"({_LONGEST_PROMPT[self.name]} tokens), got {self.max_model_len}"
            )


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    kind: str  # which part of the workload: "trace", "short", "long", "prefix-3", ...


class Workload(Protocol):
    def sample(self, rng: random.Random) -> WorkloadRequest:
        """One request; all randomness comes from `rng` (one per Locust user)."""
        ...


_LONGEST_PROMPT = {"trace": 96, "mixed": 1024, "shared-prefix": 512 + 64}


class TraceWorkload:
    """Requests of the seed trace, drawn at random: the lengths and ids bench_engine replays."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.pool = poisson_trace(TRACE_POOL_SIZE, rate=math.inf, seed=config.seed, vocab_size=VOCAB_SIZE)

    def sample(self, rng: random.Random) -> WorkloadRequest:
        request = self.pool[rng.randrange(len(self.pool))]
        return _request(self.config, request.prompt_ids, request.output_len, "trace")


class MixedWorkload:
    """Mostly short chat turns with a minority of long documents: the mix that makes
    KV-aware placement matter, since one long request holds as many blocks as dozens of
    short ones."""

    long_fraction = 0.2
    short_prompt, short_output = (16, 64), (8, 32)
    long_prompt, long_output = (512, 1024), (128, 256)

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config

    def sample(self, rng: random.Random) -> WorkloadRequest:
        is_long = rng.random() < self.long_fraction
        prompt_len, output_len = (self.long_prompt, self.long_output) if is_long else (self.short_prompt, self.short_output)
        prompt = _random_ids(rng, rng.randint(*prompt_len))
        return _request(self.config, prompt, rng.randint(*output_len), "long" if is_long else "short")


class SharedPrefixWorkload:
    """Groups of requests that start with the same long system prompt. The prefixes come
    from the config's seed, so every user (and every process) shares the same ones."""

    num_groups = 8
    prefix_len = 512
    suffix_len, output_len = (16, 64), (16, 48)

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        prefixes = random.Random(f"shared-prefix:{config.seed}")
        self.prefixes = [_random_ids(prefixes, self.prefix_len) for _ in range(self.num_groups)]

    def sample(self, rng: random.Random) -> WorkloadRequest:
        group = rng.randrange(self.num_groups)
        prompt = self.prefixes[group] + _random_ids(rng, rng.randint(*self.suffix_len))
        return _request(self.config, prompt, rng.randint(*self.output_len), f"prefix-{group}")


@functools.cache
def make_workload(config: WorkloadConfig) -> Workload:
    """The workload a config names; cached, so all users of a process share one pool."""
    match config.name:
        case "trace":
            return TraceWorkload(config)
        case "mixed":
            return MixedWorkload(config)
        case "shared-prefix":
            return SharedPrefixWorkload(config)
    raise AssertionError(config.name)  # __post_init__ checked the name


def _random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB_SIZE) for _ in range(n))


def _request(config: WorkloadConfig, prompt: tuple[int, ...], output_len: int, kind: str) -> WorkloadRequest:
    scaled = max(1, round(output_len * config.max_tokens_scale))
    return WorkloadRequest(prompt, min(scaled, config.max_model_len - len(prompt)), kind)
