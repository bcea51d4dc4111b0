"""Chat messages through a real cluster: a worker serving a tiny HF Llama whose tokenizer has a
ChatML template; the router renders, counts and records the prompt as transformers would."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
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
    is_idle,
    parse_stream,
    request_info,
    running_cluster,
    wait_idle,
)
from tests.hf_checkpoints import IM_END_ID
from workers.config import EngineArgs

SYSTEM_USER = [("system", "You are a helpful assistant. Answer briefly."), ("user", "What is a paged attention block?")]


@pytest.fixture(scope="module")
def cluster(
    ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory, chat_dir: Path
) -> Iterator[ClusterHarness]:
    """One worker of the chat checkpoint (1 MiB of KV: 128 blocks of 16 tokens)."""
    config = cluster_config(redis_server.url, tmp_path_factory.mktemp("chat"), (1 * MiB,))
    config = dataclasses.replace(config, engine=EngineArgs(model=str(chat_dir), kv_cache_memory=1 * MiB, num_threads=1))
    with running_cluster(config) as harness:
        # The worker read the template from the checkpoint (chat_template.jinja or
        # tokenizer_config.json) and sent it with its tokenizer.
        assert harness.router.chat_template is not None
        yield harness


def _chat(conversation: list[tuple[str, str]], request_id: str = "", **sampling: Any) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=role, content=content) for role, content in conversation]
    return pb.GenerateRequest(
        request_id=request_id or f"chat-{uuid.uuid4().hex[:8]}",
        messages=pb.ChatMessages(messages=messages),
        sampling=pb.SamplingParams(**{"max_tokens": 6, "temperature": 0.0, **sampling}),
    )


def _expected(chat_reference: Any, conversation: list[tuple[str, str]]) -> tuple[str, list[int]]:
    dicts = [{"role": role, "content": content} for role, content in conversation]
    text = chat_reference.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)
    out = chat_reference.apply_chat_template(dicts, add_generation_prompt=True, tokenize=True)
    return text, list(out if isinstance(out, list) else out["input_ids"])


def test_messages_are_rendered_counted_and_recorded_like_apply_chat_template(
    cluster: ClusterHarness, chat_reference: Any
) -> None:
    stub = cluster.stub
    assert stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).has_chat_template
    text, ids = _expected(chat_reference, SYSTEM_USER)
    request = _chat(SYSTEM_USER)
    chat = parse_stream(stub.Generate(request, timeout=60))
    assert chat.started.prompt_tokens == len(ids) == chat.finished.usage.prompt_tokens
    info = request_info(stub, request.request_id)
    assert list(info.prompt_token_ids) == ids
    assert info.prompt_text == text
    assert list(info.sampling.stop_token_ids) == [IM_END_ID]  # the end of turn, kept for a move
    assert "<|im_end|>" not in chat.text

    # It is those ids and that stop, nothing else: the same request as ids gives the same tokens.
    as_ids = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[IM_END_ID]),
    )
    assert parse_stream(stub.Generate(as_ids, timeout=60)).token_ids == chat.token_ids

    # Text prompts are recorded as sent; ids have no text.
    text_request = pb.GenerateRequest(request_id=f"text-{uuid.uuid4().hex[:8]}", text="Hello!",
                                      sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))
    parse_stream(stub.Generate(text_request, timeout=60))
    assert request_info(stub, text_request.request_id).prompt_text == "Hello!"
    wait_idle(stub)


def test_a_submitted_chat_request_can_be_read_back(cluster: ClusterHarness, chat_reference: Any) -> None:
    conversation = [("user", "Grüße! 日本語 🙂"), ("assistant", "Hallo!"), ("user", "Und jetzt?")]
    text, ids = _expected(chat_reference, conversation)
    request = _chat(conversation, max_tokens=4)
    assert cluster.stub.Submit(request, timeout=10).created
    result = parse_stream(cluster.stub.Stream(pb.StreamRequest(request_id=request.request_id), timeout=60))
    assert result.started.prompt_tokens == len(ids)
    info = request_info(cluster.stub, request.request_id)
    assert list(info.prompt_token_ids) == ids and info.prompt_text == text
    wait_idle(cluster.stub)


@pytest.mark.parametrize("rpc", ["Generate", "Submit"])
@pytest.mark.parametrize(
    "conversation,words",
    [
        ([("tool", "4")], ["prompt.messages: ", "a conversation cannot start with a tool message"]),
        ([], ["prompt.messages: ", "at least one"]),
        ([("user", "Hi"), ("Assistant", "Hello")], ["prompt.messages[1].role: ", "'Assistant'"]),
        ([("user", "x" * 600)], ["prompt.messages: ", "exceed the limit"]),
    ],
)
def test_a_refused_conversation_is_invalid_argument_naming_messages_and_costs_nothing(
    cluster: ClusterHarness, conversation: list[tuple[str, str]], words: list[str], rpc: str
) -> None:
    request = _chat(conversation)

    def send() -> object:
        if rpc == "Generate":
            return list(cluster.stub.Generate(request, timeout=10))
        return cluster.stub.Submit(request, timeout=10)

    message = expect_error(send, grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert message.startswith("prompt.messages"), message
    expect_error(lambda: request_info(cluster.stub, request.request_id), grpc.StatusCode.NOT_FOUND)
    assert is_idle(cluster.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5))


def test_the_cli_speaks_chat_unless_raw(
    cluster: ClusterHarness, chat_reference: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.cli import main

    base = ["--address", cluster.cluster.address, "--max-tokens", "3", "--temperature", "0"]
    assert main(["generate", SYSTEM_USER[1][1], "--system", SYSTEM_USER[0][1], *base]) == 0
    assert f"{len(_expected(chat_reference, SYSTEM_USER)[1])} prompt tokens" in capsys.readouterr().err
    assert main(["generate", "Hello!", *base]) == 0
    assert f"{len(_expected(chat_reference, [('user', 'Hello!')])[1])} prompt tokens" in capsys.readouterr().err
    assert main(["generate", "Hello!", "--raw", *base]) == 0
    assert f"{len(chat_reference('Hello!', add_special_tokens=False)['input_ids'])} prompt tokens" in capsys.readouterr().err
    assert main(["generate", "Hello!", "--raw", "--system", "Be brief", *base]) == 2
    assert "--system" in capsys.readouterr().err
    wait_idle(cluster.stub)


def test_a_client_with_only_reflection_chats(cluster: ClusterHarness) -> None:
    """What grpcurl (or any language's reflection client) does: no .proto and no generated
    stubs. The message types come from the server's reflection answer, the request is
    written in JSON, and the answer is read back as JSON."""
    from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert cluster.channel is not None
    reflection = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
    ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvserve.v1.KVServe")
    (reply,) = list(reflection.ServerReflectionInfo(iter([ask]), timeout=5))
    pool = descriptor_pool.DescriptorPool()
    for raw in reply.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
    method = pool.FindServiceByName("kvserve.v1.KVServe").methods_by_name["Generate"]
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    request = json_format.Parse(json.dumps({
        "messages": {"messages": [{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": "Say hello"}]},
        "sampling": {"maxTokens": 6, "temperature": 0},
    }), request_type())  # fmt: skip
    call = cluster.channel.unary_stream(
        "/kvserve.v1.KVServe/Generate",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_type.FromString,
    )
    events = [json_format.MessageToDict(m) for m in call(request, timeout=60)]
    assert "started" in events[0] and int(events[0]["started"]["promptTokens"]) > 6  # the template's tokens too
    assert "finished" in events[-1]
    assert int(events[-1]["finished"]["usage"]["completionTokens"]) >= 1
