"""Profile the tiny model on 2 CPU ranks (gloo) and print the tables: one command, under 2 minutes.

    PYTHONPATH=. python benchmarks/profile_tiny.py [--ranks 2] [--dtype bf16] [--max-message-size 256MiB]

Measures into a temporary cache (never reuses an earlier measurement) and reports the wall time. Both
ranks measure compute at once, as the executor's ranks will run; links cover 4 KiB .. 256 MiB.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--max-message-size", default="256MiB")
    p.add_argument("-o", "--output", help="also write the profile JSON here")
    args = p.parse_args()
    from meshplan.profiler.cli import main as profile_main

    argv = ["tiny", "--cluster", f"{args.ranks}xcpu", "--dtype", args.dtype, "--force",
            "--max-message-size", args.max_message_size] + (["-o", args.output] if args.output else [])
    with tempfile.TemporaryDirectory(prefix="meshplan-bench-") as cache:
        os.environ["MESHPLAN_CACHE"] = cache
        start = time.perf_counter()
        code = profile_main(argv)
        elapsed = time.perf_counter() - start
    print(f"plan profile {' '.join(argv)}: {elapsed:.1f} s wall (limit 120 s)")
    return code if elapsed < 120 else 1


if __name__ == "__main__":
    sys.exit(main())
