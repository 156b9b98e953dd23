"""Environments for multi-turn rollouts (dschat.envs) and the examples (dschat.envs_examples): the calculator
and the word game."""
from __future__ import annotations

import math
import time

import pytest
from transformers import AutoTokenizer

from dschat.envs import EpisodeBatch, EpisodeState, StepResult, load_environment, render_observation
from dschat.envs_examples import Calculator, calculator, evaluate, word_game, words_of
from dschat.errors import EXIT_USAGE, UserError, cli_main
from dschat.models.embedded import materialize_smollm2

from env_fixtures import Tracker, scripted
from helpers.data import make_tokenizer

SCRIPTED = "env_fixtures:scripted"
OK = (None, None, False)


def batch(rows, spec=SCRIPTED, max_turns=4, timeout=0.0, row_ids=None) -> EpisodeBatch:
    return EpisodeBatch(load_environment(spec, timeout), rows, max_turns, row_ids)


def one_line_exit_2(call, capsys) -> str:
    """``call`` stops with one ``error:`` line and exit code 2 through the CLI's error path; the line."""
    assert cli_main(lambda argv: call(), []) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


class TestLoading:
    def test_the_example_loads(self):
        env = load_environment("dschat.envs_examples:calculator", timeout=2)
        assert (env.name, env.factory, env.timeout) == ("dschat.envs_examples:calculator", calculator, 2.0)

    @pytest.mark.parametrize("spec, words", [
        ("env_fixtures", "not of the form module.path:function"),
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("env_fixtures:no_such_factory", "has no attribute 'no_such_factory'"),
        ("env_fixtures:NOT_CALLABLE", "not a function"),
    ])
    def test_bad_spec_is_one_line_naming_the_flag(self, spec, words, capsys):
        with pytest.raises(UserError, match=words):
            load_environment(spec)
        assert one_line_exit_2(lambda: load_environment(spec), capsys).startswith("error: --env ")

    @pytest.mark.parametrize("timeout", [-1, math.inf, math.nan, 1e10, "5", None, True])
    def test_bad_timeout(self, timeout):
        with pytest.raises(UserError, match="--env_timeout must be a number of seconds from 0 to 1e9"):
            load_environment(SCRIPTED, timeout)

    @pytest.mark.parametrize("max_turns", [0, -2, 1.5, True])
    def test_bad_max_turns(self, max_turns):
        with pytest.raises(UserError, match="--max_turns must be a whole number >= 1"):
            batch([{"result": OK}], max_turns=max_turns)

    def test_a_factory_without_step_names_the_row(self, capsys):
        err = one_line_exit_2(lambda: batch([{}, {}], spec="env_fixtures:no_step", row_ids=[7, 8]), capsys)
        assert "environment env_fixtures:no_step: the factory returned object on row 7" in err
        assert "step(answer) -> (observation, reward, done)" in err

    def test_a_step_lookup_that_raises_is_one_line(self, capsys):
        """A wrapper whose ``__getattr__`` raises KeyError (not AttributeError) for ``step``."""
        err = one_line_exit_2(lambda: batch([{}], spec="env_fixtures:step_lookup_raises"), capsys)
        assert ("environment env_fixtures:step_lookup_raises: looking up step on the Proxy the factory returned "
                "on row 0 raised KeyError: 'step'") in err

    def test_the_factory_gets_every_column(self):
        episodes = batch([{"result": OK, "answer": "42", "extra": [1, 2]}])
        assert episodes.envs[0].results == [OK]
        row = {"results": [OK], "tracker": Tracker(), "sleep": 0.0}
        assert scripted(row).tracker is row["tracker"]


class TestContract:
    def test_good_results_are_typed(self):
        rows = [{"result": ("text", 1, False)}, {"result": ({"role": "tool", "content": "42"}, None, True)},
                {"result": (None, 0.5, True)}]
        assert batch(rows).step(["a", "b", "c"]) == [
            StepResult("text", 1.0, False), StepResult({"role": "tool", "content": "42"}, None, True),
            StepResult(None, 0.5, True)]

    def test_numpy_rewards_and_done_flags_are_taken_as_python_numbers(self):
        import numpy as np

        from dschat.envs import _check_step

        result = _check_step("e", "row 0", ("x", np.float32(0.5), np.bool_(True)))
        assert (result.reward, result.done) == (0.5, True) and type(result.done) is bool
        assert _check_step("e", "row 0", (None, None, np.array(1) > 2)).done is False

    @pytest.mark.parametrize("result, words", [
        (["text", 1.0, True], "step returned list"),
        (("text", 1.0), "step returned a tuple of 2"),
        ("text", "step returned str"),
        ((3, 1.0, True), "observation int 3"),
        (({"role": "system", "content": "x"}, None, False), "'role': 'user' or 'tool'"),
        (({"role": "tool", "content": 42}, None, False), "'role': 'user' or 'tool'"),
        (({"role": "tool", "content": "x", "name": "calc"}, None, False), "'role': 'user' or 'tool'"),
        (({"content": "x"}, None, False), "'role': 'user' or 'tool'"),
        # Tool output decoded with errors="surrogateescape": a lone surrogate no tokenizer takes.
        (("bad \udcff bytes", None, False), "'\\udcff' at character 4 cannot be encoded as UTF-8"),
        (({"role": "tool", "content": "x\ud800"}, None, True), "'\\ud800' at character 1 cannot be encoded"),
        ((None, "1.0", True), "reward str '1.0'"),
        ((None, True, True), "reward bool True"),
        ((None, math.nan, True), "finite in float32"),
        ((None, 1e39, True), "finite in float32"),
        ((None, 10**400, True), "finite in float32"),  # an int beyond any float
        ((None, 10**5000, True), "finite in float32"),  # ... and beyond what repr() shows
        ((None, 1.0, 1), "done = int 1"),
        ((None, 1.0, None), "done = NoneType"),
    ])
    def test_a_wrong_result_is_one_line_naming_env_and_row(self, result, words, capsys):
        def after_a_good_turn() -> EpisodeBatch:
            rows = [{"result": OK}, {"result": OK}, {"results": [OK, result]}]
            episodes = batch(rows, row_ids=[10, 11, 12])
            episodes.step(["a", "b", "c"])
            return episodes

        with pytest.raises(UserError, match="environment env_fixtures:scripted on row 12 \\(turn 2\\)") as caught:
            after_a_good_turn().step(["a", "b", "c"])
        assert words in str(caught.value)
        episodes = after_a_good_turn()
        one_line_exit_2(lambda: episodes.step(["a", "b", "c"]), capsys)


class TestFailures:
    def test_an_environment_that_raises_names_env_row_turn_and_first_line(self, capsys):
        rows = [{"result": OK}, {"result": OK, "raises": (1, ValueError("bad tool\nTraceback-like detail"))}]
        episodes = batch(rows, row_ids=[3, 4])
        episodes.step(["a", "b"])
        with pytest.raises(UserError) as caught:
            episodes.step(["a", "b"])
        assert str(caught.value) == ("environment env_fixtures:scripted: step raised ValueError: bad tool on row 4 "
                                     "(turn 2); fix the environment")
        episodes.envs[1].answers.pop()
        episodes.states[1].turns = 1
        one_line_exit_2(lambda: episodes.step(["a", "b"]), capsys)

    def test_a_line_shows_the_rows_prompt_since_a_batch_index_names_no_data_row(self):
        """Step 3 passes the batch's rows, each with its ``prompt``: the line shows it, as a reward
        function's line does (with --num_generations K the batch repeats each prompt K times)."""
        rows = [{"prompt": "Human: Question number 23 about things. Assistant:", "result": OK,
                 "raises": (0, ValueError("cannot handle this one"))}]
        with pytest.raises(UserError) as caught:
            batch(rows).step(["a"])
        assert str(caught.value) == ("environment env_fixtures:scripted: step raised ValueError: cannot handle this one "
                                     "on row 0 (prompt 'Human: Question number 23 about things. Assistant:', turn 1); "
                                     "fix the environment")

    def test_what_was_raised_is_quoted_in_one_short_clear_line(self, capsys):
        """No message: "ValueError (no message)", not "ValueError: on row 0" (the place read as the
        message); a message of 100 000 characters: its first 200; an exception whose own ``__str__``
        raises: still the one line, exit 2 (a traceback, exit 1, before)."""
        class BadStr(Exception):
            def __str__(self) -> str:
                raise RuntimeError("no str")

        for error, quoted in ((ValueError(), "ValueError (no message)"),
                              (RuntimeError("x" * 100_000), "RuntimeError: " + "x" * 200 + "..."),
                              (BadStr(), "BadStr (its str() raised)")):
            episodes = batch([{"result": OK, "raises": (0, error)}])
            with pytest.raises(UserError) as caught:
                episodes.step(["a"])
            assert str(caught.value) == f"environment env_fixtures:scripted: step raised {quoted} on row 0 (turn 1); " \
                                        "fix the environment"
        one_line_exit_2(lambda: batch([{"result": OK, "raises": (0, BadStr())}]).step(["a"]), capsys)

    def test_a_user_error_of_the_environment_passes_as_it_is(self):
        episodes = batch([{"result": OK, "raises": (0, UserError("the sandbox needs --foo"))}])
        with pytest.raises(UserError, match="^the sandbox needs --foo$"):
            episodes.step(["a"])

    def test_sys_exit_in_the_factory(self, capsys):
        err = one_line_exit_2(lambda: batch([{}], spec="env_fixtures:exits"), capsys)
        assert "environment env_fixtures:exits: the factory called sys.exit(3) on row 0" in err

    def test_a_step_past_the_timeout_stops_without_waiting_for_it(self, capsys):
        # The slow row first, so it is the one the shared deadline runs out on, not a fast row starting late.
        rows = [{"result": OK, "sleep": 3.0}, {"result": OK}]
        episodes = batch(rows, timeout=0.2, row_ids=[5, 0])
        start = time.monotonic()
        with pytest.raises(UserError) as caught:
            episodes.step(["a", "b"])
        assert time.monotonic() - start < 2.0  # the 3 s call is left behind
        assert str(caught.value) == ("environment env_fixtures:scripted: step did not return within --env_timeout "
                                     "0.2 s on row 5 (turn 1); make it faster or raise --env_timeout (0: no limit)")

    def test_a_factory_past_the_timeout(self):
        with pytest.raises(UserError, match="the factory did not return within --env_timeout 0.2 s on row 1;"):
            batch([{"result": OK, "factory_sleep": 3.0}, {"result": OK, "factory_sleep": 0}],
                  spec="env_fixtures:slow_factory", timeout=0.2, row_ids=[1, 0])

    def test_no_timeout_waits(self):
        episodes = batch([{"result": (None, 1.0, True), "sleep": 0.3}], timeout=0)
        assert episodes.step(["a"]) == [StepResult(None, 1.0, True)]


class TestEpisodes:
    def test_steps_of_a_batch_overlap(self):
        tracker = Tracker()
        n = 6
        episodes = batch([{"result": OK, "sleep": 0.3, "tracker": tracker} for _ in range(n)], timeout=30)
        episodes.step(["a"] * n)
        assert tracker.calls == n and tracker.in_flight == 0
        assert tracker.most > 1  # calls were in flight together
        assert episodes.last_seconds >= 0.3 and episodes.total_seconds >= episodes.last_seconds

    def test_environment_time_adds_up(self):
        episodes = batch([{"result": OK, "sleep": 0.1}])
        made = episodes.total_seconds  # the factory's own call counts too
        assert made < 0.1  # the factory does not sleep
        episodes.step(["a"])
        first = episodes.last_seconds
        episodes.step(["a"])
        assert first >= 0.1 and episodes.last_seconds >= 0.1
        assert episodes.total_seconds == pytest.approx(made + first + episodes.last_seconds)

    def test_turns_rewards_done_and_the_cut_at_max_turns(self):
        tracker = Tracker()
        rows = [
            {"results": [("more", 0.5, False), (None, None, False), (None, 1.0, True)], "tracker": tracker},
            {"results": [("more", 0.25, False)], "tracker": tracker},  # never done
            {"results": [(None, 2.0, True)], "tracker": tracker},
        ]
        episodes = batch(rows, max_turns=3)
        assert episodes.step(["a", "b", "c"])[2] == StepResult(None, 2.0, True)
        second = episodes.step(["a", "b", None])  # a done episode's answer is ignored
        assert second[2] is None and second[1] == StepResult("more", 0.25, False)
        assert not episodes.done
        episodes.step(["a", "b", None])
        assert episodes.done and tracker.calls == 3 + 2 + 2
        assert episodes.states == [
            EpisodeState(row=0, max_turns=3, turns=3, reward=1.5, done=True, cut=False),
            EpisodeState(row=1, max_turns=3, turns=3, reward=0.75, done=True, cut=True),
            EpisodeState(row=2, max_turns=3, turns=1, reward=2.0, done=True, cut=False),
        ]
        assert episodes.step(["a", "b", "c"]) == [None, None, None] and tracker.calls == 7
        assert [e.answers for e in episodes.envs] == [["a"] * 3, ["b"] * 3, ["c"]]

    def test_one_turn(self):
        episodes = batch([{"result": ("ignored", 1.0, False)}], max_turns=1)
        episodes.step(["a"])
        assert episodes.states[0] == EpisodeState(row=0, max_turns=1, turns=1, reward=1.0, done=True, cut=True)

    def test_a_live_episode_needs_a_str_answer(self):
        with pytest.raises(TypeError, match="live episode 0 is NoneType"):
            batch([{"result": OK}]).step([None])


class TestCalculator:
    @pytest.mark.parametrize("expression, value", [
        ("1+2*3", "7"), ("7/2", "3.5"), ("6/2", "3"), ("-(2**10) % 7", "5"), ("2**0.5", "1.41421356237"),
        ("(12 - 4) // 3", "2"), ("2**-1", "0.5"),
    ])
    def test_evaluate(self, expression, value):
        assert evaluate(expression) == value

    @pytest.mark.parametrize("expression, words", [
        ("__import__('os').system('true')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
        ("True + 1", "Constant is not allowed"), ("'a' * 3", "Constant is not allowed"), ("1 < 2", "Compare"),
        ("9**9**9", "power too large"), ("2**2**3999", "power too large"), ("1/0", "division by zero"), ("(-8)**0.5", "math domain error"),
        ("10**30 * 10**30", "result longer than 40"), ("1 +", "not an arithmetic expression"),
        ("1" * 201, "longer than 200"),
    ])
    def test_evaluate_refuses(self, expression, words):
        with pytest.raises(ValueError, match=words):
            evaluate(expression)

    def test_episodes_end_to_end(self):
        rows = [{"prompt": "6 x 7?", "answer": "6 * 7 = 42\n#### 42"}, {"prompt": "1 + 6?", "answer": "7"},
                {"prompt": "2 + 2?", "answer": "4"}]
        episodes = batch(rows, spec="dschat.envs_examples:calculator", max_turns=3, timeout=10)
        first = episodes.step(["Let me compute. CALC: 6*7", "The answer is 7.", "CALC: os.system('x')"])
        assert first == [StepResult({"role": "tool", "content": "42"}, None, False), StepResult(None, 1.0, True),
                         StepResult({"role": "tool", "content": "error: Call is not allowed (numbers and + - * / "
                                     "// % ** only)"}, None, False)]
        second = episodes.step(["So it is 42.", None, "I think 5"])
        assert second == [StepResult(None, 1.0, True), None, StepResult(None, 0.0, True)]
        assert [(s.turns, s.reward, s.done, s.cut) for s in episodes.states] == [
            (2, 1.0, True, False), (1, 1.0, True, False), (2, 0.0, True, False)]

    def test_tool_calls_until_cut(self):
        episodes = batch([{"answer": "3"}], spec="dschat.envs_examples:calculator", max_turns=2)
        episodes.step(["CALC: 1+2"])
        episodes.step(["CALC: 1+2"])
        assert episodes.states[0] == EpisodeState(row=0, max_turns=2, turns=2, reward=0.0, done=True, cut=True)

    def test_a_row_without_the_answer_column(self, capsys):
        err = one_line_exit_2(lambda: batch([{"prompt": "q"}], spec="dschat.envs_examples:calculator"), capsys)
        assert "reads the dataset column 'answer'" in err and "['prompt']" in err
        assert Calculator(None).step("42") == (None, 0.0, True)  # a reference without a number matches nothing


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(str(materialize_smollm2()))


def _with_template(template: str):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


# Renders user and assistant turns, refuses any other role.
STRICT = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
          "[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
# Renders user and assistant turns, drops any other.
DROPPING = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}[{{ m['role'] }}] {{ m['content'] }}"
            "</s>{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


class TestRenderObservation:
    @pytest.mark.parametrize("observation, role", [({"role": "tool", "content": "42"}, "tool"),
                                                   ("Try again: 6*7 is not 41.", "user")])
    def test_through_the_chat_template(self, smollm2_tokenizer, observation, role):
        tok = smollm2_tokenizer
        question = {"role": "user", "content": "What is 6*7?"}
        answer = "CALC: 6*7"
        prompt = tok.apply_chat_template([question], tokenize=False, add_generation_prompt=True)
        content = observation if isinstance(observation, str) else observation["content"]
        whole = tok.apply_chat_template([question, {"role": "assistant", "content": answer},
                                         {"role": role, "content": content}], tokenize=False,
                                        add_generation_prompt=True)
        text = render_observation(observation, tok)
        assert prompt + answer + text == whole
        assert text == f"<|im_end|>\n<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n"

    def test_none_appends_nothing(self, smollm2_tokenizer):
        assert render_observation(None, smollm2_tokenizer) == ""
        assert render_observation(None, make_tokenizer()) == ""

    def test_without_a_chat_template_the_plain_text(self):
        tokenizer = make_tokenizer()
        assert not tokenizer.chat_template
        assert render_observation({"role": "tool", "content": "\n42\n"}, tokenizer) == "\n42\n"
        assert render_observation(" Human: and 5? Assistant:", tokenizer) == " Human: and 5? Assistant:"

    def test_a_template_that_refuses_the_role(self):
        tokenizer = _with_template(STRICT)
        assert render_observation("hint", tokenizer) == "</s>[user] hint</s>[assistant] "
        assert render_observation({"role": "tool", "content": "42"}, tokenizer) == "42"

    def test_a_template_that_drops_the_role(self):
        tokenizer = _with_template(DROPPING)
        assert render_observation("hint", tokenizer) == "</s>[user] hint</s>[assistant] "
        assert render_observation({"role": "tool", "content": "42"}, tokenizer) == "42"


class TestWordGame:
    """dschat.envs_examples:word_game, the multi-turn demo's game: the reward past the first turn needs
    the word that only the environment's reply carries."""

    def test_a_right_guess_ends_the_game(self):
        episodes = batch([{"prompt": "Guess.", "word": "apple"}], spec="dschat.envs_examples:word_game", max_turns=2)
        assert episodes.step(["**Apple!**"]) == [StepResult(None, 1.0, True)]
        assert episodes.states[0] == EpisodeState(row=0, max_turns=2, turns=1, reward=1.0, done=True, cut=False)

    def test_the_reveal_then_the_reply_is_scored(self):
        rows = [{"prompt": "Guess.", "word": "rocket"}] * 5
        episodes = batch(rows, spec="dschat.envs_examples:word_game", max_turns=2, timeout=10)
        reveal = StepResult("No, the secret word is rocket. Now reply with only that word.", 0.0, False)
        assert episodes.step(["Banana", "I think it is apple.", "rockets", "", "pear"]) == [reveal] * 5
        # The reply's share of words that are the word: repeating the reveal earns 1/12.
        replies = ["Rocket.", "rocket ship", "The secret word is rocket.",
                   "No, the secret word is rocket. Now reply with only that word.", "apple"]
        assert episodes.step(replies) == [StepResult(None, r, True) for r in (1.0, 0.5, 0.2, 1 / 12, 0.0)]
        assert [(s.turns, s.reward, s.done, s.cut) for s in episodes.states] == [
            (2, r, True, False) for r in (1.0, 0.5, 0.2, 1 / 12, 0.0)]

    @pytest.mark.parametrize("reply,reward", [("rocket rocket", 1.0), ("Rocket, rocket!", 1.0), ("", 0.0),
                                              ("42 ...", 0.0), ("rocket 42", 1.0)])
    def test_the_reply_s_share_of_the_word(self, reply, reward):
        """A reply made only of the word scores 1.0, repeated or not; one with no word at all 0.0."""
        game = word_game({"word": "rocket"})
        assert game.step("apple")[1:] == (0.0, False)
        assert game.step(reply) == (None, reward, True)

    def test_a_second_wrong_answer_ends_the_game_without_a_second_reveal(self):
        game = word_game({"word": "Tiger"})
        assert game.step("lion")[1:] == (0.0, False)
        assert game.step("a lion") == (None, 0.0, True)

    def test_words_of(self):
        assert words_of("**Rocket!** it's") == ["rocket", "it", "s"]
        assert words_of("42 ...") == []

    @pytest.mark.parametrize("row", [{"prompt": "q"}, {"word": "two words"}, {"word": 7}, {"word": "r2d2"}])
    def test_a_row_without_one_word(self, row, capsys):
        err = one_line_exit_2(lambda: batch([row], spec="dschat.envs_examples:word_game"), capsys)
        assert "reads the dataset column 'word'" in err and "dschat/wordgame" in err


def test_the_calculator_pays_nothing_when_the_reference_has_no_number():
    """No number in the row's answer: no final answer matches it (None == None paid 1.0)."""
    assert calculator({"answer": "no number here"}).step("I do not know")[1] == 0.0


def test_an_environment_factory_gets_a_copy_of_its_row():
    """A factory may edit its row; the dataset's row (later episodes, reward-function columns) stays."""
    from dschat.envs import EnvironmentFactory

    row = {"prompt": "p", "answer": "1"}

    def factory(r):
        r["answer"] = "changed"
        return calculator(r)

    EpisodeBatch(EnvironmentFactory("t:f", factory), [row], max_turns=1)
    assert row["answer"] == "1"
    # ... a deep copy: lists in it too (a hint game popping the hints of its row's list).
    row = {"prompt": "p", "answer": "1", "hints": ["red", "round"]}

    def hint_game(r):
        r["hints"].pop(0)
        return calculator(r)

    EpisodeBatch(EnvironmentFactory("t:f", hint_game), [row, row], max_turns=1)
    assert row["hints"] == ["red", "round"]
    # A row from Python may hold a dict of another type: it keeps its type (a defaultdict its default).
    from collections import defaultdict

    from dschat.envs import _copy_containers

    counts = defaultdict(list, {"a": [1]})
    copied = _copy_containers({"counts": counts})["counts"]
    copied["a"].append(2)
    copied["new"].append(3)
    assert type(copied) is defaultdict and counts == {"a": [1]}
