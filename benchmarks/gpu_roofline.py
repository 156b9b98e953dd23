"""What bounds step 3's generation and training on a GPU: the actor alone, without DeepSpeed.

    python benchmarks/gpu_roofline.py                      # OPT-1.3B shapes, random weights, bf16, 16 x (256 + 256)
    python benchmarks/gpu_roofline.py --model tiny-opt --batch 2 --prompt_len 16 --answer_len 8   # smoke run

``benchmarks/step3.py`` reports generation at a few per cent of the memory-bandwidth roofline and
training far under peak FLOP/s. This script separates the causes on the bare model:

1. **decode, eager**: dschat's sampling loop (``dschat.rlhf.rollout.sample_loop.sample_loop``, greedy, every
   answer ``--answer_len`` tokens) -- wall ms per decode step, and from ``torch.profiler`` the GPU
   kernel time per step (the CUDA events only). Wall minus kernel time is the host side (Python,
   module calls, kernel launches) during which the GPU idles. The roofline a step is compared with:
   the weights and the KV cache of the mean step's context (prompt + half the answer) read once, at
   the data sheet's HBM bandwidth.
2. **decode, CUDA graphs**: Hugging Face ``generate`` with a static KV cache and
   ``torch.compile(mode="reduce-overhead")`` (``--skip_compile`` to leave out; compiling takes
   minutes): how far replaying captured graphs closes the gap.
3. **training**: forward + backward of the bare model on ``batch x (prompt + answer)`` tokens in
   bf16, no optimizer, no ZeRO: the TFLOP/s this model and batch reach at best.

Peaks as in ``benchmarks/step3.py`` (data sheet on a known GPU).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from step3 import OPT_SHAPES, datasheet_peaks, kv_bytes_per_position, opt_config  # noqa: E402

from dschat.errors import UserError, cli_main  # noqa: E402


def build(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``opt-1.3b`` / ``opt-350m``: upstream's shapes with random weights; else a dschat model name or folder."""
    from transformers import AutoModelForCausalLM

    if name not in OPT_SHAPES:
        from dschat.models.registry import resolve_model_path

        return AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=dtype).to(device).eval()
    config = opt_config(name, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_eager(model, prompts, mask, answer_len: int, device: torch.device) -> tuple[float, float | None]:
    """(wall ms per decode step, GPU kernel ms per decode step or None on a CPU)."""
    from dschat.rlhf.rollout.sample_loop import sample_loop
    from dschat.rlhf.rollout.sampling import DecodingSettings

    def run(n: int) -> None:
        sample_loop(model, prompts, mask, decoding=DecodingSettings("greedy"), max_new_tokens=n,
                    min_new_tokens=n, eos_token_id=2, pad_token_id=1)

    # Warm-up over every length: the first pass at each new key length is several times slower (per-
    # shape set-up on the GPU path; step3.py's warm-up rollout showed it too), later rollouts are not.
    run(answer_len)
    sync(device)
    start = time.perf_counter()
    run(answer_len)
    sync(device)
    wall = (time.perf_counter() - start) * 1e3
    prefill_start = time.perf_counter()
    run(1)
    sync(device)
    prefill = (time.perf_counter() - prefill_start) * 1e3
    per_step = (wall - prefill) / max(answer_len - 1, 1)
    if device.type != "cuda":
        return per_step, None
    from torch.profiler import ProfilerActivity, profile

    steps = min(answer_len, 32)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(steps)
        sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof_prefill:
        run(1)
        sync(device)

    return per_step, (kernel_ms(prof.key_averages()) - kernel_ms(prof_prefill.key_averages())) / max(steps - 1, 1)


def kernel_ms(averages) -> float:
    """GPU kernel milliseconds in a profile's ``key_averages()``: the self device time of the events on
    the CUDA device only (a CPU operator's entry carries its kernels' time as well; user annotations
    span them), as ``step3.summarise_profile`` counts them."""
    return sum(e.self_device_time_total for e in averages
               if str(e.device_type).endswith("CUDA") and not e.is_user_annotation) / 1e3


def decode_step_bytes(param_bytes: int, kv_bytes_per_position: int, rows: int, context: int) -> int:
    """Bytes one decode step reads at least: every weight once, and the KV cache of ``rows`` sequences
    over ``context`` positions (``step3.kv_bytes_per_position`` bytes each)."""
    return param_bytes + rows * context * kv_bytes_per_position


def decode_graphs(model, prompts, mask, answer_len: int, device: torch.device) -> float:
    """Wall ms per decode step with a static cache and CUDA graphs (torch.compile reduce-overhead)."""
    from transformers import CompileConfig

    from dschat.runtime.compile_cache import use_private_compile_cache

    use_private_compile_cache()  # as step 3 does: not torch's default, /tmp/torchinductor_<user>
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=1, eos_token_id=2,
                  cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))

    def run(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        model.generate(prompts, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync(device)
        return (time.perf_counter() - start) * 1e3

    compile_start = time.perf_counter()
    run(answer_len)  # compiles and captures
    run(answer_len)
    print(f"  (compile + capture + 2 runs: {time.perf_counter() - compile_start:.0f} s)", flush=True)
    full, one = run(answer_len), run(1)
    return (full - one) / max(answer_len - 1, 1)


def train_flops(n_params: int, layers: int, hidden: int, batch: int, seq: int) -> float:
    """Forward + backward FLOPs: 6 per parameter per token (2 forward, 4 backward) plus attention's
    score and value products, 12 x layers x hidden x seq per token (causal masking not discounted)."""
    return 6 * n_params * batch * seq + 12 * layers * hidden * seq * seq * batch


def train_tflops(model, batch: int, seq: int, device: torch.device) -> tuple[float, float]:
    """(seconds per forward+backward, TFLOP/s) on random tokens, no optimizer."""
    model.train()
    ids = torch.randint(3, min(50000, model.config.vocab_size), (batch, seq), device=device)
    cfg = model.config
    flops = train_flops(sum(p.numel() for p in model.parameters()), cfg.num_hidden_layers, cfg.hidden_size,
                        batch, seq)
    times = []
    for i in range(4):
        sync(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    model.eval()
    seconds = sorted(times)[len(times) // 2]
    return seconds, flops / seconds / 1e12


def share(value: float) -> str:
    """A fraction as a percentage, or 'n/a' where the device has no data-sheet peak (a CPU)."""
    return "n/a" if value != value else f"{value:.1%}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="opt-1.3b", help="opt-1.3b / opt-350m (random weights), or a model name or folder")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--answer_len", type=int, default=256)
    p.add_argument("--skip_compile", action="store_true")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(args.model, device, dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak_flops, peak_bw, _ = datasheet_peaks(name, dtype) or (float("nan"), float("nan"), "")
    # The mean decode step attends over the prompt and half the answer.
    step_bytes = decode_step_bytes(param_bytes, kv_bytes_per_position(model.config, dtype.itemsize), args.batch,
                                   args.prompt_len + args.answer_len // 2)
    roofline_ms = step_bytes / peak_bw * 1e3
    prompts = torch.randint(3, min(50000, model.config.vocab_size), (args.batch, args.prompt_len), device=device)
    mask = torch.ones_like(prompts)
    print(f"{args.model} ({param_bytes / 2**30:.2f} GiB of weights, {str(dtype)[6:]}) on {name}; "
          f"{args.batch} x ({args.prompt_len} + {args.answer_len}); roofline (weights + mean KV-cache read, "
          f"{step_bytes / 2**30:.2f} GiB) {roofline_ms:.2f} ms per decode step at {peak_bw / 1e12:.2f} TB/s",
          flush=True)

    wall, kernels = decode_eager(model, prompts, mask, args.answer_len, device)
    line = f"decode, eager (dschat loop): {wall:.2f} ms/step = {share(roofline_ms / wall)} of the roofline"
    if kernels is not None:
        line += (f"; GPU kernels {kernels:.2f} ms/step ({kernels / wall:.0%} busy; host-side gap "
                 f"{wall - kernels:.2f} ms)")
    print(line, flush=True)
    seconds, tflops = train_tflops(model, args.batch, args.prompt_len + args.answer_len, device)
    print(f"training, bare model fwd+bwd {str(dtype)[6:]} at {args.batch} x {args.prompt_len + args.answer_len}: "
          f"{seconds * 1e3:.0f} ms, {tflops:.1f} TFLOP/s = {share(tflops * 1e12 / peak_flops)} of peak", flush=True)
    if device.type == "cuda" and not args.skip_compile:
        try:
            graphs = decode_graphs(model, prompts, mask, args.answer_len, device)
        except UserError:  # an unsafe compile cache folder: one line, exit 2
            raise
        except Exception as err:  # noqa: BLE001 -- report and finish: the other numbers stand
            print(f"decode, static cache + CUDA graphs: failed ({type(err).__name__}: {str(err)[:300]})")
        else:
            print(f"decode, static cache + CUDA graphs (HF generate, torch.compile reduce-overhead): "
                  f"{graphs:.2f} ms/step = {share(roofline_ms / graphs)} of the roofline", flush=True)


if __name__ == "__main__":
    sys.exit(cli_main(main))
