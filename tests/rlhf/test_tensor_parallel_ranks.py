"""Inference tensor parallelism on two real ranks (DeepSpeed launcher, gloo, ZeRO-3 with every weight
partitioned): one launch checks tiny Llama and OPT actors, with and without LoRA, through
``RolloutGenerator`` -- TP 2 greedy tokens and per-token log-probs equal TP 1's, the shards hold less
than the whole copy, the ZeRO-3 partitions come back bit for bit, the summary line names the degree, a
second end id in the generation config ends the rows where TP 1 ends them --
and one step-3 run with ``--inference_tp_size 2`` trains and saves."""
from __future__ import annotations

import pytest

from helpers.step3 import STEP3_MAIN, base_argv, subprocess_env
from helpers.steps import deepspeed_cmd, run_captured

pytestmark = pytest.mark.slow

SCRIPT = r'''
import deepspeed
import torch
from transformers import AutoModelForCausalLM

from dschat.models.build import create_hf_model
from dschat.models.lora import convert_linear_layer_to_lora
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.rlhf.rollout.deepspeed_engine import HybridEngineDecision
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.rollout.sampling import DecodingSettings
from dschat.runtime.dist import init_distributed
from dschat.runtime.ds_config import get_eval_ds_config
from dschat.runtime.zero3 import whole_partitions

info = init_distributed()
for name, lora_modules in (("tiny-llama", "layers."), ("tiny-opt", "decoder.layers.")):
    for lora in (0, 4):
        tokenizer = load_hf_tokenizer(name)
        ds_config = get_eval_ds_config(False, "fp32", 3, micro_batch_size=2)
        ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even tiny weights
        torch.manual_seed(0)  # the same model and LoRA factors on both ranks
        model = create_hf_model(AutoModelForCausalLM, name, tokenizer, ds_config)
        if lora:
            model = convert_linear_layer_to_lora(model, lora_modules, lora)
            with torch.no_grad():
                for module in model.modules():
                    if hasattr(module, "lora_left_weight"):
                        module.lora_left_weight.normal_(std=0.05)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        engine.module.eval()
        assert not whole_partitions(engine)  # two ranks: --zero3_gather_for_training auto leaves it hooked
        partitions = [p.ds_tensor.clone() for p in engine.module.parameters()]
        # Each rank its own prompts: rank 0 three rows of 6 columns, rank 1 two of 4.
        texts = (["Human: hello there", "Human: what is", "Human: a"] if info.rank == 0 else ["Human: hi", "Human: ok"])
        ids = [tokenizer(t)["input_ids"][-6:] for t in texts]
        width = 6 if info.rank == 0 else 4
        prompts = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r[-width:] for r in ids])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r[-width:]) for r in ids])
        gen = RolloutGenerator(engine, tokenizer, decision=HybridEngineDecision(True, False, dschat_engine=True),
                               decoding=DecodingSettings("greedy"), max_answer_seq_len=8, zero_stage=3,
                               inference_tp_size=2, tp_gather_partition_size=1)
        gen.extra_generate_kwargs = {"min_new_tokens": 2}
        tp = gen.rollout(prompts, mask)
        tp_line, shard = gen.summary_line(), gen.engine.model.weights
        gen.inference_tp_size = 1  # the same generator, TP 1: each rank decodes its own prompts
        one = gen.rollout(prompts, mask)
        assert torch.equal(tp.sequences, one.sequences), (name, lora, tp.sequences, one.sequences)
        assert tp.sequences.shape[1] > width + 2, tp.sequences
        torch.testing.assert_close(tp.logprobs, one.logprobs, rtol=0, atol=2e-5)
        whole = gen.engine.model.weights
        halves = [(getattr(a, n).shape[d], getattr(b, n).shape[d]) for a, b in zip(shard.layers, whole.layers)
                  for n, d in (("qkv_w", 0), ("up_w", 0), ("o_w", 1), ("down_w", 1))]
        assert all(2 * part == full for part, full in halves), halves  # each rank holds half of every matrix
        assert 2 * shard.lm_head.shape[0] == whole.lm_head.shape[0] and shard.nbytes() < whole.nbytes()
        assert all(torch.equal(a, p.ds_tensor) for a, p in zip(partitions, engine.module.parameters()))
        assert "inference TP degree 2" in tp_line and "tensor-parallel over ranks 0-1" in tp_line, tp_line
        assert gen.summary_line().endswith("inference TP degree 1")
        print(f"TP-OK {name} lora={lora} rank={info.rank} shard {shard.nbytes()} of {whole.nbytes()} bytes | {tp_line}", flush=True)
        if lora:
            continue
        # A second end id in the generation config, one a row meets past min_new_tokens for the first
        # time: TP 2 ends the rows there as TP 1 does, each rank keeping its own rows.
        answers = one.sequences[:, width:].tolist()
        specials = (tokenizer.eos_token_id, tokenizer.pad_token_id)
        found = [(info.rank, i, k, a[k]) for i, a in enumerate(answers) for k in range(2, len(a))
                 if a[k] not in a[:k] + list(specials) and specials[0] not in a[:k]] + [(-1, -1, -1, -1)]
        everyone = [torch.zeros(4, dtype=torch.long) for _ in range(2)]
        torch.distributed.all_gather(everyone, torch.tensor(found[0]))
        owner, at_row, at, stop = next(t.tolist() for t in everyone if int(t[0]) >= 0)  # (rank, row, column, id)
        engine.module.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
        gen = RolloutGenerator(engine, tokenizer, decision=HybridEngineDecision(True, False, dschat_engine=True),
                               decoding=DecodingSettings("greedy"), max_answer_seq_len=8, zero_stage=3,
                               inference_tp_size=2, tp_gather_partition_size=1)
        gen.extra_generate_kwargs = {"min_new_tokens": 2}
        assert gen.end_ids == (tokenizer.eos_token_id, stop), gen.end_ids
        tp = gen.rollout(prompts, mask)
        gen.inference_tp_size = 1
        alone = gen.rollout(prompts, mask)
        assert torch.equal(tp.sequences, alone.sequences), (tp.sequences, alone.sequences)
        if info.rank == owner:
            row = tp.sequences[at_row, width:].tolist()
            assert row[:at + 1] == answers[at_row][:at + 1], (row, answers[at_row])
            assert all(t == tokenizer.pad_token_id for t in row[at + 1:]), row  # ended at the new end id
        engine.module.generation_config.eos_token_id = tokenizer.eos_token_id
        print(f"TP-END-OK {name} rank={info.rank}", flush=True)
'''


def test_two_ranks_tp2_rollouts_equal_tp1_for_llama_and_opt_with_and_without_lora(tmp_path):
    script = tmp_path / "tp_ranks.py"
    script.write_text(SCRIPT)
    proc = run_captured(deepspeed_cmd(str(script)), cwd=tmp_path, env=subprocess_env(), timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TP-OK ") == 8, proc.stdout[-3000:]  # 2 models x LoRA off/on x 2 ranks (lines may interleave)
    assert proc.stdout.count("TP-END-OK ") == 4, proc.stdout[-3000:]  # 2 models x 2 ranks


def test_step3_with_inference_tp_size_2_trains_and_saves(tmp_path, critic_dirs, data_cache):
    out = tmp_path / "out"
    argv = base_argv("tiny-llama", critic_dirs["tiny-llama"], data_cache, "--actor_zero_stage", "3",
                     "--critic_zero_stage", "3", "--enable_hybrid_engine", "--inference_tp_size", "2",
                     "--tp_gather_partition_size", "1", "--release_inference_cache", "--actor_lora_dim", "4",
                     "--output_dir", str(out), steps=1)
    proc = run_captured(deepspeed_cmd(str(STEP3_MAIN), *argv), cwd=tmp_path, env=subprocess_env(), timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("Rollouts: ")]
    assert len(summary) == 1 and summary[0].endswith("inference TP degree 2"), proc.stdout[-3000:]
    assert proc.stdout.count("Average reward score") == 1
    # Across two ranks 'auto' leaves the training passes to ZeRO-3's hooks (gathering costs a full copy there).
    for model in ("actor", "critic"):
        assert f"ZeRO-3 training: the {model}'s parameters fetched module by module (it is partitioned" in proc.stdout
    assert (out / "actor" / "config.json").exists() and (out / "critic" / "v_head.safetensors").exists()
