"""A huge text prompt is encoded off the event loop: the loop that serves every other call
(and answers health checks) keeps running while the prompt is encoded and validated.

The service is the real one, on a Router given a tokenizer directly (no worker is needed
to validate): the tiny models' byte tokenizer with a 3.5 MB prompt, and the chat
checkpoint's tokenizer.json (a BPE tokenizer, ~2.5 s a MiB here) with 400 kB. The second
is a known gap: `tokenizers`' `Tokenizer.encode` holds the GIL for the whole encoding
(its `encode_batch` releases it), so a thread alone cannot free the loop until
workers/model/tokenizer.py's HFTokenizer.encode goes through encode_batch.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from protos.kvserve.v1 import serving_pb2 as pb
from router.core import Router, RouterConfig
from router.service import KVServeService
from router.state import RequestStore, StoreConfig
from router.validation import ClusterLimits
from workers.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


@pytest.mark.parametrize(
    ("tokenizer_name", "prompt_bytes"),
    [
        ("bytes", 3_500_000),
        ("hf", 400_000),
    ],
)
def test_a_huge_text_prompt_does_not_stall_the_event_loop(
    chat_dir: Path, store_config: StoreConfig, tokenizer_name: str, prompt_bytes: int
) -> None:
    tokenizer: Tokenizer = ByteTokenizer() if tokenizer_name == "bytes" else HFTokenizer(
        chat_dir / "tokenizer.json", 1, (2,))

    async def scenario() -> tuple[float, float, int]:
        router = Router(RouterConfig(), RequestStore(store_config))
        router.tokenizer = tokenizer
        router.limits = ClusterLimits(vocab_size=tokenizer.vocab_size, max_model_len=10**7, block_size=16,
                                      max_worker_blocks=10**6)
        service = KVServeService(router)
        text = ("attach at the last token " * (prompt_bytes // 25 + 1))[:prompt_bytes]
        request = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=4, temperature=0.0))

        # A probe of the loop: how long its 10 ms sleeps really take while the prompt is encoded.
        ticks: list[float] = []
        stop = asyncio.Event()

        async def probe() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                ticks.append(now - last)
                last = now

        probing = asyncio.create_task(probe())
        await asyncio.sleep(0.05)
        ticks.clear()
        started = time.monotonic()
        valid = await service._validate(request)
        took = time.monotonic() - started
        stop.set()
        await probing
        await router.store.close()
        assert len(valid.prompt_ids) > prompt_bytes // 10
        return took, max(ticks), len(ticks)

    took, longest_gap, num_ticks = asyncio.run(scenario())
    print(f"{tokenizer_name}: validating {prompt_bytes:,} bytes took {took:.2f} s; the loop's longest pause {longest_gap * 1000:.0f} ms "
          f"({num_ticks} probe ticks)")
    # On the loop, encoding would be one pause as long as the whole encoding; off it, the
    # loop keeps ticking (bounds loose for a loaded two-core machine).
    assert took > 0.2, "the prompt is too small to tell"
    assert longest_gap < took / 2, (longest_gap, took)
    assert num_ticks >= 5
