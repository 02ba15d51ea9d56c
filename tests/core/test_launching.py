"""launching.py: a launcher's options, declared once as an attrs config, read from a command line
(``launcher_options``: each field a flag, numbers within their validators' bounds, dicts as
repeatable KEY=VALUE, lists repeated, a bad value or an unknown option one line with exit 2),
which launcher owns a flag, the options' help, and the Launcher interface."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import typer

from eblvm_core.config import non_negative, option, positive
from eblvm_core.launching import Launcher, RunRequest, describe_options, launcher_options, option_flag, owner_of


@attrs.frozen
class ClusterConfig:
    time: int | str = option(60, "minutes or HH:MM:SS")
    nodes: int = option(1, "nodes", positive)
    retries: int | None = option(None, "requeues", non_negative)
    mem_gb: float | None = option(None, "memory per node, GB")
    extra: dict[str, Any] = option({}, "extra sbatch options")
    setup: list[str] = option([], "shell lines run first")
    nproc_per_node: int = option(1, "processes per node", positive)


@attrs.frozen
class OtherConfig:
    queue: str = option("default", "the queue")


def given(args: list[str], skip: tuple[str, ...] = ("nproc_per_node",)) -> dict[str, Any]:
    return launcher_options(ClusterConfig, args, skip=skip, command="eblvm run")


def test_each_field_is_a_flag_read_as_the_fields_type_and_those_not_given_are_absent():
    args = ["--mem-gb", "2.5", "--nodes", "3", "--extra", "account=proj", "--extra", "--exclusive"]
    args += ["--setup", "module load cuda", "--setup", "export A=1", "--time", "90", "--retries", "0"]
    assert given(args) == {
        "mem_gb": 2.5,
        "nodes": 3,
        "retries": 0,
        "extra": {"account": "proj", "exclusive": True},  # KEY alone: true; leading dashes dropped
        "setup": ["module load cuda", "export A=1"],
        "time": 90,  # a whole number of an int | str field is an int
    }
    assert given(["--time", "1:30:00"]) == {"time": "1:30:00"}
    assert given([]) == {}


@pytest.mark.parametrize(
    "args, line",
    [
        (["--extra", "=proj"], "error: Invalid value for --extra: takes KEY=VALUE (e.g. account=proj), got '=proj'"),
        (["--nodes", "0"], "error: Invalid value for '--nodes': 0 is not in the range x>=1."),
        (["--retries", "-1"], "error: Invalid value for '--retries': -1 is not in the range x>=0."),
        (["--mem-gb", "lots"], "error: Invalid value for '--mem-gb': 'lots' is not a valid float."),
        (["--nproc-per-node", "2"], "error: No such option '--nproc-per-node'."),  # skipped: the command's own
        (["--time"], "error: Option '--time' requires an argument."),
    ],
)
def test_a_bad_value_or_an_unknown_option_is_one_line_with_exit_2(capsys, args, line):
    with pytest.raises(typer.Exit) as exc:
        given(args)
    assert exc.value.exit_code == 2
    assert capsys.readouterr().err == line + "\n"


def test_the_launcher_that_owns_a_flag_is_found_by_its_fields():
    launchers = {"other": OtherConfig, "cluster": ClusterConfig}
    assert owner_of("--mem-gb", launchers) == "cluster"
    assert owner_of("--queue", launchers) == "other"
    assert owner_of("--mem_gb", launchers) is None  # the flag, not the field's name
    assert owner_of("--partition", launchers) is None


def test_the_options_help_is_one_line_a_flag():
    assert option_flag("array_parallelism") == "--array-parallelism"
    assert describe_options(ClusterConfig, skip=("extra", "setup", "nproc_per_node")).splitlines() == [
        "--time: minutes or HH:MM:SS",
        "--nodes: nodes",
        "--retries: requeues",
        "--mem-gb: memory per node, GB",
    ]


def test_a_launcher_submits_only_what_it_implements():
    """The interface declares ``submit``; a launcher that does not implement it refuses every run."""
    with pytest.raises(NotImplementedError):
        Launcher().submit(RunRequest("r.toml"), wait=False, echo=print)
    request = RunRequest("r.toml", ["run.steps=3"], "runs/small", None, "out")
    assert request.overrides == ("run.steps=3",) and str(request.resume) == "runs/small" and str(request.out) == "out"
