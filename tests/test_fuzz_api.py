"""The fuzz run: generated bad requests through a real cluster.

Hypothesis draws every field of every request message: empty, huge and badly formed ids
(and ids that are taken or unknown), text that is empty, huge or not UTF-8, token ids that
are negative, huge or outside the vocabulary, sampling numbers that are negative, NaN,
infinite or huge, too many or too long stop strings, and messages over the size limit;
plus raw bytes that may not be a message at all. The requests go out as hand-serialized
bytes, so a string field can carry bytes that are not UTF-8 (a protobuf client refuses to).

A request with one bad field must get exactly its status, naming that field; any request
must get success or one of INVALID_ARGUMENT (naming a field), NOT_FOUND, ALREADY_EXISTS,
RESOURCE_EXHAUSTED, and never UNKNOWN or INTERNAL. Afterwards the router still serves the
reference engine's output and every worker's KV is free again.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from router.core import RouterConfig
from router.server import SERVICE_NAME, ServerConfig
from router.validation import MAX_CACHE_SALT_LENGTH
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    greedy_request,
    parse_stream,
    running_cluster,
    wait_for,
    wait_idle,
)

VOCAB_SIZE = 258  # the tiny preset
MAX_PROMPT_TOKENS, MAX_TOKENS_LIMIT, MAX_MESSAGE_BYTES = 256, 16, 64 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
OK = grpc.StatusCode.OK
INVALID, NOT_FOUND, EXISTS, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
ALLOWED = {OK, INVALID, NOT_FOUND, EXISTS, EXHAUSTED}
FIELDS = (
    "request", "request_id", "prompt", "prompt.text", "prompt.token_ids", "from_offset",
    "prompt.messages", "prompt.messages[i].role", "prompt.messages[i].content",  # [i]: any index
    "cache_salt",
    *(f"sampling.{name}" for name in pb.SamplingParams.DESCRIPTOR.fields_by_name),
)  # fmt: skip
FRESH, TAKEN = "<a new id>", "<the id of a finished request>"
EXAMPLES = dict(generate=160, ids=80, raw=60)
FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same examples on every run: CI is reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# -- requests as bytes ----------------------------------------------------------------------


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field on the wire: tag, length, payload."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


@dataclasses.dataclass
class Draft:
    """A GenerateRequest before serialization; a `bytes` string field goes out raw."""

    request_id: str | bytes = FRESH
    text: str | bytes | None = None
    token_ids: list[int] | None = None
    sampling: dict[str, Any] | None = None
    cache_salt: str | bytes | None = None

    def serialize(self, taken_id: str) -> bytes:
        request_id = _resolve(self.request_id, taken_id, "fz")
        message, raw = pb.GenerateRequest(), b""
        if isinstance(request_id, bytes):
            raw += _field(1, request_id)
        else:
            message.request_id = request_id
        if isinstance(self.text, bytes):
            raw += _field(2, self.text)
        elif self.text is not None:
            message.text = self.text
        if self.token_ids is not None:
            message.token_ids.ids.extend(self.token_ids)
        if self.sampling is not None:
            sampling, raw_stop = pb.SamplingParams(), b""
            for name, value in self.sampling.items():
                if name == "stop":
                    sampling.stop.extend(s for s in value if isinstance(s, str))
                    raw_stop += b"".join(_field(6, s) for s in value if isinstance(s, bytes))
                elif name == "stop_token_ids":
                    sampling.stop_token_ids.extend(value)
                else:
                    setattr(sampling, name, value)
            raw += _field(4, sampling.SerializeToString() + raw_stop)
        if isinstance(self.cache_salt, bytes):
            raw += _field(6, self.cache_salt)
        elif self.cache_salt is not None:
            message.cache_salt = self.cache_salt
        return message.SerializeToString() + raw

    def first_bad_utf8(self) -> str | None:
        """The field the router must name for bad UTF-8, checked in field-number order."""
        if isinstance(self.request_id, bytes):
            return "request_id"
        if isinstance(self.text, bytes):
            return "prompt.text"
        if self.sampling is not None and any(isinstance(s, bytes) for s in self.sampling.get("stop", ())):
            return "sampling.stop"
        if isinstance(self.cache_salt, bytes):
            return "cache_salt"
        return None


@dataclasses.dataclass(frozen=True)
class Expect:
    code: grpc.StatusCode
    field: str | None = None


# -- strategies -----------------------------------------------------------------------------

not_utf8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80", b"\xf8\x88\x80\x80\x80"]).flatmap(
    lambda bad: st.tuples(st.binary(max_size=8), st.binary(max_size=8)).map(lambda ends: ends[0] + bad + ends[1])
).filter(lambda raw: not _is_utf8(raw))
good_ids = st.just(FRESH)
bad_ids = st.one_of(
    st.text(min_size=1, max_size=40).filter(lambda s: not all(c.isascii() and (c.isalnum() or c in "._:-") for c in s)),
    st.integers(129, 4000).map(lambda n: "x" * n),
    st.from_regex(r"\A[a-z0-9]{1,12}\Z").map(lambda s: s + "\n"),  # a regex's `$` lets a last newline through
)
huge_counts = st.integers(MAX_MESSAGE_BYTES + 1, 3 * MAX_MESSAGE_BYTES)
token_id = st.integers(0, VOCAB_SIZE - 1)
bad_token_id = st.one_of(st.integers(INT64_MIN, -1), st.integers(VOCAB_SIZE, INT64_MAX))
not_finite = st.sampled_from([math.nan, math.inf, -math.inf])
good_salts = st.text(min_size=1, max_size=MAX_CACHE_SALT_LENGTH)
bad_salts = st.one_of(st.just(""), st.integers(MAX_CACHE_SALT_LENGTH + 1, 4000).map(lambda n: "s" * n), not_utf8)

GOOD_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, MAX_TOKENS_LIMIT),
    "temperature": st.one_of(st.just(0.0), st.floats(0.0, 2.0), st.floats(0.0, 1e308), st.floats(0.0, 1e-300)),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "top_k": st.integers(0, INT64_MAX),
    "seed": st.integers(0, INT64_MAX),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=3),
    "stop_token_ids": st.lists(token_id, max_size=4),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 20),
}
BAD_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(INT64_MIN, 0), st.integers(MAX_TOKENS_LIMIT + 1, INT64_MAX)),
    "temperature": st.one_of(not_finite, st.floats(max_value=-1e-300, allow_infinity=False)),
    "top_p": st.one_of(
        not_finite, st.floats(max_value=0.0, allow_nan=False), st.floats(min_value=1.0, exclude_min=True)
    ),
    "top_k": st.integers(INT64_MIN, -1),
    "seed": st.integers(INT64_MIN, -1),
    "stop": st.one_of(
        st.lists(st.text(min_size=1, max_size=4), min_size=17, max_size=40),
        st.integers(257, 2000).map(lambda n: ["s" * n]),
        st.lists(st.text(max_size=4), max_size=3).map(lambda stops: [*stops, ""]),
        st.tuples(st.lists(st.text(min_size=1, max_size=4), max_size=3), not_utf8).map(lambda x: [*x[0], x[1]]),
    ),
    "stop_token_ids": st.lists(token_id, max_size=3).flatmap(lambda ids: bad_token_id.map(lambda bad: [*ids, bad])),
    "logprobs": st.one_of(st.integers(INT64_MIN, -1), st.integers(21, INT64_MAX)),
}


@st.composite
def good_drafts(draw: st.DrawFn) -> Draft:
    """A request the router must serve."""
    draft = Draft(request_id=draw(st.sampled_from([FRESH, ""])))
    if draw(st.booleans()):
        draft.text = draw(st.text(min_size=1, max_size=60))
    else:
        draft.token_ids = draw(st.lists(token_id, min_size=1, max_size=64))
    if draw(st.booleans()):
        names = draw(st.sets(st.sampled_from(sorted(GOOD_SAMPLING))))
        draft.sampling = {name: draw(GOOD_SAMPLING[name]) for name in sorted(names)}
    draft.cache_salt = draw(st.one_of(st.none(), good_salts))
    return draft


@st.composite
def one_bad_field(draw: st.DrawFn) -> tuple[Draft, Expect]:
    """A good request with exactly one field made bad, and the status that field must get."""
    draft = draw(good_drafts())
    kind = draw(st.sampled_from(["request_id", "text", "token_ids", "no prompt", "sampling", "cache_salt"]))
    if kind == "request_id":
        choice = draw(st.sampled_from(["bad", "not utf-8", "huge", "taken"]))
        if choice == "taken":
            draft.request_id = TAKEN
            return draft, Expect(EXISTS)  # Generate; Submit answers created=false
        draft.request_id = {
            "bad": lambda: draw(bad_ids),
            "not utf-8": lambda: draw(not_utf8),
            "huge": lambda: "x" * draw(huge_counts),
        }[choice]()
        return draft, Expect(EXHAUSTED) if choice == "huge" else Expect(INVALID, "request_id")
    if kind == "text":
        draft.token_ids = None
        choice = draw(st.sampled_from(["empty", "too many tokens", "not utf-8", "huge"]))
        draft.text = {
            "empty": lambda: "",
            "too many tokens": lambda: "t" * draw(st.integers(MAX_PROMPT_TOKENS + 1, MAX_MESSAGE_BYTES - 1024)),
            "not utf-8": lambda: draw(not_utf8),
            "huge": lambda: "h" * draw(huge_counts),
        }[choice]()
        return draft, Expect(EXHAUSTED) if choice == "huge" else Expect(INVALID, "prompt.text")
    if kind == "token_ids":
        draft.text = None
        choice = draw(st.sampled_from(["empty", "a bad id", "too many"]))
        if choice == "a bad id":
            ids = draw(st.lists(token_id, max_size=16))
            ids.insert(draw(st.integers(0, len(ids))), draw(bad_token_id))
        else:
            ids = [] if choice == "empty" else [7] * draw(st.integers(MAX_PROMPT_TOKENS + 1, 3000))
        draft.token_ids = ids
        return draft, Expect(INVALID, "prompt.token_ids")
    if kind == "no prompt":
        draft.text = draft.token_ids = None
        return draft, Expect(INVALID, "prompt")
    if kind == "cache_salt":
        draft.cache_salt = draw(bad_salts)
        return draft, Expect(INVALID, "cache_salt")
    name = draw(st.sampled_from(sorted(BAD_SAMPLING)))
    draft.sampling = {**(draft.sampling or {}), name: draw(BAD_SAMPLING[name])}
    return draft, Expect(INVALID, f"sampling.{name}")


@st.composite
def anything(draw: st.DrawFn) -> Draft:
    """Every field drawn from good and bad values alike."""
    draft = Draft(
        request_id=draw(st.one_of(good_ids, st.just(""), st.just(TAKEN), bad_ids, not_utf8)),
        text=draw(st.one_of(st.none(), st.text(max_size=80), not_utf8)),
        token_ids=draw(st.one_of(st.none(), st.lists(st.one_of(token_id, bad_token_id), max_size=80))),
        cache_salt=draw(st.one_of(st.none(), good_salts, bad_salts)),
    )
    if draft.text is not None and draft.token_ids is not None:
        draft.text = None if draw(st.booleans()) else draft.text
        draft.token_ids = None if draft.text is not None else draft.token_ids
    if draw(st.booleans()):
        names = draw(st.sets(st.sampled_from(sorted(GOOD_SAMPLING))))
        draft.sampling = {
            name: draw(st.one_of(GOOD_SAMPLING[name], BAD_SAMPLING.get(name, st.nothing()))) for name in sorted(names)
        }
    return draft


# -- sending, and judging what comes back ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    message: str
    responses: tuple[Any, ...] = ()


class RawClient:
    """KVServe's RPCs taking already-serialized requests."""

    def __init__(self, channel: grpc.Channel) -> None:
        def rpc(name: str, streaming: bool, response: Any) -> Callable[..., Any]:
            make = channel.unary_stream if streaming else channel.unary_unary
            return make(f"/{SERVICE_NAME}/{name}", request_serializer=bytes, response_deserializer=response.FromString)

        self.calls = {
            "Generate": rpc("Generate", True, pb.GenerateResponse),
            "Submit": rpc("Submit", False, pb.SubmitResponse),
            "Stream": rpc("Stream", True, pb.GenerateResponse),
            "Cancel": rpc("Cancel", False, pb.CancelResponse),
            "GetRequest": rpc("GetRequest", False, pb.RequestInfo),
        }

    def send(self, rpc: str, raw: bytes) -> Outcome:
        try:
            answer = self.calls[rpc](raw, timeout=60)
            responses = tuple(answer) if rpc in ("Generate", "Stream") else (answer,)
        except grpc.RpcError as error:
            return Outcome(error.code(), error.details() or "")
        return Outcome(OK, "", responses)


def check(outcome: Outcome, rpc: str, raw: bytes, expect: Expect | None) -> None:
    """What every answer must satisfy, and the exact status where it is known."""
    where = f"{rpc} of {raw[:160]!r}{'...' if len(raw) > 160 else ''} ({len(raw)} bytes)"
    assert outcome.code in ALLOWED, f"{where}: {outcome.code.name}: {outcome.message}"
    if len(raw) > MAX_MESSAGE_BYTES:  # gRPC refuses it before the router sees it
        expect = Expect(EXHAUSTED)
    if expect is not None:
        got = f"{outcome.code.name}: {outcome.message}"
        assert outcome.code == expect.code, f"{where}: expected {expect.code.name}, got {got}"
        if expect.field is not None:
            assert outcome.message.startswith(f"{expect.field}: "), f"{where}: {outcome.message!r} names another field"
    if outcome.code == INVALID:
        named = re.sub(r"\[\d+\]", "[i]", outcome.message.split(": ", 1)[0])
        assert named in FIELDS, f"{where}: {outcome.message!r} names no field"
    elif outcome.code == EXHAUSTED:
        # Nothing here queues long enough to be refused for room: only gRPC's size limit.
        assert len(raw) > MAX_MESSAGE_BYTES and "larger than max" in outcome.message, f"{where}: {outcome.message}"
    elif outcome.code == OK and rpc == "Generate":
        result = parse_stream(outcome.responses)
        assert result.finished.finish_reason != pb.FINISH_REASON_ERROR, f"{where}: {result.finished}"
        assert len(result.token_ids) <= MAX_TOKENS_LIMIT, f"{where}: {len(result.token_ids)} tokens"


# -- the run -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    """One worker of 128 blocks; operator limits on prompt tokens and max_tokens keep every
    request that passes short, and a 64 KiB message limit makes oversize cheap to send."""
    config = cluster_config(
        redis_server.url,
        tmp_path_factory.mktemp("fuzz"),
        (16 * MiB,),
        router=RouterConfig(max_prompt_tokens=MAX_PROMPT_TOKENS, max_tokens_limit=MAX_TOKENS_LIMIT),
    )
    config = dataclasses.replace(config, server=ServerConfig(port=0, max_message_bytes=MAX_MESSAGE_BYTES))
    with running_cluster(config) as harness:
        yield harness


def test_the_fuzz_run(cluster: ClusterHarness, reference_engine: ReferenceEngine) -> None:
    assert cluster.channel is not None
    client, seen = RawClient(cluster.channel), collections.Counter[tuple[str, str]]()
    taken = f"fz-taken-{uuid.uuid4().hex[:8]}"
    assert cluster.stub.Submit(greedy_request([1, 2, 3], 4, taken), timeout=10).created
    wait_for(
        lambda: cluster.stub.GetRequest(pb.GetRequestRequest(request_id=taken), timeout=5),
        lambda info: info.status == pb.REQUEST_STATUS_FINISHED,
        what="the taken request to finish",
    )

    def send(rpc: str, raw: bytes, expect: Expect | None) -> Outcome:
        outcome = client.send(rpc, raw)
        seen[rpc, outcome.code.name] += 1
        check(outcome, rpc, raw, expect)
        return outcome

    # Each status the run must see, whatever the draws: an example of each that a random
    # draw may miss (examples are the derandomized draws of these strategies, so any new
    # field reshuffles them).
    @example(rpc="Generate", case=(Draft(request_id=TAKEN, token_ids=[1, 2, 3]), Expect(EXISTS)))
    @example(rpc="Generate", case=Draft(token_ids=[4, 5, 6], cache_salt="tenant"))
    @settings(FUZZ, max_examples=EXAMPLES["generate"])
    @given(rpc=st.sampled_from(["Generate", "Submit"]), case=st.one_of(one_bad_field(), anything(), good_drafts()))
    def generate_requests(rpc: str, case: tuple[Draft, Expect] | Draft) -> None:
        draft, expect = case if isinstance(case, tuple) else (case, None)
        if isinstance(case, Draft) and case.first_bad_utf8() is not None:
            expect = Expect(INVALID, case.first_bad_utf8())
        elif expect is None and _only_good_values(draft):
            expect = Expect(OK)
        if rpc == "Submit" and draft.request_id == TAKEN and expect == Expect(EXISTS):
            expect = Expect(OK)  # Submit returns the existing request
        outcome = send(rpc, draft.serialize(taken), expect)
        if outcome.code == OK and rpc == "Submit":
            assert outcome.responses[0].created == (draft.request_id != TAKEN)

    @settings(FUZZ, max_examples=EXAMPLES["ids"])
    @given(
        rpc=st.sampled_from(["Stream", "Cancel", "GetRequest"]),
        request_id=st.one_of(st.sampled_from([TAKEN, FRESH, ""]), bad_ids, not_utf8, huge_counts.map("i".__mul__)),
        from_offset=st.one_of(st.just(0), st.integers(INT64_MIN, INT64_MAX), st.integers(0, 8)),
    )
    def id_requests(rpc: str, request_id: str | bytes, from_offset: int) -> None:
        resolved = _resolve(request_id, taken, "fz-unknown")
        if isinstance(resolved, bytes):
            raw, expect = _field(1, resolved), Expect(INVALID, "request_id")
        else:
            message = (  # CancelRequest and GetRequestRequest are the same bytes: the id alone
                pb.StreamRequest(request_id=resolved, from_offset=from_offset)
                if rpc == "Stream"
                else pb.CancelRequest(request_id=resolved)
            )
            raw = message.SerializeToString()
            if request_id in (TAKEN, FRESH) and not (rpc == "Stream" and from_offset < 0):
                expect = Expect(OK if request_id == TAKEN else NOT_FOUND)
            elif request_id in (TAKEN, FRESH):
                expect = Expect(INVALID, "from_offset")
            else:
                expect = Expect(INVALID, "request_id")
        outcome = send(rpc, raw, expect)
        if outcome.code == OK and rpc == "Stream":
            result = parse_stream(outcome.responses, from_offset)
            assert len(result.token_ids) == max(0, 4 - from_offset)

    @settings(FUZZ, max_examples=EXAMPLES["raw"])
    @given(rpc=st.sampled_from(["Generate", "Submit", "Stream", "GetRequest"]), raw=st.binary(max_size=300))
    def raw_bytes(rpc: str, raw: bytes) -> None:
        send(rpc, raw, None)

    generate_requests()
    id_requests()
    raw_bytes()
    print("the fuzz run's outcomes:", dict(sorted(seen.items())))
    codes = {code for _, code in seen}
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED"} <= codes, seen

    # The router never fell over: it serves the reference output, and no KV is left held.
    wait_idle(cluster.stub, timeout=60)
    result = parse_stream(cluster.stub.Generate(greedy_request([5] * 40, 8), timeout=60))
    assert result.token_ids == list(reference_engine.greedy([([5] * 40, 8)])[0].output_ids)
    wait_idle(cluster.stub)


def _resolve(request_id: str | bytes, taken_id: str, fresh_prefix: str) -> str | bytes:
    """The placeholders made real: FRESH a new id each time, TAKEN the finished request's."""
    if request_id == FRESH:
        return f"{fresh_prefix}-{uuid.uuid4().hex[:12]}"
    return taken_id if request_id == TAKEN else request_id


def _only_good_values(draft: Draft) -> bool:
    """Whether anything() happened to draw a request the router must serve."""
    if draft.request_id not in (FRESH, "") or draft.first_bad_utf8() is not None:
        return False
    if draft.text is not None:
        prompt_ok = 0 < len(draft.text.encode()) <= MAX_PROMPT_TOKENS  # type: ignore[union-attr]
    else:
        prompt_ok = draft.token_ids is not None and 0 < len(draft.token_ids) <= MAX_PROMPT_TOKENS
        prompt_ok = prompt_ok and all(0 <= t < VOCAB_SIZE for t in draft.token_ids or ())
    sampling = draft.sampling or {}
    salt_ok = draft.cache_salt is None or 0 < len(draft.cache_salt) <= MAX_CACHE_SALT_LENGTH
    return prompt_ok and salt_ok and all(_good(name, value) for name, value in sampling.items())


def _good(name: str, value: Any) -> bool:
    if name == "max_tokens":
        return 1 <= value <= MAX_TOKENS_LIMIT
    if name == "temperature":
        return math.isfinite(value) and value >= 0
    if name == "top_p":
        return 0 < value <= 1
    if name in ("top_k", "seed"):
        return value >= 0
    if name == "stop":
        return len(value) <= 16 and all(isinstance(s, str) and 0 < len(s) <= 256 for s in value)
    if name == "stop_token_ids":
        return all(0 <= t < VOCAB_SIZE for t in value)
    if name == "logprobs":
        return 0 <= value <= 20
    return True


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
