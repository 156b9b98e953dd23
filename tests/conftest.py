"""Shared test set-up: CPU DeepSpeed, no hub, the GPU marker, and the fixtures the test folders share."""
import os

# Set before anything imports deepspeed or transformers.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.step3 import make_critic_folder, make_lora_inputs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="GPU tier: needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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
