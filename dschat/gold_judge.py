"""The gold judge: a documented, deterministic, rule-based scorer of (prompt, response).

It plays the role of the human labeller for the embedded dataset (``--data_path dschat/builtin``):
it decided every chosen/rejected label there, and it is independent of any learned model, so the
reward model's held-out accuracy and the RLHF actor's gain over the SFT actor can be measured
against it.

The task it encodes is "a friendly, on-topic, well-formed, concise answer". The score is the sum
of six components (see :func:`gold_breakdown`)::

    relevance   +1.0  the response mentions a content word of the prompt (stemmed match)
    warmth      +0.5  per distinct friendly marker ("glad", "happy", "hope", "enjoy", ...), at most +1.5
    rudeness    -1.0  per distinct rude marker ("boring", "whatever", "no idea", ...), at most -2.0
    length      -1.0  if fewer than 6 words; -(n - 45) / 10 (at most -1.5) above 45 words
    repetition  -1.0  if any word 4-gram occurs twice
    ending      +0.5  if the response ends with '.', '!' or '?'

so scores lie in [-4.5, 3.0]. Length alone is not rewarded: beyond a minimum, more words earn
nothing and rambling is penalised; in the embedded dataset the longer answer is the chosen one in
about half of the pairs (``tests/data/test_builtin_dataset.py`` pins this).

The components are lexical on purpose: a 135M-parameter reward model learns them from a few
hundred pairs on a CPU, and a PPO actor can move them within a short CPU run, which is what the
CPU demo needs.
"""
from __future__ import annotations

import re
from typing import NamedTuple

# Words that carry no topic: question scaffolding and function words. Every prompt template of
# the embedded dataset uses only these besides its topic (tests/data/test_builtin_dataset.py checks).
STOPWORDS = frozenset(
    """
    a about all also an and any anything are as ask asking at be because been before but by can
    could curious did do does doing explain explanation facts fact few find for from get give good have help how i
    if in interesting into is it its just know learn learning like me mind more most my need new
    not of on one or people quick quite really say share should short some something start tell
    than that the their them then there these they thing things think this those to up very want
    was we well what when where which who why will with would you your yours please fun favourite
    """.split()
)

# Distinct friendly markers; each counts once however often it appears.
WARM_MARKERS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("glad", r"\bglad\b"),
        ("happy", r"\bhapp(?:y|ily)\b"),
        ("great", r"\bgreat\b"),
        ("hope", r"\bhope\b"),
        ("enjoy", r"\benjoy\w*"),
        ("wonderful", r"\bwonderful\b"),
        ("fascinating", r"\bfascinat\w*"),
        ("delighted", r"\bdelighted\b"),
        ("love", r"\blove\b"),
        ("lovely", r"\blovely\b"),
        ("welcome", r"\bwelcome\b"),
        ("pleasure", r"\bpleasure\b"),
    )
)

# Distinct rude or dismissive markers.
RUDE_MARKERS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("boring", r"\bboring\b"),
        ("stupid", r"\bstupid\b"),
        ("whatever", r"\bwhatever\b"),
        ("obviously", r"\bobviously\b"),
        ("dumb", r"\bdumb\b"),
        ("annoying", r"\bannoying\b"),
        ("ugh", r"\bugh\b"),
        ("seriously", r"\bseriously\b"),
        ("no idea", r"\bno idea\b"),
        ("don't care", r"\bdon'?t care\b"),
        ("figure it out", r"\bfigure (?:it|the rest) out\b"),
        ("look it up", r"\blook it up\b"),
        ("don't bother", r"\bdon'?t bother\b"),
    )
)

WARMTH_PER_MARKER = 0.5
MAX_WARM_MARKERS = 3
RUDENESS_PER_MARKER = -1.0
MAX_RUDE_MARKERS = 2
MIN_WORDS = 6
MAX_WORDS = 45
SHORT_PENALTY = -1.0
LONG_PENALTY_PER_WORD = -0.1
MAX_LONG_PENALTY = -1.5
REPETITION_PENALTY = -1.0
REPEAT_NGRAM = 4
RELEVANCE_BONUS = 1.0
ENDING_BONUS = 0.5

_WORD = re.compile(r"[a-z0-9']+")
# Upstream's conversation markers: only the answer after the last "Assistant:" is judged.
_ASSISTANT = "Assistant:"


class GoldBreakdown(NamedTuple):
    relevance: float
    warmth: float
    rudeness: float
    length: float
    repetition: float
    ending: float

    @property
    def total(self) -> float:
        # Rounded so that equal answers compare equal despite float summation order.
        return round(float(sum(self)), 6)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _stem(word: str) -> str:
    """Crude stem: drop a plural "s" or an "-ing", keep six letters.

    So "volcanoes" ~ "volcano", "kites" ~ "kite", "quilting" ~ "quilt", but "earthquakes" !~ "earth".
    """
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        word = word[:-1]
    if len(word) > 5 and word.endswith("ing"):
        word = word[:-3]
    return word[:6]


def prompt_content_stems(prompt: str) -> frozenset[str]:
    """Stems of the prompt's content words (the last human turn, stopwords removed)."""
    question = prompt.rsplit(_ASSISTANT, 1)[0]
    if "Human:" in question:
        question = question.rsplit("Human:", 1)[1]
    return frozenset(
        _stem(w) for w in _words(question) if len(w) >= 3 and w not in STOPWORDS and not w.isdigit()
    )


def _count_markers(text: str, markers: tuple[tuple[str, re.Pattern[str]], ...]) -> int:
    return sum(1 for _, pattern in markers if pattern.search(text))


def _has_repeated_ngram(words: list[str], n: int) -> bool:
    seen: set[tuple[str, ...]] = set()
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        if gram in seen:
            return True
        seen.add(gram)
    return False


def gold_breakdown(prompt: str, response: str) -> GoldBreakdown:
    """Score ``response`` as an answer to ``prompt``, component by component."""
    text = response.strip()
    lowered = text.lower()
    words = _words(text)

    topic = prompt_content_stems(prompt)
    relevance = RELEVANCE_BONUS if topic and any(_stem(w) in topic for w in words) else 0.0

    warmth = WARMTH_PER_MARKER * min(_count_markers(lowered, WARM_MARKERS), MAX_WARM_MARKERS)
    rudeness = RUDENESS_PER_MARKER * min(_count_markers(lowered, RUDE_MARKERS), MAX_RUDE_MARKERS)

    n = len(words)
    if n < MIN_WORDS:
        length = SHORT_PENALTY
    elif n > MAX_WORDS:
        length = max(MAX_LONG_PENALTY, LONG_PENALTY_PER_WORD * (n - MAX_WORDS))
    else:
        length = 0.0

    repetition = REPETITION_PENALTY if _has_repeated_ngram(words, REPEAT_NGRAM) else 0.0
    ending = ENDING_BONUS if text[-1:] in (".", "!", "?") else 0.0
    return GoldBreakdown(relevance, warmth, rudeness, length, repetition, ending)


def gold_score(prompt: str, response: str) -> float:
    """The gold judge's score of ``response`` to ``prompt`` (higher is better, in [-4.5, 3.0])."""
    return gold_breakdown(prompt, response).total


def gold_prefers(prompt: str, a: str, b: str) -> bool:
    """True when the judge strictly prefers answer ``a`` over answer ``b``."""
    return gold_score(prompt, a) > gold_score(prompt, b)


# Short and long penalties exclude each other; the long one is the larger.
GOLD_MIN = RUDENESS_PER_MARKER * MAX_RUDE_MARKERS + MAX_LONG_PENALTY + REPETITION_PENALTY
GOLD_MAX = RELEVANCE_BONUS + WARMTH_PER_MARKER * MAX_WARM_MARKERS + ENDING_BONUS
