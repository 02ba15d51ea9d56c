"""A hint that names one of eblvm's extras fits how eblvm is installed: from a checkout (an editable
install) `pip install -e ".[wandb]"` in the checkout, or the checkout's path from elsewhere; from a
package index `pip install "eblvm[wandb]"`. The trackers' and FID's refusals give it."""

from __future__ import annotations

import importlib.util

import pytest

from eblvm_core import plugins
from eblvm_core.errors import ConfigError
from tests.support import ROOT, SMALL_RECIPE


def test_the_hint_fits_a_checkout_and_an_installed_package(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert plugins.checkout() == ROOT  # these tests run from the repository, installed with pip install -e
    assert plugins.install_hint("wandb") == 'pip install -e ".[wandb]"'
    monkeypatch.chdir(tmp_path)
    assert plugins.install_hint("mlflow") == f'pip install -e "{ROOT}[mlflow]"'
    monkeypatch.setattr(plugins, "checkout", lambda: None)
    assert plugins.install_hint("fid") == 'pip install "eblvm[fid]"'


@pytest.mark.parametrize("kind", ["wandb", "mlflow"])
def test_a_missing_tracker_names_the_command_for_this_install(cli, write_recipe, monkeypatch, kind):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == kind else real(name, *a))
    monkeypatch.chdir(ROOT)
    recipe = write_recipe(SMALL_RECIPE + f'\n[[log]]\nkind = "{kind}"\n')
    result = cli(["validate", recipe])
    assert result.exit_code == 2, result.output
    assert result.output.strip().endswith(f'the {kind} logger needs the {kind} package: pip install -e ".[{kind}]"')
    monkeypatch.setattr(plugins, "checkout", lambda: None)
    result = cli(["validate", recipe])
    assert result.output.strip().endswith(f'pip install "eblvm[{kind}]"'), result.output


def test_fid_without_its_extra_names_the_command_for_this_install(monkeypatch):
    import eblvm_metrics.fid as fid_module

    from eblvm.testing import make
    from tests.plugins.deep.test_deep import GaussianEnergy, image_parts

    monkeypatch.setattr(fid_module.importlib.util, "find_spec", lambda name: None)
    monkeypatch.chdir(ROOT)
    parts = image_parts((1, 8, 8), 4)
    parts.model = GaussianEnergy(4.0, 0.5)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[fid\]"'):
        make("evaluators", "fid", parts)
