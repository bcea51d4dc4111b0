"""The grouping that lets `make test` run in two processes (tests/parallel.py) names files
that exist, and keeps together every file that binds this machine's fixed ports."""

from __future__ import annotations

from pathlib import Path

from tests.parallel import FILE_GROUPS, FIXED_PORTS, SLOWEST_FIRST, group_of

TESTS = Path(__file__).resolve().parent


def test_every_file_the_grouping_names_exists() -> None:
    groups = set(FILE_GROUPS.values())
    named = set(FILE_GROUPS) | {name for name in SLOWEST_FIRST if name not in groups}
    missing = sorted(name for name in named if not (TESTS / name).is_file())
    assert not missing, f"tests/parallel.py names files that are not in tests/: {missing}"
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)


def test_the_files_that_bind_fixed_ports_share_one_group() -> None:
    # Such a file checks its ports with skip_unless_free (tests/readme_commands.py) first.
    binders = sorted(p.name for p in TESTS.glob("test_*.py")
                     if p.name != Path(__file__).name and "skip_unless_free(" in p.read_text())
    assert binders, "no test file checks its fixed ports"
    assert {name: group_of(f"tests/{name}::t") for name in binders} == {name: FIXED_PORTS for name in binders}
    assert group_of("tests/test_two_nodes.py::test_x") == "test_two_nodes.py"
