"""ZeRO-3 training passes on whole models (dschat/rlhf/scoring_passes.py, ``--zero3_gather_for_training``):
the actor's and the critic's forward and backward run on their gathered parameters without ZeRO-3's
hooks, and train as the hooked passes do."""
from __future__ import annotations

import pytest
import torch

from test_zero3_trace import PROMPT_MASK, PROMPTS, _trainer, _whole_non_persistent, recording_gathers


def _train(trainer, steps: int = 3) -> tuple[list[tuple[float, float]], list[dict[str, torch.Tensor]]]:
    """PPO steps of ``trainer``: the micro-steps' losses, and the gradients each optimizer step takes."""
    from deepspeed.utils import safe_get_full_grad

    from dschat.runtime.zero3 import gathered_whole

    grads: list[dict[str, torch.Tensor]] = []
    step = trainer.nonfinite.step

    def recording_step(engine, **kwargs):
        if engine.is_gradient_accumulation_boundary():  # the micro-steps' gradients summed: what the optimizer takes
            grads.append({name: safe_get_full_grad(param).clone() for name, param in engine.module.named_parameters()
                          if param.requires_grad})
        return step(engine, **kwargs)

    trainer.nonfinite.step = recording_step
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        exp = trainer.generate_experience(PROMPTS, PROMPT_MASK, i)
        trainer.prepare_rollout([exp])
        trainer.train()
        for _, micro, _ in trainer.schedule([exp], None):
            actor_loss, critic_loss = trainer.train_rlhf(micro)
            losses.append((actor_loss.item(), critic_loss.item()))
            for engine in (trainer.actor_model, trainer.critic_model):  # released before each optimizer step
                assert not gathered_whole(engine) and _whole_non_persistent(engine) == 0
        trainer.eval()
    return losses, grads


@pytest.mark.parametrize("extra", [
    (),
    ("--actor_lora_dim", "4", "--actor_gradient_checkpointing", "--critic_gradient_checkpointing"),
    ("--sequence_packing", "off", "--gradient_accumulation_steps", "2"),
], ids=["packed", "lora-checkpointing", "padded-accumulation"])
def test_training_on_whole_models_trains_as_the_hooked_passes(extra, critic_dirs, data_cache, capsys, monkeypatch):
    runs = {}
    for setting in ("auto", "off"):
        trainer = _trainer(critic_dirs, data_cache, "--zero3_gather_for_training", setting, *extra)
        gathered_for = recording_gathers(monkeypatch, {id(trainer.actor_model): "actor", id(trainer.ref_model): "ref",
                                                       id(trainer.critic_model): "critic", id(trainer.reward_model): "reward"})
        runs[setting] = _train(trainer)
        # Each of the 3 rollouts' scoring passes gathers the critic (the actor's log-probs come from
        # generation); each micro-step's training passes gather the actor and the critic.
        micro_steps = len(runs[setting][0]) if setting == "auto" else 0
        assert (gathered_for.count("actor"), gathered_for.count("critic")) == (micro_steps, 3 + micro_steps)
    (gathered_losses, gathered), (hooked_losses, hooked) = runs["auto"], runs["off"]
    # The first micro-step's forward passes are the same to the bit (the same weights, the same
    # forward). The backward adds the same gradient contributions, some grouped differently (ZeRO-3's
    # hooks wrap each module's inputs and outputs in identity autograd nodes), so the first optimizer
    # steps' gradients agree to fp32 rounding, and the losses that follow, after Adam's steps, closely.
    assert gathered_losses[0] == hooked_losses[0]
    assert len(gathered) == len(hooked) and gathered[0].keys() == hooked[0].keys()
    for first_gathered, first_hooked in zip(gathered[:2], hooked[:2]):  # the actor's and the critic's first
        for name, grad in first_gathered.items():
            scale = float(first_hooked[name].abs().max())
            torch.testing.assert_close(grad, first_hooked[name], rtol=1e-5, atol=1e-6 * scale, msg=name)
    torch.testing.assert_close(torch.tensor(gathered_losses), torch.tensor(hooked_losses), rtol=1e-4, atol=1e-6)
    out = capsys.readouterr().out
    assert "ZeRO-3 training: the actor's parameters gathered once per forward and backward" in out
    # Said once per model as the trainer is built, and nothing for 'off' (the user chose the hooks).
    assert out.count("ZeRO-3 training: the critic's parameters gathered once per forward and backward") == 1
    assert "ZeRO-3 training: the critic's parameters fetched" not in out


def test_auto_gathers_only_where_it_costs_no_memory(monkeypatch, capsys):
    from contextlib import nullcontext
    from types import SimpleNamespace

    from dschat.rlhf import scoring_passes as training_gather

    monkeypatch.setattr(training_gather, "zero3_offload", lambda engine: object())  # any ZeRO-3 engine
    monkeypatch.setattr(training_gather, "mark_trained_whole", lambda engine, whole: None)
    entered: list[object] = []
    monkeypatch.setattr(training_gather, "gathered_without_hooks", lambda engine: entered.append(engine) or nullcontext())
    resident = SimpleNamespace(device="none")
    one_rank = SimpleNamespace(zero_offload_param=lambda: resident, ranks=1, quantized=False)
    two_ranks = SimpleNamespace(zero_offload_param=lambda: resident, ranks=2, quantized=False)
    offloaded = SimpleNamespace(zero_offload_param=lambda: SimpleNamespace(device="cpu"), ranks=1, quantized=False)
    quantized = SimpleNamespace(zero_offload_param=lambda: resident, ranks=1, quantized=True)  # MixZ++
    monkeypatch.setattr(training_gather, "whole_partitions", lambda engine: engine.ranks == 1)
    monkeypatch.setattr(training_gather, "quantized_partitions", lambda engine: engine.quantized)
    auto = training_gather.TrainingGather("auto", {"actor": one_rank, "critic": None})  # decided as it is built
    assert auto.decided == {"actor": True}
    for name, engine in (("actor", one_rank), ("critic", two_ranks), ("reward", offloaded), ("base", quantized),
                         ("actor", one_rank)):
        with auto(name, engine):
            pass
    assert entered == [one_rank, one_rank]
    with training_gather.TrainingGather("on")("critic", two_ranks):
        pass
    assert entered[-1] is two_ranks
    with training_gather.TrainingGather("off")("actor", one_rank):
        pass
    assert len(entered) == 3
    out = capsys.readouterr().out
    assert out.count("the actor's parameters gathered once per forward and backward") == 1
    assert "the critic's parameters fetched module by module (it is partitioned over more than one rank" in out
    assert "the reward's parameters fetched module by module (its parameters are offloaded" in out
    assert "the base's parameters fetched module by module (its frozen weights are stored quantized" in out
    with pytest.raises(ValueError, match="--zero3_gather_for_training must be auto, on or off"):
        training_gather.TrainingGather("yes")


def test_an_engine_trained_whole_records_its_trace_at_passes_without_gradients(critic_dirs, data_cache):
    from dschat.runtime.zero3 import mark_trained_whole, parameter_offload, trained_whole, whole_partitions
    from dschat.runtime.zero3 import zero3_pass

    trainer = _trainer(critic_dirs, data_cache)  # auto, one rank: both trained models marked as it is built
    assert trained_whole(trainer.actor_model) and trained_whole(trainer.critic_model)
    trainer = _trainer(critic_dirs, data_cache, "--zero3_gather_for_training", "off")
    critic = parameter_offload(trainer.critic_model).get_param_coordinator()
    assert whole_partitions(trainer.critic_model) and not trained_whole(trainer.critic_model)
    with torch.no_grad(), zero3_pass(trainer.critic_model):  # hooked training to come: wait for its backward
        pass
    assert critic.is_invalid_trace()
    mark_trained_whole(trainer.critic_model)  # its training passes run gathered: this pass is all there is
    with torch.no_grad(), zero3_pass(trainer.critic_model):
        assert critic.is_record_trace()
    mark_trained_whole(trainer.critic_model, False)
    assert not trained_whole(trainer.critic_model)


def test_quantized_partitions_reads_mixzs_quantized_storage():
    from types import SimpleNamespace

    from dschat.runtime.zero3 import quantized_partitions

    module = torch.nn.Linear(2, 2)
    module.weight.ds_tensor = torch.zeros(4)
    engine = SimpleNamespace(module=module)
    assert not quantized_partitions(engine)  # the bias is no ZeRO-3 parameter at all, the weight's partition plain
    module.weight.ds_tensor.ds_quant_scale = torch.ones(1)
    assert quantized_partitions(engine)


def test_offloaded_zero3_engines_keep_their_hooks_under_auto(critic_dirs, data_cache, capsys):
    """``--offload`` (ZeRO-3 keeps the parameters off the accelerator): ``auto`` leaves actor and critic
    to ZeRO-3's hooks, which fetch one module at a time, and the PPO step trains."""
    from dschat.runtime.zero3 import params_offloaded, trained_whole

    trainer = _trainer(critic_dirs, data_cache, "--offload")
    assert params_offloaded(trainer.actor_model) and params_offloaded(trainer.critic_model)
    losses, _ = _train(trainer, steps=1)
    assert all(torch.isfinite(torch.tensor(pair)).all() for pair in losses)
    assert not trained_whole(trainer.actor_model) and trainer.training_gather.decided == {"actor": False, "critic": False}
    assert "ZeRO-3 training: the critic's parameters fetched module by module (its parameters are offloaded" in capsys.readouterr().out


def test_the_ptx_step_trains_on_the_whole_actor_as_the_hooked_one(critic_dirs, data_cache):
    """PPO-ptx's language-model step (``train_unsupervised``) runs on the gathered actor too: the same
    loss, gradients within fp32 rounding of the hooked pass's."""
    from deepspeed.utils import safe_get_full_grad

    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainerUnsupervised
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.runtime.dist import init_distributed
    from helpers.step3 import base_argv, step3_main

    init_distributed()
    ids = torch.tensor([[1, 40, 41, 42, 43, 44], [1, 45, 46, 47, 48, 3]])
    batch = {"input_ids": ids, "attention_mask": (ids != 3).long(), "labels": torch.where(ids == 3, -100, ids)}
    runs = {}
    for setting in ("auto", "off"):
        args = step3_main().parse_args(base_argv(
            "tiny-llama", critic_dirs["tiny-llama"], data_cache, "--actor_zero_stage", "3", "--critic_zero_stage", "3",
            "--unsupervised_dataset_name", "dschat/builtin", "--unsup_coef", "0.5",
            "--zero3_gather_for_training", setting))
        torch.manual_seed(0)
        engine = DeepSpeedRLHFEngine("tiny-llama", str(critic_dirs["tiny-llama"]), load_hf_tokenizer("tiny-llama"),
                                     args, 10)
        trainer = DeepSpeedPPOTrainerUnsupervised(engine, args)
        grads = {}
        step = trainer.nonfinite.step

        def recording_step(model, **kwargs):
            grads.update({n: safe_get_full_grad(p).clone() for n, p in model.module.named_parameters() if p.requires_grad})
            return step(model, **kwargs)

        trainer.nonfinite.step = recording_step
        trainer.train()
        loss = trainer.train_unsupervised(batch, 0.5).item()
        runs[setting] = (loss, grads, trainer.training_gather.decided)
    (loss, grads, decided), (hooked_loss, hooked_grads, _) = runs["auto"], runs["off"]
    assert decided == {"actor": True, "critic": True} and loss == hooked_loss and grads.keys() == hooked_grads.keys()
    for name, grad in grads.items():
        scale = float(hooked_grads[name].abs().max())
        torch.testing.assert_close(grad, hooked_grads[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


TWO_RANKS = r'''
import gc
import os
import sys

import torch
from deepspeed.utils import safe_get_full_grad

sys.path.insert(0, os.environ["DSCHAT_TESTS"])
from helpers.step3 import base_argv, step3_main

from dschat.models.tokenizer import load_hf_tokenizer
from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
from dschat.rlhf.scoring_passes import TrainingGather
from dschat.runtime.dist import destroy_gloo_group, init_distributed
from dschat.runtime.zero3 import gathered_whole, whole_partitions

info = init_distributed()
critic, data = os.environ["CRITIC"], os.environ["DATA"]
prompts = torch.tensor([[3, 1, 40, 41], [1, 42, 43, 44]]) + info.rank  # each rank its own prompts
mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
runs = {}
for setting in ("on", "off"):
    args = step3_main().parse_args(base_argv("tiny-llama", critic, data, "--actor_zero_stage", "3", "--critic_zero_stage",
                                             "3", "--gradient_accumulation_steps", "2", "--zero3_gather_for_training",
                                             setting))
    torch.manual_seed(0)
    trainer = DeepSpeedPPOTrainer(DeepSpeedRLHFEngine("tiny-llama", critic, load_hf_tokenizer("tiny-llama"), args, 10), args)
    if setting == "off":  # two ranks: auto keeps the hooks too
        assert not whole_partitions(trainer.actor_model)
        assert TrainingGather("auto", {"actor": trainer.actor_model}).decided == {"actor": False}
    grads, losses, step = [], [], trainer.nonfinite.step

    def recording_step(engine, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad})
        return step(engine, **kwargs)

    trainer.nonfinite.step = recording_step
    for i in range(4):  # one micro-step a rollout: two optimizer steps of each model
        torch.manual_seed(100 + i)
        exp = trainer.generate_experience(prompts, mask, i)
        trainer.prepare_rollout([exp])
        trainer.train()
        for _, micro, _ in trainer.schedule([exp], None):
            losses.append([loss.item() for loss in trainer.train_rlhf(micro)])
            assert not gathered_whole(trainer.actor_model) and not gathered_whole(trainer.critic_model)
        trainer.eval()
    runs[setting] = (grads, losses, trainer.training_gather.decided)
(grads, losses, decided), (hooked_grads, hooked_losses, _) = runs["on"], runs["off"]
assert decided == {"actor": True, "critic": True} and losses[0] == hooked_losses[0]
assert len(grads) == len(hooked_grads) == 4, len(grads)  # actor and critic, two optimizer steps
for ours, theirs in zip(grads[:2], hooked_grads[:2]):  # the first steps' (the second's start from other weights)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-6 * float(theirs[name].abs().max()))
torch.testing.assert_close(torch.tensor(losses), torch.tensor(hooked_losses), rtol=1e-4, atol=1e-6)
print(f"TWO-RANKS-OK rank {info.rank}", flush=True)
# Drop the engines (and the gloo work their tensors keep) before the group goes: left to the
# interpreter's teardown, a rank once aborted after finishing ("terminate called without an active exception").
del trainer, runs, grads, hooked_grads
gc.collect()
torch.distributed.barrier()
destroy_gloo_group()
'''


@pytest.mark.slow
def test_on_trains_across_two_ranks_as_the_hooked_passes(tmp_path, critic_dirs, data_cache):
    """Two real ranks (DeepSpeed launcher, gloo): ``auto`` keeps ZeRO-3's hooks (each rank would hold a
    full copy); ``on`` gathers, and its optimizer steps' gradients, reduced over the ranks, agree with
    the hooked passes' to fp32 rounding."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from dschat.multinode import free_port
    from helpers.step3 import subprocess_env

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
    env = {**subprocess_env(), "DSCHAT_TESTS": str(Path(__file__).resolve().parents[1]),
           "CRITIC": str(critic_dirs["tiny-llama"]), "DATA": str(data_cache)}
    proc = subprocess.run([launcher, "--master_port", str(free_port()), "--num_gpus", "2", str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TWO-RANKS-OK") == 2, proc.stdout[-3000:]
