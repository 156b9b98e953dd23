"""Example environments: a calculator tool (``--env dschat.envs_examples:calculator``) and a word game
with feedback (``--env dschat.envs_examples:word_game``).

The actor may write ``CALC: <expression>`` (numbers, ``+ - * / // % **``, parentheses; read with
:mod:`ast`, never ``eval``) to get its value back as a tool message. An answer without ``CALC:`` ends
the episode: reward 1.0 when its final number equals the one of the row's ``answer`` column (a
number, or a worked solution ending in ``#### 42``), else 0.0.

The word game (the multi-turn demo's, on ``--data_path dschat/wordgame``; column ``word``): the
actor guesses a secret word; a right guess ends the episode with reward 1.0, any other answer gets
the reply ``No, the secret word is <word>. Now reply with only that word.`` and the next turn is
scored by the share of its words that are the secret word (case and punctuation aside): 1.0 for a
reply made only of the word, 0.2 for ``The secret word is rocket.``, 0.0 without it. The word is in
no prompt, so the reward past the first turn comes from using the environment's reply.
"""
from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass
from typing import Any

from dschat.errors import UserError
from dschat.rewards import MATH_REFERENCE_COLUMN, final_number

_CALL = re.compile(r"CALC:\s*([^\n]*)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.UAdd: operator.pos, ast.USub: operator.neg,
        ast.Pow: lambda a, b: a ** b if type(a) is type(b) is int else math.pow(a, b)}  # math.pow: no complex
MAX_EXPRESSION, MAX_RESULT, MAX_BITS = 200, 40, 4000  # characters in, out; bits of a whole power


def evaluate(expression: str) -> str:
    """``expression``'s value as text (12 significant digits); ValueError saying why for a non-expression."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > MAX_BITS  # checked first: no float of a huge int
                                                 or abs(right) * math.log2(max(abs(left), 2)) > MAX_BITS):
                raise ValueError("power too large")
            try:
                return _OPS[type(node.op)](left, right)
            except (ZeroDivisionError, OverflowError, ValueError) as err:  # math.pow's domain error
                raise ValueError(str(err)) from None
        raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")

    number = value(tree.body)
    text = str(int(number)) if isinstance(number, int) or number.is_integer() else f"{number:.12g}"
    if len(text) > MAX_RESULT:
        raise ValueError(f"result longer than {MAX_RESULT} characters")
    return text


@dataclass
class Calculator:
    """One episode: ``step`` answers a ``CALC:`` turn with a tool message, and scores any other."""

    expected: str | None  # the reference's final number

    def step(self, answer: str) -> tuple[Any, float | None, bool]:
        call = _CALL.search(answer)
        if call is None:
            return None, float(self.expected is not None and final_number(answer) == self.expected), True
        try:
            return {"role": "tool", "content": evaluate(call.group(1))}, None, False
        except ValueError as err:
            return {"role": "tool", "content": f"error: {err}"}, None, False


def calculator(row: dict[str, Any]) -> Calculator:
    """The factory: the episode of a row whose ``answer`` column holds the expected number."""
    if MATH_REFERENCE_COLUMN not in row:
        raise UserError(f"dschat.envs_examples:calculator reads the dataset column {MATH_REFERENCE_COLUMN!r}, "
                        f"which the prompt data lacks (it has {sorted(row)}); add that column to the data")
    return Calculator(final_number(str(row[MATH_REFERENCE_COLUMN])))


WORD_COLUMN = "word"
_LETTERS = re.compile(r"[a-z]+")


def words_of(text: str) -> list[str]:
    """``text``'s words, lower-cased, letters only (``"**Rocket!**"`` -> ``["rocket"]``)."""
    return _LETTERS.findall(text.lower())


@dataclass
class WordGame:
    """One game: ``step`` scores a guess (turn 1), then the reply to the reveal (turn 2, the last)."""

    word: str
    turn: int = 0

    def step(self, answer: str) -> tuple[Any, float, bool]:
        self.turn += 1
        said = words_of(answer)
        if said == [self.word]:
            return None, 1.0, True
        if self.turn == 1:
            return f"No, the secret word is {self.word}. Now reply with only that word.", 0.0, False
        # The share of the reply's words that are the word: 1.0 for a reply made only of it (once or
        # repeated), less the more words surround it (repeating the reveal earns 1/12), 0.0 without it.
        return None, said.count(self.word) / len(said) if said else 0.0, True


def word_game(row: dict[str, Any]) -> WordGame:
    """The factory: the game of a row whose ``word`` column holds the secret word (one word, letters)."""
    word = row.get(WORD_COLUMN)
    if not isinstance(word, str) or words_of(word) != [word.lower()]:
        raise UserError(f"dschat.envs_examples:word_game reads the dataset column {WORD_COLUMN!r} (one word of "
                        f"letters); this row has {WORD_COLUMN}={word!r} (columns {sorted(row)}); "
                        "use --data_path dschat/wordgame or add that column")
    return WordGame(word.lower())
