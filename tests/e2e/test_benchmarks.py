"""The timing and profiling scripts of benchmarks/ at their tiny sizes, on the CPU and in-process:
each runs as ``python benchmarks/NAME.py ARGS`` would (runpy, sys.argv patched), and its report
must hold the rows and columns it promises, with positive, finite times. The CUDA-only script is
checked for its refusal without a GPU and, on a GPU, at its smoke size. Every script of
benchmarks/ and studies/ shows its usage lines under --help, and nothing imports them."""

from __future__ import annotations

import math
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
STUDIES = ROOT / "studies"
SCRIPTS = sorted(BENCHMARKS.glob("*.py")) + sorted(STUDIES.glob("*.py"))


@pytest.fixture(autouse=True)
def torch_settings_put_back():
    """The scripts set torch's thread count, cuDNN autotuning and subnormal flushing for the process."""
    threads, autotune = torch.get_num_threads(), torch.backends.cudnn.benchmark
    yield
    torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = autotune
    torch.set_flush_denormal(False)


def run_script(path: Path, *args: object, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Run a script as ``python PATH ARGS`` does, in this process; return its globals."""
    monkeypatch.setattr(sys, "argv", [str(path), *map(str, args)])
    monkeypatch.syspath_prepend(str(path.parent))  # as for a script: its own folder first
    return runpy.run_path(str(path), run_name="__main__")


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in ``text``, as lists of stripped cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if row[0] not in ("size", "case", "format")]  # headers out


def positive(text: str) -> float:
    """The first number in ``text``, which must be positive and finite."""
    value = float(re.match(r"-?[\d.]+", text).group())
    assert math.isfinite(value) and value > 0, text
    return value


def spread(cell: str) -> tuple[float, float, float]:
    """'median (p10-p90)' -> the three numbers, checked to be positive and ordered."""
    median, low, high = map(float, re.fullmatch(r"([\d.]+) \(([\d.]+)-([\d.]+)\)", cell).groups())
    assert 0 < low <= median <= high and math.isfinite(high), cell
    return median, low, high


@pytest.mark.slow
def test_bench_estimators_times_every_checkerboard_estimator(tmp_path, monkeypatch):
    out = tmp_path / "table.md"
    script = run_script(BENCHMARKS / "bench_estimators.py", "--smoke", "--out", out, monkeypatch=monkeypatch)
    text = out.read_text()
    assert "| size | estimator | 1 thread (ms) |" in text
    rows = table_rows(text)
    assert [row[1] for row in rows] == [name for name, _, _ in script["CHECKERBOARD"]]
    for size, _, cell in rows:
        assert size == "checkerboard"
        spread(cell)


@pytest.mark.slow
def test_bench_compile_compiles_cold_and_warm_and_lists_what_does_not_compile(tmp_path):
    """In processes of their own (an inductor cache each): a compiled case with its ratio, compile
    times and a one-step difference at float rounding; an estimator that does not compile, with why."""
    out = tmp_path / "table.md"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_compile.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = table_rows(out.read_text())
    assert [row[1] for row in rows] == ["exact-score DSM", "BiSM implicit (K=5, Neumann 40)"]
    eager, compiled, graph, loop, ratio, loop_ratio, cold, warm, difference = rows[0][2:11]
    assert float(ratio) == pytest.approx(float(eager) / float(compiled), rel=0.05) and float(difference) < 1e-4
    assert float(loop_ratio) == pytest.approx(float(loop) / float(graph), rel=0.05)
    assert float(cold) > 0 and float(warm) > 0
    assert "not compiled: its conjugate-gradient and Neumann solves stop at a tolerance" in rows[1][3]


@pytest.mark.slow
def test_bench_overhead_checks_the_same_math_then_times_four_steps(monkeypatch, capsys):
    run_script(BENCHMARKS / "bench_overhead.py", "--smoke", monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    differences = re.findall(r"step \d: max relative difference: parameters ([\d.e+-]+)", out)
    assert len(differences) == 3 and all(float(d) <= 1e-6 for d in differences)  # the script's own bound
    rows = table_rows(out)
    assert [row[1] for row in rows] == [
        "hand-written",
        "estimator.step",
        "Trainer.fit, per step",
    ]
    for _, _, cell, ratio in rows:
        spread(cell)
        positive(ratio)
    assert rows[0][3] == "1.000"  # each ratio is to the hand-written step


@pytest.mark.slow
def test_bench_deep_builds_and_times_every_case_at_its_tiny_size(tmp_path, monkeypatch):
    out = tmp_path / "deep.md"
    script = run_script(
        BENCHMARKS / "bench_deep.py", "--smoke", "--device", "cpu", "--out", out, monkeypatch=monkeypatch
    )
    text = out.read_text()
    assert "batch 4 and tiny networks" in text
    rows = table_rows(text)
    assert [row[0] for row in rows] == [name for name, _, _ in script["CASES"]]  # eager only on a CPU
    for row in rows:
        assert len(row) == 10 and row[1] == "eager"
        positive(row[2])
        assert row[7] == ""  # the ratio to the released code is printed on a GPU only
    released = {row[0]: row[6] for row in rows}
    assert released["BiMDSM (K=5, N=0), fp32"] == "111.5"  # the released code's H100 figure beside its case


@pytest.mark.slow
def test_bench_deep_counts_flops_measures_a_peak_and_profiles(tmp_path, monkeypatch, capsys):
    path, flops, peak = BENCHMARKS / "bench_deep.py", tmp_path / "flops.md", tmp_path / "peak.md"
    run_script(path, "--smoke", "--device", "cpu", "--flops", "--cases", 8, 11, "--out", flops, monkeypatch=monkeypatch)
    rows = table_rows(flops.read_text())
    assert [row[0] for row in rows] == ["BiDVL, conv nets (N=1)", "MNIST BiMDSM (K=5, N=0)"]
    assert all(positive(row[1]) for row in rows)

    run_script(path, "--smoke", "--device", "cpu", "--peak", "--out", peak, monkeypatch=monkeypatch)
    (row,) = table_rows(peak.read_text())
    assert row[0] == "fp32" and positive(row[1]) and positive(row[2])
    capsys.readouterr()

    run_script(path, "--smoke", "--device", "cpu", "--profile", "--cases", 11, monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    header = re.search(r"### MNIST BiMDSM \(K=5, N=0\), fp32: ([\d.]+) ms per step under the profiler", out)
    assert header and positive(header.group(1))
    assert "Self CPU time total" in out


def test_bench_subnormals_times_a_run_both_ways(tmp_path, monkeypatch, capsys):
    import eblvm

    run = eblvm.train(
        ROOT / "recipes" / "grbm_bissm.toml",
        overrides=["run.steps=4", "run.log_every=2", "run.checkpoint_every=4", "~eval"],
        out=tmp_path,
        echo=None,
    )
    run_script(BENCHMARKS / "bench_subnormals.py", run.run_dir, "--steps", 2, "--rounds", 1, monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert "grbm_bissm at step 4, one CPU thread:" in out
    ieee = re.search(r"IEEE subnormals: ([\d.]+) ms per step", out).group(1)
    flushed = re.search(r"flushed to zero: ([\d.]+) ms per step", out).group(1)
    ratio = re.search(r"ratio: ([\d.]+)x", out).group(1)
    assert positive(ratio) == pytest.approx(positive(ieee) / positive(flushed), rel=0.05)


@pytest.mark.slow
def test_bench_startup_times_validate_paused_and_not_with_the_same_output(monkeypatch, capsys):
    run_script(BENCHMARKS / "bench_startup.py", "--smoke", monkeypatch=monkeypatch)
    line = capsys.readouterr().out.splitlines()[-1]
    found = re.fullmatch(
        r"  validate grbm_bissm: paused ([\d.]+) CPU-s \(([\d.]+) s wall\), "
        r"not paused ([\d.]+) CPU-s \(([\d.]+) s wall\): ([\d.]+)x the CPU",
        line,
    )
    assert found, line
    paused, _, not_paused, _, ratio = map(positive, found.groups())
    assert ratio == pytest.approx(not_paused / paused, abs=0.01)


@pytest.mark.slow
def test_bench_samplers_measures_every_sampler_at_its_tiny_size(trained, tmp_path, monkeypatch):
    out = tmp_path / "samplers.md"
    run_script(BENCHMARKS / "bench_samplers.py", trained, "--smoke", "--out", out, monkeypatch=monkeypatch)
    text = out.read_text()
    assert "80 samples (10 chains × 8), 20 warm-up transitions, one CPU thread" in text
    rows = [row for row in table_rows(text) if row[0] != "sampler"]
    assert [row[0] for row in rows] == [
        "exact draws",
        "Gibbs",
        "MALA",
        "HMC (L = 10)",
        "tempering, Gibbs moves (8 β to 0.1)",
        "tempering, MALA moves (8 β to 0.1)",
    ]
    for label, distance, *measured in rows:
        assert 0 <= float(distance) <= 1
        for cell in measured if label != "exact draws" else ():
            positive(cell.replace(",", ""))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_bench_cuda_graph_says_it_needs_a_cuda_device(monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        run_script(BENCHMARKS / "bench_cuda_graph.py", "--smoke", monkeypatch=monkeypatch)
    assert stop.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="trains on a CUDA device")
def test_bench_cuda_graph_replays_grbm_bissm_to_the_eager_bits(tmp_path, monkeypatch):
    out = tmp_path / "graph.md"
    run_script(BENCHMARKS / "bench_cuda_graph.py", "--smoke", "--out", out, monkeypatch=monkeypatch)
    (row,) = [row for row in table_rows(out.read_text()) if row[0] == "checkerboard"]
    assert row[1] == "BiSSM (K=5, N=5): grbm_bissm"
    for cell in (row[2], row[3], row[4], row[5], row[6], row[8], row[9]):
        positive(cell)
    assert float(row[7]) == 0  # graph-replayed and eager runs end at the same parameters


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_shows_its_usage_lines(path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        run_script(path, "--help", monkeypatch=monkeypatch)
    assert stop.value.code == 0
    assert f"python {path.parent.name}/{path.name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gpu_run.sh", "gpu_prepare.sh"])
def test_the_gpu_shell_scripts_print_their_usage_without_arguments(name):
    done = subprocess.run(["bash", str(BENCHMARKS / name)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert f"bash benchmarks/{name}" in done.stderr


def test_nothing_imports_the_benchmarks_or_the_studies():
    names = {path.stem for path in SCRIPTS} | {"benchmarks", "studies"}
    imports = re.compile(r"^\s*(?:from|import)\s+(\w+)", re.MULTILINE)
    for folder in ("eblvm_core", "plugins", "tests", "examples"):
        for source in (ROOT / folder).rglob("*.py"):
            found = names.intersection(imports.findall(source.read_text(encoding="utf-8")))
            assert not found, f"{source.relative_to(ROOT)} imports {sorted(found)}"
