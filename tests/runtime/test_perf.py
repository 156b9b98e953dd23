"""perf.py numbers worked out by hand, upstream's line formats, and the upstream-path helpers in
dschat.utils.utils."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dschat.runtime import perf


def cfg(layers: int, hidden: int, vocab: int) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=layers, hidden_size=hidden, vocab_size=vocab)


def test_get_hf_configs_reads_both_naming_schemes():
    assert perf.get_hf_configs(cfg(2, 4, 8)) == (2, 4, 8)
    assert perf.get_hf_configs(SimpleNamespace(n_layer=3, n_embd=16, vocab_size=50)) == (3, 16, 50)
    with pytest.raises(ValueError, match="number of layers"):
        perf.get_hf_configs(SimpleNamespace(hidden_size=4, vocab_size=8))


def test_calculate_flops_small_case():
    # 24 * c * B * s * L * h^2 = 24 * 3 * 2 * 3 * 2 * 16 = 13824
    # (1 + s/(6h) + V/(16 L h)) = 1 + 3/24 + 8/128 = 1.1875  -> 13824 * 1.1875 = 16416
    assert perf.calculate_flops(3, 2, 3, cfg(2, 4, 8)) == pytest.approx(16416.0)


def test_checkpoint_factor():
    assert perf.checkpoint_activations_factor(False, 0, 1024) == 3
    assert perf.checkpoint_activations_factor(True, 0, 1024) == 4
    # LoRA r = 128 on h = 1024: 3 - (1 - 256/1024) = 2.25
    assert perf.checkpoint_activations_factor(False, 128, 1024) == pytest.approx(2.25)


def test_step1_throughput_opt350m_by_hand():
    """OPT-350m shape (L 24, h 1024, V 50272), per-device batch 16 x 512, 2.0 s per step.

    24*3*16*512*24*1024^2 = 14,843,406,974,976
    1 + 512/6144 + 50272/393216 = 476256/393216
    flops = 14,843,406,974,976 * 476256 / 393216 = 17,978,062,012,416
    per-GPU TFLOPs = 17.978e12 / 2.0 s / 1e12 = 8.989 (upstream also divided by the world size:
    4.49 on 2 GPUs, 1.12 on 8, for the same per-GPU work).
    """
    stats = perf.throughput_stats(cfg(24, 1024, 50272), 331_196_416, batch_size=16, seq_length=512, e2e_time=2.0)
    assert stats.tflops == pytest.approx(8.989031006208)
    assert stats.samples_per_sec == 8.0 and stats.time_per_seq == 0.125
    assert perf.format_throughput(stats) == (
        "Model Parameters: 0.331 B, Latency: 2.00s, TFLOPs: 8.99, Samples/sec: 8.00, Time/seq 0.12s, "
        "Batch Size: 16, Sequence Length: 512")


def test_print_throughput_prints_upstream_line_on_rank_0_only(capsys):
    model = nn.Linear(4, 4)  # 20 parameters
    model.config = cfg(2, 4, 8)
    args = SimpleNamespace(per_device_train_batch_size=2, max_seq_len=3, gradient_checkpointing=False, lora_dim=0)
    stats = perf.print_throughput(model, args, 2.0, rank=0)
    line = capsys.readouterr().out.strip()
    assert stats.num_params == 20 and stats.tflops == pytest.approx(16416 / 2.0 / 1e12)
    assert re.fullmatch(r"Model Parameters: 0\.000 B, Latency: 2\.00s, TFLOPs: 0\.00, Samples/sec: 1\.00, "
                        r"Time/seq 1\.00s, Batch Size: 2, Sequence Length: 3", line), line
    assert perf.print_throughput(model, args, 2.0, rank=1) is None
    assert capsys.readouterr().out == ""


def step3_stats(ptx: bool) -> perf.Step3ThroughputStats:
    return perf.throughput_stats_step3(
        cfg(2, 4, 8), cfg(1, 4, 8), actor_params=1000, critic_params=500, actor_bytes_per_param=2, world_size=2,
        per_device_generation_batch_size=2, generation_batches=2, ppo_epochs=1, max_prompt_seq_len=2,
        max_answer_seq_len=4, ptx=ptx, critic_gradient_checkpointing=True,
        e2e_time=2.0, gen_exp_time=0.5, train_time=1.0)


def test_step3_throughput_by_hand():
    """s = 2 + 4 = 6; RL samples = 2 * 2 batches * 1 epoch * 2 ranks = 8; with ptx the actor
    trains on 16 (upstream's precedence bug made the batch exactly 2).

    actor  (c 3, B 16): 24*3*16*6*2*16 = 221184 * (1 + 6/24 + 8/128 = 1.3125) = 290304
    critic (c 4, B 8):  24*4*8*6*1*16  = 73728  * (1 + 6/24 + 8/64  = 1.375)  = 101376
    train TFLOPs = 391680 / (1.0 s * 2 ranks) / 1e12
    generation: 24*1*(2*2)*6*2*16 = 18432 * 1.3125 = 24192 per batch, 2 batches = 48384;
                TFLOPs = 48384 / (0.5 s * 2) / 1e12
    per-token latency = 0.5 s / (4 tokens * 2 batches) = 62.5 ms
    BW = 1000 params * 2 bytes (bf16 counts: upstream printed -1) / 0.0625 s / 1e9 = 3.2e-5 GB/s
    end-to-end TFLOPs = (391680 + 48384) / (2.0 s * 2) / 1e12
    """
    s = step3_stats(ptx=True)
    assert s.batch_size == 16 and s.seq_length == 6
    assert s.samples_per_sec == 8.0 and s.time_per_seq == 0.125
    assert s.train_tflops == pytest.approx(391680 / 2 / 1e12)
    assert s.gen_tflops == pytest.approx(48384 / 1.0 / 1e12)
    assert s.per_token_latency_ms == pytest.approx(62.5)
    assert s.gen_bandwidth_gb_s == pytest.approx(3.2e-5)
    assert s.e2e_tflops == pytest.approx(440064 / 4 / 1e12)

    no_ptx = step3_stats(ptx=False)
    assert no_ptx.batch_size == 8
    # actor on 8 samples: 145152; critic unchanged: 101376
    assert no_ptx.train_tflops == pytest.approx((145152 + 101376) / 2 / 1e12)


def test_step3_generation_rates_count_the_batches_drawn():
    """--dynamic_sampling drew 6 generation batches for the 2 trained: the generation time covers 6,
    so the per-token latency and generation TFLOPs are per batch drawn; the training is unchanged."""
    s, drawn = step3_stats(ptx=False), perf.throughput_stats_step3(
        cfg(2, 4, 8), cfg(1, 4, 8), actor_params=1000, critic_params=500, actor_bytes_per_param=2, world_size=2,
        per_device_generation_batch_size=2, generation_batches=2, ppo_epochs=1, max_prompt_seq_len=2,
        max_answer_seq_len=4, ptx=False, critic_gradient_checkpointing=True,
        e2e_time=2.0, gen_exp_time=0.5, train_time=1.0, generated_batches=6)
    assert drawn.per_token_latency_ms == pytest.approx(0.5 / (4 * 6) * 1000)
    assert drawn.gen_tflops == pytest.approx(3 * s.gen_tflops)
    assert (drawn.train_tflops, drawn.batch_size) == (s.train_tflops, s.batch_size)


def test_step3_lines_match_upstream_format():
    s = perf.Step3ThroughputStats(
        e2e_latency=12.3456, e2e_tflops=1.234, samples_per_sec=5.19, time_per_seq=0.193, batch_size=64,
        seq_length=512, gen_latency=8.0, per_token_latency_ms=31.25, gen_tflops=0.5, gen_bandwidth_gb_s=42.0,
        answer_seq_length=256, train_latency=4.0, train_tflops=2.0, actor_params=1_300_000_000,
        critic_params=0)
    assert perf.format_throughput_step3(s) == [
        "End-to-End => Latency: 12.35s, TFLOPs: 1.23, Samples/sec: 5.19, Time/seq 0.19s, Batch Size: 64, "
        "Total Seq. Length: 512",
        "Generation => Latency: 8.00s, Per-token Latency 31.25 ms, TFLOPs: 0.50, BW: 42.00 GB/sec, "
        "Answer Seq. Length: 256",
        "Training   => Latency: 4.00s, TFLOPs: 2.00",
        "Actor Model Parameters => 1.300 B, Critic Model Parameters => NA",
    ]


def test_print_throughput_step3_reads_args_and_engines(capsys):
    actor = nn.Linear(10, 10, bias=False).to(torch.bfloat16)  # 100 bf16 parameters -> 2 bytes each
    actor.config = cfg(2, 4, 8)
    critic_module = nn.Linear(5, 10, bias=False)
    critic_module.config = cfg(1, 4, 8)
    critic_engine = SimpleNamespace(module=critic_module)  # step 3 passes the critic's DeepSpeed engine
    args = SimpleNamespace(per_device_generation_batch_size=2, generation_batches=2, ppo_epochs=1,
                           max_prompt_seq_len=2, max_answer_seq_len=4, unsupervised_dataset_name="ptx",
                           actor_gradient_checkpointing=False, critic_gradient_checkpointing=True,
                           actor_lora_dim=0, critic_lora_dim=0)
    stats = perf.print_throughput_step3(actor, critic_engine, args, 2.0, 0.5, 1.0, rank=0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("End-to-End => ") and "BW: 0.00 GB/sec" in lines[1]
    assert stats.actor_params == 100 and stats.critic_params == 50
    assert stats.gen_bandwidth_gb_s == pytest.approx(100 * 2 / 0.0625 / 1e9)
    # One process here: world size 1 -> RL samples 2*2*1*1 = 4, doubled by ptx.
    assert stats.batch_size == 8


def test_bytes_per_parameter_and_counts():
    assert perf.bytes_per_parameter(nn.Linear(2, 2)) == 4
    assert perf.bytes_per_parameter(nn.Linear(2, 2).to(torch.bfloat16)) == 2
    assert perf.bytes_per_parameter(nn.Linear(2, 2).to(torch.float16)) == 2
    assert perf.count_parameters(nn.Linear(3, 2)) == 8


def test_upstream_utils_path():
    from dschat.utils import utils

    for name in ("print_rank_0", "to_device", "set_random_seed", "get_all_reduce_mean", "load_hf_tokenizer",
                 "get_optimizer_grouped_parameters", "save_hf_format", "save_zero_three_model"):
        assert callable(getattr(utils, name)), name

    mean = utils.MovingAverage()
    assert [mean.update(x) for x in (1, 2, 3)] == [1, 1.5, 2]

    ema = utils.ExponentialMovingAverage()  # alpha 0.9
    assert ema.get() == 0.0
    assert ema.update(10) == 10  # the first value is the value itself
    assert ema.update(0) == pytest.approx(9.0)  # 0.9 * 10 + 0.1 * 0
    assert ema.update(0) == pytest.approx(8.1)
    assert utils.ExponentialMovingAverage(alpha=0.5).update(4) == 4
