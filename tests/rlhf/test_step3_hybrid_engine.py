"""Rollout generation: Hybrid Engine decision and fallbacks (never crash, say why once), ZeRO-3
gather-once generation, LoRA fused for generation; GPU tier: HE on/off greedy equality."""
from __future__ import annotations

import os
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch._inductor.utils import clear_caches as clear_inductor_caches

from dschat.errors import UserError
from dschat.rlhf.rollout.deepspeed_engine import HybridEngineDecision, decide_hybrid_engine
from dschat.rlhf.rollout.generator import RolloutGenerator
from dschat.rlhf.rollout.sampling import DecodingSettings

from helpers.step3 import base_argv, step3_main
from helpers.steps import require_cuda_accelerator

PROMPTS = torch.tensor([[3, 1, 40, 41], [1, 42, 43, 44]])  # tiny-llama ids: pad 3, bos 1
PROMPT_MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])


def _engine(model: str, critic_dirs, data_cache, *extra: str):
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.runtime.dist import init_distributed

    init_distributed()
    args = step3_main().parse_args(base_argv(model, critic_dirs[model], data_cache, "--decoding", "greedy", *extra))
    torch.manual_seed(0)
    return DeepSpeedRLHFEngine(model, str(critic_dirs[model]), load_hf_tokenizer(model), args, 10)


def _generate(engine) -> torch.Tensor:
    engine.generator.eval()
    return engine.generator.generate(PROMPTS, PROMPT_MASK)


# ------------------------------------------------------------------------------------ decision


def test_decide_hybrid_engine():
    import transformers

    import dschat.rlhf.rollout.deepspeed_engine as he

    opt = SimpleNamespace(model_type="opt")
    llama = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert decide_hybrid_engine(False, opt, "cuda") == HybridEngineDecision(False, False)
    # Families dschat's decode model covers: dschat's Hybrid Engine, on any accelerator; DeepSpeed's is not built.
    for config in (opt, llama):
        for accelerator in ("cuda", "cpu"):
            assert decide_hybrid_engine(True, config, accelerator) == HybridEngineDecision(True, False, dschat_engine=True)
    # Other families: DeepSpeed's Hybrid Engine where it can work, else one line saying why not.
    bloom, gpt2 = SimpleNamespace(model_type="bloom"), SimpleNamespace(model_type="gpt2")
    if int(transformers.__version__.split(".")[0]) >= 5:  # every decoder is handed Cache objects
        cache = decide_hybrid_engine(True, bloom, "cuda")
        assert not cache.enabled and not cache.dschat_engine and "BloomBlock passes Cache objects" in cache.reason
        assert "dschat's Hybrid Engine does not cover this model (model type 'bloom' has no inference layout" in cache.reason
    with pytest.MonkeyPatch.context() as mp:  # a transformers whose BLOOM block keeps tuple caches
        mp.setattr(he, "cache_object_decoder_layer", lambda model_type: None)
        assert decide_hybrid_engine(True, bloom, "cuda") == HybridEngineDecision(True, True)
    cpu = decide_hybrid_engine(True, bloom, "cpu")
    assert not cpu.enabled and "accelerator is 'cpu'" in cpu.reason
    no_container = decide_hybrid_engine(True, gpt2, "cuda")
    assert not no_container.enabled and "no inference container" in no_container.reason


def test_decoding_settings_pin_the_sampling_distribution():
    assert DecodingSettings("greedy").generate_kwargs() == {"do_sample": False, "num_beams": 1}
    sample = DecodingSettings("sample", 0.7, 5, 0.9).generate_kwargs()
    assert sample["do_sample"] and (sample["temperature"], sample["top_k"], sample["top_p"]) == (0.7, 5, 0.9)
    assert DecodingSettings("sample", 0.7).logit_temperature == 0.7
    assert DecodingSettings("greedy", 0.7).logit_temperature == 1.0


# ------------------------------------------------------------------------------------ fallbacks


@pytest.mark.parametrize("model,extra", [
    ("tiny-llama", ()),
    ("tiny-llama", ("--actor_lora_dim", "4")),
    ("tiny-llama", ("--actor_zero_stage", "3")),
    ("tiny-opt", ("--actor_zero_stage", "3", "--actor_lora_dim", "4")),
])
def test_enable_hybrid_engine_decodes_with_dschats_engine(model, extra, critic_dirs, data_cache, capsys):
    """--enable_hybrid_engine on a covered family: dschat's Hybrid Engine gives the greedy tokens of the
    module's generate and the log-probs of a training forward, under ZeRO-0 and ZeRO-3 (gathered once),
    with LoRA (fused into the copy, unfused after), before and after an optimizer step -- whose new
    weights it copies into the same buffers."""
    from dschat.utils.module.lora import LinearLayer_LoRA

    engine = _engine(model, critic_dirs, data_cache, "--enable_hybrid_engine", "--actor_learning_rate", "0.05", *extra)
    gen = engine.generator
    assert engine.hybrid_engine.dschat_engine and type(engine.actor).__name__ == "DeepSpeedEngine"
    lora = [m for m in engine.actor.module.modules() if isinstance(m, LinearLayer_LoRA)]
    assert bool(lora) == ("--actor_lora_dim" in extra)
    with torch.no_grad():
        for layer in lora:  # a non-zero delta, so fusing it matters
            layer.lora_left_weight.normal_(0, 0.5)
    partitions = lambda: [p.ds_tensor.clone() for p in engine.actor.module.parameters() if hasattr(p, "ds_tensor")]  # noqa: E731

    def ours_and_plain() -> torch.Tensor:
        before = partitions()
        gen.eval()
        ours = gen.rollout(PROMPTS, PROMPT_MASK)
        assert gen.last_loop == "dschat-he" and not any(layer.fuse_lora for layer in lora)
        assert all(torch.equal(a, b) for a, b in zip(before, partitions()))  # ZeRO-3 partitions untouched
        gen.use_dschat_engine, gen.generation_loop = False, "hf"
        plain = gen.rollout(PROMPTS, PROMPT_MASK)
        gen.use_dschat_engine, gen.generation_loop = True, "auto"
        assert torch.equal(ours.sequences, plain.sequences)
        logp, answer_mask = _forward_logprobs(engine, ours.sequences, PROMPT_MASK, 1.0)
        kept = answer_mask.bool()
        assert torch.allclose(ours.logprobs[kept], logp[kept], atol=1e-4), (ours.logprobs[kept] - logp[kept]).abs().max()
        return ours.sequences

    first = ours_and_plain()
    buffers = [t.data_ptr() for t in gen.engine.model.weights.tensors()]
    engine.actor.train()
    logits = engine.actor(first).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), torch.roll(first, 1, 1)[:, 1:].flatten())
    engine.actor.backward(loss)
    engine.actor.step()
    after = ours_and_plain()
    assert not torch.equal(after, first)  # the step changed the greedy answer: the refreshed weights were used
    assert [t.data_ptr() for t in gen.engine.model.weights.tensors()] == buffers  # refreshed in place
    assert (gen.engine.weight_allocations, gen.engine.cache_allocations) == (1, 1)
    out = capsys.readouterr().out
    assert out.count("Rollouts: dschat Hybrid Engine (eager decode step), layout ") == 1
    assert "dtype float32, inference TP degree 1" in out
    if "--actor_zero_stage" in extra:  # weights fetched per layer: no inference copy, the module decodes
        gen.zero3_gather, gen._gather_decided = "off", None
        for _ in range(2):
            assert torch.equal(gen.rollout(PROMPTS, PROMPT_MASK).sequences, after) and gen.last_loop == "hf"
        assert capsys.readouterr().out.count("dschat Hybrid Engine: not used (the actor's ZeRO-3 weights are fetched") == 1


def test_real_hybrid_engine_without_container_generates_with_the_module(monkeypatch, critic_dirs, data_cache, capsys):
    # Force the HE on for OPT on this CPU: DeepSpeed builds a DeepSpeedHybridEngine that finds no
    # inference container; its engine.generate raises AttributeError '_generate' (0.19.8).
    import dschat.rlhf.rollout.deepspeed_engine as he

    monkeypatch.setattr(he, "decide_hybrid_engine", lambda requested, config, accelerator: he.HybridEngineDecision(True, True))
    engine = _engine("tiny-opt", critic_dirs, data_cache, "--enable_hybrid_engine")
    assert type(engine.actor).__name__ == "DeepSpeedHybridEngine"
    with pytest.raises(AttributeError, match="_generate"):
        engine.actor.generate(PROMPTS, attention_mask=PROMPT_MASK, max_new_tokens=2)
    seq = _generate(engine)
    _generate(engine)
    assert seq.shape[0] == 2
    assert capsys.readouterr().out.count("matched no inference container") == 1


class _FailingHybridEngine:
    """Stands in for a Hybrid Engine whose inference path breaks at run time."""

    def __init__(self, module):
        self.module = module
        self._inference_containers = ["container"]
        module.generate = self._broken  # DeepSpeed installs its generate on the module instance
        self.modes: list[str] = []

    def _broken(self, *args, **kwargs):
        raise AttributeError("'DeepSpeedHybridEngine' object has no attribute '_generate'")

    def eval(self):
        self.modes.append("eval")

    def train(self, mode=True):
        self.modes.append(f"train({mode})")


def test_hybrid_engine_failure_at_run_time_falls_back_once(capsys):
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer("tiny-llama")
    module = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"))
    engine = _FailingHybridEngine(module)
    gen = RolloutGenerator(engine, tok, decision=HybridEngineDecision(True, True),
                           decoding=DecodingSettings("greedy"), max_answer_seq_len=5, zero_stage=0)
    assert gen.hybrid_engine_active
    seq = gen.generate(PROMPTS, PROMPT_MASK)
    assert seq.shape == (2, 9) and not gen.hybrid_engine_active
    assert engine.modes == ["train(True)"]  # HE forwards restored before falling back
    gen.eval()
    gen.generate(PROMPTS, PROMPT_MASK)
    assert capsys.readouterr().out.count("Hybrid Engine failed to generate (AttributeError") == 1


# ------------------------------------------------------------------------------------ ZeRO-3 and LoRA


def test_zero3_gather_once_generates_the_same_tokens_without_per_layer_fetches(monkeypatch, critic_dirs, data_cache):
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    fetches = {"n": 0}
    original = PartitionedParameterCoordinator.fetch_sub_module

    def counting(self, *args, **kwargs):
        fetches["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PartitionedParameterCoordinator, "fetch_sub_module", counting)
    reference = _generate(_engine("tiny-llama", critic_dirs, data_cache, "--actor_lora_dim", "4"))
    results = {}
    for mode in ("on", "off"):
        engine = _engine("tiny-llama", critic_dirs, data_cache, "--actor_zero_stage", "3",
                         "--zero3_gather_for_generation", mode, "--actor_lora_dim", "4")
        before = {n: p.ds_tensor.clone() for n, p in engine.actor.module.named_parameters()}
        fetches["n"] = 0
        results[mode] = (_generate(engine), fetches["n"])
        after = dict(engine.actor.module.named_parameters())
        # The partitions come back bit-identical (LoRA fusion happened on discarded gathered copies).
        assert all(torch.equal(before[n], after[n].ds_tensor) for n in before)
        assert engine.generator.synced_gpus
    assert results["on"][1] == 0 and results["off"][1] > 100  # per layer, per token
    assert torch.equal(results["on"][0], results["off"][0])
    assert torch.equal(results["on"][0], reference)  # same tokens as ZeRO-0


@pytest.mark.parametrize("loop", ["dschat", "hf"])
def test_lora_is_fused_for_generation_and_unfused_after(loop, monkeypatch, critic_dirs, data_cache):
    import dschat.rlhf.rollout.sample_loop as decoding
    from dschat.models.lora import LinearLayer_LoRA

    engine = _engine("tiny-llama", critic_dirs, data_cache, "--actor_lora_dim", "4", "--generation_loop", loop)
    layers = [m for m in engine.actor.module.modules() if isinstance(m, LinearLayer_LoRA)]
    with torch.no_grad():
        for layer in layers:  # a non-zero delta, so fusion matters
            layer.lora_left_weight.normal_(0, 0.5)
    states = []
    # The decoding entry point of each loop: dschat's sample_loop, or the module class's generate.
    owner, name = (decoding, "sample_loop") if loop == "dschat" else (type(engine.actor.module), "generate")
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        states.append(all(layer.fuse_lora for layer in layers))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    fused_seq = _generate(engine)
    assert states == [True] and not any(layer.fuse_lora for layer in layers)
    # Greedy tokens with the fused weights equal those of the unfused LoRA forward.
    monkeypatch.setattr(owner, name, original)
    with torch.no_grad():
        unfused = type(engine.actor.module).generate(engine.actor.module, PROMPTS, attention_mask=PROMPT_MASK,
                                                     max_new_tokens=16, do_sample=False, pad_token_id=3, eos_token_id=2)
    assert torch.equal(fused_seq, unfused)


@pytest.mark.parametrize("extra", [(), ("--actor_lora_dim", "4"), ("--actor_zero_stage", "3")])
def test_fast_decoding_follows_the_actor_through_an_optimizer_step(extra, monkeypatch, critic_dirs, data_cache):
    """dschat's loop with oneDNN decode linears (--generation_loop dschat on a CPU) gives the plain
    path's greedy tokens and log-probs (HF generate, stock kernels), before and after the actor's
    weights change."""
    import dschat.rlhf.rollout.sample_loop as decoding

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN: --cpu_decode_linear onednn is not used")
    engine = _engine("tiny-llama", critic_dirs, data_cache, "--actor_learning_rate", "0.05",
                     "--generation_loop", "dschat", *extra)
    gen = engine.generator
    assert (gen.generation_loop, gen.cpu_decode_linear) == ("dschat", "onednn")
    installed = []  # the number of linears given oneDNN decode kernels, per rollout
    original = decoding.onednn_decode_linears

    @contextmanager
    def counted(module, rows):
        with original(module, rows) as layers:
            installed.append(layers)
            yield layers

    monkeypatch.setattr(decoding, "onednn_decode_linears", counted)

    def fast_and_plain():
        gen.eval()
        installed.clear()
        fast = gen.rollout(PROMPTS, PROMPT_MASK)
        assert gen.last_loop == "dschat"
        assert len(installed) == 1 and installed[0] > 0, (installed, gen._said)
        gen.generation_loop, gen.cpu_decode_linear = "hf", "off"
        plain = gen.rollout(PROMPTS, PROMPT_MASK)
        gen.generation_loop, gen.cpu_decode_linear = "dschat", "onednn"
        assert torch.equal(fast.sequences, plain.sequences)
        assert torch.allclose(fast.logprobs, plain.logprobs, atol=1e-5)
        return fast.sequences

    before = fast_and_plain()
    engine.actor.train()
    logits = engine.actor(before).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), torch.roll(before, 1, 1)[:, 1:].flatten())
    engine.actor.backward(loss)
    engine.actor.step()
    after = fast_and_plain()
    assert not torch.equal(after, before)  # the step changed the greedy answer: fresh weights were used


# ------------------------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-opt", "tiny-llama"])
@pytest.mark.parametrize("zero_stage", ["0", "3"])
def test_dschat_hybrid_engine_on_cuda_compiles_once_and_is_exact_in_fp32(model, zero_stage, critic_dirs, data_cache):
    """On CUDA the engine's decode step is compiled with CUDA graphs: in fp32 it gives the module's
    greedy tokens and a forward pass's log-probs, and rollouts after the first (ZeRO-3: weights
    gathered anew each time; a different prompt width) neither recompile nor re-capture."""

    require_cuda_accelerator()
    torch._dynamo.reset()  # as a process's first engine: no decode step an earlier test compiled is served
    engine = _engine(model, critic_dirs, data_cache, "--enable_hybrid_engine", "--actor_zero_stage", zero_stage,
                     "--dtype", "fp32")
    gen = engine.generator
    widths = [(PROMPTS, PROMPT_MASK), (PROMPTS[:, 1:], PROMPT_MASK[:, 1:]), (PROMPTS, PROMPT_MASK)]
    for prompts, mask in widths:
        prompts, mask = prompts.cuda(), mask.cuda()
        gen.eval()
        ours = gen.rollout(prompts, mask)
        assert gen.last_loop == "dschat-he", gen.fallback_reason
        gen.use_dschat_engine, gen.generation_loop = False, "hf"
        plain = gen.rollout(prompts, mask)
        gen.use_dschat_engine, gen.generation_loop = True, "auto"
        assert torch.equal(ours.sequences, plain.sequences)
        logp, answer_mask = _forward_logprobs(engine, ours.sequences, mask, 1.0)
        kept = answer_mask.bool()
        assert torch.allclose(ours.logprobs[kept], logp[kept], atol=1e-3), (ours.logprobs[kept] - logp[kept]).abs().max()
    he = gen.engine
    assert he.compiles_per_rollout[0] >= 1 and he.compiles_per_rollout[1:] == [0, 0], he.compiles_per_rollout
    assert he.captures >= 1 and he.weight_allocations == 1, (he.captures, he.weight_allocations)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-opt", "tiny-llama"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dschat_hybrid_engine_low_precision_agreement_is_measured(model, dtype, critic_dirs, data_cache, capsys):
    """In bf16/fp16 the engine's rounding differs from the training forward's: measure (and print) the
    share of greedy answer tokens equal to the module's generate before the first difference, and
    the largest gap between the kept log-probs and a training forward over the same rollout."""

    require_cuda_accelerator()
    engine = _engine(model, critic_dirs, data_cache, "--enable_hybrid_engine", "--actor_zero_stage", "3",
                     "--dtype", dtype)
    gen = engine.generator
    prompts, mask = PROMPTS.cuda(), PROMPT_MASK.cuda()
    gen.eval()
    ours = gen.rollout(prompts, mask)
    assert gen.last_loop == "dschat-he", gen.fallback_reason
    gen.use_dschat_engine, gen.generation_loop = False, "hf"
    plain = gen.rollout(prompts, mask)
    P = prompts.shape[1]
    a, b = ours.sequences[:, P:], plain.sequences[:, P:]
    width = min(a.shape[1], b.shape[1])
    differs = (a[:, :width] != b[:, :width]).int()
    agreeing = torch.where(differs.any(1), differs.argmax(1), torch.full_like(differs[:, 0], width))
    agreement = float(agreeing.sum()) / (width * a.shape[0])
    logp, answer_mask = _forward_logprobs(engine, ours.sequences, mask, 1.0)
    kept = answer_mask.bool()
    gap = float((ours.logprobs[kept] - logp[kept]).abs().max())
    with capsys.disabled():
        print(f"\n[{model} {dtype} ZeRO-3] dschat Hybrid Engine vs generate: greedy token agreement "
              f"{agreement:.3f} (tokens before the first difference), largest log-prob gap to the training "
              f"forward {gap:.4f}")
    assert agreement >= 0.25 and gap < 0.5, (agreement, gap)


# ------------------------------------------------------------------------------------ rollout log-probs


def _forward_logprobs(engine, seq: torch.Tensor, prompt_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """The answer tokens' log-probs from one full forward pass, computed independently of the trainer."""
    from dschat.rlhf.experience import sequence_masks

    masks = sequence_masks(prompt_mask, seq, engine.tokenizer.eos_token_id)
    module = engine.actor.module
    with torch.no_grad():
        logits = module(seq, attention_mask=masks.attention_mask, position_ids=masks.position_ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, seq[:, 1:, None]).squeeze(-1)
    P = prompt_mask.shape[1]
    return logp[:, P - 1:], masks.attention_mask[:, P:]


@pytest.mark.parametrize("model,extra,temperature", [
    ("tiny-llama", (), 1.0),
    ("tiny-opt", (), 0.7),
    ("tiny-llama", ("--actor_lora_dim", "4", "--actor_lora_module_name", "layers."), 0.7),  # LoRA fused for generation
])
def test_rollout_keeps_the_log_probs_a_forward_pass_gives(model, extra, temperature, critic_dirs, data_cache):
    from dschat.models.lora import LinearLayer_LoRA

    engine = _engine(model, critic_dirs, data_cache, "--decoding", "sample", "--temperature", str(temperature), *extra)
    for layer in engine.actor.module.modules():  # non-zero LoRA factors, so fusing them matters
        if isinstance(layer, LinearLayer_LoRA):
            torch.nn.init.normal_(layer.lora_left_weight, std=0.5)
    tok = engine.tokenizer
    rows = [tok(" Human: Tell me about kites. Assistant:")["input_ids"], tok(" Human: Hi Assistant:")["input_ids"]]
    width = max(map(len, rows))
    prompts = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    engine.generator.eval()
    torch.manual_seed(1)
    rollout = engine.generator.rollout(prompts, mask)
    assert rollout.logprobs is not None and rollout.logprobs.dtype == torch.float32
    expected, answer_mask = _forward_logprobs(engine, rollout.sequences, mask, temperature)
    assert rollout.logprobs.shape == expected.shape
    kept = answer_mask.bool()
    assert kept.sum() > 4
    assert torch.allclose(rollout.logprobs[kept], expected[kept], atol=1e-4), \
        (rollout.logprobs[kept] - expected[kept]).abs().max()
    # Turned off (the benchmark's baseline), the same seed gives the same tokens and no log-probs.
    engine.generator.keep_logprobs = False
    torch.manual_seed(1)
    plain = engine.generator.rollout(prompts, mask)
    assert plain.logprobs is None and torch.equal(plain.sequences, rollout.sequences)


def test_trainer_old_log_probs_from_the_rollout_equal_the_recomputed_ones(critic_dirs, data_cache, monkeypatch):
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    from dschat.rlhf.scoring_passes import ScoringPasses

    from transformers import LogitsProcessor, LogitsProcessorList

    engine = _engine("tiny-llama", critic_dirs, data_cache, "--decoding", "sample")
    trainer = DeepSpeedPPOTrainer(engine, engine.args)
    eos, width = engine.tokenizer.eos_token_id, PROMPTS.shape[1]

    class EndFirstRowEarly(LogitsProcessor):
        """Row 0 ends with EOS as its 3rd token, row 1 never: a pad slot follows row 0's answer."""

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            if input_ids.shape[1] == width + 2:
                scores[0] = -float("inf")
                scores[0, eos] = 0.0
            scores[1, eos] = -float("inf")
            return scores

    engine.generator.extra_generate_kwargs = {"logits_processor": LogitsProcessorList([EndFirstRowEarly()])}
    actor_passes = []
    score = ScoringPasses.token_log_probs

    def counted(self, name, *args, **kwargs):
        actor_passes[-1] += name == "actor"
        return score(self, name, *args, **kwargs)

    monkeypatch.setattr(ScoringPasses, "token_log_probs", counted)
    experiences = []
    for reuse in (True, False):
        trainer.reuse_rollout_logprobs = reuse
        actor_passes.append(0)
        torch.manual_seed(3)
        experiences.append(trainer.generate_experience(PROMPTS, PROMPT_MASK, step=0))
    assert actor_passes == [0, 1]  # the rollout's log-probs were used, then the actor scored the batch
    fast, slow = experiences
    assert torch.equal(fast.seq, slow.seq)
    start, action = fast.start, fast.action_mask[:, fast.start:].bool()
    assert action[0].sum() == 3 and action[1].sum() == fast.seq.shape[1] - width
    assert torch.allclose(fast.logprobs[:, start:][action], slow.logprobs[:, start:][action], atol=1e-4)
    assert torch.equal(fast.ref_logprobs, slow.ref_logprobs) and torch.equal(fast.values, slow.values)
    # What the PPO update sees: the per-token rewards, including upstream's reward slot after EOS
    # (its KL term uses the actor's log-prob of the first pad), and the values.
    (fast_values, fast_rewards), (slow_values, slow_rewards) = (trainer._old_values_and_rewards(e) for e in experiences)
    assert torch.allclose(fast_rewards[:, start:], slow_rewards[:, start:], atol=1e-4)
    assert torch.equal(fast_values, slow_values)


# ------------------------------------------------------------------------------------ --generation_loop graphs


def test_graphs_loop_on_a_cpu_says_why_once_and_decodes_with_dschats_loop(critic_dirs, data_cache, capsys):
    engine = _engine("tiny-llama", critic_dirs, data_cache, "--generation_loop", "graphs")
    first = _generate(engine)
    assert engine.generator.generation_loop == "dschat"
    assert torch.equal(first, _generate(engine))
    assert capsys.readouterr().out.count("--generation_loop graphs: not used (CUDA graphs need a CUDA device") == 1


@pytest.mark.parametrize("model,extra", [
    ("tiny-llama", ()),
    ("tiny-opt", ()),
    ("tiny-llama", ("--actor_zero_stage", "3", "--actor_lora_dim", "4")),  # gathered once, LoRA fused
])
def test_graphs_loop_gives_the_tokens_and_log_probs_of_generate(model, extra, critic_dirs, data_cache):
    """The static-cache path, compiled (on a CPU: inductor without CUDA graphs), with prompts padded
    to the next multiple of 64: greedy tokens equal HF generate's on the unpadded prompts, and the
    kept log-probs equal those of one forward pass over the rollout."""
    plain = _engine(model, critic_dirs, data_cache, "--generation_loop", "hf", *extra)
    expected = _generate(plain)
    engine = _engine(model, critic_dirs, data_cache, "--generation_loop", "graphs", *extra)
    engine.generator.graph_devices = ("cuda", "cpu")  # compile on this CPU (no graphs, same program)
    for _ in range(2):  # the second rollout reuses the compiled step
        engine.generator.eval()
        rollout = engine.generator.rollout(PROMPTS, PROMPT_MASK)
        assert engine.generator.generation_loop == "graphs"
        assert hasattr(engine.actor.module, "_compiled_call")  # generate took the compiled decode step
        assert torch.equal(rollout.sequences, expected), (rollout.sequences, expected)
    logp, answer_mask = _forward_logprobs(engine, rollout.sequences, PROMPT_MASK, 1.0)
    kept = answer_mask.bool()
    assert torch.allclose(rollout.logprobs[kept], logp[kept], atol=1e-4)


def test_graphs_loop_failure_falls_back_once(monkeypatch, critic_dirs, data_cache, capsys):
    expected = _generate(_engine("tiny-llama", critic_dirs, data_cache))
    engine = _engine("tiny-llama", critic_dirs, data_cache, "--generation_loop", "graphs")
    engine.generator.graph_devices = ("cuda", "cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not lower this\nsecond line")

    monkeypatch.setattr(engine.generator.path("graphs"), "generate", broken)
    assert torch.equal(_generate(engine), expected) and torch.equal(_generate(engine), expected)
    assert engine.generator.generation_loop == "dschat"
    out = capsys.readouterr().out
    assert out.count("--generation_loop graphs: CUDA graphs failed (RuntimeError: inductor could not lower this)") == 1


def test_auto_loop_on_a_cpu_is_dschats_loop_and_the_engine_where_auto_takes_it(critic_dirs, data_cache, capsys):
    """The default on a CPU: ``auto`` decodes with dschat's loop (the CPU demo's figures were measured
    with it). On a device in ``auto_engine_devices`` (none by default), ``auto`` takes dschat's Hybrid
    Engine instead, with the same tokens, and says nothing but the one rollout summary line."""
    loop = _engine("tiny-llama", critic_dirs, data_cache)
    assert loop.generator.generation_loop == "auto" and loop.generator.auto_engine_devices == ()
    expected = _generate(loop)
    assert loop.generator.last_loop == "dschat"
    engine = _engine("tiny-llama", critic_dirs, data_cache)
    assert not engine.generator.use_dschat_engine
    engine.generator.auto_engine_devices = ("cpu",)
    assert torch.equal(_generate(engine), expected) and torch.equal(_generate(engine), expected)
    assert (engine.generator.generation_loop, engine.generator.last_loop) == ("auto", "dschat-he")
    out = capsys.readouterr().out
    assert "--generation_loop" not in out and "dschat Hybrid Engine:" not in out
    assert out.count("Rollouts: dschat Hybrid Engine (eager decode step), layout llama (fused qkv, gate_up") == 1
    assert out.count("Rollouts: dschat loop (dschat.rlhf.rollout.sample_loop") == 1


def test_auto_loop_takes_graphs_where_they_apply_and_not_where_weights_are_fetched(critic_dirs, data_cache, capsys,
                                                                                   monkeypatch, tmp_path):
    """With this CPU counted as a graphs device, ``auto`` compiles (the path it takes on CUDA), and
    gives generate's greedy tokens; with ZeRO-3 weights fetched per layer it takes generate, silently.
    The compile writes its cache into dschat's private folder, not torch's /tmp default."""
    expected = _generate(_engine("tiny-llama", critic_dirs, data_cache, "--generation_loop", "hf"))
    engine = _engine("tiny-llama", critic_dirs, data_cache)
    engine.generator.graph_devices = ("cuda", "cpu")
    with monkeypatch.context() as env:
        env.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # torch's default: set at its import
        env.setenv("DSCHAT_CACHE_DIR", str(tmp_path / "cache"))  # read at the first compile
        torch._dynamo.reset()  # as a process's first compile: no graph an earlier test compiled is served
        clear_inductor_caches()  # from memory instead of the cache folder
        assert torch.equal(_generate(engine), expected)
        compiled = tmp_path / "cache" / "torch-compile"
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compiled) and compiled.stat().st_mode & 0o077 == 0
    assert any(compiled.rglob("*.py")), "inductor wrote its generated code elsewhere"
    assert (engine.generator.generation_loop, engine.generator.last_loop) == ("auto", "graphs")
    assert hasattr(engine.actor.module, "_compiled_call")

    fetched = _engine("tiny-llama", critic_dirs, data_cache, "--actor_zero_stage", "3",
                      "--zero3_gather_for_generation", "off")
    fetched.generator.graph_devices = ("cuda", "cpu")
    assert torch.equal(_generate(fetched), expected)
    assert (fetched.generator.generation_loop, fetched.generator.last_loop) == ("auto", "hf")
    assert "--generation_loop" not in capsys.readouterr().out


def test_a_compile_cache_another_account_can_write_to_is_refused_not_fallen_back_from(critic_dirs, data_cache,
                                                                                     monkeypatch, tmp_path):
    """A TORCHINDUCTOR_CACHE_DIR others can write to is a user error (one line, exit 2), not a compiler
    failure to fall back from: the rollout stops before anything is compiled."""
    planted = tmp_path / "torchinductor_victim"
    planted.mkdir()
    planted.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(planted))
    engine = _engine("tiny-llama", critic_dirs, data_cache)
    engine.generator.graph_devices = ("cuda", "cpu")
    with pytest.raises(UserError, match="TORCHINDUCTOR_CACHE_DIR .* is not safe to read on a shared machine"):
        _generate(engine)
    assert engine.generator.generation_loop == "auto" and not any(planted.iterdir())


def test_auto_loop_graphs_failure_falls_back_once(monkeypatch, critic_dirs, data_cache, capsys):
    expected = _generate(_engine("tiny-llama", critic_dirs, data_cache, "--generation_loop", "dschat"))
    engine = _engine("tiny-llama", critic_dirs, data_cache)
    engine.generator.graph_devices = ("cuda", "cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("no triton for this device")

    monkeypatch.setattr(engine.generator.path("graphs"), "generate", broken)
    assert torch.equal(_generate(engine), expected) and torch.equal(_generate(engine), expected)
    assert (engine.generator.generation_loop, engine.generator.last_loop) == ("dschat", "dschat")
    out = capsys.readouterr().out
    assert out.count("--generation_loop auto: CUDA graphs failed (RuntimeError: no triton for this device)") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-opt", "tiny-llama"])
@pytest.mark.parametrize("zero_stage", ["0", "3"])
def test_graphs_on_cuda_give_generates_tokens_and_log_probs(model, zero_stage, critic_dirs, data_cache):
    """The default loop on CUDA really captures CUDA graphs (no cudagraph skips), keeps doing so for
    a second rollout, and in fp32 gives the greedy tokens of eager generate and the log-probs of one
    forward pass over the rollout. (ZeRO-3: gathered once per rollout.)"""
    from torch._dynamo.utils import counters


    require_cuda_accelerator()
    prompts, mask = PROMPTS.cuda(), PROMPT_MASK.cuda()
    extra = ("--actor_zero_stage", zero_stage, "--dtype", "fp32")
    plain = _engine(model, critic_dirs, data_cache, "--generation_loop", "hf", *extra)
    plain.generator.eval()
    expected = plain.generator.generate(prompts, mask)
    engine = _engine(model, critic_dirs, data_cache, *extra)
    skips_before = counters["inductor"]["cudagraph_skips"]
    for _ in range(2):
        engine.generator.eval()
        rollout = engine.generator.rollout(prompts, mask)
        assert engine.generator.last_loop == "graphs", engine.generator.generation_loop
        assert torch.equal(rollout.sequences, expected), (rollout.sequences, expected)
    assert counters["inductor"]["cudagraph_skips"] == skips_before
    logp, answer_mask = _forward_logprobs(engine, rollout.sequences, mask, 1.0)
    kept = answer_mask.bool()
    assert torch.allclose(rollout.logprobs[kept], logp[kept], atol=1e-3), (rollout.logprobs[kept] - logp[kept]).abs().max()


# ------------------------------------------------------------------------------------ exact LoRA unfuse


def _base_weights(layers) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per LoRA layer: (full base weight, ZeRO-3 partition or None), copied."""
    import deepspeed

    out = []
    for layer in layers:
        w = layer.weight
        zero3 = hasattr(w, "ds_id")
        with deepspeed.zero.GatheredParameters([w], modifier_rank=None, enabled=zero3):
            full = w.detach().clone()
        out.append((full, w.ds_tensor.detach().clone() if zero3 else None))
    return out


@pytest.mark.parametrize("dtype,zero_stage,gather,persistence", [
    ("fp32", "0", "auto", None),
    ("bf16", "0", "auto", None),
    ("fp32", "3", "on", None),  # tiny weights stay gathered (persistent): the gathered tensor is the partition
    ("bf16", "3", "on", 0),  # every weight partitioned, gathered once per rollout
    ("bf16", "3", "off", 0),  # fetched per layer and token: not fused
])
def test_rollouts_leave_the_frozen_lora_base_weights_bit_identical(dtype, zero_stage, gather, persistence, monkeypatch,
                                                                  critic_dirs, data_cache):
    """Fusing LoRA for every rollout and unfusing after, with LoRA factors that change between rollouts
    (as training changes them), leaves every frozen base weight -- and under ZeRO-3 its partition --
    bit for bit as it was. Upstream's add-then-subtract moved ~27% of the bf16 entries in 5 rollouts
    (on one rank under ZeRO-3 too: the "gathered" tensor there is the partition itself)."""
    import deepspeed

    import dschat.runtime.ds_config as ds_utils
    from dschat.models.lora import LinearLayer_LoRA

    if persistence is not None:  # partition even the tiny test weights
        original = ds_utils.get_train_ds_config

        def config(*args, **kwargs):
            cfg = original(*args, **kwargs)
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
            return cfg

        monkeypatch.setattr(ds_utils, "get_train_ds_config", config)
    fused = {"n": 0}
    real_fuse = LinearLayer_LoRA.fuse_lora_weight

    def counting_fuse(self):
        fused["n"] += 1
        return real_fuse(self)

    monkeypatch.setattr(LinearLayer_LoRA, "fuse_lora_weight", counting_fuse)
    engine = _engine("tiny-llama", critic_dirs, data_cache, "--dtype", dtype, "--actor_lora_dim", "4",
                     "--actor_zero_stage", zero_stage, "--zero3_gather_for_generation", gather)
    module = engine.actor.module
    layers = [m for m in module.modules() if isinstance(m, LinearLayer_LoRA)]
    assert layers and hasattr(layers[0].weight, "ds_id") == (zero_stage == "3")

    def change_lora(std: float) -> None:  # what an optimizer step does to the factors, on every rank
        for layer in layers:
            factors = [layer.lora_left_weight, layer.lora_right_weight]
            with deepspeed.zero.GatheredParameters(factors, modifier_rank=0, enabled=zero_stage == "3"):
                with torch.no_grad():
                    layer.lora_left_weight.add_(torch.randn_like(layer.lora_left_weight) * std)
                    layer.lora_right_weight.add_(torch.randn_like(layer.lora_right_weight) * std * 0.1)

    change_lora(0.05)  # a trained-looking delta (left starts at zero)
    before = _base_weights(layers)
    for i in range(6):
        engine.generator.eval()
        rollout = engine.generator.rollout(PROMPTS, PROMPT_MASK)
        if dtype == "fp32" and i in (0, 5):  # the fused weights gave the LoRA model's tokens (in bf16 the
            # fused weight is W + delta rounded to bf16, which moves the logits enough to change them)
            with torch.no_grad():
                unfused = type(module).generate(module, PROMPTS, attention_mask=PROMPT_MASK, max_new_tokens=16,
                                                do_sample=False, pad_token_id=3, eos_token_id=2,
                                                synced_gpus=zero_stage == "3")
            assert torch.equal(rollout.sequences, unfused)
        change_lora(0.01)
    assert not any(layer.fuse_lora for layer in layers)
    assert (fused["n"] > 0) == (gather != "off")  # per-layer ZeRO-3 fetching leaves LoRA unfused
    for (w0, p0), (w1, p1) in zip(before, _base_weights(layers)):
        assert torch.equal(w0, w1)
        assert p0 is None or torch.equal(p0, p1)


class _PlainEngine:
    """What RolloutGenerator uses of a DeepSpeed engine (``.module``), around a plain module."""

    def __init__(self, module):
        self.module = module


def test_a_checkpoints_generation_config_does_not_shape_the_rollouts():
    """A generation_config.json with repetition_penalty / no_repeat_ngram_size: HF generate (and the
    Hybrid Engine's, which calls it) decode with the rollout settings only, like dschat's loop."""
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama")).eval()
    model.generation_config.repetition_penalty = 1.5
    model.generation_config.no_repeat_ngram_size = 2
    theirs = model.generation_config
    gen = RolloutGenerator(_PlainEngine(model), tok, decision=HybridEngineDecision(False, False),
                           decoding=DecodingSettings("greedy"), max_answer_seq_len=24, zero_stage=0)
    rollouts = {}
    for loop in ("dschat", "hf"):
        gen.generation_loop = loop
        rollouts[loop] = gen.rollout(PROMPTS, PROMPT_MASK)
    assert torch.equal(rollouts["hf"].sequences, rollouts["dschat"].sequences)
    assert torch.allclose(rollouts["hf"].logprobs, rollouts["dschat"].logprobs, atol=1e-5)
    assert model.generation_config is theirs and theirs.repetition_penalty == 1.5  # put back
    # The checkpoint's settings do change this model's greedy answer (so the test can fail).
    with torch.no_grad():
        penalised = model.generate(PROMPTS, attention_mask=PROMPT_MASK, max_new_tokens=24, do_sample=False,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert not torch.equal(penalised, rollouts["dschat"].sequences)

    # The Hybrid Engine path: DeepSpeed's generate, installed on the module, reads the same attribute.
    seen = []

    def hybrid_engine_generate(prompts, **kwargs):
        seen.append(model.generation_config)
        return type(model).generate(model, prompts, **kwargs)

    he = _PlainEngine(model)
    he._inference_containers = ["container"]
    model.generate = hybrid_engine_generate
    he_gen = RolloutGenerator(he, tok, decision=HybridEngineDecision(True, True),
                              decoding=DecodingSettings("greedy"), max_answer_seq_len=24, zero_stage=0)
    assert he_gen.hybrid_engine_active
    assert torch.equal(he_gen.rollout(PROMPTS, PROMPT_MASK).sequences, rollouts["dschat"].sequences)
    assert seen[0].repetition_penalty is None and seen[0].no_repeat_ngram_size is None
    assert seen[0].eos_token_id == theirs.eos_token_id and model.generation_config is theirs


def test_dschat_engine_asked_for_a_family_it_does_not_cover_falls_back_in_one_line(capsys):
    """``use_dschat_engine`` set on the generator (benchmarks/step3.py's engine modes do) for a family
    outside the decode model's table: the module path decodes, after one line saying why."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from dschat.models.decoder.layouts import unsupported_reason
    from dschat.models.tokenizer import load_hf_tokenizer
    from dschat.rlhf.rollout.dschat_engine import ENGINE_NAME

    torch.manual_seed(0)
    tok = load_hf_tokenizer("tiny-llama")
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=len(tok),
                                                        n_positions=128, bos_token_id=tok.bos_token_id,
                                                        eos_token_id=tok.eos_token_id)).eval()
    gen = RolloutGenerator(_PlainEngine(model), tok, decision=HybridEngineDecision(False, False),
                           decoding=DecodingSettings("greedy"), max_answer_seq_len=4, zero_stage=0)
    plain = gen.rollout(PROMPTS, PROMPT_MASK).sequences
    gen.use_dschat_engine = True
    assert torch.equal(gen.rollout(PROMPTS, PROMPT_MASK).sequences, plain) and gen.last_loop == "dschat"
    assert gen.engine is None and gen.fallback is not None and gen.fallback.path == "dschat-he"
    assert gen.fallback.reason == (f"{ENGINE_NAME}: not used ({unsupported_reason(model.config)}); "
                                   "decoding with the training module")
    assert capsys.readouterr().out.count(gen.fallback.reason) == 1


def test_decoding_settings_generation_config_holds_only_the_rollout_settings():
    from transformers import GenerationConfig

    model_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 7], pad_token_id=3, temperature=0.6,
                                    top_p=0.9, repetition_penalty=1.3, min_p=0.1, typical_p=0.5)
    cfg = DecodingSettings("sample", 0.7, 5, 0.95).generation_config(model_config)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, [2, 7], 3)
    assert (cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p) == (True, 0.7, 5, 0.95)
    assert cfg.min_p is None and cfg.typical_p is None and cfg.repetition_penalty == 1.0
    greedy = DecodingSettings("greedy").generation_config(None)
    assert greedy.do_sample is False and greedy.temperature is None and greedy.eos_token_id is None


def test_rollouts_leave_4bit_lora_layers_unfused_and_quantized():
    """Fusing a QLoRA layer needs its dense weight (for good, or for every layer at once): rollouts run
    those layers unfused instead, and give the LoRA model's tokens."""
    from transformers import AutoModelForCausalLM

    from dschat.models.lora import LinearLayer_LoRA, convert_linear_layer_to_lora
    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    torch.manual_seed(0)
    tok = load_hf_tokenizer("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama")).eval()
    convert_linear_layer_to_lora(model, "layers.", 4, quantize_base="nf4")
    layers = [m for m in model.modules() if isinstance(m, LinearLayer_LoRA)]
    for layer in layers:
        torch.nn.init.normal_(layer.lora_left_weight, std=0.5)
    codes = [layer.weight.detach().clone() for layer in layers]
    gen = RolloutGenerator(_PlainEngine(model), tok, decision=HybridEngineDecision(False, False),
                           decoding=DecodingSettings("greedy"), max_answer_seq_len=8, zero_stage=0)
    seq = gen.generate(PROMPTS, PROMPT_MASK)
    assert all(layer.is_quantized and not layer.fuse_lora for layer in layers)
    assert all(torch.equal(layer.weight, c) for layer, c in zip(layers, codes))
    with torch.no_grad():
        expected = type(model).generate(model, PROMPTS, attention_mask=PROMPT_MASK, max_new_tokens=8, do_sample=False,
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert torch.equal(seq, expected)
