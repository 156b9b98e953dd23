"""A literal ``~`` in a path flag (bash leaves ``--data_output_path=~/dc`` as it is) is the home folder
for every reader: the flags expand it at parsing (dschat.cli.shared.user_path), and the data cache's
own functions (dschat.data.cache) do too, so the trust check and the files it guards are one folder."""
from __future__ import annotations

import argparse
import os

import pytest

from dschat.cli.shared import add_data_args, add_logging_args, add_model_args, add_runtime_args
from dschat.cli.step3 import add_step3_args
from dschat.data import cache as data_cache
from dschat.errors import UserError


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    return home


def test_path_flags_expand_a_literal_tilde_once_at_parsing(home):
    parser = argparse.ArgumentParser()
    add_data_args(parser, phase=1)
    add_model_args(parser)
    add_runtime_args(parser)
    add_logging_args(parser, tensorboard_path="step1_tensorboard")
    args = parser.parse_args(["--data_output_path=~/dc", "--output_dir=~/out", "--model_name_or_path=~/m",
                              "--data_path", "~/a.jsonl", "dschat/builtin", "--sft_only_data_path", "~/s.jsonl",
                              "--tensorboard_path=~/tb"])
    assert args.data_output_path == str(home / "dc") and args.output_dir == str(home / "out")
    assert args.model_name_or_path == str(home / "m") and args.tensorboard_path == str(home / "tb")
    assert args.data_path == [str(home / "a.jsonl"), "dschat/builtin"]  # a name stays a name
    assert args.sft_only_data_path == [str(home / "s.jsonl")]
    step3 = add_step3_args(argparse.ArgumentParser()).parse_args(
        ["--actor_model_name_or_path=~/actor", "--critic_model_name_or_path=~/critic",
         "--reward_model_name_or_path=~/rm", "--unsupervised_dataset_name=~/u.txt", "--resume_from=~/ck"])
    assert (step3.actor_model_name_or_path, step3.critic_model_name_or_path, step3.reward_model_name_or_path,
            step3.unsupervised_dataset_name, step3.resume_from) == tuple(
        str(home / name) for name in ("actor", "critic", "rm", "u.txt", "ck"))
    assert step3.actor_model_name_or_path != "~/actor" and add_step3_args(argparse.ArgumentParser()).parse_args(
        ["--actor_model_name_or_path", "facebook/opt-1.3b"]).actor_model_name_or_path == "facebook/opt-1.3b"


def test_the_launcher_and_the_cache_builder_expand_a_tilde_too(home):
    from dschat.data.prepare import build_parser as prepare_parser
    from dschat.launch import build_parser as launch_parser

    launch = launch_parser().parse_args(["step3", "cpu/tiny", "--output_dir=~/out", "--actor_model=~/a",
                                         "--critic_model=~/c", "--hostfile=~/hosts"])
    assert (launch.output_dir, launch.actor_model, launch.critic_model, launch.hostfile) == tuple(
        str(home / name) for name in ("out", "a", "c", "hosts"))
    prepare = prepare_parser().parse_args(["--model_name_or_path=~/m", "--train_phase", "1"])
    assert prepare.model_name_or_path == str(home / "m")


def test_the_data_cache_checks_and_writes_the_same_folder_for_a_tilde(home):
    """Before, the files and lock went to ./~/dc (made 0755, never checked) while the check looked at
    $HOME/dc; and an existing $HOME/dc others could write to was not refused."""
    files = data_cache.cache_files("~/dc", "k")
    assert files.lock == home / "dc" / ".lock_k" and files.meta.parent == home / "dc"
    (home / "dc").mkdir()
    (home / "dc").chmod(0o777)
    with pytest.raises(UserError, match=f"--data_output_path {home / 'dc'} is not safe to read"):
        data_cache.check_data_output_path("~/dc")
    assert not os.path.lexists("~")
