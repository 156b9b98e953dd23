"""configs/e2e.yaml read with every key and type checked (dschat.recipes.e2e_config): a wrong shape
is one line naming the file and the key, never a silent default or a KeyError traceback."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dschat.errors import UserError
from dschat.recipes import loading as recipe_loading
from dschat.recipes.e2e_config import ReportSettings, load_e2e_config

from helpers import REPO


def _checkout(tmp_path: Path, old: str, new: str) -> Path:
    """A checkout of this repository's configs whose e2e.yaml has ``old`` replaced by ``new``."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "configs", root / "configs")
    (root / "training").mkdir()
    text = (REPO / "configs" / "e2e.yaml").read_text(encoding="utf-8")
    assert old in text
    (root / "configs" / "e2e.yaml").write_text(text.replace(old, new, 1), encoding="utf-8")
    recipe_loading._CACHE.clear()
    return root


def test_the_committed_file_loads_with_its_report_settings():
    config = load_e2e_config(REPO)
    assert config.report == ReportSettings(seed=1234, max_prompts=64, max_pairs=96, batch_size=16,
                                           generation_batch_size=64, eta_seconds=85.0)
    assert config.deployment("singlenode").name == "single_node" and config.deployment("cpu").default_actor


@pytest.mark.parametrize(("old", "new", "message"), [
    # A string where a list belongs was read letter by letter: --deployment-type n chose single_node.
    ("aliases: [singlenode]", "aliases: singlenode",
     r"deployment_types.single_node.aliases must be a list of names \(such as \[singlenode\]\), got 'singlenode'"),
    ("    default_actor: smollm2-135m", "    default_actr: smollm2-135m",
     r"unknown key 'default_actr' in deployment_types.cpu \(known: actor, aliases,"),
    ("  max_prompts: 64", "  max_prompt: 64", r"unknown key 'max_prompt' in report"),  # the report took all prompts
    ("    other_reward: opt/single_gpu/350m\n", "", r"deployment_types.single_gpu lacks 'other_reward'"),  # a KeyError
    ("  max_pairs: 96", "  max_pairs: 96\n  max_pairs: 8", "e2e.yaml, line 90: the key 'max_pairs' is given twice in one mapping"),
    ("  max_pairs: 96", "  max_pairs: 0", "report.max_pairs must be a whole number of at least 1, got '0'"),
    ("  eta_seconds: 85", "  eta_seconds: soon", "report.eta_seconds must be a number of at least 0, got 'soon'"),
    ("default_deployment: single_gpu", "default_deployment: one_gpu",
     "default_deployment 'one_gpu' is not one of deployment_types"),
    ("aliases: [multinode]", "aliases: [singlenode]",
     "'singlenode' names both deployment_types.single_node and deployment_types.multi_node"),
    ("    other_actor: opt/single_gpu/1.3b", "    other_actor: [opt/single_gpu/1.3b]",
     "deployment_types.single_gpu.other_actor must be one line of text"),
])
def test_a_wrong_shape_is_one_line_naming_the_key(tmp_path, old, new, message):
    root = _checkout(tmp_path, old, new)
    with pytest.raises(UserError, match=message) as err:
        load_e2e_config(root)
    assert str(err.value).startswith(f"{root / 'configs' / 'e2e.yaml'}") and "\n" not in str(err.value)


def test_a_recipe_it_names_must_exist(tmp_path):
    root = _checkout(tmp_path, "      13b: opt/single_node/13b", "      13b: opt/single_node/13c")
    with pytest.raises(UserError, match="no step1 recipe 'opt/single_node/13c'"):
        load_e2e_config(root)
