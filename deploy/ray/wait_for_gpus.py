"""Wait until a Ray cluster offers at least N GPUs, so `kvserve up` starts one GPU worker each.

    python deploy/ray/wait_for_gpus.py 2 [--address auto] [--timeout 1800]

`kvserve up` sizes its workers from the GPUs present when it starts; on a fresh `ray up`
or KubeRay cluster the GPU nodes join minutes after the head, so the start commands run
this first.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("num_gpus", type=int)
    parser.add_argument("--address", default="auto")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    args = parser.parse_args(argv)

    import ray

    ray.init(address=args.address, include_dashboard=False, logging_level="WARNING")
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            found = int(ray.cluster_resources().get("GPU", 0))
            if found >= args.num_gpus:
                print(f"[kvserve] {found} GPUs in the Ray cluster", file=sys.stderr)
                return 0
            if time.monotonic() > deadline:
                print(f"[kvserve] gave up: {found} of {args.num_gpus} GPUs after {args.timeout:g} s", file=sys.stderr)
                return 1
            print(f"[kvserve] waiting for GPUs: {found} of {args.num_gpus}", file=sys.stderr, flush=True)
            time.sleep(10)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
