"""Shared test helpers: where optional real assets live, and skips that say how to get them."""
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# One intra-op thread for the suite and every process it starts (set before anything imports torch; a value the
# caller set wins). The suite's models are tiny and its processes often run side by side (tests/test_default_paths.py
# runs two jobs at a time, torchrun two ranks, and other work shares the machine): with two OpenMP threads per
# process on a 2-core machine the threads spin-wait on each other, and an eager 60-step run of tests/test_distill.py's
# teacher took 32 s against 1.2 s on one thread (the whole suite: 35 minutes against 23, on the same busy machine).
# Tests that need another count set it themselves (tests/test_behaviour.py: 2, as recorded); the users' default
# thread count runs in .ci/run's part 1, the README's first command, compiled.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def shared_data(name: str) -> Path:
    """A file from the shared test data (``$PURESTEP_SHARED_DATA`` or ``../shared/data``), or skip."""
    roots = [os.environ.get("PURESTEP_SHARED_DATA"), REPO.parent / "shared" / "data"]
    for root in roots:
        if root and (Path(root) / name).exists():
            return Path(root) / name
    pytest.skip(f"{name} not found in $PURESTEP_SHARED_DATA or ../shared/data (CI provides it)")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """About 200 KB of real text on every machine: three of this Python's standard-library modules."""
    import inspect
    import json
    import textwrap
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(Path(m.__file__).read_text() for m in (json, textwrap, inspect)))
    return path


@pytest.fixture
def token_cache(tmp_path_factory, monkeypatch):
    """Tokenized data cached in this session's temporary folder, not in the user's ``~/.cache/purestep``."""
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def one_thread():
    """In-process runs on one intra-op thread, like the children the tests start with OMP_NUM_THREADS=1: a run
    split between a child and this process is bitwise comparable only at the same thread count (float
    reductions split across threads round differently on some CPUs)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _record_skip(report) -> None:
    """With ``$PURESTEP_SKIPPED`` naming a file (``.ci/run`` sets it), a skipped test's id (a skipped module's path)
    is appended to it, so CI can rerun exactly those once it has installed the extras and assets they asked for."""
    path = os.environ.get("PURESTEP_SKIPPED")
    if path and report.skipped and not hasattr(report, "wasxfail"):
        with open(path, "a") as fh:
            fh.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):
    _record_skip(report)


@pytest.fixture(scope="session", autouse=True)
def cpu_compiles_as_the_program_has_them():
    """The test session compiles as the ``purestep`` program does (``core.cpu_compiles``: it opts in); the library
    alone leaves torch as it is (tests/test_torch_api.py checks that in a child process without the opt-in)."""
    os.environ.setdefault("PURESTEP_CPU_COMPILES", "1")


@pytest.fixture(scope="session")
def installed_site(tmp_path_factory):
    """This checkout installed non-editable into a folder (tests/installed.py): the folder for PYTHONPATH."""
    import installed
    return installed.install(tmp_path_factory.mktemp("installed"))


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory):
    """``(teacher run folder, data file)``: a char-level Llama of one layer (d=32) after two eager steps on ~130k
    characters of stdlib text, in seconds: a teacher for the distillation recipe's own paths (tests/test_kd_jsd.py,
    tests/test_on_policy.py). Tests that use it take ``token_cache`` too (the data's tokens land there)."""
    import inspect
    import textwrap
    from purestep.recipes import main
    work = tmp_path_factory.mktemp("tiny_teacher")
    data = work / "text.txt"
    data.write_text(Path(textwrap.__file__).read_text() + Path(inspect.__file__).read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PURESTEP_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        assert main(["recipe=standard", f"data={data}", "tokenizer=char", f"out={work / 'teacher'}", "steps=2",
                     "block_size=16", "batch_size=4", "warmup_steps=1", "eval_every=0", "eval_batches=1",
                     "save_every=0", "sample_tokens=0", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                     "compile=false", "health=false"]) == 0
    return work / "teacher", data


DEFAULT_PATHS = "test_default_paths.py"


def pytest_collection_modifyitems(items):
    """tests/test_default_paths.py's tests last: its runs start with the session and go on beside the other tests
    (``default_paths_in_the_background``), so they are mostly done when its tests ask."""
    items.sort(key=lambda item: item.path.name == DEFAULT_PATHS)


@pytest.fixture(scope="session", autouse=True)
def default_paths_in_the_background(request, tmp_path_factory):
    """With a test of tests/test_default_paths.py selected, its compiled runs (minutes each, one core busy) start
    now, one core fewer at a time than the machine has (its ``start``), while the other tests keep the rest busy."""
    module = next((item.module for item in request.session.items if item.path.name == DEFAULT_PATHS), None)
    runs = module.start(request.session, tmp_path_factory, request.getfixturevalue("corpus")) if module else None
    yield
    if runs:
        runs.pool.shutdown(wait=True, cancel_futures=True)
