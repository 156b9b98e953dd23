"""``python -m dschat.data.prepare`` end to end, bad input included; and the shared data flags."""
from __future__ import annotations

import argparse
import json

import pytest

from dschat.cli.shared import add_data_args
from dschat.cli.step3 import add_unsupervised_data_args

from helpers.data import files_in, pref_rows, run_prepare, save_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


def args_for(tok_dir, out, *data, phase=1, split="2,4,4", extra=()):
    return ["--data_path", *data, "--data_split", split, "--data_output_path", str(out),
            "--model_name_or_path", str(tok_dir), "--train_phase", str(phase), "--max_seq_len", "64", *extra]


def assert_one_line_error(result, *needles, out=None):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    if out is not None:
        assert files_in(out) == []


def test_prepare_builds_then_hits(tok_dir, tmp_path, capsys):
    # In-process (the subprocess tests below cover the `python -m` entry point).
    from dschat.data.prepare import main
    from dschat.errors import cli_main

    out = tmp_path / "cache"
    assert cli_main(main, args_for(tok_dir, out, "dschat/builtin", phase=3)) == 0
    first = capsys.readouterr().out
    assert "Creating prompt dataset" in first
    summary = first.strip().splitlines()[-1]
    # builtin: 3000 train / 300 eval rows; "2,4,4" gives phase 3 1200 / 120 of them.
    assert summary.startswith("phase 3: train=1200 eval=120, filtered train=0 eval=0; cache ")
    meta = [n for n in files_in(out) if n.startswith("meta_")]
    assert len(meta) == 1 and json.loads((out / meta[0]).read_text())["train"]["size"] == 1200
    assert cli_main(main, args_for(tok_dir, out, "dschat/builtin", phase=3)) == 0
    second = capsys.readouterr().out
    assert "Creating prompt dataset" not in second and second.strip().splitlines()[-1] == summary
    # --rebuild_data_cache rebuilds.
    assert cli_main(main, args_for(tok_dir, out, "dschat/builtin", phase=3, extra=["--rebuild_data_cache"])) == 0
    assert "Creating prompt dataset" in capsys.readouterr().out


@pytest.mark.parametrize("phase", [1, 2, 3])
def test_prepare_with_defaults_builds_the_cache_the_step_reads(tok_dir, tmp_path, capsys, monkeypatch, phase):
    """With no length flag, prepare builds the cache key the step computes with its own defaults
    (step 3 reads --max_prompt_seq_len, 256), so the step's own data code finds the cache and builds nothing."""
    from dschat.data import prompt_dataset
    from dschat.data.prepare import main
    from dschat.errors import cli_main

    out = tmp_path / "cache"
    data = ["--data_path", "dschat/builtin", "--data_output_path", str(out)]
    assert cli_main(main, [*data, "--model_name_or_path", str(tok_dir), "--train_phase", str(phase)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    prepared = summary.rsplit("traindata_", 1)[1].removesuffix(".safetensors")

    def build(*args, **kwargs):
        raise AssertionError("the step built its data instead of reading the prepared cache")

    monkeypatch.setattr(prompt_dataset, "_build_datasets", build)
    if phase == 3:  # as step 3's main: its tokenizer, batch plan and create_datasets
        from dschat.rlhf.config import step3_config
        from dschat.training.step_data import load_tokenizer
        from helpers.step3 import step3_main

        step3 = step3_main()
        args = step3.parse_args([*data, "--actor_model_name_or_path", str(tok_dir)])
        tokenizer = load_tokenizer(args.actor_model_name_or_path, args.add_eot_token)
        loader, _, _ = step3.create_datasets(args, tokenizer, step3_config(args, 1).batches, -1)
    else:  # as steps 1 and 2's mains: build_step_data
        from dschat.training.step_data import build_step_data
        from helpers.steps import load_script

        args = load_script(f"step{phase}").parse_args([*data, "--model_name_or_path", str(tok_dir)])
        loader = build_step_data(args, -1, phase=phase, collator=None).train_loader
    assert loader.dataset.cache_key == prepared
    assert "Creating prompt dataset" not in capsys.readouterr().out


def test_unknown_dataset(tok_dir, tmp_path):
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", "someone/unknown"))
    assert_one_line_error(result, "unknown dataset 'someone/unknown'", "Dahoas/rm-static", "dschat/builtin", out=tmp_path / "cache")


def test_unknown_dataset_debug_shows_traceback(tok_dir, tmp_path):
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", "someone/unknown", extra=["--debug"]))
    assert result.returncode != 0 and "Traceback" in result.stderr and "UserError" in result.stderr


def test_missing_file(tok_dir, tmp_path):
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", str(tmp_path / "nope.jsonl")))
    assert_one_line_error(result, "nope.jsonl", "does not exist", out=tmp_path / "cache")


def test_malformed_json(tok_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(pref_rows(1)[0]) + "\n{not json}\n", encoding="utf-8")
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", str(bad)))
    assert_one_line_error(result, f"{bad}:2: malformed JSON", out=tmp_path / "cache")


def test_missing_fields(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "p", "answer": "a"}])
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", str(path)))
    assert_one_line_error(result, f"{path}:1: missing field 'chosen'", out=tmp_path / "cache")


def test_empty_phase(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", pref_rows(30))
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", str(path), phase=2, split="10,0,0"))
    assert_one_line_error(result, "phase 2, train split is empty", "rows.jsonl", out=tmp_path / "cache")


@pytest.mark.parametrize("phase", [1, 2])
def test_a_tokenizer_without_eos_is_one_line_naming_the_flag(tmp_path, phase):
    """Phases 1-2 end every text with --end_of_conversation_token, by default the tokenizer's EOS, as the
    steps do (a tokenizer without one was a TypeError traceback); phase 3 appends nothing."""
    folder = save_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "rows.jsonl", pref_rows(30))
    result = run_prepare(args_for(folder, tmp_path / "cache", str(path), phase=phase))
    assert_one_line_error(result, "has no EOS token; pass --end_of_conversation_token")
    assert not (tmp_path / "cache").exists()
    fixed = run_prepare(args_for(folder, tmp_path / "cache", str(path), phase=phase,
                                 extra=("--end_of_conversation_token", "</s>")))
    assert fixed.returncode == 0, fixed.stderr


def test_bad_data_split(tok_dir, tmp_path):
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", "dschat/builtin", split="1,2"))
    assert_one_line_error(result, "--data_split '1,2'", out=tmp_path / "cache")


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_a_seed_numpy_cannot_take_is_the_steps_line(tok_dir, tmp_path, seed):
    """As the step scripts (a NumPy traceback before)."""
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", "dschat/builtin", extra=("--seed", seed)))
    assert_one_line_error(result, f"--seed must be from 0 to 4294967295 (2**32 - 1), got {seed}", out=tmp_path / "cache")


def test_an_empty_data_path_names_itself(tok_dir, tmp_path):
    """Not "phase 1 eval split is empty for --data_path", which sent the user to the split."""
    result = run_prepare(args_for(tok_dir, tmp_path / "cache"))
    assert_one_line_error(result, "--data_path is empty; name at least one dataset", out=tmp_path / "cache")


def test_missing_model_path(tmp_path):
    result = run_prepare(args_for(tmp_path / "no-model", tmp_path / "cache", "dschat/builtin"))
    assert_one_line_error(result, "no-model", "does not exist", out=tmp_path / "cache")


def test_a_length_the_model_cannot_read_is_refused_before_any_cache_is_built(tmp_path):
    """--max_seq_len past an OPT model's position table: the step would refuse it, so the cache
    would never be read; one line, nothing written. A tokenizer-only folder has no table to check."""
    from dschat.models.registry import resolve_model_path

    result = run_prepare(args_for(resolve_model_path("tiny-opt"), tmp_path / "cache", "dschat/builtin",
                                  extra=["--max_seq_len", "100000"]))
    assert_one_line_error(result, "--max_seq_len 100000 is longer than", "pass --max_seq_len 512 or less")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("phase, rule", [(1, "at least 2 for step 1"), (2, "at least 2 for chosen/rejected pairs")])
def test_a_length_of_one_is_refused_as_the_step_refuses_it(phase, rule, tok_dir, tmp_path):
    """--max_seq_len 1 cannot hold a step-1 row or a step-2 pair: refused as the steps refuse it
    (phase 2 named the data and the tokenizer, after dropping every pair; phase 1 wrote a cache step
    1 would refuse). Phase 3's prompts may be one token."""
    result = run_prepare(args_for(tok_dir, tmp_path / "cache", "dschat/builtin", phase=phase,
                                  extra=["--max_seq_len", "1"]))
    assert_one_line_error(result, f"--max_seq_len must be {rule}", out=tmp_path / "cache")


# --- flags -----------------------------------------------------------------------------------


def parse(phase, *argv):
    parser = argparse.ArgumentParser()
    add_data_args(parser, phase=phase)
    return parser.parse_args(list(argv))


def test_data_flags_defaults_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(tmp_path / "cache"))
    private = str(tmp_path / "cache" / "data_files")  # upstream: /tmp/data_files, shared by every user
    one = parse(1)
    assert one.data_path == ["Dahoas/rm-static"] and one.data_split == "2,4,4"
    assert one.sft_only_data_path == [] and one.data_output_path == private
    assert one.rebuild_data_cache is False
    two = parse(2)
    assert not hasattr(two, "sft_only_data_path") and two.data_output_path == private
    three = parse(3)
    assert three.data_output_path == private
    assert parse(1, "--data_path", "a", "b", "--sft_only_data_path", "c").data_path == ["a", "b"]
    with pytest.raises(SystemExit):
        parse(3, "--sft_only_data_path", "x")


def test_unsupervised_flags():
    parser = argparse.ArgumentParser()
    add_unsupervised_data_args(parser)
    args = parser.parse_args([])
    assert (args.unsupervised_dataset_name, args.unsupervised_dataset_config_name, args.preprocessing_num_workers) == (None, None, None)
    help_text = parser.format_help()
    assert "--unsupervised_dataset_name" in help_text and "%" not in help_text.replace("%%", "")
