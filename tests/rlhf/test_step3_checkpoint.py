"""Step-3 checkpoints and exact resume (--save_interval counts PPO iterations): a run stopped after
a checkpoint and resumed reproduces the uninterrupted run's losses, rewards and final actor, critic
and EMA weights bit for bit (CPU, ZeRO 0 and 2); and the non-finite guard skips a rollout whose
reward is NaN; a checkpoint is written only between optimizer steps (--gradient_accumulation_steps
larger than a rollout's micro-steps)."""
from __future__ import annotations

import json
import math
import re

import pytest

from dschat.training import checkpoint as ckpt

from helpers.step3 import Interrupted, base_argv, crash_after_checkpoint, load_state, max_abs_diff, step3_main

pytestmark = pytest.mark.slow

COMPARED = ("actor_loss", "critic_loss", "reward", "kl_to_ref", "ema_reward", "response_length")


CASES = {
    # sampling, dropout in the actor and critic (random states matter), EMA
    "z0-ema": ("tiny-opt", ["--enable_ema", "--actor_dropout", "0.1", "--critic_dropout", "0.1"]),
    # bf16: the EMA averages into an fp32 copy of its weights, which the checkpoint must hold
    "z0-bf16-ema": ("tiny-opt", ["--enable_ema", "--dtype", "bf16"]),
    # ZeRO-2 actor and critic, two PPO epochs over two generation batches (Python's shuffle state)
    "z2-multi": ("tiny-llama", ["--actor_zero_stage", "2", "--critic_zero_stage", "2", "--generation_batches", "2",
                                "--ppo_epochs", "2", "--per_device_training_batch_size", "2"]),
    # ZeRO-3 actor (reference and EMA then ZeRO-3 too) and critic, LoRA on the actor
    "z3-lora-ema": ("tiny-llama", ["--actor_zero_stage", "3", "--critic_zero_stage", "3", "--actor_lora_dim", "4",
                                   "--enable_ema"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interrupted_and_resumed_ppo_matches_the_uninterrupted_run(case, tmp_path, critic_dirs, data_cache,
                                                                   monkeypatch):
    model, extra = CASES[case]
    main = step3_main().main

    def argv(out, *more):
        return base_argv(model, critic_dirs[model], data_cache, *extra, "--save_interval", "1",
                         "--output_dir", str(out), *more, steps=6)

    full = main(argv(tmp_path / "full"))
    iterations = len(full.history)
    assert iterations >= 3

    crash_after_checkpoint(monkeypatch, optimizer_steps=2)
    with pytest.raises(Interrupted):
        main(argv(tmp_path / "resumed"))
    monkeypatch.undo()
    root = tmp_path / "resumed" / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000001", "step_00000002"]
    # A line the killed run wrote past its checkpoint is dropped on resume (no duplicate iterations).
    with (tmp_path / "resumed" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"global_step": 2, "reward": 123.0}) + "\n")

    resumed = main(argv(tmp_path / "resumed", "--resume"))
    assert len(resumed.history) == iterations - 2
    for a, b in zip(full.history[2:], resumed.history):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}
        assert a["global_step"] == b["global_step"]
    for name in ("actor", "critic") + (("actor_ema",) if "--enable_ema" in extra else ()):
        assert max_abs_diff(load_state(tmp_path / "full" / name), load_state(tmp_path / "resumed" / name)) == 0.0, name
    lines = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in lines] == list(range(iterations))
    # Resumed from the last checkpoint (e.g. killed during the final save): nothing left to train.
    again = main(argv(tmp_path / "resumed", "--resume"))
    assert again.history == []
    assert max_abs_diff(load_state(tmp_path / "full" / "actor"), load_state(tmp_path / "resumed" / "actor")) == 0.0


def test_a_checkpoint_due_partway_through_gradient_accumulation_waits_for_the_optimizer_step(
        tmp_path, critic_dirs, data_cache, monkeypatch, capsys):
    # One micro-step per rollout, two per optimizer step: after iteration 3 the actor and the critic
    # hold half-accumulated gradients, which no checkpoint holds (and DeepSpeed counts micro-steps
    # from 0 again on resume). The checkpoint due then is written after iteration 4, and a run killed
    # after it resumes into the uninterrupted run's weights bit for bit.
    from dschat.rlhf import ppo_loop

    main = step3_main().main

    def argv(out, *more):
        return base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--gradient_accumulation_steps", "2",
                         "--save_interval", "3", "--output_dir", str(out), *more, steps=6)

    full = main(argv(tmp_path / "full"))
    assert len(full.history) == 6
    out = capsys.readouterr().out
    assert out.count("[checkpoint] the checkpoint due after PPO iteration 3 waits") == 1
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "full" / "checkpoints")] == [
        "step_00000004", "step_00000006"]

    root = tmp_path / "resumed" / "checkpoints"
    train_rollout = ppo_loop.train_rollout

    def killed_after_the_first_checkpoint(*a, **k):
        if ckpt.complete_checkpoints(root):
            raise Interrupted
        return train_rollout(*a, **k)

    monkeypatch.setattr(ppo_loop, "train_rollout", killed_after_the_first_checkpoint)
    with pytest.raises(Interrupted):
        main(argv(tmp_path / "resumed"))
    monkeypatch.undo()
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000004"]
    resumed = main(argv(tmp_path / "resumed", "--resume"))
    assert len(resumed.history) == 2
    for a, b in zip(full.history[4:], resumed.history):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}
    for name in ("actor", "critic"):
        assert max_abs_diff(load_state(tmp_path / "full" / name), load_state(tmp_path / "resumed" / name)) == 0.0, name


def test_a_rollout_with_a_nan_reward_is_skipped(tmp_path, critic_dirs, data_cache, capsys):
    calls = []

    def reward_fn(prompts, answers):
        calls.append(len(answers))
        return [float("nan") if len(calls) == 2 else 0.1 * len(a.split()) for a in answers]

    result = step3_main().main(base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, steps=3),
                               reward_fn=reward_fn)
    assert result.skipped_nonfinite == 1 and len(result.history) == 2
    assert all(math.isfinite(r["actor_loss"]) and math.isfinite(r["reward"]) for r in result.history)
    assert "non-finite log-probs, values or reward in the rollout of step 1; rollout skipped" in capsys.readouterr().out



def test_a_nan_reward_on_a_dropped_answer_skips_the_rollout_too(monkeypatch, tmp_path, critic_dirs, data_cache, capsys):
    """GRPO: a nan score on an answer dropped as too short still enters its group's mean (every answer
    of the group would get a nan advantage), so the rollout is skipped as for a kept answer's nan."""
    from dschat.rlhf import experience_maker
    from dschat.rlhf.experience import SequenceMasks, sequence_masks

    calls = []

    def masks_with_row_0_dropped_in_the_second_rollout(prompt_mask, seq, eos):
        masks = sequence_masks(prompt_mask, seq, eos)
        if len(calls) == 1:  # the second rollout (calls counts the reward function's calls so far)
            lengths = masks.answer_lengths.clone()
            lengths[0] = 1
            return SequenceMasks(masks.attention_mask, masks.position_ids, lengths)
        return masks

    def reward_fn(prompts, answers):
        calls.append(len(answers))
        return [float("nan") if len(calls) == 2 and i == 0 else 0.1 * len(a.split()) for i, a in enumerate(answers)]

    monkeypatch.setattr(experience_maker, "sequence_masks", masks_with_row_0_dropped_in_the_second_rollout)
    result = step3_main().main(base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--algorithm", "grpo",
                                         "--num_generations", "2", steps=3), reward_fn=reward_fn)
    out = capsys.readouterr().out
    assert "Dropping too short generated answer: step=1" in out
    assert "non-finite log-probs, values or reward in the rollout of step 1; rollout skipped" in out
    assert result.skipped_nonfinite == 1 and len(result.history) == 2
    assert all(math.isfinite(r["actor_loss"]) for r in result.history)


def test_a_resume_scored_by_another_reward_model_is_refused_a_copy_of_it_is_not(tmp_path, critic_dirs, data_cache):
    """The reward and reference models are not in a checkpoint: they come from the model flags again. A
    resume whose reward model has other weights than the run's (here --reward_model_name_or_path, the
    run's came from the critic's folder) is one line; a copy of the same weights elsewhere resumes."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dschat.errors import UserError

    main = step3_main().main
    critic = critic_dirs["tiny-opt"]

    def argv(*more):
        return base_argv("tiny-opt", critic, data_cache, "--save_interval", "1", "--output_dir", str(tmp_path / "o"),
                         *more, steps=1)

    main(argv())
    other = shutil.copytree(critic, tmp_path / "other_rm")
    for weights in other.glob("*.safetensors"):
        save_file({k: v + 0.01 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    folder = ckpt.checkpoint_root(tmp_path / "o") / ckpt.checkpoint_name(1)
    with pytest.raises(UserError) as err:
        main(argv("--resume", "--reward_model_name_or_path", str(other)))
    assert str(err.value).startswith(f"{folder} is of a run whose reward model started from other weights "
                                     f"({critic}) than --reward_model_name_or_path {other};")
    same = shutil.copytree(critic, tmp_path / "same_rm")
    assert main(argv("--resume", "--reward_model_name_or_path", str(same))).history == []


def test_a_resume_with_other_models_to_train_is_refused_both_ways(tmp_path, critic_dirs, data_cache):
    """A checkpoint holds the models its run trained. A resume that would train one more (--enable_ema on
    a run without it) or one fewer (a critic-free algorithm on a PPO checkpoint, which dropped the
    critic's state without a word) is one line naming both sets."""
    from dschat.errors import UserError

    main = step3_main().main

    def argv(out, *more):
        return base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--save_interval", "1", "--output_dir",
                         str(tmp_path / out), *more, steps=1)

    main(argv("ppo"))
    folder = ckpt.checkpoint_root(tmp_path / "ppo") / ckpt.checkpoint_name(1)
    grpo = ("--algorithm", "grpo", "--num_generations", "2", "--reward_fn", "dschat.rewards:gold")
    for more, wanted in ((("--enable_ema",), "actor, actor_ema, critic"), (grpo, "actor")):
        with pytest.raises(UserError) as err:
            main(argv("ppo", "--resume", *more))
        assert str(err.value) == (f"{folder} holds actor, critic and this run trains {wanted}: it was written by "
                                  "another step, or with other flags (a critic, --enable_ema); resume with the flags "
                                  "that wrote it")
    assert main(argv("ppo", "--resume")).history == []


def test_a_resume_on_another_plan_lays_both_lr_schedules_over_the_steps_this_run_takes(tmp_path, critic_dirs,
                                                                                        data_cache, capsys):
    """A cosine run checkpointed after one PPO step and resumed with twice the gradient accumulation:
    the actor's and the critic's restored schedules are laid over the step done plus the steps this
    run takes (this run's own plan counts from step 0 at the new accumulation)."""
    main = step3_main().main

    def argv(*more):
        return base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--lr_scheduler_type", "cosine",
                         "--save_interval", "1", "--output_dir", str(tmp_path / "o"), *more, steps=1)

    main(argv())
    capsys.readouterr()
    main(argv("--resume", "--gradient_accumulation_steps", "2"))
    printed = capsys.readouterr().out
    for name in ("actor", "critic"):
        found = re.search(rf"\[checkpoint\] {name}: the LR schedule was laid over (\d+) optimizer steps by the run "
                          r"that wrote the checkpoint and this run plans (\d+): it is laid over (\d+) now \(1 done, "
                          r"(\d+) to go\)", printed)
        assert found, printed
        saved, planned, total, left = map(int, found.groups())
        assert total == 1 + left == 1 + math.ceil((saved - 1) / 2) and planned == math.ceil(saved / 2)


def test_a_resume_past_this_runs_end_is_refused_and_keeps_the_final_models(tmp_path, critic_dirs, data_cache):
    """A run of 2 generation batches resumed with --test_stop_step 1 (a roll-back meant) would train nothing
    and save its 2-batch models as the 1-batch run's: one line, the final models left as they were. At the
    end exactly (2 again: a run killed in its final save) only the final save is left."""
    from dschat.errors import UserError

    main = step3_main().main
    out = tmp_path / "o"

    def argv(steps, *more):
        return base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--save_interval", "1", "--output_dir",
                         str(out), *more, steps=steps)

    main(argv(2))
    final = {name: (out / name / "model.safetensors").read_bytes() for name in ("actor", "critic")}
    with pytest.raises(UserError, match=r"^the checkpoint resumed from has 2 generation batches done, past "
                                        r"--test_stop_step 1: .*--resume_from an earlier"):
        main(argv(1, "--resume"))
    assert {name: (out / name / "model.safetensors").read_bytes() for name in final} == final
    assert main(argv(2, "--resume")).history == []
