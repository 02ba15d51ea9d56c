"""Third-party plugins end to end: the example `examples/eblvm-renyi` installed into a temporary
site folder (no network), seen by `eblvm plugins`, used by `eblvm run`, passing its own tests;
and the from-zero walk-through of docs/plugins.md run literally."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from eblvm_core.errors import ConfigError
from eblvm_core.plugins import load
from eblvm_core.recipe import load_recipe
from tests.support import ROOT

pytestmark = pytest.mark.slow  # every test here starts processes (torchrun ranks, pip installs)

EXAMPLE = ROOT / "examples" / "eblvm-renyi"
RECIPE = EXAMPLE / "recipes" / "grbm_bissm_renyi.toml"


# What a BiSSM run of the example needs: pinning them skips the others' imports (seconds per process).
NEEDED = "toy,grbm,posteriors,score,divergences,bism,renyi"


def environ(site: Path | None, pin: str | None = None) -> dict[str, str]:
    """This interpreter's scripts first on PATH, one thread, ``site`` (only) on PYTHONPATH, plugins pinned to ``pin``."""
    env = {k: v for k, v in os.environ.items() if k not in ("EBLVM_LOAD_PLUGINS", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    if site is not None:
        env["PYTHONPATH"] = str(site)
    if pin is not None:
        env["EBLVM_LOAD_PLUGINS"] = pin
    return env


def run(args: list, site: Path | None, cwd: Path = ROOT, pin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, env=environ(site, pin), cwd=cwd, timeout=600
    )


def install(source: Path, target: Path, workdir: Path) -> None:
    """`pip install --no-deps --no-build-isolation --target` a copy of ``source`` (the build
    leaves build/ and *.egg-info next to the sources, so not in the repository)."""
    assert importlib.util.find_spec("setuptools"), (
        "--no-build-isolation builds with the installed setuptools, and there is none"
    )
    copy = workdir / source.name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    proc = run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            target,
            copy,
        ],
        None,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def renyi_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    install(EXAMPLE, site, tmp_path_factory.mktemp("build"))
    entry_points = (site / "eblvm_renyi-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[eblvm]" in entry_points and "renyi = eblvm_renyi" in entry_points
    return site


def test_eblvm_plugins_lists_the_installed_example(renyi_site):
    proc = run([sys.executable, "-m", "eblvm_core.cli", "plugins"], renyi_site)
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout + proc.stderr
    block = proc.stdout.split("renyi  (eblvm_renyi)\n")[1].split("\n\n")[0]
    assert block.startswith("  divergence renyi: Variational Rényi α-divergence")
    assert "      alpha: float = 0.5  order α > 0 of the Rényi divergence" in block
    assert "      n_samples: int = 5  samples k of h ~ q(h|v)" in block


def test_eblvm_run_trains_with_the_renyi_divergence(renyi_site, tmp_path):
    assert "renyi" not in load()["divergences"]  # this process lacks the plugin, and so cannot read the recipe:
    with pytest.raises(ConfigError, match="unknown divergence 'renyi'"):
        load_recipe(RECIPE)
    proc = run(
        [sys.executable, "-m", "eblvm_core.cli", "run", RECIPE, "-o", "run.steps=5", "--out", tmp_path],
        renyi_site,
        pin=NEEDED,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = Path(re.search(r"^done: (.+)$", proc.stdout, re.M).group(1))
    resolved = tomllib.loads((run_dir / "recipe.toml").read_text())
    assert resolved["divergence"] == {"kind": "renyi", "alpha": 0.5, "n_samples": 5}
    assert resolved["estimator"]["kind"] == "bism-unrolled"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lower = [row["train/lower_loss"] for row in rows if "train/lower_loss" in row]
    assert lower and all(math.isfinite(x) for x in lower)
    assert math.isfinite(
        next(row for row in rows if "eval/exact-loglik/test_loglik" in row)["eval/exact-loglik/test_loglik"]
    )


def test_the_example_passes_its_own_tests_with_eblvm_core_testing(renyi_site):
    """Its tests: the divergence contract (minimal at the exact posterior on the linear-Gaussian
    model and the tiny GRBM), agreement with the `kl` plugin as α → 1, the finite-k bias, a short run."""
    proc = run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", EXAMPLE / "tests"], renyi_site, pin=NEEDED
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "eblvm_renyi" not in proc.stderr
    for name in (
        "test_divergence_contract[Renyi0-check_divergence]",
        "test_agrees_with_the_kl_plugin_as_alpha_tends_to_1",
        "test_finite_k_bias_is_upward_and_shrinks_with_k_to_the_closed_form",
        "test_the_example_recipe_trains_with_renyi",
    ):
        assert re.search(re.escape(name) + r".* PASSED", proc.stdout), name


# ---- the docs' from-zero walk-through ------------------------------------------------------------

FENCE = re.compile(r"^```(\w+)[ \t]*([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def walkthrough() -> tuple[dict[str, str], str, list[str]]:
    """(files, bash script, expected output lines) of docs/plugins.md: blocks titled with a file's
    path (``title="PATH"``), ``bash {.run}`` and ``text {.output}``."""
    files, commands, expected = {}, [], []
    for lang, info, body in FENCE.findall((ROOT / "docs" / "plugins.md").read_text()):
        attrs = info.split()
        paths = [a.removeprefix("title=").strip('"') for a in attrs if a.startswith("title=")]
        if paths:
            files[paths[0]] = body
        elif lang == "bash" and "{.run}" in attrs:
            commands.append(body)
        elif lang == "text" and "{.output}" in attrs:
            expected += [line for line in body.splitlines() if line.strip()]
    return files, "set -euo pipefail\n" + "\n".join(commands), expected


def test_the_docs_walkthrough_works_when_followed_literally(tmp_path):
    files, script, expected = walkthrough()
    assert {
        "eblvm-logvar/pyproject.toml",
        "eblvm-logvar/eblvm_logvar/__init__.py",
        "eblvm-logvar/tests/conftest.py",
        "eblvm-logvar/tests/test_log_variance.py",
    } <= set(files)
    assert 'pytest_plugins = ["eblvm.testing"]' in files["eblvm-logvar/tests/conftest.py"]  # the kit, opted into
    assert "pip install" in script and "eblvm plugins" in script and "eblvm run" in script and len(expected) >= 4
    for path, body in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    proc = run(["bash", "-c", script], None, cwd=tmp_path)
    assert proc.returncode == 0, f"the walk-through failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    missing = [line for line in expected if line.strip() not in proc.stdout]
    assert not missing, (
        f"output lines the docs promise but the commands did not print: {missing}\n{proc.stdout[-3000:]}"
    )
    run_dir = next((tmp_path / "runs" / "grbm_bissm_logvar").iterdir())
    assert tomllib.loads((run_dir / "recipe.toml").read_text())["divergence"] == {
        "kind": "log-variance",
        "n_samples": 8,
    }
    lower = [json.loads(line).get("train/lower_loss") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in lower if x is not None] and all(math.isfinite(x) for x in lower if x is not None)
