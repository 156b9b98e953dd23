"""What a launch needs to know about its hosts before the ``deepspeed`` launcher starts.

* Which hosts it runs on (:func:`launch_hosts`), read from the hostfile as the launcher reads it,
  so a single-node launch can take a free master port (:func:`free_port`, as ``torchrun
  --standalone`` does) while a multi-node one keeps the port every host agrees on.
* Whether the master port can be bound on this machine (:func:`check_master_port`).
* Values that survive DeepSpeed's PDSH runner (:func:`check_remote_safe`): it joins the remote
  command into one shell string and quotes only values with spaces, so ``$(...)`` in a flag value
  would run on every node.
* The environment of remote ranks (:func:`write_rank_env_file`): the PDSH runner forwards only a few
  variable families (``PYTHON*``, ``NCCL*``, ...) and the lines of ``.deepspeed_env``; dschat writes
  the variables ranks need into a private copy of that file, leaving the user's own alone.
  Secret-named variables are never forwarded: neither from the families the runner forwards by
  itself (:func:`forwarded_secrets`) nor from the user's ``.deepspeed_env`` lines.
* Host names that cannot reach ``ssh``/``pdsh`` as options (:func:`check_host_name`).

Whether the working directory and the ``.deepspeed_env`` files may be trusted is checked by the
launcher (``dschat.launch``), which can use the file-system trust rules of ``dschat.runtime.trust``.
"""
from __future__ import annotations

import os
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from dschat.errors import UserError, shown_url

DEFAULT_HOSTFILE = "/job/hostfile"  # where the deepspeed launcher looks without --hostfile
DEFAULT_MASTER_PORT = 29500  # the deepspeed launcher's (torch's) default
DEFAULT_DIST_TIMEOUT_MINUTES = 5.0  # --dist_timeout: how long ranks wait for each other at start-up
ENV_FILE_VAR = "DS_ENV_FILE"  # DeepSpeed reads os.path.join(<home or cwd>, $DS_ENV_FILE)
ENV_FILE_NAME = ".deepspeed_env"

# Variables the step scripts (or libraries they use) read, which DeepSpeed does not forward to remote
# ranks by itself. PYTHON* (PYTHONPATH, PYTHONUNBUFFERED) and the accelerator's family (NCCL* on
# CUDA) are forwarded by DeepSpeed already.
RANK_ENV_NAMES = frozenset({
    "DS_ACCELERATOR", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
    "DEEPSPEED_TIMEOUT", "CUDA_LAUNCH_BLOCKING",
})
RANK_ENV_PREFIXES = ("DSCHAT_", "HF_", "TRANSFORMERS_")
LOCAL_ONLY_ENV = frozenset({"DSCHAT_LAUNCHER"})  # read by dschat.launch on the first host only
# Forwarded by DeepSpeed's runner itself (its EXPORT_ENVS and the CUDA accelerator's NCCL family).
DEEPSPEED_FORWARDS = ("PYTHON", "MLFLOW", "MV2", "UCX", "NCCL")
# Every prefix DeepSpeed's multi-node runners forward from the launching environment: the runner's
# EXPORT_ENVS and the export_envs() of each accelerator (NPU, MLU, SDAA, SUPA, KunlunXin add their
# collective libraries' families, LD_LIBRARY* and PATH*).
DEEPSPEED_EXPORT_PREFIXES = DEEPSPEED_FORWARDS + (
    "ASCEND", "HCCL", "NEUWARE_HOME", "CNCL", "BKCL", "XPU", "XMLIR", "BCCL", "BIREN", "SUPA", "LD_LIBRARY", "PATH")
# A host name as ssh and pdsh take it: never an option ("-oProxyCommand=..."), a list (","), a pdsh
# range or pattern ("[1-4]", "%h") or anything a shell reads.
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
# The rendezvous identity dschat.launch gives every rank of one launch (dschat.runtime.dist reads it).
RENDEZVOUS_ID_VAR = "DSCHAT_RENDEZVOUS_ID"
# Never forwarded: the PDSH runner puts every forwarded variable on the ssh command line, which any
# user of a host can read in the process list (HF_TOKEN: log in on each node instead).
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY$|^KEY", re.IGNORECASE)

# A value the remote shell reads as one literal word: letters, digits, space (DeepSpeed double-quotes
# values with spaces) and punctuation that no shell expands. '%' is left out: pdsh substitutes %h/%n.
_SAFE_CHARS = re.compile(r"[\w ,./:=@+^-]*")
# What makes a shell run a command inside a value, double-quoted or not.
_COMMAND_CHARS = re.compile(r"[$`;|&<>\"'\\\n]")
# A URL's user or password (``scheme://user:pw@host``) or its query, anywhere in a value.
_URL_SECRET = re.compile(r"://[^\s/?#]*@|://[^\s?#]*\?")


@dataclass(frozen=True)
class Hosts:
    """The hosts a launch will run on: ``names`` in hostfile order (``["localhost"]`` without one)."""

    names: tuple[str, ...]
    hostfile: str | None  # the hostfile that was read, None when there is none

    @property
    def multi_node(self) -> bool:
        return len(self.names) > 1


def read_hostfile(path: str | os.PathLike) -> list[str]:
    """Host names of a DeepSpeed hostfile (``<host> slots=<n>`` lines; ``#`` comments, blank lines)."""
    return list(hostfile_slots(path))


def hostfile_slots(path: str | os.PathLike) -> dict[str, int]:
    """Each host of a DeepSpeed hostfile and its slots, in the file's order (a host listed twice, or
    a bad line, is one :class:`UserError` line)."""
    hosts: dict[str, int] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read hostfile {path} ({err.__class__.__name__}); write one line per host: "
                        "'<host> slots=<gpus>'") from None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if not match:
            raise UserError(f"hostfile {path} has a bad line {line!r}; write one line per host: '<host> slots=<gpus>'")
        check_host_name(match.group(1), f"hostfile {path}")
        if match.group(1) in hosts:  # DeepSpeed's runner raises on it, after the log was opened
            raise UserError(f"hostfile {path} lists host {match.group(1)} twice; give each host one line "
                            "'<host> slots=<gpus>' with all its GPUs")
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise UserError(f"hostfile {path} lists no host; write one line per host: '<host> slots=<gpus>'")
    return hosts


def check_host_name(host: str, where: str) -> None:
    """Refuse a host name outside ``[A-Za-z0-9][A-Za-z0-9._:-]*`` (``where`` names its source).

    The launcher hands hostfile names to ``ssh`` and ``pdsh`` as arguments: one starting with ``-``
    would be read as an option (``-oProxyCommand=...`` runs a command), a ``,`` splits it into two
    hosts, and ``[]``/``%`` are pdsh patterns.
    """
    if not _HOST_NAME.fullmatch(host):
        raise UserError(f"{where} names host {host!r}, which is not a host name (letters, digits and ._:- , "
                        "starting with a letter or digit: ssh would read a leading '-' as an option); "
                        "write the host's name or address")


def _filter_hosts(slots: dict[str, int], include: str | None, exclude: str | None) -> list[str]:
    """The hosts DeepSpeed's ``--include``/``--exclude`` (``host1@host2:0,1``) leave of ``slots``
    (host -> its slots): a host named without slots is dropped whole, and so is one whose every slot
    is excluded (``host:0`` of a one-slot host); "host:0" keeps a host's other slots."""
    hosts = list(slots)
    if include:
        wanted = {spec.split(":", 1)[0] for spec in include.split("@") if spec}
        hosts = [h for h in hosts if h in wanted]
    if exclude:
        excluded: dict[str, set[str] | None] = {}  # host -> its excluded slots (None: all)
        for spec in filter(None, exclude.split("@")):
            host, _, ids = spec.partition(":")
            if not ids:
                excluded[host] = None
            elif excluded.get(host, set()) is not None:
                excluded[host] = {*(excluded.get(host) or set()), *ids.split(",")}
        hosts = [h for h in hosts if h not in excluded or (excluded[h] is not None
                                                             and not {str(i) for i in range(slots[h])} <= excluded[h])]
    return hosts


def launch_hosts(hostfile: str | None, num_nodes: int | None = None, include: str | None = None,
                 exclude: str | None = None) -> Hosts:
    """The hosts the deepspeed launcher will use, decided as its ``runner.main`` does: the hostfile
    (``/job/hostfile`` by default) if it exists, filtered by ``--include``/``--exclude``, then its
    first ``--num_nodes``; no hostfile means this machine only."""
    path = hostfile or DEFAULT_HOSTFILE
    if not os.path.isfile(path):
        missing = "is not a file" if os.path.exists(path) else "does not exist"  # a folder, say
        if num_nodes is not None and num_nodes > 1:
            where = f"--hostfile {hostfile} {missing}" if hostfile else f"no --hostfile and no {DEFAULT_HOSTFILE}"
            raise UserError(f"--num_nodes {num_nodes} needs a hostfile listing the nodes, but {where}; write "
                            "one line per host: '<host> slots=<gpus>'")
        if hostfile:
            raise UserError(f"--hostfile {hostfile} {missing}; write one line per host: '<host> slots=<gpus>'")
        return Hosts(("localhost",), None)
    hosts = _filter_hosts(hostfile_slots(path), include, exclude)
    if num_nodes is not None and num_nodes > 0:
        if num_nodes > len(hosts):
            raise UserError(f"--num_nodes {num_nodes} but hostfile {path} lists {len(hosts)} usable host(s)")
        hosts = hosts[:num_nodes]
    if not hosts:
        raise UserError(f"--include/--exclude leave no host of hostfile {path}")
    return Hosts(tuple(hosts), path)


# -------------------------------------------------------------------------------------------------
# Ports
# -------------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port nobody listens on here, chosen by the OS (``torchrun --standalone`` does the same).

    Bound on every interface, as the rendezvous store of rank 0 will be. Another process may take it
    before rank 0 does; the window is the launcher's start-up, as for torchrun.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Whether a listening socket can be bound to ``port`` on every interface of this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the rendezvous store's server socket: a port in TIME_WAIT is reusable, one with a
        # listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def is_this_machine(host: str) -> bool:
    """Whether ``host`` (a hostfile name) is the machine dschat runs on."""
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    if address.startswith("127."):
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((address, 0))  # only an address of one of this machine's interfaces binds
        return True
    except OSError:
        return False


def check_master_port(port: int, hosts: Hosts, given: str) -> None:
    """Refuse ``port`` when rank 0's host is this machine and something already listens on it.

    ``given`` says where the port came from (``--master_port``, ``the recipe``, ``the launcher's
    default``). A first host elsewhere cannot be checked from here.
    """
    if not 0 < port < 65536:
        raise UserError(f"--master_port {port} is not a TCP port (1-65535)")
    first = hosts.names[0]
    if not is_this_machine(first):
        return
    if not port_is_free(port):
        where = f"{first} (the first host, this machine)" if hosts.multi_node else "this machine"
        raise UserError(f"master port {port} ({given}) is already in use on {where}; pass a free one, e.g. "
                        f"--master_port {free_port()}")


# -------------------------------------------------------------------------------------------------
# What goes through the remote shell
# -------------------------------------------------------------------------------------------------
def unsafe_chars(value: str) -> str:
    """The characters of ``value`` that a shell would not read literally ('' when there are none)."""
    if _SAFE_CHARS.fullmatch(value):
        return ""
    return "".join(sorted({c for c in value if not _SAFE_CHARS.fullmatch(c)}))


def check_remote_safe(items: Iterable[tuple[str, str]]) -> None:
    """Refuse values that DeepSpeed's PDSH runner would hand to the remote shell unquoted.

    ``items`` are ``(what, value)`` pairs: ``what`` names the value in the message (a flag, a path,
    a variable). The runner quotes only values with spaces, and in double quotes, where ``$``,
    backquotes and backslashes still act; so a ``--output_dir`` holding ``$(...)`` runs a command on
    every node (upstream has the same hole).
    """
    for what, value in items:
        bad = unsafe_chars(value)
        if bad:
            shown = shown_url(value) if "://" in value else value  # a URL's user, password and query as ***
            raise UserError(
                f"{what} {shown!r} holds {bad!r}, which the remote shell of a multi-node launch would "
                "interpret (DeepSpeed's PDSH runner does not quote it); use a value of letters, digits, "
                "spaces and _,./:=@+- (rename the path, or set the value in a file the step reads)"
            )


def check_forwarded_env(items: Iterable[tuple[str, str]]) -> None:
    """Refuse the variables DeepSpeed's runner forwards by itself (``items``: name, value) whose value
    would run a command in the remote shell (``$``, a backquote, ``;``, ``|``, ``&``, ``<``, ``>``, a
    quote, a backslash, a newline): it writes each as ``export K=V``, double-quoted only when it holds
    a space. Their other characters (``%``, ``~``, ``*``) are the user's to mean (NCCL's own
    ``NCCL_DEBUG_FILE=/tmp/nccl.%h.%p``)."""
    for name, value in items:
        bad = "".join(sorted(set(_COMMAND_CHARS.findall(value))))
        if bad:
            raise UserError(
                f"environment variable {name} holds {bad!r}, which the remote shell of a multi-node launch would "
                f"run as a command (DeepSpeed's runner forwards it to the ranks on other hosts as export "
                f"{name}=...); unset it or change its value for the launch")


def flag_values(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``(flag, value)`` pairs of a ``main.py`` argv, naming each token by the flag it belongs to."""
    out: list[tuple[str, str]] = []
    flag = "main.py argument"
    for token in argv:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            flag = name
            out.append((f"flag {name}", name))
            if eq:
                out.append((name, value))
        else:
            out.append((flag, token))
    return out


# -------------------------------------------------------------------------------------------------
# Environment of remote ranks
# -------------------------------------------------------------------------------------------------
def is_secret_name(name: str) -> bool:
    """Whether a variable's name looks like it holds a secret (``TOKEN``, ``SECRET``, ``PASSWORD``,
    ``PASSWD``, ``CREDENTIAL``, ``KEY`` at either end), in any case. The names of
    :data:`RANK_ENV_NAMES` are dschat's own list of settings, never secrets (``TOKENIZERS_PARALLELISM``)."""
    return name not in RANK_ENV_NAMES and bool(_SECRET_NAME.search(name))


def is_secret_value(value: str) -> bool:
    """Whether a variable's value holds a URL with a user or password (a token may be either) or a
    query, anywhere in it (``MLFLOW_TRACKING_URI=https://u:p@host``; pip's space-separated
    ``PIP_EXTRA_INDEX_URL``)."""
    return bool(_URL_SECRET.search(value))


def forwarded_secrets(environ: Mapping[str, str]) -> list[str]:
    """Names of ``environ`` that DeepSpeed's multi-node runner would forward by itself (their prefix
    is in :data:`DEEPSPEED_EXPORT_PREFIXES`) and that look like secrets (``MLFLOW_TRACKING_PASSWORD``,
    ``MLFLOW_TRACKING_TOKEN``): the runner writes forwarded variables into the remote command line,
    which every user of a host can read. The launcher removes them from the runner's environment."""
    return sorted(k for k, v in environ.items() if k.startswith(DEEPSPEED_EXPORT_PREFIXES)
                  and (is_secret_name(k) or is_secret_value(v)))


def secret_rank_values(environ: Mapping[str, str]) -> list[str]:
    """Names of ``environ`` that :func:`rank_env` would forward but for a value holding a URL's
    credentials (:func:`is_secret_value`, ``HF_ENDPOINT=https://u:p@mirror``): left out, and named."""
    return sorted(k for k, v in environ.items() if (k in RANK_ENV_NAMES or k.startswith(RANK_ENV_PREFIXES))
                  and k not in LOCAL_ONLY_ENV and not is_secret_name(k) and is_secret_value(v))


def rank_env(environ: Mapping[str, str], recipe_env: Mapping[str, str]) -> dict[str, str]:
    """Variables the remote ranks need: the recipe's (a value already set here wins, as on the first
    host) and the user's among :data:`RANK_ENV_NAMES` / :data:`RANK_ENV_PREFIXES`, secrets left out."""
    out = {k: v for k, v in environ.items()
           if (k in RANK_ENV_NAMES or k.startswith(RANK_ENV_PREFIXES)) and k not in LOCAL_ONLY_ENV
           and not is_secret_name(k) and not is_secret_value(v)}
    for key, value in recipe_env.items():
        if not key.startswith(DEEPSPEED_FORWARDS):
            out.setdefault(key, environ.get(key, value))
    return dict(sorted(out.items()))


def user_env_files(environ: Mapping[str, str], cwd: str | os.PathLike) -> list[Path]:
    """The ``.deepspeed_env`` files the launcher would read by itself, in its order (home, then the
    working directory; a later line wins)."""
    name = environ.get(ENV_FILE_VAR, ENV_FILE_NAME)
    home = Path(environ.get("HOME") or os.path.expanduser("~"))
    found: list[Path] = []
    for folder in (home, Path(cwd)):
        path = folder / name
        if path.is_file() and path.resolve() not in [p.resolve() for p in found]:
            found.append(path)
    return found


def _read_env_lines(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise UserError(f"{path} line {number} is not NAME=VALUE; DeepSpeed's launcher would stop on it")
        values[key.strip()] = value.strip()
    return values


def _user_env_values(environ: Mapping[str, str], cwd: str | os.PathLike) -> dict[str, str]:
    merged: dict[str, str] = {}
    for path in user_env_files(environ, cwd):
        merged.update(_read_env_lines(path))
    return merged


def secret_env_lines(environ: Mapping[str, str], cwd: str | os.PathLike) -> list[str]:
    """Names set by the user's ``.deepspeed_env`` files that look like secrets (:func:`is_secret_name`,
    :func:`is_secret_value`): :func:`write_rank_env_file` leaves them out of the launch's copy."""
    return sorted(k for k, v in _user_env_values(environ, cwd).items() if is_secret_name(k) or is_secret_value(v))


def rank_env_additions(needed: Mapping[str, str], environ: Mapping[str, str],
                       cwd: str | os.PathLike) -> dict[str, str]:
    """The variables of ``needed`` that no ``.deepspeed_env`` of the user sets (theirs win: they are
    what the user chose for the remote ranks). Values the remote shell would interpret are refused
    (:func:`check_remote_safe`): DeepSpeed puts each line into the remote command as ``export K=V``."""
    own = _user_env_values(environ, cwd)
    added = {k: v for k, v in needed.items() if k not in own}
    check_remote_safe((f"environment variable {k} (forwarded to the ranks on other hosts)", v)
                      for k, v in added.items())
    return added


def write_rank_env_file(added: Mapping[str, str], environ: Mapping[str, str], cwd: str | os.PathLike) -> Path:
    """Write the launch's ``.deepspeed_env`` into a new private folder and return it.

    It holds the user's own files' variables as DeepSpeed reads them (unchecked: what they chose to
    expand remotely is theirs), less the secret-looking ones (:func:`secret_env_lines`: DeepSpeed would
    put them on the remote command line), then ``added``. Point ``DS_ENV_FILE`` at it (an absolute
    path) and the launcher reads it instead of ``~/.deepspeed_env`` and ``./.deepspeed_env``, which
    stay untouched. The caller removes the folder after the launch.
    """
    own = {k: v for k, v in _user_env_values(environ, cwd).items() if not is_secret_name(k) and not is_secret_value(v)}
    merged = {**own, **added}
    folder = Path(tempfile.mkdtemp(prefix="dschat-launch-"))  # 0700, ours
    path = folder / ENV_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.writelines(f"{k}={v}\n" for k, v in merged.items())
    return path
