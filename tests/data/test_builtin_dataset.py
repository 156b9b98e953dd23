"""The embedded preference dataset: size, text convention, labels, and that length is not the rule."""
import json
import statistics

import pytest

from dschat import gold_judge
from dschat.data import builtin


@pytest.fixture(scope="module")
def rows():
    return {split: builtin.read_rows(split) for split in builtin.SPLITS}


def test_sizes_and_fields(rows):
    assert len(rows["train"]) >= 3000 and len(rows["eval"]) >= 300
    for split_rows in rows.values():
        for row in split_rows:
            assert set(row) == {"prompt", "chosen", "rejected"}


def test_upstream_text_convention(rows):
    for split_rows in rows.values():
        for row in split_rows:
            assert row["prompt"].startswith(" Human: ") and row["prompt"].endswith(" Assistant:")
            for answer in (row["chosen"], row["rejected"]):
                assert answer.startswith(" ") and not answer.startswith("  ")


def test_every_label_agrees_with_the_gold_judge(rows):
    for split_rows in rows.values():
        for row in split_rows:
            margin = gold_judge.gold_score(row["prompt"], row["chosen"]) - gold_judge.gold_score(
                row["prompt"], row["rejected"]
            )
            assert margin >= builtin.MIN_MARGIN, row


def test_heldout_prompts_are_unseen(rows):
    train_prompts = {r["prompt"] for r in rows["train"]}
    eval_prompts = {r["prompt"] for r in rows["eval"]}
    assert train_prompts.isdisjoint(eval_prompts)
    assert len(eval_prompts) >= 90


def test_length_alone_does_not_decide(rows):
    for split_rows in rows.values():
        longer_chosen = [len(r["chosen"].split()) > len(r["rejected"].split()) for r in split_rows]
        rate = sum(longer_chosen) / len(longer_chosen)
        assert 0.35 <= rate <= 0.65, rate


def test_chosen_answers_leave_headroom(rows):
    # SFT imitates chosen answers; RLHF has room only if they are not already perfect.
    chosen = [gold_judge.gold_score(r["prompt"], r["chosen"]) for r in rows["train"]]
    assert statistics.mean(chosen) < gold_judge.GOLD_MAX - 1.0
    assert sum(c == gold_judge.GOLD_MAX for c in chosen) / len(chosen) < 0.1


def test_generator_reproduces_the_committed_files():
    generated = builtin.generate()
    for split in builtin.SPLITS:
        committed = builtin.split_file(split).read_text(encoding="utf-8").splitlines()
        assert [json.dumps(r, ensure_ascii=False) for r in generated[split]] == committed


def test_grammar_invariants():
    """Facts are relevant to their own topic only and carry no warm or rude marker."""
    for topic, facts in builtin.TOPICS.items():
        prompt = builtin.format_prompt(builtin.QUESTION_TEMPLATES[0].format(t=topic))
        for other, other_facts in builtin.TOPICS.items():
            for fact in other_facts:
                b = gold_judge.gold_breakdown(prompt, " " + fact)
                assert b.relevance == (1.0 if other == topic else 0.0), (topic, fact)
                assert b.warmth == 0.0 and b.rudeness == 0.0, fact
    for template in builtin.QUESTION_TEMPLATES:
        assert gold_judge.prompt_content_stems(builtin.format_prompt(template.format(t=""))) == frozenset()
