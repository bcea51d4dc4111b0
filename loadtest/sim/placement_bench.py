"""How long the router's placement takes, and how many placements one core can make.

    python -m loadtest.sim.placement_bench [--workers 16,64,256,1000]

Times router/placement.py's real policies over N WorkerViews in a realistic state: each
with a report, ~30 outstanding requests, and 0-3 in-flight reservations (a reservation
lives from a placement to the worker's next StepBatch, one engine step, so a worker
rarely has more). It reports:

* decision time: one policy.choose() call, p50 and p99 in microseconds;
* placements/s: choose + place + release (the router's per-request placement work)
  back to back on one core.

`prefix` is timed the way the router runs it, PrefixIndex.hits() included, on a scene of
its own (make_prefix_scene): requests of 64 prompt blocks, half of them starting with one
of 200 shared 48-block system prompts, over workers that each hold 4 of those prompts
(some only in part) and a few predicted placements. Its placements/s also predict the
prompt on the chosen worker, as the router does. Hashing a 64-block prompt, done once per
request at validation, is timed on its own (prompt_hash_us).

Token-event cost (Redis pipeline, listeners) is measured by the router benchmark
(loadtest/bench_router.py), not here.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from loadtest.metrics import percentile
from loadtest.report import Column, Table, write_json
from loadtest.sim.proposals import CACHE_AWARE, SIM_POLICIES, make_sim_policy
from router.placement import CacheHits, ViewColumns, WorkerView
from router.prefix_index import PrefixIndex
from workers.engine.block_hash import BlockHash, hash_blocks
from workers.engine.stats import EngineStats
from workers.messages import KVSnapshot, WorkerInfo
from workers.model.tokenizer import TokenizerSpec

NEED_BLOCKS = 6  # a trace request: (64 prompt + 32 output) tokens in 16-token blocks
MAX_OUTSTANDING = 512
BLOCK_SIZE = 16

# The prefix scene.
NUM_PREFIXES = 200  # shared system prompts in the cluster
PREFIX_BLOCKS = 48  # each one's full blocks
PROMPT_BLOCKS = 64  # a request: a shared prompt (or not) and its own blocks after it
PREFIX_NEED_BLOCKS = PROMPT_BLOCKS + 2  # plus 32 output tokens
PREFIX_POOL_BLOCKS = 2048  # a pool for requests that long (a GPU worker's holds far more)
PREFIXES_PER_WORKER = 4
HIT_FRACTION = 0.5  # requests that start with a shared prompt
NUM_SCENE_REQUESTS = 256  # distinct requests, placed in turn


def make_views(num_workers: int, seed: int, num_blocks: int = 256, need_blocks: int = NEED_BLOCKS,
               prefix_caching: bool = False) -> list[WorkerView]:
    rng = random.Random(seed)
    views = []
    for i in range(num_workers):
        info = WorkerInfo(
            f"w{i}", "bench", "tiny", "cpu", "float32", 258, 2048, 16, 131072, num_blocks, TokenizerSpec(None, None, ()),
            max_num_seqs=64, prefix_caching=prefix_caching,
        )
        committed = rng.randint(num_blocks // 4, num_blocks - 2 * need_blocks)
        report = EngineStats.of_pool(num_blocks, committed, 131072, num_running=30, num_steps=100)
        reservations = {f"q{i}-{j}": need_blocks for j in range(rng.choice((0, 0, 1, 1, 2, 3)))}
        outstanding = {f"r{i}-{j}" for j in range(rng.randint(20, 40))} | set(reservations)
        view = WorkerView(info, report=report, last_report_at=0.0)
        for request_id, blocks in reservations.items():
            view.place(request_id, blocks)  # keeps whatever running totals the view maintains
        view.outstanding |= outstanding
        views.append(view)
    return views


class PrefixScene(NamedTuple):
    """A PrefixIndex over the views' workers and the prompts (block hashes) to place."""

    prefix_index: PrefixIndex
    prompts: list[tuple[BlockHash, ...]]


def _chain(first_token: int, num_blocks: int, parent: BlockHash | None = None) -> list[BlockHash]:
    tokens = [(first_token + i) % 2**32 for i in range(num_blocks * BLOCK_SIZE)]
    return hash_blocks(tokens, BLOCK_SIZE, parent=parent)


def make_prefix_scene(views: Sequence[WorkerView], seed: int) -> PrefixScene:
    """Each worker holds PREFIXES_PER_WORKER shared prompts (a quarter of them cut short,
    as eviction leaves them), and two of its outstanding requests use each whole one (so
    WorkerView.charge walks their prompts, as the router's does); every tenth prompt is
    also predicted on one more worker, and HIT_FRACTION of the requests start with a
    shared prompt."""
    rng = random.Random(seed)
    prefixes = [_chain(1_000_000 * (p + 1), PREFIX_BLOCKS) for p in range(NUM_PREFIXES)]
    index = PrefixIndex()
    for view in views:
        held: list[BlockHash] = []
        for p in rng.sample(range(NUM_PREFIXES), PREFIXES_PER_WORKER):
            length = PREFIX_BLOCKS if rng.random() < 0.75 else rng.randint(1, PREFIX_BLOCKS - 1)
            held.extend(prefixes[p][:length])
            if length == PREFIX_BLOCKS and view.info.prefix_caching:
                for user in range(2):
                    own = _chain(3_000_000_000 + 1000 * p + user, PROMPT_BLOCKS - PREFIX_BLOCKS, parent=prefixes[p][-1])
                    request_id = f"{view.worker_id}-p{p}-{user}"
                    view.prompts.add(request_id, prefixes[p] + own)
                    view.outstanding.add(request_id)
        index.reset(view.worker_id, KVSnapshot(0, tuple(held)))
    for p in range(0, NUM_PREFIXES, 10):
        index.predict(rng.choice(views).worker_id, prefixes[p], now=0.0)
    prompts = []
    for r in range(NUM_SCENE_REQUESTS):
        own = 2_000_000_000 + r * PROMPT_BLOCKS * BLOCK_SIZE
        if rng.random() < HIT_FRACTION:
            prefix = prefixes[rng.randrange(NUM_PREFIXES)]
            prompts.append(tuple(prefix + _chain(own, PROMPT_BLOCKS - PREFIX_BLOCKS, parent=prefix[-1])))
        else:
            prompts.append(tuple(_chain(own, PROMPT_BLOCKS)))
    return PrefixScene(index, prompts)


def _time_calls(call: Callable[[], object], num_calls: int) -> list[float]:
    """Seconds per call, each timed on its own, with the collector off while timing."""
    for _ in range(min(200, num_calls)):
        call()
    times = []
    gc.disable()
    try:
        for _ in range(num_calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def decision_times(policy_name: str, num_workers: int, num_calls: int) -> dict[str, float]:
    """p50/p99 microseconds of one choose() over num_workers views."""
    if policy_name in CACHE_AWARE:
        views = make_views(num_workers, num_workers, PREFIX_POOL_BLOCKS, PREFIX_NEED_BLOCKS, prefix_caching=True)
    else:
        views = make_views(num_workers, seed=num_workers)
    policy = make_sim_policy(policy_name, MAX_OUTSTANDING)
    if policy_name in CACHE_AWARE:
        index, prompts = make_prefix_scene(views, seed=num_workers)
        turn = itertools.cycle(prompts)
        live = ViewColumns(views)  # as the router's registry hands its live views to the policy

        def decide() -> object:
            hashes = next(turn)
            return policy.choose(live, PREFIX_NEED_BLOCKS, CacheHits(len(hashes), index.hits(hashes, now=1.0), hashes))

        times = _time_calls(decide, num_calls)
    else:
        live = ViewColumns(views)
        times = _time_calls(lambda: policy.choose(live, NEED_BLOCKS), num_calls)
    return {"p50_us": percentile(times, 50) * 1e6, "p99_us": percentile(times, 99) * 1e6}


def prompt_hash_us(num_calls: int = 200) -> float:
    """Median microseconds to hash one PROMPT_BLOCKS-block prompt (the router does it once
    per request)."""
    tokens = list(range(PROMPT_BLOCKS * BLOCK_SIZE))
    times = _time_calls(lambda: hash_blocks(tokens, BLOCK_SIZE), num_calls)
    return percentile(times, 50) * 1e6


def placements_per_second(policy_name: str, num_workers: int, num_placements: int, block: int = 50) -> float:
    """choose + place + release back to back, in blocks of `block`; each release ends the
    oldest placement, so the views stay in their realistic state. The median block sets
    the rate, so a burst from another process on a shared machine does not."""
    scene = None
    if policy_name in CACHE_AWARE:
        views = make_views(num_workers, num_workers, PREFIX_POOL_BLOCKS, PREFIX_NEED_BLOCKS, prefix_caching=True)
        scene = make_prefix_scene(views, seed=num_workers)
    else:
        views = make_views(num_workers, seed=num_workers)
    views = ViewColumns(views)  # as the router's registry hands its live views to the policy
    policy = make_sim_policy(policy_name, MAX_OUTSTANDING)
    live: deque[tuple[WorkerView, str]] = deque()
    block_times = []
    gc.disable()
    try:
        for first in range(0, max(num_placements, block), block):
            start = time.perf_counter()
            for i in range(first, first + block):
                request_id = f"p{i}"
                if scene is None:
                    view = policy.choose(views, NEED_BLOCKS)
                    assert view is not None
                    view.place(request_id, NEED_BLOCKS)
                else:
                    now = i * 1e-3  # a placement a millisecond: predictions lapse after prediction_ttl_s
                    hashes = scene.prompts[i % len(scene.prompts)]
                    hits = CacheHits(len(hashes), scene.prefix_index.hits(hashes, now), hashes)
                    view = policy.choose(views, PREFIX_NEED_BLOCKS, hits)
                    assert view is not None
                    view.place(request_id, PREFIX_NEED_BLOCKS, hashes)  # at its charge, as the router does
                    scene.prefix_index.predict(view.worker_id, hashes, now)
                live.append((view, request_id))
                if len(live) > num_workers:
                    old_view, old_id = live.popleft()
                    old_view.release(old_id)
            block_times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return block / percentile(block_times, 50)


def run(worker_counts: Sequence[int], policies: Sequence[str], num_calls: int = 2000) -> dict[str, Any]:
    result: dict[str, Any] = {
        "conditions": {
            "need_blocks": NEED_BLOCKS,
            "view_state": "report with 25-95% of 256 blocks committed, 20-40 outstanding, 0-3 reservations",
            "calls_per_point": num_calls,
            "prefix_scene": f"{PREFIX_POOL_BLOCKS}-block pools; need {PREFIX_NEED_BLOCKS} blocks, {PROMPT_BLOCKS} prompt; "
            f"{HIT_FRACTION:.0%} start with one of {NUM_PREFIXES} shared {PREFIX_BLOCKS}-block prompts; "
            f"each worker holds {PREFIXES_PER_WORKER} of them; hits() included",
        },
        "decision_us": {},
        "placements_per_s": {},
        "prompt_hash_us": prompt_hash_us(),
    }
    for n in worker_counts:
        result["decision_us"][str(n)] = {p: decision_times(p, n, num_calls) for p in policies}
        result["placements_per_s"][str(n)] = {p: placements_per_second(p, n, num_calls) for p in policies}
    return result


def placement_lines(result: dict[str, Any]) -> list[str]:
    """The table of run()'s result: per worker count, each policy's choose() p50 / p99 and placements/s."""
    decisions, rates = result["decision_us"], result["placements_per_s"]
    policies = list(next(iter(decisions.values())))
    table = Table((Column("workers", 8), *(Column(p, 32) for p in policies)))
    return table.lines([
        (n, *(f"{row[p]['p50_us']:>9.1f} /{row[p]['p99_us']:>7.1f} us {rates[n][p]:>8.0f}/s" for p in policies))
        for n, row in decisions.items()
    ])


def print_table(result: dict[str, Any]) -> None:
    print("\nPlacement on one core: choose() p50 / p99 us, and placements/s (choose + place + release)")
    print("\n".join(placement_lines(result)))
    print(f"hashing a {PROMPT_BLOCKS}-block prompt: {result['prompt_hash_us']:.1f} us (once per request)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="16,64,256,1000")
    parser.add_argument("--policies", default=",".join(SIM_POLICIES))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("results/sim"))
    args = parser.parse_args(argv)
    result = run([int(n) for n in args.workers.split(",")], args.policies.split(","), args.calls)
    print_table(result)
    write_json(args.out / "placement.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
