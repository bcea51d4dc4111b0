"""bench-prefix's workload: groups sharing long system prompts of real text, users asking
short questions, and the hit rate an oracle's infinite cache would reach on it.

The system prompts are the standard library's own module documentation (real English,
which the tokenizer splits as it splits real prompts), one stretch of it per group; each
request is a group's system prompt and one user's short question, in a seeded order.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Real text for the system prompts: module documentation that ships with Python.
DOC_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
                "email", "enum", "functools", "gzip", "heapq", "http", "inspect", "itertools", "json", "logging",
                "pathlib", "pickle", "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics",
                "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "uuid", "zipfile")
QUESTIONS = ("What is this library for?", "Name one function it provides.", "Is it thread safe?",
             "Give a one-line example.", "What should I read first?", "Who would use this?")


@dataclass(frozen=True)
class PrefixRequest:
    """One request of the workload: its group (whose system prompt it starts with), its user,
    and its chat messages as (role, content)."""

    group: int
    user: int
    messages: tuple[tuple[str, str], ...]


def system_prompts(groups: int, target_tokens: int, encode: Any) -> list[str]:
    """One system prompt per group, each about target_tokens tokens of documentation."""
    import importlib

    docs = []
    for name in DOC_MODULES:
        try:
            docs.append(inspect.getdoc(importlib.import_module(name)) or "")
        except ImportError:
            continue
    text = "\n\n".join(d for d in docs if d)
    words = text.split()
    prompts, start = [], 0
    for group in range(groups):
        head = f"You are the documentation assistant of team {group}. Answer from this reference only.\n\n"
        end = start
        while len(encode(head + " ".join(words[start:end]))) < target_tokens:
            end += 50
            if end >= len(words):  # wrap around: still real text, another stretch of it
                words = words + words
        prompts.append(head + " ".join(words[start:end]))
        start = end
    return prompts


def make_workload(
    groups: int, users: int, system: list[str], seed: int, num_requests: int = 2000
) -> list[PrefixRequest]:
    """num_requests seeded requests (a longer list begins with a shorter one's requests)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        group, user = rng.randrange(groups), rng.randrange(users)
        question = f"I am user {user}. {rng.choice(QUESTIONS)}"
        requests.append(PrefixRequest(group, user, (("system", system[group]), ("user", question))))
    return requests


def first_of_groups(workload: Sequence[PrefixRequest], count: int) -> list[PrefixRequest]:
    """Up to count requests, each the first of its group in workload: none of them can find a
    prefix that another one left (fewer than count when there are fewer groups)."""
    seen: set[int] = set()
    out: list[PrefixRequest] = []
    for request in workload:
        if request.group not in seen and len(out) < count:
            seen.add(request.group)
            out.append(request)
    return out


def oracle_hit_rate(workload: list[PrefixRequest], prompt_lengths: dict[int, int], block: int, encode_len: Any) -> float:
    """One infinite cache: a group's whole system prompt (its full blocks) hits after its first request."""
    seen: set[int] = set()
    hit = total = 0
    for request in workload:
        length = encode_len(request)
        total += length
        if request.group in seen:
            hit += (prompt_lengths[request.group] // block) * block
        seen.add(request.group)
    return hit / total
