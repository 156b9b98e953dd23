"""ZeRO-3's prefetch trace across step 3's passes (dschat/runtime/zero3.py): after the first
PPO step every ZeRO-3 engine holds a complete trace, nothing invalidates it, and the actor
keeps its module ids through the rollout's gather; hooks_detached puts hooks back where they were.
Scoring passes on whole models (dschat/rlhf/scoring_passes.py) give the same experience."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from helpers.step3 import base_argv, step3_main

PROMPTS = torch.tensor([[3, 1, 40, 41], [1, 42, 43, 44]])  # tiny-llama ids: pad 3, bos 1
PROMPT_MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])


# ------------------------------------------------------------------------------------ hooks_detached


def test_hooks_detached_takes_the_hooks_out_and_puts_them_back_in_their_places():
    from dschat.runtime.zero3 import hooks_detached

    calls: list[str] = []
    module = torch.nn.Linear(2, 2)

    def hook(name: str):
        return lambda *args, **kwargs: calls.append(name)

    first = module.register_forward_pre_hook(hook("first"))
    other = module.register_forward_pre_hook(hook("other"))
    last = module.register_forward_pre_hook(hook("last"), with_kwargs=True)
    post = module.register_forward_hook(hook("post"), always_call=True)
    with hooks_detached([first, last, post]):
        module(torch.ones(1, 2))
        assert calls == ["other"]
        module.register_forward_pre_hook(hook("new"))
    calls.clear()
    module(torch.ones(1, 2))
    assert calls == ["first", "other", "last", "new", "post"]
    # The same handles still remove their hooks (ids and the kwargs / always-call tables kept).
    for handle in (first, last, post, other):
        handle.remove()
    calls.clear()
    module(torch.ones(1, 2))
    assert calls == ["new"]
    assert not module._forward_pre_hooks_with_kwargs and not module._forward_hooks_always_called


# ------------------------------------------------------------------------------------ PPO steps


def _trainer(critic_dirs, data_cache, *extra: str):
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.runtime.dist import init_distributed

    init_distributed()
    args = step3_main().parse_args(base_argv("tiny-llama", critic_dirs["tiny-llama"], data_cache,
                                             "--actor_zero_stage", "3", "--critic_zero_stage", "3", *extra))
    torch.manual_seed(0)
    engine = DeepSpeedRLHFEngine("tiny-llama", str(critic_dirs["tiny-llama"]), load_hf_tokenizer("tiny-llama"),
                                 args, 10)
    return DeepSpeedPPOTrainer(engine, args)


def _whole_non_persistent(engine) -> int:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(1 for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist)


def recording_gathers(monkeypatch, roles: dict[int, str]) -> list[str]:
    """Route the whole-model gathers of dschat/rlhf/scoring_passes.py through a recorder; returns the
    list it fills with the role of each model gathered (``roles``: engine id -> role), in order."""
    from dschat.rlhf import scoring_passes as zero3_gathers
    from dschat.runtime.zero3 import gathered_whole, gathered_without_hooks

    gathered_for: list[str] = []

    @contextmanager
    def recording(engine):
        with gathered_without_hooks(engine):
            assert gathered_whole(engine)
            gathered_for.append(roles[id(engine)])
            yield

    monkeypatch.setattr(zero3_gathers, "gathered_without_hooks", recording)
    return gathered_for


def _coordinators(trainer) -> dict[str, object]:
    from dschat.runtime.zero3 import parameter_offload

    engines = {"actor": trainer.actor_model, "critic": trainer.critic_model, "ref": trainer.ref_model,
               "reward": trainer.reward_model}
    return {role: parameter_offload(e).get_param_coordinator() for role, e in engines.items()}


HOOKED_TRAINING = ("--zero3_gather_for_training", "off")  # the training passes through ZeRO-3's hooks


@pytest.mark.parametrize("extra", [
    HOOKED_TRAINING,                                      # gathered once for generation, dschat's loop
    ("--zero3_gather_for_generation", "off", *HOOKED_TRAINING),  # fetched per layer for every token (HF generate)
    ("--actor_lora_dim", "4", "--enable_hybrid_engine", *HOOKED_TRAINING),  # LoRA fused into dschat's Hybrid Engine
    ("--sequence_packing", "off", "--actor_gradient_checkpointing", "--critic_gradient_checkpointing", *HOOKED_TRAINING),
    ("--zero3_gather_for_scoring", "off", *HOOKED_TRAINING),  # scoring passes fetch module by module too
    ("--zero3_gather_for_generation", "off"),             # training gathered whole: the hooked passes are the decode steps'
], ids=["gather", "per-layer", "lora-hybrid-engine", "padded-checkpointing", "scoring-per-module",
        "per-layer-training-gathered"])
def test_after_the_first_steps_every_zero3_trace_is_complete_and_stays_valid(extra, monkeypatch, critic_dirs,
                                                                             data_cache):
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    trainer = _trainer(critic_dirs, data_cache, *extra)
    coordinators = _coordinators(trainer)
    role_of = {id(c): role for role, c in coordinators.items()}
    invalidated: list[tuple[int, str]] = []
    original = PartitionedParameterCoordinator._invalidate_trace
    step = {"i": 0}

    def counting(self):
        invalidated.append((step["i"], role_of.get(id(self), "other")))
        return original(self)

    monkeypatch.setattr(PartitionedParameterCoordinator, "_invalidate_trace", counting)
    actor_ids = [m.ds_id for m in trainer.actor_model.module.modules()]
    complete_at_training: list[tuple[int, str, bool]] = []
    left_whole: list[tuple[int, str, int]] = []
    for i in range(5):
        step["i"] = i
        exp = trainer.generate_experience(PROMPTS, PROMPT_MASK, i)
        # Passes without a backward (generation, scoring) leave nothing gathered that is not persistent.
        left_whole += [(i, role, n) for role, engine in (("actor", trainer.actor_model), ("critic", trainer.critic_model),
                                                         ("ref", trainer.ref_model), ("reward", trainer.reward_model))
                       if (n := _whole_non_persistent(engine))]
        trainer.prepare_rollout([exp])
        trainer.train()
        for _, micro, _ in trainer.schedule([exp], None):
            complete_at_training += [(i, role, coordinators[role].is_complete_trace()) for role in ("actor", "critic")]
            trainer.train_rlhf(micro)
        trainer.eval()
    # The first training pass records each trained engine's trace (DeepSpeed starts them invalid) and
    # the second step's passes complete it as they begin; no pass ever leaves the recorded order --
    # generation included -- and from the third step the trace is complete before training begins.
    assert invalidated == []
    assert left_whole == []
    if "--zero3_gather_for_training" in extra:
        assert all(done for i, _, done in complete_at_training if i >= 2), complete_at_training
        assert coordinators["actor"].is_complete_trace() and coordinators["critic"].is_complete_trace()
    else:  # trained gathered whole: the critic's passes never run the hooks; the actor's decode steps
        # record its trace as a frozen model's passes do (no backward to wait for) and keep it
        assert coordinators["actor"].is_complete_trace() and not coordinators["critic"].is_complete_trace()
    # The frozen models' passes are scoring passes only: gathered whole (the default), they never run
    # DeepSpeed's hooks, so their traces are never recorded; fetched module by module, they are.
    scoring_hooked = "--zero3_gather_for_scoring" in extra
    assert all(coordinators[role].is_complete_trace() is scoring_hooked for role in ("ref", "reward"))
    # The actor's modules keep their ids through the rollout's gather (DeepSpeed's re-registration
    # renumbered them every rollout).
    assert [m.ds_id for m in trainer.actor_model.module.modules()] == actor_ids


def test_a_trained_engine_records_its_trace_at_a_pass_with_a_backward(critic_dirs, data_cache):
    from dschat.runtime.zero3 import parameter_offload
    from dschat.runtime.zero3 import zero3_pass

    trainer = _trainer(critic_dirs, data_cache, *HOOKED_TRAINING)
    critic = _coordinators(trainer)["critic"]
    assert critic.is_invalid_trace()  # as DeepSpeed builds it
    with torch.no_grad(), zero3_pass(trainer.critic_model):  # a scoring pass: the trace stays invalid ...
        pass
    assert critic.is_invalid_trace()
    with zero3_pass(trainer.critic_model):  # ... and a pass with gradients records it
        assert critic.is_record_trace()
    # The pass-start hook is the root's first, as DeepSpeed's was: a pass begins before the root's fetch.
    for engine in (trainer.actor_model, trainer.critic_model):
        offload = parameter_offload(engine)
        assert next(iter(offload.module._forward_pre_hooks)) == offload.fwd_pre_hook.id


# ------------------------------------------------------------------------------------ scoring gathered


@pytest.mark.parametrize("extra", [(), ("--critic_lora_dim", "4", "--sequence_packing", "off")],
                         ids=["packed", "padded-critic-lora"])
def test_scoring_passes_on_whole_models_give_the_same_experience(extra, critic_dirs, data_cache, capsys,
                                                                  monkeypatch):
    from dschat.rlhf.scoring_passes import ScoringGather
    from dschat.runtime.zero3 import gathered_whole

    trainer = _trainer(critic_dirs, data_cache, *extra)
    trainer.reuse_rollout_logprobs = False  # the actor's scoring pass too
    gathered_for = recording_gathers(monkeypatch, {id(trainer.actor_model): "actor", id(trainer.ref_model): "ref",
                                                   id(trainer.critic_model): "critic", id(trainer.reward_model): "reward"})
    experiences = {}
    for setting in ("auto", "off"):
        trainer.scoring_gather = ScoringGather(setting)
        gathered_for.clear()
        torch.manual_seed(7)
        experiences[setting] = trainer.generate_experience(PROMPTS, PROMPT_MASK, 0)
        assert gathered_for == (["actor", "ref", "reward", "critic"] if setting == "auto" else [])
    gathered, fetched = experiences["auto"], experiences["off"]
    for field in ("seq", "logprobs", "ref_logprobs", "values", "reward_score"):
        assert torch.equal(getattr(gathered, field), getattr(fetched, field)), field
    assert not any(gathered_whole(e) for e in (trainer.actor_model, trainer.ref_model, trainer.critic_model))
    assert "ZeRO-3 scoring: the reference's parameters gathered once per scoring pass" in capsys.readouterr().out


def test_scoring_gather_leaves_offloaded_models_where_the_user_put_them(monkeypatch, capsys):
    from contextlib import nullcontext
    from types import SimpleNamespace

    from dschat.rlhf import scoring_passes as scoring_gather

    monkeypatch.setattr(scoring_gather, "zero3_offload", lambda engine: object())  # any ZeRO-3 engine
    monkeypatch.setattr(scoring_gather, "fits_gathered", lambda module: True)
    entered: list[object] = []
    monkeypatch.setattr(scoring_gather, "gathered_without_hooks", lambda engine: entered.append(engine) or nullcontext())
    offloaded = SimpleNamespace(module=None, zero_offload_param=lambda: SimpleNamespace(device="cpu"))
    resident = SimpleNamespace(module=None, zero_offload_param=lambda: SimpleNamespace(device="none"))
    auto = scoring_gather.ScoringGather("auto")
    for name, engine in (("reference", offloaded), ("reward model", resident), ("reference", offloaded)):
        with auto(name, engine):
            pass
    assert entered == [resident]
    with scoring_gather.ScoringGather("on")("reference", offloaded):
        pass
    assert entered == [resident, offloaded]
    out = capsys.readouterr().out
    assert out.count("the reference's parameters fetched module by module (its parameters are offloaded") == 1
