"""The launcher's log: a step's output written to ``<output_dir>/training.log`` through one handle,
the previous runs' logs kept as ``training.log.1`` ... ``.{KEPT_LOGS}`` (:class:`LogTee`); a URL flag's
password and query never shown, in the command line (:func:`shown_argv`) nor in the output
(:class:`Redactor`); the terminal written until its reader goes away (:class:`TerminalSink`)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Sequence

from dschat.errors import UserError, shown_url
from dschat.runtime.fs import foreign_link_line, open_own

__all__ = ["KEPT_LOGS", "LogTee", "Redactor", "TerminalSink", "URL_FLAGS", "shown_argv", "terminal_writer"]

#: Flags whose value is a URL that may carry a password, or a key in its query.
URL_FLAGS = ("--reward_url",)

KEPT_LOGS = 5  # earlier runs' logs kept beside training.log (training.log.1: the latest)


class LogTee:
    """Writes to ``path`` through one handle opened at the start.

    A step may replace its output folder atomically when it saves (dschat's ``atomic_dir``), which
    would take an open ``training.log`` with the old folder. The handle keeps the data readable, and
    :meth:`close` puts the complete log back at ``path`` when the folder was replaced (or the log
    removed). A log there that is not ours, in the folder we opened ours in, is a later launcher's on
    the same folder: it moved ours aside and keeps it as ``training.log.1``; ours is not written over it.

    A step that refused its input (exit code 2 before it started up) did nothing: ``close(discard=True)``
    puts the previous run's log (moved aside meanwhile) back and removes the folders made for the log.
    Else the previous log becomes ``training.log.1`` (older ones ``.2`` ... ``.{KEPT_LOGS}``), as do
    the logs a killed launcher left set aside. ``started``: the file the step creates once it starts
    up (:data:`~dschat.paths.STARTED_FILE_VAR`), beside the log so that every node sees it. The
    set-aside log and stamp of a launcher still running on the same folder (its pid is in their names:
    a second launch that the step will refuse, as the folder is in use) are left alone.

    A ``training.log`` that is a symbolic link another account made (in an output folder others can
    write to) is one line before anything is touched, and the log is never written through one planted
    later (:func:`~dschat.runtime.fs.open_own`).
    """

    def __init__(self, path: Path):
        line = foreign_link_line(path)
        if line is not None:
            raise UserError(line)
        for log in (path, *(path.with_name(f"{path.name}.{n}") for n in range(1, KEPT_LOGS + 1))):
            if os.path.lexists(log) and not log.is_symlink() and not log.is_file():  # a folder where a log goes
                raise UserError(f"{log} is not a file, and the launcher keeps its logs there; move it out of the "
                                "output folder or pass another --output_dir")
        self.path = path
        self.started = path.with_name(f".{path.name}.started-{os.getpid()}")
        if path.parent.is_dir():  # what a killed launcher left: its set-aside log is kept, its stamp goes
            leftovers = [p for p in path.parent.glob(f".{path.name}.previous-*") if not _launcher_alive(p)]
            try:
                for left in sorted(leftovers, key=lambda p: p.stat().st_mtime):
                    self._keep(left)
                for left in path.parent.glob(f".{path.name}.started-*"):
                    if not _launcher_alive(left):
                        left.unlink(missing_ok=True)
            except PermissionError as err:  # a sticky shared folder: another account's leftovers
                raise UserError(f"cannot tidy {err.filename} ({err.strerror}): another account's launch left it "
                                f"in {path.parent}, a folder others can write to; pass an --output_dir of your "
                                "own") from None
        self.created = path.parent  # the outermost folder this tee creates (None: none)
        while not self.created.parent.exists() and self.created.parent != self.created:
            self.created = self.created.parent
        if self.created.exists():
            self.created = None
        self.previous = path.with_name(f".{path.name}.previous-{os.getpid()}") if path.is_file() else None
        if self.previous is not None:
            try:
                os.replace(path, self.previous)
            except PermissionError as err:  # a sticky shared folder: another account's log
                raise UserError(f"cannot move the previous {path} aside ({err.strerror}): it is another account's "
                                "log in a folder others can write to; pass an --output_dir of your own") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open_own(path, "w+b")  # closed in close()
        self.stat = os.fstat(self.handle.fileno())
        self.folder = os.stat(path.parent)  # a save that replaces the folder changes it

    def write(self, data: bytes) -> None:
        self.handle.write(data)
        self.handle.flush()

    def close(self, discard: bool = False) -> None:
        ours = elsewhere = False  # elsewhere: a log at the path that is not ours, in the folder ours was opened in
        try:
            ours = os.path.samestat(os.stat(self.path), self.stat)
            elsewhere = (not ours and not self.path.is_symlink()  # a link planted there is refused below
                         and os.path.samestat(os.stat(self.path.parent), self.folder))
        except FileNotFoundError:
            pass
        if discard:
            self.handle.close()
            if ours:
                self.path.unlink()
            if self.previous is not None and self.previous.exists() and not elsewhere:
                os.replace(self.previous, self.path)
            folder = self.path.parent
            while self.created is not None and folder.is_relative_to(self.created):
                try:
                    folder.rmdir()  # only if empty: the step may have written there after all
                except OSError:
                    break
                folder = folder.parent
            return
        try:
            if not ours and not elsewhere:  # the folder was replaced by a save, or the log removed: put it back
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.handle.seek(0)
                with open_own(self.path, "wb") as fresh:
                    shutil.copyfileobj(self.handle, fresh)
        finally:
            self.handle.close()
        if self.previous is not None and self.previous.exists():
            try:
                self._keep(self.previous)
            except OSError as err:  # the step's exit code stands; the earlier log stays set aside
                print(f"[dschat.launch] could not keep the previous log as {self.path.name}.1 "
                      f"({type(err).__name__}: {err.strerror}); it is {self.previous}", file=sys.stderr, flush=True)

    def _keep(self, log: Path) -> None:
        """``log`` becomes ``<path>.1``, each older one moves up (``.{KEPT_LOGS}`` is replaced)."""
        for n in range(KEPT_LOGS - 1, 0, -1):
            if (older := self.path.with_name(f"{self.path.name}.{n}")).is_file():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        os.replace(log, self.path.with_name(f"{self.path.name}.1"))


def _launcher_alive(leftover: Path) -> bool:
    """Whether the launcher whose pid ends ``leftover``'s name (``.training.log.previous-<pid>``,
    ``.training.log.started-<pid>``) is still running on this machine."""
    pid = leftover.name.rpartition("-")[2]
    if not pid.isdigit() or int(pid) == os.getpid():  # this launcher's own pid: an earlier one's, reused
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another account's process: alive
        return True
    return True


def _url_args(argv: Sequence[str]) -> dict[int, tuple[str, str]]:
    """Where ``argv`` holds a :data:`URL_FLAGS` value: its index -> (what precedes the URL in that
    argument, the URL): ``("", url)`` after ``--flag``, ``("--flag=", url)`` in ``--flag=url``."""
    found = {}
    for at, (before, arg) in enumerate(zip(("", *argv), argv)):
        flag, eq, value = arg.partition("=")
        if before in URL_FLAGS:
            found[at] = ("", arg)
        elif eq and flag in URL_FLAGS:
            found[at] = (flag + eq, value)
    return found


def shown_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with each :data:`URL_FLAGS` value as :func:`~dschat.errors.shown_url` shows it."""
    shown = list(argv)
    for at, (prefix, url) in _url_args(argv).items():
        shown[at] = prefix + shown_url(url)
    return shown


class Redactor:
    """A byte stream (the step's output) with each secret-bearing :data:`URL_FLAGS` value of ``argv``
    replaced by its shown form, also where it straddles two chunks: :meth:`feed` holds back the end of
    a chunk that may begin one, :meth:`flush` gives what is held at the end."""

    def __init__(self, argv: Sequence[str]) -> None:
        pairs = {url.encode(): shown_url(url).encode() for _, url in _url_args(argv).values() if shown_url(url) != url}
        self.pairs = sorted(pairs.items(), key=lambda pair: -len(pair[0]))  # a secret that begins another: after it
        self.held = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self.pairs:
            return chunk
        data = self.held + chunk
        for secret, shown in self.pairs:
            data = data.replace(secret, shown)
        keep = next((k for k in range(min(len(data), max(len(s) for s, _ in self.pairs) - 1), 0, -1)
                     if any(s.startswith(data[-k:]) for s, _ in self.pairs)), 0)
        self.held = data[len(data) - keep:] if keep else b""
        return data[:len(data) - keep]

    def flush(self) -> bytes:
        held, self.held = self.held, b""
        return held


def terminal_writer() -> Callable[[bytes], None]:
    """Writes bytes to this process's stdout as they come (its text layer when it has no buffer)."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is not None:
        def write(data: bytes) -> None:
            buffer.write(data)
            buffer.flush()
    else:  # a text-only stdout (some test harnesses)
        def write(data: bytes) -> None:
            sys.stdout.write(data.decode("utf-8", errors="replace"))
            sys.stdout.flush()
    return write


class TerminalSink:
    """Writes to the terminal until its reader goes away (``... | head`` exits): from then on the
    step runs on, its output still reaching ``training.log``, and this process's stdout (and stderr,
    when it is the same pipe) point at the null device, so later prints neither fail nor stop it."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write: Callable[[bytes], None] | None = write

    def __call__(self, data: bytes) -> None:
        if self._write is None:
            return
        try:
            self._write(data)
        except BrokenPipeError:
            self._write = None
            _stdout_to_null()


def _stdout_to_null() -> None:
    """Point file descriptor 1 (and 2, when it is the same pipe) at the null device."""
    try:
        same = os.path.sameopenfile(1, 2)
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    os.dup2(null, 1)
    if same:
        os.dup2(null, 2)
    os.close(null)
