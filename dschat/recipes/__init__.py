"""Launch recipes: load the YAML files in ``configs/``, validate them, render a step's argv.

A *recipe* is what one upstream ``training_scripts/**/run_*.sh`` was: launcher options plus the
flags of one step's ``main.py``, with a few positional parameters (upstream's ``$1``..``$5``).
``configs/`` is the one source of truth; ``dschat.launch``, the generated shell scripts and
``e2e_rlhf.py`` all read it through this package. The format is described in ``configs/README.md``.

One module per idea: the steps (:mod:`.steps`), a recipe and the argv it renders (:mod:`.recipe`),
finding the checkout and loading its recipes (:mod:`.loading`), the generated shell scripts and
READMEs (:mod:`.scripts`), ``docs/flags.md`` (:mod:`.flags_doc`, with upstream's flag names in
:mod:`.upstream_flags`) and a small CLI (:mod:`.cli`, ``python -m dschat.recipes``: ``list``,
``show``, ``validate``, ``write-scripts`` / ``check-scripts``, ``write-flags-doc`` / ``check-flags-doc``). Their public names are importable
from here.
"""
from dschat.recipes.cli import main
from dschat.recipes.flags_doc import check_flags_doc, parser_of, render_flags_doc, step_parser, write_flags_doc
from dschat.recipes.loading import find_repo_root, get_recipe, load_all, load_step_recipes
from dschat.recipes.recipe import FlagValue, Launcher, Recipe, split_flag_groups
from dschat.recipes.scripts import (
    GENERATED_MARK,
    check_generated,
    expected_generated_files,
    render_readme,
    render_script,
    script_path,
    write_generated,
)
from dschat.recipes.upstream_flags import UPSTREAM_DEFAULTS, UPSTREAM_FLAGS
from dschat.recipes.steps import (
    PARAMS_1_2,
    PARAMS_3,
    SHELL_NAMES,
    STEP_ALIASES,
    STEPS,
    ZERO_STAGE_PARAMS,
    StepSpec,
    step_spec,
)

__all__ = [
    "PARAMS_1_2",
    "PARAMS_3",
    "ZERO_STAGE_PARAMS",
    "SHELL_NAMES",
    "StepSpec",
    "STEPS",
    "STEP_ALIASES",
    "step_spec",
    "find_repo_root",
    "FlagValue",
    "Launcher",
    "Recipe",
    "split_flag_groups",
    "load_step_recipes",
    "load_all",
    "get_recipe",
    "GENERATED_MARK",
    "script_path",
    "render_script",
    "render_readme",
    "expected_generated_files",
    "check_generated",
    "write_generated",
    "parser_of",
    "step_parser",
    "render_flags_doc",
    "check_flags_doc",
    "write_flags_doc",
    "UPSTREAM_FLAGS",
    "UPSTREAM_DEFAULTS",
    "main",
]
