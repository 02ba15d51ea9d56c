"""Damaged, truncated and mismatched data files are one line naming the file and what to do, from
``eblvm run`` and ``eblvm validate --check-data`` alike, never a traceback: image folders (a file
that is not an image, one cut short, images of different sizes, ``skip_unreadable``, a file damaged
past its header met by a DataLoader worker) and the packed files of the bundled data sets (MNIST's
idx and gzip, CIFAR-10's pickled batches and .npz, SVHN's and Frey face's .mat, CelebA's partition
file, and what torchvision downloads). Every file is a tiny fake of its format built in tmp_path."""

from __future__ import annotations

import gzip
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from eblvm_images.folder import ImageFiles
from PIL import Image

from eblvm.testing import make
from eblvm_core.contracts import Parts
from eblvm_core.errors import ConfigError, DataError
from tests.support import one_line_error

SIDE = 16  # big enough that half a PNG cuts into its pixels, not its header


def write_images(folder: Path, n: int, first: int = 0, size: tuple[int, int] = (SIDE, SIDE)) -> list[Path]:
    """n random grey PNGs (height, width) = size named img<first>.png, img<first + 1>.png, ..."""
    rng = np.random.default_rng(first)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(first, first + n):
        paths.append(folder / f"img{i:03d}.png")
        Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)).save(paths[-1])
    return paths


def cut(path: Path, fraction: float) -> Path:
    """Keep the first ``fraction`` of the file, as a copy or a download interrupted there leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def spoil(path: Path, at: int = 0, n: int = 32) -> Path:
    """Overwrite ``n`` bytes from byte ``at`` with others, as a bad disk or a bad copy does."""
    data = bytearray(path.read_bytes())
    data[at : at + n] = bytes((b + 101) % 256 for b in data[at : at + n])
    path.write_bytes(bytes(data))
    return path


@pytest.fixture
def image_root(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    write_images(root / "train", 12)
    write_images(root / "test", 4, first=100)
    return root


def folder_data(root: Path, parts: Parts | None = None, **options):
    return make("datasets", "image-folder", parts or Parts(), root=str(root), channels=1, **options)


FOLDER_RECIPE = """
[run]
name = "folder"
steps = 4
batch_size = 4
log_every = 1
checkpoint_every = 2
device = "cpu"

[data]
kind = "image-folder"
root = "{root}"
channels = 1

[model]
kind = "grbm"
n_hidden = 3

[objective]
kind = "dsm"
sigma = 0.1

[estimator]
kind = "exact-score"

[optim.model]
kind = "adam"
lr = 1e-2
"""


def run_and_validate(cli, write_recipe, tmp_path: Path, root: Path, *overrides: str) -> tuple[Path, list[str]]:
    """The one error line of ``eblvm run`` and of ``eblvm validate --check-data`` on a small
    image-folder recipe (they must agree), with the recipe's path."""
    recipe = write_recipe(FOLDER_RECIPE.format(root=root))
    options = [a for o in overrides for a in ("-o", o)]
    lines = [
        one_line_error(cli(["run", recipe, *options, "--out", tmp_path / "runs"])),
        one_line_error(cli(["validate", recipe, *options, "--check-data"])),
    ]
    assert lines[0] == lines[1]
    return recipe, lines


# ---- image folders: checked before the first step ---------------------------------------------------


@pytest.mark.parametrize(
    "fraction, reason", [(0.5, "image file is truncated"), (0.05, "Truncated File Read")], ids=["half", "header"]
)
def test_a_damaged_first_image_is_one_line_naming_it(cli, write_recipe, tmp_path, image_root, fraction, reason):
    """Half a PNG (its header whole, its pixels cut) and a PNG cut inside its header."""
    damaged = cut(image_root / "train" / "img000.png", fraction)
    recipe, lines = run_and_validate(cli, write_recipe, tmp_path, image_root)
    assert lines[0].startswith(f"error: {recipe}: [data] root: {damaged}: cannot read the image: {reason}"), lines[0]
    assert "Traceback" not in lines[0]


def test_a_file_that_is_not_an_image_is_named_with_the_option_to_skip_it(cli, write_recipe, tmp_path, image_root):
    bad = image_root / "train" / "img005.png"
    bad.write_text("<html>not found</html>")
    recipe, lines = run_and_validate(cli, write_recipe, tmp_path, image_root)
    assert lines[0].startswith(f"error: {recipe}: [data] root: {bad}: cannot read the image: cannot identify"), lines
    assert lines[0].endswith("replace or remove it, or set skip_unreadable = true to leave such files out"), lines


def test_images_of_different_sizes_are_one_line_naming_both_and_size(cli, write_recipe, tmp_path, image_root):
    """Only the last test image differs: every file's header is checked, across the splits."""
    (other,) = write_images(image_root / "test", 1, first=200, size=(SIDE + 1, SIDE))
    recipe, lines = run_and_validate(cli, write_recipe, tmp_path, image_root)
    first = image_root / "train" / "img000.png"
    assert lines[0] == (
        f"error: {recipe}: [data] size: {other} is {SIDE}×{SIDE + 1} pixels but {first} is {SIDE}×{SIDE}: "
        "images of one size are needed; set [data] size to resize them all to size × size"
    ), lines[0]
    for fix in (["data.size=8"], ["data.crop=12"]):  # resized or cropped, the sizes agree
        assert cli(["validate", recipe, "--check-data", *(a for o in fix for a in ("-o", o))]).exit_code == 0


def test_headers_alone_are_read_before_the_first_step(image_root, monkeypatch):
    """The check reads every header but decodes one image (the first), whatever the folder holds."""
    from PIL import ImageFile

    decoded, real_load = [], ImageFile.ImageFile.load

    def load(image):
        decoded.append(image.filename)
        return real_load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    data = folder_data(image_root)
    assert data.shape == (1, SIDE, SIDE) and data.size("train") == 12 and data.size("test") == 4
    assert set(decoded) == {str(image_root / "train" / "img000.png")}  # Pillow may load it more than once


def test_skip_unreadable_leaves_out_what_has_no_readable_header_and_says_so(image_root):
    not_image = image_root / "train" / "img003.png"
    not_image.write_text("not an image")
    cut(image_root / "test" / "img101.png", 0.05)
    with pytest.raises(DataError, match="skip_unreadable = true") as info:
        folder_data(image_root)
    assert str(info.value).startswith(f"{not_image}: cannot read the image:") and info.value.key == "root"
    parts = Parts()
    data = folder_data(image_root, parts, skip_unreadable=True)
    assert data.size("train") == 11 and data.size("test") == 3
    assert parts.warnings == [
        f"[data] skip_unreadable: left out 2 of 16 files, the first: {not_image}: cannot read the image: "
        f"cannot identify image file '{not_image}'"
    ]
    for path in (image_root / "train").iterdir():
        path.write_text("none is an image")
    with pytest.raises(ConfigError, match="no readable images in .*train: every file there was left out"):
        folder_data(image_root, skip_unreadable=True)


def test_skip_unreadable_is_documented_and_off_by_default():
    from eblvm_images.folder import ImageFolderConfig

    field = next(f for f in ImageFolderConfig.__attrs_attrs__ if f.name == "skip_unreadable")
    assert field.default is False and "header cannot be read" in field.metadata["help"]


def test_validate_checks_a_folder_that_is_there_and_stands_in_for_one_that_is_not(cli, write_recipe, tmp_path):
    recipe = write_recipe(FOLDER_RECIPE.format(root=tmp_path / "nowhere"))
    result = cli(["validate", recipe])
    assert result.exit_code == 0 and "checked with stand-in images" in result.output, result.output
    root = tmp_path / "images"
    write_images(root / "train", 3)
    write_images(root / "test", 2, first=100, size=(SIDE, SIDE + 2))
    recipe = write_recipe(FOLDER_RECIPE.format(root=root))
    assert "[data] size: " in one_line_error(cli(["validate", recipe]))  # without --check-data too


# ---- image files damaged past their header: named when read -------------------------------------------


def last_line_error(result) -> str:
    """The error a run that had begun stops with: its last line, after the run's opening lines; exit 2."""
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], result.output
    return lines[-1]


def test_an_image_damaged_past_its_header_is_named_when_a_worker_reads_it(image_root):
    from torch.utils.data import DataLoader

    damaged = cut(image_root / "train" / "img007.png", 0.5)
    files = ImageFiles(sorted((image_root / "train").iterdir()), 1, None, None)
    expected = f"{damaged}: cannot read the image: image file is truncated; copy it again or remove it"
    with pytest.raises(DataError) as info:
        files[7]
    assert str(info.value) == expected and info.value.key == "root"
    with pytest.raises(DataError, match="image file is truncated") as info:  # in a worker: the same error
        list(DataLoader(files, batch_size=4, num_workers=1))
    message = str(info.value)
    # the error's traceback holds the loader, whose worker stops at once when it is let go; left to the
    # garbage collector, it stops after DataLoader's 5 s timeout, in whichever test runs next
    info.value.__traceback__ = None
    del info
    assert expected in message


@pytest.mark.slow
def test_a_run_that_meets_a_damaged_image_stops_in_one_line(cli, write_recipe, tmp_path, image_root):
    damaged = cut(image_root / "train" / "img007.png", 0.5)
    recipe = write_recipe(FOLDER_RECIPE.format(root=image_root))
    line = last_line_error(cli(["run", recipe, "--out", tmp_path / "runs"]))
    assert line.startswith(f"error: {damaged}: cannot read the image: image file is truncated; copy it again"), line
    assert "eblvm run --resume" in line, line


@pytest.mark.slow  # starts a DataLoader worker process: 5 s where no earlier test started its pool
def test_a_run_that_meets_a_damaged_image_in_a_worker_stops_in_one_line(cli, write_recipe, tmp_path, image_root):
    damaged = cut(image_root / "train" / "img007.png", 0.5)
    recipe = write_recipe(FOLDER_RECIPE.format(root=image_root))
    result = cli(["run", recipe, "-o", "data.workers=1", "--out", tmp_path / "runs"])
    line = last_line_error(result)
    assert line.startswith(f"error: {damaged}: cannot read the image: image file is truncated"), line
    assert "Traceback" not in result.output and "worker process" not in result.output, result.output


# ---- packed files of the bundled data sets ------------------------------------------------------------


def write_idx(path: Path, array: np.ndarray) -> Path:
    """An idx file of unsigned bytes, gzip'd when the name ends in .gz."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with (gzip.open if path.suffix == ".gz" else open)(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())
    return path


def mnist_root(tmp_path: Path, gz: bool) -> Path:
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 20), ("t10k", 5)):
        suffix = ".gz" if gz else ""
        write_idx(raw / f"{prefix}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte{suffix}", np.arange(n) % 10)
    return tmp_path / "mnist"


def cifar_root(tmp_path: Path) -> Path:
    batches = tmp_path / "cifar" / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(batches / name, "wb") as fh:
            pickle.dump({"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), "labels": [1, 7]}, fh)
    return tmp_path / "cifar"


def npz_root(tmp_path: Path) -> Path:
    (tmp_path / "npz").mkdir()
    x = np.random.default_rng(2).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    np.savez(tmp_path / "npz" / "subset.npz", x_train=x, y_train=np.arange(6), x_test=x[:2], y_test=np.arange(2))
    return tmp_path / "npz"


def svhn_root(tmp_path: Path) -> Path:
    (tmp_path / "svhn").mkdir()
    rng = np.random.default_rng(3)
    for split in ("train", "test"):
        images = rng.integers(0, 256, (32, 32, 3, 4), dtype=np.uint8)
        scipy.io.savemat(tmp_path / "svhn" / f"{split}_32x32.mat", {"X": images, "y": np.arange(1, 5)[:, None]})
    return tmp_path / "svhn"


def frey_root(tmp_path: Path) -> Path:
    (tmp_path / "frey").mkdir()
    faces = np.random.default_rng(4).integers(0, 256, (560, 12), dtype=np.uint8)
    scipy.io.savemat(tmp_path / "frey" / "frey_rawface.mat", {"ff": faces})
    return tmp_path / "frey"


REFETCH = "delete it and download it again (-o data.download=true), or point data.root at a good copy"
REPLACE = "replace it with a good copy, or point data.root at a folder that holds one (-o data.root=/path)"
FREY_AGAIN = "delete it and download https://cs.nyu.edu/~roweis/data/frey_rawface.mat again"

# (data set, its folder, the file damaged, how, what the line says of it, what to do)
DAMAGED = [
    ("mnist", "gz", "MNIST/raw/train-images-idx3-ubyte.gz", "cut", "Compressed file ended before", REFETCH),
    ("mnist", "gz", "MNIST/raw/t10k-labels-idx1-ubyte.gz", "spoil", "Not a gzipped file", REFETCH),
    ("mnist", "gz", "MNIST/raw/train-images-idx3-ubyte.gz", "spoil-late", "CRC check failed", REFETCH),
    ("mnist", "idx", "MNIST/raw/train-images-idx3-ubyte", "cut", "its header says [20, 28, 28], it holds", REFETCH),
    ("mnist", "idx", "MNIST/raw/t10k-images-idx3-ubyte", "spoil", "not an idx file of unsigned bytes", REFETCH),
    ("cifar10", "cifar", "cifar-10-batches-py/data_batch_3", "cut", "pickle data was truncated", REFETCH),
    ("cifar10", "cifar", "cifar-10-batches-py/test_batch", "spoil", "invalid load key", REFETCH),
    ("cifar10", "npz", "subset.npz", "cut", "File is not a zip file", REPLACE),
    ("cifar10", "npz", "subset.npz", "spoil-late", "Bad CRC-32 for file 'x_train.npy'", REPLACE),
    ("svhn", "svhn", "train_32x32.mat", "cut", "could not read bytes", REFETCH),
    ("svhn", "svhn", "test_32x32.mat", "spoil-mat", "Expecting miMATRIX type here", REFETCH),
]
ROOTS = {"gz": mnist_root, "idx": mnist_root, "cifar": cifar_root, "npz": npz_root, "svhn": svhn_root}
DAMAGE = {
    "cut": lambda path: cut(path, 0.5),
    "spoil": spoil,
    "spoil-late": lambda path: spoil(path, at=path.stat().st_size // 2),
    "spoil-mat": lambda path: spoil(path, at=128),  # a .mat file's first variable, after its 128-byte header
}


@pytest.mark.parametrize("kind, folder, name, how, says, fix", DAMAGED, ids=[f"{d[2]}-{d[3]}" for d in DAMAGED])
def test_a_damaged_data_file_is_one_data_error_naming_it_and_what_to_do(tmp_path, kind, folder, name, how, says, fix):
    root = ROOTS[folder](tmp_path, folder == "gz") if folder in ("gz", "idx") else ROOTS[folder](tmp_path)
    damaged = DAMAGE[how](root / name)
    with pytest.raises(DataError) as info:
        make("datasets", kind, Parts(), root=str(root))
    line = str(info.value)
    assert line.startswith(f"{damaged}: cannot read the ") and f": {says}" in line and line.endswith(fix), line
    assert "\n" not in line and info.value.key == "root"


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "idx"])
def test_a_truncated_mnist_download_is_one_line_from_run_and_validate(cli, write_recipe, tmp_path, gz):
    """An interrupted download left half a file: before, click's bare "Aborted!" (its EOFError)."""
    root = mnist_root(tmp_path, gz)
    damaged = cut(root / "MNIST" / "raw" / ("train-images-idx3-ubyte" + ".gz" * gz), 0.5)
    recipe = write_recipe(
        FOLDER_RECIPE.format(root=root).replace('"image-folder"', '"mnist"').replace("channels = 1", "")
    )
    for command in (["run", recipe, "--out", tmp_path / "runs"], ["validate", recipe, "--check-data"]):
        line = one_line_error(cli(command))
        assert line.startswith(f"error: {recipe}: [data] root: {damaged}: cannot read the MNIST idx file: "), line
        assert line.endswith(REFETCH) and "Aborted" not in line, line


def test_a_malformed_svhn_file_is_named(tmp_path):
    root = svhn_root(tmp_path)
    scipy.io.savemat(root / "train_32x32.mat", {"X": np.zeros((28, 28, 1, 2), np.uint8), "y": np.ones((2, 1))})
    with pytest.raises(DataError, match="expected variables X of shape \\(32, 32, 3, N\\) and y") as info:
        make("datasets", "svhn", Parts(), root=str(root))
    assert str(info.value).startswith(f"{root / 'train_32x32.mat'}: cannot read the SVHN .mat file: ")


def test_a_cifar_batch_of_another_content_is_named(tmp_path):
    root = cifar_root(tmp_path)
    with open(root / "cifar-10-batches-py" / "data_batch_1", "wb") as fh:
        pickle.dump(["not", "a", "batch"], fh)
    with pytest.raises(DataError, match="cannot read the CIFAR-10 batch: list indices must be integers"):
        make("datasets", "cifar10", Parts(), root=str(root))


@pytest.mark.parametrize("how", ["cut", "spoil-mat"])
def test_a_damaged_frey_face_file_says_to_download_it_again(tmp_path, how):
    root = frey_root(tmp_path)
    DAMAGE[how](root / "frey_rawface.mat")
    with pytest.raises(DataError, match="not a readable MATLAB file") as info:
        make("datasets", "freyface", Parts(), root=str(root), n_train=6, n_val=2, n_test=2)
    line = str(info.value)
    assert line.startswith(f"{root / 'frey_rawface.mat'}: ") and FREY_AGAIN in line and "\n" not in line, line


def test_a_damaged_celeba_partition_file_is_named(tmp_path):
    write_images(tmp_path / "img_align_celeba", 3)
    for path in (tmp_path / "img_align_celeba").iterdir():
        path.rename(path.with_suffix(".jpg"))
    partition = tmp_path / "list_eval_partition.txt"
    partition.write_bytes(b"000000.jpg 0 extra\n\xff\xfe")
    with pytest.raises(DataError) as info:
        make("datasets", "celeba", Parts(), root=str(tmp_path))
    assert str(info.value).startswith(f"{partition}: cannot read the CelebA partition file: "), info.value
    assert str(info.value).endswith("replace it with CelebA's own, or remove it to split 80/10/10 in file order")


@pytest.mark.parametrize(
    "kind, dataset, folder, error",
    [
        ("mnist", "MNIST", "MNIST/raw", RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried ...")),
        ("mnist", "MNIST", "MNIST/raw", EOFError("Compressed file ended before the end-of-stream marker was reached")),
        ("cifar10", "CIFAR10", "", tarfile.ReadError("unexpected end of data")),
        ("svhn", "SVHN", "", RuntimeError("File not found or corrupted.")),
    ],
    ids=["mnist-offline", "mnist-half-archive", "cifar10-half-archive", "svhn-checksum"],
)
def test_what_a_torchvision_download_raises_is_one_line_naming_the_folder(
    tmp_path, monkeypatch, kind, dataset, folder, error
):
    """torchvision downloads (and reads back) the files: a failed download, a file failing its
    checksum or a half-downloaded archive it unpacks is one line naming where it was going."""
    import torchvision.datasets

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(torchvision.datasets, dataset, fails)
    with pytest.raises(DataError) as info:
        make("datasets", kind, Parts(), root=str(tmp_path), download=True)
    where = tmp_path / folder if folder else tmp_path
    first_line = str(error).splitlines()[0].rstrip(":")
    assert str(info.value) == (
        f"{where}: cannot read the {dataset.replace('CIFAR10', 'CIFAR-10')} files torchvision downloads: "
        f"{first_line}; delete what an interrupted download left in {where} and try again, or put the files "
        "there yourself"
    )
