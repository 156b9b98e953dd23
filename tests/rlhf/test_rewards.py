"""Reward functions (dschat.rewards): loading by spec, columns, validation, weights, built-ins."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import reward_fixtures
from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.gold_judge import gold_score
from dschat.rewards import (RewardFunction, RewardMix, final_number, gold, load_reward_function,
                            load_reward_functions, math_exact_match, reward_model_weight)
from dschat.rlhf.heldout.setup import check_eval_args

from helpers.step3 import step3_main

PROMPTS = ["Human: q0 Assistant:", "Human: q1 Assistant:", "Human: q2 Assistant:"]
ANSWERS = ["one two", "fine boom here", "x"]


class TestLoading:
    def test_builtin_specs(self):
        assert load_reward_function("dschat.rewards:gold").fn is gold
        f = load_reward_function("dschat.rewards:math_exact_match", 0.5)
        assert (f.name, f.weight) == ("dschat.rewards:math_exact_match", 0.5)

    @pytest.mark.parametrize("spec, words", [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("dschat.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
        ("dschat.rewards", "not of the form module.path:function"),
        ("reward_fixtures:NOT_CALLABLE", "not a function"),
    ])
    def test_bad_spec_is_one_line_exit_2(self, spec, words, capsys):
        with pytest.raises(UserError, match=words):
            load_reward_function(spec)
        assert cli_main(lambda argv: load_reward_function(spec), []) == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --reward_fn")

    def test_module_that_exits_at_import_is_one_line_exit_2(self, tmp_path, monkeypatch, capsys):
        """A module whose top level parses its own command line (argparse) exits while it imports: one
        line naming the flag and the module, exit 2, instead of the process exiting on argparse's word."""
        (tmp_path / "exits_at_import_mod.py").write_text(
            "import argparse\nargparse.ArgumentParser().parse_args(['--no_such_flag'])\ndef fn(p, a): return []\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        spec = "exits_at_import_mod:fn"
        with pytest.raises(UserError, match=r"--reward_fn exits_at_import_mod:fn: importing module "
                                            r"'exits_at_import_mod' called sys.exit\(2\); move"):
            load_reward_function(spec)
        capsys.readouterr()
        assert cli_main(lambda argv: load_reward_function(spec), []) == EXIT_USAGE
        # argparse prints its own complaint before it exits; the run's last word is the one line.
        assert capsys.readouterr().err.splitlines()[-1].startswith("error: --reward_fn exits_at_import_mod:fn: ")

    def test_weights_one_per_function_or_none(self):
        fns = load_reward_functions(["dschat.rewards:gold", "reward_fixtures:length"], [2.0, -1.0])
        assert [f.weight for f in fns] == [2.0, -1.0]
        assert [f.weight for f in load_reward_functions(["dschat.rewards:gold"])] == [1.0]
        with pytest.raises(UserError, match="1 --reward_fn_weight for 2 --reward_fn"):
            load_reward_functions(["dschat.rewards:gold", "reward_fixtures:length"], [2.0])


class TestCalling:
    def test_columns_given_as_the_function_accepts(self):
        cols = {"chosen": ["one", "fine here", "y"], "rejected": ["a", "b", "c"]}
        # Takes **columns: gets all of them.
        load_reward_function("reward_fixtures:seen_columns")(PROMPTS, ANSWERS, cols)
        assert reward_fixtures.seen_columns.last == ["chosen", "rejected"]
        # Names `chosen` only: "one two" has 1 of 2 words in "one" -> 0.5; "fine boom here" 2/3; "x" 0.
        got = load_reward_function("reward_fixtures:chosen_overlap")(PROMPTS, ANSWERS, cols)
        assert got == pytest.approx([0.5, 2 / 3, 0.0])
        # Takes no columns: called with two arguments.
        assert load_reward_function("reward_fixtures:length")(PROMPTS, ANSWERS, cols) == [0.2, 0.3, 0.1]
        # A dataset column named like the first two parameters is not passed: it would collide.
        clash = {**cols, "prompts": ["p"] * 3, "answers": ["a"] * 3}
        load_reward_function("reward_fixtures:seen_columns")(PROMPTS, ANSWERS, clash)
        assert reward_fixtures.seen_columns.last == ["chosen", "rejected"]

    def test_raising_function_names_the_row(self):
        f = load_reward_function("reward_fixtures:raises_on_boom")
        with pytest.raises(UserError) as err:
            f(PROMPTS, ANSWERS)
        msg = str(err.value)
        assert "reward function reward_fixtures:raises_on_boom raised RuntimeError: cannot score this" in msg
        assert "on row 1 (prompt 'Human: q1 Assistant:', answer 'fine boom here')" in msg
        assert "\n" not in msg

    def test_an_exception_that_cannot_be_printed_is_still_one_line(self):
        """Its own ``__str__`` raising was a traceback out of the error line's f-string."""
        with pytest.raises(UserError, match=r"^reward function reward_fixtures:raises_unprintable raised Unprintable "
                                            r"\(its str\(\) raised\) on row 0 "):
            load_reward_function("reward_fixtures:raises_unprintable")(PROMPTS, ANSWERS)

    def test_wrong_length(self):
        with pytest.raises(UserError, match="reward_fixtures:one_short returned 2 scores for 3 answers"):
            load_reward_function("reward_fixtures:one_short")(PROMPTS, ANSWERS)

    def test_non_finite_names_the_row(self):
        with pytest.raises(UserError, match=r"reward_fixtures:nan_on_last returned nan for row 2 .*answer 'x'"):
            load_reward_function("reward_fixtures:nan_on_last")(PROMPTS, ANSWERS)
        bad_type = RewardFunction("t:none", lambda p, a: [None] * len(a))
        with pytest.raises(UserError, match="returned None for row 0"):
            bad_type(PROMPTS, ANSWERS)


class TestBuiltins:
    def test_gold_is_the_gold_judge(self):
        p = "Human: Tell me about volcanoes. Assistant:"
        answers = ["Volcanoes are mountains where lava erupts, and I hope you enjoy learning about them!", "ugh"]
        assert gold([p, p], answers) == [gold_score(p, answers[0]), gold_score(p, answers[1])]

    @pytest.mark.parametrize("text, number", [
        ("so the total is 1,234.50 apples", "1234.5"), ("#### 42", "42"), ("7.0", "7"),
        ("step 3 gives 5 then #### -12", "-12"), ("no digits", None), ("-0", "0"),
        # Equal numbers, equal forms: leading zeros, a bare fraction, zeros after the point.
        ("The answer is .5", "0.5"), ("-.50", "-0.5"), ("007", "7"), ("0.0", "0"), ("-0.00", "0"),
        ("100", "100"), ("1,000.", "1000"), ("12345678901234567890123456789012", "12345678901234567890123456789012"),
    ])
    def test_final_number(self, text, number):
        assert final_number(text) == number

    def test_math_exact_match(self):
        refs = ["Natalia sold 48/2 = 24 clips.\n#### 72", "5", "3"]
        answers = ["She sold 72 clips in all.", "The answer is 5.0", "It is 4"]
        assert math_exact_match(PROMPTS, answers, answer=refs) == [1.0, 1.0, 0.0]
        # Numerically equal forms match; numbers that differ in a late digit do not.
        refs = ["0.5", "#### 7", "12345678901234567890123456789012"]
        answers = ["The answer is .5", "It is 007", "12345678901234567890123456789013"]
        assert math_exact_match(PROMPTS, answers, answer=refs) == [1.0, 1.0, 0.0]
        with pytest.raises(UserError, match="column 'answer', which the prompt data lacks"):
            load_reward_function("dschat.rewards:math_exact_match")(PROMPTS, answers, {"chosen": refs})


class TestMix:
    def test_weighted_sum(self):
        # 2 x model + (-1) x length: model [1, 0, -1], length [0.2, 0.3, 0.1]
        # -> [2 - 0.2, 0 - 0.3, -2 - 0.1] = [1.8, -0.3, -2.1].
        mix = RewardMix((load_reward_function("reward_fixtures:length", -1.0),), model_weight=2.0)
        got = mix.score(PROMPTS, ANSWERS, None, torch.tensor([1.0, 0.0, -1.0]))
        torch.testing.assert_close(got, torch.tensor([1.8, -0.3, -2.1]))
        assert mix.describe() == "reward = 2 x reward model + -1 x reward_fixtures:length"

    def test_functions_alone(self):
        mix = RewardMix((load_reward_function("reward_fixtures:length"),), model_weight=0.0)
        assert not mix.uses_model
        torch.testing.assert_close(mix.score(PROMPTS, ANSWERS, None), torch.tensor([0.2, 0.3, 0.1]))
        with pytest.raises(ValueError, match="no model scores"):
            RewardMix(model_weight=1.0).score(PROMPTS, ANSWERS, None)

    def test_a_weight_times_a_finite_score_beyond_float32_is_one_line_naming_the_term(self):
        # length scores [0.2, 0.3, 0.1] x 2e38 = [4e37, 6e37, 2e37]: finite; x 3e38 -> 6e37 .. 9e37,
        # still finite; the model term 3e38 x [1, 0, -1]... is finite too, but the sum of 3e38 and
        # 6e37 is not. A weight of 3e38 on scores of 2 overflows in the term itself.
        big = RewardMix((load_reward_function("reward_fixtures:length", 3e38),), model_weight=3e38)
        with pytest.raises(UserError, match=r"each finite but their sum \(reward = 3e\+38 x reward model "
                                            r"\+ 3e\+38 x reward_fixtures:length\) is beyond"):
            big.score(PROMPTS, ANSWERS, None, torch.tensor([1.0, 0.0, -1.0]))
        with pytest.raises(UserError, match=r"reward term 3e\+38 x reward model: a score of 2 times its weight"):
            RewardMix(model_weight=3e38).score(PROMPTS, ANSWERS, None, torch.tensor([0.5, 2.0, 1.0]))
        fn = RewardMix((load_reward_function("reward_fixtures:length", 3e38),), model_weight=0.0)
        torch.testing.assert_close(fn.score(PROMPTS, ANSWERS, None), torch.tensor([6e37, 9e37, 3e37]))
        # A score that is already not finite (step 3's in-process reward_fn hook, a diverged reward
        # model) is the non-finite guard's to count: passed on, not refused here.
        got = RewardMix(model_weight=2.0).score(PROMPTS, ANSWERS, None, torch.tensor([float("inf"), 0.0, 1.0]))
        assert got[0].isinf() and got[1:].tolist() == [0.0, 2.0]

    def test_the_model_weight_default_is_decided_once_for_step_3_and_the_planner(self):
        from argparse import Namespace

        from dschat.plan.roles import reward_model_used
        assert reward_model_weight(None, other_terms=False) == 1.0
        assert reward_model_weight(None, other_terms=True) == 0.0  # not loaded beside functions
        assert reward_model_weight(0.5, other_terms=True) == 0.5
        assert reward_model_weight(0.0, other_terms=False) == 0.0
        flags = dict(reward_fn=None, reward_url=None, env=None, reward_model_weight=None)
        assert reward_model_used(Namespace(**flags))
        assert not reward_model_used(Namespace(**{**flags, "reward_url": "http://judge"}))
        assert reward_model_used(Namespace(**{**flags, "env": "dschat.envs_examples:Guess", "reward_model_weight": 2.0}))


def test_prompt_columns_of_the_builtin_data(tmp_path):
    """Each phase-3 prompt's other fields, looked up from a step-3 batch by its prompts' sources; the
    embedded data asks a prompt several times with other answer pairs, so without sources such a
    prompt is one line."""
    from dschat.data import builtin
    from dschat.data.collators import SOURCES_KEY, DataCollatorRLHF
    from dschat.data.prompt_columns import load_prompt_columns
    from dschat.data.prompt_dataset import create_prompt_dataset
    from dschat.errors import UserError
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer("tiny-opt")
    columns = load_prompt_columns(["dschat/builtin"], "2,4,4", 1234, str(tmp_path), -1, tok)
    train, _ = create_prompt_dataset(-1, ["dschat/builtin"], "2,4,4", str(tmp_path), 3, 1234, tok, 64)
    pairs = {}
    every = builtin.read_rows("train") + builtin.read_rows("eval")
    for r, key in zip(every, tok([r["prompt"] for r in every])["input_ids"]):
        pairs.setdefault(tuple(key), set()).add((r["chosen"], r["rejected"]))
    batch = DataCollatorRLHF(64)([train[i] for i in range(8)])
    prompts, mask = batch["prompt"], batch["prompt_att_mask"]
    ids = [tuple(row[m.bool()].tolist()) for row, m in zip(prompts, mask)]
    texts = [tok.decode(r) for r in ids]
    got = columns.for_batch(prompts, mask, texts, batch[SOURCES_KEY])
    assert "chosen" in got and "rejected" in got and "prompt" not in got
    for i, row in enumerate(ids):
        assert (got["chosen"][i], got["rejected"][i]) in pairs[row]
    shared = next(i for i, row in enumerate(ids) if len(pairs[row]) > 1)
    with pytest.raises(UserError, match=r"rows whose 'chosen', 'rejected' differ.*pass the batch's 'prompt_sources'"):
        columns.for_batch(prompts[shared:shared + 1], mask[shared:shared + 1], texts[shared:shared + 1])
    with pytest.raises(UserError, match=r"is not in the phase-3 data"):
        columns.for_batch(prompts[:, -3:], mask[:, -3:], texts)


class TestUntrustedResults:
    """What a function returns or does is checked: no string read as digits, float32 finiteness, sys.exit,
    a timeout, and a bounded search for the failing row."""

    def test_a_string_or_bytes_result_is_refused(self):
        # "12" for two answers would read as [1.0, 2.0].
        with pytest.raises(UserError, match=r"reward_fixtures:returns_string returned str '12'.*, not a list of 2 "
                                            r"floats; return one number per answer"):
            load_reward_function("reward_fixtures:returns_string")(PROMPTS[:2], ANSWERS[:2])
        with pytest.raises(UserError, match="returned bytes"):
            RewardFunction("t:bytes", lambda p, a: b"\x01\x02")(PROMPTS[:2], ANSWERS[:2])
        with pytest.raises(UserError, match="returned dict"):  # list() of it would be its keys
            RewardFunction("t:dict", lambda p, a: {0: 1.0, 1: 2.0})(PROMPTS[:2], ANSWERS[:2])
        with pytest.raises(UserError, match=r"returned '0.5' for row 1"):
            RewardFunction("t:strs", lambda p, a: [1.0, "0.5", 2.0])(PROMPTS, ANSWERS)

    def test_finite_in_float64_but_not_in_float32_is_refused(self):
        with pytest.raises(UserError, match=r"beyond_float32 returned 1e\+39 for row 2 .*finite in float32"):
            load_reward_function("reward_fixtures:beyond_float32")(PROMPTS, ANSWERS)
        # The largest float32 still passes, and so does the in-process hook's inf (the non-finite guard's).
        assert RewardFunction("t:max", lambda p, a: [3.4e38] * 3)(PROMPTS, ANSWERS) == [3.4e38] * 3
        assert RewardFunction("t:hook", lambda p, a: [1e39] * 3, require_finite=False)(PROMPTS, ANSWERS) == [1e39] * 3

    def test_a_generator_function_is_read_inside_its_call_so_its_failures_and_time_are_the_calls(self):
        """A function written as a generator (or returning ``map(...)``) runs as its result is read: that
        reading is part of the call, named and bisected when it raises, and timed by the timeout."""
        def scores(prompts, answers):
            for answer in answers:
                yield 1.0 / (len(answer) - 1)  # "x" (row 2): ZeroDivisionError

        with pytest.raises(UserError, match=r"reward function t:gen raised ZeroDivisionError: .* on row 2 \(prompt"):
            RewardFunction("t:gen", scores)(PROMPTS, ANSWERS)
        assert RewardFunction("t:map", lambda p, a: map(len, a))(PROMPTS, ANSWERS) == [7.0, 14.0, 1.0]
        release = threading.Event()

        def slow(prompts, answers):
            release.wait(60)
            yield from [0.0] * len(answers)

        try:
            with pytest.raises(UserError, match=r"t:slow did not return within --reward_fn_timeout 0.2 s"):
                RewardFunction("t:slow", slow, timeout=0.2)(PROMPTS, ANSWERS)
        finally:
            release.set()

    def test_sys_exit_is_a_failure_naming_the_function_and_is_not_called_again(self, capsys):
        reward_fixtures.exits.calls = 0
        fn = load_reward_function("reward_fixtures:exits")
        with pytest.raises(UserError, match=r"reward function reward_fixtures:exits called sys.exit\(3\) on a batch "
                                            r"of 3 rows .*raise an exception or return scores instead"):
            fn(PROMPTS, ANSWERS)
        assert reward_fixtures.exits.calls == 1
        assert cli_main(lambda argv: fn(PROMPTS, ANSWERS), []) == EXIT_USAGE  # one line, exit 2
        assert capsys.readouterr().err.count("\n") == 1
        # In a worker thread too (--reward_fn_timeout).
        reward_fixtures.exits.calls = 0
        with pytest.raises(UserError, match=r"called sys.exit\(3\)"):
            load_reward_function("reward_fixtures:exits", timeout=30)(PROMPTS, ANSWERS)
        assert reward_fixtures.exits.calls == 1

    def test_a_sys_exit_value_is_shown_short_and_never_breaks_the_line(self):
        """``sys.exit`` with 5000 characters: 60 of them; with an object whose ``__repr__`` raises: its type
        (a traceback out of the error line before)."""
        import sys

        class Unshowable:
            def __repr__(self) -> str:
                raise RuntimeError("no repr")

        for code, shown in (("x" * 5000, "'" + "x" * 56 + "..."), (Unshowable(), "<a Unshowable>")):
            with pytest.raises(UserError) as err:
                RewardFunction("t:exits", lambda p, a, code=code: sys.exit(code))(PROMPTS, ANSWERS)
            assert str(err.value).startswith(f"reward function t:exits called sys.exit({shown}) on a batch of 3 rows")
            assert len(str(err.value)) < 300

    def test_a_call_past_the_timeout_stops_with_a_line_naming_the_function(self):
        release, calls = threading.Event(), []

        def stuck(prompts, answers):
            calls.append(len(answers))
            release.wait(60)
            return [0.0] * len(answers)

        fn = RewardFunction("judges:slow", stuck, timeout=0.2)
        start = time.monotonic()
        try:
            with pytest.raises(UserError, match=r"reward function judges:slow did not return within "
                                                r"--reward_fn_timeout 0.2 s on a batch of 3 rows .*raise "
                                                r"--reward_fn_timeout \(0: no limit\)"):
                fn(PROMPTS, ANSWERS)
        finally:
            release.set()
        assert time.monotonic() - start < 10
        assert calls == [3]  # never called again after the timeout
        # Within the time: the result, computed in the worker thread with the caller's grad mode.
        modes = []
        quick = RewardFunction("t:quick", lambda p, a: modes.append(torch.is_grad_enabled()) or [1.0] * len(a),
                               timeout=30)
        with torch.no_grad():
            assert quick(PROMPTS, ANSWERS) == [1.0, 1.0, 1.0]
        assert modes == [False]
        for bad in (-1, 1e10):  # 1e10: beyond what Python's waits take (an OverflowError at the first call)
            with pytest.raises(UserError, match="--reward_fn_timeout must be a number of seconds from 0 to 1e9"):
                load_reward_function("dschat.rewards:gold", timeout=bad)

    def test_the_failing_row_is_found_in_a_bounded_number_of_calls(self):
        calls = []

        def bad_row_40(prompts, answers):
            calls.append(len(answers))
            if "row 40" in answers:
                raise ValueError("cannot parse")
            return [0.0] * len(answers)

        prompts, answers = [f"q{i}" for i in range(64)], [f"row {i}" for i in range(64)]
        with pytest.raises(UserError, match=r"raised ValueError: cannot parse on row 40 \(prompt 'q40', answer "
                                            r"'row 40'\); fix the function"):
            RewardFunction("t:bad", bad_row_40)(prompts, answers)
        # The batch, then at most 2 probes per halving (log2 64 = 6): not 41 single-row calls.
        assert len(calls) <= 1 + 2 * 6 and calls[0] == 64
        calls.clear()

        def fails_on_pairs(prompts, answers):  # fails only with rows 0 and 63 together
            calls.append(len(answers))
            if "row 0" in answers and "row 63" in answers:
                raise ValueError("pair")
            return [0.0] * len(answers)

        with pytest.raises(UserError, match=r"on rows 0-63 of a batch of 64 \(no half of them fails alone"):
            RewardFunction("t:pairs", fails_on_pairs)(prompts, answers)
        assert calls == [64, 32, 32]

    def test_the_flag_reaches_reward_and_judge_functions(self):
        main = step3_main()
        argv = ["--data_path", "dschat/builtin", "--actor_model_name_or_path", "a", "--output_dir", "out",
                "--reward_fn", "reward_fixtures:length", "--eval_judge", "reward_fixtures:length"]
        default = main.parse_args(argv)
        assert default.reward_fn_timeout == 600.0
        args = main.parse_args([*argv, "--reward_fn_timeout", "2.5"])
        assert [f.timeout for f in main.reward_mix(args).functions] == [2.5]
        assert [j.fn.timeout for j in check_eval_args(args)] == [2.5]
        args = main.parse_args([*argv, "--reward_fn_timeout", "-1"])
        with pytest.raises(UserError, match="--reward_fn_timeout must be"):
            main.reward_mix(args)


def test_the_final_number_is_the_last_one_and_a_reference_without_one_scores_nothing():
    assert final_number("3 + 4 = 7") == "7"
    assert final_number("#### 3 then #### 7") == "7"
    assert math_exact_match(["q"], ["3 + 4 = 7"], answer=["7"]) == [1.0]
    assert math_exact_match(["q"], ["no idea"], answer=["n/a"]) == [0.0]


def test_the_reward_model_weight_rules_that_decide_loading_it():
    """An --env run without --reward_model_weight loads no reward model (the planner and the guards
    ask reward_model_used); a negative weight is a weight: the model loads and its score counts."""
    from argparse import Namespace

    from dschat.rewards import reward_model_used

    flags = dict(reward_fn=None, reward_url=None, env=None, reward_model_weight=None)
    assert reward_model_used(Namespace(**flags))
    assert not reward_model_used(Namespace(**{**flags, "env": "dschat.envs_examples:calculator"}))
    assert reward_model_used(Namespace(**{**flags, "env": "x:y", "reward_model_weight": -0.5}))
    mix = RewardMix(model_weight=-0.5)
    assert mix.uses_model and mix.score(["p"], ["a"], None, torch.tensor([2.0])).tolist() == [-1.0]
