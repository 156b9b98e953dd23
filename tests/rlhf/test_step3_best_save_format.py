"""Step 3's best models (``--save_best_by``) are written in ``--save_format``, as the final models are:
``--save_format bin`` gives ``pytorch_model.bin`` in ``best/actor`` and ``best/critic`` too."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from dschat.models.build import create_critic_model, create_hf_model
from dschat.models.tokenizer import load_hf_tokenizer
from dschat.rlhf.heldout.setup import Judge
from dschat.rlhf.heldout import evaluation as ev
from dschat.rlhf.heldout.best import save_best


@pytest.mark.parametrize("save_format,files", [
    ("bin", {"pytorch_model.bin"}),
    ("both", {"pytorch_model.bin", "model.safetensors"}),
    ("safetensors", {"model.safetensors"}),
])
def test_best_models_are_saved_in_the_save_format(tmp_path, save_format, files):
    tok = load_hf_tokenizer("tiny-opt")
    torch.manual_seed(0)
    models = {"actor": create_hf_model(AutoModelForCausalLM, "tiny-opt", tok),
              "critic": create_critic_model("tiny-opt", tok, None)}
    save_best(tmp_path, models, tok, {"step": 1, "by": "proxy", "score": 0.5}, 0, save_format)
    for name in models:
        weights = {p.name for p in (tmp_path / "best" / name).iterdir() if p.suffix in (".bin", ".safetensors")}
        assert weights - {"v_head.safetensors"} == files, name


def test_the_evaluation_passes_the_runs_save_format(tmp_path, monkeypatch):
    formats = []
    monkeypatch.setattr(ev, "save_best", lambda *args, save_format="safetensors": formats.append(save_format))
    args = SimpleNamespace(eval_interval=1, eval_alarm_sigmas=2.0, save_best_by="judge", output_dir=str(tmp_path),
                           stop_on_overoptimization=False, save_format="bin")
    trainer = SimpleNamespace(prompt_columns=object(), tokenizer=None,
                              rlhf_engine=SimpleNamespace(actor=object(), critic=None, actor_ema=None))
    evaluation = ev.StepThreeEvaluation(args, trainer, [], [Judge("j", fn=object())])
    rows = ev._Rows([0], [0.0], {"j": [1.0]}, [0.0], [0.0], [1], [True])
    monkeypatch.setattr(evaluation, "_evaluate_shard", lambda: rows)
    assert evaluation.maybe_evaluate(0)["new_best"] and formats == ["bin"]
