"""How the suite is split between processes (conftest.py imports these hooks).

`make test` runs the suite in two pytest-xdist processes (`-n 2 --dist loadfile`;
`TEST_PROCESSES=0 make test` runs one): one process kept two cores 59% busy, most cluster
tests waiting on a process or a socket. Each process has its own Ray and Redis (conftest.py's
session fixtures).
Work goes out a group at a time, and a group is a whole file, so a file's module fixtures
start once; two kinds of files share a group (FILE_GROUPS):
- files that bind this machine's fixed ports (the README's 50051 and 9400, Ray's 6379, ...):
  one process runs them all, so no two run at once;
- files that use the real model's reference (the smollm2 fixtures): it loads once (~20 s).
Groups go out slowest first (SLOWEST_FIRST, measured with --durations=0), so that no long
file starts last while the other process idles; the rest follow in their usual order.
(xdist's own `xdist_group` mark renames node ids, which pytest 9.2 no longer lets it do.)
"""

from __future__ import annotations

from typing import Any

import pytest

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
                                    f"in tests/parallel.py as REAL_MODEL, so that it loads once")
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
