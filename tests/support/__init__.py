"""What many tests share: the repository's paths, small recipes, random GRBMs away from their
initial values, a run killed (kill -9) mid-training, a step poisoned with a NaN, and the check of a
one-line CLI error. Fixtures are in tests/conftest.py; test plugins beside this file."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from eblvm_grbm.model import GRBM

from tests.support.forked import Forked

ROOT = Path(__file__).resolve().parents[2]  # the repository
RECIPES = ROOT / "recipes"

# A small exact-score DSM run on a small checkerboard: fast enough for end-to-end tests.
SMALL_RECIPE = """
[run]
name = "small"
seed = 7
steps = 30
batch_size = 50
log_every = 10
checkpoint_every = 10

[data]
kind = "checkerboard"
n_train = 2000
n_test = 500

[model]
kind = "grbm"
n_hidden = 4

[objective]
kind = "dsm"
sigma = 0.1

[estimator]
kind = "exact-score"

[optim.model]
kind = "adam"
lr = 1e-2

[[eval]]
kind = "exact-loglik"
"""

# SMALL_RECIPE trained by BiSM: a Bernoulli posterior, the KL lower level, one inner and one unrolled step
BISM = SMALL_RECIPE.replace(
    '[estimator]\nkind = "exact-score"',
    """[posterior]
kind = "bernoulli"

[divergence]
kind = "kl"

[estimator]
kind = "bism-unrolled"
inner_steps = 1
unroll_steps = 1

[optim.posterior]
kind = "adam\"""",
)


def grbm_away_from_init(
    d: int,
    m: int,
    *,
    sigma: float,
    weight_std: float,
    seed: int = 0,
    coupling: str = "scaled",
    dtype: torch.dtype = torch.float64,
) -> GRBM:
    """A GRBM with d visible and m hidden units and every parameter away from its initial value:
    σ = ``sigma``, W ~ N(0, weight_std²), b and c ~ N(0, 0.5²), drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    model = GRBM(d, m, init_sigma=sigma, init_weight_std=weight_std, coupling=coupling).to(dtype)
    with torch.no_grad():
        model.b.normal_(0.0, 0.5)
        model.c.normal_(0.0, 0.5)
    return model


def kill_run_when(recipe: Path, out: Path, ready: Callable[[Path], bool], timeout: float = 120.0) -> None:
    """Start ``eblvm run RECIPE --out OUT`` in a process (``forked.Forked``) and kill it (SIGKILL) as soon as a
    ``last.pt`` checkpoint exists for which ``ready(path)`` holds, or when it ends or times out."""
    proc = Forked(["run", recipe, "--out", out])
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = list(out.glob("*/*/checkpoints/last.pt"))
        if found and ready(found[0]):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def poison_at(monkeypatch, step: int, what) -> None:
    """Make the built estimator call ``what(built, metrics)`` after its ``step``-th step (counted
    from the build), with that step's metrics, which it may change in place."""
    import eblvm_core.session as session_module

    real_build = session_module.build

    def build(*args, **kwargs):
        built = real_build(*args, **kwargs)
        real_step, count = built.parts.estimator.step, [0]

        def poisoned(batch):
            metrics = real_step(batch)
            count[0] += 1
            if count[0] == step:
                what(built, metrics)
            return metrics

        built.parts.estimator.step = poisoned
        return built

    monkeypatch.setattr(session_module, "build", build)


def one_line_error(result) -> str:
    """The one line a bad input gets from the CLI: exit code 2, no traceback, "error: ..."."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    return lines[0]


def session_run(recipe=None, overrides=(), device=None, out="runs", resume=None, echo=print, command=None, **attend):
    """``session.run`` called as the tests call it, positionally: (run_dir, final evaluation)."""
    from eblvm_core.launching import RunRequest
    from eblvm_core.session import run

    return run(RunRequest(recipe, overrides, resume, device, out, command), echo, **attend)


# ---- what the tests of a run's modules share (tests/core/test_{session,guard,records,...}.py) ----


def only_run_dir(out: Path) -> Path:
    """The one run directory under ``out`` (``<out>/<name>/<stamp>``)."""
    ((run_dir,),) = [list(p.iterdir()) for p in out.iterdir()]
    return run_dir


def scalars(output: str) -> dict[str, float]:
    """The 'name: value' lines of a command's output, as numbers."""
    found = {}
    for line in output.splitlines():
        key, _, value = line.partition(": ")
        try:
            found[key] = float(value)
        except ValueError:
            continue
    return found


def networks(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's tensors in a checkpoint file."""
    from eblvm_core import checkpoint as ckpt

    return ckpt.load(checkpoint)["networks"]["model"]


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names holding the same tensors, bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def metrics_rows(run_dir: Path) -> list[dict]:
    """Every row of ``run_dir``'s metrics.jsonl."""
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes, but the lock (which records its last holder)."""
    return {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in run_dir.rglob("*")
        if p.is_file() and p.name != ".lock"
    }


def one_line(result, code: int = 2, label: str = "error") -> str:
    """The one ``label: ...`` line of a CLI result that exited with ``code``, without a traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith(f"{label}: ")]
    assert len(lines) == 1, result.output
    return lines[0]


def error_lines(result) -> list[str]:
    """The ``error: ...`` lines of a CLI result that exited with code 2 (every line is one), without a traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert all(line.startswith("error: ") for line in lines), result.output
    return lines


def train_small(folder: Path, text: str = SMALL_RECIPE) -> Path:
    """A finished run of ``text`` (by default the small recipe: 30 steps, checkpoints at 10, 20 and
    30) trained in ``folder``/runs, quietly: its run directory."""
    recipe = folder / "r.toml"
    recipe.write_text(text)
    run_dir, _ = session_run(recipe, out=folder / "runs", echo=lambda _line: None)
    return run_dir


def flip_a_bit_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip the lowest bit of the first byte of ``tensor``'s data inside the checkpoint file."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the tensor's bytes must occur once in the file"
    data[at] ^= 1
    path.write_bytes(bytes(data))


def trained_tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's trained state (networks, optimizers, EMA), by path."""
    found = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, dict):
            found.update(trained_tensors(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            found.update(trained_tensors(dict(enumerate(value)), name + "/"))
    return found


def assert_same_parameters(a_dir: Path, b_dir: Path) -> None:
    """The last checkpoints of two run directories hold the same networks and roles, to the bit."""
    from eblvm_core import checkpoint as ckpt

    a, b = (ckpt.load(ckpt.last_checkpoint(d)) for d in (a_dir, b_dir))
    ta = trained_tensors({k: a[k] for k in ("networks", "roles")})
    tb = trained_tensors({k: b[k] for k in ("networks", "roles")})
    assert ta.keys() == tb.keys() and ta
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


def small_state(text: str = SMALL_RECIPE, overrides=()):
    """(recipe, RunState) of a recipe given as TOML text, on the CPU without loggers, built from its
    seed as a session builds it: what a Trainer trains, with no run directory."""
    import tomllib

    return small_state_of(tomllib.loads(text), overrides)


def small_state_of(data: dict, overrides=()):
    """``small_state`` of a recipe given as TOML-ready data (which it changes: no loggers)."""
    from eblvm_core import checkpoint as ckpt
    from eblvm_core.build import build
    from eblvm_core.session import resolve_recipe
    from eblvm_core.state import RunState

    data["log"] = []
    recipe = resolve_recipe(data, ["run.device=cpu", *overrides])
    ckpt.seed_everything(recipe.run.seed)
    return recipe, RunState(recipe, build(recipe, "cpu"))
