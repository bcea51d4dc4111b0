"""The `kvserve` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from cluster.client import add_client_parsers
from cluster.offline import add_offline_parser
from cluster.up import add_router_parser, add_up_parser
from workers.engine.errors import InvalidRequestError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="KV-cache-aware LLM serving")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_up_parser(subparsers)
    add_router_parser(subparsers)
    add_client_parsers(subparsers)
    add_offline_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except InvalidRequestError as exc:
        print(f"kvserve {args.command}: invalid request: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # configuration and model-loading errors name their field
        print(f"kvserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in a client command (kvserve up handles its own)
        print(f"\nkvserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvserve stream ID | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
