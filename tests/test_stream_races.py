"""Stream(request_id, from_offset) at the racy moments, through a real cluster.

The router hands each event to its listeners before Redis has it, and forgets a finished
request only once its finish is recorded. A Stream that attaches in between (a Node.js
client found it: on the delta at offset 15 of a 16-token request, Stream from 16) used to
subscribe to a request that would publish nothing more and wait for its deadline. Every
Stream here must end with `finished` within a bound, with each token exactly once.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from tests.cluster_harness import (
    ClusterHarness,
    ReferenceEngine,
    cluster_config,
    greedy_request,
    parse_stream,
    read_deltas,
    running_cluster,
    wait_idle,
)

PROMPT_TEXT = "attach at the last token"
MAX_TOKENS = 16
ITERATIONS = 30
STREAM_BOUND_S = 20.0  # a Stream that gets no `finished` by then has hung


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    with running_cluster(cluster_config(redis_server.url, tmp_path_factory.mktemp("races"))) as harness:
        yield harness


def _text_request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        text=PROMPT_TEXT,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )


def test_a_stream_sent_on_the_last_delta_gets_finished(cluster: ClusterHarness, reference_engine: ReferenceEngine) -> None:
    """The issue's reproduction, 30 times: on the delta at offset 15, Stream from 16 (the end),
    from 15 (the last token's offset) and from 0; each ends with `finished` and the tokens
    from its offset on, exactly once."""
    expected = reference_engine.greedy([(list(PROMPT_TEXT.encode()), MAX_TOKENS)])[0].output_ids
    from_offsets = (MAX_TOKENS, MAX_TOKENS - 1, 0)
    took: list[float] = []
    for iteration in range(ITERATIONS):
        request_id = f"race-{iteration}-{uuid.uuid4().hex[:6]}"
        call = cluster.stub.Generate(_text_request(request_id), timeout=60)
        started, deltas = read_deltas(call, 1)
        while deltas[-1].offset + len(deltas[-1].token_ids) < MAX_TOKENS:
            deltas += read_deltas_more(call)
        # The delta that brings the last token (a lagging client may get the last two coalesced).
        assert deltas[-1].offset + len(deltas[-1].token_ids) == MAX_TOKENS
        # On the last delta: attach at once (the calls start now; they are read below).
        sent_at = time.monotonic()
        streams = [
            cluster.stub.Stream(pb.StreamRequest(request_id=request_id, from_offset=f), timeout=STREAM_BOUND_S)
            for f in from_offsets
        ]
        rest = list(call)
        assert [m.WhichOneof("event") for m in rest] == ["finished"]
        assert [t for d in deltas for t in d.token_ids] == expected
        for from_offset, stream in zip(from_offsets, streams):
            try:
                result = parse_stream(stream, from_offset)
            except grpc.RpcError as error:
                raise AssertionError(
                    f"iteration {iteration}: Stream from {from_offset} ended {error.code()} ({error.details()})"
                ) from None
            assert result.token_ids == expected[from_offset:], (iteration, from_offset)
            assert result.finished.finish_reason == pb.FINISH_REASON_LENGTH
            assert result.finished.usage.completion_tokens == MAX_TOKENS
            assert result.started.request_id == request_id == started.request_id
        took.append(time.monotonic() - sent_at)
    wait_idle(cluster.stub)
    print(f"{ITERATIONS} iterations: the three Streams ended within {max(took):.2f} s of the last delta")


def read_deltas_more(call: Iterator[pb.GenerateResponse]) -> list[pb.TokenDelta]:
    message = next(call)
    assert message.WhichOneof("event") == "delta", message
    return [message.delta]


def test_streams_that_attach_while_it_runs_get_each_token_once(
    cluster: ClusterHarness, reference_engine: ReferenceEngine
) -> None:
    """A request this router runs, attached to at random moments from random offsets at or
    below (and just past) its progress: Redis up to what the listener missed, then live."""
    prompt, max_tokens = list(range(20, 36)), 240
    expected = reference_engine.greedy([(prompt, max_tokens)])[0].output_ids
    request_id = f"attach-{uuid.uuid4().hex[:8]}"
    cluster.stub.Submit(greedy_request(prompt, max_tokens, request_id), timeout=10)
    rng = random.Random(7)
    watch = cluster.stub.Stream(pb.StreamRequest(request_id=request_id), timeout=120)
    started, seen = read_deltas(watch, 1)
    streams: list[tuple[int, Iterator[pb.GenerateResponse]]] = []
    while len(streams) < 16:
        seen += read_deltas_more(watch)
        progress = seen[-1].offset + len(seen[-1].token_ids)
        if progress >= max_tokens - 8:
            break
        if rng.random() < 0.15:
            from_offset = rng.choice([0, progress, progress + 1, rng.randrange(progress + 1)])
            streams.append((from_offset, cluster.stub.Stream(
                pb.StreamRequest(request_id=request_id, from_offset=from_offset), timeout=120)))
    assert len(streams) >= 8
    whole = parse_stream([pb.GenerateResponse(started=started), *(pb.GenerateResponse(delta=d) for d in seen), *watch])
    assert whole.token_ids == expected
    for from_offset, stream in streams:
        result = parse_stream(stream, from_offset)
        assert result.token_ids == expected[from_offset:], from_offset
        assert result.finished.finish_reason == pb.FINISH_REASON_LENGTH
    wait_idle(cluster.stub)
