"""``python -m dschat.recipes``: list, show, validate and generate launch recipes; generate docs/flags.md."""
from __future__ import annotations

import argparse
from typing import Sequence

from dschat.recipes.flags_doc import FLAGS_DOC, check_flags_doc, write_flags_doc
from dschat.recipes.loading import find_repo_root, get_recipe, load_all, load_step_recipes
from dschat.recipes.scripts import check_generated, write_generated
from dschat.recipes.steps import STEPS, step_spec

def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dschat.recipes", description="List, show, validate and generate launch recipes."
    )
    parser.add_argument("--repo-root", default=None, help="the dschat checkout (default: found automatically)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="list recipes")
    p_list.add_argument("step", nargs="?", default=None, help="step1, step2, dpo or step3 (default: all)")
    p_show = sub.add_parser("show", help="print a recipe's deepspeed command")
    p_show.add_argument("step")
    p_show.add_argument("recipe")
    p_show.add_argument("positionals", nargs="*", help="upstream-style positional values")
    sub.add_parser("validate", help="load and validate every recipe")
    sub.add_parser("write-scripts", help="(re)write training/*/training_scripts from configs/")
    sub.add_parser("check-scripts", help="exit 1 if the committed scripts differ from configs/")
    sub.add_parser("write-flags-doc", help=f"(re)write {FLAGS_DOC} from the step scripts' parsers")
    sub.add_parser("check-flags-doc", help=f"exit 1 if {FLAGS_DOC} differs from the step scripts' parsers")
    args = parser.parse_args(argv)

    if args.command == "list":
        steps = [step_spec(args.step).key] if args.step else list(STEPS)
        for key in steps:
            print(f"{key} ({STEPS[key].title}):")
            for recipe in load_step_recipes(key, args.repo_root).values():
                print(f"  {recipe.id:28s} {recipe.description}")
    elif args.command == "show":
        recipe = get_recipe(args.step, args.recipe, args.repo_root)
        print(recipe.command_preview(recipe.params_from_positionals(args.positionals)))
    elif args.command == "validate":
        total = sum(len(r) for r in load_all(args.repo_root).values())
        print(f"{total} recipes OK")
    elif args.command == "write-scripts":
        written = write_generated(args.repo_root)
        base = find_repo_root(args.repo_root)
        for path in written:
            print(f"wrote {path.relative_to(base)}" if path.exists() else f"deleted {path.relative_to(base)}")
        print(f"{len(written)} file(s) changed")
    elif args.command == "check-scripts":
        _report(check_generated(args.repo_root), "training_scripts are in sync with configs/")
    elif args.command == "write-flags-doc":
        path = write_flags_doc(args.repo_root)
        print(f"wrote {path.relative_to(find_repo_root(args.repo_root))}")
    elif args.command == "check-flags-doc":
        _report(check_flags_doc(args.repo_root), f"{FLAGS_DOC} is in sync with the step scripts")


def _report(problems: list[str], in_sync: str) -> None:
    """A check's outcome: each problem on a line and exit code 1, else the ``in_sync`` line."""
    for line in problems:
        print(line)
    if problems:
        raise SystemExit(1)
    print(in_sync)
