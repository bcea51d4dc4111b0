"""Generates the gRPC stubs from the .proto whenever the package is built or installed."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithStubs(build_py):
    def run(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from protos.generate import generate

        generate()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
