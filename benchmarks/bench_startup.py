"""CPU and wall time of short eblvm commands, each a new process, with the garbage collector paused
while torch loads (what eblvm does, eblvm_core/startup.py) and without the pause (docs/benchmarks.md).

    python benchmarks/bench_startup.py [--rounds 5]
    python benchmarks/bench_startup.py --smoke      # one round of validate: a check, in seconds

Each command runs as ``python -c`` of eblvm's entry point, once as it is and once with
``eblvm_core.startup.pause_gc`` replaced by a function that does nothing, so that the two differ in
the pause alone; the two take turns ``--rounds`` times. A process's CPU time is its user + system
time (``resource.RUSAGE_CHILDREN``). Both must print the same final lines (a run's evaluation,
validate's ``ok``): the script stops where they differ.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "validate grbm_bissm": ["validate", "grbm_bissm"],
    "run grbm_bissm, 50 steps": ["run", "grbm_bissm", "-o", "run.steps=50", "-o", "run.compile=false"],
}
ENTRY = "import sys; from eblvm_core.cli import main; sys.argv = ['eblvm', *sys.argv[1:]]; main()"
NO_PAUSE = "import eblvm_core.startup as startup; startup.pause_gc = lambda: None; " + ENTRY


def timed(code: str, args: list[str], cwd: str) -> tuple[float, float, list[str]]:
    """(CPU seconds, wall seconds, the ``name: value`` lines of stdout) of ``python -c CODE ARGS``."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, stdout=subprocess.PIPE, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} exited with {done.returncode}:\n{done.stdout}")
    lines = [line for line in done.stdout.splitlines() if re.fullmatch(r"ok: \S+|[\w/.-]+: [-+\d.e]+", line)]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu, wall, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one round of validate")
    args = parser.parse_args()
    commands = {"validate grbm_bissm": COMMANDS["validate grbm_bissm"]} if args.smoke else COMMANDS
    rounds = 1 if args.smoke else args.rounds
    variants = {"paused": ENTRY, "not paused": NO_PAUSE}
    print(f"{sys.platform}, {os.cpu_count()} cores, {rounds} rounds; median CPU and wall seconds of a process")
    with tempfile.TemporaryDirectory() as cwd:
        for name, command in commands.items():
            cpu: dict[str, list[float]] = {v: [] for v in variants}
            wall: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(rounds):
                outputs = {}
                for variant, code in variants.items():
                    seconds, elapsed, outputs[variant] = timed(code, command, cwd)
                    cpu[variant].append(seconds)
                    wall[variant].append(elapsed)
                if outputs["paused"] != outputs["not paused"]:
                    raise SystemExit(f"{name}: the outputs differ: {outputs}")
            paused, not_paused = (statistics.median(cpu[v]) for v in variants)
            print(
                f"  {name}: paused {paused:.2f} CPU-s ({statistics.median(wall['paused']):.2f} s wall), "
                f"not paused {not_paused:.2f} CPU-s ({statistics.median(wall['not paused']):.2f} s wall): "
                f"{not_paused / paused:.2f}x the CPU"
            )


if __name__ == "__main__":
    main()
