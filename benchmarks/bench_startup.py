"""CPU and wall time of short eblvm commands, each a new process, with the garbage collector paused
while torch loads (what eblvm does, eblvm_core/startup.py) and without the pause; and of a
comparison with two worker processes forked from a server that loaded torch once (what eblvm does)
and spawned, each loading torch again (docs/benchmarks.md).

    python benchmarks/bench_startup.py [--rounds 5]
    python benchmarks/bench_startup.py --smoke      # one round of validate: a check, in seconds

Each command runs as ``python -c`` of eblvm's entry point, once as it is and once with
``eblvm_core.startup.pause_gc`` replaced by a function that does nothing, so that the two differ in
the pause alone; the two take turns ``--rounds`` times. A process's CPU time is its user + system
time (``resource.RUSAGE_CHILDREN``). Both must print the same final lines (a run's evaluation,
validate's ``ok``): the script stops where they differ.

The comparison (2 methods × 2 seeds of 20 steps, ``--jobs 2``) runs as it is and with
``multiprocessing.get_all_start_methods`` answering spawn alone. Its fork server is not this
script's child, so its CPU time is the machine's (``/proc/stat``, Linux; skipped elsewhere): run it
on a quiet machine. Both must give the same final evaluations (results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

COMMANDS = {
    "validate grbm_bissm": ["validate", "grbm_bissm"],
    "run grbm_bissm, 50 steps": ["run", "grbm_bissm", "-o", "run.steps=50", "-o", "run.compile=false"],
}
ENTRY = "import sys; from eblvm_core.cli import main; sys.argv = ['eblvm', *sys.argv[1:]]; main()"
NO_PAUSE = "import eblvm_core.startup as startup; startup.pause_gc = lambda: None; " + ENTRY
SPAWNED = "import multiprocessing; multiprocessing.get_all_start_methods = lambda: ['spawn']; " + ENTRY
Measured = tuple[float, float, Any]  # CPU seconds, wall seconds, a result both variants must share
POOL_SPEC = """[compare]
name = "pool"
metrics = ["eval/exact-loglik/test_loglik"]
overrides = ["run.steps=20", "run.compile=false", "data.n_train=500", "data.n_test=200"]

[[method]]
name = "CD"
recipe = "{cd}"

[[method]]
name = "DSM"
recipe = "{dsm}"
"""


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


def taking_turns(name: str, variants: dict[str, str], rounds: int, measure: Callable[[str], Measured]) -> None:
    """Print the median CPU and wall seconds of each of the two ``variants`` (label: code), measured
    by ``measure(code) -> (CPU s, wall s, result)`` taking turns ``rounds`` times, and the second's
    CPU over the first's; stop where the results of a round differ."""
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        results = {}
        for variant, code in variants.items():
            seconds, elapsed, results[variant] = measure(code)
            cpu[variant].append(seconds)
            wall[variant].append(elapsed)
        first_result, second_result = results.values()
        if first_result != second_result:
            raise SystemExit(f"{name}: the results differ: {results}")
    (first, first_cpu), (second, second_cpu) = ((v, statistics.median(cpu[v])) for v in variants)
    print(
        f"  {name}: {first} {first_cpu:.2f} CPU-s ({statistics.median(wall[first]):.2f} s wall), "
        f"{second} {second_cpu:.2f} CPU-s ({statistics.median(wall[second]):.2f} s wall): "
        f"{second_cpu / first_cpu:.2f}x the CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one round of validate")
    args = parser.parse_args()
    commands = {"validate grbm_bissm": COMMANDS["validate grbm_bissm"]} if args.smoke else COMMANDS
    rounds = 1 if args.smoke else args.rounds
    print(f"{sys.platform}, {os.cpu_count()} cores, {rounds} rounds; median CPU and wall seconds of a process")
    with tempfile.TemporaryDirectory() as cwd:
        for name, command in commands.items():
            variants = {"paused": ENTRY, "not paused": NO_PAUSE}
            taking_turns(name, variants, rounds, lambda code, command=command: timed(code, command, cwd))
        if not args.smoke and os.path.exists("/proc/stat"):
            pool(rounds, cwd)


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (every process), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(f) for f in stat.readline().split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def pool(rounds: int, cwd: str) -> None:
    """The comparison with its workers forked from the fork server and spawned, taking turns; its
    CPU seconds are the machine's, its result each run's final evaluations."""
    from eblvm_core.recipe.library import recipe_file

    spec = os.path.join(cwd, "pool.toml")
    with open(spec, "w") as file:
        file.write(POOL_SPEC.format(cd=recipe_file("grbm_cd"), dsm=recipe_file("grbm_dsm")))

    def measure(code: str) -> Measured:
        out = os.path.join(tempfile.mkdtemp(dir=cwd), "results")
        command = ["compare", spec, "--seeds", "2", "--jobs", "2", "--out", out, "--device", "cpu"]
        busy = busy_seconds()
        _, elapsed, _ = timed(code, command, cwd)
        cpu = busy_seconds() - busy
        with open(os.path.join(out, "results.json")) as results:
            return cpu, elapsed, sorted((r["method"], r["seed"], r["final"]) for r in json.load(results)["runs"])

    name = "compare, 2 methods x 2 seeds, --jobs 2 (the machine's CPU)"
    taking_turns(name, {"forked": ENTRY, "spawned": SPAWNED}, rounds, measure)


if __name__ == "__main__":
    main()
