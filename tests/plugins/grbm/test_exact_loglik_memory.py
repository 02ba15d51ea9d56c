"""Exact log Z in bounded memory: the GRBM's 2^m hidden states are enumerated in chunks generated
from integer ranges, and `exact-loglik` refuses, at build time, enumerations beyond 2^40 states."""

from __future__ import annotations

import copy
import itertools
import math
import subprocess
import sys
from functools import partial

import pytest
import torch
from eblvm_grbm import evaluators
from eblvm_grbm import model as model_module
from eblvm_grbm.evaluators import ExactLoglikConfig, about, build_exact_loglik, time_estimate
from eblvm_grbm.model import CHUNK_ELEMENTS, GRBM, binary_states, default_chunk
from torch.utils._python_dispatch import TorchDispatchMode

from eblvm_core.contracts import DataSplits, Parts
from tests.support import SMALL_RECIPE, grbm_away_from_init, one_line_error

random_grbm = partial(grbm_away_from_init, sigma=0.8, weight_std=0.5)


def one_shot_log_partition(model: GRBM) -> torch.Tensor:
    """The enumeration before chunking: every state from itertools.product, one log-sum-exp."""
    d, m = model.W.shape
    hs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=m)), dtype=model.W.dtype)  # (2^m, m)
    uh = hs @ model.coupling_weight().T
    terms = hs @ model.c + uh @ model.b + 0.5 * model.sigma**2 * (uh**2).sum(-1)
    return torch.logsumexp(terms, 0) + 0.5 * d * torch.log(2 * math.pi * model.sigma**2)


def mode_log_partition(model: GRBM) -> float:
    """log Z another way: ∫ exp(−E(v, h)) dv = exp(−E(v*_h, h)) (2πσ²)^{d/2} at the mode v*_h = b + σ²Uh
    of the Gaussian p(v | h), through ``energy`` and ``visible_mean``, summed in float64 with math.fsum."""
    d, m = model.W.shape
    model = copy.deepcopy(model).double().requires_grad_(False)
    hs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=m)), dtype=torch.float64)
    neg_e = (-model.energy(model.visible_mean(hs), hs)).tolist()  # (2^m,)
    top = max(neg_e)
    log_volume = 0.5 * d * math.log(2 * math.pi * float(model.sigma) ** 2)
    return top + math.log(math.fsum(math.exp(x - top) for x in neg_e)) + log_volume


# ---- the states ------------------------------------------------------------------------------


def test_binary_states_are_the_product_order_from_any_start():
    m = 7
    product = torch.tensor(list(itertools.product([0.0, 1.0], repeat=m)))
    like = torch.zeros((), dtype=torch.float32)
    torch.testing.assert_close(binary_states(0, 2**m, m, like), product, rtol=0, atol=0)
    for start, stop in ((0, 1), (5, 42), (100, 128), (127, 128)):
        torch.testing.assert_close(binary_states(start, stop, m, like), product[start:stop], rtol=0, atol=0)
    # the last states of m = 40, numbered beyond 32 bits, against their binary digits
    m, start = 40, 2**40 - 3
    digits = [[float(c) for c in format(i, f"0{m}b")] for i in range(start, 2**40)]
    torch.testing.assert_close(binary_states(start, 2**40, m, like), torch.tensor(digits), rtol=0, atol=0)


def test_default_chunk_keeps_chunk_times_width_under_the_budget():
    for d, m in ((1, 1), (2, 4), (2, 40), (560, 40), (784, 20), (CHUNK_ELEMENTS, 40)):
        chunk = default_chunk(d, m)
        assert chunk >= 1 and chunk & (chunk - 1) == 0, chunk
        assert chunk * (d + m) <= CHUNK_ELEMENTS or chunk == 1
        assert 2 * chunk * (d + m) > CHUNK_ELEMENTS  # the largest such power of two


# ---- chunked log Z ---------------------------------------------------------------------------


def test_chunked_log_partition_equals_the_one_shot_enumeration_and_a_sum_at_the_modes():
    """float64, m = 12: chunks that divide 2^12 (1, 32), that do not (37, 1000), one (4096) and
    larger than 2^12 (5000). The chunks' log-sum-exps are combined by float64 log-add-exp, each
    step exact to ~2 ulps of |log Z| ≈ 15 (4e-15), so even 4096 one-state chunks stay within
    2e-11 < 1e-10, while the least likely state has p(h) = 2e-7: a dropped or repeated state
    moves log Z by ≥ 2e-7."""
    model = random_grbm(d=3, m=12)
    with torch.no_grad():
        one_shot = float(one_shot_log_partition(model))
        reference = mode_log_partition(model)
        assert one_shot == pytest.approx(reference, abs=1e-10)
        for chunk in (1, 32, 37, 1000, 4096, 5000):
            assert float(model.log_partition(chunk=chunk)) == pytest.approx(one_shot, abs=1e-10), chunk


def test_default_chunks_leave_the_main_jobs_numbers_unchanged():
    """float32 as the recipes train: one chunk (m = 4, the bundled recipes) is bit-identical to the
    one-shot enumeration; 2^16 states in 2^15-state chunks (d = 2) agree to float32 rounding of the
    chunks' log-sum-exps (1 ulp ≈ 1.2e-7 relative seen; 1e-6 allowed), and both to the float64 sum
    at the modes."""
    for m, tol in ((4, 0.0), (16, 1e-6)):
        model = random_grbm(d=2, m=m, dtype=torch.float32)
        with torch.no_grad():
            chunked, one_shot = model.log_partition(max_hidden=m), one_shot_log_partition(model)
        assert default_chunk(2, m) < 2**m or tol == 0.0
        torch.testing.assert_close(chunked, one_shot, rtol=tol, atol=0)
        assert float(chunked) == pytest.approx(mode_log_partition(model), rel=1e-5)


def test_chunked_log_partition_has_the_one_shot_gradient():
    model = random_grbm(d=3, m=8)
    params = [model.W, model.b, model.c, model.log_sigma]
    chunked = torch.autograd.grad(model.log_partition(chunk=37), params)
    one_shot = torch.autograd.grad(one_shot_log_partition(model), params)
    for a, b in zip(chunked, one_shot):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_progress_counts_every_state_once_in_order():
    model, seen = random_grbm(d=2, m=10), []
    with torch.no_grad():
        model.log_partition(chunk=300, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(300, 1024), (600, 1024), (900, 1024), (1024, 1024)]


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [4096, None])
def test_enumeration_allocates_no_tensor_beyond_a_chunk(chunk):
    """m = 22: 2^22 states, 92M elements at once; chunked, no operator returns more than
    chunk × max(m, d) elements (the default chunk: CHUNK_ELEMENTS in all)."""
    d, m = 2, 22
    model = GRBM(d, m)
    largest = LargestTensor()
    with torch.no_grad(), largest:
        log_z = model.log_partition(max_hidden=m, chunk=chunk)
    assert math.isfinite(float(log_z))
    bound = 4096 * m if chunk else CHUNK_ELEMENTS
    assert 0 < largest.numel <= bound, (largest.numel, bound)


# ---- the evaluator's guard and time estimate -------------------------------------------------


def recipe(n_hidden: int, max_hidden: int | None = None) -> str:
    text = SMALL_RECIPE.replace("n_hidden = 4", f"n_hidden = {n_hidden}")
    if max_hidden is not None:
        text = text.replace('kind = "exact-loglik"', f'kind = "exact-loglik"\nmax_hidden = {max_hidden}')
    return text


def test_validate_and_run_refuse_max_hidden_beyond_40_in_one_line(cli, write_recipe, tmp_path):
    """The issue's recipe (n_hidden = 34, max_hidden = 64) is refused before anything is built."""
    path = write_recipe(recipe(34, 64))
    for command in (["validate", path], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command))
        assert line.startswith(f"error: {path}: [eval.0] max_hidden: must be at most 40, got 64"), line
        assert "2^40 ≈ 1.1e+12" in line and "ais-loglik" in line, line
    assert not (tmp_path / "runs").exists()
    line = one_line_error(cli(["validate", write_recipe(recipe(4)), "-o", "eval.0.max_hidden=41"]))
    assert "[eval.0] max_hidden: must be at most 40, got 41" in line
    assert "[eval.0] max_hidden: must be > 0" in one_line_error(cli(["validate", write_recipe(recipe(4, 0))]))


def test_validate_and_run_refuse_more_hidden_units_than_max_hidden(cli, write_recipe, tmp_path):
    path = write_recipe(recipe(34))
    for command in (["validate", path], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command))
        assert line.startswith(f"error: {path}: [eval.0] max_hidden: "), line
        assert "m=34 > max_hidden=20" in line and "ais-loglik" in line and "at most 40" in line, line
    assert not (tmp_path / "runs").exists()


def test_max_hidden_40_is_valid(cli, write_recipe):
    result = cli(["validate", write_recipe(recipe(4, 40))])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_the_refusal_is_one_line_on_stderr_from_python_m_eblvm(write_recipe):
    path = write_recipe(recipe(34, 64))
    proc = subprocess.run([sys.executable, "-m", "eblvm", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{path}: [eval.0] max_hidden: must be at most 40, got 64" in proc.stderr


def test_large_enumerations_are_announced_with_states_and_chunks(monkeypatch, capsys):
    d, m = 2, 6
    data = DataSplits(train=torch.randn(20, d), test=torch.randn(20, d))
    parts = Parts(dtype=torch.float32, data=data, model=random_grbm(d, m, dtype=torch.float32))
    assert build_exact_loglik(ExactLoglikConfig(), parts).announce is None  # 64 states: no line
    monkeypatch.setattr(evaluators, "ANNOUNCE_STATES", 2**5)
    monkeypatch.setattr(model_module, "CHUNK_ELEMENTS", 40)  # 40 // (d + m) = 5: chunks of 4 states
    evaluate = build_exact_loglik(ExactLoglikConfig(), parts)
    assert evaluate.announce.startswith("log Z over 2^6 = 64 hidden states in 16 chunks of 4;"), evaluate.announce
    evaluate(parts)  # the enumeration takes under a second: no estimate
    assert capsys.readouterr().err == ""


def test_time_estimate_prints_once_and_not_at_the_end(capsys):
    progress = time_estimate(after=0.0)
    progress(1000, 1000)  # done: nothing left to estimate
    progress(250, 1000)
    progress(500, 1000)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("exact-loglik: 250 of 1,000 hidden states in "), lines
    assert lines[0].endswith(" to go") and " about " in lines[0]


def test_about_picks_the_largest_unit():
    assert [about(s) for s in (0.42, 42.0, 210.0, 7560.0, 130 * 86400.0)] == [
        "0.42 s",
        "42 s",
        "3.5 min",
        "2.1 h",
        "130 days",
    ]
