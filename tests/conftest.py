"""Shared fixtures: real services on loopback, started once per test session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from router.state import StoreConfig

if TYPE_CHECKING:
    from tests.cluster_harness import ReferenceEngine

# -- the suite on two cores -------------------------------------------------------------------
# `make test` runs the suite in two pytest-xdist processes (`-n 2 --dist loadfile`): CI has two
# cores, and one process kept them 59% busy, most cluster tests waiting on a process or a
# socket. Each process has its own Ray and Redis (the session fixtures below).
# Work goes out a group at a time, and a group is a whole file, so a file's module fixtures
# start once; two kinds of files share a group (FILE_GROUPS):
# - files that bind this machine's fixed ports (the README's 50051 and 9400, Ray's 6379, ...):
#   one process runs them all, so no two run at once;
# - files that use the real model's reference (the smollm2 fixtures): it loads once (~20 s).
# Groups go out slowest first (SLOWEST_FIRST, measured with --durations=0), so that no long
# file starts last while the other process idles; the rest follow in their usual order.
# (xdist's own `xdist_group` mark renames node ids, which pytest 9.2 no longer lets it do.)
FIXED_PORTS = "fixed-ports"
REAL_MODEL = "real-model"
REAL_MODEL_FIXTURES = {"smollm2", "smollm2_tokenizer"}
FILE_GROUPS = {
    "test_readme_commands.py": FIXED_PORTS,
    "test_deploy_replay.py": FIXED_PORTS,
    "test_real_model.py": REAL_MODEL,
    "test_gguf.py": REAL_MODEL,
    "test_chat.py": REAL_MODEL,
    "test_gguf_tokenizer.py": REAL_MODEL,
}
SLOWEST_FIRST = (
    FIXED_PORTS,  # test_readme_commands.py 95 s, test_deploy_replay.py 25 s
    "test_slow_readers.py",
    "test_cluster_migration.py",
    REAL_MODEL,  # ~60 s, 22 of them the reference's load
    "test_two_routers.py",
    "test_state_dir_ownership.py",
    "test_two_nodes.py",
    "test_security.py",
    "test_locust_smoke.py",
    "test_chaos_redis.py",
    "test_cluster_admission.py",
    "test_chaos_leaks.py",
    "test_cluster_prefix.py",
    "test_redis_faults.py",
    "test_cluster_failures.py",
    "test_chaos_locust.py",
    "test_fuzz_api.py",
    "test_chaos_overload.py",
)


def group_of(nodeid: str) -> str:
    """The group of a test: its file's name, or the shared group its file belongs to."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return FILE_GROUPS.get(name, name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and group_of(item.nodeid) != REAL_MODEL:
            raise pytest.UsageError(f"{item.path.name} uses the real model's reference: add it to FILE_GROUPS "
                                    f"in tests/conftest.py as REAL_MODEL, so that it loads once")
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    # The order the workers collect in is the order groups go out (loadscope reordering is off).
    rank = {name: index for index, name in enumerate(SLOWEST_FIRST)}
    position = {item: index for index, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(group_of(item.nodeid), len(rank)), position[item]))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadFileScheduling

    class FileGroups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    if config.getoption("dist") != "loadfile":
        return None
    config.option.loadscopereorder = False
    return FileGroups(config, log)


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
