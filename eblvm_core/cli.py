"""The ``eblvm`` command line (typer). User errors print one line and exit with code 2."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import typer

from eblvm_core import experiments
from eblvm_core.command import check_device, fail, guarded
from eblvm_core.errors import EblvmError
from eblvm_core.experiments.commands import CPUS, GPUS, LAUNCHER, MEM, NODES, PARTITION, SBATCH, TIME, slurm_options

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Learn energy-based latent variable models from TOML recipes.",
    epilog="Plugins may add commands: `eblvm plugins` lists them.",
)


@app.command()
def run(
    recipe: Path | None = typer.Argument(None, help="recipe file (omit with --resume)"),
    override: list[str] = typer.Option([], "-o", "--override", help="section.key=value; repeatable"),
    device: str | None = typer.Option(None, help="auto, cpu, cuda, cuda:N or mps (default: the recipe's)"),
    out: Path = typer.Option(Path("runs"), help="folder that holds run directories"),
    resume: Path | None = typer.Option(
        None, help="continue the run in this run directory (a run's name folder, runs/<name>: its latest run)"
    ),
    nproc_per_node: int | None = typer.Option(
        None,
        "--nproc-per-node",
        min=1,
        help="train with this many processes on this machine, started and watched by eblvm (data parallel; "
        "docs/distributed.md); with --launcher slurm, processes per node of the job",
    ),
    launcher: str = LAUNCHER,
    partition: str | None = PARTITION,
    time: str | None = TIME,
    nodes: int | None = NODES,
    gpus: int | None = GPUS,
    cpus: int | None = CPUS,
    mem: str | None = MEM,
    sbatch: list[str] = SBATCH,
    wait: bool = typer.Option(
        False, "--wait", help="with --launcher slurm: watch the job to its end and print its final evaluation"
    ),
) -> None:
    """Train a model as a recipe says; print the final evaluation.

    Under torchrun (`torchrun --nproc-per-node G -m eblvm run RECIPE`) every process runs this
    command; rank 0 alone writes and prints. [run] batch_size is the global batch. With
    --launcher slurm the run is one Slurm job (docs/cluster.md), requeued with its checkpoint when
    Slurm stops it; the command says where it lives and returns (--wait: at its end).
    """
    check_device(device)
    if (recipe is None) == (resume is None):
        fail("give a recipe file or --resume RUN_DIR (one of them)")
    options = slurm_options(launcher, partition, time, nodes, gpus, cpus, mem, None, sbatch, nproc_per_node)
    if launcher != "local":
        _submit(launcher, options, recipe, override, device, out, resume, wait)
        return
    if wait:
        fail("--wait is for a cluster job: add --launcher slurm")
    if nproc_per_node is not None:
        if resume is not None:  # the processes, and the launcher's own records, name the run itself
            resume = _run_dir(resume, "cannot resume")
        raise typer.Exit(_launch(nproc_per_node, recipe, override, device, out, resume))

    def go() -> None:
        from eblvm_core.session import run as train

        train(recipe, override, device, out, resume, echo=typer.echo)  # prints the final evaluation and done:

    guarded(go)


def _submit(
    launcher: str,
    options: dict,
    recipe: Path | None,
    override: list[str],
    device: str | None,
    out: Path,
    resume: Path | None,
    wait: bool,
) -> None:
    """``eblvm run --launcher slurm``: the run as one cluster job (``experiments.launcher``)."""
    import shlex

    def go() -> None:
        from eblvm_core.experiments.launcher import SlurmConfig, require_submitit, submit_run, with_options

        config = with_options(SlurmConfig(), options)
        require_submitit(launcher)
        submit_run(launcher, config, recipe, override, device, out, resume, shlex.join(sys.argv), wait, typer.echo)

    guarded(go)


def _run_dir(path: Path, doing: str = "") -> Path:
    """The run directory a user's path names (a run's name folder gives its latest run, said on
    stderr); a missing path or a folder that is not a run fails with its own line (exit 2)."""
    from eblvm_core.rundir import find_run_dir

    try:
        run_dir, note = find_run_dir(path, doing)
    except EblvmError as exc:
        fail(str(exc))
    if note is not None:
        typer.echo(note, err=True)
    return run_dir


def _launch(
    nproc: int, recipe: Path | None, override: list[str], device: str | None, out: Path, resume: Path | None
) -> int:
    """Train with ``nproc`` processes of ``python -m eblvm run ...`` started and watched by this
    one (``eblvm_core.launch``); returns the exit code."""
    if "WORLD_SIZE" in os.environ:
        fail("--nproc-per-node: this process was launched by torchrun already")
    from eblvm_core.launch import run_processes

    args = [str(recipe)] if recipe is not None else ["--resume", str(resume)]
    args += [a for o in override for a in ("-o", o)] + ["--out", str(out)]
    args += ["--device", device] if device is not None else []
    sys.stdout.flush()
    return run_processes(nproc, args, resume)


@app.command()
def validate(
    recipes: list[Path] = typer.Argument(..., help="recipe files, comparison specs or search specs"),
    override: list[str] = typer.Option([], "-o", "--override", help="section.key=value; repeatable"),
    check_data: bool = typer.Option(
        False,
        "--check-data",
        help="also require the data files (by default a data set whose files are absent is replaced by a stand-in, with a warning)",
    ),
    show: bool = typer.Option(
        False, "--show", help="print the resolved recipe (includes merged, overrides applied, every default) as TOML"
    ),
) -> None:
    """Dry-run recipes: build every part at recipe size without training, downloading or writing.

    Whatever `eblvm run` would reject before its first step is rejected here, with the same
    one-line error and exit code 2. Comparison specs ([compare] and [[method]]) are checked
    row by row; search specs ([search] and [params]) at every end of every searched range. With
    --show, each resolved recipe is printed as `eblvm run` would write it into the run
    directory's recipe.toml.
    """
    from eblvm_core.build import dry_run
    from eblvm_core.experiments.search_spec import is_search_spec, search_recipes
    from eblvm_core.experiments.spec import is_spec, spec_recipes
    from eblvm_core.recipe import load_recipe, read

    bad = 0
    for path in recipes:
        try:
            raw = read(path)
            if is_search_spec(raw):
                resolved = search_recipes(path, override)
            elif is_spec(raw):
                resolved = spec_recipes(path, override)
            else:
                resolved = {str(path): load_recipe(path, override)}
            warnings: dict[str, None] = {}
            for recipe in resolved.values():
                warnings.update(dict.fromkeys(dry_run(recipe, check_data=check_data)))
            for warning in warnings:
                typer.echo(f"warning: {path}: {warning}", err=True)
            if show:
                import tomli_w

                for name, recipe in resolved.items():
                    typer.echo(f"# {name}\n{tomli_w.dumps(recipe.to_dict())}")
            typer.echo(f"ok: {path}")
        except EblvmError as exc:
            for line in str(exc).splitlines():  # several errors found together: one line each
                typer.echo(f"error: {line}", err=True)
            bad += 1
    if bad:
        raise typer.Exit(2)


@app.command()
def plugins() -> None:
    """List plugins, what each registers, and each component's config fields."""
    from eblvm_core.config import describe
    from eblvm_core.plugins import load

    loaded = load()
    for info in loaded.plugins:
        typer.echo(f"{info.name}  ({info.module})")
        for kind, names in info.components.items():
            for name in names:
                entry = loaded[kind].get(name)
                typer.echo(f"  {kind[:-1]} {name}: {entry.doc}")
                keys = entry.reported_keys()
                if keys:
                    typer.echo(f"      reports: {', '.join(keys)}")
                for field, tp, default, help_ in describe(entry.config):
                    typer.echo(f"      {field}: {tp} = {default}  {help_}".rstrip())
        for cmd, _fn, plugin in loaded.commands:
            if plugin == info.name:
                typer.echo(f"  command {cmd}")
    for name, why in loaded.failed.items():
        typer.echo(f"{name}  FAILED: {why}")


@app.command("eval")
def eval_run(
    run_dir: Path = typer.Argument(
        ..., help="a run directory (holds recipe.toml and checkpoints/), or a run's name folder: its latest run"
    ),
    checkpoint: str = typer.Option(
        "last",
        help="last, best (needs [run] select_metric), step:N (kept by [run] keep_every) or a checkpoint path",
    ),
    evaluator: list[str] = typer.Option(
        [],
        "--evaluator",
        "-e",
        help="evaluator name, run instead of the recipe's [[eval]]; repeatable; -o eval.N.key=value sets an option "
        "of the N-th (from 0)",
    ),
    override: list[str] = typer.Option(
        [],
        "-o",
        "--override",
        help="section.key=value applied to the recipe ([[eval]], [sampler], where and how long); repeatable",
    ),
    device: str | None = typer.Option(None, help="auto, cpu, cuda, cuda:N or mps (default: the recipe's)"),
    seed: int = typer.Option(0, help="seed of every RNG before evaluating"),
) -> None:
    """Re-run evaluators on a saved checkpoint; print the results, append them to the run's
    metrics.jsonl and log them to its [[log]] loggers (TensorBoard) at the checkpoint's step.

    `eblvm eval RUN -e ais-loglik -o eval.0.n_chains=500` runs AIS alone with 500 chains;
    `--checkpoint step:5000` evaluates the checkpoint kept at step 5000 ([run] keep_every).
    """
    check_device(device)

    def go() -> None:
        from eblvm_core.evaluate import evaluator_tables, load_run, record, run_evaluators

        tables = evaluator_tables(evaluator) if evaluator else None
        err = lambda line: typer.echo(line, err=True)  # noqa: E731
        run = load_run(run_dir, checkpoint, device, override, seed, evals=tables, echo=err)
        result = run_evaluators(run, echo=err)
        for key, value in result.scalars.items():
            typer.echo(f"{key.removeprefix('eval/')}: {value:.6g}")
        for path in record(run, result):
            typer.echo(f"image: {path}")
        logged = f" and its [[log]] ({', '.join(s.kind for s in run.recipe.logs)})" if run.recipe.logs else ""
        typer.echo(f"step {run.step} ({run.checkpoint}); appended to {run.run_dir / 'metrics.jsonl'}{logged}")

    guarded(go)


@app.command()
def sample(
    run_dir: Path = typer.Argument(..., help="a run directory"),
    n: int = typer.Option(64, "-n", min=1, help="number of samples"),
    out: Path | None = typer.Option(None, help="image file, e.g. samples.png (default RUN_DIR/samples.png)"),
    raw: str = typer.Option("pt", help="format of the raw samples written beside the image: pt or npy"),
    checkpoint: str = typer.Option("last", help="last, best or a checkpoint path"),
    sampler: str | None = typer.Option(
        None,
        help="sampler name (default: the recipe's [sampler], else the sampler of its sample-grid or fid [[eval]], "
        "else the model's default)",
    ),
    override: list[str] = typer.Option(
        [], "-o", "--override", help="section.key=value, e.g. sampler.burn_in=200 or eval.1.sampler_options.burn_in=200"
    ),
    device: str | None = typer.Option(None, help="auto, cpu, cuda, cuda:N or mps (default: the recipe's)"),
    seed: int = typer.Option(0, help="seed of the sampler"),
    scale: int | None = typer.Option(
        None,
        min=1,
        help="image grids: every pixel drawn as SCALE × SCALE pixels (nearest neighbour); default: the smallest "
        "whole factor that makes each image at least 64 pixels on its shorter side (2-D scatters ignore it)",
    ),
) -> None:
    """Draw samples from a trained model with the recipe's sampler settings; save them as an image
    (a scatter for 2-D data, else a grid upscaled to a readable size, see --scale) and as raw values
    (n, *event_shape) beside it (.pt or .npy)."""
    check_device(device)
    if raw not in ("pt", "npy"):
        fail(f"--raw must be pt or npy, got '{raw}'")
    if out is not None and out.suffix.lower() not in (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"):
        fail(f"--out {out}: name an image file such as samples.png; the raw samples are written beside it (--raw)")

    def go() -> None:
        from torchvision.utils import save_image

        from eblvm_core.evaluate import load_run, sample_run, samples_image, save_samples

        run = load_run(run_dir, checkpoint, device, override, seed)
        samples, image, source = sample_run(run, n, sampler)
        if scale is not None:
            image = samples_image(samples, run.parts.data, scale)
        path = out or run.run_dir / "samples.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_image(image, path)
        values = save_samples(samples, path, raw)
        typer.echo(f"{n} samples (step {run.step}, sampler {source}) -> {path}, {values}")

    guarded(go)


def _add_command(fn: Callable[..., None], name: str | None = None) -> None:
    app.command(name or fn.__name__.replace("_", "-"))(fn)


experiments.register_commands(register=_add_command)  # eblvm's own commands of many runs (compare)


def main() -> None:
    """The ``eblvm`` entry point. Plugins (and torch) load only for commands that need them, so
    ``eblvm --help`` and ``eblvm <command> --help`` start fast; a plugin command that would
    shadow a built-in one, or one another plugin registered first, is refused."""
    builtin = {command.name or command.callback.__name__ for command in app.registered_commands}
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if command is not None and command not in builtin:
        from eblvm_core.plugins import BUILTIN, load

        owners: dict[str, str] = {}
        for name, fn, plugin in load().commands:
            if plugin in BUILTIN:
                continue  # eblvm's own, registered with the app
            if name in builtin:
                typer.echo(
                    f"eblvm: plugin '{plugin}' registers a command '{name}', which is eblvm's own; ignored", err=True
                )
            elif name in owners:
                typer.echo(
                    f"eblvm: plugin '{plugin}' registers a command '{name}', which plugin '{owners[name]}' "
                    "registered first; ignored",
                    err=True,
                )
            else:
                owners[name] = plugin
                app.command(name)(fn)
    try:
        app()
    except SystemExit as exc:
        distributed = sys.modules.get("eblvm_core.distributed")
        if distributed is not None and distributed.was_a_rank():  # leave before torch's teardown can abort
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        raise
    finally:  # exiting: a late Ctrl-C must not print a traceback from an exit handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
