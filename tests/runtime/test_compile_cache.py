"""torch.compile's cache is a folder of the user's own (dschat.runtime.compile_cache): torch's default,
``/tmp/torchinductor_<user>``, is a folder another account can create first and fill with code a compile
loads. Step 3's compiles are checked to write where this module points (tests/rlhf/test_step3_hybrid_engine.py)."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch._inductor.config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from dschat.errors import UserError
from dschat.runtime.compile_cache import COMPILE_CACHE_ENV, compile_cache_dir, use_private_compile_cache


@pytest.fixture
def clean_env(monkeypatch, tmp_path) -> Iterator[Path]:
    """No cache variable set, dschat's cache under ``tmp_path/cache``; inductor's header switch restored."""
    for var in COMPILE_CACHE_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(tmp_path / "cache"))
    with inductor_config.patch(cpp_cache_precompile_headers=inductor_config.cpp_cache_precompile_headers):
        yield tmp_path / "cache"


def test_the_default_is_a_private_folder_in_dschats_cache_and_inductor_uses_it(clean_env):
    folder = use_private_compile_cache()
    assert folder == compile_cache_dir() == clean_env / "torch-compile"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert Path(inductor_cache_dir()) == folder  # where inductor writes and reads its files
    assert use_private_compile_cache() == folder  # a second call changes nothing


def test_torchs_own_default_in_the_variable_is_replaced(clean_env, monkeypatch):
    """torch writes its /tmp default into TORCHINDUCTOR_CACHE_DIR when torch._dynamo is imported: that
    is not the user naming a folder."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert use_private_compile_cache() == clean_env / "torch-compile"
    assert Path(inductor_cache_dir()) == clean_env / "torch-compile"


@pytest.mark.parametrize("var", COMPILE_CACHE_ENV)
def test_a_named_folder_others_can_write_to_is_refused_in_one_line(clean_env, tmp_path, monkeypatch, var):
    planted = tmp_path / "torchinductor_victim"
    planted.mkdir()
    planted.chmod(0o777)  # how /tmp/torchinductor_<user> looks when another account made it first
    monkeypatch.setenv(var, str(planted))
    with pytest.raises(UserError) as err:
        use_private_compile_cache()
    message = str(err.value)
    assert message.startswith(f"{var} {planted} is not safe to read on a shared machine: its group and others can write")
    assert "point it at a folder of your own, or unset it" in message and "\n" not in message


def test_a_named_folder_reached_through_a_link_others_can_swap_is_refused(clean_env, tmp_path, monkeypatch):
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "link").symlink_to(own)  # the folder is the user's; the link anyone could point elsewhere
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared / "link"))
    with pytest.raises(UserError, match=f"^TORCHINDUCTOR_CACHE_DIR {shared / 'link'} is not safe to read on a "
                                        f"shared machine: .* the folder {shared} holding or above the symbolic link"):
        use_private_compile_cache()


def test_a_named_folder_of_ones_own_is_kept_and_a_missing_one_made_private(clean_env, tmp_path, monkeypatch):
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(own))
    assert use_private_compile_cache() == own and stat.S_IMODE(own.stat().st_mode) == 0o755
    later = tmp_path / "later" / "cache"  # torch would make it with the umask, where another could come first
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(later))
    assert use_private_compile_cache() == later
    assert stat.S_IMODE(later.stat().st_mode) == stat.S_IMODE(later.parent.stat().st_mode) == 0o700
    assert not clean_env.exists()


def test_tritons_folder_inside_inductors_is_not_held_to_the_rule_twice(clean_env, monkeypatch):
    """After a compile inductor sets TRITON_CACHE_DIR to a subfolder it made with the umask (group-writable
    under umask 002): a second call, say a benchmark's next mode, must not refuse it."""
    folder = use_private_compile_cache()
    triton = folder / "triton" / "0"
    triton.mkdir(parents=True)
    triton.chmod(0o777)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    assert use_private_compile_cache() == folder


def test_dschats_cache_folder_itself_must_be_the_users_own(clean_env):
    (clean_env / "torch-compile").mkdir(parents=True)
    (clean_env / "torch-compile").chmod(0o777)  # DSCHAT_CACHE_DIR on a shared disk, made by another
    with pytest.raises(UserError, match="torch.compile's cache folder .* its group and others can write"):
        use_private_compile_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_headers_are_not_precompiled_into_a_default_folder_another_account_made(clean_env, tmp_path, monkeypatch):
    """torch 2.13 precompiles C++ headers under its /tmp default whatever the variable says."""
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))  # torch's default is <tempdir>/torchinductor_<user>
    inductor_config.cpp_cache_precompile_headers = True
    use_private_compile_cache()  # the default folder does not exist: nobody's own yet
    assert inductor_config.cpp_cache_precompile_headers is False
    inductor_config.cpp_cache_precompile_headers = True
    Path(default_cache_dir()).mkdir(mode=0o700)
    use_private_compile_cache()  # the user's own: headers stay on
    assert inductor_config.cpp_cache_precompile_headers is True
    Path(default_cache_dir()).chmod(0o777)
    use_private_compile_cache()
    assert inductor_config.cpp_cache_precompile_headers is False


def test_a_folder_that_cannot_be_made_is_one_line(clean_env, tmp_path, monkeypatch):
    """Not a traceback, nor (on the rollout's paths) a compile failure to fall back from."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(UserError, match=r"^TORCHINDUCTOR_CACHE_DIR .*/file is not a folder; point it at"):
        use_private_compile_cache()
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with pytest.raises(UserError, match=r"^torch.compile's cache folder .* cannot be created \(Not a directory\); "
                                        "set DSCHAT_CACHE_DIR"):
        use_private_compile_cache()
