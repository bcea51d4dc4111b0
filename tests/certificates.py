"""A self-signed certificate for the TLS tests, made with the openssl command."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest


@dataclasses.dataclass(frozen=True)
class Certificate:
    cert: Path
    key: Path

    @property
    def pem(self) -> bytes:
        return self.cert.read_bytes()


def self_signed(directory: Path) -> Certificate:
    """A self-signed certificate for localhost and 127.0.0.1 (it is its own CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("the TLS tests make their certificate with the openssl command, which is not on PATH")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return Certificate(cert, key)
