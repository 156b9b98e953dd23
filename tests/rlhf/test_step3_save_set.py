"""Step 3 saves ``actor/``, ``critic/`` and ``actor_ema/`` as one set: each folder is saved atomically,
and a marker in ``--output_dir`` names the set from before the first save to after the last. A run
stopped between its folders (a kill, a full disk on the critic) leaves the marker, and every folder
of the set is refused as a model in one line (they may hold models of two runs: the new actor beside
an earlier run's critic and EMA actor); the next run into that folder saves them together again."""
from __future__ import annotations

import pytest

from dschat.errors import UserError
from dschat.models import save as model_save
from dschat.models.registry import resolve_model_path
from dschat.runtime.inplace import SET_MARKER, mark_set, unfinished_set, unmark_set

from helpers.step3 import base_argv, step3_main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_marker_names_the_folders_of_the_set_and_nothing_else(tmp_path, monkeypatch):
    out = tmp_path / "out"
    mark_set(out, ["actor", "critic"])
    assert unfinished_set(out / "actor") == out / SET_MARKER == unfinished_set(out / "critic")
    assert unfinished_set(out / "best") is None and unfinished_set(tmp_path / "other" / "actor") is None
    (out / "actor").mkdir()
    (tmp_path / "link").symlink_to(out / "actor")  # a link to it, or "." inside it, is the same folder
    assert unfinished_set(tmp_path / "link") == out / SET_MARKER
    monkeypatch.chdir(out / "actor")
    assert unfinished_set(".") == out / SET_MARKER
    (out / SET_MARKER).write_text("{not json")  # unreadable: every folder beside it is suspect
    assert unfinished_set(out / "best") == out / SET_MARKER
    unmark_set(out)
    assert unfinished_set(out / "actor") is None and not (out / SET_MARKER).exists()


def test_a_save_stopped_between_the_folders_leaves_them_refused_until_a_run_saves_them_together(
        critic_dirs, data_cache, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = base_argv("tiny-opt", critic_dirs["tiny-opt"], data_cache, "--output_dir", str(out), "--enable_ema", steps=1)
    step3_main().main(argv)
    assert not (out / SET_MARKER).exists()
    resolve_model_path(str(out / "actor"))  # a finished set loads

    saved = model_save.save_hf_model

    def disk_full_on_the_critic(model, tokenizer, folder, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if folder.name == "critic":
            raise UserError(f"no space left on the device of {folder}")
        return saved(model, tokenizer, folder, *args, **kwargs)

    monkeypatch.setattr(model_save, "save_hf_model", disk_full_on_the_critic)
    with pytest.raises(UserError, match="no space left"):
        step3_main().main(argv + ["--seed", "7"])
    assert (out / SET_MARKER).exists()  # the new actor/ beside the first run's critic/ and actor_ema/
    for name in ("actor", "critic", "actor_ema"):
        with pytest.raises(UserError, match=rf"^{out / name} is one of the models a save into {out} did not finish "
                                            rf"\({SET_MARKER} is there: it stopped between its folders"):
            resolve_model_path(str(out / name))
    monkeypatch.undo()
    step3_main().main(argv)  # the next run saves the set together
    assert not (out / SET_MARKER).exists()
    for name in ("actor", "critic", "actor_ema"):
        resolve_model_path(str(out / name))


def test_a_marker_that_cannot_be_written_stops_before_any_model_is_saved(tmp_path):
    """Rank 0 cannot write the marker (its folder is a file here): every rank learns it (one
    all-reduce) and raises before the body, so none waits for the others at a barrier."""
    (tmp_path / "out").write_text("a file where the output folder should be")
    entered = []
    with pytest.raises(OSError):
        with model_save.saving_together(tmp_path / "out", ["actor"], rank=0):
            entered.append(True)
    assert entered == []
