"""Optimizer groups, the optimizer choice and its math, the scheduler and the step count."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import OPTConfig, OPTForCausalLM

from dschat.errors import UserError
from dschat.models.lora import convert_linear_layer_to_lora, only_optimize_lora_parameters
from dschat.runtime import optim as optim_mod
from dschat.runtime.optim import (
    create_optimizer,
    SCHEDULER_TYPES,
    create_scheduler,
    relay_schedule,
    get_optimizer_grouped_parameters,
    num_update_steps,
)


def tiny_opt(layers: int = 1) -> OPTForCausalLM:
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=layers, ffn_dim=64,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                    dropout=0.0))


def group_names(model: nn.Module, groups: list) -> list:
    """Each group as (its non-param options, the names of its params)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]]) for g in groups]


L0 = "model.decoder.layers.0."


def test_groups_for_tiny_lora_model():
    model = convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=2)
    got = group_names(model, get_optimizer_grouped_parameters(model, 0.1, lora_lr=5e-4))
    assert got == [
        # (1) decay, not LoRA. Wrapped Linear weights are frozen by the conversion, so absent;
        # lm_head is tied to embed_tokens and listed once.
        ({"weight_decay": 0.1}, ["model.decoder.embed_tokens.weight", "model.decoder.embed_positions.weight"]),
        # (2) LoRA factors, own LR
        ({"weight_decay": 0.1, "lr": 5e-4}, [
            L0 + "self_attn.k_proj.lora_right_weight", L0 + "self_attn.k_proj.lora_left_weight",
            L0 + "self_attn.v_proj.lora_right_weight", L0 + "self_attn.v_proj.lora_left_weight",
            L0 + "self_attn.q_proj.lora_right_weight", L0 + "self_attn.q_proj.lora_left_weight",
            L0 + "self_attn.out_proj.lora_right_weight", L0 + "self_attn.out_proj.lora_left_weight",
            L0 + "fc1.lora_right_weight", L0 + "fc1.lora_left_weight",
            L0 + "fc2.lora_right_weight", L0 + "fc2.lora_left_weight",
        ]),
        # (3) no decay: biases and layer norms
        ({"weight_decay": 0.0}, [
            "model.decoder.final_layer_norm.weight", "model.decoder.final_layer_norm.bias",
            L0 + "self_attn.k_proj.bias", L0 + "self_attn.v_proj.bias", L0 + "self_attn.q_proj.bias",
            L0 + "self_attn.out_proj.bias", L0 + "self_attn_layer_norm.weight", L0 + "self_attn_layer_norm.bias",
            L0 + "fc1.bias", L0 + "fc2.bias", L0 + "final_layer_norm.weight", L0 + "final_layer_norm.bias",
        ]),
    ]


def test_empty_groups_are_dropped():
    # Only LoRA trainable: groups (1) and (3) are empty (DSE #755/#756 crash on empty groups).
    lora_only = only_optimize_lora_parameters(convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=2))
    groups = get_optimizer_grouped_parameters(lora_only, 0.1, lora_lr=1e-3)
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == [{"weight_decay": 0.1, "lr": 1e-3}]
    # No LoRA at all: the LoRA group is dropped.
    plain = get_optimizer_grouped_parameters(tiny_opt(), 0.0)
    assert [{k: v for k, v in g.items() if k != "params"} for g in plain] == [{"weight_decay": 0.0},
                                                                              {"weight_decay": 0.0}]


def test_no_decay_matching_is_lower_cased_substring():
    model = nn.Module()
    model.dense = nn.Linear(2, 2, bias=False)
    model.LayerNorm = nn.LayerNorm(2, bias=False)  # BERT-style capitalised name -> "layernorm.weight"
    got = group_names(model, get_optimizer_grouped_parameters(model, 0.01))
    assert got == [({"weight_decay": 0.01}, ["dense.weight"]), ({"weight_decay": 0.0}, ["LayerNorm.weight"])]


def test_cpu_without_offload_uses_adamw_with_upstream_settings():
    model = convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=2)
    opt = create_optimizer(get_optimizer_grouped_parameters(model, 0.1, lora_lr=5e-4), lr=1e-5, offload=False)
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["fused"] is True  # torch's fused CPU kernel, not the per-tensor loop
    assert [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in opt.param_groups] == [
        (1e-5, 0.1, (0.9, 0.95), 1e-8), (5e-4, 0.1, (0.9, 0.95), 1e-8), (1e-5, 0.0, (0.9, 0.95), 1e-8)]


def test_cpu_fused_adamw_follows_the_per_tensor_loop_to_fp32_rounding():
    """The fused kernel rounds differently from torch's default loop, nothing more: after five steps
    of a LoRA model's three groups (decay, LoRA lr, no decay) on its real gradients, every trained
    tensor has moved and lies within 1e-4 of its movement from the loop's (measured: 5e-6; a wrong
    lr, decay or bias correction would be off by more than 1e-2). The keys' biases are left out:
    softmax ignores a shift shared by a row's logits, so their gradient is zero in exact arithmetic,
    and the steps Adam takes on its rounding noise differ between any two orderings."""
    def train(make):
        model = convert_linear_layer_to_lora(tiny_opt(layers=2), "decoder.layers.", lora_dim=4)
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # LoRA freezes the bases
        start = [p.detach().clone() for _, p in trained]
        opt = make(get_optimizer_grouped_parameters(model, 0.1, lora_lr=1e-2))
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        for _ in range(5):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [(n, before, p.detach()) for (n, p), before in zip(trained, start)]

    fused = train(lambda groups: create_optimizer(groups, lr=1e-3, offload=False))
    loop = train(lambda groups: torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                                  weight_decay=0.0, foreach=False))
    compared = 0
    for (name, before, a), (_, _, b) in zip(fused, loop):
        if name.endswith("k_proj.bias"):
            continue
        moved = float((a - before).abs().max())
        assert moved > 0, name
        assert float((a - b).abs().max()) <= 1e-4 * moved, name
        compared += 1
    assert compared > 20


def test_non_cpu_accelerator_uses_fused_adam(monkeypatch):
    calls = []

    class FakeFusedAdam:  # the real one needs the CUDA-built kernel
        def __init__(self, params, **kwargs):
            calls.append((params, kwargs))

    monkeypatch.setattr(optim_mod, "_accelerator_name", lambda: "cuda")
    monkeypatch.setattr(optim_mod, "FusedAdam", FakeFusedAdam)
    groups = [{"params": [nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}]
    assert isinstance(create_optimizer(groups, lr=3e-4, offload=False), FakeFusedAdam)
    assert calls == [(groups, {"lr": 3e-4, "betas": (0.9, 0.95)})]


def fused_adam_reference(p, grads, *, lr, betas, eps, weight_decay):
    """FusedAdam, ADAM_MODE_1 (adam_w_mode=True, its default), transcribed from DeepSpeed's
    csrc/adam/multi_tensor_adam.cu:

        m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
        update = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + decay * p
        p = p - lr * update
    """
    p = p.clone().double()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + weight_decay * p
        p = p - lr * update
    return p.float()


def run_optimizer(make_opt, p0, grads):
    p = nn.Parameter(p0.clone())
    opt = make_opt([{"params": [p], "weight_decay": 0.1}])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_cpu_adamw_matches_fused_adam_update_by_hand():
    p0 = torch.tensor([1.0, -2.0])
    g = torch.tensor([0.5, 0.25])
    # Step 1 by hand (lr 0.1, betas (0.9, 0.95), wd 0.1): bias correction makes m_hat = g, v_hat = g^2,
    # so the Adam direction is g/|g| = [1, 1] (up to eps), and
    #   p = p - lr * (1 + wd * p) = [1 - 0.1*1.1, -2 - 0.1*0.8] = [0.89, -2.08]
    make = lambda groups: create_optimizer(groups, lr=0.1, offload=False)
    stepped = run_optimizer(make, p0, [g])
    torch.testing.assert_close(stepped, torch.tensor([0.89, -2.08]))
    torch.testing.assert_close(stepped, fused_adam_reference(p0, [g], lr=0.1, betas=(0.9, 0.95), eps=1e-8,
                                                             weight_decay=0.1))
    # Several steps with varying gradients: bias corrections and decay keep agreeing.
    grads = [torch.randn(5, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    p0 = torch.randn(5, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(run_optimizer(make, p0, grads),
                               fused_adam_reference(p0, grads, lr=0.1, betas=(0.9, 0.95), eps=1e-8,
                                                    weight_decay=0.1))


@pytest.mark.slow
def test_offload_uses_deepspeed_cpu_adam_under_zero2():
    """The one test that JIT-compiles DeepSpeedCPUAdam (~40 s the first time, then cached)."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from dschat.runtime.dist import init_distributed
    from dschat.runtime.ds_config import get_train_ds_config

    init_distributed()
    # Same math as FusedAdam / AdamW on the hand-made tensor.
    grads = [torch.randn(5, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    p0 = torch.randn(5, generator=torch.Generator().manual_seed(9))
    cpu_adam = run_optimizer(lambda groups: create_optimizer(groups, lr=0.1, offload=True), p0, grads)
    torch.testing.assert_close(cpu_adam, fused_adam_reference(p0, grads, lr=0.1, betas=(0.9, 0.95), eps=1e-8,
                                                              weight_decay=0.1))
    # And one ZeRO-2 step with the optimizer offloaded to CPU.
    model = convert_linear_layer_to_lora(tiny_opt(layers=2), "decoder.layers.", lora_dim=4)
    optimizer = create_optimizer(get_optimizer_grouped_parameters(model, 0.0, lora_lr=1e-2), lr=1e-3, offload=True)
    assert type(optimizer) is DeepSpeedCPUAdam
    cfg = get_train_ds_config(True, "fp32", 2, micro_batch_size=2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    left = engine.module.model.decoder.layers[0].fc1.lora_left_weight
    before = left.detach().clone()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = engine(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    engine.backward(loss)
    engine.step()
    assert not torch.equal(left.detach(), before)


def test_scheduler_linear_warmup_and_decay():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = create_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])


# transformers' polynomial schedule divides by zero at the last step of a run that is all warmup
# (warmup == total); dschat's ends it at lr_end (the test below).
@pytest.mark.parametrize("name,warmup,total", [
    (name, warmup, total) for name in SCHEDULER_TYPES
    for warmup, total in [(0, 1), (0, 10), (3, 10), (10, 10), (12, 10), (1, 2)]
    if not (name == "polynomial" and warmup == total)])
def test_every_scheduler_is_transformers_step_by_step(name, warmup, total):
    """create_scheduler's schedules are transformers.get_scheduler's (upstream's call), bit for bit,
    past the last step too, and their state dicts are alike."""
    from transformers import get_scheduler

    ours_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.3)
    theirs_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.3)
    ours = create_scheduler(name, ours_opt, warmup, total)
    theirs = get_scheduler(name, theirs_opt, num_warmup_steps=warmup, num_training_steps=total)
    for _ in range(total + 4):
        assert ours.get_last_lr() == theirs.get_last_lr()
        ours_opt.step(), theirs_opt.step()
        ours.step(), theirs.step()
    # Alike but for the lambdas: ours keep their schedule (restored with a checkpoint), transformers' none.
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.pop("lr_lambdas")[0]["kind"] == name and theirs_state.pop("lr_lambdas") in ([None], [{}])
    assert ours_state == theirs_state


def test_polynomial_scheduler_refuses_a_learning_rate_at_its_end_and_ends_an_all_warmup_run():
    with pytest.raises(UserError, match="polynomial decays to 1e-07"):
        create_scheduler("polynomial", torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0), 0, 10)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = create_scheduler("polynomial", opt, 4, 4)
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step(), sched.step()
    assert lrs == pytest.approx([0.0, 0.25, 0.5, 0.75, 1e-7, 1e-7])


def test_scheduler_rejects_unknown_type():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(UserError, match="lr_scheduler_type"):
        create_scheduler("triangular", opt, 0, 10)


def test_num_update_steps():
    assert num_update_steps(num_batches=10, epochs=3, grad_accum=4) == 9   # 3 * ceil(10/4)
    assert num_update_steps(num_batches=8, epochs=2, grad_accum=4) == 4
    assert num_update_steps(num_batches=0, epochs=1, grad_accum=1) == 0
    with pytest.raises(UserError, match="gradient_accumulation_steps"):
        num_update_steps(num_batches=8, epochs=1, grad_accum=0)


def test_warmup_past_the_schedule_is_a_warning(capsys):
    create_scheduler("linear", torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 10, 10)
    assert "WARNING: --num_warmup_steps 10 is at least the 10 optimizer steps" in capsys.readouterr().out
    create_scheduler("linear", torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 9, 10)
    create_scheduler("constant", torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 20, 10)
    assert "WARNING" not in capsys.readouterr().out


def _constant_resumed_as(kind: str, done: int, lr: float, warmup: int, planned: int):
    """A constant schedule (lr 0.1) stepped ``done`` times, loaded into this run's ``kind`` one (lr,
    warmup, planned steps): (this run's optimizer, its scheduler, this run's settings before the load)."""
    from dschat.runtime.optim import FlagSchedule

    saved_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    saved = create_scheduler("constant", saved_opt, 0, done + 54)
    for _ in range(done):
        saved_opt.step(), saved.step()
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    ours = create_scheduler(kind, opt, warmup, planned)
    wanted = FlagSchedule.of(ours)
    ours.load_state_dict(saved.state_dict())
    return opt, ours, wanted


def test_a_changed_schedule_on_resume_names_each_side_as_it_is():
    """A checkpoint's constant schedule loaded into this run's linear one with warmup: the line names
    the checkpoint's kind without the warmup it never had, and this run's settings apply from its step."""
    from dschat.runtime.optim import FlagSchedule, follow_flags

    opt, ours, wanted = _constant_resumed_as("linear", 4, 0.2, 2, 10)
    line = follow_flags(wanted, ours)
    assert line == ("this run's learning rates and LR schedule (lr 0.2, linear, 2 warmup steps) apply from the step "
                    "it resumes at; the checkpoint's were lr 0.1, constant")
    # The constant schedule had no length: the linear one is laid over the steps done and to go.
    assert relay_schedule(ours, 10, 6) == ("the checkpoint's LR schedule was laid over no number of optimizer steps "
                                           "(a constant one): this run's is laid over 10 (4 done, 6 to go)")
    assert ours.get_last_lr() == [pytest.approx(0.2 * (10 - 4) / (10 - 2))]
    assert opt.param_groups[0]["lr"] == ours.get_last_lr()[0]
    assert follow_flags(FlagSchedule.of(ours), ours) is None


def test_a_constant_schedule_resumed_as_cosine_on_another_plan_ends_where_the_run_ends():
    """200 constant steps done; the resumed run asks for cosine and plans 64 steps from scratch (another
    accumulation) but takes 14 more: the cosine is laid over 214 and falls to 0 there (it was laid over
    the 64 of a fresh plan and rose again past them)."""
    from dschat.runtime.optim import follow_flags

    opt, ours, wanted = _constant_resumed_as("cosine", 200, 0.1, 0, 64)
    assert follow_flags(wanted, ours) is not None
    assert "laid over 214 (200 done, 14 to go)" in relay_schedule(ours, 64, 14)
    rates = []
    for _ in range(14):
        opt.step(), ours.step()
        rates.append(ours.get_last_lr()[0])
    assert all(a > b for a, b in zip(rates, rates[1:])) and rates[-1] == pytest.approx(0.0, abs=1e-12)
