"""The gold judge on hand-written examples; each expected total is worked out in the comments."""
import pytest

from dschat.gold_judge import GOLD_MAX, GOLD_MIN, gold_breakdown, gold_prefers, gold_score

VOLCANO = " Human: What can you tell me about volcanoes? Assistant:"


def test_friendly_on_topic_answer():
    resp = " Sure, I'd be glad to help! Volcanoes form where molten rock rises through cracks in the crust. I hope this helps!"
    b = gold_breakdown(VOLCANO, resp)
    # relevance: "volcanoes" -> stem "volcan" also in the answer        -> +1.0
    # warmth: "glad", "hope" (2 distinct markers) x 0.5                  -> +1.0
    # rudeness 0, 20 words (6..45) -> length 0, no repeated 4-gram -> 0
    # ends with "!"                                                      -> +0.5
    assert b == (1.0, 1.0, 0.0, 0.0, 0.0, 0.5)
    assert gold_score(VOLCANO, resp) == 2.5


def test_rude_off_topic_answer_caps_rudeness():
    resp = " Whatever. I have no idea, look it up."
    b = gold_breakdown(VOLCANO, resp)
    # rude markers: "whatever", "no idea", "look it up" = 3, capped at 2 -> -2.0
    # 8 words -> no length penalty; ends with "." -> +0.5; nothing about volcanoes -> 0
    assert b == (0.0, 0.0, -2.0, 0.0, 0.0, 0.5)
    assert gold_score(VOLCANO, resp) == -1.5


def test_too_short_and_unfinished():
    # 1 word: short penalty -1.0; relevant +1.0; ends with "!" +0.5 -> 0.5
    assert gold_score(VOLCANO, " Volcanoes!") == 0.5
    # cut off mid-sentence: no ending bonus; 7 words, relevant -> 1.0
    assert gold_score(VOLCANO, " Volcanoes form where molten rock rises through") == 1.0


def test_long_answers_are_penalised_not_rewarded():
    sentence = "Volcanoes form where molten rock rises through cracks in the crust."  # 11 words
    filler = " ".join(f"w{i}" for i in range(39))  # 39 distinct words, no repeats
    long_resp = f" {sentence} {filler}."  # 50 words
    b = gold_breakdown(VOLCANO, long_resp)
    # 50 words: -(50 - 45) / 10 = -0.5
    assert b.length == pytest.approx(-0.5)
    very_long = f" {sentence} " + " ".join(f"x{i}" for i in range(200)) + "."
    assert gold_breakdown(VOLCANO, very_long).length == -1.5  # capped
    # Same content, more words: never better.
    assert gold_score(VOLCANO, " " + sentence) > gold_score(VOLCANO, long_resp)


def test_repetition_penalty():
    resp = " The volcano is hot. The volcano is hot."
    # 4-gram "the volcano is hot" occurs twice -> -1.0; relevant +1.0; 8 words; "." +0.5
    assert gold_breakdown(VOLCANO, resp).repetition == -1.0
    assert gold_score(VOLCANO, resp) == 0.5


def test_relevance_uses_stems_and_only_the_last_human_turn():
    kites = " Human: Tell me something interesting about kites. Assistant:"
    assert gold_breakdown(kites, " A kite needs wind to fly well today.").relevance == 1.0
    # "earthquakes" must not match "Earth".
    quakes = " Human: What do you know about earthquakes? Assistant:"
    assert gold_breakdown(quakes, " The Earth goes around the sun every year.").relevance == 0.0
    multi = " Human: Tell me about owls. Assistant: Owls hunt at night. Human: What about comets? Assistant:"
    assert gold_breakdown(multi, " Owls are birds that hunt at night.").relevance == 0.0
    assert gold_breakdown(multi, " Comets are balls of ice and dust.").relevance == 1.0
    # Question scaffolding is not topic: "explain" in the prompt is not matched by "explain".
    q = " Human: Can you explain chess to me? Assistant:"
    assert gold_breakdown(q, " Let me explain it to you now.").relevance == 0.0


def test_warmth_counts_distinct_markers_capped():
    resp = " Glad, glad, glad! I hope you enjoy it, happy to help, what a wonderful day."
    # distinct: glad, hope, enjoy, happy, wonderful = 5 -> capped at 3 x 0.5 = 1.5
    assert gold_breakdown(VOLCANO, resp).warmth == 1.5


def test_bounds_and_prefers():
    assert (GOLD_MIN, GOLD_MAX) == (-4.5, 3.0)
    good = " Happy to help! Volcanoes can build whole islands. I hope this helps!"
    bad = " Ugh, that is a boring question."
    assert gold_prefers(VOLCANO, good, bad)
    assert not gold_prefers(VOLCANO, bad, good)
    assert not gold_prefers(VOLCANO, good, good)
