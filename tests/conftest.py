"""Shared fixtures: real services on loopback, started once per test session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from router.state import StoreConfig

# How `make test` splits the suite between two processes (pytest-xdist): tests/parallel.py.
from tests.parallel import pytest_collection_modifyitems, pytest_xdist_make_scheduler  # noqa: F401

if TYPE_CHECKING:
    from tests.cluster_harness import ReferenceEngine


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server on a free loopback port, with its AOF in a temp dir."""
    server = EmbeddedRedis(RedisServerConfig(state_dir=tmp_path_factory.mktemp("redis")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store_config(redis_server: EmbeddedRedis) -> StoreConfig:
    """A store on the session's Redis with a prefix of its own, so tests never share keys."""
    return StoreConfig(url=redis_server.url, prefix=f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole session (its start costs seconds). Logical CPUs are
    declared above the machine's 2 so that several small workers fit at once."""
    import ray

    # kvserve's namespace: a `kvserve router` process joining this Ray finds a test
    # cluster's named workers there (each test's store prefix keeps their names apart).
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False, namespace="kvserve")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """transformers' tokenizer (and chat template) of smollm2-135m-instruct's GGUF file, the
    reference of every test of the real tokenizer: converted once per session (~6 s)."""
    from transformers import AutoTokenizer

    from workers.model.named_models import resolve_named_model

    path = resolve_named_model("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smollm2(smollm2_tokenizer: Any) -> tuple[Any, Any, Any]:
    """The real model, loaded once per session: kvserve's float32 load of smollm2-135m-instruct,
    and transformers' model and tokenizer of the same GGUF file (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    from workers.model.loader import load_model
    from workers.model.named_models import resolve_named_model

    loaded = load_model("smollm2-135m-instruct", torch.device("cpu"), torch.float32)
    path = resolve_named_model("smollm2-135m-instruct")
    hf_model: Any = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return loaded, hf_model.eval(), smollm2_tokenizer


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved by transformers, with a ChatML template and its special tokens."""
    from tests.hf_checkpoints import make_chat_checkpoint

    directory = tmp_path_factory.mktemp("chat-llama")
    make_chat_checkpoint(directory)
    return directory


@pytest.fixture(scope="session")
def chat_reference(chat_dir: Path) -> Any:
    """transformers' tokenizer of chat_dir: the chat tests' reference."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(chat_dir))


@pytest.fixture(scope="session")
def reference_engine() -> ReferenceEngine:
    """The in-process engine with the cluster tests' worker EngineArgs (loads the model once)."""
    from tests.cluster_harness import ReferenceEngine, tiny_engine

    return ReferenceEngine(tiny_engine())
