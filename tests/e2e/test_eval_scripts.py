"""prompt_eval.py and rw_eval.py on tiny models: upstream's output blocks, greedy decoding, and a
reward-model evaluation that really loads the trained weights (deterministic, unlike upstream's)."""
from __future__ import annotations

import pytest
import torch

from helpers import PYTHON
from helpers.steps import STEP_DIRS, base_argv, load_script, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def sft_folder(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "out"
    load_script("step1").main(base_argv("tiny-llama", data_dir, "--output_dir", str(out), max_train_steps=3))
    return out


@pytest.fixture(scope="module")
def reward_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "out"
    return load_script("step2").main(base_argv("tiny-opt-quirk", data_dir, "--learning_rate", "1e-3",
                                               "--output_dir", str(out), max_train_steps=6))


def test_prompt_eval_prints_upstream_blocks_greedily(sft_folder, capsys):
    prompt_eval = load_script("step1", "prompt_eval")
    argv = ["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune", str(sft_folder),
            "--max_new_tokens", "6"]
    results = prompt_eval.main(argv)
    out = capsys.readouterr().out
    assert len(results) == 6
    assert out.count("==========Baseline: Greedy=========") == 6
    assert out.count("==========finetune: Greedy=========") == 6
    assert out.count("====================prompt end=============================") == 6
    assert results[0].prompt == "Human: Please tell me about Microsoft in a few sentence? Assistant:"
    for r in results:
        assert r.baseline[0].startswith(r.prompt) and r.finetune[0].startswith(r.prompt)
    assert any(r.baseline != r.finetune for r in results)  # the fine-tuned weights are really used
    # Greedy: the same answers on a second run.
    again = prompt_eval.main(argv)
    assert [r.finetune for r in again] == [r.finetune for r in results]


def test_prompt_eval_other_languages(sft_folder, capsys):
    prompt_eval = load_script("step1", "prompt_eval")
    results = prompt_eval.main(["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune",
                                str(sft_folder), "--max_new_tokens", "2", "--language", "Japanese"])
    assert results[0].prompt == "Human: マイクロソフトについて簡単に教えてください。 Assistant:"
    assert "鳥が冬に南に移動するのはなぜですか" in capsys.readouterr().out


def test_rw_eval_scores_the_trained_model_deterministically(reward_run, capsys):
    rw_eval = load_script("step2", "rw_eval")
    argv = ["--model_name_or_path", str(reward_run.output_dir), "--max_seq_len", "128"]
    first = rw_eval.main(argv)
    second = rw_eval.main(argv)
    out = capsys.readouterr().out
    assert out.count("==================Eval result============================") == 4
    assert out.count("=============Scores (higher, better)========================") == 4
    assert "good_ans score:  " in out and "bad_ans score:  " in out
    assert [(s.good_score, s.bad_score) for s in first] == [(s.good_score, s.bad_score) for s in second]

    # The scores are the trained engine's, not a random value head's.
    tokenizer = reward_run.tokenizer
    engine = reward_run.engine
    engine.eval()
    for s, good, bad in zip(first, rw_eval.GOOD_ANSWERS, rw_eval.BAD_ANSWERS):
        batch = rw_eval.prepare_datapair(s.prompt, good, bad, tokenizer, 128, tokenizer.eos_token)
        with torch.no_grad():
            expected = engine(**batch)
        assert s.good_score == pytest.approx(expected["chosen_mean_scores"].item(), abs=1e-5)
        assert s.bad_score == pytest.approx(expected["rejected_mean_scores"].item(), abs=1e-5)
    engine.train()


def test_rw_eval_on_a_tokenizer_without_eos_is_one_line_naming_the_flag(reward_run, tmp_path):
    """A reward model trained with --end_of_conversation_token because its tokenizer has no EOS: its saved
    tokenizer has none either (a TypeError traceback); the flag, as in training, scores it."""
    import json
    import shutil

    folder = shutil.copytree(reward_run.output_dir, tmp_path / "rm")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    argv = [PYTHON, "rw_eval.py", "--model_name_or_path", str(folder), "--max_seq_len", "64"]
    proc = run_cli(argv, cwd=STEP_DIRS["step2"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "has no EOS token; pass --end_of_conversation_token" in errors[0]
    fixed = run_cli([*argv, "--end_of_conversation_token", "</s>"], cwd=STEP_DIRS["step2"])
    assert fixed.returncode == 0, fixed.stderr[-2000:]


def test_rw_eval_refuses_a_folder_that_is_not_a_reward_model(sft_folder):
    proc = run_cli([PYTHON, "rw_eval.py", "--model_name_or_path", str(sft_folder)], cwd=STEP_DIRS["step2"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "not a step-2 reward model output" in errors[0]


def test_prompt_eval_refuses_what_it_cannot_compare(tmp_path):
    """One line each, before any model loads or generates: several answers per prompt (greedy gives
    one), a step-2 reward model as either model, a baseline whose tokenizer is another family's."""
    from dschat.errors import UserError
    from helpers.step3 import make_critic_folder

    prompt_eval = load_script("step1", "prompt_eval")

    def run(baseline, finetune, *extra):
        return prompt_eval.main(["--model_name_or_path_baseline", str(baseline), "--model_name_or_path_finetune",
                                 str(finetune), "--max_new_tokens", "2", *extra])

    with pytest.raises(UserError, match="decodes greedily.*pass --num_return_sequences 1"):
        run("tiny-llama", "tiny-llama", "--num_return_sequences", "2")
    with pytest.raises(UserError, match=r"--max_new_tokens 600 after the longest prompt's \d+ tokens passes "
                                        "--model_name_or_path_baseline's 512 positions"):
        run("tiny-opt", "tiny-opt", "--max_new_tokens", "600")
    critic = make_critic_folder("tiny-llama", tmp_path / "rm")
    with pytest.raises(UserError, match="--model_name_or_path_finetune .* is a reward model .*no language-model head; pass a base model"):
        run("tiny-llama", critic)
    with pytest.raises(UserError, match="--model_name_or_path_baseline .* is a reward model"):
        run(critic, "tiny-llama")
    with pytest.raises(UserError, match="the baseline's tokenizer, used for both models, is not the fine-tuned.*vocab"):
        run("tiny-opt", "tiny-llama")
    # A step-1 model trained with --add_eot_token against its own base: the flag is the fix, not another baseline.
    from transformers import AutoModelForCausalLM

    from dschat.models.build import create_hf_model
    from dschat.models.save import save_hf_model
    from dschat.training.step_data import load_tokenizer

    tok = load_tokenizer("tiny-llama", True)
    sft = save_hf_model(create_hf_model(AutoModelForCausalLM, "tiny-llama", tok), tok, tmp_path / "sft")
    with pytest.raises(UserError, match="trained with --add_eot_token: pass --add_eot_token$"):
        run("tiny-llama", sft)
    run("tiny-llama", sft, "--add_eot_token")


def test_a_step3_output_folder_is_its_actor_for_prompt_eval_and_refused_by_rw_eval(tmp_path, capsys):
    """prompt_eval.py takes a step-3 --output_dir as its actor/ (as chat.py does); rw_eval.py refuses it in
    one line that names the folder's critic/."""
    from transformers import AutoModelForCausalLM

    from dschat.errors import UserError
    from dschat.models.registry import resolve_model_path
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer
    from helpers.step3 import make_critic_folder

    src = resolve_model_path("tiny-llama")
    save_hf_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), load_hf_tokenizer(src),
                  tmp_path / "out" / "actor")
    make_critic_folder("tiny-llama", tmp_path / "out" / "critic")
    results = load_script("step1", "prompt_eval").main(
        ["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune", str(tmp_path / "out"),
         "--max_new_tokens", "2"])
    assert len(results) == 6 and results[0].finetune == results[0].baseline  # the same weights, greedy
    notice = f"(using the step-3 actor in {tmp_path}/out/actor for --model_name_or_path_finetune)"
    assert notice in capsys.readouterr().out
    with pytest.raises(UserError, match=rf"^--model_name_or_path {tmp_path}/out is a step-3 output folder, not a "
                                        rf"reward model; pass the step-2 --output_dir, or {tmp_path}/out/critic "):
        load_script("step2", "rw_eval").main(["--model_name_or_path", str(tmp_path / "out")])
