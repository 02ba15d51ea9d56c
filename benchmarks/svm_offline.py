"""The SVM probe where the checkpoint cannot travel: posterior means computed on one machine, the
linear SVMs fitted on another.

A GPU lease returns files of at most 16 MiB; a deep run's checkpoint (weights and Adam states) is
about 128 MB. So the lease exports E_q[h | v] of the train and test sets (float32, with the labels)
and the development machine fits the ``svm-probe`` evaluator's SVMs (scikit-learn's default
LinearSVC, the papers' protocol) on them, and on raw pixels when given the recipe and data:

    python benchmarks/svm_offline.py export RUN_DIR OUT.npz [--n-train 60000] [--n-test 10000]
    python benchmarks/svm_offline.py score OUT.npz [--raw RECIPE -o data.root=...]
    python benchmarks/svm_offline.py embed OUT.npz FIGURE.png [--n 2000] [--method tsne]

``score`` prints the accuracies, one per line. ``embed`` draws the first ``n`` test means in 2-D as
the ``posterior-embedding`` evaluator does (BiSM Fig. 11 is t-SNE).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch


def export(args: argparse.Namespace) -> None:
    from eblvm_metrics.probes import posterior_means

    from eblvm_core.api import load

    loaded = load(args.run_dir, args.checkpoint, device=args.device, evaluators=[], echo=None)
    parts, data = loaded.parts, loaded.parts.data
    arrays = {"step": np.array(loaded.step)}
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        n = min(n, data.size(split))
        arrays[f"{split}_means"] = posterior_means(parts, split, n, args.batch_size).numpy()
        arrays[f"{split}_labels"] = data.labels[split][:n].numpy()
    np.savez_compressed(args.out, **arrays)
    print(f"{args.out}: step {loaded.step}, {Path(args.out).stat().st_size / 2**20:.1f} MiB")


def score(args: argparse.Namespace) -> None:
    from sklearn.svm import LinearSVC

    from eblvm_core.api import load_recipe
    from eblvm_core.build import build, pick_device

    saved = np.load(args.means)
    y_train, y_test = saved["train_labels"], saved["test_labels"]
    features = {"posterior": (saved["train_means"], saved["test_means"])}
    if args.raw:
        data = build(load_recipe(args.raw, [*args.override, "~eval"]), pick_device("cpu")).parts.data
        features["raw"] = tuple(
            data.take(split, torch.arange(len(y))).flatten(1).float().numpy()
            for split, y in (("train", y_train), ("test", y_test))
        )
    print(f"step {int(saved['step'])}: {len(y_train):,} train, {len(y_test):,} test")
    for name, (train, test) in features.items():
        accuracy = LinearSVC().fit(train, y_train).score(test, y_test)
        print(f"{name}_accuracy {accuracy:.4f}")


def embed(args: argparse.Namespace) -> None:
    from eblvm_metrics.probes import EMBEDDING_NAMES, embedded
    from torchvision.utils import save_image

    from eblvm_core.plot import embedding, render

    saved = np.load(args.means)
    means, labels = torch.from_numpy(saved["test_means"][: args.n]), torch.from_numpy(saved["test_labels"][: args.n])
    title = f"posterior means of {len(means)} test examples, step {int(saved['step'])}"
    figure = embedding(embedded(means, args.method), labels, title, EMBEDDING_NAMES[args.method])
    save_image(render(figure), args.figure)
    print(args.figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("export", help="posterior means of the train and test sets as one .npz")
    out.add_argument("run_dir")
    out.add_argument("out")
    out.add_argument("--n-train", type=int, default=60000)
    out.add_argument("--n-test", type=int, default=10000)
    out.add_argument("--checkpoint", default="last")
    out.add_argument("--device", default=None)
    out.add_argument("--batch-size", type=int, default=500)
    scored = sub.add_parser("score", help="linear-SVM test accuracy on exported means (and on raw pixels)")
    scored.add_argument("means")
    scored.add_argument("--raw", metavar="RECIPE", help="also fit on the raw pixels of this recipe's data")
    scored.add_argument("-o", "--override", action="append", default=[])
    drawn = sub.add_parser("embed", help="the test means in 2-D, one colour per class, as a PNG")
    drawn.add_argument("means")
    drawn.add_argument("figure")
    drawn.add_argument("--n", type=int, default=2000)
    drawn.add_argument("--method", choices=("pca", "tsne"), default="tsne")
    args = parser.parse_args(argv)
    {"export": export, "score": score, "embed": embed}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
