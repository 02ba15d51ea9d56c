# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A deep EBLVM on 8×8 digits: samples via q and the posterior's embedding
#
# The recipe `digits_bimdsm` is the BiSM paper's deep energy-based latent variable model, shrunk to
# run on a CPU: a ResNet energy $E(v, h)$ of an 8×8 image $v$ and a continuous latent $h \in \mathbb{R}^{16}$,
# a Gaussian posterior $q(h\,|\,v)$ computed by a small convolutional network, and BiMDSM to train them:
#
# - the upper level is multiscale denoising score matching (MDSM): noisy digits $\tilde v = v + \sigma\epsilon$
#   with $\sigma$ between 0.1 and 1, and the model's score $\nabla_{\tilde v}\log p(\tilde v)$, estimated through
#   $q$, matched to $-(\tilde v - v)/\sigma_0^2$;
# - the lower level fits $q$ by the Fisher divergence
#   $\tfrac12\mathbb{E}_q\lVert\nabla_h \log q(h|v) + \nabla_h E(v, h)\rVert^2$, five steps per batch.
#
# The data are scikit-learn's 1,797 handwritten digits, built in: nothing to download. The full recipe
# trains 13,000 steps (about 13 minutes on one core); here we train **800 steps**, under a minute,
# so expect rough samples.

# %%
import tempfile
import time

import matplotlib.pyplot as plt
import torch
from torchvision.utils import make_grid

import eblvm

recipe = eblvm.load_recipe("digits_bimdsm").to_dict()  # the recipe as data, every default filled in
print([evaluator["kind"] for evaluator in recipe["eval"]])

# %% [markdown]
# The recipe's `[[eval]]` list ends training with the posterior's Fisher divergence on test digits,
# a linear-SVM probe on posterior means, a `posterior-embedding` figure, a `sample-grid` and
# `sample-classes`, which labels samples with a digit classifier. We draw the samples and the
# embedding ourselves below, and leave `sample-classes` out: it is meant for trained models, and on a
# barely trained one its confidence is fooled by saturated noise. The two cheap evaluators stay.

# %%
sample_grid = next(e for e in recipe["eval"] if e["kind"] == "sample-grid")  # kept for later
recipe["eval"] = [e for e in recipe["eval"] if e["kind"] in ("posterior-fisher", "svm-probe")]
out = tempfile.mkdtemp(prefix="eblvm-tutorial-")
start = time.perf_counter()
run = eblvm.train(recipe, overrides={"run.steps": 800}, out=out, echo=None)
print(f"800 steps and the final evaluation in {time.perf_counter() - start:.0f} s")
for key, value in run.metrics.items():
    print(f"    {key} = {value:.3f}")

# %% [markdown]
# `posterior-fisher` is the lower level's objective on test digits: how far $q$ is from the model's
# posterior, in the Fisher divergence. `svm-probe` fits a linear SVM on the posterior means
# $\mathbb{E}_q[h\,|\,v]$ to classify the digits (`posterior_accuracy`), beside one on the 64 raw pixels
# (`raw_accuracy`). After so short a run the 16 posterior dimensions hold much less of the class than
# the pixels do; the papers' claim that they rival the pixels is about fully trained models.
#
# ## Samples via q
#
# An EBLVM's samples come from its joint density $p(v, h) \propto e^{-E(v, h)}$. The papers draw them
# *via q*: take random training images $v'$, fix $h = \mathbb{E}_q[h\,|\,v']$, and run annealed Langevin
# dynamics on $v$ under $E(v, h)$,
# $v \leftarrow v - \tfrac12\epsilon^2\nabla_v E(v, h) + \sqrt{T}\,\epsilon\,\xi$, with the temperature $T$
# falling from 100 to 1 and then to 0, and a final denoising step at $\sigma_0$. So the samples are
# draws of $p(v\,|\,h)$ for latents of training images, not unconditional ones. That is the sampler of
# the recipe's `sample-grid` evaluator (`annealed-langevin`, whose mode `auto` is `via-q` for an
# EBLVM: 900 steps of $\epsilon = 0.04$, keeping 8 snapshots of each chain). Loading the run with that
# evaluator makes it the run's sampler, `loaded.sampler`, the one `eblvm sample` would use.

# %%
loaded = run.load(evaluators=[sample_grid], echo=None)
start = time.perf_counter()
sampler = loaded.sampler
samples = sampler.sample(loaded.model, 64, torch.Generator().manual_seed(0))  # (64, 1, 8, 8)
print(f"64 samples in {time.perf_counter() - start:.0f} s; snapshots kept: {tuple(sampler.trajectory.shape)}")

data = loaded.data
low, high = data.bounds[0]
real = data.take("test", torch.arange(64))


def grid(images):
    """64 images (64, 1, 8, 8) -> one 8 × 8 grid, pixels scaled to [0, 1]."""
    unit = ((images.float().cpu() - low) / (high - low)).clamp(0, 1)
    return make_grid(unit, nrow=8, padding=1, pad_value=0.5)[0]


fig, axes = plt.subplots(1, 2, figsize=(10, 5))
for ax, images, title in [(axes[0], real, "test digits"), (axes[1], samples, "samples via q, after 800 steps")]:
    ax.imshow(grid(images), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title)
    ax.axis("off")
plt.show()

# %% [markdown]
# After 800 steps the samples have the digits' general look, bright strokes on a dark background,
# centred and about the right thickness, and some can be read as a digit; many are blurred or
# halfway between two. Rough, as expected of 6% of the recipe's schedule: docs/results.md shows the
# full run's samples, mostly recognisable digits of every class.
#
# The sampler kept 8 snapshots along each chain. Each row below is one chain, from the hot start
# (noise at $T = 100$, clipped to the pixel range) to its last state before the denoising step.

# %%
chains = sampler.trajectory[:, :8].transpose(0, 1).reshape(-1, 1, 8, 8)  # 8 chains × 8 snapshots
fig, ax = plt.subplots(figsize=(5, 5))
ax.imshow(grid(chains), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
ax.set_title("annealed Langevin via q: 8 chains, left to right")
ax.axis("off")
plt.show()

# %% [markdown]
# ## The posterior embedding
#
# What has $q$ learnt? Below, the posterior means $\mathbb{E}_q[h\,|\,v]$ of the test digits, projected
# to their first two principal components and coloured by the digit's class: the figure of the
# recipe's `posterior-embedding` evaluator (which can use t-SNE instead, the papers' Figure 6).

# %%
n = data.size("test")
with torch.no_grad():
    test = data.take("test", torch.arange(n)).to(loaded.parts.device, loaded.parts.dtype)
    means = loaded.posterior.mean(test)  # (n, 16)
centred = means - means.mean(0)
projected = centred @ torch.linalg.svd(centred, full_matrices=False).Vh[:2].T  # (n, 2)
labels = data.labels["test"][:n]

fig, ax = plt.subplots(figsize=(6.5, 5.5))
for digit in range(10):
    chosen = projected[labels == digit]
    ax.scatter(chosen[:, 0], chosen[:, 1], s=10, color=plt.cm.tab10(digit), label=str(digit))
ax.set_xlabel("principal component 1")
ax.set_ylabel("principal component 2")
ax.set_title(rf"posterior means $E_q[h\,|\,v]$ of {n} test digits")
ax.legend(title="digit", markerscale=2, bbox_to_anchor=(1.02, 1), loc="upper left")
plt.show()

# %% [markdown]
# Without ever seeing a label, the posterior has begun to sort the digits: a few classes gather in
# their own regions, while most still overlap in these two directions (the SVM probe above reads all
# 16 and gets about 0.6 right). The full recipe takes this much further (its SVM probe reads 0.77,
# docs/results.md): `eblvm run digits_bimdsm` trains it, with the sample grid and this embedding in
# its final evaluation.
