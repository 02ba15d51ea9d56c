"""What the posterior has learnt: a linear-SVM probe on posterior means beside one on raw pixels
(BiSM appendix C.2, Table 2), and a 2-D embedding of the posterior means coloured by class."""

from __future__ import annotations

from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, EvalResult, Parts, option, positive, reporting
from eblvm.tools import render
from eblvm_metrics.figures import embedding


def posterior_means(parts: Parts, split: str, n: int, batch_size: int) -> Tensor:
    """E_q[h | v] (n, m) of the first n examples of a split."""
    data, out = parts.data, []
    with torch.no_grad():
        for start in range(0, n, batch_size):
            v = data.take(split, torch.arange(start, min(start + batch_size, n))).to(parts.device, parts.dtype)
            out.append(parts.posterior.mean(v).float().cpu())
    return torch.cat(out)


def _needs_labels_and_posterior(parts: Parts, splits: tuple[str, ...]) -> None:
    data = parts.need("data", "")
    if parts.posterior is None:
        raise ConfigError("", "kind", "this evaluator reads posterior means E_q[h | v]: the recipe needs a [posterior]")
    for split in splits:
        if not data.has(split):
            raise ConfigError("", "split", f"the data set has no '{split}' split")
        if not data.labels or split not in data.labels:
            raise ConfigError("", "kind", f"the data set has no class labels for its '{split}' split")


@attrs.frozen
class SVMProbeConfig:
    n_train: int = option(10000, "training examples the SVMs are fitted on (the first n)", positive)
    n_test: int = option(10000, "test examples they are scored on (the first n)", positive)
    raw: bool = option(True, "also fit a linear SVM on the raw pixels, the papers' reference")
    batch_size: int = option(500, "examples per posterior evaluation", positive)


def build_svm_probe(cfg: SVMProbeConfig, parts: Parts):
    """Test accuracy of a linear SVM (scikit-learn's default LinearSVC) on posterior means, and on raw pixels."""
    _needs_labels_and_posterior(parts, ("train", "test"))

    @reporting(["posterior_accuracy", "raw_accuracy"] if cfg.raw else ["posterior_accuracy"])
    def evaluate(parts: Parts) -> EvalResult:
        from sklearn.svm import LinearSVC

        data = parts.data
        n_train, n_test = min(cfg.n_train, data.size("train")), min(cfg.n_test, data.size("test"))
        y_train, y_test = data.labels["train"][:n_train].numpy(), data.labels["test"][:n_test].numpy()
        features = {
            "posterior": (
                posterior_means(parts, "train", n_train, cfg.batch_size),
                posterior_means(parts, "test", n_test, cfg.batch_size),
            )
        }
        if cfg.raw:
            features["raw"] = (
                data.take("train", torch.arange(n_train)).flatten(1).float().cpu(),
                data.take("test", torch.arange(n_test)).flatten(1).float().cpu(),
            )
        scalars = {}
        for name, (train, test) in features.items():
            svm = LinearSVC().fit(train.numpy(), y_train)
            scalars[f"{name}_accuracy"] = float(svm.score(test.numpy(), y_test))
        return EvalResult(scalars=scalars)

    return evaluate


@attrs.frozen
class EmbeddingConfig:
    split: Literal["test", "train", "val"] = option("test", "the split whose posterior means are drawn")
    n: int = option(2000, "points drawn", positive)
    method: Literal["pca", "tsne"] = option("pca", "PCA (fast) or t-SNE (scikit-learn; the papers' Fig. 6, slow)")
    size: int = option(480, "height of the image in pixels (the class legend adds to its width)", positive)


EMBEDDING_NAMES = {"pca": "PCA", "tsne": "t-SNE"}


def embedded(points: Tensor, method: Literal["pca", "tsne"]) -> Tensor:
    """Points (n, d) -> (n, 2): their first two principal components, or t-SNE's map (seed 0)."""
    if method == "pca":
        centred = points - points.mean(0)
        return centred @ torch.linalg.svd(centred, full_matrices=False).Vh[:2].T
    from sklearn.manifold import TSNE

    return torch.from_numpy(TSNE(2, init="pca", random_state=0).fit_transform(points.numpy())).float()


def build_posterior_embedding(cfg: EmbeddingConfig, parts: Parts):
    """Posterior means E_q[h | v] embedded in 2-D (PCA or t-SNE), one colour per class, with axes and a class legend."""
    _needs_labels_and_posterior(parts, (cfg.split,))

    @reporting([])
    def evaluate(parts: Parts) -> EvalResult:
        n = min(cfg.n, parts.data.size(cfg.split))
        means = posterior_means(parts, cfg.split, n, 500)
        figure = embedding(
            embedded(means, cfg.method),
            parts.data.labels[cfg.split][:n],
            rf"posterior means $E_q[h\,|\,v]$ of {n} {cfg.split} examples",
            EMBEDDING_NAMES[cfg.method],
            cfg.size,
        )
        return EvalResult(images={"embedding": render(figure)})

    return evaluate
