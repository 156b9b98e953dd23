"""The DeepSpeed config builder (golden dicts), dtype resolution, dist set-up, and real CPU engines."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from dschat.errors import UserError
from dschat.runtime import dist as dist_utils
from dschat.runtime import ds_config as ds_utils
from dschat.runtime.ds_config import get_eval_ds_config, get_train_ds_config, resolve_dtype, torch_dtype_of


def _assert_same_dict(got: dict, expected: dict) -> None:
    """Equal values *and* the same key order at every level (upstream's order is kept)."""
    assert got == expected
    assert list(got) == list(expected)
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_same_dict(got[key], value)


# ------------------------------------------------------------------------------ golden dicts


def test_train_stage0_fp16_no_offload():
    cfg = get_train_ds_config(False, "fp16", 0, micro_batch_size=4, gradient_accumulation_steps=2, world_size=1)
    _assert_same_dict(cfg, {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": 0,
            "overlap_comm": True,
            "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "none"},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        "fp16": {"enabled": True, "loss_scale_window": 100},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": False,
            "max_out_tokens": 512,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
        },
        "tensorboard": {"enabled": False, "output_path": "/ds_tensorboard_logs/", "job_name": "_tensorboard"},
    })


def test_train_stage3_bf16_offload_hybrid_engine_tensorboard():
    # Positional arguments exactly as upstream's rlhf_engine passes them for the actor.
    cfg = get_train_ds_config(True, "bf16", 3, True, 2, True, False, 4, 384, True, False, "/tmp/run", "step3_actor",
                              micro_batch_size=2, gradient_accumulation_steps=4, world_size=8,
                              gradient_clipping=0.5)
    _assert_same_dict(cfg, {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        "bfloat16": {"enabled": True},
        "gradient_clipping": 0.5,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": True,
            "max_out_tokens": 384,
            "inference_tp_size": 2,
            "release_inference_cache": True,
            "pin_parameters": False,
            "tp_gather_partition_size": 4,
        },
        "tensorboard": {
            "enabled": True,
            "output_path": "/tmp/run/ds_tensorboard_logs/",
            "job_name": "step3_actor_tensorboard",
        },
    })


def test_train_stage3_mixed_precision_lora(monkeypatch):
    monkeypatch.setattr(ds_utils, "_device_count", lambda: 8)
    cfg = get_train_ds_config(False, "bf16", 3, enable_mixed_precision_lora=True,
                              micro_batch_size=1, world_size=16)
    _assert_same_dict(cfg["zero_optimization"], {
        "stage": 3,
        "overlap_comm": True,
        "offload_param": {"device": "none"},
        "offload_optimizer": {"device": "none"},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
        "zero_quantized_nontrainable_weights": True,
        "zero_hpz_partition_size": 8,  # world (16) != devices per node (8): hierarchical partitions
    })
    assert cfg["train_batch_size"] == 16
    # One node, all devices used: no hpZ partition.
    single_node = get_train_ds_config(False, "bf16", 3, enable_mixed_precision_lora=True,
                                      micro_batch_size=1, world_size=8)
    assert list(single_node["zero_optimization"])[-2:] == ["memory_efficient_linear",
                                                           "zero_quantized_nontrainable_weights"]


def test_eval_stage3_offload():
    cfg = get_eval_ds_config(True, "bf16", 3, micro_batch_size=4, gradient_accumulation_steps=2, world_size=2)
    _assert_same_dict(cfg, {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 1e4,
            "offload_param": {"device": "cpu"},
            "memory_efficient_linear": False,
        },
        "bfloat16": {"enabled": True},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    })


def test_eval_fp16_has_no_loss_scale_window():
    cfg = get_eval_ds_config(False, "fp16", micro_batch_size=1, world_size=1)
    assert cfg["fp16"] == {"enabled": True}
    assert cfg["zero_optimization"] == {"stage": 0, "stage3_param_persistence_threshold": 1e4,
                                        "offload_param": {"device": "none"}, "memory_efficient_linear": False}


def test_fp32_has_no_precision_block():
    train = get_train_ds_config(False, "fp32", 2, micro_batch_size=3, world_size=1)
    assert list(train) == ["train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
                           "zero_optimization", "gradient_clipping", "prescale_gradients",
                           "wall_clock_breakdown", "hybrid_engine", "tensorboard"]
    assert train["train_batch_size"] == 3
    evaluation = get_eval_ds_config(False, "fp32", micro_batch_size=3, world_size=1)
    assert list(evaluation) == ["train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
                                "zero_optimization", "gradient_clipping", "prescale_gradients",
                                "wall_clock_breakdown"]


def test_world_size_defaults_to_env_without_process_group(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert get_train_ds_config(False, "fp32", micro_batch_size=2, gradient_accumulation_steps=5)["train_batch_size"] == 30
    monkeypatch.delenv("WORLD_SIZE")
    assert get_eval_ds_config(False, "fp32", micro_batch_size=2)["train_batch_size"] == 2


def test_upstream_style_call_gets_upstream_placeholders(monkeypatch):
    # Upstream's callers pass no batch size and overwrite the two keys afterwards.
    monkeypatch.setenv("WORLD_SIZE", "8")  # not used: the placeholders are literal, as upstream's dict
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    train = get_train_ds_config(False, "bf16", 3, True, 2)
    evaluation = get_eval_ds_config(True, "fp16", 3)
    for cfg in (train, evaluation):
        assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"]) == (32, 4)
        assert (ds_utils.GLOBAL_BATCH_SIZE, ds_utils.MICRO_BATCH_SIZE) == (32, 4)
    # Everything else is what the computed call gives, and so is the result once the caller overwrites.
    computed = get_train_ds_config(False, "bf16", 3, True, 2, micro_batch_size=2, gradient_accumulation_steps=4,
                                   world_size=8)
    train["train_micro_batch_size_per_gpu"] = 2
    train["train_batch_size"] = 2 * 8 * 4
    _assert_same_dict(train, computed)
    with pytest.raises(TypeError, match="need micro_batch_size"):
        get_train_ds_config(False, "fp32", gradient_accumulation_steps=2)
    with pytest.raises(TypeError, match="need micro_batch_size"):
        get_eval_ds_config(False, "fp32", world_size=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="fp8", micro_batch_size=1), "unknown dtype"),
    (dict(dtype="fp32", micro_batch_size=0), "micro_batch_size"),
    (dict(dtype="fp32", micro_batch_size=1, gradient_accumulation_steps=0), "gradient_accumulation_steps"),
])
def test_bad_config_inputs_are_user_errors(kwargs, match):
    dtype = kwargs.pop("dtype")
    with pytest.raises(UserError, match=match):
        get_train_ds_config(False, dtype, world_size=1, **kwargs)


# ------------------------------------------------------------------------------------- dtypes


def test_resolve_dtype_on_cpu_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(ds_utils, "_warned_fp16_on_cpu", False)
    with caplog.at_level(logging.WARNING, logger="dschat.runtime.ds_config"):
        assert resolve_dtype("fp16") == "fp32"
        assert resolve_dtype("fp16") == "fp32"
        assert resolve_dtype("bf16") == "bf16"
        assert resolve_dtype("fp32") == "fp32"
    warnings = [r.getMessage() for r in caplog.records if r.name == "dschat.runtime.ds_config"]
    assert warnings == ["dtype fp16 is not supported on the CPU accelerator; training in fp32 instead"]


def test_resolve_dtype_keeps_fp16_on_cuda(monkeypatch):
    monkeypatch.setattr(ds_utils, "_accelerator_name", lambda: "cuda")
    assert resolve_dtype("fp16") == "fp16"


def test_resolve_dtype_rejects_unknown():
    with pytest.raises(UserError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")


def test_torch_dtype_of():
    assert [torch_dtype_of(d) for d in ("fp16", "bf16", "fp32")] == [torch.float16, torch.bfloat16, torch.float32]


# ---------------------------------------------------------------------------------------- dist


def test_single_process_env_is_filled_in(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    dist_utils._ensure_single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    # No rendezvous address: one process meets itself through a store in its memory, no port.
    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ


def test_launcher_env_is_left_alone(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    dist_utils._ensure_single_process_env()
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["MASTER_PORT"]) == ("3", "1", "29555")


@pytest.fixture(scope="module")
def dist_info():
    return dist_utils.init_distributed()


def test_init_distributed_single_process_and_idempotent(dist_info, capsys):
    assert dist_info == dist_utils.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert dist_utils.init_distributed() == dist_info
    assert torch.distributed.is_initialized() and dist_utils.is_rank_0()
    x = torch.tensor([1.0, 3.0])
    assert torch.equal(dist_utils.get_all_reduce_mean(x), torch.tensor([1.0, 3.0]))
    assert torch.equal(x, torch.tensor([1.0, 3.0]))  # the caller's tensor is not reduced in place
    assert dist_utils.collective_device(x) == torch.device("cpu")  # gloo reduces host tensors
    dist_utils.barrier()
    dist_utils.print_rank_0("hello")
    dist_utils.print_rank_0("explicit", rank=0)
    assert capsys.readouterr().out == "hello\nexplicit\n"


def test_host_tensors_go_through_the_gpu_under_nccl(monkeypatch):
    # NCCL refuses host tensors ("No backend type associated with device type cpu"): a PPO step's
    # loss means are host tensors, and the first GPU run of step 3 failed there.
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert dist_utils.collective_device(torch.zeros(2)) == torch.device("cuda", 2)
    on_gpu = torch.empty(2, device="meta")
    assert dist_utils.collective_device(on_gpu) == torch.device("meta")


def test_no_collective_is_handed_a_host_tensor_directly():
    """A tensor made without ``device=`` is on the host, which NCCL refuses: such tensors must go
    through ``dschat.runtime.dist`` (all_reduce_sum / get_all_reduce_mean copy them to the GPU). This
    slipped through twice (a PPO step's loss means, then its ratio statistics), and CPU tests cannot
    see it (gloo takes host tensors), so the source is checked: within a function, a name handed to
    ``torch.distributed.all_reduce`` must not be bound to ``torch.tensor/zeros/...(...)`` without
    ``device=``."""
    import ast

    makers = {"tensor", "zeros", "ones", "empty", "full", "zeros_like", "arange"}
    root = Path(dist_utils.__file__).resolve().parents[1]
    problems = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "dist.py" and path.parent.name == "utils":
            continue
        tree = ast.parse(path.read_text())
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            host_names = set()
            for node in ast.walk(func):
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                        and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in makers
                        and not any(k.arg == "device" for k in node.value.keywords)):
                    host_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            for node in ast.walk(func):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("all_reduce", "broadcast", "all_gather") and node.args
                        and isinstance(node.args[0], ast.Name) and node.args[0].id in host_names):
                    problems.append(f"{path.relative_to(root)}:{node.lineno} {func.name}: {node.args[0].id}")
    assert not problems, problems


# ---------------------------------------------------------------------------- real CPU engines


def tiny_opt() -> OPTForCausalLM:
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                                    dropout=0.0))


def _gathered_copy(params):
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params)):
        return [p.detach().clone() for p in params]


@pytest.mark.parametrize("stage, dtype", [(0, "fp16"), (2, "fp32"), (3, "fp32"), (2, "bf16")])
def test_config_initialises_engine_and_trains_one_step(dist_info, stage, dtype):
    import deepspeed

    from dschat.models.lora import convert_linear_layer_to_lora
    from dschat.runtime.optim import create_optimizer, create_scheduler, get_optimizer_grouped_parameters

    cfg = get_train_ds_config(False, resolve_dtype(dtype), stage, micro_batch_size=2)  # fp16 -> fp32 on CPU
    model = convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=4)
    optimizer = create_optimizer(get_optimizer_grouped_parameters(model, 0.1, lora_lr=1e-2), lr=1e-3, offload=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      lr_scheduler=create_scheduler("linear", optimizer, 0, 10), config=cfg)
    assert engine.zero_optimization_stage() == stage
    assert engine.train_batch_size() == 2 and engine.gradient_accumulation_steps() == 1
    tracked = [engine.module.model.decoder.layers[0].fc1.lora_left_weight, engine.module.lm_head.weight]
    before = _gathered_copy(tracked)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = engine(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    engine.backward(loss)
    engine.step()
    after = _gathered_copy(tracked)
    assert all(not torch.equal(a, b) for a, b in zip(after, before))


def test_eval_config_initialises_frozen_engine(dist_info):
    import deepspeed

    model = tiny_opt()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    engine, *_ = deepspeed.initialize(model=model, config=get_eval_ds_config(False, "fp32", 3, micro_batch_size=2))
    engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, expected)


def test_zero3_partitioned_lora_fuses_under_gather(dist_info):
    """LoRA on already-partitioned weights (ds_shape) and fusing them after ZeRO-3 training."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from dschat.models.lora import convert_linear_layer_to_lora, convert_lora_to_linear_layer
    from dschat.runtime.optim import create_optimizer, get_optimizer_grouped_parameters

    cfg = get_train_ds_config(False, "fp32", 3, micro_batch_size=2)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even tiny weights
    model = tiny_opt()
    deepspeed.zero.Init(module=model, config_dict_or_path=cfg)
    q_weight = model.model.decoder.layers[0].self_attn.q_proj.weight
    assert q_weight.numel() == 0 and tuple(q_weight.ds_shape) == (64, 64)
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=4)
    q = model.model.decoder.layers[0].self_attn.q_proj
    assert q.lora_right_weight.shape == (64, 4) and q.lora_left_weight.shape == (4, 64)  # from ds_shape
    optimizer = create_optimizer(get_optimizer_grouped_parameters(model, 0.0, lora_lr=1e-2), lr=1e-3, offload=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    w, left, right = _gathered_copy([q.weight, q.lora_left_weight, q.lora_right_weight])
    assert torch.count_nonzero(left) > 0
    assert q.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    convert_lora_to_linear_layer(engine.module)
    (fused,) = _gathered_copy([q.weight])
    torch.testing.assert_close(fused, w + q.lora_scaling * left.t() @ right.t())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_qlora_model_trains_under_zero2(dist_info, dtype):
    """A 4-bit (uint8, frozen) base passes through ZeRO-2 untouched; only LoRA factors train."""
    import deepspeed

    from dschat.models.lora import convert_linear_layer_to_lora, only_optimize_lora_parameters
    from dschat.runtime.optim import create_optimizer, get_optimizer_grouped_parameters

    model = convert_linear_layer_to_lora(tiny_opt(), "decoder.layers.", lora_dim=4, quantize_base="nf4")
    only_optimize_lora_parameters(model)
    optimizer = create_optimizer(get_optimizer_grouped_parameters(model, 0.0, lora_lr=1e-2), lr=1e-3, offload=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=get_train_ds_config(False, dtype, 2, micro_batch_size=2))
    fc1 = engine.module.model.decoder.layers[0].fc1
    base_before, left_before = fc1.weight.detach().clone(), fc1.lora_left_weight.detach().clone()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = engine(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    engine.backward(loss)
    engine.step()
    assert fc1.weight.dtype == torch.uint8 and torch.equal(fc1.weight.detach(), base_before)
    assert not torch.equal(fc1.lora_left_weight.detach(), left_before)
