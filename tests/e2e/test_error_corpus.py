"""A corpus of malformed recipes, overrides and files: each is refused by `validate` and by `run`
with one line `error: <file>: [section] key: message` (`error: -o <value>: ...` for an override),
exit code 2, no traceback, nothing written; and recipes at the edges of what is valid still pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import BISM, SMALL_RECIPE, one_line_error
from tests.support.forked import Forked

BIG = 2**73  # beyond 64 bits
INT64_MAX = 2**63 - 1  # a 64-bit size no allocator can serve

WITH_PLOT = SMALL_RECIPE + '\n[[eval]]\nkind = "density-plot"\ngrid = 40\n'
KSD = SMALL_RECIPE.replace('kind = "dsm"\nsigma = 0.1', 'kind = "ksd"\npairing = "halves"')
FREY = SMALL_RECIPE.replace('kind = "checkerboard"\nn_train = 2000\nn_test = 500', 'kind = "freyface"\nroot = "{root}"')
SGD = SMALL_RECIPE.replace('[optim.model]\nkind = "adam"', '[optim.model]\nkind = "sgd"')


def edit(base: str, *pairs: str) -> str:
    """``base`` with each (old, new) pair of ``pairs`` replaced; every old must be there."""
    text = base
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def run_key(key: str, value: str, base: str = SMALL_RECIPE) -> str:
    return edit(base, "seed = 7", f"seed = 7\n{key} = {value}") if key != "seed" else edit(base, "seed = 7", value)


def model(line: str, base: str = SMALL_RECIPE) -> str:
    return edit(base, "n_hidden = 4", f"n_hidden = 4\n{line}")


def optim(line: str, base: str = SMALL_RECIPE) -> str:
    return edit(base, "lr = 1e-2", f"lr = 1e-2\n{line}")


# (id, recipe text, overrides, expected section, expected key); section None: an error about the file
RECIPES = [
    # [run]
    ("steps zero", edit(SMALL_RECIPE, "steps = 30", "steps = 0"), [], "run", "steps"),
    ("steps negative", edit(SMALL_RECIPE, "steps = 30", "steps = -5"), [], "run", "steps"),
    ("steps 10^23", edit(SMALL_RECIPE, "steps = 30", "steps = 100000000000000000000000"), [], "run", "steps"),
    ("steps string", edit(SMALL_RECIPE, "steps = 30", 'steps = "30"'), [], "run", "steps"),
    ("steps float", edit(SMALL_RECIPE, "steps = 30", "steps = 30.0"), [], "run", "steps"),
    ("steps bool", edit(SMALL_RECIPE, "steps = 30", "steps = true"), [], "run", "steps"),
    ("batch zero", edit(SMALL_RECIPE, "batch_size = 50", "batch_size = 0"), [], "run", "batch_size"),
    ("seed 2^73", edit(SMALL_RECIPE, "seed = 7", f"seed = {BIG}"), [], "run", "seed"),
    ("seed negative", edit(SMALL_RECIPE, "seed = 7", "seed = -1"), [], "run", "seed"),
    ("seed float", edit(SMALL_RECIPE, "seed = 7", "seed = 1.5"), [], "run", "seed"),
    ("name parent", edit(SMALL_RECIPE, 'name = "small"', 'name = "../escaped"'), [], "run", "name"),
    ("name dotdot", edit(SMALL_RECIPE, 'name = "small"', 'name = ".."'), [], "run", "name"),
    ("name slash", edit(SMALL_RECIPE, 'name = "small"', 'name = "a/b"'), [], "run", "name"),
    ("name absolute", edit(SMALL_RECIPE, 'name = "small"', 'name = "/tmp/abs"'), [], "run", "name"),
    ("name backslash", edit(SMALL_RECIPE, 'name = "small"', 'name = "a\\\\b"'), [], "run", "name"),
    ("name empty", edit(SMALL_RECIPE, 'name = "small"', 'name = ""'), [], "run", "name"),
    ("name NUL", edit(SMALL_RECIPE, 'name = "small"', 'name = "a\\u0000b"'), [], "run", "name"),
    ("device gpu", run_key("device", '"gpu"'), [], "run", "device"),
    ("device index", run_key("device", '"cuda:x"'), [], "run", "device"),
    ("dtype", run_key("dtype", '"float16"'), [], "run", "dtype"),
    ("precision fp8", run_key("precision", '"fp8"'), [], "run", "precision"),
    (
        "precision vs objective",
        run_key("precision", '"bf16"', WITH_PLOT.replace('kind = "dsm"\nsigma = 0.1', 'kind = "ssm"')),
        [],
        "run",
        "precision",
    ),
    ("threads negative", run_key("threads", "-1"), [], "run", "threads"),
    ("log_every zero", edit(SMALL_RECIPE, "log_every = 10", "log_every = 0"), [], "run", "log_every"),
    ("eval_every negative", run_key("eval_every", "-1"), [], "run", "eval_every"),
    (
        "checkpoint_every zero",
        edit(SMALL_RECIPE, "checkpoint_every = 10", "checkpoint_every = 0"),
        [],
        "run",
        "checkpoint_every",
    ),
    ("select_mode", run_key("select_mode", '"best"'), [], "run", "select_mode"),
    ("select_metric unknown", run_key("select_metric", '"eval/exact-loglik/val_loglik"'), [], "run", "select_metric"),
    ("run unknown key", run_key("stepz", "3"), [], "run", "stepz"),
    ("run not a table", "run = 5\n" + SMALL_RECIPE[SMALL_RECIPE.index("[data]") :], [], "run", None),
    # [data]
    ("data kind", edit(SMALL_RECIPE, '"checkerboard"', '"checkerbored"'), [], "data", "kind"),
    ("data kind type", edit(SMALL_RECIPE, '"checkerboard"', "3"), [], "data", "kind"),
    ("data n_train zero", edit(SMALL_RECIPE, "n_train = 2000", "n_train = 0"), [], "data", "n_train"),
    ("data n_train 2^63-1", edit(SMALL_RECIPE, "n_train = 2000", f"n_train = {INT64_MAX}"), [], "data", "n_train"),
    ("data n_cols negative", edit(SMALL_RECIPE, "n_test = 500", "n_test = 500\nn_cols = -2"), [], "data", "n_cols"),
    (
        "data missing",
        edit(SMALL_RECIPE, '[data]\nkind = "checkerboard"\nn_train = 2000\nn_test = 500', ""),
        [],
        "data",
        None,
    ),
    # [model]
    ("n_hidden negative", edit(SMALL_RECIPE, "n_hidden = 4", "n_hidden = -4"), [], "model", "n_hidden"),
    ("n_hidden 2^63-1", edit(SMALL_RECIPE, "n_hidden = 4", f"n_hidden = {INT64_MAX}"), [], "model", "n_hidden"),
    ("n_hidden 2^64", edit(SMALL_RECIPE, "n_hidden = 4", f"n_hidden = {2**64}"), [], "model", "n_hidden"),
    ("init_sigma inf", model("init_sigma = inf"), [], "model", "init_sigma"),
    ("init_sigma nan", model("init_sigma = nan"), [], "model", "init_sigma"),
    ("init_sigma -inf", model("init_sigma = -inf"), [], "model", "init_sigma"),
    ("init_sigma zero", model("init_sigma = 0"), [], "model", "init_sigma"),
    ("coupling", model('coupling = "scale"'), [], "model", "coupling"),
    ("learn_sigma string", model('learn_sigma = "yes"'), [], "model", "learn_sigma"),
    ("model unknown key", edit(SMALL_RECIPE, "n_hidden = 4", "n_hiden = 4"), [], "model", "n_hiden"),
    ("model kind missing", edit(SMALL_RECIPE, 'kind = "grbm"', ""), [], "model", "kind"),
    (
        "model not a table",
        edit(SMALL_RECIPE, '[model]\nkind = "grbm"\nn_hidden = 4', "").replace("[run]", 'model = "grbm"\n[run]'),
        [],
        "model",
        None,
    ),
    ("model NUL key", model('"x\\u0000" = 1'), [], "model", "'x\\x00'"),
    ("exact-loglik too large", edit(SMALL_RECIPE, "n_hidden = 4", "n_hidden = 40"), [], "eval.0", "max_hidden"),
    # [objective]
    ("sigma inf", edit(SMALL_RECIPE, "sigma = 0.1", "sigma = inf"), [], "objective", "sigma"),
    ("sigma nan", edit(SMALL_RECIPE, "sigma = 0.1", "sigma = nan"), [], "objective", "sigma"),
    ("sigma negative", edit(SMALL_RECIPE, "sigma = 0.1", "sigma = -0.1"), [], "objective", "sigma"),
    ("objective kind", edit(SMALL_RECIPE, 'kind = "dsm"', 'kind = "dms"'), [], "objective", "kind"),
    (
        "projection",
        edit(SMALL_RECIPE, 'kind = "dsm"\nsigma = 0.1', 'kind = "ssm"\nprojection = "gaussan"'),
        [],
        "objective",
        "projection",
    ),
    ("objective missing", edit(SMALL_RECIPE, '[objective]\nkind = "dsm"\nsigma = 0.1', ""), [], "estimator", "kind"),
    ("ksd halves odd batch", edit(KSD, "batch_size = 50", "batch_size = 51"), [], "objective", "pairing"),
    ("ksd bandwidth zero", edit(KSD, 'pairing = "halves"', "bandwidth = 0.0"), [], "objective", "bandwidth"),
    # [optim.<role>]
    ("lr inf", edit(SMALL_RECIPE, "lr = 1e-2", "lr = inf"), [], "optim.model", "lr"),
    ("lr nan", edit(SMALL_RECIPE, "lr = 1e-2", "lr = nan"), [], "optim.model", "lr"),
    ("lr zero", edit(SMALL_RECIPE, "lr = 1e-2", "lr = 0"), [], "optim.model", "lr"),
    ("lr negative", edit(SMALL_RECIPE, "lr = 1e-2", "lr = -1e-3"), [], "optim.model", "lr"),
    ("beta1 one", optim("beta1 = 1.0"), [], "optim.model", "beta1"),
    ("beta2 negative", optim("beta2 = -0.1"), [], "optim.model", "beta2"),
    ("beta2 above one", optim("beta2 = 1.5"), [], "optim.model", "beta2"),
    ("eps zero", optim("eps = 0.0"), [], "optim.model", "eps"),
    ("weight_decay negative", optim("weight_decay = -1.0"), [], "optim.model", "weight_decay"),
    ("max_grad_norm negative", optim("max_grad_norm = -1.0"), [], "optim.model", "max_grad_norm"),
    ("max_grad_norm zero", optim("max_grad_norm = 0.0"), [], "optim.model", "max_grad_norm"),
    ("max_grad_norm inf", optim("max_grad_norm = inf"), [], "optim.model", "max_grad_norm"),
    ("sgd momentum negative", optim("momentum = -0.5", SGD), [], "optim.model", "momentum"),
    ("sgd max_grad_norm negative", optim("max_grad_norm = -2.0", SGD), [], "optim.model", "max_grad_norm"),
    ("optimizer kind", edit(SMALL_RECIPE, 'kind = "adam"', 'kind = "adamw"'), [], "optim.model", "kind"),
    ("ema one", optim("ema = 1.0"), [], "optim.model", "ema"),
    ("ema zero", optim("ema = 0"), [], "optim.model", "ema"),
    ("ema string", optim('ema = "high"'), [], "optim.model", "ema"),
    ("misspelt role", edit(SMALL_RECIPE, "[optim.model]", "[optim.modle]"), [], "optim.modle", None),
    ("role of no part", SMALL_RECIPE + '\n[optim.posterior]\nkind = "adam"\n', [], "optim.posterior", None),
    ("role missing", edit(SMALL_RECIPE, '[optim.model]\nkind = "adam"\nlr = 1e-2', ""), [], "optim.model", "kind"),
    ("schedule kind", optim('schedule = { kind = "cosin" }'), [], "optim.model.schedule", "kind"),
    (
        "schedule gamma zero",
        optim('schedule = { kind = "exponential", gamma = 0.0 }'),
        [],
        "optim.model.schedule",
        "gamma",
    ),
    (
        "schedule warm-up negative",
        optim('schedule = { kind = "cosine", warmup_steps = -1 }'),
        [],
        "optim.model.schedule",
        "warmup_steps",
    ),
    (
        "optim not tables",
        edit(SMALL_RECIPE, '[optim.model]\nkind = "adam"\nlr = 1e-2', "").replace("[run]", "optim = 3\n[run]"),
        [],
        "optim",
        None,
    ),
    # posterior, divergence, estimator (BiSM)
    ("fisher with bernoulli", edit(BISM, 'kind = "kl"', 'kind = "fisher"'), [], "divergence", "kind"),
    ("posterior wrong latent kind", edit(BISM, 'kind = "bernoulli"', 'kind = "gaussian"'), [], "posterior", "kind"),
    (
        "posterior wrong latent size",
        edit(BISM, 'kind = "bernoulli"', 'kind = "gaussian"\nlatent_dim = 7'),
        [],
        "posterior",
        "latent_dim",
    ),
    (
        "posterior negative width",
        edit(BISM, 'kind = "bernoulli"', 'kind = "bernoulli"\nhidden = [-3]'),
        [],
        "posterior",
        "hidden",
    ),
    (
        "posterior zero width",
        edit(BISM, 'kind = "bernoulli"', 'kind = "bernoulli"\nhidden = [8, 0]'),
        [],
        "posterior",
        "hidden",
    ),
    (
        "temperature inf",
        edit(BISM, 'kind = "bernoulli"', 'kind = "bernoulli"\ntemperature = inf'),
        [],
        "posterior",
        "temperature",
    ),
    (
        "temperature zero",
        edit(BISM, 'kind = "bernoulli"', 'kind = "bernoulli"\ntemperature = 0.0'),
        [],
        "posterior",
        "temperature",
    ),
    ("posterior missing", edit(BISM, '[posterior]\nkind = "bernoulli"', ""), [], "estimator", "kind"),
    (
        "divergence n_samples zero",
        edit(BISM, 'kind = "kl"', 'kind = "kl"\nn_samples = 0'),
        [],
        "divergence",
        "n_samples",
    ),
    ("inner_steps zero", edit(BISM, "inner_steps = 1", "inner_steps = 0"), [], "estimator", "inner_steps"),
    ("unroll_steps negative", edit(BISM, "unroll_steps = 1", "unroll_steps = -1"), [], "estimator", "unroll_steps"),
    ("unroll kind", edit(BISM, "unroll_steps = 1", 'unroll_steps = 1\nunroll = "rmsprop"'), [], "estimator", "unroll"),
    (
        "unroll adam without adam",
        edit(
            BISM,
            "unroll_steps = 1",
            'unroll_steps = 1\nunroll = "adam"',
            '[optim.posterior]\nkind = "adam"',
            '[optim.posterior]\nkind = "sgd"',
        ),
        [],
        "estimator",
        "unroll",
    ),
    ("inner_lr inf", edit(BISM, "unroll_steps = 1", "unroll_steps = 1\ninner_lr = inf"), [], "estimator", "inner_lr"),
    ("estimator kind", edit(SMALL_RECIPE, 'kind = "exact-score"', 'kind = "exact-scor"'), [], "estimator", "kind"),
    # [[eval]], [[log]], top level
    (
        "eval split",
        edit(SMALL_RECIPE, 'kind = "exact-loglik"', 'kind = "exact-loglik"\nsplit = "val"'),
        [],
        "eval.0",
        "split",
    ),
    ("eval kind", edit(SMALL_RECIPE, '"exact-loglik"', '"exact-loglk"'), [], "eval.0", "kind"),
    (
        "eval unknown key",
        edit(SMALL_RECIPE, 'kind = "exact-loglik"', 'kind = "exact-loglik"\nbogus = 1'),
        [],
        "eval.0",
        "bogus",
    ),
    (
        "eval batch zero",
        edit(SMALL_RECIPE, 'kind = "exact-loglik"', 'kind = "exact-loglik"\nbatch_size = 0'),
        [],
        "eval.0",
        "batch_size",
    ),
    (
        "eval max_hidden 2^73",
        edit(SMALL_RECIPE, 'kind = "exact-loglik"', f'kind = "exact-loglik"\nmax_hidden = {BIG}'),
        [],
        "eval.0",
        "max_hidden",
    ),
    ("eval grid zero", edit(WITH_PLOT, "grid = 40", "grid = 0"), [], "eval.1", "grid"),
    ("eval a table", edit(SMALL_RECIPE, "[[eval]]", "[eval]"), [], "eval", None),
    ("log kind", SMALL_RECIPE + '\n[[log]]\nkind = "tensorbord"\n', [], "log.0", "kind"),
    ("unknown section", edit(SMALL_RECIPE, "[objective]", "[objectiv]"), [], "objectiv", None),
    ("empty recipe", "", [], "data", None),
    # -o overrides
    ("-o float for int", SMALL_RECIPE, ["model.n_hidden=3.5"], "model", "n_hidden"),
    ("-o unknown section", SMALL_RECIPE, ["modle.n_hidden=3"], "modle", None),
    ("-o no section", SMALL_RECIPE, ["steps=3"], None, None),
    ("-o no key", SMALL_RECIPE, ["=3"], None, None),
    ("-o no value", SMALL_RECIPE, ["run.steps"], None, None),
    ("-o negative lr", SMALL_RECIPE, ["optim.model.lr=-1"], "optim.model", "lr"),
    ("-o no such eval item", SMALL_RECIPE, ["eval.3.kind=x"], "eval.3", None),
    ("-o into a value", SMALL_RECIPE, ["run.steps.x=1"], "run", "steps"),
    ("-o seed 2^73", SMALL_RECIPE, [f"run.seed={BIG}"], "run", "seed"),
    ("-o steps 10^23", SMALL_RECIPE, ["run.steps=100000000000000000000000"], "run", "steps"),
    ("-o lr inf", SMALL_RECIPE, ["optim.model.lr=inf"], "optim.model", "lr"),
    ("-o sigma nan", SMALL_RECIPE, ["objective.sigma=nan"], "objective", "sigma"),
    ("-o name traversal", SMALL_RECIPE, ["run.name=../x"], "run", "name"),
    ("-o name NUL", SMALL_RECIPE, ['run.name="a\\u0000b"'], "run", "name"),
    ("-o max_grad_norm", SMALL_RECIPE, ["optim.model.max_grad_norm=-1"], "optim.model", "max_grad_norm"),
    ("-o beta1", SMALL_RECIPE, ["optim.model.beta1=1"], "optim.model", "beta1"),
    ("-o misspelt role", SMALL_RECIPE, ["optim.modle.lr=1e-3"], "optim.modle", None),
    ("-o n_hidden 2^63-1", SMALL_RECIPE, [f"model.n_hidden={INT64_MAX}"], "model", "n_hidden"),
    ("-o split", SMALL_RECIPE, ["eval.0.split=val"], "eval.0", "split"),
    ("-o fisher", BISM, ["divergence.kind=fisher"], "divergence", "kind"),
]


def assert_names(line: str, path: Path, section: str | None, key: str | None) -> None:
    """``error: <path>: [section] key: message``, without a stray ``: :``."""
    where = " ".join(filter(None, [f"[{section}]" if section else "", key or ""]))
    prefix = f"error: {path}: " + (f"{where}: " if where else "")
    assert line.startswith(prefix), f"expected {prefix!r}...; got {line!r}"
    assert ": :" not in line and line.removeprefix(prefix).strip(), line


def overrides(values: list[str]) -> list[str]:
    return [a for value in values for a in ("-o", value)]


@pytest.mark.slow
@pytest.mark.parametrize("name, text, values, section, key", RECIPES, ids=[c[0] for c in RECIPES])
def test_validate_and_run_refuse_with_one_line(cli, write_recipe, tmp_path, name, text, values, section, key):
    path = write_recipe(text)
    source = f"-o {values[-1]}" if values else path  # an error an -o value caused names it
    for command in (["validate", path], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command + overrides(values)))
        assert_names(line, source, section, key)
    assert not (tmp_path / "runs").exists(), "a refused run writes nothing"
    assert not (tmp_path / "escaped").exists(), "a run name must not lead out of --out"


def test_the_corpus_is_large_and_covers_every_section():
    assert len(RECIPES) + len(FILES) + 1 >= 80
    covered = {section.split(".")[0] for *_rest, section, _key in RECIPES if section}
    assert {
        "run",
        "data",
        "model",
        "posterior",
        "objective",
        "divergence",
        "estimator",
        "optim",
        "eval",
        "log",
    } <= covered


def test_a_missing_data_folder_is_refused_by_run_and_validate_check_data(cli, write_recipe, tmp_path):
    """`validate` checks absent data files with stand-ins (a warning); --check-data requires them."""
    path = write_recipe(FREY.format(root=tmp_path / "nowhere"))
    for command in (["validate", path, "--check-data"], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command))
        assert_names(line, path, "data", "root")
        assert str(tmp_path / "nowhere" / "frey_rawface.mat") in line
    assert not (tmp_path / "runs").exists()


def write_bytes(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


FILES = [
    ("binary", lambda d: write_bytes(d, "bin.toml", bytes(range(256)) * 4), "not a UTF-8 text file"),
    ("latin-1", lambda d: write_bytes(d, "latin.toml", ("# café\n" + SMALL_RECIPE).encode("latin-1")), "not a UTF-8"),
    ("NUL byte", lambda d: write_bytes(d, "nul.toml", SMALL_RECIPE.encode().replace(b"small", b"sm\x00all")), "NUL"),
    ("directory", lambda d: (d / "dir.toml").mkdir() or d / "dir.toml", "is a directory"),
    ("missing", lambda d: d / "nope.toml", "not found"),
    ("invalid TOML", lambda d: write_bytes(d, "bad.toml", b"[run\nsteps = 1"), "invalid TOML"),
    ("duplicate key", lambda d: write_bytes(d, "dup.toml", b"[run]\nsteps = 1\nsteps = 2\n"), "invalid TOML"),
]


@pytest.mark.parametrize("name, make, fragment", FILES, ids=[c[0] for c in FILES])
def test_unreadable_recipe_files(cli, tmp_path, name, make, fragment):
    path = make(tmp_path)
    for command in (["validate", path], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command))
        assert_names(line, path, None, None)
        assert fragment in line and "\x00" not in line, line
    assert not (tmp_path / "runs").exists()


VALID = [
    ("the small recipe", SMALL_RECIPE, []),
    ("BiSM", BISM, []),
    ("largest seed", edit(SMALL_RECIPE, "seed = 7", f"seed = {INT64_MAX}"), []),
    ("dotted name", edit(SMALL_RECIPE, 'name = "small"', 'name = "..small.v2-1"'), []),
    ("int for float", edit(SMALL_RECIPE, "lr = 1e-2", "lr = 1"), []),
    ("beta at zero, clipping", optim("beta1 = 0.0\nmax_grad_norm = 1.0"), []),
    ("ksd halves even", KSD, []),
    ("temperature 0.5 warns", edit(BISM, 'kind = "bernoulli"', 'kind = "bernoulli"\ntemperature = 0.5'), []),
    ("overrides", SMALL_RECIPE, ["run.name=other", "optim.model.max_grad_norm=5", "eval.0.split=train"]),
]


@pytest.mark.parametrize("name, text, values", VALID, ids=[c[0] for c in VALID])
def test_valid_recipes_still_pass(cli, write_recipe, name, text, values):
    path = write_recipe(text)
    result = cli(["validate", path, *overrides(values)])
    assert result.exit_code == 0 and f"ok: {path}" in result.output, result.output
    if "temperature" in name:
        assert "[posterior] temperature: 0.5 > 0.2" in result.output


def test_a_valid_edge_recipe_runs(cli, write_recipe, tmp_path):
    path = write_recipe(edit(SMALL_RECIPE, "seed = 7", f"seed = {INT64_MAX}", "steps = 30", "steps = 2"))
    result = cli(["run", path, "--out", tmp_path / "runs", "-o", "optim.model.max_grad_norm=1"])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["-o", f"run.seed={BIG}"], "[run] seed: must fit in 64 bits"),
        (["-o", f"model.n_hidden={INT64_MAX}"], "[model] n_hidden: cannot be built at this size"),
        (["-o", "optim.model.lr=inf"], "[optim.model] lr: must be a finite number"),
    ],
)
def test_real_processes_exit_2_without_a_traceback(write_recipe, tmp_path, args, fragment):
    path = write_recipe()
    proc = Forked(["run", path, "--out", tmp_path / "runs", *args])  # a process of its own, torch loaded
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in stderr + stdout, stderr
    assert stderr.strip().count("\n") == 0 and fragment in stderr, stderr
