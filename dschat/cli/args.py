"""Command-line flags shared by the step scripts, defined once per group with upstream's names.

Each ``add_*_args(parser, ...)`` adds one argument group. Names, defaults and help follow upstream's
``main.py`` files (``training/step*/main.py``); flags that are ours say so in their help.
"""
from __future__ import annotations

import argparse

__all__ = ["add_data_args", "add_unsupervised_data_args"]

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def add_data_args(parser: argparse.ArgumentParser, *, phase: int) -> argparse._ArgumentGroup:
    """Add the data flags of step ``phase`` (1 = SFT, 2 = reward model / DPO, 3 = PPO).

    ``--sft_only_data_path`` exists only in step 1, and step 3's ``--data_output_path`` default has
    no trailing slash, both as upstream. ``--rebuild_data_cache`` is ours (upstream's ``reload``
    argument was reachable only by editing the code).
    """
    if phase not in (1, 2, 3):
        raise ValueError(f"phase must be 1, 2 or 3, got {phase}")
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data_path", nargs="*", default=["Dahoas/rm-static"],
        help="Path to the training dataset. Accepted format: 1) a single data path, 2) multiple "
             "datasets in the form: dataset1-path dataset2-path ... Besides the hub datasets "
             "upstream supports: dschat/builtin, local/jsonfile, a .json/.jsonl/.parquet file or "
             "folder with prompt/chosen[/rejected] columns, or a save_to_disk folder.",
    )
    group.add_argument(
        "--data_split", type=str, default="2,4,4",
        help="Comma-separated list of proportions for training phase 1, 2, and 3 data. For example "
             "the split `6,2,2` will use 60%% of data for phase 1, 20%% for phase 2 and 20%% for "
             "phase 3.",
    )
    if phase == 1:
        group.add_argument(
            "--sft_only_data_path", nargs="*", default=[],
            help="Path to the dataset for only using in SFT phase.",
        )
    group.add_argument(
        "--data_output_path", type=str, default="/tmp/data_files" if phase == 3 else "/tmp/data_files/",
        help="Where to store the data-related files such as the tokenised-dataset cache. May be "
             "shared by all ranks and nodes if the filesystem supports file locks: the cache is "
             "built once under a lock and written atomically.",
    )
    group.add_argument(
        "--rebuild_data_cache", action="store_true",
        help="(dschat) Rebuild the tokenised-dataset cache even if a matching one exists. The cache "
             "key already covers file contents, tokenizer, split, lengths and eot token.",
    )
    return group


def add_unsupervised_data_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Step 3's PPO-ptx data flags (``--unsup_coef`` belongs to the PPO group)."""
    group = parser.add_argument_group("unsupervised data (PPO-ptx)")
    group.add_argument(
        "--unsupervised_dataset_name", type=str, default=None,
        help="The name of the dataset to use (via the datasets library). Also: a local "
             "save_to_disk folder, .json/.jsonl/.parquet/.txt file(s), or dschat/builtin. Setting it "
             "enables PPO-ptx (upstream also required a config name).",
    )
    group.add_argument(
        "--unsupervised_dataset_config_name", type=str, default=None,
        help="The configuration name of the dataset to use (via the datasets library).",
    )
    group.add_argument(
        "--preprocessing_num_workers", type=int, default=None,
        help="The number of processes to use for the preprocessing.",
    )
    return group
