"""Bad requests through a real cluster: each gets its status code and a message naming the
field, costs nothing (no record, no KV), and the router serves on afterwards."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from tests.cluster_harness import (
    MiB,
    ClusterHarness,
    cluster_config,
    expect_error,
    greedy_request,
    is_idle,
    parse_stream,
    running_cluster,
    wait_idle,
)

VOCAB_SIZE, MAX_MODEL_LEN = 258, 2048  # the tiny preset


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterHarness]:
    """One worker of 128 blocks: 2048 tokens, the model's max length."""
    with running_cluster(cluster_config(redis_server.url, tmp_path_factory.mktemp("errors"), (16 * MiB,))) as harness:
        yield harness


def _id() -> str:
    return f"bad-{uuid.uuid4().hex[:8]}"


def _tokens(prompt_ids: list[int], **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=_id(),
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(**{"max_tokens": 4, **sampling}),
    )


def _salted(cache_salt: str) -> pb.GenerateRequest:
    request = _tokens([1, 2, 3])
    request.cache_salt = cache_salt  # set, so present even when empty
    return request


def _chat(*role_content: tuple[str, str]) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=role, content=content) for role, content in role_content]
    return pb.GenerateRequest(request_id=_id(), messages=pb.ChatMessages(messages=messages))


BAD_REQUESTS: dict[str, tuple[Callable[[], pb.GenerateRequest], str]] = {
    # The tiny preset's byte tokenizer has no chat template (tests/test_cluster_chat.py has one).
    "messages without a chat template": (lambda: _chat(("user", "Hi")), "prompt.messages"),
    "empty messages": (lambda: _chat(), "prompt.messages"),
    "unknown role": (lambda: _chat(("system", "Be brief"), ("narrator", "Once")), "prompt.messages[1].role"),
    "empty text": (lambda: pb.GenerateRequest(request_id=_id(), text=""), "prompt.text"),
    "no prompt": (lambda: pb.GenerateRequest(request_id=_id(), sampling=pb.SamplingParams(max_tokens=4)), "prompt"),
    "empty token ids": (lambda: pb.GenerateRequest(request_id=_id(), token_ids=pb.TokenIds()), "prompt.token_ids"),
    "token id = vocab size": (lambda: _tokens([1, VOCAB_SIZE]), "prompt.token_ids"),
    "negative token id": (lambda: _tokens([-1, 2]), "prompt.token_ids"),
    "prompt at max length": (lambda: _tokens([5] * MAX_MODEL_LEN), "prompt.token_ids"),
    "max_tokens 0": (lambda: _tokens([1], max_tokens=0), "sampling.max_tokens"),
    "max_tokens negative": (lambda: _tokens([1], max_tokens=-3), "sampling.max_tokens"),
    "prompt + max_tokens over max length": (
        lambda: _tokens([5] * 100, max_tokens=MAX_MODEL_LEN - 99),
        "sampling.max_tokens",
    ),
    "temperature negative": (lambda: _tokens([1], temperature=-0.5), "sampling.temperature"),
    "temperature NaN": (lambda: _tokens([1], temperature=math.nan), "sampling.temperature"),
    "top_p 0": (lambda: _tokens([1], top_p=0.0), "sampling.top_p"),
    "top_p 1.5": (lambda: _tokens([1], top_p=1.5), "sampling.top_p"),
    "top_k negative": (lambda: _tokens([1], top_k=-1), "sampling.top_k"),
    "seed negative": (lambda: _tokens([1], seed=-1), "sampling.seed"),
    "logprobs 100": (lambda: _tokens([1], logprobs=100), "sampling.logprobs"),
    "bad request id": (lambda: greedy_request([1, 2], 4, request_id="no spaces/or slashes!"), "request_id"),
    "empty cache salt": (lambda: _salted(""), "cache_salt"),
    "cache salt of 257 characters": (lambda: _salted("s" * 257), "cache_salt"),
}


@pytest.mark.parametrize("rpc", ["Generate", "Submit"])
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_is_refused_naming_its_field(cluster: ClusterHarness, case: str, rpc: str) -> None:
    make, field = BAD_REQUESTS[case]
    request = make()

    def send() -> object:
        if rpc == "Generate":
            return list(cluster.stub.Generate(request, timeout=10))
        return cluster.stub.Submit(request, timeout=10)

    message = expect_error(send, grpc.StatusCode.INVALID_ARGUMENT)
    assert message.startswith(f"{field}: "), message
    # It cost nothing: no record under its id, no KV promised or held anywhere.
    if case != "bad request id":
        expect_error(
            lambda: cluster.stub.GetRequest(pb.GetRequestRequest(request_id=request.request_id), timeout=5),
            grpc.StatusCode.NOT_FOUND,
        )
    assert is_idle(cluster.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5))


def test_unknown_ids_are_not_found_and_bad_ids_invalid(cluster: ClusterHarness) -> None:
    stub, unknown = cluster.stub, "never-submitted"
    for rpc in (
        lambda: stub.GetRequest(pb.GetRequestRequest(request_id=unknown), timeout=5),
        lambda: stub.Cancel(pb.CancelRequest(request_id=unknown), timeout=5),
        lambda: list(stub.Stream(pb.StreamRequest(request_id=unknown), timeout=5)),
    ):
        expect_error(rpc, grpc.StatusCode.NOT_FOUND, unknown)
    for rpc in (
        lambda: stub.GetRequest(pb.GetRequestRequest(request_id="a b"), timeout=5),
        lambda: stub.Cancel(pb.CancelRequest(request_id=""), timeout=5),
        lambda: list(stub.Stream(pb.StreamRequest(request_id="x" * 129), timeout=5)),
    ):
        expect_error(rpc, grpc.StatusCode.INVALID_ARGUMENT, "request_id")
    expect_error(
        lambda: list(stub.Stream(pb.StreamRequest(request_id=unknown, from_offset=-1), timeout=5)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "from_offset",
    )


def test_generate_with_a_taken_id_is_already_exists(cluster: ClusterHarness) -> None:
    request_id = f"taken-{uuid.uuid4().hex[:8]}"
    assert cluster.stub.Submit(greedy_request([1, 2, 3], 8, request_id), timeout=10).created
    expect_error(
        lambda: list(cluster.stub.Generate(greedy_request([4, 5], 4, request_id), timeout=10)),
        grpc.StatusCode.ALREADY_EXISTS,
        request_id,
        "Stream",
    )
    # The request that holds the id is untouched.
    result = parse_stream(cluster.stub.Stream(pb.StreamRequest(request_id=request_id), timeout=30))
    assert len(result.token_ids) == 8 and result.finished.finish_reason == pb.FINISH_REASON_LENGTH
    info = cluster.stub.GetRequest(pb.GetRequestRequest(request_id=request_id), timeout=5)
    assert list(info.prompt_token_ids) == [1, 2, 3]
    wait_idle(cluster.stub)


def test_the_router_serves_after_bad_requests(cluster: ClusterHarness) -> None:
    result = parse_stream(cluster.stub.Generate(greedy_request([5] * 64, 8), timeout=60))
    assert len(result.token_ids) == 8 and result.finished.finish_reason == pb.FINISH_REASON_LENGTH
    assert result.finished.usage.prompt_tokens == 64
    wait_idle(cluster.stub)


def test_a_model_without_a_chat_template_says_so_and_the_cli_sends_text(
    cluster: ClusterHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.cli import main

    assert not cluster.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).has_chat_template
    address = cluster.cluster.address
    assert main(["generate", "Hi", "--address", address, "--max-tokens", "3", "--temperature", "0"]) == 0
    assert "2 prompt tokens" in capsys.readouterr().err  # b"Hi", as text
    assert main(["generate", "Hi", "--address", address, "--system", "Be brief"]) == 2
    assert "--system: the model has no chat template" in capsys.readouterr().err
    wait_idle(cluster.stub)
