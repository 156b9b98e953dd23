#!/usr/bin/env python
"""How far one PPO iteration of step 3 wanders through the project's files, measured at run time.

Runs step 3's ``main`` in-process on the CPU (ZeRO-0, fp32, PPO with a critic, tiny-opt with a
random critic, ``--data_path dschat/builtin``, one generation batch, ``--test_stop_step 1``: one PPO
iteration) and, while step 3's PPO loop function runs, records every call from a project file into
a project file (``dschat/`` and ``training/``; the step script counts as the caller of the loop)
with ``sys.setprofile``. Prints:

* ``files``: the project files entered. The step script calls the loop and is not counted for that;
  it counts only where the loop calls back into it (a closure of the script);
* ``back-calls``: calls into a file that is already on the stack below the caller's file (a call
  back up, e.g. a loop calling a closure of the script that called the loop), as distinct
  ``caller file -> callee file:function`` edges, and how many such calls happened (``sys.setprofile``
  reports each resumption of a generator as a call, so the counts of edges into generators are high;
  the sets of files and edges are not affected);
* ``two-way pairs``: file pairs that call each other in both directions.

``--loop module:function`` names the loop function to trace (several may be given; the first that
imports is used): ``dschat.rlhf.ppo_loop:run_ppo`` by default, then ``dschat.training.loop:train_ppo_epochs``.

Usage: ``DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/trace_spine.py [--verbose]``
"""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT_DIRS = (str(REPO / "dschat") + os.sep, str(REPO / "training") + os.sep)
DEFAULT_LOOPS = ("dschat.rlhf.ppo_loop:run_ppo", "dschat.training.loop:train_ppo_epochs")


def project_file(filename: str) -> str | None:
    """``filename`` relative to the repository when it is one of the project's files, else None."""
    if filename.startswith(PROJECT_DIRS):
        return os.path.relpath(filename, REPO)
    return None


class SpineTrace:
    """Call edges between project files, recorded while it is the profiler."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.edges: Counter[tuple[str, str]] = Counter()
        self.back_calls: Counter[tuple[str, str]] = Counter()

    def __call__(self, frame, event, arg):  # noqa: ANN001 -- sys.setprofile's signature
        if event != "call":
            return
        callee = project_file(frame.f_code.co_filename)
        if callee is None:
            return
        self.files.add(callee)
        # The project files on the stack, innermost first, consecutive repeats collapsed.
        stack: list[str] = []
        f = frame.f_back
        while f is not None:
            name = project_file(f.f_code.co_filename)
            if name is not None and (not stack or stack[-1] != name):
                stack.append(name)
            f = f.f_back
        if not stack or stack[0] == callee:
            return
        caller = stack[0]
        self.edges[(caller, callee)] += 1
        if callee in stack[1:]:
            self.back_calls[(caller, f"{callee}:{frame.f_code.co_name}")] += 1

    def two_way_pairs(self) -> list[tuple[str, str]]:
        return sorted({tuple(sorted((a, b))) for (a, b) in self.edges if (b, a) in self.edges})

    def report(self, verbose: bool) -> str:
        lines = [f"files: {len(self.files)}",
                 f"back-calls: {len(self.back_calls)} edges, {sum(self.back_calls.values())} calls",
                 f"two-way pairs: {len(self.two_way_pairs())}"]
        if verbose:
            lines += ["", "files entered:"] + [f"  {f}" for f in sorted(self.files)]
            lines += ["", "back-calls:"] + [f"  {a} -> {b} ({n}x)" for (a, b), n in sorted(self.back_calls.items())]
            lines += ["", "two-way pairs:"] + [f"  {a} <-> {b}" for a, b in self.two_way_pairs()]
            lines += ["", "edges:"] + [f"  {a} -> {b} ({n}x)" for (a, b), n in sorted(self.edges.items())]
        return "\n".join(lines)


def patch_loop(specs: list[str], trace: SpineTrace) -> str:
    """Wrap the first loop function of ``specs`` that imports so it runs under ``trace``."""
    for spec in specs:
        module_name, function_name = spec.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, function_name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def traced(*args, __original=original, **kwargs):  # noqa: ANN002, ANN003
            sys.setprofile(trace)
            try:
                return __original(*args, **kwargs)
            finally:
                sys.setprofile(None)

        setattr(module, function_name, traced)
        return spec
    raise SystemExit(f"none of the loop functions {specs} imports")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", action="append", default=None, help="module:function of the PPO loop")
    parser.add_argument("--verbose", action="store_true", help="list the files, back-calls, pairs and edges")
    cli = parser.parse_args()
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from dschat.models.build import create_critic_model
    from dschat.models.registry import resolve_model_path
    from dschat.models.save import save_hf_model
    from dschat.models.tokenizer import load_hf_tokenizer

    torch.set_num_threads(1)
    trace = SpineTrace()
    loop = patch_loop(cli.loop or list(DEFAULT_LOOPS), trace)
    spec = importlib.util.spec_from_file_location("step3_main", REPO / "training" / "step3_rlhf_finetuning" / "main.py")
    step3 = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = step3  # its dataclasses look their module up
    spec.loader.exec_module(step3)
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_path("tiny-opt")
        torch.manual_seed(0)
        tokenizer = load_hf_tokenizer(model)
        critic = Path(tmp) / "critic"
        save_hf_model(create_critic_model(model, tokenizer, None), tokenizer, critic)
        step3.main([
            "--actor_model_name_or_path", "tiny-opt", "--critic_model_name_or_path", str(critic),
            "--data_path", "dschat/builtin", "--data_output_path", str(Path(tmp) / "data"),
            "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
            "--max_prompt_seq_len", "16", "--max_answer_seq_len", "16", "--dtype", "fp32",
            "--enable_test_mode", "--test_stop_step", "1", "--num_warmup_steps", "0",
            "--actor_zero_stage", "0", "--critic_zero_stage", "0",
        ])
    print(f"traced: {loop}")
    print(trace.report(cli.verbose))


if __name__ == "__main__":
    main()
