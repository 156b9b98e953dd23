"""Steps 1, 2 and DPO refuse a ``--max_seq_len`` the model's position table or the chosen/rejected
pairs cannot take: one line, exit 2, before distributed start-up, any data or any weight."""
from __future__ import annotations

import pytest

from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.training.step_data import check_seq_len_fits_positions

from helpers.steps import base_argv, load_script

STEPS = ("step1", "step2", "dpo")


def started_nothing(monkeypatch, script):
    """Make distributed start-up and the data preamble fail the test: the refusal comes before them."""

    def fail(*args, **kwargs):
        raise AssertionError("the run started before its flags were checked")

    monkeypatch.setattr(script, "setup_run", fail)
    monkeypatch.setattr(script, "build_step_data", fail)


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def refused_before_start_up(step: str, model: str, max_seq_len: int, tmp_path, monkeypatch, capsys) -> list[str]:
    """The error lines of ``step`` on ``model`` with ``--max_seq_len``, which must stop it (exit 2)
    before distributed start-up and the data."""
    script = load_script(step)
    started_nothing(monkeypatch, script)
    argv = base_argv(model, tmp_path / "data", "--output_dir", str(tmp_path / "out"), max_seq_len=max_seq_len)
    assert cli_main(script.main, argv) == EXIT_USAGE
    return error_lines(capsys)


@pytest.mark.parametrize("step", STEPS)
def test_max_seq_len_past_a_learned_position_table_is_one_line(step, tmp_path, monkeypatch, capsys):
    """tiny-opt has 512 learned positions: --max_seq_len 1024 would be an IndexError at the first
    long batch (the first evaluation); it is refused from the config alone."""
    assert refused_before_start_up(step, "tiny-opt", 1024, tmp_path, monkeypatch, capsys) == [
        "error: --max_seq_len 1024 is longer than tiny-opt can read: its opt position embeddings have 512 "
        "positions, and a longer row would index past them; pass --max_seq_len 512 or less"]


@pytest.mark.parametrize("step", ["step2", "dpo"])
def test_pairs_need_two_positions(step, tmp_path, monkeypatch, capsys):
    """One position holds the shared first token only: no pair could be compared."""
    assert refused_before_start_up(step, "tiny-llama", 1, tmp_path, monkeypatch, capsys) == [
        "error: --max_seq_len must be at least 2 for chosen/rejected pairs (a shared first token and one to "
        "compare them at), got 1; pass --max_seq_len 2 or more"]


def save_config(folder, config):
    config.save_pretrained(str(folder))
    return str(folder)


def test_position_limits_by_family(tmp_path):
    """Learned tables (OPT, GPT-2, GPT-Neo) are the limit, up to and including their size; rotary and
    ALiBi families (Llama, BLOOM) run longer sequences and are never refused."""
    import transformers

    check_seq_len_fits_positions("tiny-opt", 512)
    with pytest.raises(UserError, match="--max_seq_len 513 is longer than tiny-opt"):
        check_seq_len_fits_positions("tiny-opt", 513)
    gpt2 = save_config(tmp_path / "gpt2", transformers.GPT2Config(n_positions=64))
    check_seq_len_fits_positions(gpt2, 64)
    with pytest.raises(UserError, match="its gpt2 position embeddings have 64 positions"):
        check_seq_len_fits_positions(gpt2, 65)
    neo = save_config(tmp_path / "neo", transformers.GPTNeoConfig(max_position_embeddings=128))
    with pytest.raises(UserError, match="its gpt_neo position embeddings have 128 positions"):
        check_seq_len_fits_positions(neo, 129)
    for family, config in (("gptj", transformers.GPTJConfig(n_positions=32)),  # a table of rotary sin/cos
                           ("codegen", transformers.CodeGenConfig(n_positions=32))):
        folder = save_config(tmp_path / family, config)
        check_seq_len_fits_positions(folder, 32)
        with pytest.raises(UserError, match=f"its {family} position embeddings have 32 positions"):
            check_seq_len_fits_positions(folder, 33)
    check_seq_len_fits_positions("tiny-llama", 4096)  # 512 rotary positions in its config
    bloom = save_config(tmp_path / "bloom", transformers.BloomConfig())
    check_seq_len_fits_positions(bloom, 100_000)


def test_step3_checks_every_model_that_reads_the_actors_ids(tmp_path):
    """A whole rollout (prompt + answer) must fit the critic's and the reward model's position
    tables when they read the actor's token ids: a critic-free run's reward model too. A critic that
    starts from the actor, and a reward model of another tokenizer, are not checked against theirs."""
    import argparse
    import re

    import transformers

    from dschat.rlhf.rlhf_engine import ModelSources

    from helpers.step3 import step3_main

    check_readers = step3_main().check_readers
    short = save_config(tmp_path / "short", transformers.GPT2Config(n_positions=64))
    args = argparse.Namespace(max_prompt_seq_len=48, max_answer_seq_len=32)  # 80 > 64
    line = re.escape("--max_prompt_seq_len + --max_answer_seq_len 80 is longer than")
    with pytest.raises(UserError, match=line):  # a critic-free run's reward model
        check_readers(args, ModelSources(None, short), critic=False, reward_model=True)
    with pytest.raises(UserError, match=line):  # PPO's critic
        check_readers(args, ModelSources(short, "tiny-llama"), critic=True, reward_model=True)
    check_readers(args, ModelSources(short, short), critic=False, reward_model=False)  # neither is loaded
    check_readers(args, ModelSources("tiny-llama", short, critic_from_actor=True, reward_tokenizer=object()),
                  critic=True, reward_model=True)


@pytest.mark.parametrize("flag", ["--output_dir", "--data_output_path", "--model_name_or_path", "--data_path"])
@pytest.mark.parametrize("too_long", ["one name", "in all"])
def test_a_path_with_a_name_too_long_for_the_file_system_is_one_line(flag, too_long, tmp_path, monkeypatch, capsys):
    """A folder name of 300 bytes in a path flag, or 20 names of 250 bytes (5000 in all): Python's
    ``Path.exists`` raises ENAMETOOLONG rather than answer False, which was a traceback (exit 1) from
    whichever check met it first. The line shows the path's ends, not all 5000 bytes."""
    long = tmp_path / ("c" * 300) if too_long == "one name" else tmp_path.joinpath(*["d" * 250] * 20)
    script = load_script("step1")
    started_nothing(monkeypatch, script)
    argv = base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(tmp_path / "out"))
    argv[argv.index(flag) + 1] = str(long / "x.jsonl") if flag == "--data_path" else str(long)
    assert cli_main(script.main, argv) == EXIT_USAGE
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"error: {str(long)[:100]}...") and lines[0].endswith(
        "has a name longer than the file system allows (File name too long: a file or folder name of more than "
        "255 bytes in it, or more than 4096 bytes in all); pass a shorter path") and len(lines[0]) < 400, lines
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing made


@pytest.mark.parametrize("step", ["step1", "step2", "dpo"])
def test_more_accumulation_than_the_runs_micro_batches_is_one_line(step, tmp_path, capsys):
    """DeepSpeed steps the optimizer every --gradient_accumulation_steps micro-batches: with more than
    the run has, no step was taken, and the step saved the untrained model with exit code 0."""
    out = tmp_path / "out"
    argv = base_argv("tiny-opt", tmp_path / "data", "--output_dir", str(out), "--gradient_accumulation_steps",
                     "10000", max_train_steps=0)
    code = cli_main(load_script(step).main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == EXIT_USAGE and "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("error: --gradient_accumulation_steps 10000 is more than the run's ")
    assert "epoch(s)): no optimizer step would be taken, and the untrained model saved; give at most" in lines[0]
    assert not (out / "config.json").exists()


def test_accumulation_up_to_the_runs_micro_batches_is_planned():
    from dschat.training.engine_setup import plan_optimizer_steps

    assert plan_optimizer_steps(38, 1, 38) == 1 and plan_optimizer_steps(19, 2, 38) == 2  # accumulates across epochs
    with pytest.raises(UserError, match=r"^--gradient_accumulation_steps 39 is more than the run's 38 micro-batches "
                                        r"\(19 per epoch x 2 epoch\(s\)\)"):
        plan_optimizer_steps(19, 2, 39)
    assert plan_optimizer_steps(0, 1, 4) == 0  # no data: said elsewhere
