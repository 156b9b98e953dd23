"""Model-state bytes counted from live step-3 DeepSpeed engines' tensors, per role and category.

Run in-process (:func:`count_cases`) or as a script under the ``deepspeed`` launcher
(``engine_bytes.py OUT_JSON DATA_DIR CASES_JSON``), where each rank writes ``OUT_JSON.<rank>``.
A case is ``(model, critic folder, extra step-3 flags)``. Each engine of the case counts:

* ``params``: the unique storages behind the module's parameters (``param.data`` and, under ZeRO-3,
  ``param.ds_tensor``), ZeRO-1/2's flat parameter groups included;
* ``master``: the fp32 partitions the optimizer steps, where they are storages of their own;
* ``moments``: Adam's ``exp_avg`` and ``exp_avg_sq``;
* ``grads``: after one backward, before the step: every gradient storage (``param.grad``, ZeRO-2's
  partition buffer, ZeRO-3's flat partition buffer, the fp32 partitions' ``.grad``), minus ZeRO's
  reduction buckets (``buckets``);
* ``offload_buffers``: ZeRO-1/2's buffers for optimizer offload (``temp_grad_buffer_for_gpu_offload``,
  ``temp_grad_buffer_for_cpu_offload``, ``param_buffer_of_bit16_for_cpu_offload_groups``).

A storage is counted once, in the first category that holds it; every counted storage is kept
alive until the engine is counted, so addresses are not reused across categories.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

ROLES = ("actor", "ref", "critic", "reward")


def _storages(tensors: Iterable[Any], seen: dict[int, Any]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen``, which keeps each counted storage alive
    (so that no later tensor of another category can reuse a freed one's address)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen[key] = storage
        total += storage.nbytes()
    return total


def _param_tensors(engine: Any) -> list[Any]:
    out = []
    for p in engine.module.parameters():
        out.append(p.data)
        out.append(getattr(p, "ds_tensor", None))
    opt = engine.optimizer
    out.extend(getattr(opt, "bit16_groups_flat", []) or [])
    out.extend(getattr(opt, "fp16_partitioned_groups_flat", []) or [])
    return out


def _master_tensors(engine: Any) -> list[Any]:
    opt = engine.optimizer
    return list(getattr(opt, "single_partition_of_fp32_groups", []) or []) + \
        list(getattr(opt, "fp32_partitioned_groups_flat", []) or [])


def _inner_optimizer(engine: Any) -> Any:
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _moment_tensors(engine: Any) -> list[Any]:
    inner = _inner_optimizer(engine)
    return [state[k] for state in inner.state.values() for k in ("exp_avg", "exp_avg_sq") if k in state]


def _bucket_tensors(engine: Any) -> list[Any]:
    opt = engine.optimizer
    out = list(getattr(opt, "ipg_buffer", None) or [])
    for bucket in (getattr(opt, "ipg_buckets", None) or {}).values():
        out.append(getattr(bucket, "buffer", None))
    return out


def _grad_tensors(engine: Any) -> list[Any]:
    opt = engine.optimizer
    out = [p.grad for p in engine.module.parameters()]
    out.append(getattr(opt, "grads_in_partition", None))
    out.append(getattr(opt, "grad_partitions_flat_buffer", None))
    averaged = getattr(opt, "averaged_gradients", None)
    for group in (averaged.values() if isinstance(averaged, dict) else []):
        out.extend(group or [])
    out.extend(t.grad for t in _master_tensors(engine))
    return out


def _offload_buffer_tensors(engine: Any) -> list[Any]:
    opt = engine.optimizer
    return [getattr(opt, "temp_grad_buffer_for_gpu_offload", None), getattr(opt, "temp_grad_buffer_for_cpu_offload", None),
            *(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None) or [])]


def count(engine: Any, trained: bool, step: Any) -> dict[str, int]:
    """The engine's bytes per category after one pass (``step(engine)``: forward, and backward for a
    trained one), the optimizer's moments after its first step."""
    seen: dict[int, Any] = {}
    step(engine)  # ZeRO-3 keeps its persistent parameters whole from the first pass on
    result = {"params": _storages(_param_tensors(engine), seen)}
    if not trained:
        return {**result, "master": 0, "moments": 0, "grads": 0, "buckets": 0, "offload_buffers": 0}
    result["master"] = _storages(_master_tensors(engine), seen)
    result["buckets"] = _storages(_bucket_tensors(engine), seen)
    result["grads"] = _storages(_grad_tensors(engine), seen)
    result["offload_buffers"] = _storages(_offload_buffer_tensors(engine), seen)
    engine.step()
    result["moments"] = _storages(_moment_tensors(engine), seen)
    return result


def _actor_step(engine: Any) -> None:
    ids = torch.arange(2, 10).view(1, 8)
    logits = engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    engine.backward(logits.float().pow(2).mean())


def _critic_step(engine: Any) -> None:
    ids = torch.arange(2, 10).view(1, 8)
    values = engine.module.forward_value(input_ids=ids, attention_mask=torch.ones_like(ids), return_value_only=True)
    engine.backward(values.float().pow(2).mean())


def _frozen(step: Any) -> Any:
    """``step``'s forward without gradients (a frozen engine's scoring pass)."""

    def run(engine: Any) -> None:
        with torch.no_grad():
            engine.backward = lambda loss: None
            step(engine)
            del engine.backward

    return run


def count_case(model: str, critic: str, data: str, extra: list[str]) -> dict[str, dict[str, int]]:
    """Build step 3's engines for ``model`` with ``extra`` flags and count each role's bytes."""
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.runtime.dist import init_distributed

    from helpers.step3 import base_argv, step3_main

    init_distributed()
    args = step3_main().parse_args(base_argv(model, Path(critic), Path(data), *extra))
    torch.manual_seed(0)
    rlhf = DeepSpeedRLHFEngine(model, critic, load_hf_tokenizer(model), args, 10)
    return {
        "actor": count(rlhf.actor, True, _actor_step),
        "ref": count(rlhf.ref, False, _frozen(_actor_step)),
        "critic": count(rlhf.critic, True, _critic_step),
        "reward": count(rlhf.reward, False, _frozen(_critic_step)),
        **({"ema": count(rlhf.actor_ema, False, _frozen(_actor_step))} if rlhf.actor_ema is not None else {}),
    }


def main(argv: list[str]) -> None:
    out, data, cases = [a for a in argv if not a.startswith("--local_rank")]
    from dschat.runtime.dist import get_rank

    results = [count_case(model, critic, data, extra) for model, critic, extra in json.loads(cases)]
    Path(f"{out}.{get_rank()}").write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
