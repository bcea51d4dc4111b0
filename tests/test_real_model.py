"""The real model end to end: SmolLM2-135M-Instruct (the default `--model`) answers eight chat
prompts with exactly transformers' greedy tokens, in float32, through `kvserve offline` and
through a cluster's `Generate` with `messages`, stopping where transformers stops (its end
of turn, `<|im_end|>`), with the template's tokens counted in the usage.

Transformers checks our answers teacher-forced: one forward pass over prompt + answer, and
at every position its argmax must be the token we produced next (and eos where we stopped
early). By induction that is transformers' greedy decoding token for token, at one forward
per prompt instead of 64 (the autoregressive reference took 45 s of the suite)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.cli import main as kvserve
from cluster.redis_server import EmbeddedRedis
from protos.kvserve.v1 import serving_pb2 as pb
from tests.cluster_harness import MiB, ClusterHarness, cluster_config, running_cluster
from workers.config import EngineArgs

MAX_TOKENS = 64
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short paragraph about the ocean."}],
    [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three fruits that are red."}],
    [{"role": "user", "content": "Explain what a computer program is to a child."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and French."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fun fact about cats."}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
]  # fmt: skip


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


@pytest.fixture(scope="module")
def prompts(smollm2: tuple[Any, Any, Any]) -> list[list[int]]:
    """Each conversation's prompt ids, as transformers' apply_chat_template renders them."""
    hf_tokenizer = smollm2[2]
    out = []
    for messages in CONVERSATIONS:
        rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(hf_tokenizer.encode(rendered, add_special_tokens=False))
    return out


def assert_transformers_greedy(smollm2: tuple[Any, Any, Any], prompt: list[int], output: list[int]) -> str:
    """Every token of `output` is transformers' argmax after the tokens before it; an output
    shorter than MAX_TOKENS ends where transformers' argmax is eos. Returns "eos" or "length"."""
    import torch

    _, hf_model, hf_tokenizer = smollm2
    eos = hf_tokenizer.eos_token_id
    answer = _until_eos(output, eos)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + answer])).logits[0]  # [len(prompt) + len(answer), vocab]
    best = logits[len(prompt) - 1 :].argmax(dim=-1).tolist()  # transformers' next token at each step
    for index, token in enumerate(answer):
        assert best[index] == token, f"token {index}: transformers' greedy gives {best[index]}, we gave {token}"
    if len(answer) < MAX_TOKENS:
        assert best[len(answer)] == eos, f"we stopped after {len(answer)} tokens, transformers goes on"
        return "eos"
    return "length"


def test_eight_chat_prompts_through_kvserve_offline_equal_transformers(
    prompts: list[list[int]], tmp_path: Path, capsys: pytest.CaptureFixture[str], smollm2: tuple[Any, Any, Any]
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    code = kvserve(["offline", "--requests", str(requests), "--json", "--max-tokens", str(MAX_TOKENS),
                    "--temperature", "0", "--kv-cache-memory", "64MiB", "--dtype", "float32"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    reasons = []
    for row, prompt in zip(rows, prompts, strict=True):
        assert row["prompt_ids"] == prompt
        reason = assert_transformers_greedy(smollm2, prompt, row["output_ids"])
        assert row["finish_reason"] == reason, row
        assert "<|im_end|>" not in row["output_text"]
        reasons.append(reason)
    assert "Paris" in rows[0]["output_text"]
    assert set(reasons) == {"eos", "length"}, reasons  # some answers end their turn, some run to 64


@pytest.fixture(scope="module")
def cluster(ray_session: None, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHarness]:
    config = cluster_config(redis_server.url, tmp_path_factory.mktemp("real"), (64 * MiB,))
    engine = EngineArgs(model="smollm2-135m-instruct", dtype="float32", kv_cache_memory=64 * MiB, num_threads=1)
    with running_cluster(config.__class__(**{**config.__dict__, "engine": engine})) as harness:
        yield harness


def test_eight_chat_prompts_through_a_cluster_equal_transformers(
    cluster: ClusterHarness, prompts: list[list[int]], smollm2: tuple[Any, Any, Any]
) -> None:
    """All eight at once: they share the worker's batches, and still equal transformers."""
    calls = []
    for messages in CONVERSATIONS:
        request = pb.GenerateRequest(
            request_id=f"real-{uuid.uuid4().hex[:8]}",
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]),
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        )
        calls.append((request.request_id, cluster.stub.Generate(request, timeout=300)))
    for (request_id, call), prompt in zip(calls, prompts, strict=True):
        events = list(call)
        tokens = [t for e in events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]
        text = "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")
        finished = events[-1].finished
        assert events[0].started.prompt_tokens == len(prompt)
        assert finished.usage.prompt_tokens == len(prompt)
        reason = assert_transformers_greedy(smollm2, prompt, tokens)
        assert "<|im_end|>" not in text
        assert finished.finish_reason == (pb.FINISH_REASON_EOS if reason == "eos" else pb.FINISH_REASON_LENGTH)
        info = cluster.stub.GetRequest(pb.GetRequestRequest(request_id=request_id), timeout=10)
        assert info.prompt_text.startswith("<|im_start|>") and info.prompt_text.endswith("<|im_start|>assistant\n")
