"""Pieces the step scripts share: run set-up, data loaders, engine construction, evaluation
loops, logging, the weight digest.

The step ``main.py`` files wire these together and read top to bottom; the work happens here.

Environment variables read here:

* ``DSCHAT_WEIGHT_DIGEST_DIR``: when set, every rank writes ``<tag>-rank<r>.sha256`` into that
  folder at the end of training: the SHA-256 of its full (ZeRO-3: gathered) parameters, names,
  shapes and dtypes included. Data-parallel ranks must end with identical weights; the 2-rank
  tests compare these files.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import deepspeed
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler

from dschat.data.collators import drop_padding_columns
from dschat.data.prompt_dataset import check_data_output_path
from dschat.data.raw_datasets import resolve_dataset
from dschat.errors import UserError
from dschat.models.families import family_of
from dschat.models.lora import (
    convert_linear_layer_to_lora,
    make_model_gradient_checkpointing_compatible,
    only_optimize_lora_parameters,
)
from dschat.models.registry import resolve_model_path
from dschat.runtime.dist import (
    DEFAULT_DIST_TIMEOUT_MINUTES,
    barrier,
    get_all_reduce_mean,
    get_world_size,
    init_distributed,
)
from dschat.runtime.ds_config import check_optimizer_offload, check_param_offload, get_train_ds_config, resolve_dtype
from dschat.runtime.fs import atomic_file, check_writable_dir
from dschat.runtime.grad_reduction import reduce_gradients_in_place_on_one_rank
from dschat.runtime.optim import (
    create_optimizer,
    create_scheduler,
    get_optimizer_grouped_parameters,
    num_update_steps,
)
from dschat.runtime.zero3 import gathered_parameters, is_zero3_param
from dschat.training.checkpoint import check_checkpoint_args, prepare_checkpoint_root


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor of a (nested) batch to ``device``; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def prepare_batch(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """A right-padded step-1/2/DPO batch on ``device``, without its all-padding columns.

    Upstream pads every row to ``--max_seq_len``; the dropped columns change no real token's output
    or loss (see :func:`dschat.data.collators.drop_padding_columns`), only the compute.
    """
    return drop_padding_columns(to_device(batch, device), side="right")


def set_random_seed(seed: int | None) -> None:
    """Seed python, numpy, torch and the accelerator (upstream name; a no-op for ``None``)."""
    if seed is None:
        return
    # lazy: transformers.set_seed lives in transformers.trainer_utils, which imports peft and
    # bitsandbytes: +3.2 s CPU at import (python -X importtime), which --help must not pay.
    from transformers import set_seed

    set_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device (upstream's manual_seed_all)


def make_train_loader(
    dataset: Dataset, batch_size: int, collate_fn: Callable | None, seed: int, *, shuffle: bool = True,
    drop_last: bool = False,
) -> DataLoader:
    """A loader with a seeded ``DistributedSampler`` (also for one process).

    One sampler type everywhere makes the order a function of (seed, epoch, rank) only; callers
    must call ``set_epoch`` each epoch (docs/upstream.md#data-cache). ``drop_last`` drops each
    rank's last, short batch (step 3 does when a short rollout would shift its optimizer steps).
    """
    if len(dataset) == 0:
        raise UserError("the training split is empty; check --data_path and --data_split")
    sampler = DistributedSampler(
        dataset,
        num_replicas=get_world_size(),
        rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        shuffle=shuffle,
        seed=seed,
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      generator=_loader_generator(seed), drop_last=drop_last)


def _loader_generator(seed: int) -> torch.Generator:
    """A DataLoader without its own generator draws a worker base seed from the *global* torch RNG
    each time it is iterated; with one, iterating leaves the global RNG (dropout) alone, which a
    resumed run needs to reproduce the uninterrupted one (dschat.training.checkpoint)."""
    return torch.Generator().manual_seed(seed)


def make_eval_loader(dataset: Dataset, batch_size: int, collate_fn: Callable | None) -> DataLoader:
    """Each rank evaluates its shard of the held-out split (no shuffling, no padding duplicates
    beyond what ``DistributedSampler`` adds to even out ranks)."""
    if len(dataset) == 0:
        raise UserError("the held-out (eval) split is empty; use more data or another --data_split")
    if get_world_size() > 1:
        sampler: Any = DistributedSampler(dataset, shuffle=False)
    else:
        sampler = SequentialSampler(dataset)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      generator=_loader_generator(0))


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float
    lora_lr: float
    offload: bool
    scheduler: str
    num_warmup_steps: int
    num_training_steps: int


def initialize_engine(model: nn.Module, ds_config: dict, optim: OptimSettings | None) -> Any:
    """``deepspeed.initialize`` with upstream's optimizer and scheduler (or none, for frozen models)."""
    if optim is None:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        return engine
    groups = get_optimizer_grouped_parameters(model, optim.weight_decay, optim.lora_lr)
    if not groups:
        raise UserError("no trainable parameters: check --only_optimize_lora / --lora_dim / --lora_module_name")
    optimizer = create_optimizer(groups, lr=optim.lr, offload=optim.offload)
    scheduler = create_scheduler(optim.scheduler, optimizer, optim.num_warmup_steps, max(1, optim.num_training_steps))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    reduce_gradients_in_place_on_one_rank(engine)  # ZeRO-0 on one rank: the same numbers, no flat copies
    return engine


def apply_lora(
    model: nn.Module, lora_dim: int, lora_module_name: str, only_optimize_lora: bool,
    force_optimize_params: Iterable[str] = (),
) -> nn.Module:
    """Upstream's LoRA wiring, refusing a module filter that matches nothing."""
    if lora_dim <= 0:
        return model
    model = convert_linear_layer_to_lora(model, lora_module_name, lora_dim)
    if not any(hasattr(m, "lora_right_weight") for m in model.modules()):
        suggestion = family_of(getattr(model, "config", None)).lora_module_name
        raise UserError(
            f"the LoRA module filter {lora_module_name!r} matched no Linear layer of this "
            f"{getattr(getattr(model, 'config', None), 'model_type', 'model')}; "
            f"pass --lora_module_name {suggestion!r} (this family's decoder blocks)"
        )
    if only_optimize_lora:
        model = only_optimize_lora_parameters(model, list(force_optimize_params))
        model = make_model_gradient_checkpointing_compatible(model)
    return model


def evaluate_perplexity(engine: Any, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Mean LM loss over the whole held-out split (all ranks) and ``exp`` of it (DSE #773)."""
    engine.eval()
    total = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    with torch.no_grad():
        for batch in loader:
            batch = prepare_batch(batch, device)
            loss = engine(**batch, use_cache=False).loss
            total += loss.float()
            count += 1
    engine.train()
    loss = (get_all_reduce_mean(total) / get_all_reduce_mean(count).clamp(min=1)).item()
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = float("inf")
    return perplexity, loss


@dataclass(frozen=True)
class RewardEval:
    """Held-out reward-model metrics: mean end scores, accuracy (chosen > rejected), the number
    of pairs, and the mean pairwise loss (not printed by upstream; tests and TensorBoard use it)."""

    chosen: float
    rejected: float
    accuracy: float
    pairs: int
    loss: float = float("nan")


def evaluate_reward(engine: Any, loader: DataLoader, device: torch.device, eval_iters: int | None) -> RewardEval:
    """Upstream's reward-model eval: accuracy (chosen > rejected) and mean end scores.

    ``eval_iters`` caps the number of batches per rank (upstream's ``--eval_iters``); ``None`` or
    0 means the whole split. Counts are summed over ranks, so the numbers are exact, not a mean of
    per-rank means (upstream averaged per-batch means).
    """
    engine.eval()
    sums = torch.zeros(5, device=device, dtype=torch.float64)  # correct, pairs, chosen, rejected, loss*pairs
    with torch.no_grad():
        for step, batch in enumerate(loader):
            if eval_iters and step >= eval_iters:
                break
            batch = prepare_batch(batch, device)
            out = engine(**batch, use_cache=False)
            chosen = out["chosen_mean_scores"].double()
            rejected = out["rejected_mean_scores"].double()
            pairs = float(chosen.numel())
            sums += torch.stack(
                [(chosen > rejected).sum().double(), torch.tensor(pairs, device=device, dtype=torch.float64),
                 chosen.sum(), rejected.sum(), out["loss"].double() * pairs]
            )
    engine.train()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    correct, pairs, chosen_sum, rejected_sum, loss_sum = sums.tolist()
    denom = max(pairs, 1.0)
    return RewardEval(chosen_sum / denom, rejected_sum / denom, correct / denom, int(pairs), loss_sum / denom)


class TensorBoardLogger:
    """Rank-0 TensorBoard scalars with a global step that never resets across epochs
    (upstream used the per-epoch step, so each epoch overwrote the last)."""

    def __init__(self, enabled: bool, path: str, name: str):
        self.writer = None
        if enabled and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            # lazy: the tensorboard package is optional (needed with --enable_tensorboard only), +0.07 s
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(path) / name))

    def scalars(self, step: int, **values: float) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def cycle_batches(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def quiet_transformers() -> None:
    """Silence per-load progress bars; keep warnings."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # lazy: transformers costs 0.75 s CPU at import (python -X importtime), and step 2's --help,
    # which imports this module, never needs it.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------
# Run set-up shared by the step scripts
# ---------------------------------------------------------------------------------------------

WEIGHT_DIGEST_ENV = "DSCHAT_WEIGHT_DIGEST_DIR"


def check_common_args(args: argparse.Namespace) -> None:
    """Reject contradictory or impossible flags before anything is loaded or written."""
    if getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None):
        raise UserError(
            "--deepspeed_config is not used: dschat builds the DeepSpeed config from the flags "
            "(--zero_stage, --dtype, --offload, --per_device_train_batch_size, ...); drop it"
        )
    if getattr(args, "lora_dim", 0) < 0:
        raise UserError(f"--lora_dim must be >= 0, got {args.lora_dim}")
    if getattr(args, "only_optimize_lora", False) and getattr(args, "lora_dim", 0) <= 0:
        raise UserError("--only_optimize_lora needs LoRA layers; also pass --lora_dim > 0 (e.g. --lora_dim 128)")
    if getattr(args, "zero_stage", 0) not in (0, 1, 2, 3):
        raise UserError(f"--zero_stage must be 0, 1, 2 or 3, got {args.zero_stage}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "num_train_epochs", "max_seq_len"):
        value = getattr(args, name, 1)
        if value < 1:
            raise UserError(f"--{name} must be >= 1, got {value}")
    for name in ("max_train_steps", "num_warmup_steps", "eval_interval", "eval_iters", "freeze_layers"):
        value = getattr(args, name, 0)
        if value < 0:
            raise UserError(f"--{name} must be >= 0, got {value}")
    if getattr(args, "offload", False):
        check_optimizer_offload(args.zero_stage, "--zero_stage")
    if getattr(args, "offload_reference_model", False):  # DPO: the reference is ZeRO-3 iff the policy is
        check_param_offload("--offload_reference_model", args.zero_stage, "--zero_stage")
    check_output_paths(args)
    check_checkpoint_args(args)


def check_output_paths(args: argparse.Namespace) -> None:
    """``--output_dir``, ``--data_output_path`` and (when enabled) ``--tensorboard_path`` must be
    folders this process can create, and a data cache folder one this user may trust: refused at
    start-up, not after training (steps 1-3)."""
    for name in ("output_dir", "data_output_path"):
        if getattr(args, name, None):
            check_writable_dir(getattr(args, name), f"--{name}")
    if getattr(args, "data_output_path", None):
        check_data_output_path(args.data_output_path)
    if getattr(args, "enable_tensorboard", False):
        check_writable_dir(args.tensorboard_path, "--tensorboard_path")


def check_paths(args: argparse.Namespace, model_flags: Iterable[str] = ("model_name_or_path",)) -> None:
    """Bad model and dataset paths fail here: before distributed start-up, before anything is loaded
    or written (the rows themselves are checked when the data is read, still before any model)."""
    for flag in model_flags:
        resolve_model_path(getattr(args, flag))
    for name in [*args.data_path, *getattr(args, "sft_only_data_path", [])]:
        resolve_dataset(name)


@dataclass(frozen=True)
class RunContext:
    """Where this process runs: global rank, world size, device, and the dtype actually used."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dtype: str


def setup_run(args: argparse.Namespace) -> RunContext:
    """Initialise distributed (launcher or plain ``python``), pick the dtype, seed everything.

    On a CPU accelerator an fp16 request trains in fp32 (one warning): upstream recipes run
    unchanged there.
    """
    quiet_transformers()
    info = init_distributed(timeout_minutes=getattr(args, "dist_timeout", DEFAULT_DIST_TIMEOUT_MINUTES))
    prepare_checkpoint_root(args, info.rank)  # every rank's view of --output_dir, before any model loads
    dtype = resolve_dtype(args.dtype)
    set_random_seed(args.seed)
    barrier()
    return RunContext(info.rank, info.local_rank, info.world_size, info.device, dtype)


def load_step_tokenizer(args: argparse.Namespace, eot_special_token: str) -> tuple[Any, str]:
    """The tokenizer and the end-of-conversation text appended to every training sample.

    ``--add_eot_token`` adds ``eot_special_token`` as an additional special token (upstream). The
    end-of-conversation text is ``--end_of_conversation_token`` if given, else the tokenizer's EOS,
    in every step: the SFT model learns to stop with the token the reward model scores and the
    PPO actor ends with (docs/upstream.md#flags-and-defaults; DSE #819 / #927).
    """
    # lazy: it imports transformers' tokenizers (0.4 s CPU at import, python -X importtime), which
    # step 2's --help, importing this module, never needs.
    from dschat.models.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(
        args.model_name_or_path, fast_tokenizer=True,
        add_special_tokens=eot_special_token if args.add_eot_token else None,
    )
    eot = args.end_of_conversation_token or tokenizer.eos_token
    if not eot:
        raise UserError(
            f"the tokenizer of {args.model_name_or_path} has no EOS token; pass "
            "--end_of_conversation_token (e.g. '<|endoftext|>')"
        )
    return tokenizer, eot


def train_ds_config(args: argparse.Namespace, ctx: RunContext, tb_name: str) -> dict:
    """The trained engine's DeepSpeed config from the step flags (upstream's tb names)."""
    return get_train_ds_config(
        offload=args.offload, dtype=ctx.dtype, stage=args.zero_stage,
        enable_tensorboard=args.enable_tensorboard, tb_path=args.tensorboard_path, tb_name=tb_name,
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        world_size=ctx.world_size,
    )


def plan_optimizer_steps(num_batches: int, epochs: int, gradient_accumulation_steps: int,
                         max_train_steps: int = 0) -> int:
    """Optimizer steps the LR schedule is laid out over: upstream's
    ``epochs * ceil(batches / GA)``, capped by ``--max_train_steps`` when that is > 0."""
    steps = num_update_steps(num_batches, epochs, gradient_accumulation_steps)
    return min(steps, max_train_steps) if max_train_steps > 0 else steps


def optim_settings(args: argparse.Namespace, num_training_steps: int) -> OptimSettings:
    return OptimSettings(
        lr=args.learning_rate, weight_decay=args.weight_decay, lora_lr=args.lora_learning_rate,
        offload=args.offload, scheduler=args.lr_scheduler_type, num_warmup_steps=args.num_warmup_steps,
        num_training_steps=num_training_steps,
    )


def reset_final_norm_for_reward(model: nn.Module, zero_stage: int) -> list[str]:
    """Reset the body's final layer norm of a fresh reward model where the family asks for it.

    BLOOM's ``ln_f.weight`` has a large variance that makes bf16 reward training unstable, and the
    norm fed the replaced LM head anyway, so it is reset to weight 1 / bias 0 and always trained,
    as upstream intends (DSE #772). Returns the
    parameter names to force-train (also with ``--only_optimize_lora``).
    """
    norm_name = family_of(model.config).reset_final_norm_for_reward
    if norm_name is None:
        return []
    norm = getattr(model.rwtransformer, norm_name)
    params = [norm.weight, norm.bias]
    is_zero3 = zero_stage == 3 and is_zero3_param(norm.weight)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=is_zero3):
        if not is_zero3 or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            with torch.no_grad():
                torch.nn.init.ones_(norm.weight)
                torch.nn.init.zeros_(norm.bias)
    return [f"rwtransformer.{norm_name}.weight", f"rwtransformer.{norm_name}.bias"]


class OptimizerStepCounter:
    """Counts micro-steps and optimizer steps (every ``gradient_accumulation_steps`` micro-steps,
    across epochs, as DeepSpeed does) and knows when ``--max_train_steps`` is reached."""

    def __init__(self, gradient_accumulation_steps: int, max_train_steps: int = 0):
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.max_train_steps = max_train_steps
        self.micro_steps = 0

    def micro_step(self) -> bool:
        """Record one micro-step; True when it completed an optimizer step."""
        self.micro_steps += 1
        return self.micro_steps % self.gradient_accumulation_steps == 0

    @property
    def optimizer_steps(self) -> int:
        return self.micro_steps // self.gradient_accumulation_steps

    @property
    def done(self) -> bool:
        return self.max_train_steps > 0 and self.optimizer_steps >= self.max_train_steps


class StepTimer:
    """Wall time of one training micro-step (``time.time`` as upstream; on an accelerator the
    ``engine.step()`` call ends with a synchronising loss/grad reduction)."""

    def __init__(self) -> None:
        self.start = time.time()

    def elapsed(self) -> float:
        return max(time.time() - self.start, 1e-9)


@dataclass
class RunResult:
    """What a step ``main`` returns when called in-process (tests, notebooks).

    ``evals``: one dict per evaluation (``epoch``, ``step`` and the metrics); ``train_losses``:
    the loss of every micro-step on this rank; ``step_times``: the wall time of every micro-step
    (forward, backward, optimizer step) in seconds; ``step_shapes``: the (rows, columns) each
    micro-step fed the model after padding trimming; ``engine``: the trained DeepSpeed engine.
    """

    output_dir: Path | None
    evals: list[dict] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_shapes: list[tuple[int, int]] = field(default_factory=list)
    optimizer_steps: int = 0
    engine: Any = None
    tokenizer: Any = None
    weight_digest: str | None = None
    skipped_nonfinite: int = 0  # micro-steps and optimizer steps the non-finite guard skipped


def print_loss_line(epoch: int, step: int, loss: torch.Tensor) -> None:
    """Upstream's ``--print_loss`` line (every rank prints its own loss)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    print(f"Epoch: {epoch}, Step: {step}, Rank: {rank}, loss = {loss.item()}")


# ---------------------------------------------------------------------------------------------
# Weight digest (data-parallel consistency checks)
# ---------------------------------------------------------------------------------------------


def parameter_digest(model: Any) -> str:
    """SHA-256 over every parameter's name, shape, dtype and bytes, in ``named_parameters`` order.

    Collective under ZeRO-3 (each parameter is gathered in turn): every rank must call it.
    """
    digest = hashlib.sha256()
    for name, param in gathered_parameters(model):
        tensor = param.to("cpu").contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_weight_digest(model: Any, tag: str) -> str | None:
    """If ``$DSCHAT_WEIGHT_DIGEST_DIR`` is set, write this rank's :func:`parameter_digest` to
    ``<dir>/<tag>-rank<r>.sha256`` and return it (collective: call on every rank)."""
    folder = os.environ.get(WEIGHT_DIGEST_ENV)
    if not folder:
        return None
    digest = parameter_digest(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    Path(folder).mkdir(parents=True, exist_ok=True)
    with atomic_file(Path(folder) / f"{tag}-rank{rank}.sha256") as tmp:
        tmp.write_text(digest + "\n", encoding="utf-8")
    return digest
