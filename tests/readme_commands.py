"""The shell commands that README.md and docs/deploy.md show, read out of their ```bash blocks.

A command is one logical line: backslash continuations joined, the trailing `# comment`
dropped, leading indentation removed. tests/test_readme_commands.py runs them as written
and checks that every one of them is either run by a test or a benchmark, or is named as
one that cannot run here (a cloud or a Kubernetes cluster).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "deploy.md")
_BLOCK = re.compile(r"^[ \t]*```bash\n(.*?)^[ \t]*```", re.S | re.M)
_HEADING = re.compile(r"^#+ (.+)$", re.M)
# How long a fixed port may stay taken before skip_unless_free calls it taken (see there).
FREE_WAIT_S = 30.0


@dataclass(frozen=True)
class Command:
    document: str  # "README.md" or "docs/deploy.md"
    section: str  # the heading above the block
    text: str  # the command as a person types it, without its comment


def _strip_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (not one inside quotes)."""
    quote: str | None = None
    for index, char in enumerate(line):
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def commands(document: Path) -> list[Command]:
    text = document.read_text(encoding="utf-8")
    headings = [(m.start(), m.group(1).strip()) for m in _HEADING.finditer(text)]
    found = []
    for block in _BLOCK.finditer(text):
        section = next((title for start, title in reversed(headings) if start < block.start()), "")
        logical: list[str] = []
        pending = ""
        for raw in block.group(1).splitlines():
            line = raw.strip()
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            line = pending + line
            pending = ""
            line = _strip_comment(line)
            if line:
                logical.append(line)
        name = str(document.relative_to(ROOT))
        found.extend(Command(name, section, line) for line in logical)
    return found


def all_commands() -> list[Command]:
    return [command for document in DOCUMENTS for command in commands(document)]


def quickstart() -> list[str]:
    """The README's "Quickstart: a cluster" block, in order."""
    return [c.text for c in commands(ROOT / "README.md") if c.section == "Quickstart: a cluster"]


def skip_unless_free(ports: Sequence[int], why: str) -> None:
    """Skip the test when one of these fixed ports is taken on this machine (a developer's own
    `make serve`, say), saying so. Under CI (CI=true, a fresh machine) a taken port is a
    test's leftover, so it fails: a skip there would leave the README's commands unrun.

    The README's ports lie in Linux's ephemeral range (32768-60999), so a connection that
    another test running beside this one opens may hold one for a moment (a CI run failed
    so, on 50052, free again by the end of the run). A port counts as taken only if it
    stays taken for FREE_WAIT_S (a tenth of that outside CI)."""
    wait_s = FREE_WAIT_S if os.environ.get("CI") == "true" else FREE_WAIT_S / 10
    deadline = time.monotonic() + wait_s
    while True:
        taken = [port for port in ports if port_taken(port)]
        if not taken:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    reason = f"port(s) {taken} are taken on this machine; {why}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: something the suite started still holds them)")
    print(f"SKIP: {reason}", file=sys.stderr)
    pytest.skip(reason)


def port_taken(port: int, host: str = "0.0.0.0") -> bool:
    """Whether a server could not bind `port` now. SO_REUSEADDR as servers bind: a port
    whose old connections sit in TIME_WAIT is free to them."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False
