"""Where a request runs: the router's view of each worker's KV, and the placement policies.

The number placed on is a worker's *headroom*: blocks no admitted request can claim,
from the worker's last report, minus what this router placed there since that report
(in-flight reservations). A burst between two reports therefore sees each placement
immediately and spreads instead of piling onto the worker that looked emptiest.

    headroom = report.uncommitted_blocks - sum(reservations not yet in a report)
    uncommitted = total_blocks - sum over admitted requests of the larger of their
                  commitment and what they hold (a block they share through the
                  prefix cache counted once)

A request's commitment (reservation(), RouterConfig.kv_reserve_ratio) is its prompt's
blocks and those of ceil(ratio x max_tokens) output tokens; at ratio 1, its longest. It
goes only to a worker whose pool holds its longest (choose()'s longest_blocks).

A request is reserved at its charge, not its whole need: with the worker's prefix cache
on, the leading prompt blocks that requests this router placed there and that have not
finished already hold (or will) are not committed again (workers/engine/shared_prefix.py).

A worker also takes no more requests than its engine runs at once (max_num_seqs): with
its sequence slots full, a request waits in the router's queue, where it can still go to
whichever worker frees first, rather than in that worker's:

    free_seq_slots = max_num_seqs - (running + waiting in its report) - reservations
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from array import array
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from workers.engine.block_hash import BlockHash
from workers.engine.config import blocks_for_tokens
from workers.engine.shared_prefix import SharedPrefixes
from workers.engine.stats import EngineStats
from workers.messages import WorkerInfo


@dataclass(slots=True)
class WorkerView:
    """The router's state for one worker. Owned by the router's worker pool.

    Slotted, and its total kept as a plain attribute: the kv pass reads two attributes of
    every worker on every decision."""

    info: WorkerInfo
    report: EngineStats | None = None
    last_report_at: float = field(default_factory=time.monotonic)
    alive: bool = True
    reservations: dict[str, int] = field(default_factory=dict)  # request_id -> blocks
    reserved_blocks: int = 0  # sum of reservations
    # Kept as one int (updated on report, place, release): the kv policy reads it for
    # every worker on every decision.
    headroom_blocks: int = -1
    # Headroom less the blocks its last report has holding cached prefixes nobody uses:
    # what a request's new blocks take before the worker evicts a cached one (negative
    # when reservations are counted against cached blocks). Kept like headroom_blocks.
    clean_headroom_blocks: int = -1
    # Requests it can still be sent (max_num_seqs - running - waiting - reservations); a
    # large number when its engine has no limit or the router does not count slots.
    free_seq_slots: int = 0
    count_seq_slots: bool = True
    outstanding: set[str] = field(default_factory=set)  # placed here, not finished
    new_preemptions: int = 0  # how many its last report counts over the report before it
    # The prompt blocks of the outstanding requests, which a newcomer's prompt can share
    # (kept only for a worker whose prefix cache is on).
    prompts: SharedPrefixes = field(default_factory=SharedPrefixes)
    # Liveness from progress: when its engine last stepped (or last had nothing to do).
    progress_at: float = field(default_factory=time.monotonic)
    num_blocks: int = field(init=False, default=0)  # info.num_blocks, refreshed with the rest
    # The ViewColumns that holds this view's numbers (at row _row), kept current by _refresh.
    _columns: ViewColumns | None = field(init=False, default=None, repr=False, compare=False)
    _row: int = field(init=False, default=0, repr=False, compare=False)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def total_blocks(self) -> int:
        return self.info.num_blocks

    def __post_init__(self) -> None:
        self._refresh()

    def _refresh(self) -> None:
        self.num_blocks = self.info.num_blocks
        reported = self.report.num_uncommitted_blocks if self.report is not None else self.info.num_blocks
        self.headroom_blocks = reported - self.reserved_blocks
        self.clean_headroom_blocks = self.headroom_blocks - (self.report.num_evictable_blocks if self.report else 0)
        limit = self.info.max_num_seqs
        if limit is None or not self.count_seq_slots:
            self.free_seq_slots = _NO_SLOT_LIMIT
        else:
            r = self.report
            unfinished = r.num_running + r.num_waiting if r is not None else 0
            self.free_seq_slots = limit - unfinished - len(self.reservations)
        if self._columns is not None:
            self._columns.update(self._row, self)

    def set_alive(self, alive: bool) -> None:
        self.alive = alive
        self._refresh()

    def apply_report(self, report: EngineStats, added_ids: Sequence[str], now: float) -> None:
        """A fresh report: reservations for requests it already counts are dropped."""
        if self.report is None or report.num_steps != self.report.num_steps:
            self.progress_at = now
        self.new_preemptions = report.num_preemptions - self.report.num_preemptions if self.report is not None else 0
        self.report = report
        self.last_report_at = now
        for request_id in added_ids:
            self.reserved_blocks -= self.reservations.pop(request_id, 0)
        self._refresh()

    @property
    def has_work(self) -> bool:
        """Requests placed here, or running or waiting in its last report."""
        r = self.report
        return bool(self.outstanding) or (r is not None and r.num_running + r.num_waiting > 0)

    def charge(self, need_blocks: int, block_hashes: Sequence[BlockHash] = (), hint: int = 0) -> int:
        """The blocks a request committing need_blocks newly commits here: less its
        prompt's leading blocks that an outstanding request already holds, with the worker's
        prefix cache on. hint: how many of them its cache holds (SharedPrefixes.shared)."""
        return self.prompts.charge(need_blocks, block_hashes, hint) if self.info.prefix_caching else need_blocks

    def place(self, request_id: str, need_blocks: int, block_hashes: Sequence[BlockHash] = ()) -> int:
        """Reserve the request here at its charge (returned) and count its prompt blocks."""
        self.prompts.remove(request_id)  # placed again: its own blocks are no share of its own
        blocks = self.charge(need_blocks, block_hashes)
        self.reserved_blocks += blocks - self.reservations.get(request_id, 0)
        self.reservations[request_id] = blocks
        self.outstanding.add(request_id)
        if self.info.prefix_caching:
            self.prompts.add(request_id, block_hashes)
        self._refresh()
        return blocks

    def refused(self, num_committed_blocks: int) -> None:
        """The worker refused a request (AddRefused): it counts num_committed_blocks, more
        than its last report, which other routers' requests explain. Until its next report,
        place against that."""
        if self.report is not None and num_committed_blocks > self.report.num_committed_blocks:
            self.report = dataclasses.replace(self.report, num_committed_blocks=num_committed_blocks)
            self._refresh()

    def release(self, request_id: str) -> None:
        """The request ended (or never reached the engine): forget it here."""
        self.reserved_blocks -= self.reservations.pop(request_id, 0)
        self.outstanding.discard(request_id)
        self.prompts.remove(request_id)
        self._refresh()


@dataclass(frozen=True)
class CacheHits:
    """Of a request's prompt_blocks full prompt blocks, how many leading ones each worker
    holds (absent: none). Those are blocks the worker would not compute, nor newly hold."""

    prompt_blocks: int
    by_worker: Mapping[str, int]
    block_hashes: Sequence[BlockHash] = ()  # the prompt's, for WorkerView.charge


class PlacementPolicy(Protocol):
    """Picks a worker for a request that commits `need_blocks` (reservation()), or None: not now.

    hits: what the workers' prefix caches hold of the request's prompt
    (router/prefix_index.py); policies blind to the cache ignore it. longest_blocks: the
    blocks the request holds at its longest (prompt + max_tokens); every policy passes
    over a worker whose pool is smaller, so wherever a request committed below its
    longest is placed, it can finish."""

    name: str
    # Places only where the request's commitment fits: its sends ask the worker to refuse
    # what it cannot commit (AddRequest.must_fit). Blind policies over-commit by design.
    kv_aware: bool
    # Reads the hits. A policy that does not refuses a request only for its sizes, so where
    # it refused one it refuses any at least as large (commitment and longest) while no
    # worker gains room (the router's backfill scan relies on it).
    reads_hits: bool

    def choose(
        self, workers: Sequence[WorkerView], need_blocks: int, hits: CacheHits | None = None, longest_blocks: int = 0
    ) -> WorkerView | None: ...


_NO_SLOT_LIMIT = 1 << 30


def _eligible(workers: Sequence[WorkerView], need_blocks: int, max_outstanding: int,
              longest_blocks: int = 0) -> list[WorkerView]:
    size = max(need_blocks, longest_blocks)
    return [
        w for w in workers
        if w.alive and size <= w.total_blocks and len(w.outstanding) < max_outstanding
    ]


# From this many workers the kv pass runs over ViewColumns' arrays: one decision costs
# ~6 us with numpy at any size up to 1,000 workers, against ~0.05 us per worker as a
# Python loop (48 us at 1,000), which is the cheaper below about 120 workers.
VECTOR_MIN_WORKERS = 128


def reservation(num_prompt_tokens: int, max_tokens: int, num_output_tokens: int, need_blocks: int,
                ratio: float, block_size: int) -> tuple[int, int | None]:
    """What a placement commits (RouterConfig.kv_reserve_ratio): the blocks of the prompt
    and of ceil(ratio x max_tokens) output tokens, at least one more than the request has
    already made (a moved request prefills those at once), and those tokens (None: all of
    max_tokens, need_blocks). The policy places it only on a worker whose pool holds its
    longest (need_blocks: choose()'s longest_blocks), so wherever the reservation finds
    room the request can finish there, growing into blocks others free or by preempting
    them."""
    if ratio >= 1:
        return need_blocks, None
    tokens = min(max_tokens, max(math.ceil(ratio * max_tokens), num_output_tokens + 1))
    if tokens == max_tokens:
        return need_blocks, None
    return blocks_for_tokens(num_prompt_tokens + tokens - 1, block_size), tokens


class ReserveRatio:
    """The ratio reservation() commits at. Fixed at `ceiling` without a floor; with one, it
    adapts to the answers requests actually give and to the preemptions it causes.

    What it falls to, its *target*, is learned from the requests that ended: `ceiling`
    times the 90th percentile of their output over their max_tokens (the last
    LEARN_WINDOW of them, once LEARN_MIN have ended; `ceiling` before), never below
    `floor`. The ceiling says what share of a request's final length to commit while it
    is in flight (0.5: requests in flight are on average half way); the percentile says
    what share of max_tokens a final length is. Requests that run to max_tokens keep it at
    the ceiling, so it commits as the fixed ratio does; answers that stop at a quarter of
    max_tokens bring it to a quarter of the ceiling. Every end counts (EOS, a stop, a
    cancel: what matters to KV is how long a request held it), except an error and a
    request that never ran.

    Right after any worker preempts it is `ceiling` again, and each second without a
    preemption lowers it by (ceiling - target) / decay_s, as SGLang lowers its
    new_token_ratio, until it is at the target.

        ceiling 0.5, floor 0.1, decay 20 s, answers at a fifth of max_tokens (target 0.1):
            t=0 preempt -> 0.5;  t=10 -> 0.3;  t>=20 -> 0.1
        the same, answers at max_tokens (target 0.5): 0.5 throughout

    Learning from ends rather than only from preemptions matters: a preemption comes a
    whole generation after the placements that caused it, so a ratio that fell on time
    alone let too many start whenever answers ran long (2026-12-06: p99 TTFT 4.62 s
    against 1.97 s fixed, at capacity, every request to max_tokens)."""

    # Ends remembered, and how many before the target moves off the ceiling.
    LEARN_WINDOW = 256
    LEARN_MIN = 32
    LEARN_QUANTILE = 0.9

    __slots__ = ("ceiling", "floor", "decay_s", "since", "target", "_ends")

    def __init__(self, ceiling: float, floor: float | None = None, decay_s: float = 20.0,
                 now: float | None = None) -> None:
        self.ceiling = ceiling
        self.floor = ceiling if floor is None else floor
        self.decay_s = decay_s
        # When it was last at the ceiling: the last preemption seen, or the start.
        self.since = time.monotonic() if now is None else now
        self.target = ceiling
        self._ends: collections.deque[float] = collections.deque(maxlen=self.LEARN_WINDOW)

    def at(self, now: float) -> float:
        """The ratio to commit at, at monotonic time `now`."""
        target = self.target
        if target >= self.ceiling:
            return self.ceiling
        elapsed = now - self.since
        if elapsed >= self.decay_s:
            return target
        return self.ceiling - (self.ceiling - target) * max(elapsed, 0.0) / self.decay_s

    def preempted(self, now: float) -> None:
        """A worker preempted (its report's counter rose): back to the ceiling."""
        self.since = now

    def ended(self, num_output_tokens: int, max_tokens: int) -> None:
        """A request ended with num_output_tokens of its max_tokens: learn from it."""
        if self.floor >= self.ceiling or max_tokens < 1:
            return
        self._ends.append(min(num_output_tokens / max_tokens, 1.0))
        if len(self._ends) >= self.LEARN_MIN:
            # inverted_cdf: an observed share (the nearest rank), not one between two
            share = float(np.quantile(np.fromiter(self._ends, float), self.LEARN_QUANTILE, method="inverted_cdf"))
            self.target = min(self.ceiling, max(self.floor, self.ceiling * share))


class ViewColumns(list[WorkerView]):
    """A list of views (read-only) that also keeps, as numpy columns, the numbers the kv
    pass reads of each: what it can take (its headroom, or -inf when it is dead or has no
    free sequence slot), its total blocks, and its outstanding requests; and, for the
    prefix policy, its clean headroom (less the blocks holding cached prefixes). Each view
    writes its row whenever its numbers change (WorkerView._refresh), so a decision reads
    the columns without a pass over the views. Below min_rows views it keeps no columns
    (the loop is cheaper there, and the views then write nothing).

    A view belongs to one ViewColumns at a time: a newer one over the same view takes it,
    and the older is then `stale` and no longer used for the fast path."""

    def __init__(self, views: Sequence[WorkerView] = (), min_rows: int | None = None) -> None:
        super().__init__(views)
        n = len(self)
        self.vectorised = n >= (VECTOR_MIN_WORKERS if min_rows is None else min_rows)
        if not self.vectorised:
            return
        # Written through the array.array (a store there is a C double, cheaper than numpy's
        # scalar path), read through numpy views of the same memory.
        self._rows = tuple(array("d", bytes(8 * n)) for _ in range(4))
        self.free, self.total, self.load, self.clean = (np.frombuffer(a) for a in self._rows)
        self._share = np.empty(n)  # scratch for kv_choice and miss_choice
        self._evicts = np.empty(n)
        self._full = np.empty(n, dtype=bool)
        for row, view in enumerate(self):
            if view._columns is not None and view._columns is not self:
                view._columns.vectorised = False  # stale: its rows for this view stop here
            view._columns, view._row = self, row
            self.update(row, view)

    @functools.cached_property
    def min_total_blocks(self) -> int:
        """The smallest pool among these views (0 if none): fixed while the list is."""
        return min((view.num_blocks for view in self), default=0)

    def update(self, row: int, view: WorkerView) -> None:
        free, total, load, clean = self._rows
        free[row] = view.headroom_blocks if view.alive and view.free_seq_slots > 0 else -math.inf
        total[row] = view.num_blocks
        load[row] = len(view.outstanding)
        clean[row] = max(0, view.clean_headroom_blocks)

    def _best(self, score: np.ndarray, row: int | None = None) -> WorkerView | None:
        """The row of the highest score (-inf: not eligible; row: its argmax, if known),
        then the fewest outstanding, then the first."""
        if row is None:
            row = int(score.argmax())
        best = score[row]
        if best == -math.inf:
            return None
        ties = np.flatnonzero(score == best)
        if len(ties) > 1:
            row = int(ties[self.load[ties].argmin()])
        return self[row]

    def kv_choice(self, need_blocks: int, max_outstanding: int, longest_blocks: int = 0) -> WorkerView | None:
        """KVPolicy's choice, vectorised: the largest free share after the request among
        views that can take it and are under the cap, then the fewest outstanding, then
        the first. The share is computed as the loop computes it, (headroom - need) /
        total in float64, so the two agree to the bit."""
        share, full = self._share, self._full
        np.subtract(self.free, need_blocks, out=share)
        np.divide(share, self.total, out=share)
        np.greater_equal(self.load, max_outstanding, out=full)
        if longest_blocks > self.min_total_blocks:
            full |= self.total < longest_blocks
        share[full] = -math.inf
        row = int(share.argmax())
        if not share[row] >= 0:  # no room anywhere (-inf, or every share negative)
            return None
        return self._best(share, row)

    def miss_choice(self, need_blocks: int, max_outstanding: int, load_weight: float,
                    per_evict: float, longest_blocks: int = 0) -> WorkerView | None:
        """PrefixPolicy's choice for a prompt nobody holds, vectorised: among views with room
        and under the cap, the highest -load_weight x (1 - share) - per_evict x evicts, where
        share is kv's and evicts = max(0, need - clean); then the fewest outstanding, then
        the first. Computed in the loop's order of operations, so the two agree to the bit."""
        share, evicts, full = self._share, self._evicts, self._full
        np.subtract(self.free, need_blocks, out=share)
        np.divide(share, self.total, out=share)
        np.greater_equal(self.load, max_outstanding, out=full)
        full |= share < 0
        if longest_blocks > self.min_total_blocks:
            full |= self.total < longest_blocks
        share[full] = 0.0  # not -inf: inf x a load weight of 0 would be nan (the row is dropped below)
        np.subtract(need_blocks, self.clean, out=evicts)
        np.maximum(evicts, 0.0, out=evicts)
        np.multiply(evicts, per_evict, out=evicts)
        np.subtract(1.0, share, out=share)
        np.multiply(share, -load_weight, out=share)
        np.subtract(share, evicts, out=share)
        share[full] = -math.inf
        return self._best(share)


class KVPolicy:
    """The default: only workers with KV room for this request's commitment, and among
    them the one left with the largest share of its KV free after it. Balancing the free
    share makes assignments proportional to capacity (a worker with twice the KV takes
    twice the requests) and spreads a light load over every worker."""

    name = "kv"
    kv_aware = True
    reads_hits = False

    def __init__(self, max_outstanding: int) -> None:
        self.max_outstanding = max_outstanding

    def choose(
        self, workers: Sequence[WorkerView], need_blocks: int, hits: CacheHits | None = None, longest_blocks: int = 0
    ) -> WorkerView | None:
        # From VECTOR_MIN_WORKERS up, the same choice over ViewColumns' arrays. Below it,
        # one pass, no allocation (60 us at 1,000 workers before the reordering below,
        # ~half of it after). A worker that cannot
        # beat the best so far is passed over on two attribute reads; in random order a new
        # best turns up O(log n) times, so the other checks run for few workers.
        cap = self.max_outstanding
        if type(workers) is ViewColumns and workers.vectorised:
            return workers.kv_choice(need_blocks, cap, longest_blocks)
        best: WorkerView | None = None
        best_share = 0.0  # a share below 0 means "does not fit" (headroom <= total)
        best_load = 0
        for w in workers:
            share = (w.headroom_blocks - need_blocks) / w.num_blocks
            if share < best_share or not w.alive or w.free_seq_slots <= 0 or w.num_blocks < longest_blocks:
                continue
            load = len(w.outstanding)
            if load >= cap:
                continue
            if best is None or share > best_share or load < best_load:
                best, best_share, best_load = w, share, load
        return best


class KVLeastLoadedPolicy:
    """Only workers with KV room, and among them the fewest outstanding requests: KV as a
    hard constraint, compute balance as the ranking."""

    name = "kv-least-loaded"
    kv_aware = True
    reads_hits = False

    def __init__(self, max_outstanding: int) -> None:
        self.max_outstanding = max_outstanding

    def choose(
        self, workers: Sequence[WorkerView], need_blocks: int, hits: CacheHits | None = None, longest_blocks: int = 0
    ) -> WorkerView | None:
        best: WorkerView | None = None
        best_key = (0, 0)
        for w in workers:
            if (w.headroom_blocks < need_blocks or not w.alive or w.free_seq_slots <= 0
                    or w.num_blocks < longest_blocks):
                continue
            load = len(w.outstanding)
            if load >= self.max_outstanding:
                continue
            key = (load, -w.headroom_blocks)
            if best is None or key < best_key:
                best, best_key = w, key
        return best


class LeastRequestsPolicy:
    """Fewest outstanding requests, blind to KV (for comparison)."""

    name = "least-requests"
    kv_aware = False
    reads_hits = False

    def __init__(self, max_outstanding: int) -> None:
        self.max_outstanding = max_outstanding

    def choose(
        self, workers: Sequence[WorkerView], need_blocks: int, hits: CacheHits | None = None, longest_blocks: int = 0
    ) -> WorkerView | None:
        eligible = _eligible(workers, need_blocks, self.max_outstanding, longest_blocks)
        return min(eligible, key=lambda w: len(w.outstanding)) if eligible else None


class RoundRobinPolicy:
    """Each worker in turn, blind to KV (for comparison)."""

    name = "round-robin"
    kv_aware = False
    reads_hits = False

    def __init__(self, max_outstanding: int) -> None:
        self.max_outstanding = max_outstanding
        self._next = 0

    def choose(
        self, workers: Sequence[WorkerView], need_blocks: int, hits: CacheHits | None = None, longest_blocks: int = 0
    ) -> WorkerView | None:
        for i in range(len(workers)):
            w = workers[(self._next + i) % len(workers)]
            if w in _eligible([w], need_blocks, self.max_outstanding, longest_blocks):
                self._next = (self._next + i + 1) % len(workers)
                return w
        return None


class RandomPolicy:
    """A uniformly random worker, blind to KV (for comparison)."""

    name = "random"
    kv_aware = False
    reads_hits = False

    def __init__(self, max_outstanding: int, seed: int = 0) -> None:
        self.max_outstanding = max_outstanding
        self._rng = random.Random(seed)

    def choose(
        self, workers: Sequence[WorkerView], need_blocks: int, hits: CacheHits | None = None, longest_blocks: int = 0
    ) -> WorkerView | None:
        eligible = _eligible(workers, need_blocks, self.max_outstanding, longest_blocks)
        return self._rng.choice(eligible) if eligible else None


@dataclass(frozen=True)
class PrefixWeights:
    """The `prefix` policy's knobs (kvserve up --prefix-weight, --load-weight,
    --evict-weight, --balance-abs, --balance-rel); README "How a request is placed" has
    the formula."""

    prefix_weight: float = 1.0
    load_weight: float = 1.0
    evict_weight: float = 1.0
    balance_abs: int = 8
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        for name in ("prefix_weight", "load_weight", "evict_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PrefixWeights.{name} must be >= 0, got {getattr(self, name)}")
        if self.balance_abs < 0:
            raise ValueError(f"PrefixWeights.balance_abs must be >= 0, got {self.balance_abs}")
        if not self.balance_rel >= 1:
            raise ValueError(f"PrefixWeights.balance_rel must be >= 1, got {self.balance_rel}")


class PrefixPolicy:
    """Send a request where its prompt's KV already is, among workers with room for it.

    For each live worker w with room for the request's commitment and under the
    outstanding cap:

        score(w) = (prefix_weight x cached(w) - evict_weight x evicts(w)) / prompt_blocks
                   - load_weight x kv_load(w)
        kv_load(w) = 1 - (headroom(w) - charge(w)) / total(w)
        evicts(w) = max(0, need - cached(w) - max(0, headroom(w) - evictable(w)))

    and the highest score wins (ties: fewer outstanding, then the first). Room and load
    are judged on the request's charge there (WorkerView.charge): its whole need less the
    prompt blocks this router's unfinished requests on w already hold. A cached block
    nobody holds counts: the request commits it again when it takes it.

    evicts(w) is how many cached blocks of other prompts the request's new blocks would
    push out on w (it takes clean free blocks first; evictable(w) from w's last report).
    Without it a partial hit on a worker whose cache is full of other groups' prefixes
    scores as a gain, a new group lands on whichever worker has the most free share
    counting cached blocks as free, and the groups placed together take turns evicting
    each other's tails while another worker has clean room (bench-prefix, 2026-12-03:
    four groups on a worker that holds 3.6, 2-3 s recomputes each time). evict_weight 0
    is the policy before that.

    The decision is one pass over every worker for the best score without a hit (the
    miss's choice: kv's own pass, since -load_weight x kv_load orders as kv's free share,
    and a second pass, vectorised over ViewColumns from 128 workers, only when kv's
    choice would evict) plus a look at the few that hold the prompt: as cheap as
    kv at 1,000 workers. Two guards keep affinity from overloading one worker while others
    idle: with nothing cached anywhere it is the `kv` policy; and when the chosen worker
    has more than balance_abs more outstanding requests than the miss's choice and more
    than balance_rel times as many, the miss's choice wins (SGLang's router balances on
    the same two thresholds)."""

    name = "prefix"
    kv_aware = True
    reads_hits = True

    def __init__(self, max_outstanding: int, weights: PrefixWeights | None = None) -> None:
        self.max_outstanding = max_outstanding
        self.weights = weights or PrefixWeights()
        self._kv = KVPolicy(max_outstanding)
        # worker id -> its view, for the workers that hold a prompt; rebuilt from the
        # workers passed in when an id is missing or its view has died (a rejoined worker
        # gets a new view).
        self._views: dict[str, WorkerView] = {}

    def choose(
        self, workers: Sequence[WorkerView], need_blocks: int, hits: CacheHits | None = None, longest_blocks: int = 0
    ) -> WorkerView | None:
        if hits is None:
            return self._kv.choose(workers, need_blocks, None, longest_blocks)
        weights = self.weights
        per_hit = weights.prefix_weight / max(hits.prompt_blocks, 1)
        per_evict = weights.evict_weight / max(hits.prompt_blocks, 1)
        load_weight = weights.load_weight
        # The best worker as if nothing of the prompt were cached anywhere (kv's choice when
        # evictions cost nothing): what a miss gets, and the yardstick of the balance guard.
        miss = self._miss_choice(workers, need_blocks, load_weight, per_evict, longest_blocks)
        if not hits.by_worker:
            return miss
        hot: WorkerView | None = None  # the best-scoring worker that holds some of the prompt
        hot_score = 0.0
        hot_load = 0
        views = self._views
        for worker_id, hit in hits.by_worker.items():
            w = views.get(worker_id)
            if w is None or not w.alive:
                w = self._view(worker_id, workers)
                views = self._views
            if w is None or not w.alive or w.free_seq_slots <= 0 or w.num_blocks < longest_blocks:
                continue
            after = w.headroom_blocks - w.charge(need_blocks, hits.block_hashes, hit)  # also means "fits"
            load = len(w.outstanding)
            if after < 0 or load >= self.max_outstanding:
                continue
            score = per_hit * hit - load_weight * (1 - after / w.num_blocks)
            clean = w.clean_headroom_blocks  # inline _evicts: this loop runs for every holder
            evicts = need_blocks - hit - (clean if clean > 0 else 0)
            if evicts > 0:
                score -= per_evict * evicts
            if hot is None or score > hot_score or (score == hot_score and load < hot_load):
                hot, hot_score, hot_load = w, score, load
        if hot is None or miss is None or miss is hot:
            return hot or miss
        miss_hit = hits.by_worker.get(miss.info.worker_id, 0)
        miss_after = miss.headroom_blocks - miss.charge(need_blocks, hits.block_hashes, miss_hit)
        miss_score = (per_hit * miss_hit - per_evict * _evicts(miss, need_blocks, miss_hit)
                      - load_weight * (1 - miss_after / miss.num_blocks))
        if miss_score > hot_score:
            return miss
        miss_load = len(miss.outstanding)
        if hot_load - miss_load > weights.balance_abs and hot_load > weights.balance_rel * miss_load:
            return miss
        return hot

    def _miss_choice(self, workers: Sequence[WorkerView], need_blocks: int, load_weight: float,
                     per_evict: float, longest_blocks: int = 0) -> WorkerView | None:
        """The highest score with no hit: -load_weight x kv_load - per_evict x evicts, ties to
        the fewest outstanding, then the first. kv's choice when evictions cost nothing or
        it would evict nothing; else a pass of its own (ViewColumns.miss_choice, vectorised)."""
        kv = self._kv.choose(workers, need_blocks, None, longest_blocks)
        # kv's choice has the best -load_weight x kv_load (load_weight > 0); if it evicts
        # nothing, no worker scores higher (the eviction term only lowers a score), and on
        # a tie kv's order (fewer outstanding, then the first) is this one's: it is the
        # choice. So the full pass runs only when the freest worker would evict.
        if per_evict == 0 or kv is None or (load_weight > 0 and need_blocks <= kv.clean_headroom_blocks):
            return kv
        cap = self.max_outstanding
        if type(workers) is ViewColumns and workers.vectorised:
            return workers.miss_choice(need_blocks, cap, load_weight, per_evict, longest_blocks)
        best: WorkerView | None = None
        best_score = 0.0
        best_load = 0
        for w in workers:
            share = (w.headroom_blocks - need_blocks) / w.num_blocks
            if share < 0 or not w.alive or w.free_seq_slots <= 0 or w.num_blocks < longest_blocks:
                continue
            load = len(w.outstanding)
            if load >= cap:
                continue
            score = -load_weight * (1.0 - share) - per_evict * _evicts(w, need_blocks, 0)
            if best is None or score > best_score or (score == best_score and load < best_load):
                best, best_score, best_load = w, score, load
        return best

    def _view(self, worker_id: str, workers: Sequence[WorkerView]) -> WorkerView | None:
        view = self._views.get(worker_id)
        if view is None or not view.alive:
            self._views = {w.info.worker_id: w for w in workers}
            view = self._views.get(worker_id)
        return view


def _evicts(w: WorkerView, need_blocks: int, hit: int) -> int:
    """The cached blocks a request of need_blocks, hit of them cached on w, would evict
    there: its new blocks beyond w's clean free ones (uncommitted, not holding a cached
    prefix). From w's last report; a worker without one has evicted nothing yet."""
    return max(0, need_blocks - hit - max(0, w.clean_headroom_blocks))


POLICIES = ("kv", "prefix", "kv-least-loaded", "least-requests", "round-robin", "random")


def make_policy(name: str, max_outstanding: int, prefix_weights: PrefixWeights | None = None) -> PlacementPolicy:
    if name == "prefix":
        return PrefixPolicy(max_outstanding, prefix_weights)
    if name == "kv":
        return KVPolicy(max_outstanding)
    if name == "kv-least-loaded":
        return KVLeastLoadedPolicy(max_outstanding)
    if name == "least-requests":
        return LeastRequestsPolicy(max_outstanding)
    if name == "round-robin":
        return RoundRobinPolicy(max_outstanding)
    if name == "random":
        return RandomPolicy(max_outstanding)
    raise ValueError(f"placement policy must be one of {', '.join(POLICIES)}, got {name!r}")
