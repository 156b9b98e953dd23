"""A prompt that several dataset rows share, whose other fields differ (dschat.data.prompt_columns):
its tokens cannot tell which row a generated answer belongs to, so nothing may silently get the
first row's fields. ``--shared_prompt_fields refuse`` (the default) stops a reward function that names
such a field before any model loads, and an environment when it reads one; ``first`` gives the first
row's; a function taking ``**kwargs`` gets the first row's either way, with one note."""
from __future__ import annotations

import pytest
import torch

from dschat.data.prompt_columns import PromptColumns, PromptRow, load_prompt_columns
from dschat.envs import EpisodeBatch, load_environment
from dschat.errors import UserError
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.rewards import columns_taken, load_reward_function

from helpers.data import write_jsonl
from helpers.step3 import base_argv, refused_in_process

GUESS = "Guess my number."
SHARED = r"the prompt 'Guess my number\.' is in 12 rows whose 'secret' differ"


@pytest.fixture(scope="module")
def tok():
    return load_hf_tokenizer("tiny-opt")


@pytest.fixture(scope="module")
def columns(tmp_path_factory, tok) -> PromptColumns:
    """Ten rows of one guessing-game prompt with their own secrets (two more in eval), a prompt asked
    twice with the same fields, and ten ordinary prompts."""
    folder = tmp_path_factory.mktemp("guess")
    rows = ([{"prompt": GUESS, "chosen": "5", "secret": i} for i in range(10)]
            + [{"prompt": "Say hi.", "chosen": "hi", "secret": 0}] * 2
            + [{"prompt": f"Q{i}?", "chosen": f"A{i}.", "secret": i} for i in range(10)])
    write_jsonl(folder / "train.jsonl", rows)
    write_jsonl(folder / "eval.jsonl", [{"prompt": GUESS, "chosen": "5", "secret": 10 + i} for i in range(2)])
    return load_prompt_columns([str(folder)], "0,0,1", 1234, str(tmp_path_factory.mktemp("out")), -1, tok)


def batch_of(tok, *texts: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """A left-padded batch of ``texts``' token ids, as the phase-3 loader gives it."""
    ids = tok(list(texts))["input_ids"]
    width = max(map(len, ids)) + 1
    prompts = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    return prompts, mask, list(texts)


def test_only_a_prompt_whose_rows_differ_is_shared(columns):
    assert len(columns.shared) == 1
    (shared,) = columns.shared.values()
    assert (shared.text, shared.rows, shared.fields) == (GUESS, 12, frozenset({"secret"}))
    assert columns.shared_fields() == {"secret"}


def test_an_environment_reading_a_shared_field_gets_one_line_naming_it_and_the_fix(columns, tok):
    guess, hi, q3 = columns.rows_for_batch(*batch_of(tok, GUESS, "Say hi.", "Q3?"))
    assert isinstance(guess, PromptRow) and "secret" not in guess and guess["chosen"] == "5"
    assert guess.get("no such field", 7) == 7
    for read in (lambda row: row["secret"], lambda row: row.get("secret"), lambda row: row.copy()["secret"]):
        with pytest.raises(UserError, match=SHARED + r".*make each prompt distinct"):
            read(guess)
    with pytest.raises(KeyError):
        guess["no such field"]
    assert (hi["secret"], q3["secret"]) == (0, 3)  # asked twice with the same fields: not shared
    # Through the environment's factory (it gets a copy of the row), the line is the run's line.
    with pytest.raises(UserError, match=SHARED):
        EpisodeBatch(load_environment("env_fixtures:reads_secret"), [q3, guess], max_turns=1)
    assert EpisodeBatch(load_environment("env_fixtures:reads_secret"), [q3, hi], max_turns=1).states


def test_first_gives_the_first_rows_fields(columns, tok):
    columns.refuse = False
    try:
        (guess,) = columns.rows_for_batch(*batch_of(tok, GUESS))
        # the first in phase-3 order (the split shuffles the rows)
        assert guess["secret"] == columns.for_batch(*batch_of(tok, GUESS))["secret"][0] in range(12)
    finally:
        columns.refuse = True


def test_a_function_naming_a_shared_field_is_refused_one_taking_kwargs_gets_the_first_rows(columns, tok):
    named = load_reward_function("reward_fixtures:chosen_overlap")
    kwargs = load_reward_function("reward_fixtures:seen_columns")
    assert columns_taken([named, kwargs]) == (frozenset({"chosen"}), True)
    # Functions taking **kwargs that say what they read (columns_read): the built-ins and --reward_url.
    from dschat.remote_reward import remote_reward_function
    builtins = [load_reward_function("dschat.rewards:gold"), load_reward_function("dschat.rewards:math_exact_match"),
                remote_reward_function("http://127.0.0.1:1/get_reward")]
    assert columns_taken(builtins) == (frozenset({"answer"}), False)
    columns.refuse_shared(columns_taken([named])[0])  # 'chosen' is the same in the guessing rows
    with pytest.raises(UserError, match=SHARED):
        columns.refuse_shared({"chosen", "secret"})
    first, q3 = columns.for_batch(*batch_of(tok, GUESS, "Q3?"))["secret"]
    assert first in range(12) and q3 == 3
    assert columns.shared_notice("they get the first such row's") == (
        "note: the data has 1 prompt(s) that several rows share, with differing 'secret'; a prompt's row is "
        "found by its tokens, so they get the first such row's")


@pytest.mark.parametrize("flags", [("--reward_fn", "reward_fixtures:chosen_overlap"),
                                   ("--eval_interval", "1", "--eval_judge", "reward_fixtures:chosen_overlap")])
def test_step3_refuses_a_function_naming_a_shared_field_before_any_model(capsys, monkeypatch, critic_dirs, data_cache,
                                                                        flags):
    """The embedded data asks a prompt several times with other answer pairs: a reward or judge
    function that names ``chosen`` is refused (exit 2) unless --shared_prompt_fields first."""
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine

    def no_engines(*args, **kwargs):
        raise AssertionError("the engines were built before the refusal")

    monkeypatch.setattr(DeepSpeedRLHFEngine, "__init__", no_engines)
    line = refused_in_process(base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, *flags), capsys)
    assert "rows whose 'chosen' differ" in line and "make each prompt distinct" in line


def test_field_values_are_the_same_when_equal_or_both_nan():
    import numpy as np

    from dschat.data.prompt_columns import _ABSENT, _same
    assert _same(1, 1.0) and _same("a", "a") and _same(float("nan"), float("nan"))
    assert _same(np.float32("nan"), float("nan")) and _same([1, 2], [1, 2])
    assert not _same(1, 2) and not _same(float("nan"), 1.0) and not _same(None, 0)
    assert not _same(np.array([1, 2]), np.array([1, 2]))  # no plain bool: counted as different
    assert _same(_ABSENT, _ABSENT) and not _same(_ABSENT, None)


def test_the_evaluation_built_without_step3s_main_refuses_a_judge_reading_a_shared_field(tmp_path, tok):
    """StepThreeEvaluation from Python, with a trainer that has no columns: it loads them itself and
    refuses the same judge step 3's main refuses."""
    from types import SimpleNamespace

    from dschat.rlhf.heldout import evaluation as ev
    from dschat.rlhf.heldout.setup import Judge
    args = SimpleNamespace(eval_interval=1, data_path=["dschat/builtin"], data_split="2,4,4", seed=1234,
                           data_output_path=str(tmp_path), local_rank=-1, output_dir=None)
    trainer = SimpleNamespace(prompt_columns=None, tokenizer=tok, device="cpu",
                              rlhf_engine=SimpleNamespace(actor=object(), critic=None, actor_ema=None))
    with pytest.raises(UserError, match="rows whose 'chosen' differ"):
        ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=load_reward_function("reward_fixtures:chosen_overlap"))])
    gold = Judge("gold", fn=load_reward_function("dschat.rewards:gold"))  # reads no column
    assert ev.StepThreeEvaluation(args, trainer, [], [gold]).enabled
