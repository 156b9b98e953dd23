"""The memory planner against measured peaks: each phase of a PPO step, predicted and measured.

    bash .ci/gpu plan-accuracy                                   # a GPU: the six configurations below
    python benchmarks/plan_accuracy.py --configs opt-z3-he,opt-z0-lora --json
    DS_ACCELERATOR=cpu python benchmarks/plan_accuracy.py --configs opt-z0 --actor tiny-opt --critic tiny-opt \\
        --batch 2 --prompt_len 16 --answer_len 8                # a CPU: the pipeline, and the model states

For each configuration (:data:`CONFIGS`: the actor and critic, ZeRO stage, actor LoRA, Hybrid
Engine) the step-3 engines are built as ``benchmarks/step3.py`` builds them (random weights from the
``opt-*`` / ``llama-1b`` shapes, :func:`step3.build_step3`) and the planner plans the same step-3
flags through its Python API (:func:`dschat.plan.cli.plan`, on one GPU of the device's memory, as
step 3's preflight does). Then ``--warmup`` + ``--steps`` PPO steps run dschat's default path
(``ours`` in step3.py), every prompt exactly ``--prompt_len`` real tokens and every answer exactly
``--answer_len`` tokens, so that each rollout has the planner's shape (prompt + answer).

**Phases, measured** (CUDA): ``torch.cuda.reset_peak_memory_stats()`` as a phase starts and
``torch.cuda.max_memory_allocated()`` as it ends, the largest over the measured steps, as the
planner defines the phases (:mod:`dschat.plan.phases`): *generation* (the rollout), *scoring* (the
rest of ``generate_experience``: the reference, reward, critic and actor passes), *actor training* and
*critic training* (each model's forward and backward, inside the trainer's ``training_gather``), the
*optimizer step* (the actor's and the critic's ``engine.step()``). The benchmark wraps those calls on
its own trainer (:class:`PhaseMeter`); nothing in dschat changes. Also on CUDA: the memory still
allocated after the last step against the planned resident bytes (every model's states and a kept
Hybrid Engine copy).

**Model states, counted** (any device): after the steps, each engine's parameters, fp32 master,
Adam moments, gradients (after one more forward and backward) and resident reduction buckets,
counted from its tensors by ``tests/plan/engine_bytes.py`` (the rules of the planner's exactness
test), against the planner's per-role model states. On the CPU accelerator in fp32 the planner's
states are those of ``plan_roles(..., cpu_accelerator=True)`` (ZeRO-3 keeps a separate fp32 master
there) and must be equal; on a GPU they are the plan's own, and the counting rules are the ones
checked on the CPU only.

A CPU has no allocator peak per phase: there the phase rows give the prediction and say that the
measurement needs CUDA. Results: a Markdown section per run (``--results``), or with ``--json`` the
whole result as JSON on stdout. Several configurations run one per child process (a fresh CUDA
context each, so one configuration's leftovers cannot raise the next one's peaks); the models are
written once, by the parent.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from deepspeed.accelerator import get_accelerator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests" / "plan"))  # engine_bytes: the exactness test's counting rules

import engine_bytes  # noqa: E402
from step3 import append_results, build_step3, configure, model_folders, publish, versions  # noqa: E402
from step3 import parse_args as step3_parse_args  # noqa: E402

from dschat.plan.cli import build_parser as plan_parser, format_gb, plan  # noqa: E402
from dschat.plan.roles import plan_roles  # noqa: E402


@dataclass(frozen=True)
class Config:
    """One measured configuration: step3.py's models and flags."""

    actor: str
    critic: str
    zero_stage: int
    lora: bool
    hybrid_engine: bool


# OPT-1.3B (OPT-350m critic, upstream's single-GPU pair) and the Llama-3.2-1B shape (its own critic):
# each of ZeRO 0/3, LoRA/full and the Hybrid Engine on/off appears with both families, three times in all.
CONFIGS: dict[str, Config] = {
    "opt-z3-he": Config("opt-1.3b", "opt-350m", 3, False, True),
    "opt-z0-lora": Config("opt-1.3b", "opt-350m", 0, True, False),
    "opt-z3-lora": Config("opt-1.3b", "opt-350m", 3, True, False),
    "opt-z0-he": Config("opt-1.3b", "opt-350m", 0, False, True),
    "llama-z3-lora-he": Config("llama-1b", "llama-1b", 3, True, True),
    "llama-z0": Config("llama-1b", "llama-1b", 0, False, False),
    # Without the Hybrid Engine and LoRA: the plainest step (quick on a CPU with tiny models).
    "opt-z0": Config("opt-1.3b", "opt-350m", 0, False, False),
}
DEFAULT_CONFIGS = ("opt-z3-he", "opt-z0-lora", "opt-z3-lora", "opt-z0-he", "llama-z3-lora-he", "llama-z0")
TOLERANCE = 0.10  # the goal: each phase's prediction within 10 % of the measured peak
STATE_KEYS = ("params", "master", "moments", "grads", "offload_buffers", "buckets")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, run in this order: {', '.join(CONFIGS)} (default: the first six)")
    p.add_argument("--actor", default=None, help="replace every configuration's actor (e.g. tiny-opt on a CPU)")
    p.add_argument("--critic", default=None, help="replace every configuration's critic/reward body")
    p.add_argument("--lora_dim", type=int, default=128, help="actor LoRA rank of the LoRA configurations")
    p.add_argument("--prompt_len", type=int, default=256, help="--max_prompt_seq_len; every prompt fills it")
    p.add_argument("--answer_len", type=int, default=256, help="--max_answer_seq_len; every answer fills it")
    p.add_argument("--batch", type=int, default=16, help="per-device generation = training batch")
    p.add_argument("--dtype", default=None, choices=("fp16", "bf16", "fp32"), help="default: fp32 on CPU, bf16 on GPU")
    p.add_argument("--steps", type=int, default=1, help="measured PPO steps (each phase: the largest peak)")
    p.add_argument("--warmup", type=int, default=1, help="PPO steps before (optimizer states, compiles)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the tables")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results.md"), help="append the tables here ('': don't)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--models_dir", default="", help=argparse.SUPPRESS)  # a child: the parent's model folders
    p.add_argument("--child_out", default="", help=argparse.SUPPRESS)  # a child: write its result here
    args = p.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not names or any(c not in CONFIGS for c in names):
        p.error(f"--configs must list some of {', '.join(CONFIGS)}, got {args.configs!r}")
    if min(args.prompt_len, args.answer_len, args.batch, args.steps, args.lora_dim) < 1 or args.warmup < 0:
        p.error("--prompt_len, --answer_len, --batch, --steps and --lora_dim must be >= 1, --warmup >= 0")
    args.configs = names
    return args


def models_of(config: Config, args: argparse.Namespace) -> tuple[str, str]:
    """The (actor, critic) models of ``config`` under ``--actor`` / ``--critic``."""
    return args.actor or config.actor, args.critic or args.actor or config.critic


def step3_args(config: Config, args: argparse.Namespace, dtype: str) -> argparse.Namespace:
    """``benchmarks/step3.py``'s arguments for ``config`` (its one ``ours`` mode)."""
    actor, critic = models_of(config, args)
    argv = ["--actor", actor, "--critic", critic, "--prompt_len", str(args.prompt_len),
            "--answer_len", str(args.answer_len), "--batch", str(args.batch), "--zero_stage", str(config.zero_stage),
            "--dtype", dtype, "--seed", str(args.seed), "--modes", "ours", "--results", ""]
    argv += ["--lora_dim", str(args.lora_dim)] if config.lora else []
    return step3_parse_args(argv + (["--hybrid_engine"] if config.hybrid_engine else []))


# ------------------------------------------------------------------------------------------------
# The prediction
# ------------------------------------------------------------------------------------------------
def predict(argv: Sequence[str], gpu_bytes: int, cpu: bool) -> dict:
    """The planner on step 3's flags ``argv`` on one GPU of ``gpu_bytes``: :func:`dschat.plan.cli.plan`'s
    result, plus ``"states"`` (role -> the six :data:`STATE_KEYS`, the device's resident buckets) from
    ``plan_roles`` (with ``cpu_accelerator`` on the CPU, as the exactness test plans) and
    ``"hybrid_engine"`` (whether the plan decodes with dschat's Hybrid Engine)."""
    args = plan_parser(3).parse_args([*argv, "--gpus_per_node", "1", "--num_nodes", "1"])
    result = plan(args, gpu_bytes=gpu_bytes)
    roles = plan_roles(args, 1, dtype=args.dtype, cpu_accelerator=cpu, hybrid_engine=args.enable_hybrid_engine)
    result["states"] = {role: {**{k: p.state.counted()[k] for k in STATE_KEYS[:-1]}, "buckets": p.state.device["buckets"]}
                        for role, p in roles.items()}
    generation = result["phases"][0]["consumers"]
    result["hybrid_engine"] = any(k.startswith("HE ") for k in generation)
    return result


# ------------------------------------------------------------------------------------------------
# The measurement
# ------------------------------------------------------------------------------------------------
class PhaseMeter:
    """Per-phase peaks of an allocator (``torch.cuda`` on a CUDA device, else none: nothing is measured):
    :meth:`start` resets its peak, :meth:`stop` keeps the largest ``max_memory_allocated`` seen for the
    phase while ``measuring``. ``log`` lists what happened while measuring: ``"start"`` and the phases
    stopped, in order."""

    def __init__(self, device: torch.device, allocator: Any = None) -> None:
        self.allocator = allocator if allocator is not None else (torch.cuda if device.type == "cuda" else None)
        self.cuda = self.allocator is not None
        self.device = device
        self.measuring = False
        self.peaks: dict[str, int] = {}
        self.log: list[str] = []

    def start(self) -> None:
        if self.cuda:
            self.allocator.synchronize(self.device)
            self.allocator.reset_peak_memory_stats(self.device)
            if self.measuring:
                self.log.append("start")

    def stop(self, phase: str) -> None:
        if self.cuda and self.measuring:
            self.allocator.synchronize(self.device)
            self.peaks[phase] = max(self.peaks.get(phase, 0), int(self.allocator.max_memory_allocated(self.device)))
            self.log.append(phase)

    def allocated(self) -> int | None:
        """The bytes allocated now (None without an allocator)."""
        if not self.cuda:
            return None
        self.allocator.synchronize(self.device)
        return int(self.allocator.memory_allocated(self.device))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.start()
        yield
        self.stop(name)


class _MeasuredGather:
    """The trainer's ``training_gather`` (called as ``gather(name, engine)``) with each call measured as
    ``"<name> training"``; every other attribute is the wrapped object's."""

    def __init__(self, inner: Any, meter: PhaseMeter) -> None:
        self._inner, self._meter = inner, meter

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    @contextmanager
    def __call__(self, name: str, engine: Any) -> Iterator[None]:
        with self._meter.phase(f"{name} training"), self._inner(name, engine):
            yield


@contextmanager
def measured_phases(trainer: Any, meter: PhaseMeter) -> Iterator[None]:
    """Wrap, on ``trainer`` only, the calls that bound the planner's phases: the generator's
    ``rollout`` (generation; scoring starts as it returns), the passes' ``training_gather`` (actor and
    critic training) and each trained engine's ``step`` (the optimizer step). Everything is put back."""
    generator, passes = trainer.generator, trainer.passes
    rollout = type(generator).rollout.__get__(generator)
    engines = [e for e in (trainer.actor_model, getattr(trainer, "critic_model", None)) if e is not None]

    def measured_rollout(prompts: torch.Tensor, mask: torch.Tensor) -> Any:
        with meter.phase("generation"):
            out = rollout(prompts, mask)
        meter.start()  # scoring: from here to generate_experience's return
        return out

    def measured_step(step: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with meter.phase("optimizer step"):
                return step(*args, **kwargs)
        return run

    gather = passes.training_gather
    generator.rollout = measured_rollout
    passes.training_gather = _MeasuredGather(gather, meter)
    for engine in engines:
        engine.step = measured_step(engine.step)  # an instance attribute over DeepSpeed's method
    try:
        yield
    finally:
        for engine in engines:
            del engine.step
        passes.training_gather = gather
        del generator.rollout


def full_prompts(tokenizer: Any, batch: int, prompt_len: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of ``batch`` prompts of exactly ``prompt_len`` real tokens each (the held-out
    builtin prompts' tokens end to end, cut into rows): no padding, so the rollout has the planner's
    shape."""
    from dschat.eval.heldout import heldout_prompts

    stream = [t for text in heldout_prompts() for t in tokenizer(text)["input_ids"]]
    need = batch * prompt_len * count
    stream = (stream * (need // max(1, len(stream)) + 1))[:need]
    ids = torch.tensor(stream).view(count, batch, prompt_len)
    return [(ids[i], torch.ones_like(ids[i])) for i in range(count)]


def ppo_steps(trainer: Any, batches: list, warmup: int, meter: PhaseMeter, device: torch.device) -> None:
    """``warmup`` + measured PPO steps of ``trainer`` on ``batches`` (step3.py's step: experience, then
    each micro-batch's actor and critic update), the measured ones under ``meter``."""
    with measured_phases(trainer, meter):
        for i, (prompts, mask) in enumerate(batches):
            meter.measuring = i >= warmup
            exp = trainer.generate_experience(prompts.to(device), mask.to(device), i)
            meter.stop("scoring")
            trainer.prepare_rollout([exp])
            trainer.train()
            for _, micro, _ in trainer.schedule([exp], None):
                trainer.train_rlhf(micro)
            print(f"[plan_accuracy] step {i}{' (warm-up)' if i < warmup else ''} done", flush=True)


def _state_pass(critic: bool, train: bool) -> Callable[[Any], None]:
    """One forward (and for a trained engine a backward) of ``engine`` on 8 tokens of its device: what
    ``tests/plan/engine_bytes.py`` runs before counting (gradients exist between backward and step)."""
    def run(engine: Any) -> None:
        ids = torch.arange(2, 10, device=engine.device).view(1, 8)
        with torch.set_grad_enabled(train):
            if critic:
                out = engine.module.forward_value(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                  return_value_only=True)
            else:
                out = engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            if train:
                engine.backward(out.float().pow(2).mean())
    return run


def counted_states(rlhf: Any) -> dict[str, dict[str, int]]:
    """Each engine's model-state bytes counted from its tensors (``engine_bytes.count``; a trained
    engine steps once more)."""
    engines = {"actor": (rlhf.actor, False, True), "ref": (rlhf.ref, False, False),
               "critic": (rlhf.critic, True, True), "reward": (rlhf.reward, True, False)}
    return {role: engine_bytes.count(engine, train, _state_pass(critic, train))
            for role, (engine, critic, train) in engines.items() if engine is not None}


# ------------------------------------------------------------------------------------------------
# One configuration
# ------------------------------------------------------------------------------------------------
def pair_folders(actor: str, critic: str, folder: Path) -> tuple[str, str]:
    """The model folders of ``actor`` and ``critic`` (step3.py's :func:`model_folders`) in ``folder``:
    written once, then read from ``folder/models.json`` (the parent writes them, its children read them)."""
    index = folder / "models.json"
    if index.exists():
        return tuple(json.loads(index.read_text(encoding="utf-8")))
    paths = model_folders(actor, critic, folder)
    index.write_text(json.dumps(paths), encoding="utf-8")
    return paths


def run_config(name: str, args: argparse.Namespace, dtype: str, folder: Path, allocator: Any = None) -> dict:
    """Predict and measure configuration ``name`` in this process; ``folder`` holds (or gets) its models;
    ``allocator``: :class:`PhaseMeter`'s (default: ``torch.cuda`` on a CUDA device)."""
    from dschat.plan.preflight import device_memory
    from dschat.runtime.dist import init_distributed

    config = CONFIGS[name]
    info = init_distributed()
    if info.world_size != 1:
        raise SystemExit("error: plan_accuracy.py measures one process's GPU: run it with python, not a launcher")
    device = info.device
    accelerator, memory = device_memory()
    sargs = step3_args(config, args, dtype)
    actor, critic = pair_folders(sargs.actor, sargs.critic, folder)
    torch.manual_seed(args.seed)
    built = build_step3(sargs, actor, critic, folder / f"data-{name}", dtype)
    prediction = predict(built.argv, memory, cpu=accelerator == "cpu")
    configure(built.trainer, "ours", built.he_available, "auto", built.dschat_he, 1)
    meter = PhaseMeter(device, allocator)
    batches = full_prompts(built.tokenizer, args.batch, args.prompt_len, args.warmup + args.steps)
    ppo_steps(built.trainer, batches, args.warmup, meter, device)
    resident = meter.allocated()
    counted = counted_states(built.engine)
    phases = []
    for phase in prediction["phases"]:
        measured = meter.peaks.get(phase["name"])
        error = None if measured is None else (phase["peak_bytes"] - measured) / measured
        phases.append({"name": phase["name"], "predicted_bytes": phase["peak_bytes"], "measured_bytes": measured,
                       "error": error, "within": None if error is None else abs(error) <= TOLERANCE,
                       "consumers": phase["consumers"]})
    planned_resident = next(p["predicted_bytes"] for p in phases if p["name"] == "optimizer step")
    states = {role: {"predicted": prediction["states"][role], "counted": {k: counted[role][k] for k in STATE_KEYS},
                     "equal": prediction["states"][role] == {k: counted[role][k] for k in STATE_KEYS}}
              for role in prediction["states"]}
    return {
        "config": name, "actor": sargs.actor, "critic": sargs.critic, "zero_stage": config.zero_stage,
        "lora_dim": sargs.lora_dim, "hybrid_engine": config.hybrid_engine, "dtype": dtype,
        "accelerator": accelerator, "device_bytes": memory, "step3_argv": built.argv,
        "hybrid_engine_planned": prediction["hybrid_engine"],
        "generation_loop": built.trainer.generator.last_loop or "",
        "phases": phases, "phase_log": meter.log,
        "resident": {"predicted_bytes": planned_resident, "measured_bytes": resident},
        "model_states": states, "plan": {k: v for k, v in prediction.items() if k not in ("phases", "states")},
    }


def run_children(args: argparse.Namespace, argv: Sequence[str], dtype: str, root: Path) -> list[dict]:
    """Each configuration in a child process of its own (this script, ``--configs NAME``), the models
    written here first, once per (actor, critic) pair; a child that fails is one entry with its error."""
    pairs = {models_of(CONFIGS[n], args) for n in args.configs}
    for actor, critic in sorted(pairs):
        pair_folders(actor, critic, root / f"{actor}+{critic}")
    out = []
    for name in args.configs:
        actor, critic = models_of(CONFIGS[name], args)
        child_out = root / f"{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--configs", name, "--dtype", dtype,
               "--results", "", "--models_dir", str(root / f"{actor}+{critic}"), "--child_out", str(child_out)]
        proc = subprocess.run(cmd, cwd=REPO)
        if proc.returncode == 0 and child_out.exists():
            out.append(json.loads(child_out.read_text(encoding="utf-8")))
        else:
            out.append({"config": name, "error": f"its process exited with {proc.returncode}"})
    return out


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def phase_table(results: list[dict]) -> list[str]:
    """One row per configuration and phase: predicted, measured, error (predicted against measured),
    within :data:`TOLERANCE`; the resident bytes after the last step as a last row per configuration.
    In GB (10^9 bytes), or MB where every prediction is under a GB (tiny models)."""
    largest = max((p["predicted_bytes"] for r in results for p in r.get("phases", [])), default=0)
    unit, scale = ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6)

    def _gb(n: int) -> str:
        return f"{n / scale:.3f}"

    lines = [f"| configuration | phase | predicted {unit} | measured {unit} | error % | within 10 % |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | (failed: {r['error']}) | | | | |")
            continue
        rows = [(p["name"], p["predicted_bytes"], p["measured_bytes"], p["error"], p["within"]) for p in r["phases"]]
        res = r["resident"]
        measured = res["measured_bytes"]
        error = None if measured is None else (res["predicted_bytes"] - measured) / measured
        rows.append(("resident after the step", res["predicted_bytes"], measured, error,
                     None if error is None else abs(error) <= TOLERANCE))
        for phase, predicted, measured, error, within in rows:
            if measured is None:
                lines.append(f"| {r['config']} | {phase} | {_gb(predicted)} | needs CUDA | | |")
            else:
                lines.append(f"| {r['config']} | {phase} | {_gb(predicted)} | {_gb(measured)} | {100 * error:+.1f} | "
                             f"{'yes' if within else 'no'} |")
    return lines


def state_table(results: list[dict]) -> list[str]:
    """One row per configuration and engine: the planned and the counted model-state bytes."""
    head = " / ".join(STATE_KEYS)
    lines = [f"| configuration | engine | planned ({head}) | counted | equal |", "|---|---|---|---|---|"]
    for r in results:
        for role, s in r.get("model_states", {}).items():
            planned = " / ".join(str(s["predicted"][k]) for k in STATE_KEYS)
            counted = " / ".join(str(s["counted"][k]) for k in STATE_KEYS)
            lines.append(f"| {r['config']} | {role} | {planned} | {counted} | {'yes' if s['equal'] else 'NO'} |")
    return lines


def report(results: list[dict], args: argparse.Namespace, argv: Sequence[str], dtype: str) -> list[str]:
    """The results section: what ran, the phase table, the model-state table."""
    ok = [r for r in results if "error" not in r]
    cuda = any(r["accelerator"] != "cpu" for r in ok)
    device = (torch.cuda.get_device_name() if torch.cuda.is_available() and cuda else
              f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    lines = [
        f"### memory plan against measured peaks, {datetime.date.today().isoformat()}: {', '.join(args.configs)}, "
        f"{args.batch} x ({args.prompt_len} + {args.answer_len}), {dtype}",
        "",
        f"- device: {device}; {versions()}",
        f"- command: `python benchmarks/plan_accuracy.py {' '.join(shlex.quote(a) for a in argv)}`",
        f"- {args.steps} measured PPO step(s) after {args.warmup} warm-up, dschat's default path; every prompt "
        f"{args.prompt_len} real tokens, every answer {args.answer_len}; prediction: `dschat.plan.cli.plan` on one GPU "
        "of this device's memory; error = (predicted - measured) / measured",
    ]
    for r in ok:
        planned = "dschat's Hybrid Engine" if r["hybrid_engine_planned"] else "the training module"
        lines.append(f"- {r['config']}: {r['actor']} actor, {r['critic']} critic, ZeRO-{r['zero_stage']}"
                     + (f", LoRA {r['lora_dim']}" if r["lora_dim"] else "")
                     + (", --enable_hybrid_engine" if r["hybrid_engine"] else "")
                     + f"; planned generation by {planned}, the run decoded with {r['generation_loop'] or 'n/a'}; "
                     f"plan peak {format_gb(r['plan']['peak_bytes_per_gpu'])} in {r['plan']['peak_phase']}")
    if not cuda:
        lines.append("- no CUDA device: the phases' peaks (activations, logits, caches, gathers) need CUDA's "
                     "allocator and are not measured here; the model states are counted from the engines' tensors")
    lines += ["", *phase_table(results), "", "Model states per engine, bytes (planned by `dschat.plan`, counted from the "
              "live engines' tensors as tests/plan/engine_bytes.py counts them"
              + ("; the counting rules are checked on the CPU in fp32 only" if cuda else "") + "):", "",
              *state_table(results), ""]
    return lines


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    dtype = args.dtype or ("fp32" if get_accelerator().device_name() == "cpu" else "bf16")
    if args.child_out:  # a child: one configuration, the parent's models
        result = run_config(args.configs[0], args, dtype, Path(args.models_dir))
        Path(args.child_out).write_text(json.dumps(result), encoding="utf-8")
        # In the log as each configuration ends (a run stopped later still shows the ones done).
        print("\n".join(["", *phase_table([result]), "", *state_table([result]), ""]), flush=True)
        return {"configs": [result]}
    with tempfile.TemporaryDirectory(prefix="dschat-plan-accuracy-") as tmp:
        root = Path(tmp)
        if len(args.configs) == 1:
            results = [run_config(args.configs[0], args, dtype, root)]
        else:
            results = run_children(args, argv, dtype, root)
    out = {"configs": results, "tolerance": TOLERANCE}
    lines = report(results, args, argv, dtype)
    if args.json:  # JSON on stdout; the tables still go to --results
        print(json.dumps(out, indent=1), flush=True)
        if args.results:
            append_results(Path(args.results), lines)
    else:
        publish(lines, args.results)
    return out


if __name__ == "__main__":
    sys.exit(1 if any("error" in r for r in main()["configs"]) else 0)  # a configuration that failed
