"""How much a BiDVL model's test reconstruction RMSE owes to batch norm's statistics, not to its weights.

The reconstruction G(E_q[h|v]) runs batch norm twice (encoder, generator). Its RMSE can be read
with the statistics gathered in training (eval mode, eblvm's ``reconstruction`` evaluator), with
each test batch's own statistics (train mode, as the released code's ``mse_score`` reads it), or
with the running statistics moved the way the released conv code moves them at the end of every
epoch, by its visualisation passes in train mode: G(z) of a fixed z ~ N(0, I), the encoder on the
epoch's last batch v and G(μ(v)), the encoder on G(z) and G(μ(G(z))). Its training passes put
prior draws z and posterior draws h = μ + σε through the generator; the evaluation puts posterior
means through it, and the visualisation passes are the only ones that do the same.

A last reading re-estimates the running statistics at the final weights: reset, then the equal
average (batch norm's ``momentum = None``) over ``--updates`` updates' worth of the training passes
(encoder: data v, G(z); generator: z, h = μ(v) + σ(v)ε, z). Training keeps a moving average with
momentum 0.1 over passes made while the weights moved; if this reading matches the first, the gap
to each batch's statistics comes from what the training passes feed batch norm (z and posterior
draws, not posterior means), not from the average's noise or its lag behind the weights.

Two more readings put posterior means through the generator in train mode, as the reconstruction
does, for ``--updates // 4`` batches (10 by default) before reading with the running statistics:
once on training images (batch norm recalibrated for the reconstruction path, no test image
used), once on the test images in order, which is what the released metric ``mse_score`` does to
the running statistics as a side effect of its train-mode reading. The first also reports how the
recalibration moves the sampling path G(z), which shares those statistics.

The generator now keeps a second set of statistics for posterior codes (``[generator]
posterior_statistics``, read by the evaluator; a checkpoint from before loads with both sets equal
to its one set). The first two readings are of the model as saved; the rest read it with one set,
the plain one (for a checkpoint from before: the released code's mix of z and posterior draws).
One more re-estimates that set from the lower level's posterior draws h = μ(v) + σ(v)ε alone (the
encoder in train mode as in training, its statistics put back), which is what the second set
holds at the end of a run trained with it, if the average's lag does not matter.

    python studies/bidvl_batchnorm.py RUN_DIR [--checkpoint last] [--batch-size 100] [--updates 40]

prints one line per reading: the RMSE per pixel in the data's units, on the whole test split.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from eblvm_bidvl.nets import batch_norms


def visualisation_passes(parts, batch_size: int, seed: int) -> None:
    """The released conv code's end-of-epoch passes, in train mode without gradients (moves running statistics)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch_size, parts.generator.latent_dim, generator=g).to(parts.device, parts.dtype)
    last = torch.randperm(parts.data.size("train"), generator=g)[:batch_size]
    v = parts.data.take("train", last).to(parts.device, parts.dtype)
    parts.posterior.train(), parts.generator.train()
    with torch.no_grad():
        samples = parts.generator(z)
        parts.generator(parts.posterior.mean(v))
        parts.generator(parts.posterior.mean(samples))


@contextlib.contextmanager
def equal_average(nets):
    """Within the block batch norm in ``nets`` starts from reset statistics and averages every pass
    equally (``momentum = None``); the momenta are put back after."""
    norms = [m for net in nets for m in batch_norms(net)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    try:
        yield
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum


def posterior_draw_pass(parts, batch_size: int, g: torch.Generator) -> None:
    """The lower level's pass on posterior draws: G(μ(v) + σ(v)ε) for a random training batch v (train mode, no gradients)."""
    index = torch.randint(parts.data.size("train"), (batch_size,), generator=g)
    v = parts.data.take("train", index).to(parts.device, parts.dtype)
    mu, log_std = parts.posterior.params(v)
    noise = torch.randn(mu.shape, generator=g).to(parts.device, parts.dtype)
    parts.generator(mu + log_std.exp() * noise)


def reestimated_statistics(parts, batch_size: int, updates: int, seed: int) -> None:
    """Reset batch norm in the encoder and the generator and fill its running statistics with the
    equal average over ``updates`` updates' training passes at the current weights (no gradients)."""
    g = torch.Generator().manual_seed(seed)
    parts.posterior.train(), parts.generator.train()
    with equal_average((parts.posterior, parts.generator)), torch.no_grad():
        for _ in range(updates):
            z = torch.randn(batch_size, parts.generator.latent_dim, generator=g).to(parts.device, parts.dtype)
            samples = parts.generator(z)
            parts.generator(z)  # the lower step's pass on the upper step's z: twice in the average, as in training
            posterior_draw_pass(parts, batch_size, g)
            parts.posterior.mean(samples)


def posterior_draw_statistics(parts, batch_size: int, updates: int, seed: int) -> None:
    """Reset the generator's batch norm and fill its running statistics with the equal average over
    ``updates`` lower-level passes on posterior draws h = μ(v) + σ(v)ε (no gradients); the
    encoder runs in train mode, as in training, and its statistics are put back."""
    kept = {k: b.clone() for k, b in parts.posterior.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    parts.posterior.train(), parts.generator.train()
    with equal_average((parts.generator,)), torch.no_grad():
        for _ in range(updates):
            posterior_draw_pass(parts, batch_size, g)
    parts.posterior.load_state_dict(kept)


def one_set(generator: torch.nn.Module) -> bool:
    """Drop the generator's second set of statistics, if it keeps one (the plain set stays); True if it did."""
    dropped = False
    for m in generator.modules():
        for name in [k for k in m._buffers if k.startswith("posterior_")]:
            del m._buffers[name]
            dropped = True
    return dropped


def reconstruction_passes(parts, split: str, batch_size: int, batches: int, seed: int | None) -> None:
    """``batches`` train-mode passes v -> G(μ(v)) without gradients over ``split``'s images: a random
    draw (``seed``) or, with ``seed`` None, the split in order (moves running statistics)."""
    n = parts.data.size(split)
    order = torch.arange(n) if seed is None else torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    parts.posterior.train(), parts.generator.train()
    with torch.no_grad():
        for start in range(0, min(n, batches * batch_size), batch_size):
            v = parts.data.take(split, order[start : start + batch_size]).to(parts.device, parts.dtype)
            parts.generator(parts.posterior.mean(v))


def generated(parts, z: torch.Tensor) -> tuple[torch.Tensor, float]:
    """G(z) in eval mode (the sampling path, with the running statistics) and its mean energy."""
    parts.generator.eval(), parts.model.eval()
    with torch.no_grad():
        x = parts.generator(z)
        return x, parts.model.energy(x).mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--checkpoint", default="last")
    parser.add_argument("--batch-size", type=int, default=100, help="test batch and visualisation batch (100 released)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--updates", type=int, default=40, help="updates' passes for the re-estimated statistics")
    args = parser.parse_args(argv)

    from eblvm.api import load

    loaded = load(args.run_dir, args.checkpoint, device=args.device, evaluators=[], echo=None)
    parts, table = loaded.parts, {"kind": "reconstruction", "batch_size": args.batch_size, "images": 0}

    def readings() -> dict[str, float]:
        scalars = loaded.evaluate([table], echo=None).scalars
        return {key: scalars[f"eval/reconstruction/{key}"] for key in ("test_rmse", "test_rmse_batch_stats")}

    first = readings()
    print(f"step {loaded.step}, {parts.data.size('test'):,} test images, batches of {args.batch_size}")
    print(f"running statistics (eval mode, eblvm's evaluator)     {first['test_rmse']:.4f}")
    print(f"each batch's statistics (train mode, released metric) {first['test_rmse_batch_stats']:.4f}")
    if one_set(parts.generator):
        print(f"  (the generator's statistics of posterior codes; with its plain set: {readings()['test_rmse']:.4f})")
    modules = (parts.posterior, parts.generator)
    states = [{k: b.clone() for k, b in m.state_dict().items()} for m in modules]

    def restore() -> None:
        """Batch norm's statistics (and the weights) back to the checkpoint's."""
        for m, state in zip(modules, states):
            m.load_state_dict(state)

    for seed in range(3):
        visualisation_passes(parts, args.batch_size, seed)
        after = readings()["test_rmse"]
        print(f"running statistics after the released visualisation passes (draw {seed}) {after:.4f}")
        restore()
    for seed in range(2):
        reestimated_statistics(parts, args.batch_size, args.updates, seed)
        again = readings()["test_rmse"]
        print(f"running statistics re-estimated over {args.updates} updates' training passes (draw {seed}) {again:.4f}")
        restore()
    for seed in range(2):
        posterior_draw_statistics(parts, args.batch_size, args.updates, seed)
        split = readings()["test_rmse"]
        print(
            f"generator's statistics re-estimated over {args.updates} updates' posterior draws only (draw {seed}) {split:.4f}"
        )
        restore()
    batches = max(1, args.updates // 4)
    z = torch.randn(500, parts.generator.latent_dim, generator=torch.Generator().manual_seed(0))
    z = z.to(parts.device, parts.dtype)
    samples, energy = generated(parts, z)
    for split, seed in (("train", 0), ("train", 1), ("test", None)):
        reconstruction_passes(parts, split, args.batch_size, batches, seed)
        moved = readings()["test_rmse"]
        source = f"{split} images (draw {seed})" if seed is not None else "the test images in order (released metric)"
        print(f"running statistics after {batches} train-mode batches of G(μ(v)) on {source} {moved:.4f}")
        if seed == 0:
            recalibrated, energy_after = generated(parts, z)
            change = (recalibrated - samples).pow(2).mean().sqrt()
            print(
                f"  and the samples G(z) of 500 fixed z (eval mode): pixel std {samples.std():.3f} -> "
                f"{recalibrated.std():.3f}, rms change {change:.4f}, mean energy {energy:.3f} -> {energy_after:.3f}"
            )
        restore()


if __name__ == "__main__":
    main()
