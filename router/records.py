"""The values the request store keeps: a request's record and its token log entries.

Plain data with their Redis encodings; router/state.py does the I/O.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.engine.sampling import SamplingParams


class RequestStatus(str, enum.Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"

    @property
    def is_finished(self) -> bool:
        return self in _ENDED_STATUSES


_ENDED_STATUSES = frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED})
_STATUS_VALUES = frozenset(status.value for status in RequestStatus)


@dataclass
class RequestRecord:
    """One request's hash, decoded. Times are unix seconds; 0.0 means "not yet"."""

    request_id: str
    status: RequestStatus
    prompt_ids: list[int]
    sampling: dict[str, Any]
    seed: int | None = None
    worker_id: str = ""
    created_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    finish_reason: str = ""
    num_output_tokens: int = 0
    error: str = ""
    num_migrations: int = 0
    prompt_text: str = ""  # what prompt_ids were encoded from ("" for token ids)
    cached_prompt_tokens: int = 0  # prompt tokens its worker's prefix cache held (Usage)
    # When the first worker to take it accepted it (0.0: none yet): an adopter observes the
    # queue time of a request no worker took, and only of such a one.
    accepted_at: float = 0.0
    router_id: str = ""  # the router that owns it (router/ownership.py); "" for none
    # A client asked another router to cancel it (Ownership.ask_to_cancel): whoever owns it
    # next ends it instead of running it.
    cancel_requested: bool = False
    # GenerateRequest.cache_salt: kept so that a move or an adoption hashes its prompt, and
    # shares cached KV, as the first placement did. "" for none (the API refuses an empty one).
    cache_salt: str = ""

    @property
    def is_finished(self) -> bool:
        """True once FINISHED, CANCELLED or FAILED."""
        return self.status.is_finished

    def to_fields(self) -> dict[str, str]:
        """The hash fields, as stored."""
        return {
            "status": self.status.value,
            "prompt_ids": json.dumps(self.prompt_ids, separators=(",", ":")),
            "sampling": json.dumps(self.sampling, separators=(",", ":"), sort_keys=True),
            "seed": "" if self.seed is None else str(self.seed),
            "worker_id": self.worker_id,
            "created_at": repr(self.created_at),
            "first_token_at": repr(self.first_token_at),
            "finished_at": repr(self.finished_at),
            "finish_reason": self.finish_reason,
            "num_output_tokens": str(self.num_output_tokens),
            "error": self.error,
            "num_migrations": str(self.num_migrations),
            "prompt_text": self.prompt_text,
            "cached_prompt_tokens": str(self.cached_prompt_tokens),
            **({"accepted_at": repr(self.accepted_at)} if self.accepted_at else {}),
            "router_id": self.router_id,
            **({"cancel_requested": "1"} if self.cancel_requested else {}),
            **({"cache_salt": self.cache_salt} if self.cache_salt else {}),
        }

    @classmethod
    def from_fields(cls, request_id: str, fields: Mapping[str, str]) -> RequestRecord:
        """Decode a hash; fields it lacks take their defaults."""
        seed = fields.get("seed", "")
        return cls(
            request_id=request_id,
            status=RequestStatus(fields["status"]),
            prompt_ids=[int(t) for t in json.loads(fields.get("prompt_ids") or "[]")],
            sampling=dict(json.loads(fields.get("sampling") or "{}")),
            seed=int(seed) if seed else None,
            worker_id=fields.get("worker_id", ""),
            created_at=float(fields.get("created_at") or 0.0),
            first_token_at=float(fields.get("first_token_at") or 0.0),
            finished_at=float(fields.get("finished_at") or 0.0),
            finish_reason=fields.get("finish_reason", ""),
            num_output_tokens=int(fields.get("num_output_tokens") or 0),
            error=fields.get("error", ""),
            num_migrations=int(fields.get("num_migrations") or 0),
            prompt_text=fields.get("prompt_text", ""),
            cached_prompt_tokens=int(fields.get("cached_prompt_tokens") or 0),
            accepted_at=float(fields.get("accepted_at") or 0.0),
            router_id=fields.get("router_id", ""),
            cancel_requested=fields.get("cancel_requested", "") == "1",
            cache_salt=fields.get("cache_salt", ""),
        )


def sampling_params(sampling: Mapping[str, Any]) -> SamplingParams:
    """A stored sampling object (RequestRecord.sampling) as SamplingParams; raises on a
    record written by something else (InvalidRequestError, TypeError)."""
    args = dict(sampling)
    args["stop"] = tuple(args.get("stop", ()))
    args["stop_token_ids"] = tuple(args.get("stop_token_ids", ()))
    return SamplingParams(**args)


@dataclass(frozen=True)
class LogEntry:
    """The tokens one engine step gave one request, starting at output offset `offset`.

    `token_ids` may be empty for an entry of text alone (text released late).

    `text` is the detokenized delta and belongs to the LAST token; `logprobs` is
    empty or has one object per token.
    """

    offset: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if not self.token_ids and not self.text:
            raise ValueError("a log entry needs token_ids or text")
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"logprobs must be empty or one per token: {len(self.logprobs)} for "
                f"{len(self.token_ids)} token_ids"
            )

    @property
    def end_offset(self) -> int:
        """The output offset just past this entry's last token."""
        return self.offset + len(self.token_ids)

    def to_json(self) -> str:
        element: dict[str, Any] = {"o": self.offset, "ids": list(self.token_ids), "t": self.text}
        if self.logprobs:
            element["lp"] = list(self.logprobs)
            return json.dumps(element, separators=(",", ":"))
        # What json.dumps writes for it, built by hand: one entry per request per step.
        ids = ",".join(map(str, self.token_ids))
        return f'{{"o":{self.offset},"ids":[{ids}],"t":{json.encoder.encode_basestring_ascii(self.text)}}}'

    @classmethod
    def from_json(cls, raw: str) -> LogEntry:
        element = json.loads(raw)
        return cls(
            offset=int(element["o"]),
            token_ids=tuple(int(t) for t in element["ids"]),
            text=str(element.get("t", "")),
            logprobs=tuple(element.get("lp", ())),
        )

    def starting_at(self, from_offset: int) -> LogEntry:
        """This entry without its tokens before `from_offset`; the text stays whole."""
        skip = from_offset - self.offset
        if skip <= 0:
            return self
        return LogEntry(
            offset=from_offset,
            token_ids=self.token_ids[skip:],
            text=self.text,
            logprobs=self.logprobs[skip:],
        )


@dataclass(frozen=True)
class LogEnd:
    """The end marker of a request's token log: how it ended, as the ending write had it."""

    status: RequestStatus
    finish_reason: str
    error: str
    num_output_tokens: int

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> LogEnd:
        return cls(
            status=RequestStatus(fields["end"]),
            finish_reason=fields.get("finish_reason", ""),
            error=fields.get("error", ""),
            num_output_tokens=int(fields.get("n") or 0),
        )

    @classmethod
    def of_record(cls, record: RequestRecord) -> LogEnd:
        """The end a record says, for a log that has no marker (it ended before markers)."""
        return cls(record.status, record.finish_reason, record.error, record.num_output_tokens)


@dataclass(frozen=True)
class StepWrite:
    """One request's share of an engine step.

    `entry` is the log entry to append (None: only field updates); `fields` are
    hash fields to set. Setting `status` to an ended status ends the request.
    """

    request_id: str
    entry: LogEntry | None
    fields: Mapping[str, str | int | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        status = self.fields.get("status")
        if isinstance(status, RequestStatus):
            status = status.value
        if status is not None and status not in _STATUS_VALUES:
            raise ValueError(f"fields['status'] must be one of {sorted(_STATUS_VALUES)}, got {status!r}")

    @property
    def entry_json(self) -> str:
        """The entry as the log stores it ("" for none), encoded once: a write the
        recorder sends again after an outage reuses it. (Cached by hand: Python 3.11's
        functools.cached_property takes one lock for every instance of the class, on
        every token's path.)"""
        cached: str | None = self.__dict__.get("_entry_json")
        if cached is None:
            cached = self.__dict__["_entry_json"] = "" if self.entry is None else self.entry.to_json()
        return cached

    @property
    def offset(self) -> int:
        return 0 if self.entry is None else self.entry.offset

    @property
    def end_offset(self) -> int:
        return 0 if self.entry is None else self.entry.end_offset
