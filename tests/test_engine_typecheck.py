"""The engine core stays strictly typed and free of heavy imports.

workers/engine is plain Python so the scheduler and allocator can be tested in
milliseconds and reused by the simulator; torch, ray, redis and grpc belong elsewhere.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_DIR = REPO_ROOT / "workers" / "engine"
FORBIDDEN = frozenset({"torch", "ray", "redis", "grpc"})


def engine_files() -> list[Path]:
    return sorted(ENGINE_DIR.rglob("*.py"))


def imported_top_level_modules(source: str, filename: str = "<source>") -> set[str]:
    """Top-level names of every absolute import in the source, wherever it appears."""
    tree = ast.parse(source, filename=filename)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))
            and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value.split(".")[0])
    return names


def test_engine_files_exist() -> None:
    assert (ENGINE_DIR / "scheduler.py") in engine_files()


@pytest.mark.parametrize("path", engine_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_engine_imports_no_heavy_dependency(path: Path) -> None:
    forbidden = imported_top_level_modules(path.read_text(), str(path)) & FORBIDDEN
    assert not forbidden, f"{path.relative_to(REPO_ROOT)} imports {sorted(forbidden)}"


def test_import_scan_sees_every_form() -> None:
    source = (
        "import os, torch.nn\n"
        "from ray import actor\n"
        "from . import x\n"
        "def f() -> None:\n"
        "    import grpc.aio\n"
        "importlib.import_module('redis.client')\n"
    )
    assert imported_top_level_modules(source) == {"os", "torch", "ray", "grpc", "redis"}


@pytest.mark.parametrize("package", ["workers/engine", "router"])
def test_passes_mypy_strict(package: str) -> None:
    """The engine core, and the router against grpcio's and protobuf's published stubs (the
    `test` extra); protoc's generated module is not checked (pyproject.toml, [tool.mypy])."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", package],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    output = result.stdout + result.stderr
    print(output)
    assert result.returncode == 0, f"mypy --strict {package} failed:\n{output}"


def test_the_policy_benchmark_type_checks() -> None:
    """bench-policies' modules, not strict (what they import is followed silently): a name
    left undefined on a path no test drives (--address) fails here, as one did."""
    modules = ["loadtest/bench_policies.py", "loadtest/policy_rounds.py", "loadtest/policy_rates.py",
               "loadtest/policy_replay.py"]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent", *modules],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mypy {' '.join(modules)} failed:\n{output}"
