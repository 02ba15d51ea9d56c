"""The ``eblvm`` command line (typer). User errors print one line and exit with code 2."""

from __future__ import annotations

import os
import signal
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import typer

from eblvm_core.cli_support import check_device, fail, guarded
from eblvm_core.errors import EblvmError
from eblvm_core.launching import Launcher, RunRequest, launcher_options, owner_of
from eblvm_core.startup import paused_gc

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Learn energy-based latent variable models from TOML recipes.",
    epilog="Plugins may add commands: `eblvm plugins` lists them.",
)


def _print_version(asked: bool) -> None:
    if asked:
        from eblvm_core import __version__

        typer.echo(f"eblvm {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="print eblvm's version and exit"
    ),
) -> None:
    """Learn energy-based latent variable models from TOML recipes."""


LOCAL = "local"  # the launcher that trains in this process (or --nproc-per-node processes here)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
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
        "docs/distributed.md); with a launcher, processes per node of its job",
    ),
    launcher: str = typer.Option(
        LOCAL,
        "--launcher",
        help="local: train here; another launcher a plugin registers (slurm: a Slurm job through submitit, "
        "docs/cluster.md) trains elsewhere, and its options follow (`eblvm plugins` lists them)",
    ),
    wait: bool = typer.Option(
        False, "--wait", help="with a launcher: watch the run to its end and print its final evaluation"
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
    request = RunRequest(recipe, override, resume, device, out)
    if launcher != LOCAL:
        guarded(lambda: _submit(launcher, ctx.args, nproc_per_node, request, wait))
        return
    if ctx.args:
        _not_local(ctx.args)
    if wait:
        _not_local(["--wait"])
    if nproc_per_node is not None:
        if resume is not None:  # the processes, and the launcher's own records, name the run itself
            request = attrs.evolve(request, resume=_run_dir(resume, "cannot resume"))
        raise typer.Exit(_launch(nproc_per_node, request))

    def go() -> None:
        from eblvm_core.session import run as train

        train(request, echo=typer.echo)  # prints the final evaluation and done:

    with paused_gc():
        guarded(go)


def _launchers() -> dict[str, Any]:
    """The launchers plugins registered, by name: their registry entries."""
    from eblvm_core.plugins import load

    return {entry.name: entry for entry in load()["launchers"].entries()}


def _runs_as(entry: Any) -> str:
    """What a launcher's runs are, from the class its factory returns (``Launcher.runs_as``)."""
    try:
        returned = typing.get_type_hints(entry.factory).get("return")
    except Exception:  # an annotation that does not resolve
        returned = None
    return returned.runs_as if isinstance(returned, type) and issubclass(returned, Launcher) else Launcher.runs_as


def _not_local(args: list[str]) -> None:
    """Refuse options the local launcher does not take: a launcher's own (naming it), else unknown."""
    flag = next((a.split("=")[0] for a in args if a.startswith("--")), None)
    launchers = _launchers()
    configs = {name: e.config for name, e in launchers.items()}
    owner = owner_of(flag, configs) if flag is not None and flag != "--wait" else None
    if flag == "--wait":
        owner = next(iter(launchers), None)
        if owner is None:
            fail("--wait is for a run a launcher starts elsewhere, and no plugin registers a launcher")
        fail(f"--wait is for {_runs_as(launchers[owner])}: add --launcher {owner}")
    if owner is not None:
        fail(f"{flag} is an option of {_runs_as(launchers[owner])}: add --launcher {owner}")
    fail(f"no such option: {flag or args[0]}")


def _submit(name: str, args: list[str], nproc_per_node: int | None, request: RunRequest, wait: bool) -> None:
    """``eblvm run --launcher NAME``: the run handed to a registered launcher with its options."""
    import shlex

    from eblvm_core.build import _make
    from eblvm_core.config import structure
    from eblvm_core.recipe import Section

    launchers = _launchers()
    if name not in launchers:
        fail(f"--launcher must be {', '.join([LOCAL, *launchers])}, got '{name}'")
    entry = launchers[name]
    options = launcher_options(entry.config, args, skip=("nproc_per_node",), command="eblvm run")
    if nproc_per_node is not None and "nproc_per_node" in attrs.fields_dict(entry.config):
        options["nproc_per_node"] = nproc_per_node
    config = structure(entry.config, options, "launcher (command line)")
    launcher = _make(Section("launcher", entry, config))
    launcher.submit(attrs.evolve(request, command=shlex.join(sys.argv)), wait, typer.echo)


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


def _launch(nproc: int, request: RunRequest) -> int:
    """Train with ``nproc`` processes of ``python -m eblvm run ...`` started and watched by this
    one (``eblvm_core.processes``); returns the exit code."""
    if "WORLD_SIZE" in os.environ:
        fail("--nproc-per-node: this process was launched by torchrun already")
    from eblvm_core.processes import run_processes

    args = [str(request.recipe)] if request.resume is None else ["--resume", str(request.resume)]
    args += [a for o in request.overrides for a in ("-o", o)] + ["--out", str(request.out)]
    args += ["--device", request.device] if request.device is not None else []
    sys.stdout.flush()
    return run_processes(nproc, args, request.resume)


@app.command()
def validate(
    recipes: list[Path] = typer.Argument(..., help="recipe files, comparison specs or search specs"),
    override: list[str] = typer.Option([], "-o", "--override", help="section.key=value; repeatable"),
    check_data: bool = typer.Option(
        False,
        "--check-data",
        help="also read the data files, as run does (downloading them where the recipe sets download = true); by default a data set whose files are absent is replaced by a stand-in, with a warning",
    ),
    show: bool = typer.Option(
        False, "--show", help="print the resolved recipe (includes merged, overrides applied, every default) as TOML"
    ),
) -> None:
    """Dry-run recipes: build every part at recipe size without training or writing (or, without --check-data, downloading).

    Whatever `eblvm run` would reject before its first step is rejected here, with the same
    one-line error and exit code 2. Specs a plugin reads (the experiments plugin's comparison specs,
    checked row by row, and search specs, at every end of every searched range) too. With
    --show, each resolved recipe is printed as `eblvm run` would write it into the run
    directory's recipe.toml.
    """
    with paused_gc():  # the first dry build resumes it (eblvm_core.startup)
        from eblvm_core.build import dry_run
        from eblvm_core.plugins import load
        from eblvm_core.recipe import load_recipe
        from eblvm_core.recipe.library import recipe_file

        readers = [entry.factory for entry in load()["spec_readers"].entries()]
        bad = 0
        for path in recipes:
            try:
                file = recipe_file(path)
                resolved = next((found for read in readers if (found := read(file, override)) is not None), None)
                if resolved is None:
                    resolved = {str(path): load_recipe(file, override)}
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
def plugins(
    name: str | None = typer.Argument(None, help="a component: its options alone"),
    kind: str | None = typer.Option(None, help="only the components of this kind (model, estimator, ...)"),
) -> None:
    """List plugins, what each registers, and each component's config fields."""
    from eblvm_core.config import describe
    from eblvm_core.plugins import load
    from eblvm_core.registry import did_you_mean

    loaded = load()
    found = [(k, n, info.name) for info in loaded.plugins for k, names in info.components.items() for n in names]
    kinds = list(dict.fromkeys(k for k, _, _ in found))
    if kind is not None and kind not in kinds and f"{kind}s" not in kinds:
        fail(f"--kind: no kind '{kind}'{did_you_mean(kind, kinds)}; kinds: {', '.join(kinds)}")
    shown = [f for f in found if kind is None or kind in (f[0], f[0][:-1])]
    shown = [f for f in shown if name is None or f[1] == name]
    if name is not None and not shown:
        fail(f"no component '{name}'{did_you_mean(name, sorted({n for _, n, _ in found}))}")
    indent = "  " if name is None and kind is None else ""
    for info in loaded.plugins:
        plugin = info.name
        if indent:
            typer.echo(f"{plugin}  ({info.module})")
        for k, n, _ in (f for f in shown if f[2] == plugin):
            entry = loaded[k].get(n)
            typer.echo(f"{indent}{k[:-1]} {n}: {entry.doc}" + ("" if indent else f"  (plugin {plugin})"))
            keys = entry.reported_keys()
            if keys:
                typer.echo(f"{indent}    reports: {', '.join(keys)}")
            for field, tp, default, help_ in describe(entry.config):
                typer.echo(f"{indent}    {field}: {tp} = {default}  {help_}".rstrip())
        for command in loaded.commands if indent else []:
            if command.plugin == plugin:
                typer.echo(f"  command {command.name}")
    for failed, why in loaded.failed.items() if indent else []:
        typer.echo(f"{failed}  FAILED: {why}")


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
        import math

        from eblvm_core.errors import TrainingDiverged
        from eblvm_core.saved import evaluator_tables, load_run, record

        tables = evaluator_tables(evaluator) if evaluator else None
        err = lambda line: typer.echo(line, err=True)  # noqa: E731
        run = load_run(run_dir, checkpoint, device, override, seed, evals=tables, echo=err)
        result = run.evaluate(echo=err)
        for key, value in result.scalars.items():
            typer.echo(f"{key.removeprefix('eval/')}: {value:.6g}")
        for path in record(run, result):
            typer.echo(f"image: {path}")
        logged = f" and its [[log]] ({', '.join(s.kind for s in run.recipe.logs)})" if run.recipe.logs else ""
        typer.echo(f"step {run.step} ({run.checkpoint}); appended to {run.run_dir / 'metrics.jsonl'}{logged}")
        bad = next(((k, v) for k, v in result.scalars.items() if not math.isfinite(v)), None)
        if bad is not None:
            raise TrainingDiverged(
                f"{run.run_dir} step {run.step} ({run.checkpoint}): evaluation gave {bad[0]} = {bad[1]}: "
                "the model has degenerated"
            )

    with paused_gc():
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
    (a scatter for 2-D data, else a grid upscaled to a readable size, see --scale), as raw values
    (n, *event_shape) beside it (.pt or .npy), and the sampler's diagnostics (acceptance, effective
    sample size, split R-hat...) beside them as .json, printed too.

    `eblvm sample RUN --sampler hmc` draws by HMC at its defaults; `-o sampler.kind=hmc -o
    sampler.leapfrog_steps=20` with 20 leapfrog steps."""
    check_device(device)
    if raw not in ("pt", "npy"):
        fail(f"--raw must be pt or npy, got '{raw}'")
    if out is not None and out.suffix.lower() not in (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"):
        fail(f"--out {out}: name an image file such as samples.png; the raw samples are written beside it (--raw)")

    def go() -> None:
        import torch
        from torchvision.utils import save_image

        from eblvm_core.errors import TrainingDiverged
        from eblvm_core.files import output_file
        from eblvm_core.saved import load_run, sample_run, samples_image, save_diagnostics, save_samples

        run = load_run(run_dir, checkpoint, device, override, seed)
        path = output_file(out or run.run_dir / "samples.png", "samples")
        drawn, image, source = sample_run(run, n, sampler)
        if not bool(torch.isfinite(drawn.samples).all()):
            raise TrainingDiverged(
                f"{run.run_dir} step {run.step} ({run.checkpoint}): the sampler {source} drew non-finite samples: "
                "the model has degenerated; nothing was written"
            )
        if scale is not None:
            image = samples_image(drawn.samples, run.parts.data, scale)
        save_image(image, path)
        values = save_samples(drawn.samples, path, raw)
        diagnostics = save_diagnostics(run, drawn, source, path)
        for key, value in drawn.diagnostics.items():
            typer.echo(f"{key}: {value:.4g}")
        typer.echo(f"{n} samples (step {run.step}, sampler {source}) -> {path}, {values}, {diagnostics}")

    with paused_gc():
        guarded(go)


def _command_name(command: typer.models.CommandInfo) -> str:
    """A typer command's name: given, else its function's."""
    return command.name or str(getattr(command.callback, "__name__", ""))


EBLVM_COMMANDS = frozenset(_command_name(command) for command in app.registered_commands)


def add_plugin_commands(echo: Callable[[str], None] = lambda line: typer.echo(line, err=True)) -> None:
    """Add the commands plugins register to the app (once); one that would shadow one of eblvm's
    own, or one another plugin registered first, is refused with a line through ``echo``."""
    from eblvm_core.plugins import load

    taken = {_command_name(command) for command in app.registered_commands}
    owners: dict[str, str] = {}
    for command in load().commands:
        name, plugin = command.name, command.plugin
        if name in EBLVM_COMMANDS:
            echo(f"eblvm: plugin '{plugin}' registers a command '{name}', which is eblvm's own; ignored")
        elif name in owners:
            echo(
                f"eblvm: plugin '{plugin}' registers a command '{name}', which plugin '{owners[name]}' registered first; ignored"
            )
        else:
            owners[name] = plugin
            if name not in taken:
                app.command(name, **command.settings)(command.fn)


def main() -> None:
    """The ``eblvm`` entry point. Plugins (and torch) load only for commands that need them, so
    ``eblvm --help`` and ``eblvm <command> --help`` of eblvm's own commands start fast; a plugin
    command that would shadow one of eblvm's own, or one another plugin registered first, is refused."""
    from eblvm_core.plugins import check_pins

    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if command is not None:
        try:
            check_pins()
        except EblvmError as exc:
            typer.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
    if command is not None and command not in EBLVM_COMMANDS:
        add_plugin_commands()
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
    main()
