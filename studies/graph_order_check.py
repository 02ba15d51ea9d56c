"""Which test of tests/e2e/test_cuda.py, run before it in the same process, makes a CUDA test fail.

    python studies/graph_order_check.py [TARGET] [--jobs 6]    # a CUDA device

TARGET (default: the graph-replay random-draw test, which failed only after other tests in one
process; docs/benchmarks.md) is run after each other test of the file, one fresh pytest process
per pair, ``--jobs`` at a time. Prints one line per pair (passed or failed, and the failure's
first line) and the target alone, so the tests that break it are named.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

FILE = "tests/e2e/test_cuda.py"
TARGET = f"{FILE}::test_graphed_step_replays_the_eager_updates_and_random_draws_and_falls_back_on_a_new_shape"


def pytest(target: str, *before: str) -> tuple[bool, str]:
    """(whether ``target`` passed, its first failure line) in a fresh pytest process that runs
    ``before`` first."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *before, target],
        capture_output=True,
        text=True,
    ).stdout
    failure = next((line for line in out.splitlines() if line.startswith("E ")), "")
    return f"PASSED {target}" in out, failure[:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="?", default=TARGET)
    parser.add_argument("--jobs", type=int, default=6)
    args = parser.parse_args()
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", FILE],
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    before = [line for line in collected if line.startswith(FILE + "::") and line != args.target]
    print(f"alone: {'passed' if pytest(args.target)[0] else 'FAILED'}", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        for test, (passed, failure) in zip(before, pool.map(lambda t: pytest(args.target, t), before)):
            print(f"{'passed' if passed else 'FAILED'} after {test.removeprefix(FILE + '::')}  {failure}", flush=True)


if __name__ == "__main__":
    main()
