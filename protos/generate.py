"""Generate the Python gRPC stubs from protos/kvserve/v1/serving.proto.

    python -m protos.generate            # write them next to the .proto (what install does)
    python -m protos.generate --check    # exit 1 if the stubs in the tree are stale

The stubs are build output: generated at install (setup.py and `make venv`), git-ignored,
never edited by hand. The test suite fails if they differ from a fresh generation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("protos/kvserve/v1/serving.proto")
OUTPUTS = ("serving_pb2.py", "serving_pb2.pyi", "serving_pb2_grpc.py")


def generate(out_root: Path = ROOT) -> list[Path]:
    """Run protoc; the stubs land at out_root/protos/kvserve/v1/. Returns their paths."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(ROOT / PROTO),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO} with exit code {code}")
    return [out_root / PROTO.parent / name for name in OUTPUTS]


def stale_stubs() -> list[str]:
    """Names of stubs in the tree that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            current = ROOT / PROTO.parent / path.name
            if not current.exists() or current.read_bytes() != path.read_bytes():
                stale.append(path.name)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the stubs are current")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        if stale:
            print(f"stale gRPC stubs: {', '.join(stale)}; run python -m protos.generate", file=sys.stderr)
            return 1
        return 0
    for path in generate():
        print(f"generated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
