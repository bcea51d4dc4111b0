"""What crosses between a worker actor and the router: plain, picklable values.

A request's full data goes to its worker once (AddRequest); after that only what
changed travels: one StepBatch per engine step per worker, carrying the token events of
every request in that step and the worker's KV report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.block_hash import BlockHash
from workers.engine.stats import EngineStats
from workers.engine.plan import TokenEvent
from workers.engine.request import Resume
from workers.engine.sampling import SamplingParams
from workers.model.tokenizer import TokenizerSpec


class WorkerLoadError(RuntimeError):
    """A worker's engine could not load its model (a missing file, a model that does not
    fit): raised by the worker's info(), the first call a router makes, so the one line
    that says why reaches the router as this exception and not as an actor's death."""

    @staticmethod
    def why(exc: BaseException) -> str:
        """The reason alone: Ray raises it wrapped, and the wrapper's str() is a traceback."""
        return str(getattr(exc, "cause", exc))


@dataclass(frozen=True)
class WorkerInfo:
    """Sent once when a worker is up: what the router validates and places against."""

    worker_id: str
    node_id: str
    model: str
    device: str
    dtype: str
    vocab_size: int
    max_model_len: int
    block_size: int
    block_bytes: int
    num_blocks: int
    tokenizer: TokenizerSpec
    # Most requests its engine runs at once; the router places no more than that there
    # (running + waiting + on their way) and keeps the rest in its own queue. None: no limit.
    max_num_seqs: int | None = None
    # Its engine's prefix cache is on: requests sharing a prompt prefix there share its blocks.
    prefix_caching: bool = False
    # Where a router reads this worker's events (workers/events_wire.py): host:port, and
    # the token its hello must carry. Set by the actor once it serves them.
    events_address: str = ""
    events_token: str = field(default="", repr=False)


@dataclass(frozen=True)
class AddRequest:
    """A request for a worker's engine. request_id is the router's key for this placement
    (see router.core.engine_key): a moved request gets a new one, so the events of an
    earlier placement can never be taken for this one's."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    resume: Resume | None = None  # set when the request moved here from another worker
    cache_salt: str | None = None  # prefix-cache isolation: shares KV only within one salt
    # The router that placed it: its token events go to that router's stream only.
    router_id: str = ""
    # Refuse it (AddRefused) unless the worker can commit its blocks now (its prompt and
    # committed_tokens of output): routers that cannot see each other's reservations
    # still never over-commit a worker.
    must_fit: bool = False
    # Its prompt's full block hashes (workers/engine/block_hash.py, as the router's prefix
    # index names them): the commit ledger charges it less the blocks requests already
    # here share with it (workers/engine/shared_prefix.py).
    block_hashes: tuple[BlockHash, ...] = ()
    # The output tokens its commitment counts (the router's --kv-reserve-ratio of
    # max_tokens): None, all of max_tokens. A request that grows past it holds what it
    # holds; a worker that runs out of blocks preempts.
    reserve_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.reserve_tokens is not None and not 1 <= self.reserve_tokens <= self.params.max_tokens:
            raise ValueError(f"AddRequest.reserve_tokens must be in [1, max_tokens={self.params.max_tokens}], "
                             f"got {self.reserve_tokens}")

    @property
    def committed_tokens(self) -> int:
        """The output tokens the worker commits KV for: reserve_tokens, or max_tokens."""
        return self.params.max_tokens if self.reserve_tokens is None else self.reserve_tokens


@dataclass(frozen=True)
class AddRefused:
    """What add_request answers for a must_fit request that does not fit: the worker's
    committed blocks (its last report plus requests taken since) and the request's need."""

    request_id: str
    num_committed_blocks: int
    num_total_blocks: int
    need_blocks: int


@dataclass(frozen=True)
class KVEventBatch:
    """A worker's prefix-cache changes since its previous batch, in order: stored True is
    a block cached (full, its KV written), False one evicted. seq counts the batches that
    carry changes, from 1 per worker process, so a gap shows a lost batch."""

    seq: int
    events: tuple[tuple[bool, BlockHash], ...]


@dataclass(frozen=True)
class KVSnapshot:
    """Everything a worker's cache holds, as of its batch number seq."""

    seq: int
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class StepBatch:
    """Everything a worker has to say since its last batch.

    report: its engine's KV pool, queues and prefix-cache counters after the last step.
    added_ids: requests the engine took in since the last batch (their KV is now inside
    report.num_committed_blocks, so the router drops its in-flight reservation for them).
    """

    report: EngineStats
    events: tuple[TokenEvent, ...] = ()
    added_ids: tuple[str, ...] = ()
    heartbeat: bool = False  # sent by the actor's event loop: nothing new, still alive
    kv_events: KVEventBatch | None = None  # prefix-cache changes since the last batch that had some
    sent_at: float = 0.0  # the worker's time.time() as it published the batch (latency probes)
    handed_at: float = 0.0  # the actor's time.time() as its stream handed the batch to Ray (likewise)
    step_s: float = 0.0  # the engine step's own time (perf_counter) in the engine process, of the last step
