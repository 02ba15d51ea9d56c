"""sample-classes: a classifier of the training digits tells digit-like samples (confident, varied
labels) from noise (unsure) and from one digit repeated (no variety), with no Inception network."""

from __future__ import annotations

import math

import eblvm_metrics.samples as samples_module
import pytest
import torch
from eblvm_metrics.samples import label_statistics

from eblvm.testing import make
from eblvm_core.contracts import Parts, Sampler


class Replay(Sampler):
    """A stand-in sampler that returns given images as the model's samples."""

    def __init__(self, images: torch.Tensor):
        self.images = images

    def sample(self, model, n, generator=None):
        return self.images[:n]


def digits_parts() -> Parts:
    parts = Parts(dtype=torch.float32)
    parts.data = make("datasets", "digits", parts, scale="symmetric")
    parts.model = make("models", "resnet-ebm", parts, width=4, blocks=1, stages=1)
    return parts


def scores(parts: Parts, images: torch.Tensor, monkeypatch) -> dict[str, float]:
    monkeypatch.setattr(samples_module, "named_sampler", lambda *_: Replay(images))
    return make("evaluators", "sample-classes", parts)(parts).scalars


def test_label_statistics_by_hand():
    p = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.7, 0.3]], dtype=torch.float64)
    confidence, entropy = label_statistics(p)
    assert confidence == pytest.approx((0.9 + 0.8 + 0.6 + 0.7) / 4)
    assert entropy == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))  # labels 0, 1, 0, 0


@pytest.mark.slow
def test_the_check_separates_held_out_digits_from_noise_and_from_one_repeated_digit(monkeypatch):
    parts = digits_parts()
    held_out = parts.data.take("test", torch.arange(100, 164))  # not among the 64 test images it reports on
    digits = scores(parts, held_out, monkeypatch)
    low, high = parts.data.bounds[0]
    noise = low + (high - low) * torch.rand(64, *parts.data.shape, generator=torch.Generator().manual_seed(5))
    noisy = scores(parts, noise, monkeypatch)
    one = scores(parts, held_out[:1].expand(64, *held_out.shape[1:]), monkeypatch)

    assert digits["classifier_accuracy"] > 0.9
    assert digits["samples_confidence"] > 0.85 and digits["test_confidence"] > 0.85
    assert noisy["samples_confidence"] < 0.75 and digits["noise_confidence"] < 0.75  # unsure on noise
    assert digits["samples_label_entropy"] > 1.9  # varied: near log 10 = 2.30
    assert one["samples_label_entropy"] == 0.0 and one["samples_confidence"] > 0.85  # confident but one class
