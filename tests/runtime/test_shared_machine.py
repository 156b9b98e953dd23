"""Safe on a shared machine: a folder, cache file or lock is trusted only when this user owns it and
nobody else can write to it (dschat.runtime.fs), and the tokenised-data cache is private by default.

Another account is simulated two ways: a folder group or others can write to, or ``os.stat`` reporting
another owner for one path (the suite may run as one user). Where the tests run as root and
``setpriv`` exists, a real second uid (65534, "nobody") plants the files as well. Root can read and
write anything, so there it is the ownership check that must refuse.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from dschat.data import cache as data_cache
from dschat.data.cache import cache_files
from dschat.data.prompt_dataset import create_prompt_dataset
from dschat.errors import UserError
from dschat.paths import data_cache_dir
from dschat.runtime import fs, trust

from helpers.data import make_tokenizer, pref_rows, write_jsonl

OTHER_UID = 65534  # "nobody"
SETPRIV = shutil.which("setpriv")
needs_second_uid = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None,
    reason="planting files as a real second user needs root and setpriv (util-linux); the simulated cases cover it",
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid (chown) needs root; "
                                "the simulated cases cover it")


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def fake_owner(monkeypatch: pytest.MonkeyPatch, *paths: Path, uid: int = OTHER_UID) -> None:
    """Make ``os.stat`` report ``uid`` as the owner of ``paths`` (another account's files)."""
    real = os.stat
    targets = {os.fspath(p) for p in paths}

    def stat_(path, *args, **kwargs):
        info = real(path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and os.fspath(path) in targets:
            fields = list(info)
            fields[stat.ST_UID] = uid
            return os.stat_result(fields)
        return info

    monkeypatch.setattr(os, "stat", stat_)


def as_other_user(script: str) -> None:
    """Run ``sh -c script`` as uid/gid 65534 with no supplementary groups."""
    subprocess.run([SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "sh", "-c", script],
                   check=True, capture_output=True, timeout=60)


# ------------------------------------------------------------------------------------------------ the helper


def test_own_folder_and_file_are_trusted(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "f").chmod(0o644)
    assert trust.untrusted_reason(tmp_path) is None and trust.is_trusted(tmp_path / "f")
    trust.check_trusted(tmp_path / "f", "file", "fix it")  # no error
    assert not trust.is_trusted(tmp_path / "missing")


@pytest.mark.parametrize("mode,who", [(0o770, "its group can write"), (0o707, "other users can write"),
                                      (0o777, "its group and others can write")])
def test_writable_by_group_or_others_is_not_trusted(tmp_path, monkeypatch, mode, who):
    monkeypatch.setattr(trust, "_private_group", lambda gid, uid: False)  # a group others belong to
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    assert who in trust.untrusted_reason(folder)
    with pytest.raises(UserError, match=f"--x {folder} is not safe to read on a shared machine: {who} .*; do this"):
        trust.check_trusted(folder, "--x", "do this")


def test_group_write_is_fine_when_the_group_is_the_users_private_one(tmp_path, monkeypatch):
    # Debian/Ubuntu give every user a private group and umask 002: a clone or cache folder is 0775.
    folder = tmp_path / "mine"
    folder.mkdir()
    folder.chmod(0o775)
    monkeypatch.setattr(trust, "_private_group", lambda gid, uid: gid == folder.stat().st_gid and uid == os.geteuid())
    assert trust.untrusted_reason(folder) is None
    folder.chmod(0o777)  # others too: never
    assert "its group and others can write" in trust.untrusted_reason(folder)


def test_a_private_group_has_no_other_member(monkeypatch):
    import grp
    import pwd
    from types import SimpleNamespace

    def user(name, uid, gid):
        return pwd.struct_passwd((name, "x", uid, gid, "", f"/home/{name}", "/bin/sh"))

    def group(name, gid, *members):
        return grp.struct_group((name, "x", gid, list(members)))

    def accounts(users, groups):  # a made-up passwd and group database, as trust looks them up
        by_uid, by_gid = {u.pw_uid: u for u in users}, {g.gr_gid: g for g in groups}
        monkeypatch.setattr(trust, "pwd", SimpleNamespace(getpwuid=lambda uid: by_uid[uid],
                                                          getpwall=lambda: list(users)))
        monkeypatch.setattr(trust, "grp", SimpleNamespace(getgrgid=lambda gid: by_gid[gid]))

    ann, bob = user("ann", 2001, 2001), user("bob", 2002, 2002)
    accounts([ann, bob], [group("ann", 2001, "ann"), group("bob", 2002)])
    assert trust._private_group(2001, 2001)
    assert not trust._private_group(2002, 2001)  # another user's private group
    assert not trust._private_group(2001, 4242)  # a uid with no account here
    assert not trust._private_group(4242, 2001)  # a gid with no group here
    accounts([ann, bob], [group("ann", 2001, "ann", "bob"), group("bob", 2002)])
    assert not trust._private_group(2001, 2001)  # another member
    accounts([ann, user("bob", 2002, 2001)], [group("ann", 2001)])
    assert not trust._private_group(2001, 2001)  # another account's primary group
    accounts([ann], [group("staff", 2001)])
    assert not trust._private_group(2001, 2001)  # not named after the user
    accounts([user("ann", 2001, 100)], [group("ann", 2001), group("users", 100)])
    assert not trust._private_group(2001, 2001)  # not the user's primary group


def test_another_owner_is_not_trusted_even_when_this_process_can_write(tmp_path, monkeypatch):
    target = tmp_path / "planted"
    target.write_text("x")
    target.chmod(0o600)
    fake_owner(monkeypatch, target)
    assert os.access(target, os.W_OK)  # permissions alone would let it through
    assert f"uid {OTHER_UID}), not to you" in trust.untrusted_reason(target)
    assert not trust.is_trusted(target)


def test_a_symlink_is_judged_by_its_target(tmp_path):
    target = tmp_path / "open"
    target.mkdir()
    target.chmod(0o777)
    (tmp_path / "link").symlink_to(target)
    assert not trust.is_trusted(tmp_path / "link")


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_folder_above_that_others_can_write_to_makes_the_path_untrusted(tmp_path, monkeypatch, mode):
    """OpenSSH's StrictModes: whoever can write to a folder above a path can rename the path away and
    put their own in its place, so the user's own 0700 folder inside it is not trusted either."""
    monkeypatch.setattr(trust, "_private_group", lambda gid, uid: False)
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(mode)
    mine = team / "me" / "cache"
    mine.mkdir(parents=True, mode=0o700)
    (mine / "f").write_text("x")
    for path in (mine, mine / "f", team / "me"):
        reason = trust.untrusted_reason(path)
        assert reason is not None and f"can write to the folder {team} above it (mode {mode:04o})" in reason, reason
        assert not trust.is_trusted(path)
    with pytest.raises(UserError, match=f"--x {mine} is not safe to read on a shared machine: .* the folder {team} "
                                        "above it"):
        trust.check_trusted(mine, "--x", "do this")
    # A link from a safe place into it is judged where it leads.
    (tmp_path / "link").symlink_to(mine)
    assert not trust.is_trusted(tmp_path / "link")
    # The user's private group writing to the folder above is fine, as for the path itself.
    team.chmod(0o775)
    monkeypatch.setattr(trust, "_private_group", lambda gid, uid: True)
    assert trust.untrusted_reason(mine) is None


def test_a_sticky_folder_above_is_fine_when_the_next_folder_down_is_the_users(tmp_path, monkeypatch):
    """/tmp and /dev/shm are writable by all but sticky: only an entry's owner can rename it."""
    sticky = tmp_path / "scratch"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine = sticky / "me" / "out"
    mine.mkdir(parents=True, mode=0o700)
    (sticky / "me").chmod(0o700)
    assert trust.untrusted_reason(mine) is None and trust.untrusted_reason(sticky / "me") is None
    fake_owner(monkeypatch, sticky / "me")  # another account's folder in the sticky one: it may swap "out"
    assert f"the folder {sticky / 'me'} above it belongs to" in trust.untrusted_reason(mine)


def test_a_symlink_in_a_folder_others_can_write_to_is_not_trusted_whatever_it_points_to(tmp_path):
    """Whoever can write to the folder holding a link can point it elsewhere: a link to the user's own
    private folder is only as safe as that folder, and so is a path through such a link."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "link").symlink_to(mine)
    (mine / "cache").mkdir(mode=0o700)
    for path in (shared / "link", shared / "link" / "cache", shared / "link" / "cache" / ".." / "cache"):
        reason = trust.untrusted_reason(path)
        assert reason is not None and (f"can write to the folder {shared} holding or above the symbolic link "
                                       f"{shared / 'link'} on its way (mode 0777)") in reason, (path, reason)
    # A link in a safe place whose target goes through that link: the same.
    (tmp_path / "safe").mkdir(mode=0o700)
    (tmp_path / "safe" / "again").symlink_to(shared / "link" / "cache")
    assert f"symbolic link {shared / 'link'} on its way" in trust.untrusted_reason(tmp_path / "safe" / "again")
    with pytest.raises(UserError, match="--data_output_path .* holding or above the symbolic link"):
        data_cache.check_data_output_path(shared / "link")
    # The user's own link in a sticky folder (/tmp) is fine: only its owner can rename it there.
    shared.chmod(0o1777)
    assert trust.untrusted_reason(shared / "link" / "cache") is None


def _acl(*named: tuple[int, int, int], mask: int = 7) -> bytes:
    """Linux's system.posix_acl_access value: owner rwx, ``named`` (tag, id, permissions), group rwx,
    ``mask``, others none."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, 7, undefined), *[(tag, perm, who) for tag, who, perm in named], (0x04, 7, undefined),
               (0x10, mask, undefined), (0x20, 0, undefined)]
    return (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + who.to_bytes(4, "little")
        for tag, perm, who in sorted(entries))


def test_group_write_of_the_private_group_is_not_excused_when_an_acl_lets_others_write(tmp_path, monkeypatch):
    """With a POSIX ACL, the mode's group bits are the ACL's mask: "u:nobody:rwx" shows as 0770, which
    looked like the user's private group writing."""
    folder = tmp_path / "mine"
    folder.mkdir(mode=0o700)
    try:
        os.setxattr(folder, "system.posix_acl_access", _acl((0x02, OTHER_UID, 7)))
    except OSError as err:
        pytest.skip(f"no POSIX ACLs on this file system ({err.strerror})")
    monkeypatch.setattr(trust, "_private_group", lambda gid, uid: gid != OTHER_UID)
    assert mode_of(folder) == 0o770
    assert "users or groups its ACL names can write to it" in trust.untrusted_reason(folder)
    (folder / "cache").mkdir(mode=0o700)
    assert "users or groups its ACL names can write to the folder" in trust.untrusted_reason(folder / "cache")
    assert not trust.owned_privately(folder)
    os.setxattr(folder, "system.posix_acl_access", _acl((0x08, OTHER_UID, 7)))  # a named group: the same
    assert "users or groups its ACL names" in trust.untrusted_reason(folder)
    os.setxattr(folder, "system.posix_acl_access", _acl((0x02, OTHER_UID, 5), (0x08, OTHER_UID, 5)))  # read only
    assert trust.untrusted_reason(folder) is None
    os.setxattr(folder, "system.posix_acl_access", _acl((0x02, os.geteuid(), 7)))  # the user, named
    assert trust.untrusted_reason(folder) is None


def test_a_folder_above_owned_by_another_user_makes_the_path_untrusted(tmp_path, monkeypatch):
    home = tmp_path / "bob"
    (home / "project").mkdir(parents=True, mode=0o700)
    home.chmod(0o755)
    fake_owner(monkeypatch, home)
    reason = trust.untrusted_reason(home / "project")
    assert reason is not None and f"the folder {home} above it belongs to" in reason and "not to you" in reason
    assert "root" in reason  # root's folders (/, /home) are fine, as for ssh


def test_make_private_dir_creates_0700_folders_whatever_the_umask(tmp_path):
    (tmp_path / "existing").mkdir(mode=0o755)
    old = os.umask(0)
    try:
        made = trust.make_private_dir(tmp_path / "existing" / "a" / "b")
        trust.make_private_dir(made)  # again: a no-op
    finally:
        os.umask(old)
    assert made.is_dir() and mode_of(made) == mode_of(made.parent) == 0o700
    assert mode_of(tmp_path / "existing") == 0o755  # folders that exist are left as they are


# ------------------------------------------------------------------------------------------------ the data cache


@pytest.fixture(scope="module")
def victim(tmp_path_factory) -> dict:
    """The victim's data and tokenizer, and a planted cache for the victim's key (the attacker's text)."""
    root = tmp_path_factory.mktemp("victim")
    tok = make_tokenizer()
    data = write_jsonl(root / "victim.jsonl", pref_rows(30))
    attacker_rows = [{**row, "chosen": " PLANTED answer."} for row in pref_rows(30)]
    attacker_data = write_jsonl(root / "attacker.jsonl", attacker_rows)
    # The key is deterministic: anyone can compute the victim's from the same inputs.
    victim_key = create_prompt_dataset(-1, [str(data)], "2,4,4", str(root / "keys"), 1, 1234, tok, 32)[0].cache_key
    planted = create_prompt_dataset(-1, [str(attacker_data)], "2,4,4", str(root / "built"), 1, 1234, tok, 32)[0]
    plant = root / "plant"
    plant.mkdir()
    source, target = cache_files(root / "built", planted.cache_key), cache_files(plant, victim_key)
    for src, dst in zip(source.all(), target.all()):
        shutil.copy(src, dst)
    meta = json.loads(target.meta.read_text())
    target.meta.write_text(json.dumps({**meta, "key": victim_key}))
    for path in target.all():
        path.chmod(0o644)
    return {"tok": tok, "data": data, "plant": plant, "key": victim_key}


def run_victim(victim: dict, output_path: Path):
    return create_prompt_dataset(-1, [str(victim["data"])], "2,4,4", str(output_path), 1, 1234, victim["tok"], 32)


def decoded_first_row(victim: dict, train) -> str:
    return victim["tok"].decode(train[0]["input_ids"], skip_special_tokens=True)


def test_default_cache_folder_is_private_and_files_are_0600(victim, tmp_path, monkeypatch):
    monkeypatch.setenv("DSCHAT_CACHE_DIR", str(tmp_path / "home" / "cache"))
    (tmp_path / "home").mkdir()
    train, _ = run_victim(victim, data_cache_dir())
    folder = tmp_path / "home" / "cache" / "data_files"
    assert data_cache_dir() == folder and mode_of(folder) == mode_of(folder.parent) == 0o700
    files = cache_files(folder, train.cache_key)
    assert {p.name: mode_of(p) for p in (*files.all(), files.lock)} == {
        p.name: 0o600 for p in (*files.all(), files.lock)}
    assert "PLANTED" not in decoded_first_row(victim, train)


def test_the_planted_cache_is_a_real_threat(victim, tmp_path, monkeypatch):
    """Without the trust checks the victim trains on the attacker's text (as upstream, where the
    shared /tmp/data_files held pickles, the same plant ran code)."""
    folder = tmp_path / "data_files"
    shutil.copytree(victim["plant"], folder)
    monkeypatch.setattr(data_cache, "check_trusted", lambda *args: None)
    train, _ = run_victim(victim, folder)
    assert "PLANTED answer" in decoded_first_row(victim, train)


def test_a_cache_folder_others_can_write_to_is_refused(victim, tmp_path):
    folder = tmp_path / "data_files"
    shutil.copytree(victim["plant"], folder)
    folder.chmod(0o777)  # how it looks when another user made it in /tmp for everyone
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(UserError, match=f"--data_output_path {folder} is not safe to read .* others can write"):
        run_victim(victim, folder)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing read, nothing written


def test_a_refused_new_folder_under_a_folder_others_can_write_to_leaves_no_folder_made(tmp_path):
    """The folders were made first and checked after: refused, yet me/newcache/deeper stayed behind."""
    shared = tmp_path / "team"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError, match=f"--data_output_path {shared}/me/newcache/deeper is not safe to read .* "
                                        f"the folder {shared} above it"):
        trust.make_trusted_dir(shared / "me" / "newcache" / "deeper", "--data_output_path", "pass a folder of your own")
    assert list(shared.iterdir()) == []
    made = trust.make_trusted_dir(tmp_path / "mine" / "cache", "--data_output_path", "pass a folder of your own")
    assert made.is_dir() and mode_of(made) == mode_of(made.parent) == 0o700


def test_a_cache_file_of_another_owner_is_refused(victim, tmp_path, monkeypatch):
    folder = tmp_path / "data_files"
    shutil.copytree(victim["plant"], folder)
    planted = cache_files(folder, victim["key"]).train
    fake_owner(monkeypatch, planted)
    with pytest.raises(UserError, match=f"data cache file {planted} is not safe to read .* belongs to .*uid 65534"):
        run_victim(victim, folder)


def test_a_lock_of_another_owner_is_one_line(victim, tmp_path, monkeypatch):
    folder = tmp_path / "data_files"
    folder.mkdir(mode=0o700)
    lock = cache_files(folder, victim["key"]).lock
    lock.write_text("")
    fake_owner(monkeypatch, lock)
    with pytest.raises(UserError, match=f"data-cache lock {lock} is not safe to read .* belongs to .*uid 65534"):
        run_victim(victim, folder)
    assert sorted(p.name for p in folder.iterdir()) == [lock.name]


def test_a_lock_that_cannot_be_opened_is_one_line(victim, tmp_path, monkeypatch):
    """Not root: another user's lock file (0644) cannot be opened for writing; filelock raises
    PermissionError, which used to be a traceback."""
    from filelock import FileLock

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self.lock_file))

    monkeypatch.setattr(FileLock, "acquire", denied)
    with pytest.raises(UserError, match="cannot take the data-cache lock .*Permission denied.*another user's"):
        run_victim(victim, tmp_path / "data_files")


@pytest.fixture
def sticky_tmp():
    """A folder like /tmp (1777) that both users can reach."""
    folder = Path(tempfile.mkdtemp(prefix="dschat-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@needs_second_uid
def test_a_folder_another_user_planted_is_refused(victim, sticky_tmp):
    plant = sticky_tmp / "plant"
    shutil.copytree(victim["plant"], plant)
    plant.chmod(0o755)
    folder = sticky_tmp / "data_files"  # upstream's default, /tmp/data_files, made by the attacker
    as_other_user(f"mkdir -m 755 {folder} && cp {plant}/* {folder}/")
    assert folder.stat().st_uid == OTHER_UID
    with pytest.raises(UserError, match=f"--data_output_path {folder} is not safe .* belongs to .*uid 65534"):
        run_victim(victim, folder)


@needs_root
def test_a_file_another_user_owns_is_refused_even_by_root(victim, tmp_path):
    folder = tmp_path / "data_files"
    shutil.copytree(victim["plant"], folder)
    folder.chmod(0o700)
    planted = cache_files(folder, victim["key"]).meta
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(UserError, match=f"data cache file {planted} is not safe .* belongs to .*uid 65534"):
        run_victim(victim, folder)
