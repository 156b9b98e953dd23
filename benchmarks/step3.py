"""Step-3 (PPO) benchmark: dschat's default rollout path against the plain path, in one process.

    python benchmarks/step3.py                                   # CPU: SmolLM2-135M actor and critic, 4 x (64 + 64)
    python benchmarks/step3.py --actor opt-1.3b --critic opt-350m --prompt_len 256 --answer_len 256 \\
        --batch 16 --zero_stage 3 --dtype bf16                  # GPU, upstream's protocol, random weights

A fixed PPO workload -- the same prompts, every answer exactly ``--answer_len`` tokens
(``min_new_tokens``), ``--steps`` PPO iterations after ``--warmup`` -- runs twice on the same
engines:

* **baseline**: the plain path. Hugging Face ``generate`` on the training engine's module with the
  stock kernels (ZeRO-3 parameters fetched layer by layer for every token, LoRA not fused, no Hybrid
  Engine), prompts left-padded to ``--prompt_len`` as the data pipeline delivers them, and a second
  actor forward pass over the rollout for the old log-probs. This is what upstream does without its
  Hybrid Engine.
* **ours**: the default path of ``training/step3_rlhf_finetuning/main.py``: all-padding prompt
  columns dropped, the old log-probs kept from generation, ``--generation_loop auto`` (on CUDA:
  ``generate`` with a static KV cache and CUDA graphs; elsewhere dschat's decoding loop, with oneDNN
  decode linears on a CPU, ``dschat/rlhf/rollout/sample_loop.py``), LoRA fused and ZeRO-3 gathered once per
  rollout for generation, the Hybrid Engine when ``--hybrid_engine`` is on and usable, the scoring
  passes and training on packed rows (``--sequence_packing auto``; the baseline's are padded), and
  under ZeRO-3 each scoring pass on its model gathered once (``--zero3_gather_for_scoring auto``).
  ``--answer_spread`` cuts the answers to varied lengths, as a trained actor's end, so that the
  padding packing removes is there to remove.

Per phase it prints generation tokens/s, per-token latency and achieved memory bandwidth ((weight
bytes + KV-cache bytes read) x decode steps / time, the roofline of memory-bound decoding), experience-pass tokens/s and
TFLOP/s (forward passes), training tokens/s and TFLOP/s (upstream's FLOP formula over the tokens
actually processed) and the time in the optimizer steps, end-to-end samples/s, peak memory and, under
ZeRO-3, the prefetch-trace invalidations per step, then ours / baseline. Peaks: the device's data-sheet figures on a
known GPU, otherwise measured here (a large copy and a large matmul). Results are appended to
``benchmarks/results.md`` (``--results``) with date, device, versions and the command.

``--algorithm grpo|rloo|reinforce_pp|remax`` (with ``--num_generations K``) runs the same workload --
``--batch`` sequences a step, ``--batch / K`` prompts each answered ``K`` times -- without a critic;
run it beside a PPO run (two processes: the CPU peak is the process's) to measure what the critic
costs.

``--actor`` / ``--critic`` take a model folder, a dschat short name, or ``opt-1.3b`` / ``opt-350m``
(upstream's shapes with random weights, built from the configs, no download; tokenizer from
``tiny-opt``). ``opt-1.3b-thin`` / ``opt-350m-thin`` keep those models' 24 layers and layer-norm
placement at hidden size 64 and a 1024-id vocabulary: on a CPU their host work (hooks, launches,
bookkeeping) is most of a step, as a GPU's is more nearly.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import os
import platform
import resource
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Upstream's OPT shapes (facebook/opt-1.3b, facebook/opt-350m config.json), built with random weights.
OPT_SHAPES: dict[str, dict[str, Any]] = {
    "opt-1.3b": dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
                     word_embed_proj_dim=2048, do_layer_norm_before=True),
    "opt-350m": dict(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                     word_embed_proj_dim=512, do_layer_norm_before=False),
    # The same layers, thin (hidden 64, 4 heads, a 1024-id vocabulary): a CPU stand-in for a GPU's host work.
    "opt-1.3b-thin": dict(hidden_size=64, num_hidden_layers=24, ffn_dim=256, num_attention_heads=4,
                          word_embed_proj_dim=64, do_layer_norm_before=True, vocab_size=1024),
    "opt-350m-thin": dict(hidden_size=64, num_hidden_layers=24, ffn_dim=256, num_attention_heads=4,
                          word_embed_proj_dim=32, do_layer_norm_before=False, vocab_size=1024),
}
# Data-sheet peaks of NVIDIA's H100, H200 and A100 variants: (words that must all be in the device
# name, lower case; the variant; dense bf16/fp16 tensor-core FLOP/s; fp32 FLOP/s without tensor cores
# (what an fp32 matmul gets with TF32 off, PyTorch's default); HBM bytes/s). Most specific first: the
# first entry whose words are all in the name is the device's.
GPU_PEAKS: tuple[tuple[tuple[str, ...], str, float, float, float], ...] = (
    (("h100", "nvl"), "H100 NVL", 835e12, 60e12, 3.9e12),
    (("h100", "pcie"), "H100 PCIe", 756e12, 51e12, 2.0e12),
    (("h100",), "H100 SXM", 989e12, 67e12, 3.35e12),
    (("h200", "nvl"), "H200 NVL", 835e12, 60e12, 4.8e12),
    (("h200",), "H200 SXM", 989e12, 67e12, 4.8e12),
    (("a100", "pcie", "40gb"), "A100 PCIe 40GB", 312e12, 19.5e12, 1.555e12),
    (("a100", "40gb"), "A100 SXM 40GB", 312e12, 19.5e12, 1.555e12),
    (("a100", "pcie"), "A100 PCIe 80GB", 312e12, 19.5e12, 1.935e12),
    (("a100",), "A100 SXM 80GB", 312e12, 19.5e12, 2.039e12),
)


# A Llama-3.2-1B-shaped actor (meta-llama/Llama-3.2-1B config.json), random weights, tiny-llama's tokenizer.
LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                     rms_norm_eps=1e-5, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
}

MODES = ("baseline", "ours", "ours-no-fuse", "ours-no-gather", "ours-no-graphs", "ours-no-pack", "ours-no-score-gather",
         "ours-no-train-gather", "ours-hooked", "ours-graphs", "ours-he", "ours-tp")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actor", default="smollm2-135m",
                   help="actor model (folder, short name, opt-1.3b, opt-350m, their -thin twins, llama-1b)")
    p.add_argument("--critic", default=None, help="critic/reward body (default: the actor's model); random value head")
    p.add_argument("--prompt_len", type=int, default=64, help="--max_prompt_seq_len: prompts are left-padded to it")
    p.add_argument("--answer_len", type=int, default=64, help="--max_answer_seq_len; every answer has exactly this many tokens")
    p.add_argument("--answer_spread", type=float, default=0.0,
                   help="0 (default): every answer is --answer_len tokens. F in (0, 1]: each answer is cut after "
                        "generation at a length drawn uniformly from [(1 - F) x --answer_len, --answer_len] (the "
                        "same lengths in every mode), ending in EOS with padding after it, as a trained actor's "
                        "answers end: what the scoring passes and training see in a real run (sequence packing "
                        "acts on that padding)")
    p.add_argument("--batch", type=int, default=4, help="per-device generation = training batch")
    p.add_argument("--steps", type=int, default=3, help="measured PPO iterations per mode")
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured PPO iterations per mode (use 2 where a mode trains through ZeRO-3's hooks: "
                        "DeepSpeed works out its release plan once, at the first step with a complete trace)")
    p.add_argument("--zero_stage", type=int, default=0, choices=(0, 1, 2, 3), help="actor and critic ZeRO stage")
    p.add_argument("--lora_dim", type=int, default=0, help="actor LoRA rank (0: off)")
    p.add_argument("--hybrid_engine", action="store_true", help="--enable_hybrid_engine for ours")
    p.add_argument("--dtype", default=None, choices=("fp16", "bf16", "fp32"), help="default: fp32 on CPU, bf16 on GPU")
    p.add_argument("--modes", default="baseline,ours",
                   help="comma-separated, run in this order: baseline, ours, and ours without one fast path "
                        "(ours-no-fuse: LoRA not fused for generation; ours-no-gather: ZeRO-3 weights fetched "
                        "per layer and token, which also means HF generate instead of dschat's loop; "
                        "ours-no-graphs: --generation_loop dschat; ours-no-pack: --sequence_packing off; "
                        "ours-no-score-gather: --zero3_gather_for_scoring off; ours-no-train-gather: "
                        "--zero3_gather_for_training off; ours-hooked: both off), or "
                        "ours with --generation_loop graphs "
                        "(ours-graphs), or ours decoding with dschat's Hybrid Engine (ours-he, what "
                        "--enable_hybrid_engine selects), or ours-he over tensor-parallel groups of "
                        "--inference_tp_size ranks (ours-tp). With two modes a last column gives the second's "
                        "speed-up over the first")
    p.add_argument("--inference_tp_size", type=int, default=1,
                   help="--inference_tp_size for the ours-tp mode: launch the benchmark on N x k ranks "
                        "(deepspeed --num_gpus ...); needs --zero_stage 3 and --hybrid_engine. The other modes "
                        "decode with TP degree 1 on the same ranks")
    p.add_argument("--release_inference_cache", action="store_true",
                   help="--release_inference_cache for ours: dschat's Hybrid Engine frees its KV cache and weight "
                        "copy after each rollout")
    p.add_argument("--ours_generation_loop", default="auto", choices=("auto", "dschat", "hf", "graphs"),
                   help="--generation_loop for ours (auto: CUDA graphs on CUDA, dschat's loop elsewhere)")
    p.add_argument("--algorithm", default="ppo", choices=("ppo", "grpo", "rloo", "reinforce_pp", "remax"),
                   help="step 3's --algorithm (the critic-free ones build no critic)")
    p.add_argument("--num_generations", type=int, default=1,
                   help="answers per prompt (--num_generations); must divide --batch")
    p.add_argument("--profile", action="store_true",
                   help="after every mode's measured steps, one more step per mode with its scoring passes and its "
                        "training under torch.profiler (not counted in the figures): per phase, wall time, kernel time and "
                        "launches (CUDA), time in operators, and the operators that took longest, added to the "
                        "results")
    p.add_argument("--trace_dir", default="",
                   help="with --profile: write each mode's profiled training phase here as a gzipped Chrome trace "
                        "(<mode>-training.json.gz, <mode>-<position>-training.json.gz for a mode listed twice; "
                        "rank 0's; open it in Perfetto or chrome://tracing)")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results.md"), help="append the results here ('' : don't)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher (ranks read LOCAL_RANK)")
    args = p.parse_args(argv)
    if not 0.0 <= args.answer_spread <= 1.0:
        p.error(f"--answer_spread must be within [0, 1], got {args.answer_spread}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes must list some of {', '.join(MODES)}, got {args.modes!r}")
    args.modes = modes
    if min(args.prompt_len, args.answer_len, args.batch, args.steps) < 1 or args.warmup < 0:
        p.error("--prompt_len, --answer_len, --batch and --steps must be >= 1, --warmup >= 0")
    if ("ours-tp" in modes) != (args.inference_tp_size > 1) or (args.inference_tp_size > 1 and (
            args.zero_stage != 3 or not args.hybrid_engine)):
        p.error("--modes ours-tp and --inference_tp_size N > 1 go together, with --zero_stage 3 and --hybrid_engine")
    if args.trace_dir and not args.profile:
        p.error("--trace_dir writes the traces of --profile: add --profile")
    if args.num_generations < 1 or args.batch % args.num_generations:
        p.error(f"--num_generations {args.num_generations} must divide --batch {args.batch}")
    return args


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------
def opt_config(name: str, pad_token_id: int, bos_token_id: int, eos_token_id: int) -> Any:
    """The ``OPTConfig`` of ``opt-1.3b`` / ``opt-350m`` and their thin twins (:data:`OPT_SHAPES`; OPT's vocabulary,
    unless the shape says otherwise, and positions)."""
    from transformers import OPTConfig

    return OPTConfig(**{"vocab_size": 50272, "max_position_embeddings": 2048, "pad_token_id": pad_token_id,
                        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, **OPT_SHAPES[name]})


def llama_config(name: str, pad_token_id: int, bos_token_id: int, eos_token_id: int) -> Any:
    """The ``LlamaConfig`` of ``llama-1b`` (:data:`LLAMA_SHAPES`)."""
    from transformers import LlamaConfig

    return LlamaConfig(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       **LLAMA_SHAPES[name])


def materialise(name: str, folder: Path) -> str:
    """A model folder for ``name``: ``opt-*`` / ``llama-1b`` shapes get random weights and tiny-opt's /
    tiny-llama's tokenizer (every id of which is inside the shape's vocabulary)."""
    if name not in OPT_SHAPES and name not in LLAMA_SHAPES:
        return name
    from transformers import AutoModelForCausalLM

    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    out = folder / name
    if not (out / "config.json").exists():
        tokenizer = load_hf_tokenizer("tiny-opt" if name in OPT_SHAPES else "tiny-llama")
        build = opt_config if name in OPT_SHAPES else llama_config
        config = build(name, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
        torch.manual_seed(0)
        save_hf_model(AutoModelForCausalLM.from_config(config), tokenizer, out)
    return str(out)


def critic_folder(model: str, folder: Path) -> str:
    """A step-2-style folder (body + random ``v_head``) on ``model``; timing does not depend on weights."""
    from dschat.models.build import create_critic_model
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    out = folder / "critic"
    tokenizer = load_hf_tokenizer(model)
    save_hf_model(create_critic_model(model, tokenizer, None), tokenizer, out)
    return str(out)


def model_folders(actor: str, critic: str | None, folder: Path) -> tuple[str, str]:
    """The actor's model (:func:`materialise`) and a step-2-style critic folder (:func:`critic_folder`) on
    ``critic`` (default: the actor's model), written into ``folder``."""
    return materialise(actor, folder), critic_folder(materialise(critic or actor, folder), folder)


def step3_main_module() -> Any:
    """``training/step3_rlhf_finetuning/main.py`` imported as a module (it is not a package)."""
    import importlib.util

    name = "dschat_step3_main"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "training" / "step3_rlhf_finetuning" / "main.py")
    step3 = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = step3  # its dataclasses look their module up
    spec.loader.exec_module(step3)
    return step3


def step3_argv(args: argparse.Namespace, actor: str, critic: str, data_dir: Path, dtype: str) -> list[str]:
    """The step-3 flags (``training/step3_rlhf_finetuning/main.py``'s) of this benchmark's ``args``
    (:func:`parse_args`' fields) on the model folders ``actor`` and ``critic``, in ``dtype``."""
    argv = [
        "--actor_model_name_or_path", actor, "--critic_model_name_or_path", critic,
        "--data_path", "dschat/builtin", "--data_output_path", str(data_dir),
        "--per_device_generation_batch_size", str(args.batch), "--per_device_training_batch_size", str(args.batch),
        "--max_prompt_seq_len", str(args.prompt_len), "--max_answer_seq_len", str(args.answer_len),
        "--actor_zero_stage", str(args.zero_stage), "--critic_zero_stage", str(args.zero_stage),
        "--dtype", dtype, "--actor_learning_rate", "1e-6", "--critic_learning_rate", "1e-6",
        "--actor_dropout", "0.0", "--num_warmup_steps", "0", "--seed", str(args.seed),
        "--algorithm", args.algorithm, "--num_generations", str(args.num_generations),
    ]
    if args.lora_dim:
        from transformers import AutoConfig

        from dschat.models.families import family_of
        from dschat.models.registry import resolve_model_path

        family = family_of(AutoConfig.from_pretrained(resolve_model_path(actor)))
        argv += ["--actor_lora_dim", str(args.lora_dim), "--actor_lora_module_name", family.lora_module_name]
    if args.hybrid_engine:
        argv.append("--enable_hybrid_engine")
    if args.release_inference_cache:
        argv.append("--release_inference_cache")
    return argv + ["--inference_tp_size", str(args.inference_tp_size)]


@dataclass
class Step3Build:
    """Step 3's engines and trainer as this benchmark runs them."""

    engine: Any  # DeepSpeedRLHFEngine
    trainer: Any  # DeepSpeedPPOTrainer
    tokenizer: Any
    argv: list[str]  # the step-3 flags they were built from (:func:`step3_argv`)
    he_available: bool  # the generator's Hybrid Engine is usable
    dschat_he: bool  # --hybrid_engine asked for dschat's Hybrid Engine


def build_step3(args: argparse.Namespace, actor: str, critic: str, data_dir: Path, dtype: str) -> Step3Build:
    """Build step 3's engines (``DeepSpeedRLHFEngine``; no critic for a critic-free ``--algorithm``) and
    trainer from :func:`step3_argv`, every answer exactly ``--answer_len`` tokens (``min_new_tokens``)."""
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine

    argv = step3_argv(args, actor, critic, data_dir, dtype)
    sargs = step3_main_module().parse_args(argv)
    tokenizer = load_hf_tokenizer(actor)
    engine = DeepSpeedRLHFEngine(actor, critic, tokenizer, sargs, num_total_iters=10_000,
                                 with_critic=args.algorithm == "ppo")
    trainer = DeepSpeedPPOTrainer(engine, sargs)
    trainer.generator.extra_generate_kwargs = {"min_new_tokens": args.answer_len}  # fixed workload
    return Step3Build(engine, trainer, tokenizer, argv, trainer.generator.hybrid_engine_active,
                      trainer.generator.use_dschat_engine)


# ------------------------------------------------------------------------------------------------
# Peaks
# ------------------------------------------------------------------------------------------------
@dataclass
class Peaks:
    flops: float  # FLOP/s in the training dtype
    bandwidth: float  # bytes/s
    source: str


def datasheet_peaks(device_name: str, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float, str] | None:
    """(FLOP/s in ``dtype``, HBM bytes/s, what they are) of a GPU in :data:`GPU_PEAKS` by its name, else
    None: the dense bf16/fp16 tensor-core peak, or for fp32 the data sheet's fp32 figure."""
    name = device_name.lower()
    for words, variant, half, single, bandwidth in GPU_PEAKS:
        if all(word in name for word in words):
            fp32 = dtype == torch.float32
            flops = single if fp32 else half
            kind = "fp32 (no tensor cores)" if fp32 else "dense bf16/fp16"
            what = f"{variant} data sheet, {kind} {flops / 1e12:g} TFLOP/s, HBM {bandwidth / 1e12:g} TB/s"
            return flops, bandwidth, what
    return None


def device_peaks(device: torch.device, dtype: torch.dtype) -> Peaks:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = datasheet_peaks(name, dtype)
        if known is not None:
            flops, bw, what = known
            return Peaks(flops, bw, f"{name}: {what}")
    # Measured: best of a few large copies (read + write) and large matmuls in the training dtype.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    src = torch.empty(64 * 2**20, dtype=torch.float32, device=device)  # 256 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(); t = time.perf_counter(); dst.copy_(src); sync(); best = min(best, time.perf_counter() - t)
    bandwidth = 2 * src.numel() * src.element_size() / best
    del src, dst
    n = 2048
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(8):  # best of 8: on a shared CPU one slow sample would set the peak low
        sync(); t = time.perf_counter(); a @ b; sync(); best = min(best, time.perf_counter() - t)
    flops = 2 * n**3 / best
    return Peaks(flops, bandwidth, f"measured on this {device.type}: {n}x{n} {str(dtype).replace('torch.', '')} "
                                   f"matmul {flops / 1e12:.3f} TFLOP/s, 256 MiB copy {bandwidth / 1e9:.1f} GB/s "
                                   "(measured, not a data sheet's: on a machine other jobs load, a phase can read "
                                   "over 100% of it)")


# ------------------------------------------------------------------------------------------------
# Profile (--profile)
# ------------------------------------------------------------------------------------------------
@dataclass
class PhaseProfile:
    """One profiled phase: wall seconds, and from torch.profiler the kernels' time and launches (CUDA;
    0 elsewhere), the time spent inside operators on the host, and the longest operators."""
    phase: str
    wall_s: float
    kernel_s: float
    kernels: int
    host_op_s: float
    top_device: list[tuple[str, float, int]]  # (kernel, seconds, calls), longest first
    top_host: list[tuple[str, float, int]]  # (operator, self seconds on the host, calls), longest first
    spans: list[tuple[str, float, int]] = field(default_factory=list)  # (annotated range, host seconds, calls)


def summarise_profile(phase: str, wall_s: float, averages: Sequence[Any], top: int = 6) -> PhaseProfile:
    """A :class:`PhaseProfile` from ``torch.profiler``'s ``key_averages()``: kernels are the events on
    the CUDA device (their self time is their run time); host time is the operators' self CPU time;
    user annotations (``record_function`` ranges: :func:`annotated`'s, the optimizers') are spans, by
    their whole host time. Pure arithmetic, checked by hand in tests."""
    device = [a for a in averages if str(a.device_type).endswith("CUDA") and not a.is_user_annotation]
    host = [a for a in averages if str(a.device_type).endswith("CPU") and not a.is_user_annotation]
    ranges = sorted((a for a in averages if str(a.device_type).endswith("CPU") and a.is_user_annotation),
                    key=lambda a: -a.cpu_time_total)
    by_device = sorted(device, key=lambda a: -a.self_device_time_total)[:top]
    by_host = sorted(host, key=lambda a: -a.self_cpu_time_total)[:top]
    return PhaseProfile(
        phase, wall_s,
        kernel_s=sum(a.self_device_time_total for a in device) / 1e6,
        kernels=sum(a.count for a in device),
        host_op_s=sum(a.self_cpu_time_total for a in host) / 1e6,
        top_device=[(a.key, a.self_device_time_total / 1e6, a.count) for a in by_device],
        top_host=[(a.key, a.self_cpu_time_total / 1e6, a.count) for a in by_host],
        spans=[(a.key, a.cpu_time_total / 1e6, a.count) for a in ranges[:top + 2]],
    )


class PhaseProfiler:
    """torch.profiler over stretches of one step, one :class:`PhaseProfile` per ``start`` / ``stop``."""

    def __init__(self, device: torch.device, sync: Any) -> None:
        from torch.profiler import ProfilerActivity

        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.sync = sync
        self.phases: list[PhaseProfile] = []
        self._prof: Any = None
        self._t = 0.0

    def start(self) -> None:
        """Begin a phase; a phase begun and not stopped is dropped (a step with two rollouts, such as
        ReMax's: its scoring begins after the last)."""
        from torch.profiler import profile

        self.sync()
        if self._prof is not None:
            self._prof.stop()
        self._prof = profile(activities=self.activities)
        self._prof.start()
        self._t = time.perf_counter()

    def stop(self, phase: str, trace: Path | None = None) -> None:
        self.sync()
        wall = time.perf_counter() - self._t
        self._prof.stop()
        self.phases.append(summarise_profile(phase, wall, self._prof.key_averages()))
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                raw = Path(tmp) / "trace.json"
                self._prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        self._prof = None


@contextmanager
def annotated(trainer: Any) -> Iterator[None]:
    """Name the training's parts for the profiler: the actor's and the critic's forward passes
    (the trainer's scoring passes' ``token_log_probs`` / ``token_values``, or a trainer's own
    ``_token_log_probs`` / ``_token_values``), and each engine's ``backward`` and ``step``."""
    from torch.profiler import record_function

    def named(label: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)
        return run

    passes = getattr(trainer, "passes", None)
    owners = ([(passes, "token_log_probs", "actor forward"), (passes, "token_values", "critic forward")]
              if passes is not None else
              [(trainer, "_token_log_probs", "actor forward"), (trainer, "_token_values", "critic forward")])
    for name in ("actor", "critic"):
        engine = getattr(trainer, f"{name}_model", None)
        if engine is not None:
            owners += [(engine, "backward", f"{name} backward"), (engine, "step", f"{name} optimizer step")]
    owners = [(obj, attr, label) for obj, attr, label in owners if hasattr(obj, attr)]
    kept = [(obj, attr, obj.__dict__.get(attr)) for obj, attr, _ in owners]
    for obj, attr, label in owners:
        setattr(obj, attr, named(label, getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, before in kept:
            if before is None:
                del obj.__dict__[attr]
            else:
                setattr(obj, attr, before)


def trace_path(trace_dir: str, modes: Sequence[str], k: int) -> Path:
    """``--trace_dir``'s file for the ``k``-th of ``modes``: ``<mode>-training.json.gz``, with the
    mode's position where it is listed twice."""
    mode = modes[k]
    return Path(trace_dir) / (f"{mode}-training.json.gz" if modes.count(mode) == 1 else f"{mode}-{k + 1}-training.json.gz")


def profile_lines(results: Sequence[ModeResult]) -> list[str]:
    """The results' lines for ``--profile``: one per mode and phase."""
    lines = []
    for r in results:
        for ph in r.profile:
            kernels = (f"kernels {ph.kernel_s:.3f} s ({100 * ph.kernel_s / ph.wall_s:.0f} % of wall), "
                       f"{ph.kernels} launches; " if ph.kernels else "")
            head = (f"- {r.mode}, {ph.phase}: wall {ph.wall_s:.3f} s; {kernels}host time in operators "
                    f"{ph.host_op_s:.3f} s")
            named = [("host time in ranges", ph.spans)] if ph.spans else []
            named += [("longest kernels", ph.top_device)] if ph.top_device else []
            named += [("longest operators on the host (self time)", ph.top_host)]
            parts = [f"{what}: " + ", ".join(f"`{name[:60]}` {sec:.3f} s x{calls}" for name, sec, calls in items)
                     for what, items in named]
            lines.append(head + "; " + "; ".join(parts))
    return lines


# ------------------------------------------------------------------------------------------------
# One mode
# ------------------------------------------------------------------------------------------------
@dataclass
class ModeResult:
    mode: str
    gen_s: float = 0.0
    exp_s: float = 0.0
    train_s: float = 0.0
    optimizer_s: float = 0.0  # of train_s: inside the actor's and the critic's engine.step()
    steps: int = 0
    scoring_passes: tuple[int, int, int] = (1, 1, 1)  # per step: actor-shaped (reference; actor), reward, critic
    trace_invalidations: int = -1  # ZeRO-3 prefetch-trace invalidations in the measured steps (-1: not ZeRO-3)
    prompt_width: list[int] = field(default_factory=list)  # prompt columns fed per step
    peak_memory_bytes: int = 0
    memory_note: str = ""
    generation_loop: str = ""  # what the mode's last rollout decoded with (RolloutGenerator.last_loop)
    device_mallocs: int = -1  # CUDA: the caching allocator's device allocations in the measured steps (-1: not CUDA)
    alloc_retries: int = -1  # CUDA: allocations that freed the cache and retried (memory pressure)
    profile: list[PhaseProfile] = field(default_factory=list)  # --profile: the extra step's phases
    # Per measured step, model name -> (rows, columns) its pass computed: packed rows where it packed,
    # else the padded batch (:func:`pass_shapes`); the scoring passes' (experience), and every training
    # pass's. Empty: the padded batch, ``batch x (prompt width + answer_len)``, everywhere.
    exp_shapes: list[dict[str, tuple[int, int]]] = field(default_factory=list)
    train_shapes: list[dict[str, list[tuple[int, int]]]] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.gen_s + self.exp_s + self.train_s


def prompt_batches(tokenizer: Any, batch: int, prompt_len: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of held-out builtin prompts, left-padded to ``prompt_len`` (as the collator does)."""
    from dschat.eval.heldout import heldout_prompts

    texts = heldout_prompts()
    rows = [tokenizer(t)["input_ids"][-prompt_len:] for t in texts]
    out = []
    for i in range(count):
        chunk = [rows[(i * batch + j) % len(rows)] for j in range(batch)]
        ids = torch.tensor([[tokenizer.pad_token_id] * (prompt_len - len(r)) + r for r in chunk])
        mask = torch.tensor([[0] * (prompt_len - len(r)) + [1] * len(r) for r in chunk])
        out.append((ids, mask))
    return out


def answer_lengths(batch: int, answer_len: int, spread: float, step: int, seed: int) -> torch.Tensor | None:
    """(batch,) answer lengths of one step under ``--answer_spread`` (None: every answer full length);
    the same in every mode."""
    if spread <= 0:
        return None
    shortest = max(2, int(round((1.0 - spread) * answer_len)))
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(shortest, answer_len + 1, (batch,), generator=g)


def cut_answers(rollout: Any, prompt_width: int, lengths: torch.Tensor, eos: int, pad: int) -> Any:
    """``rollout`` with answer ``i`` ending in EOS at token ``lengths[i]`` and padding after it. The
    rollout's log-probs are kept as they were, so the EOS column and the reward slot hold the log-probs
    of the tokens replaced: the step's KL and reward figures are off, its timings are not."""
    seq = rollout.sequences.clone()
    answer = seq[:, prompt_width:]
    cols = torch.arange(answer.shape[1], device=seq.device)[None, :]
    n = lengths.to(seq.device)[:, None]
    answer = torch.where(cols == n - 1, torch.full_like(answer, eos), answer)
    seq[:, prompt_width:] = torch.where(cols >= n, torch.full_like(answer, pad), answer)
    return type(rollout)(seq, rollout.logprobs)


def configure(trainer: Any, mode: str, he_available: bool, ours_loop: str = "auto", dschat_he: bool = False,
              tp_size: int = 1) -> None:
    """Set the generator's fast paths for ``mode``; ``dschat_he``: plain ``ours`` was asked for dschat's
    Hybrid Engine (``--hybrid_engine``), which ``ours-he`` and ``ours-tp`` (over groups of ``tp_size``
    ranks) always take."""
    from dschat.rlhf.scoring_passes import ScoringGather, TrainingGather

    ours = mode.startswith("ours")  # ours, or ours without one fast path (an ablation)
    gen = trainer.generator
    gen.use_dschat_engine = mode in ("ours-he", "ours-tp") or (mode == "ours" and dschat_he)
    gen.inference_tp_size = tp_size if mode == "ours-tp" else 1
    trainer.reuse_rollout_logprobs = ours
    gen.keep_logprobs = ours
    gen.fuse_lora = ours and mode != "ours-no-fuse"
    gen.zero3_gather = "auto" if ours and mode != "ours-no-gather" else "off"
    loops = {"ours-graphs": "graphs", "ours-no-graphs": "dschat"}
    gen.generation_loop = loops.get(mode, ours_loop) if ours else "hf"
    gen.cpu_decode_linear = "onednn" if ours else "off"
    # --sequence_packing: the models the trainer resolved as able to pack, in ours; none in the baseline.
    supported = getattr(trainer, "packing_supported", None)
    if supported is None:
        supported = trainer.packing_supported = dict(getattr(trainer, "packing", {}))
    trainer.packing = {name: ok and ours and mode != "ours-no-pack" for name, ok in supported.items()}
    # --zero3_gather_for_scoring: ours gathers each ZeRO-3 model once for its scoring pass; the baseline does not.
    trainer.scoring_gather = ScoringGather("auto" if ours and mode not in ("ours-no-score-gather", "ours-hooked") else "off")
    # --zero3_gather_for_training: ours trains each ZeRO-3 model gathered whole on one rank; the baseline does not.
    trainer.training_gather = TrainingGather("auto" if ours and mode not in ("ours-no-train-gather", "ours-hooked") else "off",
                                             {"actor": getattr(trainer, "actor_model", None),
                                              "critic": getattr(trainer, "critic_model", None)})
    gen._gather_decided = None
    gen.hybrid_engine_active = ours and he_available


TRACE_INVALIDATIONS = {"n": 0, "counting": False}


def count_trace_invalidations() -> None:
    """Count every invalidation of a ZeRO-3 prefetch trace (any engine) in :data:`TRACE_INVALIDATIONS`:
    an invalidated trace means passes that fetch every module on demand, without prefetching."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    if TRACE_INVALIDATIONS["counting"]:
        return
    original = PartitionedParameterCoordinator._invalidate_trace

    def counting(self: Any) -> None:
        TRACE_INVALIDATIONS["n"] += 1
        original(self)

    PartitionedParameterCoordinator._invalidate_trace = counting
    TRACE_INVALIDATIONS["counting"] = True


def run_mode(trainer: Any, batches: list, mode: str, steps: int, warmup: int, device: torch.device,
             he_available: bool, ours_loop: str = "auto", dschat_he: bool = False, tp_size: int = 1,
             answer_spread: float = 0.0, seed: int = 0, profile_only: bool = False,
             trace: Path | None = None) -> ModeResult:
    """``warmup`` + ``steps`` PPO steps of ``mode`` (the figures: the last ``steps``). With
    ``profile_only``, instead, one step on the batch after those (``batches`` holds it) whose scoring
    passes and training run under torch.profiler (its training written to ``trace`` as a gzipped
    Chrome trace where given): the result holds only ``profile``."""
    from dschat.data.collators import drop_padding_columns

    configure(trainer, mode, he_available, ours_loop, dschat_he, tp_size)
    generator = trainer.generator
    rollout = type(generator).rollout.__get__(generator)  # the class's method, not a previous mode's cut
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = ModeResult(mode)
    engines = [e for e in (trainer.actor_model, getattr(trainer, "critic_model", None)) if e is not None]
    step_time = {"s": 0.0}

    def timed_step(step: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            sync(); t = time.perf_counter()
            out = step(*args, **kwargs)
            sync(); step_time["s"] += time.perf_counter() - t
            return out
        return run

    for engine in engines:
        engine.step = timed_step(engine.step)  # an instance attribute over DeepSpeed's method, for this mode
    reward_passes = int(getattr(trainer, "reward_model", None) is not None)
    critic_passes = int(getattr(trainer, "critic_model", None) is not None)
    # Actor-shaped scoring passes as they happen (the reference's, and the actor's where the rollout
    # kept no log-probs), counted in the last measured step.
    actor_shaped = {"n": 0}
    passes = trainer.passes  # the scoring passes the trainer's experience maker and update share
    token_log_probs = passes.token_log_probs

    def counted(name: str, *args: Any, **kwargs: Any) -> Any:
        actor_shaped["n"] += 1
        return token_log_probs(name, *args, **kwargs)

    # The rows and columns each pass computed, from the packings the passes ask for: the experience
    # maker's first (one packing for every scoring pass; ReMax's greedy baseline asks again), and each
    # training micro-step's.
    pack = passes.packed
    shapes: dict[str, Any] = {"phase": "", "exp": {}, "train": {}, "exp_layout": ""}

    def recorded(seq: torch.Tensor, attention_mask: torch.Tensor, *names: str) -> Any:
        layout = pack(seq, attention_mask, *names)
        rows = tuple(layout.input_ids.shape) if layout is not None else None
        got = pass_shapes(trainer.packing, tuple(seq.shape), rows, names)
        if shapes["phase"] == "exp" and not shapes["exp"]:
            shapes["exp"] = got
            kind, (r, w) = ("packed", rows) if rows is not None else ("padded", tuple(seq.shape))
            shapes["exp_layout"] = f"{kind} {r} x {w}"
        elif shapes["phase"] == "train":
            for name, shape in got.items():
                shapes["train"].setdefault(name, []).append(shape)
        return layout

    def one_step(i: int, profiler: PhaseProfiler | None = None) -> None:
        """PPO step ``i`` on ``batches[i]``, added to ``result`` if measured. With ``profiler``, the scoring passes
        (from the rollout's end) and the training are profiled as two phases."""
        prompts, mask = (t.to(device) for t in batches[i])
        if mode.startswith("ours"):
            trimmed = drop_padding_columns({"prompt": prompts, "prompt_att_mask": mask}, "prompt_att_mask", side="left")
            prompts, mask = trimmed["prompt"], trimmed["prompt_att_mask"]
        lengths = answer_lengths(prompts.shape[0] * trainer.settings.num_generations, trainer.max_answer_seq_len,
                                 answer_spread, i, seed)
        generate = rollout
        if lengths is not None:
            tokenizer = trainer.tokenizer

            def generate(p: torch.Tensor, m: torch.Tensor, _n: torch.Tensor = lengths) -> Any:
                out = rollout(p, m)
                if p.shape[0] != _n.shape[0]:  # ReMax's greedy baseline: one answer per prompt, left whole
                    return out
                return cut_answers(out, p.shape[1], _n, tokenizer.eos_token_id, tokenizer.pad_token_id)
        if profiler is not None:
            unprofiled = generate

            def generate(p: torch.Tensor, m: torch.Tensor) -> Any:  # scoring is profiled from here on
                out = unprofiled(p, m)
                profiler.start()
                return out
        generator.rollout = generate
        sync()
        actor_shaped["n"] = 0
        passes.token_log_probs = counted
        passes.packed = recorded
        shapes.update(phase="exp", exp={}, train={}, exp_layout="")
        try:
            exp = trainer.generate_experience(prompts, mask, i)
        finally:
            del passes.token_log_probs
        result.scoring_passes = (actor_shaped["n"], reward_passes, critic_passes)
        if profiler is not None:
            profiler.stop("scoring")
            profiler.start()
        sync()
        shapes["phase"] = "train"
        t = time.perf_counter()
        try:
            with annotated(trainer) if profiler is not None else nullcontext():
                trainer.prepare_rollout([exp])
                trainer.train()
                for _, micro, _ in trainer.schedule([exp], None):
                    trainer.train_rlhf(micro)
                sync()
        finally:
            del passes.packed
        train_s = time.perf_counter() - t
        if profiler is not None:
            profiler.stop("training", trace=trace)
        label = " (warm-up)" if i < warmup else " (profiled)" if profiler is not None else ""
        print(f"[{mode}] step {i}{label}: generation {trainer.generate_time:.2f} s, experience "
              f"{trainer.experience_time:.2f} s, training {train_s:.2f} s, scoring rows "
              f"{shapes['exp_layout'] or 'n/a'}, prompt width {prompts.shape[1]}", flush=True)
        if warmup <= i < warmup + steps:
            result.gen_s += trainer.generate_time
            result.exp_s += trainer.experience_time
            result.train_s += train_s
            result.steps += 1
            result.prompt_width.append(int(prompts.shape[1]))
            result.exp_shapes.append(dict(shapes["exp"]))
            result.train_shapes.append({name: list(v) for name, v in shapes["train"].items()})

    try:
        if profile_only:
            profiler = PhaseProfiler(device, sync)
            one_step(warmup + steps, profiler)
            result.profile = profiler.phases
            return result
        for i in range(warmup + steps):
            if i == warmup:
                step_time["s"] = 0.0
                invalidations_before = TRACE_INVALIDATIONS["n"]
                allocator_before = allocator_counts(device)
            one_step(i)
        result.optimizer_s = step_time["s"]
        if TRACE_INVALIDATIONS["counting"]:
            result.trace_invalidations = TRACE_INVALIDATIONS["n"] - invalidations_before
        if allocator_before is not None:
            result.device_mallocs, result.alloc_retries = (
                after - before for after, before in zip(allocator_counts(device), allocator_before))
        result.generation_loop = trainer.generator.last_loop or ""
        if device.type == "cuda":
            result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
            result.memory_note = "max allocated in this mode"
        else:
            result.peak_memory_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            result.memory_note = "process peak RSS so far"
        return result
    finally:
        for engine in engines:
            del engine.step  # DeepSpeed's method again
        generator.__dict__.pop("rollout", None)  # the class's rollout again
        passes.__dict__.pop("packed", None)  # the class's methods again, after an error too
        passes.__dict__.pop("token_log_probs", None)


def pass_shapes(packing: dict[str, bool], padded: tuple[int, int], packed: tuple[int, int] | None,
                names: Sequence[str] = ()) -> dict[str, tuple[int, int]]:
    """Model name (``names``, default every model in ``packing``) -> (rows, columns) its pass over one
    batch computes: the packed rows ``packed`` where the model packs and the batch was packed (every
    slot, filler included, is computed), else the padded batch ``padded``."""
    return {name: packed if packed is not None and packing.get(name) else padded for name in names or packing}


def allocator_counts(device: torch.device) -> tuple[int, int] | None:
    """(device allocations, retries) of CUDA's caching allocator so far; None off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0))


# ------------------------------------------------------------------------------------------------
# Accounting
# ------------------------------------------------------------------------------------------------
@dataclass
class Metrics:
    gen_tokens_per_s: float
    gen_ms_per_token: float
    gen_bandwidth: float  # bytes/s
    exp_tokens_per_s: float
    train_tokens_per_s: float
    train_flops: float  # FLOP/s
    exp_flops: float  # FLOP/s of the scoring passes (forward only)
    samples_per_s: float
    seq_len: float  # mean columns per sequence of the padded batch (prompt width + answer_len)
    slots: float = 0.0  # mean slots the actor's training passes computed per sequence (packed rows: fewer)


def kv_bytes_per_position(config: Any, element_size: int) -> int:
    """Bytes of KV cache one sequence position holds over all layers: keys and values, ``layers x
    kv_heads x head_dim`` elements each (grouped-query attention's fewer KV heads; ``head_dim`` from the
    config, else hidden / heads)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_size


def decode_kv_positions(rows: int, prompt_width: int, answer_len: int) -> int:
    """KV-cache positions the decode steps of one rollout read, over all rows: the prefill (token 0)
    reads none, the step that feeds answer token ``j`` (1 to ``answer_len - 1``) attends over the
    ``prompt_width + j`` positions then cached (its own included)."""
    return rows * sum(prompt_width + j for j in range(1, answer_len))


def account(r: ModeResult, *, batch: int, answer_len: int, actor_param_bytes: int, actor_config: Any,
            critic_config: Any, actor_factor: float, critic_factor: float, reward_config: Any = None,
            kv_bytes_per_position: int = 0) -> Metrics:
    """Turn one mode's times into rates. Pure arithmetic (tests/e2e/test_benchmarks.py checks it by hand).
    ``reward_config``: the reward model's shape where there is no critic (the critic's is the reward
    model's in this benchmark). Tokens and FLOPs count the slots each pass computed
    (:attr:`ModeResult.exp_shapes`, :attr:`ModeResult.train_shapes`: packed rows where it packed, filler
    included, attention over a packed row's whole width); the experience tokens are the reference's,
    the training tokens the actor's. Generation bytes: the weights once per decode step plus the KV
    cache each step reads (``kv_bytes_per_position``, :func:`kv_bytes_per_position`; 0 leaves it out)."""
    from dschat.runtime.perf import calculate_flops

    n = max(r.steps, 1)
    seq_len = sum(w + answer_len for w in r.prompt_width) / n
    gen_tokens = batch * answer_len * n
    padded = [(batch, w + answer_len) for w in r.prompt_width]
    exp_shapes = r.exp_shapes or [{} for _ in padded]
    train_shapes = r.train_shapes or [{} for _ in padded]

    def slots(shapes: Sequence[tuple[int, int]]) -> int:
        return sum(rows * cols for rows, cols in shapes)

    def fwd_bwd(factor: float, shapes: Sequence[tuple[int, int]], config: Any) -> float:
        return sum(calculate_flops(factor, rows, cols, config) for rows, cols in shapes)

    exp_actor = [s.get("reference", p) for s, p in zip(exp_shapes, padded)]
    exp_reward = [s.get("reward", p) for s, p in zip(exp_shapes, padded)]
    exp_critic = [s.get("critic", p) for s, p in zip(exp_shapes, padded)]
    train_actor = [s.get("actor", [p]) for s, p in zip(train_shapes, padded)]
    train_critic = [s.get("critic", [p]) for s, p in zip(train_shapes, padded)]
    exp_tokens = slots(exp_actor)
    train_tokens = sum(slots(shapes) for shapes in train_actor)
    flops = sum(fwd_bwd(actor_factor, a, actor_config)
                + (fwd_bwd(critic_factor, c, critic_config) if critic_config is not None else 0.0)
                for a, c in zip(train_actor, train_critic))
    # Scoring: forward passes only (factor 1), each model's pass at its own rows (the reward model's and
    # the critic's differ where only one of them packs), reward_config shaping the reward model.
    actor_passes, reward_passes, critic_passes = r.scoring_passes
    shaped = reward_config or critic_config
    exp_flops = sum(actor_passes * fwd_bwd(1.0, [a], actor_config) + reward_passes * fwd_bwd(1.0, [w], shaped)
                    + critic_passes * fwd_bwd(1.0, [c], shaped)
                    for a, w, c in zip(exp_actor, exp_reward, exp_critic)) if shaped is not None else 0.0
    gen_bytes = (actor_param_bytes * answer_len * n
                 + kv_bytes_per_position * sum(decode_kv_positions(batch, w, answer_len) for w in r.prompt_width))
    return Metrics(
        gen_tokens_per_s=gen_tokens / r.gen_s,
        gen_ms_per_token=1000 * r.gen_s / (answer_len * n),
        gen_bandwidth=gen_bytes / r.gen_s,
        exp_tokens_per_s=exp_tokens / r.exp_s if r.exp_s > 0 else float("inf"),
        train_tokens_per_s=train_tokens / r.train_s,
        train_flops=flops / r.train_s,
        exp_flops=exp_flops / r.exp_s if r.exp_s > 0 else 0.0,
        samples_per_s=batch * n / r.total_s,
        seq_len=seq_len,
        slots=train_tokens / (batch * n),
    )


def table(results: list[ModeResult], metrics: list[Metrics], peaks: Peaks) -> list[str]:
    """One column per mode; with exactly two modes a last column holds the second's speed-up over the
    first (time first / time second, rate second / rate first): ``ours / baseline`` by default."""
    compare = len(results) == 2
    head = "| | " + " | ".join(r.mode for r in results)
    head += f" | {results[1].mode} / {results[0].mode} |" if compare else " |"
    lines = [head, "|---" * (len(results) + 1 + compare) + "|"]

    def row(label: str, values: list[float], fmt: str, ratio: str | None) -> None:
        cells = [format(v, fmt) for v in values]
        extra = ""
        if compare:
            first, second = values
            num, den = (first, second) if ratio == "time" else (second, first)
            extra = (f" {num / den:.2f}x |" if den else " n/a |") if ratio else " |"
        lines.append(f"| {label} | " + " | ".join(cells) + " |" + extra)

    row("generation s/step", [r.gen_s / r.steps for r in results], ".2f", "time")
    row("experience s/step", [r.exp_s / r.steps for r in results], ".2f", "time")
    row("training s/step", [r.train_s / r.steps for r in results], ".2f", "time")
    row("  of which optimizer steps s/step", [r.optimizer_s / r.steps for r in results], ".2f", "time")
    row("end to end s/step", [r.total_s / r.steps for r in results], ".2f", "time")
    row("end to end samples/s", [m.samples_per_s for m in metrics], ".3f", "rate")
    row("columns per sequence", [m.seq_len for m in metrics], ".1f", None)
    row("slots computed per sequence (training; packed rows: fewer)", [m.slots for m in metrics], ".1f", None)
    row("generation tokens/s", [m.gen_tokens_per_s for m in metrics], ".1f", "rate")
    row("generation ms per answer token, whole rollout", [m.gen_ms_per_token for m in metrics], ".1f", None)
    row("generation GB/s ((weights + KV cache read) x steps / time)", [m.gen_bandwidth / 1e9 for m in metrics],
        ".2f", None)
    row("  of peak bandwidth", [100 * m.gen_bandwidth / peaks.bandwidth for m in metrics], ".1f", None)
    row("experience tokens/s (slots computed)", [m.exp_tokens_per_s for m in metrics], ".1f", None)
    row("experience TFLOP/s (forward passes)", [m.exp_flops / 1e12 for m in metrics], ".4f", None)
    row("  of peak FLOP/s", [100 * m.exp_flops / peaks.flops for m in metrics], ".1f", None)
    row("training tokens/s (slots computed)", [m.train_tokens_per_s for m in metrics], ".1f", None)
    row("training TFLOP/s", [m.train_flops / 1e12 for m in metrics], ".4f", None)
    row("  of peak FLOP/s", [100 * m.train_flops / peaks.flops for m in metrics], ".1f", None)
    row("peak memory GiB", [r.peak_memory_bytes / 2**30 for r in results], ".2f", None)
    if all(r.device_mallocs >= 0 for r in results):
        row("CUDA allocator: device allocations / step", [r.device_mallocs / r.steps for r in results], ".1f", None)
        row("CUDA allocator: retries (cache freed) / step", [r.alloc_retries / r.steps for r in results], ".1f", None)
    if all(r.trace_invalidations >= 0 for r in results):
        row("ZeRO-3 trace invalidations / step", [r.trace_invalidations / r.steps for r in results], ".1f", None)
    return lines


def versions() -> str:
    import deepspeed
    import transformers

    return f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}"


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = parse_args(argv)
    from deepspeed.accelerator import get_accelerator

    from dschat.runtime.dist import barrier, init_distributed
    from dschat.runtime.perf import bytes_per_parameter, checkpoint_activations_factor, count_parameters

    info = init_distributed()
    device = info.device
    on_gpu = get_accelerator().device_name() != "cpu"
    dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    torch.manual_seed(args.seed)
    with shared_temporary_directory(info.rank, info.world_size) as tmp_path:
        actor, critic = model_folders(args.actor, args.critic, tmp_path)
        barrier()  # rank 0 wrote the folders
        built = build_step3(args, actor, critic, tmp_path / "data", dtype)
        engine, trainer, tokenizer = built.engine, built.trainer, built.tokenizer
        he_available, dschat_he = built.he_available, built.dschat_he
        # batch / K prompts a step; the trainer answers each K times.
        batches = prompt_batches(tokenizer, args.batch // args.num_generations, args.prompt_len,
                                 args.warmup + args.steps + args.profile)
        torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        peaks = device_peaks(device, torch_dtype if on_gpu else torch.float32)

        if args.zero_stage == 3:
            count_trace_invalidations()
        common = (args.ours_generation_loop, dschat_he, args.inference_tp_size, args.answer_spread, args.seed)
        results = [run_mode(trainer, batches, mode, args.steps, args.warmup, device, he_available, *common)
                   for mode in args.modes]
        # Profiled steps only after every mode's measured ones: on CUDA the profiler leaves its layer
        # loaded, which would slow the modes measured after it.
        if args.profile:
            for k, (mode, result) in enumerate(zip(args.modes, results)):
                trace = trace_path(args.trace_dir, args.modes, k) if args.trace_dir and info.rank == 0 else None
                result.profile = run_mode(trainer, batches, mode, args.steps, args.warmup, device, he_available,
                                          *common, profile_only=True, trace=trace).profile
        he_engine = trainer.generator.engine
        actor_module = engine.actor.module
        critic_module = engine.critic.module if engine.critic is not None else None
        actor_factor = checkpoint_activations_factor(False, args.lora_dim, actor_module.config.hidden_size)
        critic_factor = (checkpoint_activations_factor(False, 0, critic_module.config.hidden_size)
                         if critic_module is not None else 0.0)
        critic_config = critic_module.config if critic_module is not None else None
        reward_module = engine.reward.module if engine.reward is not None else None
        metrics = [account(r, batch=args.batch, answer_len=args.answer_len,
                           actor_param_bytes=count_parameters(actor_module) * bytes_per_parameter(actor_module),
                           actor_config=actor_module.config, critic_config=critic_config,
                           actor_factor=actor_factor, critic_factor=critic_factor,
                           reward_config=reward_module.config if reward_module is not None else None,
                           kv_bytes_per_position=kv_bytes_per_position(actor_module.config,
                                                                       bytes_per_parameter(actor_module)))
                   for r in results]

    device_name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--local_rank")]
    launcher = f"deepspeed --num_gpus {info.world_size} " if info.world_size > 1 else "python "
    command = f"{launcher}benchmarks/step3.py " + " ".join(shlex.quote(a) for a in given)
    lines = [
        f"### step 3, {datetime.date.today().isoformat()}: {args.actor} actor, {args.critic or args.actor} critic, "
        f"{args.batch} x ({args.prompt_len} + {args.answer_len}), ZeRO-{args.zero_stage}, {dtype}"
        + (f", LoRA {args.lora_dim}" if args.lora_dim else "") + (", Hybrid Engine requested" if args.hybrid_engine else "")
        + (f", algorithm {args.algorithm} (K = {args.num_generations}, no critic)" if args.algorithm != "ppo" else "")
        + (f", inference TP {args.inference_tp_size} over {info.world_size} ranks (per-rank figures)"
           if args.inference_tp_size > 1 else "")
        + (f", answers cut to {1 - args.answer_spread:.0%}-100 % of {args.answer_len} tokens" if args.answer_spread else ""),
        "",
        f"- device: {device_name}; {versions()}",
        f"- command: `{command}`",
        f"- {args.steps} measured PPO steps per mode after {args.warmup} warm-up; peaks: {peaks.source}",
        f"- Hybrid Engine for ours: {'active' if he_available else 'not used'}"
        + (f" (fallback of {fallback.path}: {fallback.reason})" if (fallback := trainer.generator.fallback) else "")
        + "; generation loop per mode (its last rollout): "
        + ", ".join(f"{r.mode} {r.generation_loop}" for r in results),
        f"- sequence packing in ours: {', '.join(n for n, ok in trainer.packing_supported.items() if ok) or 'none'}"
        + (f" (padded: {', '.join(n for n, ok in trainer.packing_supported.items() if not ok)})"
           if not all(trainer.packing_supported.values()) else ""),
        f"- memory: {results[0].memory_note}",
        *([f"- dschat Hybrid Engine: {he_engine.rollouts} rollouts, compiles per rollout "
           f"{he_engine.compiles_per_rollout or 'n/a (eager)'}, CUDA graphs captured {he_engine.captures}, weight "
           f"buffers allocated {he_engine.weight_allocations}x, KV cache {he_engine.cache_allocations}x, "
           f"TP degree {he_engine.tp_size} (the last mode's engine)"
           + (", --release_inference_cache" if args.release_inference_cache else "")] if he_engine else []),
        "",
        *table(results, metrics, peaks),
        "",
        *([f"Profile of one more step per mode, after every mode's measured steps (torch.profiler; not "
           f"in the figures above): the scoring passes and the training"
           + (f"; traces of the training in {args.trace_dir}" if args.trace_dir else ""), "",
           *profile_lines(results), ""] if args.profile else []),
    ]
    return publish(lines, args.results, write=info.rank == 0)


@contextmanager
def shared_temporary_directory(rank: int, world_size: int) -> Iterator[Path]:
    """A new private folder that every rank sees (rank 0 makes it, the others learn its name through
    a collective: no pickles), removed by rank 0 when all are done. One rank: a TemporaryDirectory."""
    from dschat.runtime.dist import barrier, gather_ints

    if world_size == 1:
        with tempfile.TemporaryDirectory(prefix="dschat-bench-") as tmp:
            yield Path(tmp)
        return
    name = tempfile.mkdtemp(prefix="dschat-bench-").encode() if rank == 0 else b""
    table = gather_ints(list(name.ljust(4096, b"\0")))
    path = Path(bytes(table[0]).rstrip(b"\0").decode())
    try:
        yield path
    finally:
        barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def publish(lines: list[str], results: str, write: bool = True) -> list[str]:
    """Print one run's section and append it to ``results`` (unless '' or not ``write``); return it."""
    print("\n".join(lines), flush=True)
    if results and write:
        append_results(Path(results), lines)
    return lines


def append_results(path: Path, lines: Sequence[str]) -> None:
    """Append one run's section to ``path`` (created with a title when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    text = "" if new else path.read_text(encoding="utf-8")
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write("# Benchmark results\n\nAppended by `benchmarks/*.py`; newest last. See benchmarks/README.md.\n\n")
        elif not text.endswith("\n\n"):  # a hand-written reading above may end without a blank line
            f.write("\n" if text.endswith("\n") else "\n\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
