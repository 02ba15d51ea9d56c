"""A command's start without the cyclic garbage collector (eblvm_core.startup): paused by the
commands that build, resumed by the build with what exists frozen and what the build makes not,
and on again after a command that failed before its build. A pool of run workers forked from a
server that loaded torch once."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import tomllib

import pytest

from eblvm_core import startup
from tests.support import SMALL_RECIPE


@pytest.fixture
def collector():
    """The collector on and nothing frozen for the test; after it, on or off and frozen or not as
    before (conftest.py froze what the worker loaded, an in-process command what it had built on)."""
    was_enabled, was_frozen = gc.isenabled(), gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.enable()
    yield
    startup._paused = False
    gc.unfreeze()
    if was_frozen:
        gc.freeze()
    (gc.enable if was_enabled else gc.disable)()


def tracked(obj: object) -> bool:
    """Whether a later collection would look at ``obj``: frozen objects are in no generation."""
    return any(o is obj for o in gc.get_objects())


def test_a_pause_holds_until_resumed_which_freezes_what_exists_and_imports_dynamo(collector):
    startup.pause_gc()
    assert not gc.isenabled()
    before = []  # made during the pause
    startup.resume_gc()
    assert gc.isenabled() and gc.get_freeze_count() > 0 and "torch._dynamo" in sys.modules
    assert not tracked(before)
    after = []
    assert tracked(after)
    frozen = gc.get_freeze_count()  # less as frozen objects are freed, never more without a freeze
    startup.resume_gc()  # a second build resumes nothing and freezes nothing
    assert gc.get_freeze_count() <= frozen and tracked(after)


def test_without_a_pause_resuming_leaves_the_collector_alone(collector):
    startup.resume_gc()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()  # someone else's choice: a pause does not claim it, a resume does not undo it
    startup.pause_gc()
    startup.resume_gc()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_the_build_resumes_and_what_it_builds_is_not_frozen(collector):
    import eblvm
    from eblvm_core.build import build

    recipe = eblvm.load_recipe(tomllib.loads(SMALL_RECIPE))
    startup.pause_gc()
    built = build(recipe, "cpu")
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert not tracked(recipe) and tracked(built.parts.model) and tracked(built.parts.data)


def test_a_dry_run_resumes_before_it_makes_the_parts_it_plans_with(collector, monkeypatch):
    """validate's dry run makes the data and networks to plan, and builds with them: made after the
    resume, they are not frozen either."""
    import eblvm
    from eblvm_core import build as building

    recipe = eblvm.load_recipe(tomllib.loads(SMALL_RECIPE))
    built, build = [], building.build
    monkeypatch.setattr(building, "build", lambda *args, **kw: built.append(build(*args, **kw)) or built[-1])
    startup.pause_gc()
    building.dry_run(recipe)
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert not tracked(recipe) and tracked(built[0].parts.model) and tracked(built[0].parts.data)


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_command_pauses_and_its_build_resumes(collector, cli, write_recipe, tmp_path, command):
    result = cli([command, write_recipe(), *(["--out", tmp_path / "runs"] if command == "run" else [])])
    assert result.exit_code == 0, result.output
    assert gc.isenabled() and gc.get_freeze_count() > 0


def test_a_command_that_fails_before_its_build_turns_collection_on_again(collector, cli, write_recipe, tmp_path):
    result = cli(["run", write_recipe(SMALL_RECIPE.replace("steps = 30", "steps = -1")), "--out", tmp_path / "runs"])
    assert result.exit_code == 2 and "steps" in result.output
    assert gc.isenabled() and gc.get_freeze_count() == 0


def worker_start(name: str) -> tuple[int, str | None, bool, bool]:
    """What a pool's worker sees at its first task: its parent's process id, the variable ``name``,
    whether collection is on, and whether its process had loaded eblvm's worker imports."""
    return os.getppid(), os.environ.get(name), gc.isenabled(), "eblvm_core.worker_imports" in sys.modules


@pytest.mark.slow
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server here")
def test_a_pools_workers_fork_from_a_server_that_loaded_torch_and_see_the_environment_of_now(monkeypatch):
    """Two pools one after the other: each worker is forked from the one fork server (not from this
    process), which loaded torch and a run's modules; it starts with collection paused and with
    this process's environment when its pool was made, also a variable set after the server began."""
    seen = []
    for value in ("first", "second"):
        monkeypatch.setenv("EBLVM_TEST_POOL", value)
        with startup.worker_pool(2) as pool:
            seen.append(pool.submit(worker_start, "EBLVM_TEST_POOL").result(timeout=120))
    servers = {parent for parent, *_ in seen}
    assert len(servers) == 1 and os.getpid() not in servers
    assert [variable for _, variable, *_ in seen] == ["first", "second"]
    assert all(not collecting and preloaded for _, _, collecting, preloaded in seen)
