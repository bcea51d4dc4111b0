"""One streaming Generate call, timed token by token and reported as Locust request events.

    send ──── started ─── delta ──── delta ─── delta ─ ... ── finished
    |<──────── TTFT ─────────>|<─ ITL ─>|<─ ITL ─>|
    |<─────────────────────────── E2E ──────────────────────────────>|

Every event has request_type "grpc"; the size column carries token counts:

    TTFT  send to the first delta with tokens      size: prompt tokens
    ITL   one event per gap between two deltas     size: tokens in the later delta
          with tokens (the router sends one delta
          per engine step, so normally one token)
    E2E   send to `finished`                       size: output tokens

A request that fails is one E2E failure (never a TTFT or ITL one), so the E2E row's
failure count is the number of failed requests. Its error reads "CODE: detail" with the
gRPC status code first (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...), or
FINISH_REASON_ERROR / FINISH_REASON_CANCELLED for a stream that ended that way, or
BAD_STREAM when the stream broke the contract (offsets, counts, a missing `finished`).
Free-standing numbers in the detail become N ("12 waiting" -> "N waiting", while a
worker id like w1 stays), so that Locust, which groups failures by (method, name, error),
keeps one row per kind of failure rather than one per queue length.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import grpc

from loadtest.workloads import WorkloadRequest
from protos.kvserve.v1 import serving_pb2 as pb
from protos.kvserve.v1 import serving_pb2_grpc as pb_grpc

REQUEST_TYPE = "grpc"
TTFT, ITL, E2E = "TTFT", "ITL", "E2E"

FireRequest = Callable[..., Any]  # environment.events.request.fire
_NUMBER = re.compile(r"(?<![A-Za-z_])[0-9]+(?:\.[0-9]+)?")


class RequestFailure(Exception):
    """How a failed request reads in Locust's failure table: "CODE: detail"."""

    def __repr__(self) -> str:  # Locust shows repr(exception); keep it the bare message
        return str(self)


def failure_of(code: str, detail: str) -> RequestFailure:
    return RequestFailure(f"{code}: {_NUMBER.sub('N', detail)}" if detail else code)


def generate_request(request: WorkloadRequest) -> pb.GenerateRequest:
    """Greedy and ignoring EOS, so the output is exactly request.max_tokens long."""
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=request.prompt_ids),
        sampling=pb.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
    )


def timed_generate(
    stub: pb_grpc.KVServeStub,
    request: WorkloadRequest,
    fire: FireRequest,
    timeout: float,
    metadata: tuple[tuple[str, str], ...] = (),
) -> bool:
    """Run one request to its end, firing TTFT and ITL events as tokens arrive and one
    E2E event at the end; True when it succeeded.

    If the calling greenlet is killed (the test stopped) the call is cancelled, which
    frees the request's KV in the cluster, and nothing more is reported for it."""
    context: dict[str, Any] = {"kind": request.kind, "request_id": "", "worker_id": ""}
    num_tokens = 0
    failure: RequestFailure | None = None
    start = time.perf_counter()
    last_token_at = start
    call = stub.Generate(generate_request(request), timeout=timeout, metadata=metadata or None)
    try:
        finished: pb.Finished | None = None
        for response in call:
            kind = response.WhichOneof("event")
            if kind == "started":
                context["request_id"] = response.started.request_id
                context["worker_id"] = response.started.worker_id
            elif kind == "delta" and response.delta.token_ids:
                now = time.perf_counter()
                delta = response.delta
                if delta.offset != num_tokens:
                    failure = failure_of("BAD_STREAM", f"a delta at offset {delta.offset} after {num_tokens} tokens")
                    break
                name, size = (ITL, len(delta.token_ids)) if num_tokens else (TTFT, len(request.prompt_ids))
                fire(request_type=REQUEST_TYPE, name=name, response_time=(now - last_token_at) * 1000.0,
                     response_length=size, exception=None, context=context)
                num_tokens += len(delta.token_ids)
                last_token_at = now
            elif kind == "finished":
                finished = response.finished
        if failure is None:
            failure = _check_finished(finished, num_tokens, request.max_tokens)
    except grpc.RpcError as exc:
        failure = failure_of(exc.code().name if exc.code() else "UNKNOWN", exc.details() or "")
    except Exception as exc:  # noqa: BLE001 - a client-side bug must show up in the report too
        failure = failure_of("CLIENT_ERROR", f"{type(exc).__name__}: {exc}")
    finally:
        call.cancel()  # no-op once the call is done; frees the request when we stop early
    fire(request_type=REQUEST_TYPE, name=E2E, response_time=(time.perf_counter() - start) * 1000.0,
         response_length=num_tokens, exception=failure, context=context)
    return failure is None


def _check_finished(finished: pb.Finished | None, num_tokens: int, max_tokens: int) -> RequestFailure | None:
    if finished is None:
        return failure_of("BAD_STREAM", "the stream ended without a finished message")
    if finished.finish_reason != pb.FINISH_REASON_LENGTH:
        return failure_of(pb.FinishReason.Name(finished.finish_reason), finished.error)
    if num_tokens != max_tokens or finished.usage.completion_tokens != num_tokens:
        return failure_of(
            "BAD_STREAM",
            f"{num_tokens} tokens streamed, usage says {finished.usage.completion_tokens}, max_tokens {max_tokens}",
        )
    return None
