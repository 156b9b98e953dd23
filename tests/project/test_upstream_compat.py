"""Switching from upstream DeepSpeed-Chat without edits: its output folders, its helper names.

Upstream's step-1 output is ``pytorch_model.bin`` + ``config.json`` (with ``_name_or_path``, as older
transformers wrote it) + bare vocabulary files (``tokenizer.save_vocabulary``); its step-2 output is
the same with the whole RewardModel in ``pytorch_model.bin`` (``rwtransformer.*`` + ``v_head.weight``,
LoRA fused). The folders here are written by hand in that layout from the tiny models, and whatever
dschat loads from them must score / predict exactly like the model they were written from.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dschat.errors import UserError
from dschat.models.tiny import build_tiny_model
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.utils.model.model_utils import create_critic_model, create_hf_model

from helpers import PYTHON, REPO
from helpers.step3 import base_argv, load_state, step3_main
from helpers.steps import deepspeed_cmd, load_script, run_cli

TEXTS = [" Human: Tell me about owls. Assistant: Owls hunt at night.", " Human: hi Assistant: bye"]


def _vocab_only(tokenizer, folder: Path) -> None:
    """What upstream's save_hf_format leaves: the BPE vocabulary, no special-token files."""
    tokenizer.backend_tokenizer.model.save(str(folder))  # vocab.json + merges.txt
    assert not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists()


def _config_json(config, folder: Path, name_or_path: str | None, **extra) -> None:
    data = config.to_dict()
    if name_or_path is not None:
        data["_name_or_path"] = name_or_path
    data.update(extra)
    (folder / "config.json").write_text(json.dumps(data))


def write_upstream_critic(name: str, folder: Path, seed: int = 0, state_edit=None):
    """An upstream step-2 folder for tiny model ``name``; returns (the original critic, its tokenizer)."""
    tokenizer = load_hf_tokenizer(name)
    torch.manual_seed(seed)
    critic = create_critic_model(name, tokenizer, None).eval()
    with torch.no_grad():
        critic.v_head.weight.normal_()  # a fresh head is small: make it matter
    state = {k: v.clone() for k, v in critic.state_dict().items()}
    assert set(state) == {"v_head.weight"} | {f"rwtransformer.{k}" for k in critic.rwtransformer.state_dict()}
    if state_edit is not None:
        state_edit(state)
    folder.mkdir(parents=True)
    torch.save(state, folder / "pytorch_model.bin")
    # Upstream's RewardModel also left end_token_id / n_embd in the body config it saved.
    _config_json(critic.rwtransformer.config, folder, str(build_tiny_model(name)),
                 end_token_id=tokenizer.eos_token_id, n_embd=critic.rwtransformer.config.hidden_size)
    _vocab_only(tokenizer, folder)
    return critic, tokenizer


def write_upstream_actor(name: str, folder: Path, name_or_path: str | None = None, vocab_rows: int | None = None):
    """An upstream step-1 folder; ``vocab_rows`` gives its embeddings that many rows (the rows beyond
    the tokenizer initialised like the others, so the actor samples their ids as often)."""
    tokenizer = load_hf_tokenizer(name)
    torch.manual_seed(1)
    actor = create_hf_model(AutoModelForCausalLM, name, tokenizer).eval()
    if vocab_rows is not None:
        actor.resize_token_embeddings(vocab_rows)
    with torch.no_grad():
        actor.lm_head.weight.add_(0.01 * torch.randn_like(actor.lm_head.weight))  # differ from the base
    folder.mkdir(parents=True)
    torch.save(actor.state_dict(), folder / "pytorch_model.bin")
    _config_json(actor.config, folder, str(build_tiny_model(name)) if name_or_path is None else name_or_path)
    _vocab_only(tokenizer, folder)
    return actor, tokenizer


def _values(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.forward_value(batch.input_ids, attention_mask=batch.attention_mask, return_value_only=True)


@pytest.fixture(scope="module")
def upstream_opt_critic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("upstream") / "reward-models" / "opt"
    critic, tokenizer = write_upstream_critic("tiny-opt", folder)
    return folder, critic, tokenizer


# ------------------------------------------------------------------------------------ tokenizer


def test_vocab_only_folder_loads_the_original_tokenizer(upstream_opt_critic, capsys):
    folder, _, original = upstream_opt_critic
    # What loading the bare vocabulary would give: GPT-2 defaults, no </s> BOS -- the reason for
    # upstream's _name_or_path workaround (DSE #460).
    bare = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    assert bare(TEXTS[0]).input_ids != original(TEXTS[0]).input_ids
    tokenizer = load_hf_tokenizer(str(folder))
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "loading the tokenizer of" in out and "_name_or_path" in out
    assert tokenizer(TEXTS).input_ids == original(TEXTS).input_ids
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("</s>", "</s>", "<pad>")
    assert tokenizer.padding_side == "right"


def test_name_or_path_chain_is_followed(tmp_path, upstream_opt_critic):
    # A step-3 actor names its step-1 folder, which names the base model: neither has tokenizer files.
    step1 = tmp_path / "actor-models" / "opt"
    write_upstream_actor("tiny-opt", step1)
    step3 = tmp_path / "step3-models" / "opt" / "actor"
    write_upstream_actor("tiny-opt", step3, name_or_path=str(step1))
    assert load_hf_tokenizer(str(step3))(TEXTS).input_ids == load_hf_tokenizer("tiny-opt")(TEXTS).input_ids


@pytest.mark.parametrize("name_or_path", ["some-org/never-downloaded-model", "/no/such/original/model"])
def test_unloadable_original_tokenizer_says_to_copy_the_files(tmp_path, monkeypatch, name_or_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "actor"
    write_upstream_actor("tiny-opt", folder, name_or_path=name_or_path)
    with pytest.raises(UserError, match="copy the original model's tokenizer files") as err:
        load_hf_tokenizer(str(folder))
    assert name_or_path in str(err.value) and "\n" not in str(err.value)


def test_name_or_path_cycle_is_an_error(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_upstream_actor("tiny-opt", a, name_or_path=str(b))
    write_upstream_actor("tiny-opt", b, name_or_path=str(a))
    with pytest.raises(UserError, match="lead in a circle"):
        load_hf_tokenizer(str(a))


# ----------------------------------------------------------------------------- step-1 (actor) folder


def test_upstream_step1_folder_loads_as_actor(tmp_path):
    folder = tmp_path / "actor-models" / "opt"
    actor, _ = write_upstream_actor("tiny-opt", folder)
    tokenizer = load_hf_tokenizer(str(folder))
    loaded = create_hf_model(AutoModelForCausalLM, str(folder), tokenizer).eval()
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, actor(**batch).logits)


def test_upstream_step1_folder_loads_partitioned_under_zero3(tmp_path):
    import deepspeed

    from dschat.runtime.dist import init_distributed
    from dschat.utils.ds_utils import get_eval_ds_config

    init_distributed()
    folder = tmp_path / "actor"
    actor, _ = write_upstream_actor("tiny-opt", folder)
    ds_config = get_eval_ds_config(False, "fp32", 3, micro_batch_size=2, world_size=1)
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    loaded = create_hf_model(AutoModelForCausalLM, str(folder), load_hf_tokenizer(str(folder)), ds_config)
    fc1 = loaded.model.decoder.layers[1].fc1.weight
    assert fc1.numel() == 0
    with deepspeed.zero.GatheredParameters([fc1, loaded.lm_head.weight]):
        assert torch.equal(fc1.data, actor.model.decoder.layers[1].fc1.weight)
        assert torch.equal(loaded.lm_head.weight.data, actor.lm_head.weight)


# ---------------------------------------------------------------------------- step-2 (critic) folder


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_upstream_critic_scores_like_the_model_it_was_saved_from(tmp_path, name):
    folder = tmp_path / "critic"
    critic, _ = write_upstream_critic(name, folder, seed=3)
    tokenizer = load_hf_tokenizer(str(folder))
    loaded = create_critic_model(str(folder), tokenizer, None, rlhf_training=True).eval()
    assert torch.equal(loaded.v_head.weight, critic.v_head.weight)
    got, expected = _values(loaded, tokenizer), _values(critic, tokenizer)
    assert torch.equal(got, expected)
    # A fresh critic would not: the values depend on the loaded weights.
    fresh = create_critic_model(name, tokenizer, None).eval()
    assert not torch.allclose(_values(fresh, tokenizer), expected)


def test_fp16_upstream_critic_loads_in_fp32(tmp_path):
    # Upstream's default --dtype fp16 saved a half-precision state dict.
    def to_fp16(state):
        for key in state:
            state[key] = state[key].half()

    folder = tmp_path / "critic"
    critic, tokenizer = write_upstream_critic("tiny-llama", folder, state_edit=to_fp16)
    loaded = create_critic_model(str(folder), tokenizer, None, rlhf_training=True).eval()
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, critic.state_dict()[name].half().float()), name


def test_unreadable_bin_is_one_line_error(tmp_path):
    folder = tmp_path / "critic"
    _, tokenizer = write_upstream_critic("tiny-opt", folder)
    torch.save({"args": argparse.Namespace(lr=1.0)}, folder / "pytorch_model.bin")  # not tensors only
    with pytest.raises(UserError, match="cannot read .* as a tensor state dict"):
        create_critic_model(str(folder), tokenizer, None, rlhf_training=True)
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read .* as a tensor state dict"):
        create_critic_model(str(folder), tokenizer, None, rlhf_training=True)


def _add_key(state):
    state["rwtransformer.decoder.layers.9.fc1.weight"] = torch.zeros(2, 2)


def _drop_key(state):
    del state["rwtransformer.decoder.final_layer_norm.bias"]


def _reshape_key(state):
    state["rwtransformer.decoder.layers.0.fc1.weight"] = torch.zeros(3, 64)


def _stray_key(state):
    state["lora_right_weight"] = torch.zeros(2)


def _drop_head(state):
    del state["v_head.weight"]


def _bad_head(state):
    state["v_head.weight"] = torch.zeros(1, 7)


@pytest.mark.parametrize("edit, message", [
    (_add_key, "unexpected: decoder.layers.9.fc1.weight"),
    (_drop_key, "missing: decoder.final_layer_norm.bias"),
    (_reshape_key, r"wrong shape: decoder.layers.0.fc1.weight \(3, 64\) vs \(128, 64\)"),
    (_stray_key, "neither v_head.weight nor rwtransformer.*: lora_right_weight"),
    (_drop_head, "no v_head.weight"),
    (_bad_head, r"has shape \(1, 7\)"),
])
def test_upstream_critic_with_wrong_keys_is_one_line_error(tmp_path, edit, message):
    folder = tmp_path / "critic"
    _, tokenizer = write_upstream_critic("tiny-opt", folder, state_edit=edit)
    with pytest.raises(UserError, match=message) as err:
        create_critic_model(str(folder), tokenizer, None, rlhf_training=True)
    assert "\n" not in str(err.value)


def test_step1_folder_is_not_a_critic(tmp_path):
    folder = tmp_path / "actor"
    _, tokenizer = write_upstream_actor("tiny-opt", folder)
    with pytest.raises(UserError, match=r"not an upstream step-2 reward model \(a step-1 causal LM"):
        create_critic_model(str(folder), tokenizer, None, rlhf_training=True)


def test_legacy_buffers_are_ignored_as_transformers_ignores_them(tmp_path):
    # transformers < 4.31 saved LLaMA's rotary inv_freq per layer; the key is no longer a model key.
    def legacy(state):
        state["rwtransformer.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    folder = tmp_path / "critic"
    critic, tokenizer = write_upstream_critic("tiny-llama", folder, state_edit=legacy)
    loaded = create_critic_model(str(folder), tokenizer, None, rlhf_training=True).eval()
    assert torch.equal(_values(loaded, tokenizer), _values(critic, tokenizer))


def test_dschat_value_head_file_wins_over_a_stray_bin(tmp_path):
    from dschat.utils.model.reward_model import critic_format

    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert critic_format(tmp_path) == "upstream"
    (tmp_path / "v_head.safetensors").write_bytes(b"")
    assert critic_format(tmp_path) == "dschat"
    assert critic_format(tmp_path / "nope") is None


def test_zero3_upstream_critic_is_built_partitioned_and_scores_the_same(upstream_opt_critic):
    import deepspeed

    from dschat.runtime.dist import init_distributed
    from dschat.utils.ds_utils import get_eval_ds_config

    init_distributed()
    folder, critic, _ = upstream_opt_critic
    tokenizer = load_hf_tokenizer(str(folder))
    ds_config = get_eval_ds_config(False, "fp32", 3, micro_batch_size=2, world_size=1)
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even tiny weights
    loaded = create_critic_model(str(folder), tokenizer, ds_config, rlhf_training=True, zero_stage=3)
    fc1 = loaded.rwtransformer.decoder.layers[0].fc1.weight
    assert fc1.numel() == 0 and tuple(fc1.ds_shape) == (128, 64)  # built under zero.Init
    with deepspeed.zero.GatheredParameters([fc1]):
        assert torch.equal(fc1.data, critic.rwtransformer.decoder.layers[0].fc1.weight)
    engine, *_ = deepspeed.initialize(model=loaded, config=ds_config)
    engine.eval()
    assert torch.equal(_values(engine.module, tokenizer), _values(critic, tokenizer))


TWO_RANK_SCRIPT = """
import sys, torch, deepspeed
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.runtime.dist import init_distributed
from dschat.runtime.zero3 import release_zero3_prefetch
from dschat.utils.ds_utils import get_eval_ds_config
from dschat.utils.model.model_utils import create_critic_model, load_state_dict_into_model
folder, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
info = init_distributed()
tokenizer = load_hf_tokenizer(folder)
ds_config = get_eval_ds_config(False, "fp32", 3, micro_batch_size=2)
ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
critic = create_critic_model(folder, tokenizer, ds_config, rlhf_training=True, zero_stage=3)
engine, *_ = deepspeed.initialize(model=critic, config=ds_config)
engine.eval()
batch = tokenizer(%r, return_tensors="pt", padding=True)
with torch.no_grad():
    values = engine.module.forward_value(batch.input_ids, attention_mask=batch.attention_mask, return_value_only=True)
# upstream's loader: rank 0 loads each gathered module, the others receive it
state = torch.load(folder + "/pytorch_model.bin", map_location="cpu", weights_only=True)
load_state_dict_into_model(engine.module, {k: torch.zeros_like(v) for k, v in state.items()}, zero_stage=3)
with torch.no_grad():
    zeroed = engine.module.forward_value(batch.input_ids, attention_mask=batch.attention_mask, return_value_only=True)
torch.save({"values": values, "zeroed": zeroed}, f"{out}/rank{info.rank}.pt")
# End as the step scripts do: no all-gather of DeepSpeed's prefetcher left in flight, both ranks done,
# the group destroyed. Ending right after the forward, this job twice died at exit in CI ("terminate
# called without an active exception", exit 250) after writing its results.
release_zero3_prefetch(engine)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
""" % (TEXTS,)


@pytest.mark.slow
def test_two_zero3_ranks_load_the_upstream_critic(tmp_path, upstream_opt_critic):
    folder, critic, tokenizer = upstream_opt_critic
    script = tmp_path / "load_critic.py"
    script.write_text(TWO_RANK_SCRIPT)
    proc = run_cli(deepspeed_cmd(str(script), str(folder), str(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    expected = _values(critic, tokenizer)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert torch.equal(result["values"], expected), rank
        assert torch.count_nonzero(result["zeroed"]) == 0, rank  # rank 0's load reached both ranks


# ------------------------------------------------------------------------- step 3 / e2e path checks


def test_step3_check_paths_accepts_either_format_and_names_both(tmp_path, upstream_opt_critic):
    main = step3_main()
    args = main.parse_args(base_argv("tiny-opt", upstream_opt_critic[0], tmp_path / "data",
                                     "--output_dir", str(tmp_path / "out")))
    check_paths = main.check_paths
    check_paths(args)  # upstream format
    args.critic_model_name_or_path = str(build_tiny_model("tiny-opt"))  # a plain model folder
    with pytest.raises(UserError) as err:
        check_paths(args)
    assert "v_head.safetensors" in str(err.value) and "pytorch_model.bin" in str(err.value)
    step1 = tmp_path / "actor"
    write_upstream_actor("tiny-opt", step1)
    args.critic_model_name_or_path = str(step1)  # upstream format, but a causal LM: its keys tell
    with pytest.raises(UserError, match="a step-1 causal LM"):
        check_paths(args)


def test_e2e_accepts_an_upstream_reward_folder(upstream_opt_critic, tmp_path):
    sys.path.insert(0, str(REPO))
    import e2e_rlhf as E

    assert E.folder_problem(upstream_opt_critic[0], "reward") is None
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    problem = E.folder_problem(tmp_path, "reward")
    assert "v_head.safetensors" in problem and "pytorch_model.bin" in problem


@pytest.mark.slow
def test_step3_runs_from_upstream_step1_and_step2_folders(tmp_path, upstream_opt_critic, capsys):
    """Step 3 as a user switching from upstream runs it: both inputs in upstream's format, the actor
    with more embedding rows than the critic (found on an H100: an OPT-1.3B actor's 50272 rows, an
    upstream critic resized to 552; the actor sampled ids the critic has no row for). Every model is
    resized to the tokenizer's length rounded up to 8, as upstream does, and one line says so."""

    actor_dir = tmp_path / "actor-models" / "opt"
    _, tokenizer = write_upstream_actor("tiny-opt", actor_dir, vocab_rows=2048)  # the critic has 1000
    rows = 8 * -(-len(tokenizer) // 8)
    argv = base_argv("tiny-opt", upstream_opt_critic[0], tmp_path / "data", "--output_dir", str(tmp_path / "out"),
                     steps=1)
    argv[argv.index("--actor_model_name_or_path") + 1] = str(actor_dir)
    result = step3_main().main(argv)
    assert (f"note: the models' embeddings differ in size (actor 2048, critic/reward model 1000 rows); every model "
            f"is resized to the tokenizer's length rounded up to 8 ({rows} rows)") in capsys.readouterr().out
    assert len(result.history) == 1 and all(torch.isfinite(torch.tensor(v)) for v in
                                            (result.history[0]["actor_loss"], result.history[0]["critic_loss"]))
    engine = result.rlhf_engine
    bodies = [getattr(m.module, "rwtransformer", m.module) for m in (engine.actor, engine.ref, engine.critic, engine.reward)]
    assert [body.get_input_embeddings().weight.shape[0] for body in bodies] == [rows] * 4
    assert (tmp_path / "out" / "critic" / "v_head.safetensors").is_file()  # dschat writes its own format
    assert load_state(tmp_path / "out" / "actor")["model.decoder.embed_tokens.weight"].shape[0] == rows


def test_aligned_vocab_rows_only_when_the_models_differ():
    from types import SimpleNamespace

    from dschat.utils.model.model_utils import aligned_vocab_rows

    tokenizer = [None] * 545  # only its length is read
    same = {"actor": SimpleNamespace(vocab_size=548), "critic": SimpleNamespace(vocab_size=552)}  # both pad to 552
    assert aligned_vocab_rows(tokenizer, same) == (None, None)
    rows, note = aligned_vocab_rows(tokenizer, {"actor": SimpleNamespace(vocab_size=50272),
                                                "critic": SimpleNamespace(vocab_size=552)})
    assert rows == 552 and "(actor 50272, critic 552 rows)" in note and "(552 rows), as upstream does" in note


# ----------------------------------------------------------------------------- evaluation scripts


def test_rw_eval_scores_an_upstream_folder_like_the_dschat_save_of_the_same_model(tmp_path, upstream_opt_critic):
    from dschat.models.save import save_hf_model

    folder, critic, tokenizer = upstream_opt_critic
    dschat_folder = save_hf_model(critic, tokenizer, tmp_path / "dschat-critic")
    rw_eval = load_script("step2", "rw_eval")
    upstream_scores = rw_eval.main(["--model_name_or_path", str(folder), "--max_seq_len", "64"])
    dschat_scores = rw_eval.main(["--model_name_or_path", str(dschat_folder), "--max_seq_len", "64"])
    assert len(upstream_scores) == 2 and upstream_scores == dschat_scores


@pytest.mark.parametrize("script, usage", [
    ("training/step1_supervised_finetuning/evaluation_scripts/run_prompt.sh", "BASELINE_MODEL FINETUNED_MODEL"),
    ("training/step2_reward_model_finetuning/evaluation_scripts/run_eval.sh", "REWARD_MODEL"),
])
def test_evaluation_scripts_print_usage_without_paths(script, usage):
    import subprocess

    proc = subprocess.run(["bash", str(REPO / script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"usage: bash {REPO / script} {usage}" in proc.stderr


@pytest.mark.slow
def test_evaluation_scripts_run_the_eval_programs(tmp_path, upstream_opt_critic):
    actor = tmp_path / "actor"
    write_upstream_actor("tiny-opt", actor)
    scripts = REPO / "training"
    proc = run_cli(["bash", str(scripts / "step2_reward_model_finetuning/evaluation_scripts/run_eval.sh"),
                    str(upstream_opt_critic[0]), "--max_seq_len", "64"], cwd=tmp_path, PYTHON=PYTHON)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("good_ans score:") == 2
    # Relative paths are the caller's: the script does not change directory.
    proc = run_cli(["bash", str(scripts / "step1_supervised_finetuning/evaluation_scripts/run_prompt.sh"),
                    "tiny-opt", "actor", "--max_new_tokens", "4"], cwd=tmp_path, PYTHON=PYTHON)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("==========finetune: Greedy=========") == 6


# ------------------------------------------------------------------------------ dschat.utils.utils


def test_utils_reexports_moving_average():
    from dschat.rlhf.actor_ema import moving_average
    from dschat.utils import utils

    assert utils.moving_average is moving_average and "moving_average" in utils.__all__
    assert "load_state_dict_into_model" in utils.__all__


def _tiny_opt_lm(seed: int):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64))


def test_load_state_dict_into_model_is_strict():
    from dschat.utils.utils import load_state_dict_into_model

    source, target = _tiny_opt_lm(0), _tiny_opt_lm(1)
    state = source.state_dict()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    for edit, message in ((lambda s: s.pop("model.decoder.final_layer_norm.bias"), "missing: model.decoder.final_layer_norm.bias"),
                          (lambda s: s.__setitem__("extra.weight", torch.zeros(1)), "unexpected: extra.weight"),
                          (lambda s: s.__setitem__("lm_head.weight", torch.zeros(3, 3)), "wrong shape: lm_head.weight")):
        bad = dict(state)
        edit(bad)
        with pytest.raises(UserError, match=message):
            load_state_dict_into_model(target, bad)
        assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing loaded
    report = load_state_dict_into_model(target, state)
    assert report == ([], [], [])
    assert all(torch.equal(v, state[k]) for k, v in target.state_dict().items())
    # strict=False: the matching keys load, the others come back.
    partial = {k: v for k, v in _tiny_opt_lm(2).state_dict().items() if k != "lm_head.weight"}
    partial["extra"] = torch.zeros(1)
    report = load_state_dict_into_model(_tiny_opt_lm(3), partial, strict=False)
    assert report.unexpected_keys == ["extra"] and report.missing_keys == ["lm_head.weight"]


def test_load_state_dict_into_model_with_prefix():
    from dschat.utils.utils import load_state_dict_into_model

    source, target = _tiny_opt_lm(0), _tiny_opt_lm(1)
    prefixed = {f"rwtransformer.{k}": v for k, v in source.state_dict().items()}
    load_state_dict_into_model(target, prefixed, start_prefix="rwtransformer.")
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items())
    with pytest.raises(UserError, match="unexpected"):
        load_state_dict_into_model(target, source.state_dict(), start_prefix="rwtransformer.")


def test_load_state_dict_into_model_under_zero3():
    import deepspeed

    from dschat.runtime.dist import init_distributed
    from dschat.utils.ds_utils import get_eval_ds_config
    from dschat.utils.utils import load_state_dict_into_model

    init_distributed()
    cfg = get_eval_ds_config(False, "fp32", 3, micro_batch_size=1, world_size=1)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    source, target = _tiny_opt_lm(0), _tiny_opt_lm(1)
    deepspeed.zero.Init(module=target, config_dict_or_path=cfg)
    q = target.model.decoder.layers[0].self_attn.q_proj.weight
    assert q.numel() == 0  # partitioned
    with pytest.raises(UserError, match="wrong shape"):
        load_state_dict_into_model(target, {**source.state_dict(), "lm_head.weight": torch.zeros(2, 2)}, zero_stage=3)
    load_state_dict_into_model(target, source.state_dict(), zero_stage=3)
    params = dict(target.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, param in params.items():
            assert torch.equal(param.data, source.state_dict()[name]), name


def test_reward_and_actor_folders_are_told_apart_in_both_formats(tmp_path):
    # Upstream's step-1 and step-2 folders both hold pytorch_model.bin; only the keys differ. The
    # chatbot and the report's --actor / --reward checks must tell them apart.
    from dschat.eval import scoring
    from dschat.utils.model.reward_model import is_reward_model_folder

    sys.path.insert(0, str(REPO / "inference"))
    import chatbot

    critic, actor = tmp_path / "critic", tmp_path / "actor"
    write_upstream_critic("tiny-opt", critic)
    write_upstream_actor("tiny-opt", actor)
    assert is_reward_model_folder(critic) and not is_reward_model_folder(actor)
    assert scoring.check_reward_folder(critic) == Path(critic)
    assert scoring.check_actor_folder(actor) == Path(actor)
    with pytest.raises(UserError, match="is not a step-2 reward model output"):
        scoring.check_reward_folder(actor)
    with pytest.raises(UserError, match="is a reward model .*no language-model head"):
        scoring.check_actor_folder(critic)
    with pytest.raises(UserError, match="is a reward model .*; chat with a step-1 output"):
        chatbot.resolve_chat_folder(str(critic))
    assert chatbot.resolve_chat_folder(str(actor)) == str(actor)
