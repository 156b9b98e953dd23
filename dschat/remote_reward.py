"""A reward served over HTTP (``--reward_url``): OpenRLHF's remote reward-model protocol.

One request is a POST of JSON to the URL::

    {"query": [prompt + answer, ...], "prompts": [prompt, ...], "labels": [label, ...]}

and its reply is JSON ``{"rewards": [float, ...]}``, one finite float (in float32) per query, in the
order of the queries. ``labels`` holds each row's reference answer -- the dataset column ``answer``
(:data:`LABEL_COLUMN`) as a string -- or ``""`` for every row when the data has no such column, so the
three lists always have the same length.

:class:`RemoteReward` is a reward function (``fn(prompts, answers, **columns) -> list[float]``), so
step 3 weighs it into the :class:`~dschat.rewards.RewardMix` as a ``--reward_fn``. A call sends the
batch in chunks of at most ``chunk_size`` queries, concurrently (at most
:data:`MAX_CONCURRENT_REQUESTS` at a time, on daemon threads of the call), over one kept-alive
``requests.Session``. Each attempt of a request has ``timeout`` seconds for each step of making its
connection and between bytes of the reply. Once it has its connection, the attempt (sending, waiting
for and reading the whole reply) ends ``2 * timeout`` after it began at the latest: at that limit
the connection is shut down, however slowly the server is still sending, and the attempt counts as a
timeout. Making the connection is held to its own steps' limits only (an attempt whose connection is
made past its limit ends as soon as it is made): the name lookup has none, connecting has
``timeout`` for each address the host name resolves to, a TLS handshake ``timeout`` for each of its
reads (:func:`worst_case_seconds` tells what is bounded). A request is retried ``retries`` times
after a connection error, a timeout or an HTTP 408, 429 or 5xx status, waiting ``backoff * 2**i``
seconds before retry ``i``. Any other failure is not retried (a request that cannot be made at all,
such as requests' ``InvalidURL``, ``InvalidSchema`` or ``InvalidHeader``, neither). What goes wrong
stops the run with one :class:`~dschat.errors.UserError` line naming the URL: the last error once
the retries are spent, an HTTP error status, or a reply of the wrong shape (not JSON, no
``"rewards"`` list, the wrong number of rewards, a reward that is not a finite number, more than
:data:`MAX_REPLY_BYTES`). A network error is told by its type and the socket's reason
(``ConnectionRefusedError: [Errno 111] Connection refused``), never by requests' or urllib3's own
text, which quotes the URL (its query, where keys go) or the headers. The first failing request
stops the call at once: requests in flight are not waited for (they run on daemon threads, which do
not hold the process at exit), those not yet sent are not sent.

With ``DSCHAT_SERVE_API_KEY`` set (:data:`API_KEY_ENV`, the key ``python -m dschat.serve`` then
requires) every request to a loopback or ``https://`` URL carries ``Authorization: Bearer <key>``
(never one in clear to another host); a key that holds whitespace (a line break at its end), a
control or a non-ASCII character, which no header carries, is refused when the client is made.
Before each call to a loopback URL the owners of the sockets listening on its port (at a loopback
address or at every address) are read from ``/proc/net/tcp`` and ``tcp6`` (Linux): a server of
another account on this machine is refused with one line, before any prompt or key is sent to it.
Lines and names show the URL without its user, password and query
(:func:`~dschat.errors.shown_url`).

Nothing here talks to the network until the object is called.
"""
from __future__ import annotations

import json
import math
import os
import queue
import socket
import threading
import time
from contextlib import suppress
from functools import lru_cache
from typing import Any, Sequence
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from dschat.errors import UserError, shown_url
from dschat.rewards import MATH_REFERENCE_COLUMN, RewardFunction, as_float32, check_timeout, check_weight
from dschat.runtime.trust import is_loopback_host, listener_owners

__all__ = [
    "RemoteReward",
    "remote_reward_function",
    "check_reward_url",
    "plain_http_warning",
    "API_KEY_ENV",
    "LABEL_COLUMN",
    "QUERIES_PER_REQUEST",
    "MAX_CONCURRENT_REQUESTS",
    "MAX_REPLY_BYTES",
    "worst_case_seconds",
    "check_api_key",
]

#: The dataset column sent as ``labels`` (the reference answer; GSM8K's name for it).
LABEL_COLUMN = MATH_REFERENCE_COLUMN
#: Most queries in one request; a larger batch is split into several requests.
QUERIES_PER_REQUEST = 256
#: Most requests of one call in flight at once.
MAX_CONCURRENT_REQUESTS = 8
#: Most bytes of a reply (after its content encoding is undone); a longer one is refused.
MAX_REPLY_BYTES = 64 * 2**20
#: Seconds before the first retry; doubled before each later one.
BACKOFF_SECONDS = 0.5
_READ_BYTES = 64 * 1024
_ERROR_TEXT_BYTES = 4096  # read of an error status's reply, for its line
_RETRY_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
#: The API key dschat's server requires and this client sends (``Authorization: Bearer <key>``).
API_KEY_ENV = "DSCHAT_SERVE_API_KEY"


def check_reward_url(url: str) -> str:
    """``url`` if it is an ``http://`` or ``https://`` URL with a host, else one :class:`UserError` line."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--reward_url {shown_url(url)!r} is not an http:// or https:// URL with a host (e.g. "
                        "http://127.0.0.1:5000/get_reward)")
    try:
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        raise UserError(f"--reward_url {shown_url(url)!r} has a bad port; give a number in 1-65535") from None
    return url


def plain_http_warning(url: str) -> str | None:
    """The start-up warning for a plain ``http://`` URL to a host that is not this machine (the prompts
    and answers cross the network unencrypted), else None."""
    parts = urlsplit(url)
    if parts.scheme == "http" and not is_loopback_host(parts.hostname or ""):
        unsent = f" ({API_KEY_ENV} is not sent over it)" if os.environ.get(API_KEY_ENV) else ""
        return (f"warning: --reward_url {shown_url(url)} is plain http:// to a host that is not this machine: the prompts "
                f"and answers cross the network unencrypted{unsent}; use https:// or a loopback address")
    return None


def check_api_key(key: str) -> None:
    """One line when ``key`` (:data:`API_KEY_ENV`'s value) holds whitespace, a control or a non-ASCII
    character: a trailing line break or carriage return (a key file, a copy-paste) most often. Such
    a key could not travel in ``Authorization: Bearer <key>``; the client and ``python -m
    dschat.serve`` refuse it alike, so a server never starts with a key no client can send."""
    if not (key.isascii() and key.isprintable() and not any(c.isspace() for c in key)):
        raise UserError(f"{API_KEY_ENV} holds whitespace (a line break at its end?), a control or a non-ASCII "
                        "character, which an HTTP header cannot carry; set it to the key alone")


def worst_case_seconds(timeout: float, retries: int, backoff: float = BACKOFF_SECONDS) -> float:
    """The most seconds one request may take before its reply or its failure line when each of its
    ``retries + 1`` attempts has its connection (made or reused) within ``2 * timeout`` of its start:
    such an attempt ends ``2 * timeout`` after its start at the latest (sending, and waiting for and
    reading the whole reply, however slowly it comes), and the backoffs come between attempts.
    Not bounded by it: making a connection, whose steps keep their own limits past the attempt's (the
    name lookup none, connecting ``timeout`` for each address the host name resolves to, a TLS
    handshake ``timeout`` for each of its reads), so an attempt that connects later ends when its
    connection is made; and the requests of a call beyond :data:`MAX_CONCURRENT_REQUESTS`
    (``QUERIES_PER_REQUEST`` queries each), which wait for a free thread."""
    retries = min(max(int(retries), 0), 40)  # beyond that, longer than any run
    return (retries + 1) * 2.0 * float(timeout) + backoff * (2.0 ** retries - 1)


def _reason(err: BaseException) -> str:
    """``err``'s type and, where one caused it, the socket's own error (``ConnectionRefusedError:
    [Errno 111] Connection refused``): never requests' or urllib3's text, which quotes the URL or
    the headers."""
    seen, todo, socket_error = set(), [err], None
    while todo:  # the chain: causes, contexts, urllib3's .reason, exceptions held as arguments
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        module = type(current).__module__.split(".")[0]
        if isinstance(current, OSError) and module not in ("requests", "urllib3") and socket_error is None:
            socket_error = current
        todo += [x for x in (current.__cause__, current.__context__, getattr(current, "reason", None), *current.args)
                 if isinstance(x, BaseException)]
    if socket_error is None:
        return type(err).__name__
    return f"{type(err).__name__} ({type(socket_error).__name__}: {_short(socket_error)})"


class _Retryable(Exception):
    """A failure worth another attempt (connection, timeout, 408/429/5xx)."""


_OWNERS = threading.Lock()  # guards which attempt each connection is serving
_running = threading.local()  # .deadline: the deadline of the attempt running on this thread


class _Deadline:
    """The end of one attempt, ``seconds`` after it is entered (a context manager around the attempt,
    on its thread). When it passes, :attr:`passed` is set and the socket of the connection the attempt
    holds is shut down, so that a wait on it (to send, for the reply's head or for more of its body)
    ends at once with an error or an early end of the reply. A connection is the attempt's from its
    ``connect`` or ``request`` on the attempt's thread (:class:`_Watched`) until it goes back to the
    pool (:class:`_Pooled`, once its reply is read whole or it is closed) or another attempt takes
    it; one connected after the deadline is shut down as soon as it is connected. :attr:`cut` tells
    whether the deadline ended the attempt's exchange: it passed while the attempt held a connection
    or before it took one. A wait that has no socket of the connection yet (the name lookup,
    connecting) or whose socket is detached (a TLS handshake under way) is not ended."""

    def __init__(self, seconds: float) -> None:
        self.passed = False
        self.cut = False
        self._over = False
        self._connection: Any = None
        self._timer = threading.Timer(seconds, self._pass)
        self._timer.daemon = True

    def __enter__(self) -> "_Deadline":
        self._timer.start()  # first: a timer that cannot start leaves the thread without a deadline
        _running.deadline = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _running.deadline = None
        self._timer.cancel()
        with _OWNERS:
            self._over = True

    def take(self, connection: Any) -> None:
        with _OWNERS:
            self._connection, connection._reward_deadline = connection, self
            if self.passed:
                self.cut = True
                self._shut()

    def _pass(self) -> None:
        with _OWNERS:
            if not self._over:
                self.passed = True
                self.cut = self._connection is None or self._connection._reward_deadline is self
                self._shut()

    def _shut(self) -> None:
        connection = self._connection
        sock = _socket_of(getattr(connection, "sock", None) or getattr(connection, "_reward_socket", None))
        if sock is not None and connection._reward_deadline is self:
            with suppress(OSError, TypeError):  # closed already, or detached by a TLS handshake under way
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the socket's own, under TLS too


def _socket_of(sock: Any) -> socket.socket | None:
    """The ``socket.socket`` a connection's ``sock`` is or wraps (through an https proxy to an https
    URL, urllib3's ``SSLTransport`` holds it as ``.socket``), or None where it leads to none."""
    for _ in range(8):  # a transport wraps a socket or another transport; never a loop
        if sock is None or isinstance(sock, socket.socket):
            return sock
        sock = getattr(sock, "socket", None)
    return None


def _take(connection: Any) -> None:
    deadline = getattr(_running, "deadline", None)
    if deadline is not None:
        deadline.take(connection)


class _Watched:
    """Mixed into a urllib3 connection class: the attempt on the calling thread can end the connection
    at its :class:`_Deadline`."""

    def connect(self) -> None:
        _take(self)  # a wait for a proxy's tunnel, on the new socket, ends at the deadline too
        super().connect()  # type: ignore[misc]
        # Kept: a reply that ends with the connection (Connection: close, no length, HTTP/1.0) takes
        # the socket, and http.client drops it from the connection.
        self._reward_socket = self.sock
        _take(self)  # a deadline that passed while connecting ends it now

    def request(self, *args: Any, **kwargs: Any) -> Any:
        _take(self)
        return super().request(*args, **kwargs)  # type: ignore[misc]


class _Pooled:
    """Mixed into a urllib3 connection pool class: a connection put back in the pool (its reply read
    whole, or the connection closed) serves no attempt any more, so no attempt's deadline, passing
    later, shuts it down while another attempt takes it from the pool."""

    def _put_conn(self, conn: Any, *args: Any, **kwargs: Any) -> Any:
        if conn is not None:
            with _OWNERS:
                conn._reward_deadline = None
        return super()._put_conn(conn, *args, **kwargs)  # type: ignore[misc]


@lru_cache(maxsize=None)
def _watched_pool(pool_class: type) -> type:
    """``pool_class`` with :class:`_Pooled` mixed in, making connections of its own class with
    :class:`_Watched` mixed in."""
    if issubclass(pool_class.ConnectionCls, _Watched):
        return pool_class
    connection = type(pool_class.ConnectionCls.__name__, (_Watched, pool_class.ConnectionCls), {})
    return type(pool_class.__name__, (_Pooled, pool_class), {"ConnectionCls": connection})


def _watch(manager: Any) -> Any:
    manager.pool_classes_by_scheme = {scheme: _watched_pool(pool_class)
                                      for scheme, pool_class in manager.pool_classes_by_scheme.items()}
    return manager


class _Adapter(HTTPAdapter):
    """requests' adapter, with connections (direct or through a proxy) that a :class:`_Deadline` can end."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        _watch(self.poolmanager)

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        return _watch(super().proxy_manager_for(proxy, **proxy_kwargs))


# A loopback URL is this machine's server: never through HTTP(S)_PROXY / ALL_PROXY (requests does not
# skip them for 127.0.0.1), which would carry the key, prompts and answers off it. A scheme given None
# here is sent directly, and "no_proxy" keeps the environment's proxies off a redirect the server
# answers (requests looks them up again for it); the environment's CA bundle still applies.
_NO_PROXY = {"http": None, "https": None, "all": None, "no_proxy": "*"}


class RemoteReward:
    """The reward function of one reward server (see the module docstring for the protocol).

    ``timeout``: seconds per request (> 0); ``retries``: further attempts after a retryable failure
    (>= 0); ``chunk_size``: most queries per request; ``backoff``: seconds before the first retry.
    Thread-safe: the session's connection pool holds one connection per concurrent request.
    """

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int = 3, chunk_size: int = QUERIES_PER_REQUEST,
                 backoff: float = BACKOFF_SECONDS) -> None:
        self.url = check_reward_url(url)
        timeout = check_timeout(timeout, "--reward_url_timeout", zero_is_no_limit=False)
        if retries < 0:
            raise UserError(f"--reward_url_retries must be >= 0, got {retries}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.timeout, self.retries, self.chunk_size, self.backoff = float(timeout), int(retries), chunk_size, backoff
        self.shown = shown_url(url)
        parts = urlsplit(url)  # the key goes to this machine or over TLS, never in clear across the network
        self.loopback = is_loopback_host(parts.hostname or "")
        private = parts.scheme == "https" or self.loopback
        self.api_key = (os.environ.get(API_KEY_ENV) or None) if private else None
        if self.api_key is not None:
            check_api_key(self.api_key)
        self._session: requests.Session | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteReward({self.shown!r})"

    def check_owner(self) -> None:
        """A loopback URL whose port another account's server listens on: one :class:`UserError` line."""
        parts = urlsplit(self.url)
        if not is_loopback_host(parts.hostname or "") or not hasattr(os, "getuid"):
            return
        port = parts.port or (443 if parts.scheme == "https" else 80)
        others = sorted(listener_owners(port) - {os.getuid()})
        if others:
            owner = others[0]
            raise UserError(f"--reward_url {self.shown}: the server listening on port {port} belongs to another "
                            f"account (uid {owner}), so the prompts and answers would go to it; start your own "
                            "reward server on a free port (python -m dschat.serve FOLDER --port 0 prints it) and "
                            "pass its URL")

    def _unauthorized(self) -> str:
        """The fix for an HTTP 401: the key to set, or why it was not sent."""
        if self.api_key is None and os.environ.get(API_KEY_ENV):
            return (f"{API_KEY_ENV} is set but not sent to a plain http:// URL of another host (it would cross the "
                    "network in clear); reach the server through an SSH tunnel (a loopback URL) or https://")
        return f"set {API_KEY_ENV} to the server's API key"

    def session(self) -> requests.Session:
        """The one kept-alive session, made on first use."""
        with self._lock:
            if self._session is None:
                session = requests.Session()
                adapter = _Adapter(pool_connections=1, pool_maxsize=MAX_CONCURRENT_REQUESTS)
                session.mount("http://", adapter)
                session.mount("https://", adapter)
                if self.api_key is not None:
                    session.headers["Authorization"] = f"Bearer {self.api_key}"
                self._session = session
            return self._session

    def close(self) -> None:
        """Close the session's connections (a later call opens new ones)."""
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None

    def __call__(self, prompts: list[str], answers: list[str], **columns: Sequence[Any]) -> list[float]:
        """One reward per answer, in order, from the server. Raises one :class:`UserError` line on failure."""
        if len(prompts) != len(answers):
            raise ValueError(f"{len(prompts)} prompts for {len(answers)} answers")
        if not answers:
            return []
        labels = columns.get(LABEL_COLUMN)
        labels = ["" if x is None else str(x) for x in labels] if labels is not None else [""] * len(answers)
        payloads = [{"query": [p + a for p, a in zip(prompts[i:i + self.chunk_size], answers[i:i + self.chunk_size])],
                     "prompts": list(prompts[i:i + self.chunk_size]), "labels": labels[i:i + self.chunk_size]}
                    for i in range(0, len(answers), self.chunk_size)]
        self.check_owner()
        if len(payloads) == 1:
            return self._post(payloads[0])
        return [score for part in self._post_all(payloads) for score in part]

    def _post_all(self, payloads: list[dict[str, list[str]]]) -> list[list[float]]:
        """Each payload's rewards, in order, at most :data:`MAX_CONCURRENT_REQUESTS` requests in flight
        on daemon threads of this call. The first failure to happen (or a Ctrl-C) is raised at once:
        requests in flight are not waited for, and neither those not yet sent nor a retry is sent."""
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(payloads)):
            todo.put(i)
        finished: queue.Queue[tuple[int, list[float] | None, BaseException | None]] = queue.Queue()
        stop = threading.Event()

        def work() -> None:
            while not stop.is_set():
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    finished.put((i, self._post(payloads[i], stop), None))
                except BaseException as err:  # noqa: BLE001 -- handed to the caller, which raises it
                    stop.set()  # before the caller hears of it: no worker takes another payload
                    finished.put((i, None, err))

        for _ in range(min(len(payloads), MAX_CONCURRENT_REQUESTS)):
            threading.Thread(target=work, name="reward_url", daemon=True).start()
        parts: list[list[float]] = [[] for _ in payloads]
        try:
            for _ in payloads:
                i, part, err = finished.get()
                if err is not None:
                    raise err
                parts[i] = part or []
        finally:
            stop.set()
        return parts

    def _post(self, payload: dict[str, list[str]], stop: threading.Event | None = None) -> list[float]:
        """The rewards of one request, after at most ``retries`` retries (none once ``stop`` is set)."""
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
                if stop is not None and stop.is_set():
                    break
            try:
                return self._attempt(payload)
            except _Retryable as err:
                last = err
        attempts = "once" if self.retries == 0 else f"{self.retries + 1} times"
        raise UserError(f"--reward_url {self.shown} failed {attempts} (--reward_url_retries "
                        f"{self.retries}); last error: {last}; check that the reward server is up and reachable, or "
                        "raise --reward_url_timeout / --reward_url_retries (a server that scores one request at a "
                        "time makes the others wait: every rank's, every run's)")

    def _attempt(self, payload: dict[str, list[str]]) -> list[float]:
        deadline, failure = _Deadline(2 * self.timeout), None
        try:
            with deadline:
                status, body, whole = self._exchange(payload)
        except requests.RequestException as err:
            failure = err
        if deadline.cut:  # a reply read whole before the limit counts; one it cut short may look whole
            raise _Retryable(f"the reply did not arrive whole within {2 * self.timeout:g} s (twice "
                             f"--reward_url_timeout {self.timeout:g} s)")
        if isinstance(failure, requests.Timeout):
            raise _Retryable(f"no reply within --reward_url_timeout {self.timeout:g} s "
                             f"({type(failure).__name__})")
        if isinstance(failure, requests.TooManyRedirects):  # a loop of redirects: no retry mends it
            raise UserError(f"--reward_url {self.shown} keeps redirecting ({_reason(failure)}); pass the URL the "
                            "server answers at")
        if isinstance(failure, ValueError):  # InvalidURL, InvalidSchema, InvalidHeader, ...: no retry mends it
            raise UserError(f"--reward_url {self.shown}: the request cannot be made ({_reason(failure)}); check "
                            f"the URL (and {API_KEY_ENV})")
        if failure is not None:
            raise _Retryable(_reason(failure))
        if status in _RETRY_STATUS:
            raise _Retryable(f"HTTP {status} {_short(_text(body))}")
        if status != 200:
            raise UserError(f"--reward_url {self.shown} answered HTTP {status} {_short(_text(body))}; "
                            + (self._unauthorized() if status == 401 else
                               "check the URL (a dschat server's route is /get_reward)"))
        return self._rewards(body, whole, len(payload["query"]))

    def _exchange(self, payload: dict[str, list[str]]) -> tuple[int, bytes, bool]:
        """The reply's status, its body and whether that is the whole body: the whole of a 200 reply
        up to :data:`MAX_REPLY_BYTES` (none of a longer one, which is refused), the first
        ``_ERROR_TEXT_BYTES`` of another status's (for its line)."""
        with self.session().post(self.url, json=payload, timeout=self.timeout, stream=True,
                                 proxies=_NO_PROXY if self.loopback else None) as reply:
            moved = next((r for r in reply.history if r.status_code in (301, 302, 303)), None)
            if moved is not None:  # requests followed it with a GET, without the queries
                raise UserError(f"--reward_url {self.shown} answered HTTP {moved.status_code} (moved to "
                                f"{shown_url(moved.headers.get('Location', '?'))}), which turns the POST into a GET; "
                                "pass the URL it moved to")
            limit = MAX_REPLY_BYTES if reply.status_code == 200 else _ERROR_TEXT_BYTES
            parts, size = [], 0
            for part in reply.iter_content(_READ_BYTES):
                parts.append(part)
                size += len(part)
                if size > limit:  # a refused reply is not kept; an error status's start makes its line
                    return reply.status_code, b"" if reply.status_code == 200 else b"".join(parts)[:limit], False
            return reply.status_code, b"".join(parts), True

    def _rewards(self, body: bytes, whole: bool, expected: int) -> list[float]:
        """The reply's ``"rewards"``, checked: a list of ``expected`` finite numbers."""
        def wrong(what: str) -> UserError:
            return UserError(f"--reward_url {self.shown} replied {what}; a reward server replies JSON "
                             f'{{"rewards": [...]}} with one finite float per query')
        if not whole:
            raise wrong(f"with more than {MAX_REPLY_BYTES / 2**20:g} MiB")
        try:
            reply = json.loads(body)  # UTF-8, or UTF-16/32 told by their zero bytes
        except (ValueError, RecursionError):  # a UnicodeDecodeError is one; RecursionError: nested too deep
            raise wrong(f"with something that is not JSON ({_short(_text(body))!r})") from None
        if not isinstance(reply, dict) or "rewards" not in reply:
            raise wrong(f"JSON without a \"rewards\" key ({_short(json.dumps(reply))})")
        rewards = reply["rewards"]
        if not isinstance(rewards, list):
            raise wrong(f"\"rewards\" of type {type(rewards).__name__}, not a list")
        if len(rewards) != expected:
            raise wrong(f"{len(rewards)} rewards for {expected} queries")
        scores = []
        for i, value in enumerate(rewards):
            try:  # a bool is no score; an int past float's range overflows
                score = math.nan if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
            except OverflowError:
                score = math.inf
            if not math.isfinite(as_float32(score)):
                raise wrong(f"reward {_short(repr(value), 40)} for query {i}, not a finite number (in float32)")
            scores.append(score)
        return scores


def _text(body: bytes) -> str:
    return body.decode("utf-8", errors="replace")


def _short(value: Any, limit: int = 120) -> str:
    flat = " ".join(str(value).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def remote_reward_function(url: str, weight: float = 1.0, timeout: float = 60.0, retries: int = 3) -> RewardFunction:
    """The ``--reward_url`` term of step 3's reward mix, weighted (``--reward_url_weight``). Its own
    timeout per request replaces the mix's per-call one."""
    weight = check_weight(weight, "--reward_url_weight")
    reward = RemoteReward(url, timeout=timeout, retries=retries)
    return RewardFunction(reward.shown, reward, weight)
