"""Throughput estimates printed by the step scripts (upstream's ``dschat/utils/perf.py``).

FLOPs follow the Megatron-LM paper (Narayanan et al. 2021, eq. 3)::

    F = 24 * c * B * s * L * h^2 * (1 + s / (6h) + V / (16 L h))

with ``c`` the checkpoint-activations factor (3 = forward + backward, 4 with activation
recomputation; with LoRA upstream subtracts ``1 - 2 r / h`` because frozen weights need no weight
gradient), ``B`` sequences of ``s`` tokens, ``L`` layers, hidden size ``h`` and vocabulary ``V``.

The numbers are computed by pure functions (:func:`throughput_stats`, :func:`throughput_stats_step3`)
that tests check by hand; :func:`print_throughput` / :func:`print_throughput_step3` only format
them with upstream's exact lines (its arithmetic fixed: docs/upstream.md#throughput-lines):

* steps 1 / 2 / DPO: FLOPs are computed for the *per-device* batch, so per-GPU TFLOPs divide by the
  time only;
* step 3: with PPO-ptx the *actor's* trained samples are doubled (the critic never trains on ptx
  batches);
* step 3: bytes per parameter come from the actor's actual parameter dtype (bf16 = 2);
* step 3: ``gen_exp_time`` is the generation time summed over all ``generation_batches`` (the
  caller measures it), so generation TFLOPs and per-token latency count every generated batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from dschat.runtime.zero3 import full_numel

__all__ = [
    "get_hf_configs",
    "calculate_flops",
    "checkpoint_activations_factor",
    "count_parameters",
    "bytes_per_parameter",
    "ThroughputStats",
    "Step3ThroughputStats",
    "throughput_stats",
    "throughput_stats_step3",
    "format_throughput",
    "format_throughput_step3",
    "print_throughput",
    "print_throughput_step3",
]


def get_hf_configs(hf_config: Any) -> tuple[int, int, int]:
    """``(num_layers, hidden_size, vocab_size)`` of an HF config (GPT-2 style names too)."""
    num_layers = getattr(hf_config, "num_hidden_layers", getattr(hf_config, "n_layer", None))
    hidden_size = getattr(hf_config, "hidden_size", getattr(hf_config, "n_embd", None))
    vocab_size = getattr(hf_config, "vocab_size", None)
    if not all((num_layers, hidden_size, vocab_size)):
        raise ValueError("Could not determine number of layers, hidden size, and vocab size of the model")
    return int(num_layers), int(hidden_size), int(vocab_size)


def calculate_flops(checkpoint_activations_factor: float, batch_size: int, seq_length: int, hf_config: Any) -> float:
    """Training FLOPs of one iteration over ``batch_size`` sequences (Megatron formula above)."""
    num_layers, hidden_size, vocab_size = get_hf_configs(hf_config)
    return (24 * checkpoint_activations_factor * batch_size * seq_length * num_layers * hidden_size**2) * (
        1.0 + seq_length / (6.0 * hidden_size) + vocab_size / (16.0 * num_layers * hidden_size)
    )


def checkpoint_activations_factor(gradient_checkpointing: bool, lora_dim: int, hidden_size: int) -> float:
    """3 (fwd + bwd), 4 with recomputation; LoRA subtracts ``1 - 2 r / h`` (upstream's estimate)."""
    factor = 4.0 if gradient_checkpointing else 3.0
    if lora_dim > 0:
        factor -= 1 - lora_dim * 2 / hidden_size
    return factor


def _parameters(model: Any) -> Iterable[torch.nn.Parameter]:
    return getattr(model, "module", model).parameters()


def count_parameters(model: Any) -> int:
    """All parameters, full sizes under ZeRO-3 (``ds_numel``), LoRA factors included."""
    return sum(full_numel(p) for p in _parameters(model))


def bytes_per_parameter(model: Any) -> int:
    """Bytes per element of the model's floating-point parameters (fp32 4, fp16 / bf16 2)."""
    for p in _parameters(model):
        if p.is_floating_point():
            return torch.empty((), dtype=p.dtype).element_size()
    return 4


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _params_string(num_params: int) -> str:
    billions = num_params / 1e9
    return f"{billions:.3f} B" if billions != 0 else "NA"


# ---------------------------------------------------------------------------------------------
# Steps 1, 2 and DPO
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputStats:
    """One training micro-step on one device. ``tflops`` is per GPU."""

    num_params: int
    latency: float
    tflops: float
    samples_per_sec: float
    time_per_seq: float
    batch_size: int
    seq_length: int


def throughput_stats(
    hf_config: Any, num_params: int, *, batch_size: int, seq_length: int, e2e_time: float,
    gradient_checkpointing: bool = False, lora_dim: int = 0,
) -> ThroughputStats:
    """Per-device numbers for a micro-step of ``batch_size`` sequences that took ``e2e_time`` s.

    Every device runs the same work concurrently, so per-GPU TFLOPs are the per-device FLOPs over
    the time (upstream divided by the world size once more).
    """
    _, hidden_size, _ = get_hf_configs(hf_config)
    factor = checkpoint_activations_factor(gradient_checkpointing, lora_dim, hidden_size)
    flops = calculate_flops(factor, batch_size, seq_length, hf_config)
    return ThroughputStats(
        num_params=num_params,
        latency=e2e_time,
        tflops=flops / (e2e_time * 1e12),
        samples_per_sec=batch_size / e2e_time,
        time_per_seq=e2e_time / batch_size,
        batch_size=batch_size,
        seq_length=seq_length,
    )


def format_throughput(stats: ThroughputStats) -> str:
    """Upstream's line, character for character."""
    return (
        f"Model Parameters: {_params_string(stats.num_params)}, Latency: {stats.latency:.2f}s, "
        f"TFLOPs: {stats.tflops:.2f}, Samples/sec: {stats.samples_per_sec:.2f}, "
        f"Time/seq {stats.time_per_seq:.2f}s, Batch Size: {stats.batch_size}, "
        f"Sequence Length: {stats.seq_length}"
    )


def print_throughput(hf_model: Any, args: Any, e2e_time: float, rank: int = 0) -> ThroughputStats | None:
    """Print the step-1 / DPO throughput line on rank <= 0 (upstream's signature).

    ``hf_model`` is the trained module (an engine is unwrapped); ``args`` needs
    ``per_device_train_batch_size``, ``max_seq_len``, ``gradient_checkpointing`` and ``lora_dim``.
    """
    if rank > 0:
        return None
    module = getattr(hf_model, "module", hf_model)
    stats = throughput_stats(
        module.config, count_parameters(module),
        batch_size=args.per_device_train_batch_size, seq_length=args.max_seq_len, e2e_time=e2e_time,
        gradient_checkpointing=bool(getattr(args, "gradient_checkpointing", False)),
        lora_dim=int(getattr(args, "lora_dim", 0) or 0),
    )
    print(format_throughput(stats))
    return stats


# ---------------------------------------------------------------------------------------------
# Step 3
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step3ThroughputStats:
    """One PPO iteration (``generation_batches`` rollouts + ``ppo_epochs`` of training), all ranks.

    TFLOPs are per GPU. ``batch_size`` counts the sequences the actor trains on per iteration over
    all ranks (RL samples, doubled with PPO-ptx).
    """

    e2e_latency: float
    e2e_tflops: float
    samples_per_sec: float
    time_per_seq: float
    batch_size: int
    seq_length: int
    gen_latency: float
    per_token_latency_ms: float
    gen_tflops: float
    gen_bandwidth_gb_s: float
    answer_seq_length: int
    train_latency: float
    train_tflops: float
    actor_params: int
    critic_params: int


def throughput_stats_step3(
    actor_config: Any, critic_config: Any, *, actor_params: int, critic_params: int, actor_bytes_per_param: int,
    world_size: int, per_device_generation_batch_size: int, generation_batches: int, ppo_epochs: int,
    max_prompt_seq_len: int, max_answer_seq_len: int, ptx: bool,
    actor_gradient_checkpointing: bool = False, critic_gradient_checkpointing: bool = False,
    actor_lora_dim: int = 0, critic_lora_dim: int = 0,
    e2e_time: float, gen_exp_time: float, train_time: float, generated_batches: int | None = None,
) -> Step3ThroughputStats:
    """The step-3 numbers. ``gen_exp_time`` is summed over the generation batches generated:
    ``generated_batches``, default ``generation_batches`` (``--dynamic_sampling`` draws more than it
    trains on)."""
    drawn = generation_batches if generated_batches is None else max(generated_batches, 1)
    seq_length = max_answer_seq_len + max_prompt_seq_len
    rl_samples = per_device_generation_batch_size * generation_batches * ppo_epochs * world_size
    actor_samples = rl_samples * (2 if ptx else 1)  # PPO-ptx trains the actor on as many ptx rows

    _, actor_hidden, _ = get_hf_configs(actor_config)
    actor_factor = checkpoint_activations_factor(actor_gradient_checkpointing, actor_lora_dim, actor_hidden)
    train_flops = calculate_flops(actor_factor, actor_samples, seq_length, actor_config)
    if critic_config is not None:  # None: a critic-free algorithm trains the actor only
        _, critic_hidden, _ = get_hf_configs(critic_config)
        critic_factor = checkpoint_activations_factor(critic_gradient_checkpointing, critic_lora_dim, critic_hidden)
        train_flops += calculate_flops(critic_factor, rl_samples, seq_length, critic_config)
    train_tflops = train_flops / (train_time * world_size * 1e12)

    # Generation: one forward pass over the full sequence per generated batch (upstream's estimate,
    # i.e. the training formula with factor 1), for every rank's batch.
    gen_flops_per_batch = calculate_flops(1, per_device_generation_batch_size * world_size, seq_length, actor_config)
    gen_flops = gen_flops_per_batch * drawn
    gen_tflops = gen_flops / (gen_exp_time * world_size * 1e12)
    # Each decoding step reads every actor weight once.
    pertok_lat = gen_exp_time / (max_answer_seq_len * drawn)
    gen_bw = actor_params * actor_bytes_per_param / pertok_lat / 1e9

    total_tflops = (train_flops + gen_flops) / (e2e_time * world_size * 1e12)
    return Step3ThroughputStats(
        e2e_latency=e2e_time, e2e_tflops=total_tflops, samples_per_sec=actor_samples / e2e_time,
        time_per_seq=e2e_time / actor_samples, batch_size=actor_samples, seq_length=seq_length,
        gen_latency=gen_exp_time, per_token_latency_ms=pertok_lat * 1000, gen_tflops=gen_tflops,
        gen_bandwidth_gb_s=gen_bw, answer_seq_length=max_answer_seq_len,
        train_latency=train_time, train_tflops=train_tflops,
        actor_params=actor_params, critic_params=critic_params,
    )


def format_throughput_step3(stats: Step3ThroughputStats) -> list[str]:
    """Upstream's four lines."""
    return [
        f"End-to-End => Latency: {stats.e2e_latency:.2f}s, TFLOPs: {stats.e2e_tflops:.2f}, "
        f"Samples/sec: {stats.samples_per_sec:.2f}, Time/seq {stats.time_per_seq:.2f}s, "
        f"Batch Size: {stats.batch_size}, Total Seq. Length: {stats.seq_length}",
        f"Generation => Latency: {stats.gen_latency:.2f}s, Per-token Latency {stats.per_token_latency_ms:.2f} ms, "
        f"TFLOPs: {stats.gen_tflops:.2f}, BW: {stats.gen_bandwidth_gb_s:.2f} GB/sec, "
        f"Answer Seq. Length: {stats.answer_seq_length}",
        f"Training   => Latency: {stats.train_latency:.2f}s, TFLOPs: {stats.train_tflops:.2f}",
        f"Actor Model Parameters => {_params_string(stats.actor_params)}, "
        f"Critic Model Parameters => {_params_string(stats.critic_params)}",
    ]


def print_throughput_step3(
    actor_model: Any, critic_model: Any, args: Any, e2e_time: float, gen_exp_time: float, train_time: float,
    rank: int = 0, generated_batches: int | None = None,
) -> Step3ThroughputStats | None:
    """Print upstream's four step-3 lines on rank <= 0 (upstream's signature).

    ``actor_model`` / ``critic_model``: modules or DeepSpeed engines (unwrapped here); ``critic_model``
    is None for a critic-free algorithm. ``args``
    needs step 3's batch, length, gradient-checkpointing and LoRA flags and
    ``unsupervised_dataset_name``. ``gen_exp_time`` must be the generation time summed over the
    iteration's generation batches: ``generation_batches``, or ``generated_batches`` where more were
    drawn (``--dynamic_sampling``).
    """
    if rank > 0:
        return None
    actor = getattr(actor_model, "module", actor_model)
    critic = getattr(critic_model, "module", critic_model)
    stats = throughput_stats_step3(
        actor.config, None if critic is None else critic.config,
        actor_params=count_parameters(actor), critic_params=0 if critic is None else count_parameters(critic),
        actor_bytes_per_param=bytes_per_parameter(actor), world_size=_world_size(),
        per_device_generation_batch_size=args.per_device_generation_batch_size,
        generation_batches=int(getattr(args, "generation_batches", 1)),
        ppo_epochs=int(getattr(args, "ppo_epochs", 1)),
        max_prompt_seq_len=args.max_prompt_seq_len, max_answer_seq_len=args.max_answer_seq_len,
        ptx=getattr(args, "unsupervised_dataset_name", None) is not None,
        actor_gradient_checkpointing=bool(getattr(args, "actor_gradient_checkpointing", False)),
        critic_gradient_checkpointing=bool(getattr(args, "critic_gradient_checkpointing", False)),
        actor_lora_dim=int(getattr(args, "actor_lora_dim", 0) or 0),
        critic_lora_dim=int(getattr(args, "critic_lora_dim", 0) or 0),
        e2e_time=e2e_time, gen_exp_time=gen_exp_time, train_time=train_time, generated_batches=generated_batches,
    )
    for line in format_throughput_step3(stats):
        print(line)
    return stats
