"""dschat/builtin-samples: gold-labelled pairs of an SFT actor's answers, and the script that makes them."""
import json

import pytest

from dschat import gold_judge
from dschat.data import builtin
from dschat.data.adapters.local import BUILTIN_NAME, BUILTIN_SAMPLES_NAME, BuiltinDataset
from dschat.data.dispatch import get_raw_dataset, resolve_dataset
from dschat.eval import sample_pairs
from dschat.models.registry import resolve_model_path
from dschat.recipes.loading import get_recipe


@pytest.fixture(scope="module")
def rows():
    return {split: builtin.read_rows(split, builtin.samples_dir()) for split in builtin.SPLITS}


def test_sizes_fields_and_text_convention(rows):
    assert len(rows["train"]) >= 1500 and len(rows["eval"]) >= 100
    for split_rows in rows.values():
        for row in split_rows:
            assert set(row) == {"prompt", "chosen", "rejected"}
            assert row["prompt"].startswith(" Human: ") and row["prompt"].endswith(" Assistant:")
            assert row["chosen"] != row["rejected"] and row["chosen"].strip() and row["rejected"].strip()


def test_every_label_agrees_with_the_gold_judge(rows):
    def margin(row):
        return gold_judge.gold_score(row["prompt"], row["chosen"]) - gold_judge.gold_score(row["prompt"], row["rejected"])

    worst = min((r for split_rows in rows.values() for r in split_rows), key=margin)
    assert margin(worst) >= builtin.MIN_MARGIN, worst


def test_prompts_are_train_prompts_only(rows):
    """The report's held-out prompts stay unseen: every prompt is one of dschat/builtin's train
    prompts, and the two splits of the samples share none."""
    builtin_train = {r["prompt"] for r in builtin.read_rows("train")}
    builtin_eval = {r["prompt"] for r in builtin.read_rows("eval")}
    train, held = ({r["prompt"] for r in rows[s]} for s in builtin.SPLITS)
    assert train | held <= builtin_train
    assert (train | held).isdisjoint(builtin_eval)
    assert train.isdisjoint(held) and len(held) == sample_pairs.DEFAULT_EVAL_PROMPTS


def test_the_pairs_are_not_the_grammar(rows):
    """They are the actor's own text: almost no answer is one the grammar wrote."""
    grammar = {a for r in builtin.read_rows("train") for a in (r["chosen"], r["rejected"])}
    answers = [a for r in rows["train"] for a in (r["chosen"], r["rejected"])]
    assert sum(a in grammar for a in answers) / len(answers) < 0.05


def test_make_pairs_by_hand():
    prompt = " Human: Tell me about owls. Assistant:"
    good = " I'm glad you asked! Owls hunt at night and see well in dim light."  # warmth too: 2.0
    plain = " Owls hunt at night and see well in dim light."  # relevance + ending: 1.5
    off = " Cats sleep a lot during the day and hunt at night."  # ending only: 0.5
    same = " Owls hunt at night and see well in the dark."  # 1.5: ties with plain
    assert [gold_judge.gold_score(prompt, a) for a in (good, plain, off, same)] == [2.0, 1.5, 0.5, 1.5]
    answers = [{"prompt": prompt, "answer": a} for a in (good, plain, off, same, plain, "  ")]
    rows = sample_pairs.make_pairs(answers, per_prompt=10)
    got = {(r["chosen"], r["rejected"]) for r in rows}
    # Every pair separated by >= 0.5, better answer first; the tie, the duplicate and the blank are left out.
    assert got == {(good, plain), (good, off), (good, same), (plain, off), (same, off)}
    assert len(rows) == 5 and all(r["prompt"] == prompt for r in rows)
    assert len(sample_pairs.make_pairs(answers, per_prompt=2)) == 2
    assert sample_pairs.make_pairs(answers, per_prompt=10, margin=1.5) == [
        {"prompt": prompt, "chosen": good, "rejected": off}
    ]


def test_split_by_prompt_holds_whole_prompts_out():
    rows = [{"prompt": f"p{i % 7}", "chosen": "a", "rejected": "b"} for i in range(30)]
    split = sample_pairs.split_by_prompt(rows, eval_prompts=3)
    train, held = ({r["prompt"] for r in split[s]} for s in ("train", "eval"))
    assert len(held) == 3 and train.isdisjoint(held) and len(split["train"]) + len(split["eval"]) == 30


def test_the_dataset_name_resolves_and_loads():
    source = resolve_dataset(BUILTIN_SAMPLES_NAME)
    assert source.adapter is BuiltinDataset
    assert [f.name for f in source.files] == ["train.jsonl", "eval.jsonl"]
    assert source.files[0].parent == builtin.samples_dir()
    samples = get_raw_dataset(BUILTIN_SAMPLES_NAME, "/unused", 1234, 0)
    plain = get_raw_dataset(BUILTIN_NAME, "/unused", 1234, 0)
    # A cache name of its own, so the two datasets never share a tokenised cache entry.
    assert (samples.dataset_name_clean, plain.dataset_name_clean) == ("dschat_builtin_samples", "dschat_builtin")
    first = samples.get_train_data()[0]
    assert samples.get_prompt_and_chosen(first) == first["prompt"] + first["chosen"]
    assert len(samples.get_train_data()) == len(builtin.read_rows("train", builtin.samples_dir()))


def test_the_cpu_demo_step2_reads_both():
    assert list(get_recipe("step2", "cpu/smollm2-135m").flag("data_path")) == [BUILTIN_NAME, BUILTIN_SAMPLES_NAME]


def test_the_script_writes_labelled_pairs_from_a_real_actor(tmp_path, monkeypatch, capsys):
    prompts = sample_pairs.train_prompts()[:6]
    monkeypatch.setattr(sample_pairs, "train_prompts", lambda: prompts)
    out = tmp_path / "samples"
    argv = ["--actor", str(resolve_model_path("tiny-llama")), "--out", str(out), "--draws", "3",
            "--max_new_tokens", "12", "--eval_prompts", "2", "--device", "cpu"]
    assert sample_pairs.cli_main(sample_pairs.main, argv) == 0
    assert "draw 3/3: 6 answers" in capsys.readouterr().out
    split = {s: [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()] for s in builtin.SPLITS}
    assert split["train"] and split["eval"]  # the tiny model's 18 seeded answers give 11 pairs
    for row in split["train"] + split["eval"]:
        assert row["prompt"] in prompts
        margin = gold_judge.gold_score(row["prompt"], row["chosen"]) - gold_judge.gold_score(row["prompt"], row["rejected"])
        assert margin >= builtin.MIN_MARGIN


def test_step3_helpers_know_both_embedded_names():
    from dschat.data.unsupervised import load_unsupervised_raw
    from dschat.rlhf.heldout.setup import resolve_judges

    judges = resolve_judges(["gold"], [BUILTIN_NAME, BUILTIN_SAMPLES_NAME])
    assert [j.name for j in judges] == ["gold"]
    texts = load_unsupervised_raw(BUILTIN_SAMPLES_NAME)["train"]["text"]
    first = builtin.read_rows("train", builtin.samples_dir())[0]
    assert texts[0] == first["prompt"] + first["chosen"]


@pytest.mark.parametrize("argv, message", [
    (["--actor", "/nonexistent/actor"], "/nonexistent/actor"),
    (["--actor", "x", "--draws", "0"], "--draws must be at least 1"),
    (["--actor", "x", "--eval_prompts", "0"], "--eval_prompts must be at least 1"),
    (["--actor", "x", "--temperature", "0"], "--temperature must be above 0"),
    (["--actor", "x", "--temperature", "inf"], "--temperature must be above 0 and finite"),
    (["--actor", "x", "--eval_prompts", "100000"], "--eval_prompts 100000 holds out every one of the"),
])
def test_the_script_refuses_bad_input_in_one_line(argv, message, tmp_path, capsys):
    assert sample_pairs.cli_main(sample_pairs.main, argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_an_out_that_is_a_file_is_refused_before_sampling(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sample_pairs, "sample_answers", lambda *a, **k: pytest.fail("sampled before checking --out"))
    out = tmp_path / "file"
    out.write_text("mine")
    argv = ["--actor", str(resolve_model_path("tiny-llama")), "--out", str(out)]
    assert sample_pairs.cli_main(sample_pairs.main, argv) == 2
    assert "--out" in capsys.readouterr().err and out.read_text() == "mine"


def test_no_pairs_for_a_split_writes_nothing(tmp_path, monkeypatch, capsys):
    prompts = sample_pairs.train_prompts()[:6]
    monkeypatch.setattr(sample_pairs, "train_prompts", lambda: prompts)
    same = [{"prompt": p, "answer": " the same answer"} for p in prompts for _ in range(3)]  # nothing to separate
    monkeypatch.setattr(sample_pairs, "sample_answers", lambda *a, **k: same)
    out = tmp_path / "samples"
    out.mkdir()
    (out / "train.jsonl").write_text("old\n")
    argv = ["--actor", str(resolve_model_path("tiny-llama")), "--out", str(out), "--eval_prompts", "2"]
    assert sample_pairs.cli_main(sample_pairs.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: no train or eval pairs") and "nothing written" in err
    assert sorted(p.name for p in out.iterdir()) == ["train.jsonl"] and (out / "train.jsonl").read_text() == "old\n"


def test_holding_out_every_prompt_is_refused_before_sampling(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sample_pairs, "train_prompts", lambda: ["a", "b"])
    monkeypatch.setattr(sample_pairs, "sample_answers", lambda *a, **k: pytest.fail("sampled before the check"))
    argv = ["--actor", str(resolve_model_path("tiny-llama")), "--out", str(tmp_path / "o"), "--eval_prompts", "2"]
    assert sample_pairs.cli_main(sample_pairs.main, argv) == 2
    assert "--eval_prompts 2 holds out every one of the 2 train prompts" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
