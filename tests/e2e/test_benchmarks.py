"""benchmarks/: the step-3 benchmark runs both modes on a tiny model, and its accounting is right."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import REPO


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"dschat_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_step3_accounting_by_hand():
    bench = _load("step3")
    # 2 measured steps, prompt widths 10 and 6, answers 4 tokens, batch 2.
    r = bench.ModeResult("ours", gen_s=2.0, exp_s=1.0, train_s=4.0, steps=2, prompt_width=[10, 6])
    config = SimpleNamespace(num_hidden_layers=2, hidden_size=8, vocab_size=32)
    m = bench.account(r, batch=2, answer_len=4, actor_param_bytes=1000, actor_config=config, critic_config=config,
                      actor_factor=3.0, critic_factor=3.0)
    assert m.gen_tokens_per_s == pytest.approx(2 * 4 * 2 / 2.0)  # 16 generated tokens in 2 s
    assert m.gen_ms_per_token == pytest.approx(1000 * 2.0 / 8)  # 8 decode steps
    assert m.gen_bandwidth == pytest.approx(1000 * 8 / 2.0)  # the weights are read once per decode step
    assert m.seq_len == pytest.approx((14 + 10) / 2)
    assert m.exp_tokens_per_s == pytest.approx(2 * 12 * 2 / 1.0)
    assert m.train_tokens_per_s == pytest.approx(2 * 12 * 2 / 4.0)
    assert m.samples_per_s == pytest.approx(4 / 7.0)

    def flops(seq):  # upstream's formula written out: 24 f B s l h^2 (1 + s / 6h + V / 16 l h)
        return 24 * 3.0 * 2 * seq * 2 * 64 * (1 + seq / 48 + 32 / 256)
    assert m.train_flops == pytest.approx(2 * (flops(14) + flops(10)) / 4.0)
    # Scoring: forward passes only (a third of a training pass each): by default the reference and
    # two critic-shaped passes (reward model, critic); the baseline adds the actor's.
    assert m.exp_flops == pytest.approx(3 * (flops(14) + flops(10)) / 3 / 1.0)
    r.scoring_passes = (2, 1, 0)
    wide = SimpleNamespace(num_hidden_layers=2, hidden_size=16, vocab_size=32)
    m = bench.account(r, batch=2, answer_len=4, actor_param_bytes=1000, actor_config=config, critic_config=None,
                      actor_factor=3.0, critic_factor=3.0, reward_config=wide)

    def flops_wide(seq):
        return 24 * 1.0 * 2 * seq * 2 * 256 * (1 + seq / 96 + 32 / 512)
    assert m.exp_flops == pytest.approx(sum(2 * flops(s) / 3 + flops_wide(s) for s in (14, 10)) / 1.0)


def test_step3_accounting_counts_the_packed_slots_each_pass_computed():
    bench = _load("step3")
    config = SimpleNamespace(num_hidden_layers=2, hidden_size=8, vocab_size=32)

    def flops(factor, rows, cols):
        return 24 * factor * rows * cols * 2 * 64 * (1 + cols / 48 + 32 / 256)
    # One step of 4 sequences, padded 4 x 14: the reference and the actor pack into 2 x 20, the reward
    # model and the critic run padded (they do not pack).
    assert bench.pass_shapes({"actor": True, "reference": True, "reward": False}, (4, 14), (2, 20)) == {
        "actor": (2, 20), "reference": (2, 20), "reward": (4, 14)}
    assert bench.pass_shapes({"actor": True, "critic": False}, (4, 14), None, ("actor",)) == {"actor": (4, 14)}
    r = bench.ModeResult("ours", gen_s=1.0, exp_s=1.0, train_s=2.0, steps=1, prompt_width=[10],
                         scoring_passes=(1, 1, 1),
                         exp_shapes=[{"reference": (2, 20), "reward": (4, 14), "critic": (4, 14)}],
                         train_shapes=[{"actor": [(2, 20)], "critic": [(4, 14)]}])
    m = bench.account(r, batch=4, answer_len=4, actor_param_bytes=1000, actor_config=config, critic_config=config,
                      actor_factor=3.0, critic_factor=3.0)
    assert m.seq_len == 14 and m.slots == pytest.approx(40 / 4)
    assert m.exp_tokens_per_s == pytest.approx(40 / 1.0) and m.train_tokens_per_s == pytest.approx(40 / 2.0)
    assert m.train_flops == pytest.approx((flops(3.0, 2, 20) + flops(3.0, 4, 14)) / 2.0)
    assert m.exp_flops == pytest.approx(flops(1.0, 2, 20) + 2 * flops(1.0, 4, 14))
    # The reward model packs and the critic does not: each scoring pass at its own rows.
    r.exp_shapes = [{"reference": (2, 20), "reward": (2, 20), "critic": (4, 14)}]
    m = bench.account(r, batch=4, answer_len=4, actor_param_bytes=1000, actor_config=config, critic_config=config,
                      actor_factor=3.0, critic_factor=3.0)
    assert m.exp_flops == pytest.approx(2 * flops(1.0, 2, 20) + flops(1.0, 4, 14))


def test_step3_generation_bandwidth_counts_the_kv_cache_reads():
    bench = _load("step3")
    roofline = _load("gpu_roofline")
    # Grouped-query attention: 2 layers x 2 KV heads x head_dim 4, keys and values, 2 bytes each.
    gqa = SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=4,
                          hidden_size=64)
    assert bench.kv_bytes_per_position(gqa, 2) == 2 * 2 * 2 * 4 * 2
    mha = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, hidden_size=32)  # OPT: no KV heads given
    assert bench.kv_bytes_per_position(mha, 4) == 2 * 3 * 4 * 8 * 4
    # Prompt 10, 4 answer tokens: the prefill reads no cache, then 11, 12 and 13 positions, per row.
    assert bench.decode_kv_positions(2, 10, 4) == 2 * (11 + 12 + 13)
    r = bench.ModeResult("ours", gen_s=2.0, exp_s=1.0, train_s=4.0, steps=2, prompt_width=[10, 6])
    config = SimpleNamespace(num_hidden_layers=2, hidden_size=8, vocab_size=32)
    m = bench.account(r, batch=2, answer_len=4, actor_param_bytes=1000, actor_config=config, critic_config=None,
                      actor_factor=3.0, critic_factor=3.0, kv_bytes_per_position=16)
    kv = 16 * 2 * ((11 + 12 + 13) + (7 + 8 + 9))
    assert m.gen_bandwidth == pytest.approx((1000 * 8 + kv) / 2.0)
    assert roofline.decode_step_bytes(1000, 16, rows=2, context=12) == 1000 + 2 * 12 * 16


def test_step3_datasheet_peaks_pick_the_variant_and_the_dtype():
    import torch

    bench = _load("step3")

    def peaks(name, dtype=torch.bfloat16):
        flops, bandwidth, _ = bench.datasheet_peaks(name, dtype)
        return flops / 1e12, bandwidth / 1e12
    assert peaks("NVIDIA H100 80GB HBM3") == (989, 3.35)
    assert peaks("NVIDIA H100 PCIe") == (756, 2.0)
    assert peaks("NVIDIA H100 NVL") == (835, 3.9)
    assert peaks("NVIDIA H200") == (989, 4.8) and peaks("NVIDIA H200 NVL") == (835, 4.8)
    assert peaks("NVIDIA A100-SXM4-80GB") == (312, 2.039)
    assert peaks("NVIDIA A100-SXM4-40GB") == (312, 1.555)
    assert peaks("NVIDIA A100-PCIE-40GB") == (312, 1.555)
    assert peaks("NVIDIA A100 80GB PCIe") == (312, 1.935)
    assert peaks("NVIDIA H100 80GB HBM3", torch.float32) == (67, 3.35)
    assert peaks("NVIDIA A100-SXM4-80GB", torch.float32) == (19.5, 2.039)
    assert "fp32" in bench.datasheet_peaks("NVIDIA H200", torch.float32)[2]
    assert bench.datasheet_peaks("NVIDIA GeForce RTX 4090") is None


def test_gpu_roofline_kernel_time_counts_only_the_cuda_events():
    roofline = _load("gpu_roofline")

    def event(device, us, annotation=False):
        return SimpleNamespace(device_type=f"DeviceType.{device}", self_device_time_total=us,
                               is_user_annotation=annotation)
    # aten::mm on the host carries its kernel's 300 us as well; an annotation spans both kernels.
    averages = [event("CUDA", 300.0), event("CUDA", 200.0), event("CPU", 300.0), event("CUDA", 500.0, True)]
    assert roofline.kernel_ms(averages) == pytest.approx(0.5)


def test_step3_ratio_column_compares_baseline_with_ours():
    bench = _load("step3")
    base = bench.ModeResult("baseline", gen_s=4.0, exp_s=2.0, train_s=6.0, steps=2, prompt_width=[8, 8])
    ours = bench.ModeResult("ours", gen_s=2.0, exp_s=1.0, train_s=3.0, steps=2, prompt_width=[4, 4])
    config = SimpleNamespace(num_hidden_layers=1, hidden_size=8, vocab_size=16)
    metrics = [bench.account(r, batch=1, answer_len=2, actor_param_bytes=10, actor_config=config,
                             critic_config=config, actor_factor=3.0, critic_factor=3.0) for r in (base, ours)]
    lines = bench.table([base, ours], metrics, bench.Peaks(1e12, 1e9, "test"))
    e2e = next(line for line in lines if line.startswith("| end to end s/step"))
    assert e2e == "| end to end s/step | 6.00 | 3.00 | 2.00x |"
    samples = next(line for line in lines if line.startswith("| end to end samples/s"))
    assert samples.endswith("| 2.00x |")


def test_results_sections_are_separated_by_a_blank_line(tmp_path):
    bench = _load("step3")
    path = tmp_path / "results.md"
    bench.append_results(path, ["### one", "", "body"])
    path.write_text(path.read_text() + "A reading written by hand, no blank line after it.\n")
    bench.append_results(path, ["### two"])
    text = path.read_text()
    assert text.startswith("# Benchmark results") and "after it.\n\n### two\n" in text


def test_step3_ablation_modes_configure_one_path_off_and_ratio_only_for_two_modes():
    bench = _load("step3")
    assert bench.parse_args(["--modes", "ours,ours-no-fuse,ours-no-gather,ours-no-graphs,ours-graphs"]).modes == [
        "ours", "ours-no-fuse", "ours-no-gather", "ours-no-graphs", "ours-graphs"]
    assert bench.parse_args([]).ours_generation_loop == "auto"
    gen = SimpleNamespace()
    trainer = SimpleNamespace(generator=gen)
    bench.configure(trainer, "ours-no-fuse", False)
    assert (gen.fuse_lora, gen.zero3_gather, gen.keep_logprobs, trainer.reuse_rollout_logprobs) == (False, "auto", True, True)
    bench.configure(trainer, "ours-no-gather", False)
    assert (gen.fuse_lora, gen.zero3_gather, gen.generation_loop) == (True, "off", "auto")
    bench.configure(trainer, "ours-no-graphs", False)
    assert (gen.fuse_lora, gen.zero3_gather, gen.generation_loop) == (True, "auto", "dschat")
    bench.configure(trainer, "ours", False)
    assert (gen.fuse_lora, gen.zero3_gather, gen.generation_loop) == (True, "auto", "auto")
    bench.configure(trainer, "ours-graphs", False)
    assert (gen.fuse_lora, gen.zero3_gather, gen.generation_loop) == (True, "auto", "graphs")
    bench.configure(trainer, "ours", False, ours_loop="graphs")
    assert gen.generation_loop == "graphs"
    bench.configure(trainer, "baseline", False, ours_loop="graphs")
    assert (gen.fuse_lora, gen.zero3_gather, gen.generation_loop) == (False, "off", "hf")
    assert not gen.use_dschat_engine
    bench.configure(trainer, "ours-he", False)  # dschat's Hybrid Engine (--enable_hybrid_engine)
    assert (gen.use_dschat_engine, gen.fuse_lora, gen.zero3_gather, gen.keep_logprobs) == (True, True, "auto", True)
    bench.configure(trainer, "ours", False)
    assert not gen.use_dschat_engine
    bench.configure(trainer, "ours", False, dschat_he=True)  # --hybrid_engine
    assert gen.use_dschat_engine
    # The ZeRO-3 gathers of the scoring and the training passes: ours' default, off one by one or both.
    gathers = {}
    for mode in ("ours", "ours-no-score-gather", "ours-no-train-gather", "ours-hooked", "baseline"):
        bench.configure(trainer, mode, False)
        gathers[mode] = (trainer.scoring_gather.setting, trainer.training_gather.setting)
    assert gathers == {"ours": ("auto", "auto"), "ours-no-score-gather": ("off", "auto"),
                       "ours-no-train-gather": ("auto", "off"), "ours-hooked": ("off", "off"),
                       "baseline": ("off", "off")}
    # The thin twins keep OPT-1.3B's / OPT-350m's layers and layer-norm placement, at hidden 64 and 1024 ids.
    for name in ("opt-1.3b", "opt-350m"):
        full, thin = bench.opt_config(name, 1, 2, 2), bench.opt_config(f"{name}-thin", 1, 2, 2)
        assert (full.vocab_size, thin.vocab_size, thin.hidden_size) == (50272, 1024, 64)
        assert (thin.num_hidden_layers, thin.do_layer_norm_before) == (full.num_hidden_layers, full.do_layer_norm_before)
    llama = bench.llama_config("llama-1b", 0, 1, 2)  # Llama-3.2-1B's shape: 1.24 B parameters
    E, L, V = llama.hidden_size, llama.num_hidden_layers, llama.vocab_size
    per_layer = E * (E + 2 * llama.num_key_value_heads * llama.head_dim) + E * E + 3 * E * llama.intermediate_size
    assert round((V * E + L * per_layer) / 1e9, 2) == 1.24 and llama.rope_parameters["rope_type"] == "llama3"

    def times(mode, gen_s):
        return bench.ModeResult(mode, gen_s=gen_s, exp_s=1.0, train_s=3.0, steps=1, prompt_width=[4])
    config = SimpleNamespace(num_hidden_layers=1, hidden_size=8, vocab_size=16)

    def lines_for(results):
        metrics = [bench.account(r, batch=1, answer_len=2, actor_param_bytes=10, actor_config=config,
                                 critic_config=config, actor_factor=3.0, critic_factor=3.0) for r in results]
        return bench.table(results, metrics, bench.Peaks(1e12, 1e9, "test"))

    def row(lines, label):
        return next(line for line in lines if line.startswith(f"| {label} |"))
    # Two modes: the second's speed-up over the first, in the order given (times: first / second).
    lines = lines_for([times("ours", 4.0), times("ours-graphs", 1.0)])
    assert lines[0] == "| | ours | ours-graphs | ours-graphs / ours |"
    assert row(lines, "generation s/step") == "| generation s/step | 4.00 | 1.00 | 4.00x |"
    assert row(lines, "end to end s/step") == "| end to end s/step | 8.00 | 5.00 | 1.60x |"
    assert row(lines, "generation tokens/s") == "| generation tokens/s | 0.5 | 2.0 | 4.00x |"
    lines = lines_for([times("ours", 1.0), times("baseline", 4.0)])
    assert lines[0] == "| | ours | baseline | baseline / ours |"
    assert row(lines, "generation s/step") == "| generation s/step | 1.00 | 4.00 | 0.25x |"
    # Three modes: no ratio column.
    lines = lines_for([times("ours", 2.0), times("ours-no-fuse", 2.0), times("ours-no-gather", 3.0)])
    assert lines[0] == "| | ours | ours-no-fuse | ours-no-gather |"
    assert row(lines, "end to end s/step") == "| end to end s/step | 6.00 | 6.00 | 7.00 |"


def test_step3_benchmark_runs_both_modes_on_a_tiny_model(tmp_path, capsys):
    bench = _load("step3")
    results = tmp_path / "results.md"
    lines = bench.main(["--actor", "tiny-llama", "--batch", "2", "--prompt_len", "32", "--answer_len", "6",
                        "--steps", "1", "--warmup", "0", "--results", str(results)])
    out = capsys.readouterr().out
    # Every step generated exactly --answer_len tokens in both modes; ours fed fewer prompt columns.
    assert "[baseline] step 0: " in out and "[ours] step 0: " in out
    assert "prompt width 32" in out.split("[ours]")[0]
    ours_width = int(out.split("[ours] step 0: ")[1].split("prompt width ")[1].split()[0])
    assert ours_width < 32
    text = results.read_text()
    assert text.startswith("# Benchmark results") and "tiny-llama actor" in text and "| end to end s/step |" in text
    assert "command: `python benchmarks/step3.py --actor tiny-llama" in text
    assert any(line.startswith("| columns per sequence | 38.0 | ") for line in lines)


def test_step3_profile_summary_by_hand():
    bench = _load("step3")

    def avg(key, device, count, self_cpu=0.0, cpu=0.0, self_dev=0.0, annotation=False):
        return SimpleNamespace(key=key, device_type=f"DeviceType.{device}", count=count, self_cpu_time_total=self_cpu,
                               cpu_time_total=cpu, self_device_time_total=self_dev, is_user_annotation=annotation)
    averages = [
        avg("aten::mm", "CPU", 4, self_cpu=300.0, cpu=900.0, self_dev=2000.0),  # device time of its kernels: not summed
        avg("aten::add", "CPU", 10, self_cpu=500.0, cpu=500.0),
        avg("gemm_kernel", "CUDA", 4, self_dev=2000.0),
        avg("elementwise", "CUDA", 10, self_dev=1000.0),
        avg("actor backward", "CPU", 1, self_cpu=50.0, cpu=4000.0, annotation=True),
        avg("actor backward", "CUDA", 1, self_dev=9000.0, annotation=True),  # a GPU range: neither kernel nor span
    ]
    ph = bench.summarise_profile("training", 0.01, averages, top=1)
    assert (ph.kernel_s, ph.kernels, ph.host_op_s) == (pytest.approx(0.003), 14, pytest.approx(0.0008))
    assert ph.top_device == [("gemm_kernel", pytest.approx(0.002), 4)]
    assert ph.top_host == [("aten::add", pytest.approx(0.0005), 10)]
    assert ph.spans == [("actor backward", pytest.approx(0.004), 1)]
    r = bench.ModeResult("ours", profile=[ph])
    (line,) = bench.profile_lines([r])
    assert line == ("- ours, training: wall 0.010 s; kernels 0.003 s (30 % of wall), 14 launches; host time in "
                    "operators 0.001 s; host time in ranges: `actor backward` 0.004 s x1; longest kernels: "
                    "`gemm_kernel` 0.002 s x4; longest operators on the host (self time): `aten::add` 0.001 s x10")
    # On a CPU: no kernels, so no kernel figures.
    cpu = bench.summarise_profile("scoring", 0.5, averages[:2])
    assert (cpu.kernel_s, cpu.kernels, cpu.top_device, cpu.spans) == (0.0, 0, [], [])
    assert "kernels" not in bench.profile_lines([bench.ModeResult("baseline", profile=[cpu])])[0]


def test_step3_annotated_names_the_training_parts_and_puts_everything_back():
    import torch
    from torch.profiler import profile

    bench = _load("step3")

    class Engine:
        def backward(self, loss):
            return loss * 2

        def step(self):
            return "stepped"

    class Trainer:
        def _token_log_probs(self, x):
            return x + 1

    trainer, timed = Trainer(), Engine()
    trainer.actor_model, trainer.critic_model = Engine(), timed
    timed.step = lambda: "timed"  # an instance attribute already there (the benchmark's optimizer timer)
    with profile() as prof:
        with bench.annotated(trainer):
            assert trainer._token_log_probs(torch.ones(1)).item() == 2.0
            assert trainer.actor_model.backward(torch.ones(1)).item() == 2.0
            assert (trainer.actor_model.step(), timed.step()) == ("stepped", "timed")
    names = {e.key for e in prof.key_averages() if e.is_user_annotation}
    assert {"actor forward", "actor backward", "actor optimizer step", "critic optimizer step"} <= names
    assert "_token_log_probs" not in vars(trainer) and vars(trainer.actor_model) == {}
    assert timed.step() == "timed" and "backward" not in vars(timed)


def test_step3_phase_profiler_drops_a_phase_begun_again():
    import torch

    bench = _load("step3")
    profiler = bench.PhaseProfiler(torch.device("cpu"), lambda: None)
    profiler.start()
    torch.ones(3).exp()  # a first rollout's end: dropped
    profiler.start()
    torch.ones(4).neg()
    profiler.stop("scoring")
    (phase,) = profiler.phases
    names = {name for name, _, _ in phase.top_host}
    assert phase.phase == "scoring" and "aten::neg" in names and "aten::exp" not in names


def test_step3_benchmark_profiles_one_more_step_and_writes_traces(tmp_path, capsys):
    import gzip
    import json

    bench = _load("step3")
    lines = bench.main(["--actor", "tiny-llama", "--batch", "2", "--prompt_len", "16", "--answer_len", "4",
                        "--steps", "1", "--warmup", "0", "--profile", "--trace_dir", str(tmp_path / "traces"),
                        "--results", ""])
    out = capsys.readouterr().out
    # The profiled steps come after every mode's measured ones and are not in their figures.
    assert out.index("[ours] step 0: ") < out.index("[baseline] step 1 (profiled): ") < out.index("[ours] step 1 (profiled): ")
    assert "| generation s/step |" in "\n".join(lines)
    profiled = [line for line in lines if line.startswith("- baseline, ") or line.startswith("- ours, ")]
    assert [line.split(":")[0] for line in profiled] == ["- baseline, scoring", "- baseline, training",
                                                         "- ours, scoring", "- ours, training"]
    # The host's longest operators are named (which comes first depends on the machine's load: on a
    # busy one a gloo all-reduce can outlast every ATen operator of these tiny models).
    tops = [line.split("longest operators on the host (self time): ")[1] for line in profiled]
    assert all(top.startswith("`") and "`aten::" in top for top in tops)
    assert all("`actor backward`" in line and "`critic optimizer step`" in line for line in profiled[1::2])
    for mode in ("baseline", "ours"):
        trace = json.loads(gzip.decompress((tmp_path / "traces" / f"{mode}-training.json.gz").read_bytes()))
        assert any(e.get("name") == "actor backward" for e in trace["traceEvents"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--trace_dir", str(tmp_path)])
    # A mode listed twice traces each of its runs.
    assert [bench.trace_path("d", ["ours", "baseline", "ours"], k).name for k in range(3)] == [
        "ours-1-training.json.gz", "baseline-training.json.gz", "ours-3-training.json.gz"]


def test_step3_answer_spread_cuts_by_hand_and_packing_is_ours_only():
    import torch

    from dschat.rlhf.rollout.sampling import Rollout

    bench = _load("step3")
    assert bench.answer_lengths(4, 10, 0.0, step=0, seed=1) is None
    lengths = bench.answer_lengths(64, 10, 0.5, step=3, seed=1)
    assert lengths.min() >= 5 and lengths.max() <= 10 and len(set(lengths.tolist())) > 3
    assert torch.equal(lengths, bench.answer_lengths(64, 10, 0.5, step=3, seed=1))  # the same in every mode
    rollout = Rollout(torch.arange(14).reshape(2, 7), torch.zeros(2, 4))
    cut = bench.cut_answers(rollout, 3, torch.tensor([2, 4]), eos=99, pad=-1)
    assert cut.sequences.tolist() == [[0, 1, 2, 3, 99, -1, -1], [7, 8, 9, 10, 11, 12, 99]]
    assert cut.logprobs is rollout.logprobs
    trainer = SimpleNamespace(generator=SimpleNamespace(), packing={"actor": True, "reward": False})
    bench.configure(trainer, "ours", False)
    assert trainer.packing == {"actor": True, "reward": False}
    bench.configure(trainer, "ours-no-pack", False)
    assert trainer.packing == {"actor": False, "reward": False}
    bench.configure(trainer, "baseline", False)
    assert trainer.packing == {"actor": False, "reward": False}
    bench.configure(trainer, "ours-he", False)
    assert trainer.packing == {"actor": True, "reward": False}


def test_step3_benchmark_with_answer_spread_runs_ours_packed_and_unpacked(tmp_path, capsys):
    bench = _load("step3")
    lines = bench.main(["--actor", "tiny-llama", "--batch", "3", "--prompt_len", "16", "--answer_len", "8",
                        "--answer_spread", "0.75", "--steps", "1", "--warmup", "0", "--modes", "ours-no-pack,ours",
                        "--results", ""])
    assert "answers cut to 25%-100 % of 8 tokens" in lines[0]
    assert "- sequence packing in ours: actor, reference, critic, reward" in lines
    # Ours' scoring passes ran on packed rows, ours-no-pack's on the padded batch, and ours computed fewer slots.
    out = capsys.readouterr().out
    assert "scoring rows packed " in out.split("[ours] step 0: ")[1].splitlines()[0]
    assert "scoring rows padded 3 x 24, " in out.split("[ours-no-pack] step 0: ")[1].splitlines()[0]
    slots = next(line for line in lines if line.startswith("| slots computed per sequence")).split(" | ")
    assert float(slots[2]) < float(slots[1])
    assert any(line.startswith("| generation ms per answer token, whole rollout | ") for line in lines)
    assert lines[lines.index("| | ours-no-pack | ours | ours / ours-no-pack |") + 1].count("|---") == 4


def test_packing_benchmark_times_every_layout_on_a_tiny_model(tmp_path):
    bench = _load("packing")
    results = tmp_path / "results.md"
    lines = bench.main(["--model", "tiny-llama", "--batch", "4", "--answer_len", "12", "--batches", "2",
                        "--results", str(results)])
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"layout", *bench.LAYOUTS}
    assert rows["padded"].endswith("| 1.00x |")
    slots = {name: float(rows[name].split(" | ")[1]) for name in bench.LAYOUTS}
    assert slots["fewest-slots"] <= slots["chosen"] <= slots["padded"]
    assert "command: `python benchmarks/packing.py --model tiny-llama" in results.read_text()


def test_step3_graphs_mode_on_a_cpu_says_it_decoded_with_dschats_loop(tmp_path, capsys):
    # CUDA graphs need a CUDA device: on a CPU ours-graphs falls back, and the results say so (ours, the
    # default on a CPU, decodes with dschat's loop too).
    bench = _load("step3")
    lines = bench.main(["--actor", "tiny-llama", "--batch", "2", "--prompt_len", "16", "--answer_len", "4",
                        "--steps", "1", "--warmup", "0", "--modes", "ours,ours-graphs", "--results", ""])
    out = capsys.readouterr().out
    assert "--generation_loop graphs: not used (CUDA graphs need a CUDA device" in out
    assert any(line.endswith("generation loop per mode (its last rollout): ours dschat, "
                             "ours-graphs dschat") for line in lines)
    assert lines[lines.index("| | ours | ours-graphs | ours-graphs / ours |") + 1].count("|---") == 4


def test_step12_accounting_by_hand():
    bench = _load("step12")
    config = SimpleNamespace(num_hidden_layers=1, hidden_size=8, vocab_size=16)
    stats = bench.summarise([1.0, 3.0], [(4, 10), (2, 6)], config, 3.0, samples_per_row=0.5)
    assert stats["median_s"] == 2.0
    assert stats["samples_per_s"] == pytest.approx((4 + 2) * 0.5 / 4.0)  # step 2: two rows per pair
    assert stats["columns"] == 8.0

    def flops(rows, cols):  # 24 f B s l h^2 (1 + s / 6h + V / 16 l h)
        return 24 * 3.0 * rows * cols * 1 * 64 * (1 + cols / 48 + 16 / 128)
    assert stats["tflops"] == pytest.approx((flops(4, 10) + flops(2, 6)) / 4.0 / 1e12)
    # Step 2's reward model: a value head, so no LM-head term (V / 16 l h).
    reward = bench.summarise([1.0, 3.0], [(4, 10), (2, 6)], config, 3.0, samples_per_row=0.5, lm_head=False)

    def flops_no_head(rows, cols):
        return 24 * 3.0 * rows * cols * 1 * 64 * (1 + cols / 48)
    assert reward["tflops"] == pytest.approx((flops_no_head(4, 10) + flops_no_head(2, 6)) / 4.0 / 1e12)


def test_step12_benchmark_runs_on_a_tiny_model(tmp_path):
    bench = _load("step12")
    results = tmp_path / "results.md"
    lines = bench.main(["--model", "tiny-llama", "--configs", "zero0,zero0+lora", "--lora_dim", "4",
                        "--batch", "2", "--max_seq_len", "32", "--steps", "1", "--warmup", "0",
                        "--results", str(results)])
    rows = [line for line in lines if line.startswith("| step")]
    assert [r.split(" | ")[1] for r in rows if not r.startswith("| step |")] == [
        "ZeRO-0", "ZeRO-0 + LoRA 4", "ZeRO-0", "ZeRO-0 + LoRA 4"]
    assert rows[1].endswith("| 1.00x |")  # the first configuration is the baseline
    assert "steps 1-2" in results.read_text()


def test_step12_rejects_a_bad_configuration(capsys):
    bench = _load("step12")
    with pytest.raises(SystemExit) as err:
        bench.parse_args(["--configs", "zero5"])
    assert err.value.code == 2 and "bad configuration 'zero5'" in capsys.readouterr().err


def test_gpu_roofline_flops_by_hand_and_smoke_run(capsys):
    roofline = _load("gpu_roofline")
    # 10 parameters, 2 layers of width 4, 3 sequences of 5 tokens: 6*10*15 + 12*2*4*5*5*3
    assert roofline.train_flops(10, 2, 4, 3, 5) == 900 + 7200
    assert roofline.share(float("nan")) == "n/a" and roofline.share(0.25) == "25.0%"
    roofline.main(["--model", "tiny-opt", "--batch", "2", "--prompt_len", "8", "--answer_len", "4"])
    out = capsys.readouterr().out
    assert "decode, eager (dschat loop): " in out and "training, bare model fwd+bwd float32 at 2 x 12: " in out


def test_step3_benchmark_grpo_runs_without_a_critic(tmp_path, capsys):
    bench = _load("step3")
    lines = bench.main(["--actor", "tiny-llama", "--batch", "4", "--prompt_len", "16", "--answer_len", "4",
                        "--steps", "1", "--warmup", "0", "--modes", "ours", "--algorithm", "grpo",
                        "--num_generations", "2", "--results", ""])
    assert "algorithm grpo (K = 2, no critic)" in lines[0]
    assert any(line.startswith("| training TFLOP/s |") for line in lines)
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch", "4", "--num_generations", "3"])


def test_decode_benchmark_compares_dschats_loop_with_its_hybrid_engine(tmp_path):
    bench = _load("decode")
    results = tmp_path / "results.md"
    lines = bench.main(["--model", "tiny-llama", "--new_tokens", "6", "--warmup", "0", "--repeats", "1",
                        "--results", str(results)])
    assert any(line.endswith("greedy tokens of the two modes equal") for line in lines)
    assert [line.split(" |")[0] for line in lines if line.startswith(("| loop", "| engine"))] == ["| loop", "| engine"]
    assert "command: `python benchmarks/decode.py --model tiny-llama" in results.read_text()


@pytest.mark.parametrize("path", ["dschat", "dschat-he"])
def test_episodes_kv_benchmark_plays_both_modes_alike_and_reuse_feeds_fewer_tokens(path, tmp_path):
    bench = _load("episodes_kv")
    results = tmp_path / "results.md"
    from dschat.models.decoder.forward import DecodeModel

    passes = DecodeModel.prefill, DecodeModel.step
    lines = bench.main(["--model", "tiny-llama", "--turns", "2", "--turn_tokens", "3", "--batch", "2",
                        "--warmup", "0", "--repeats", "1", "--path", path, "--results", str(results)])
    assert any(line.endswith("episodes of the two modes equal") for line in lines)
    fed = {line.split(" | ")[0]: int(line.split(" | ")[2]) for line in lines if line.startswith(("| reuse", "| prefill"))}
    assert fed["| reuse"] < fed["| prefill"]
    assert "command: `python benchmarks/episodes_kv.py --model tiny-llama" in results.read_text()
    assert (DecodeModel.prefill, DecodeModel.step) == passes  # the benchmark's wrapping is undone


def test_step3_tp_mode_decodes_over_the_group_and_needs_its_flags():
    """``ours-tp``: dschat's Hybrid Engine over --inference_tp_size ranks; the other modes at TP 1. (A
    2-rank CPU run of it is recorded in benchmarks/results.md.)"""
    bench = _load("step3")
    gen = SimpleNamespace()
    trainer = SimpleNamespace(generator=gen)
    bench.configure(trainer, "ours-tp", False, tp_size=2)
    assert gen.use_dschat_engine and gen.inference_tp_size == 2
    bench.configure(trainer, "ours-he", False, tp_size=2)
    assert gen.use_dschat_engine and gen.inference_tp_size == 1
    flags = ["--zero_stage", "3", "--hybrid_engine"]
    assert bench.parse_args(["--modes", "ours-he,ours-tp", "--inference_tp_size", "2", *flags]).inference_tp_size == 2
    for bad in (["--modes", "ours-tp", *flags], ["--modes", "ours-tp", "--inference_tp_size", "2", "--hybrid_engine"],
                ["--modes", "ours-he", "--inference_tp_size", "2", *flags]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_gpu_session_runs_the_benchmark_with_flags_it_takes(tmp_path):
    """`bash .ci/gpu session` is written here and run only on a lent GPU: its commands, printed by a
    dry run, must at least be ones the benchmark accepts (every item, in its order)."""
    import os
    import shlex
    import subprocess

    bench = _load("step3")
    env = {**os.environ, "DRY_RUN": "1", "LOG_DIR": str(tmp_path), "SESSION_S": "100000"}
    out = subprocess.run(["bash", str(REPO / ".ci" / "gpu"), "session"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    commands = [line.split("): ", 1)[1] for line in out.splitlines() if "benchmarks/step3.py" in line and "): " in line]
    assert len(commands) >= 3, out
    for command in commands:
        words = shlex.split(command)
        argv = words[words.index("_") + 1:] if "_" in words else words[words.index("benchmarks/step3.py") + 1:]
        args = bench.parse_args(argv)
        assert (args.prompt_len, args.answer_len, args.batch, args.dtype) == (256, 256, 16, "bf16")
        assert args.results == str(tmp_path / "results-gpu.md")
        if "_" in words:  # the tree before inference TP: its benchmark has no --profile
            assert "--profile" not in argv
        elif args.profile:  # each item traces into its own folder (what comes back: 2 folders down)
            assert Path(args.trace_dir).parent == tmp_path
    traced = [shlex.split(c)[shlex.split(c).index("--trace_dir") + 1] for c in commands if "--trace_dir" in c]
    assert len(traced) == len(set(traced)) == 2
    # With time to spare nothing is skipped, but the TP-1 item where the pre-TP tree is absent (a clone).
    assert [line for line in out.splitlines() if "skipped" in line and "no .pre-tp/" not in line] == []


def test_gpu_session_only_runs_the_items_named(tmp_path):
    """`SESSION_ONLY=TEXT bash .ci/gpu session` (a second device call, for an item the first call's
    budget left out) runs the versions and the items whose name holds TEXT, and says so of the rest."""
    import os
    import subprocess

    env = {**os.environ, "DRY_RUN": "1", "LOG_DIR": str(tmp_path), "SESSION_S": "100000", "SESSION_ONLY": "packed rows"}
    out = subprocess.run(["bash", str(REPO / ".ci" / "gpu"), "session"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    started = [line.split(" (", 1)[0] for line in out.splitlines() if line.startswith("== ") and " s left): " in line]
    assert started == ["== versions", "== opt-1.3b ZeRO-0: ours on packed rows vs padded rows"], out
    assert "--modes ours,ours-no-pack" in out
    assert sum("not selected (SESSION_ONLY=packed rows)" in line for line in out.splitlines()) >= 5


def test_gpu_tier_installs_the_carried_wheels_inside_the_checkout_and_again_when_they_change(tmp_path):
    """`.ci/gpu` puts the wheels carried in .whl/ first on PYTHONPATH: they go into the checkout's own
    .gpu-site/ (a /tmp folder could have been made and filled by another account), once per set of wheels."""
    import os
    import shutil
    import subprocess
    import zipfile

    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "gpu", repo / ".ci" / "gpu")
    (repo / ".whl").mkdir()

    def wheel(version: str) -> None:
        for old in (repo / ".whl").glob("*.whl"):
            old.unlink()
        info = f"dschat_probe-{version}.dist-info"
        with zipfile.ZipFile(repo / ".whl" / f"dschat_probe-{version}-py3-none-any.whl", "w") as z:
            z.writestr("dschat_probe/__init__.py", f"VERSION = {version!r}\n")
            z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: dschat-probe\nVersion: {version}\n")
            z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            z.writestr(f"{info}/RECORD", "")

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "LOG_DIR": str(tmp_path / "logs")}
    site = repo / ".gpu-site"

    def setup() -> str:
        run = subprocess.run(["bash", str(repo / ".ci" / "gpu"), "setup"], cwd=repo, env=env, capture_output=True,
                             text=True, timeout=300)
        return run.stdout + run.stderr

    wheel("1.0")
    assert f"carried wheels: installed in {site}\n" in setup()
    assert (site / "dschat_probe" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    marker = (site / ".dschat-installed").read_text()
    (site / "dschat_probe" / "kept.txt").write_text("")  # the same wheels: nothing reinstalled
    setup()
    assert (site / "dschat_probe" / "kept.txt").exists()
    wheel("2.0")
    setup()
    assert (site / "dschat_probe" / "__init__.py").read_text() == "VERSION = '2.0'\n"
    assert not (site / "dschat_probe-1.0.dist-info").exists() and (site / ".dschat-installed").read_text() != marker


def test_startup_benchmark_times_both_modes_and_sees_deepspeed_import_mlflow(tmp_path):
    """``--module deepspeed``: the guarded process (dschat first) imports DeepSpeed without MLflow;
    the unguarded one imports DeepSpeed first, and with it MLflow (the test extra installs it)."""
    pytest.importorskip("mlflow")
    bench = _load("startup")
    results = tmp_path / "results.md"
    lines = bench.main(["--module", "deepspeed", "--warmup", "0", "--repeats", "1", "--results", str(results)])
    rows = {line.split(" | ")[0]: line.split(" | ")[2] for line in lines if line.startswith(("| guarded", "| unguarded"))}
    assert rows == {"| guarded": "no |", "| unguarded": "yes |"}
    assert any(line.startswith("unguarded / guarded: ") for line in lines)
    assert "command: `python benchmarks/startup.py --module deepspeed" in results.read_text()


def test_spine_trace_counts_files_back_calls_and_two_way_pairs_by_hand():
    bench = _load("trace_spine")

    def frame(file: str, name: str, back=None):
        return SimpleNamespace(f_code=SimpleNamespace(co_filename=str(REPO / file), co_name=name), f_back=back)

    trace = bench.SpineTrace()
    loop = frame("dschat/rlhf/loop.py", "run")
    a = frame("dschat/rlhf/a.py", "make", loop)
    b = frame("dschat/rlhf/b.py", "score", a)
    outside = frame("/usr/lib/python3/x.py", "helper", b)  # not a project file: passed over on the stack
    calls = [a, b, frame("dschat/rlhf/a.py", "again", outside), frame("dschat/rlhf/loop.py", "closure", b),
             frame("dschat/rlhf/b.py", "score2", a)]
    for f in calls:
        trace(f, "call", None)
    trace(frame("dschat/rlhf/c.py", "ignored", a), "return", None)  # only calls count
    assert trace.files == {"dschat/rlhf/a.py", "dschat/rlhf/b.py", "dschat/rlhf/loop.py"}
    assert trace.edges == {("dschat/rlhf/loop.py", "dschat/rlhf/a.py"): 1, ("dschat/rlhf/a.py", "dschat/rlhf/b.py"): 2,
                           ("dschat/rlhf/b.py", "dschat/rlhf/a.py"): 1, ("dschat/rlhf/b.py", "dschat/rlhf/loop.py"): 1}
    assert trace.back_calls == {("dschat/rlhf/b.py", "dschat/rlhf/a.py:again"): 1,
                                ("dschat/rlhf/b.py", "dschat/rlhf/loop.py:closure"): 1}
    assert trace.two_way_pairs() == [("dschat/rlhf/a.py", "dschat/rlhf/b.py")]  # b -> loop is one way
    assert trace.report(verbose=False).splitlines() == ["files: 3", "back-calls: 2 edges, 2 calls", "two-way pairs: 1"]


def test_spine_trace_runs_one_ppo_iteration_and_the_loop_calls_nothing_back():
    """The step-3 loop (run_ppo) calls out and never back into a file below it on the stack."""
    import os
    import subprocess

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "trace_spine.py")], capture_output=True,
                          text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "traced: dschat.rlhf.ppo_loop:run_ppo" in lines
    assert "back-calls: 0 edges, 0 calls" in lines and "two-way pairs: 0" in lines
    assert any(line.startswith("files: ") and int(line.split()[1]) > 10 for line in lines)


def test_rlvr_options_summary_of_a_folder_no_run_made_says_not_run(tmp_path):
    """--summary_only runs nothing; on a folder that does not exist yet it wrote table.json into it
    before making it (a FileNotFoundError)."""
    import subprocess

    out = tmp_path / "rlvr"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rlvr_options.py"), "--out", str(out),
                           "--summary_only", "--seeds", "1", "--configs", "grpo"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| grpo | not run |" in proc.stdout and (out / "table.json").is_file()
