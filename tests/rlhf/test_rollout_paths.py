"""The rollout generator asks its decoding paths in a fixed order: a path that refuses hands the rollout
to the next, the summary line names the path that served and the reasons of those before it, and a
fallback (a path asked for that stops serving) is recorded once, as the latest one."""
from __future__ import annotations

import pytest
import torch

from dschat.rlhf.rollout.deepspeed_engine import HybridEngineDecision
from dschat.rlhf.rollout.generator import PATH_ORDER, RolloutGenerator
from dschat.rlhf.rollout.path import Fallback
from dschat.rlhf.rollout.sampling import DecodingSettings

PROMPTS = torch.tensor([[3, 1, 40, 41], [1, 42, 43, 44]])  # tiny-llama ids: pad 3, bos 1
PROMPT_MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])


class _PlainEngine:
    """What RolloutGenerator uses of a DeepSpeed engine (``.module``), around a plain module."""

    def __init__(self, module):
        self.module = module


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM

    from dschat.models.registry import resolve_model_path
    from dschat.models.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer("tiny-llama")
    return AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama")).eval(), tok


def _generator(model_and_tokenizer, decision=HybridEngineDecision(False, False), **kwargs) -> RolloutGenerator:
    model, tok = model_and_tokenizer
    return RolloutGenerator(_PlainEngine(model), tok, decision=decision, decoding=DecodingSettings("greedy"),
                            max_answer_seq_len=6, zero_stage=0, **kwargs)


def _generate_expected(model_and_tokenizer) -> torch.Tensor:
    model, tok = model_and_tokenizer
    with torch.no_grad():
        return type(model).generate(model, PROMPTS, attention_mask=PROMPT_MASK, max_new_tokens=6, do_sample=False,
                                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def test_the_paths_are_asked_in_a_fixed_order(model_and_tokenizer):
    gen = _generator(model_and_tokenizer)
    assert [path.name for path in gen.paths] == ["dschat-he-tp", "dschat-he", "hybrid-engine", "graphs", "dschat", "hf"]
    assert [type(path) for path in gen.paths] == list(PATH_ORDER)
    assert [path.on_module for path in gen.paths] == [False, False, False, True, True, True]


def test_a_refusing_path_hands_the_rollout_to_the_next_and_the_summary_says_why(model_and_tokenizer, capsys):
    expected = _generate_expected(model_and_tokenizer)
    gen = _generator(model_and_tokenizer, generation_loop="hf")
    assert torch.equal(gen.generate(PROMPTS, PROMPT_MASK), expected)
    assert gen.last_loop == "hf" and gen.fallback is None  # chosen by a flag: not a fallback
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("Rollouts: hf (the training module's generate), layout llama (the training module's) [after ")
    assert "dschat-he: no --enable_hybrid_engine" in line and "hybrid-engine: no --enable_hybrid_engine" in line
    assert "graphs: generation loop 'hf'; dschat: generation loop 'hf']" in line
    assert line.endswith(", dtype float32, inference TP degree 1")
    # Asked in that order: the dschat loop serves once the flag lets it.
    gen.generation_loop = "auto"
    assert torch.equal(gen.generate(PROMPTS, PROMPT_MASK), expected) and gen.last_loop == "dschat"
    assert gen.summary_line().startswith("Rollouts: dschat loop (dschat.rlhf.rollout.sample_loop on the training module)")
    assert "graphs: CUDA graphs need a CUDA device, the actor is on 'cpu']" in gen.summary_line()


def test_an_asked_path_that_cannot_serve_is_one_fallback_record_said_once(model_and_tokenizer, capsys):
    expected = _generate_expected(model_and_tokenizer)
    gen = _generator(model_and_tokenizer, generation_loop="graphs")
    said = ("--generation_loop graphs: not used (CUDA graphs need a CUDA device, the actor is on 'cpu'); decoding with "
            "dschat's loop, or Hugging Face generate() where that loop cannot serve")  # (ZeRO-3 fetched layer by layer)
    for _ in range(2):
        assert torch.equal(gen.generate(PROMPTS, PROMPT_MASK), expected)
        assert gen.fallback == Fallback("graphs", said) and gen.fallback_reason == said
        assert (gen.generation_loop, gen.last_loop) == ("dschat", "dschat")
    out = capsys.readouterr().out
    assert out.count(said) == 1 and out.count("Rollouts: dschat loop") == 1
    assert "graphs: CUDA graphs need a CUDA device, the actor is on 'cpu']" in out


def test_a_failing_path_falls_back_to_the_next_unless_out_of_memory(model_and_tokenizer, monkeypatch, capsys):
    expected = _generate_expected(model_and_tokenizer)
    gen = _generator(model_and_tokenizer)
    gen.graph_devices = ("cuda", "cpu")  # graphs would serve on this CPU
    graphs = gen.path("graphs")

    def out_of_memory(request):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(graphs, "generate", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        gen.generate(PROMPTS, PROMPT_MASK)
    assert gen.fallback is None and gen.generation_loop == "auto"

    def compiler_failure(request):
        raise RuntimeError("inductor could not lower this\nsecond line")

    monkeypatch.setattr(graphs, "generate", compiler_failure)
    assert torch.equal(gen.generate(PROMPTS, PROMPT_MASK), expected) and gen.last_loop == "dschat"
    said = ("--generation_loop auto: CUDA graphs failed (RuntimeError: inductor could not lower this); "
            "decoding with dschat's loop (or Hugging Face generate() where that loop cannot serve) from now on")
    assert gen.fallback == Fallback("graphs", said)
    assert "graphs: failed (RuntimeError), off for the rest of the run]" in gen.summary_line()
    assert torch.equal(gen.generate(PROMPTS, PROMPT_MASK), expected)  # graphs is not asked again
    assert "graphs: generation loop 'dschat']" in gen.summary_line()
    assert capsys.readouterr().out.count(said) == 1


def test_a_hybrid_engine_decision_that_falls_back_is_the_record(model_and_tokenizer, capsys):
    reason = "--enable_hybrid_engine: DeepSpeed's Hybrid Engine needs CUDA inference kernels; generating with the module"
    gen = _generator(model_and_tokenizer, decision=HybridEngineDecision(True, False, reason))
    assert gen.fallback == Fallback("hybrid-engine", reason)
    gen.generate(PROMPTS, PROMPT_MASK)
    assert f"hybrid-engine: {reason.removeprefix('--enable_hybrid_engine: ')}" in gen.summary_line()
    assert capsys.readouterr().out.count(reason) == 1  # the notice, once; the summary gives the reason alone
