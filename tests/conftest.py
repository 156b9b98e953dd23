"""Shared test set-up: CPU DeepSpeed, no hub, the GPU marker, and the fixtures the test folders share."""
import gc
import os

# Set before anything imports deepspeed or transformers.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.step3 import make_critic_folder, make_lora_inputs


# Under pytest-xdist (the README's test command: two workers, ``--dist loadfile``) each worker runs in
# its own process: one thread each, so that the two leave each other a core (a worker at torch's
# default of one thread per core would oversubscribe the machine while the other runs).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Files whose tests share a session-scoped fixture (tests/training/conftest.py: one step-1 run on two
# ranks) go to the same worker, so that the run is made once.
SAME_WORKER = {"tests/training/test_resume_reshape.py": "tests/training/test_two_ranks.py"}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and unused) without the plugin
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of :data:`SAME_WORKER` grouped; any other mode is xdist's."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # noqa: PLC0415 -- only under pytest-xdist

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

    return SharedFixtureScheduling(config, log)


def pytest_collection_finish(session):
    """Everything imported by now (torch, transformers, DeepSpeed, dschat, the test modules) lives as
    long as the session: freeze it out of the garbage collector's full collections, which DeepSpeed
    runs at every ZeRO-3 engine's set-up and which otherwise scan it all each time."""
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="GPU tier: needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Tests marked ``forks`` fork the test process (a kill at each point of a save). Late in a full run
# pytest holds gigabytes, and the kernel's overcommit check can refuse fork() (ENOMEM): so the marked
# tests of a module run together in one fresh interpreter, and each reports the outcome it had there.
FRESH_PROCESS_ENV = "DSCHAT_TEST_FRESH_PROCESS"
_fresh_outcomes: dict[str, str] = {}  # node id -> "PASSED" / "FAILED" / ...
_fresh_output: dict[str, str] = {}  # module path -> the fresh run's output


def _run_fresh(item: pytest.Item) -> None:
    module = str(item.path)
    nodes = [i.nodeid for i in item.session.items if str(i.path) == module and "forks" in i.keywords]
    # --durations-min: pytest.ini's slowest-tests list would push the child's traceback out of what is kept.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--durations-min",
                           "1e9", *nodes],
                          cwd=item.config.rootpath, env={**os.environ, FRESH_PROCESS_ENV: "1"},
                          capture_output=True, text=True, timeout=3600)
    _fresh_output[module] = proc.stdout[-6000:] + proc.stderr[-2000:]
    for line in proc.stdout.splitlines():
        outcome, _, node = line.partition(" ")
        if outcome in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            _fresh_outcomes.setdefault(node.split(" - ")[0], outcome)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if "forks" not in pyfuncitem.keywords or os.environ.get(FRESH_PROCESS_ENV):
        return None  # run here
    if str(pyfuncitem.path) not in _fresh_output:
        _run_fresh(pyfuncitem)
    outcome = _fresh_outcomes.get(pyfuncitem.nodeid)
    if outcome == "SKIPPED":
        pytest.skip("skipped in the fresh interpreter")
    if outcome != "PASSED":
        pytest.fail(f"{outcome or 'no outcome'} in a fresh interpreter:\n{_fresh_output[str(pyfuncitem.path)]}",
                    pytrace=False)
    return True


# The step-3 inputs are module-scoped: one set per test module, as when each module imported
# them, so a module's runs share a data cache and critic folders with no other module's.

@pytest.fixture(scope="module")
def critic_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Step-2-style critic folders (random value head) for tiny-opt, tiny-llama and tiny-opt-quirk."""
    root = tmp_path_factory.mktemp("step3_critics")
    return {name: make_critic_folder(name, root / name) for name in ("tiny-opt", "tiny-llama", "tiny-opt-quirk")}


@pytest.fixture(scope="module")
def lora_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A LoRA actor and critic of tiny-opt-quirk saved by dschat, as steps 1 and 2 leave them."""
    return make_lora_inputs("tiny-opt-quirk", tmp_path_factory.mktemp("step3_lora_inputs"))


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--data_output_path`` of a module's step-3 runs."""
    return tmp_path_factory.mktemp("step3_data")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the 2 CPU cores are shared. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``; a module whose module-scoped runs must
    also see one thread defines its own module-scoped fixture (rlhf/test_step3_evaluation.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
