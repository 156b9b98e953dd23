"""Who may be trusted on a shared machine: a file or folder is trusted only when this user owns it
and nobody else can write to it or to a folder above it.

:func:`untrusted_reason` says why a path is not (the owner, a group or others that can write to it,
or, :func:`untrusted_ancestor`, a folder above it, or holding a symlink on its way, that another
account could swap, as OpenSSH's StrictModes checks; group write counts unless the group is the
user's private one and no POSIX ACL entry lets another user or group write); :func:`is_trusted` and
:func:`check_trusted` (one line, exit code 2) build on it, and :func:`untrusted_inside` checks a whole
tree below a trusted folder. A cache, lock or leftover folder that another account could have planted, edited or swapped is
never read. :func:`make_private_dir` creates folders only their owner can enter (0700);
:func:`make_trusted_dir` also refuses one that exists and is not the user's own (and removes what it
made: :func:`missing_ancestors`, :func:`remove_made_folders`);
:func:`owned_privately` is the test for leftovers a crash-safe write may adopt; :func:`foreign_link`
tells a symlink another account made (in a folder others can write to) that a write would follow.

Beyond files: :func:`is_loopback_host` tells a host name or address that only this machine reaches,
:func:`listener_owners` reads which accounts' sockets listen on a local TCP port (a server on the
loopback address that another account started). A URL as lines and logs may show it (no password, no
query) is :func:`dschat.errors.shown_url`.
"""
from __future__ import annotations

import errno
import grp
import ipaddress
import os
import pwd
import stat
import struct
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

from dschat.errors import UserError

__all__ = [
    "missing_ancestors",
    "remove_made_folders",
    "owned_privately",
    "foreign_link",
    "foreign_link_on_the_way",
    "untrusted_reason",
    "untrusted_ancestor",
    "untrusted_inside",
    "walk_through_links",
    "is_trusted",
    "check_trusted",
    "make_private_dir",
    "make_trusted_dir",
    "is_loopback_host",
    "listener_owners",
]

_LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp: listening


def owned_privately(path: str | os.PathLike) -> bool:
    """Whether a leftover beside or inside an output folder (a crash-safe write's temporary folder,
    journal or marker) may be adopted or deleted: it exists, is not a symlink, belongs to this user
    and nobody else can write to it. The folders above it are not checked (as :func:`is_trusted`
    does): whoever can replace one of them can replace the output folder itself, so refusing the
    user's own leftover there would protect nothing and strand the only copy of a save."""
    if os.path.islink(path):
        return False
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return False
    me = os.geteuid()
    return info.st_uid == me and _writers(info, me, path) is None


def foreign_link(path: str | os.PathLike) -> str | None:
    """Why ``path`` is a symbolic link dschat must not write through, or ``None``: it is a link (not
    followed: ``os.lstat``) that an account other than this process's user made (root running dschat
    included; a link root made is trusted, as root could write the target anyway). Whoever can write to
    a folder can plant one there, pointing at any file or folder of this user's, for a write to land in.
    ``None`` too when there is nothing at ``path``."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    me = os.geteuid()
    if not stat.S_ISLNK(info.st_mode) or info.st_uid in (me, 0):
        return None
    try:
        who = f"{pwd.getpwuid(info.st_uid).pw_name}, uid {info.st_uid}"
    except KeyError:  # a uid with no passwd entry
        who = f"uid {info.st_uid}"
    return f"a symbolic link another account ({who}) made"


def foreign_link_on_the_way(path: str | os.PathLike) -> tuple[Path, str] | None:
    """The first symbolic link that resolving ``path`` meets (the last component included) that
    another account made (:func:`foreign_link`), with its reason; None when there is none."""
    for link, _ in _links_on_the_way(path):
        reason = foreign_link(link)
        if reason is not None:
            return link, reason
    return None


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:  # a uid with no passwd entry (a container, a deleted account)
        return f"uid {uid}"


def _private_group(gid: int, uid: int) -> bool:
    """Whether group ``gid`` is ``uid``'s own: a user-private group (the user's primary group, of the
    user's name, with no other member and no other account's primary group), as Debian and Ubuntu give
    every user, whose default umask 002 makes the user's files group-writable."""
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:  # an id without a name here (e.g. from another machine's NFS)
        return False
    if group.gr_gid != user.pw_gid or group.gr_name != user.pw_name or set(group.gr_mem) - {user.pw_name}:
        return False
    return all(other.pw_gid != gid or other.pw_uid == uid for other in pwd.getpwall())


# POSIX ACLs as Linux stores them in the ``system.posix_acl_access`` attribute: a 4-byte version,
# then 8-byte entries (tag, permissions: 16 bits each; id: 32 bits), little-endian.
_ACL_XATTR = "system.posix_acl_access"
_ACL_USER, _ACL_GROUP, _ACL_WRITE = 0x02, 0x08, 0x02


def _acl_writers(path: str | os.PathLike, me: int) -> bool:
    """Whether ``path``'s POSIX ACL names a user (not ``me``) or a group (not ``me``'s private one)
    with write permission. With such entries the mode's group bits are the ACL's mask, the most any
    of them may do, not the owning group's rights. No ACL (or a file system without them): False."""
    try:
        acl = os.getxattr(path, _ACL_XATTR)
    except OSError as err:
        if err.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    for offset in range(4, len(acl) - 7, 8):
        tag, perm, who = struct.unpack_from("<HHI", acl, offset)
        if perm & _ACL_WRITE and ((tag == _ACL_USER and who != me)
                                  or (tag == _ACL_GROUP and not _private_group(who, me))):
            return True
    return False


def _writers(info: os.stat_result, me: int, path: str | os.PathLike) -> str | None:
    """Who besides the owner can write to ``path`` (``info``: its ``os.stat``): "its group", "other
    users", ..., or ``None``. Group write does not count when the group is ``me``'s private one and
    no POSIX ACL entry gives another user or group write (:func:`_acl_writers`)."""
    writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable == stat.S_IWGRP and _private_group(info.st_gid, me):
        if _acl_writers(path, me):
            return "users or groups its ACL names"
        writable = 0
    if not writable:
        return None
    return "its group and others" if writable == stat.S_IWGRP | stat.S_IWOTH else (
        "its group" if writable == stat.S_IWGRP else "other users")


def untrusted_ancestor(path: str | os.PathLike) -> str | None:
    """Why a folder above ``path`` lets another account replace it, or ``None`` (OpenSSH's StrictModes).

    Every folder from ``path``'s parent up to ``/`` (of the resolved path: symlinks followed, as a
    reader's open does) must belong to this user or root and be writable by nobody else (group write
    by the user's private group is fine): whoever can write to a folder can rename what is in it and
    put their own in its place. The same holds for every folder that holds a symlink met on the way
    (:func:`_links_on_the_way`: a component of ``path``, or of a link's target) and the folders above
    it: whoever can write there can point the link elsewhere. One exception, as ``/tmp`` and
    ``/dev/shm`` need: a sticky folder (mode ``+t``) lets only an entry's owner rename it, so there
    the next folder down (or the link) only has to belong to this user or root. Raises
    ``FileNotFoundError`` when ``path`` does not exist.
    """
    child = Path(os.path.realpath(path))
    reason = _folders_reason(child.parents, os.stat(child), "above it")
    for link, holder in _links_on_the_way(path):
        reason = reason or _folders_reason((holder, *holder.parents), os.lstat(link),
                                           f"holding or above the symbolic link {link} on its way")
    return reason


def _folders_reason(folders: Sequence[Path], child_info: os.stat_result, where: str) -> str | None:
    """Why one of ``folders`` (resolved, each the one above the one before) lets another account
    replace the entry below it (``child_info``: the first one's entry's status), or ``None``;
    ``where`` places the folder in the message."""
    me = os.geteuid()
    for folder in folders:
        info = os.stat(folder)
        if info.st_uid not in (me, 0):
            return f"the folder {folder} {where} belongs to {_user_name(info.st_uid)}, not to you (uid {me}) or root"
        who = _writers(info, me, folder)
        sticky_guard = info.st_mode & stat.S_ISVTX and child_info.st_uid in (me, 0)
        if who is not None and not sticky_guard:
            return (f"{who} can write to the folder {folder} {where} (mode {stat.S_IMODE(info.st_mode):04o}), so "
                    "they could put something else in its place")
        child_info = info
    return None


_MAX_LINKS = 40  # symlinks one path's resolution may meet (Linux's limit; more is ELOOP)


def _links_on_the_way(path: str | os.PathLike) -> list[tuple[Path, Path]]:
    """``(link, folder)`` for every symlink that resolving ``path`` meets, in order: the link as
    reached (its folder resolved) and that folder. Resolves as the kernel does (a link's target,
    relative to the link's folder, is resolved in turn, its own links included; ``..`` goes up from
    where a link led); components that do not exist end nothing here. More than 40 links: ``OSError``
    (ELOOP)."""
    raw = os.fspath(path)
    raw = raw if os.path.isabs(raw) else os.path.join(os.getcwd(), raw)
    pending = raw.split(os.sep)[::-1]  # a stack: the next component last
    current, links = "/", []
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if not os.path.islink(candidate):
            current = candidate
            continue
        if len(links) == _MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fspath(path))
        links.append((Path(candidate), Path(current)))
        target = os.readlink(candidate)
        current = "/" if os.path.isabs(target) else current
        pending.extend(target.split(os.sep)[::-1])
    return links


def untrusted_reason(path: str | os.PathLike, *, root_may_own: bool = False) -> str | None:
    """Why ``path`` must not be trusted on a shared machine, or ``None`` when it may be.

    Trusted means: owned by this process's effective user (or by root, with ``root_may_own``: a
    system-wide install root could change anyway), and writable by nobody else -- group write is
    fine when the group is the user's private one (:func:`_private_group`) -- and no folder above it
    lets another account replace it (:func:`untrusted_ancestor`). The owner is what counts, not what
    ``os.access`` says: root can read and write anything, yet must still not trust a file another
    account planted. A symlink is judged by its target (``os.stat`` follows it), which is what a
    reader opens, and by the folders it sits in (:func:`untrusted_ancestor`). Raises ``FileNotFoundError`` when ``path`` does not exist.
    """
    return _owner_reason(os.stat(path), path, root_may_own) or untrusted_ancestor(path)


def _owner_reason(info: os.stat_result, path: str | os.PathLike, root_may_own: bool) -> str | None:
    """Why ``path`` (``info``: its status) is not this user's own (or root's, with ``root_may_own``)
    or another can write to it, or ``None``; the folders above it are not looked at."""
    me = os.geteuid()
    if info.st_uid != me and not (root_may_own and info.st_uid == 0):
        return f"it belongs to {_user_name(info.st_uid)}, not to you (uid {me})"
    who = _writers(info, me, path)
    return None if who is None else f"{who} can write to it (mode {stat.S_IMODE(info.st_mode):04o})"


def walk_through_links(folder: str | os.PathLike, onerror: Callable[[OSError], None] | None = None
                       ) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(folder)`` through linked folders, as a reader that opens paths below ``folder`` sees
    them, each folder once (one reached again, by a second link or a link cycle, is not walked)."""
    seen: set[tuple[int, int]] = set()
    for root, dirs, files in os.walk(folder, onerror=onerror, followlinks=True):
        try:
            info = os.stat(root)
        except OSError:  # gone meanwhile: nothing to walk
            dirs[:] = []
            continue
        if (info.st_dev, info.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((info.st_dev, info.st_ino))
        yield root, dirs, files


def untrusted_inside(folder: str | os.PathLike, *, root_may_own: bool = False) -> str | None:
    """Why an entry below the trusted ``folder`` (every file and folder, recursively, through linked
    folders: :func:`walk_through_links`) must not be trusted, naming it, or ``None``: each must be this
    user's (or root's, with ``root_may_own``) and writable by nobody else (:func:`_owner_reason`); a
    symbolic link is judged as :func:`untrusted_reason` judges a path (its target and every folder on
    its way). An entry that cannot be examined (a link loop, no permission) is a reason too. For a
    tree whose files run as code (a checkout)."""
    for parent, dirs, files in walk_through_links(folder):
        for name in (*dirs, *files):
            entry = os.path.join(parent, name)
            try:
                reason = (untrusted_reason(entry, root_may_own=root_may_own) if os.path.islink(entry)
                          else _owner_reason(os.lstat(entry), entry, root_may_own))
            except FileNotFoundError:  # removed meanwhile, or a dangling link: nothing to run
                continue
            except OSError as err:
                reason = f"it cannot be examined ({err.strerror or err})"
            if reason:
                return f"{entry}: {reason}"
    return None


def is_trusted(path: str | os.PathLike) -> bool:
    """True when ``path`` exists, this user owns it and nobody else can write to it."""
    try:
        return untrusted_reason(path) is None
    except FileNotFoundError:
        return False


def check_trusted(path: str | os.PathLike, what: str, fix: str) -> None:
    """Refuse ``path`` with one line unless this user owns it and nobody else can write to it.

    ``what`` names the path in the message ("--data_output_path", "data cache file"); ``fix`` says
    what to do ("pass a folder of your own"). See :func:`untrusted_reason`.
    """
    reason = untrusted_reason(path)
    if reason is not None:
        raise UserError(f"{what} {path} is not safe to read on a shared machine: {reason}; {fix}")


def missing_ancestors(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, innermost first (the folders a
    ``mkdir(parents=True)`` of ``path`` would create)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_made_folders(made: Sequence[Path]) -> None:
    """Remove the empty folders a call made (``made``: :func:`missing_ancestors` before it), innermost
    first; one already gone is passed over, and one holding someone else's files ends the walk."""
    for folder in made:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return


def make_private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and its missing parents as folders only their owner can enter (0700).

    Folders that exist already are left as they are (check them with :func:`check_trusted`);
    another process creating the same folder at the same time is fine.
    """
    target = Path(os.path.expanduser(os.fspath(path)))
    _make_private_dirs(target)
    return target


def _make_private_dirs(target: Path) -> list[Path]:
    """:func:`make_private_dir` of ``target``; returns the folders it made, innermost first."""
    made = []
    for folder in reversed(missing_ancestors(target)):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made by another rank meanwhile, or a file: the caller's checks name it
        os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask; this is exact
        made.insert(0, folder)
    return made


def make_trusted_dir(path: str | os.PathLike, what: str, fix: str, not_a_folder_fix: str | None = None) -> Path:
    """:func:`make_private_dir`, then refuse ``path`` in one line unless it is a folder this user may
    trust (:func:`check_trusted`, with ``what`` and ``fix``); a path that is not a folder is told
    ``not_a_folder_fix`` (default ``fix``). A refused path leaves no folder this call made. Returns the
    folder."""
    target = Path(os.path.expanduser(os.fspath(path)))
    made = _make_private_dirs(target)  # removed again when refused
    try:
        if not target.is_dir():
            raise UserError(f"{what} {path} is not a folder; {not_a_folder_fix or fix}")
        check_trusted(target, what, fix)
    except UserError:
        remove_made_folders(made)  # empty, unless another process wrote there meanwhile: then it stays
        raise
    return target


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback: ``localhost``, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listener_owners(port: int, tables: Sequence[str] = ("/proc/net/tcp", "/proc/net/tcp6")) -> set[int]:
    """The uids of the accounts whose TCP sockets listen on ``port`` at an address a loopback URL
    reaches (a loopback address, or every address), read from Linux's ``tables``; empty when none
    does or the tables cannot be read."""
    owners = set()
    for table in tables:
        try:
            lines = Path(table).read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # sl local_address rem_address st queues tr:when retrnsmt uid ...
            if len(fields) <= 7 or fields[3] != _LISTEN:
                continue
            address, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) == port and _reached_from_loopback(address):
                owners.add(int(fields[7]))
    return owners


def _reached_from_loopback(address: str) -> bool:
    """Whether a socket bound to ``address`` (the kernel's hex: 32-bit words in this machine's byte
    order) takes connections to a loopback address; an address that cannot be read counts as one
    (the owner check stays strict)."""
    try:
        words = [bytes.fromhex(address[i:i + 8]) for i in range(0, len(address), 8)]
        ip = ipaddress.ip_address(b"".join(w[::-1] if sys.byteorder == "little" else w for w in words))
    except ValueError:
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified
