"""``python -m dschat.serve MODEL [--host 127.0.0.1] [--port 5000]``: serve a step-2 reward model
(``POST /get_reward``) or an actor (OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions``).

Order: parse -> what MODEL is (a step-2 reward model, :func:`is_reward_model`: its folder or its LoRA
``lora_adapter/`` folder; else a causal LM: a step-1/3 folder, a registry name, a hub id or a PEFT
adapter folder; else one line) -> bind the port (a busy one is one line naming ``--port``) -> load
the model (an actor: its decoder picked by ``--decoding_engine`` and warmed up) -> print the line
``serving <kind> <folder> on http://HOST:PORT (...)`` (the bound port, also for ``--port 0``; an
actor's line ends with ``; decoding with <engine>: <why>``) -> serve until stopped (Ctrl-C or SIGTERM:
an actor's open requests are answered 503 at once; then uvicorn's graceful shutdown, bounded: requests
still open after :data:`GRACEFUL_SHUTDOWN_SECONDS`, a client's half-sent body too, are cancelled and
the process exits). A reward model's ``--max_seq_len``
longer than its position table (OPT, GPT-2, ...: :func:`check_seq_len_fits_positions`, from the config)
is refused before the port is bound. Every refusal is one ``error:`` line, exit code 2. With
``DSCHAT_SERVE_API_KEY`` set, every route but ``GET /health`` needs ``Authorization: Bearer <key>``
(:mod:`dschat.serve.app`); without it a note says that every account that reaches the port can use
the model. A ``--host`` that is not a loopback address gets a warning
line: the server has no TLS.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Callable, Sequence

from dschat.errors import UserError, cli_main
from dschat.eval.scoring import check_reward_folder, pick_device
from dschat.models.registry import check_seq_len_fits_positions, load_config, resolve_model_path
from dschat.models.reward_model import is_reward_model_folder, value_head_file
from dschat.paths import is_adapter_folder, is_short_name
from dschat.remote_reward import API_KEY_ENV, check_api_key
from dschat.runtime.trust import is_loopback_host

try:  # the serve extra: pip install -c constraints.txt '.[serve]' in the checkout
    import uvicorn

    from dschat.serve.actor import engine_unsupported, load_actor_engine, resolve_actor, start_batcher
    from dschat.serve.app import build_actor_app, build_app
    from dschat.serve.reward_scorer import load_reward_scorer
except ImportError as err:
    _MISSING: ImportError | None = err
else:
    _MISSING = None

__all__ = ["GRACEFUL_SHUTDOWN_SECONDS", "build_parser", "main", "bind", "check_device", "is_reward_model"]

#: Seconds uvicorn waits, once stopped (Ctrl-C, SIGTERM), for open requests to finish before it cancels
#: them and exits: a client that never finishes sending its request cannot keep the server up.
GRACEFUL_SHUTDOWN_SECONDS = 5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dschat.serve",
                                     description="Serve a model over HTTP: a step-2 reward model on POST "
                                                 "/get_reward (OpenRLHF's remote reward protocol), an actor on "
                                                 "OpenAI-compatible /v1/completions and /v1/chat/completions; "
                                                 "GET /health.")
    parser.add_argument("model", metavar="MODEL",
                        help="A step-2 output folder (a reward model: body + value head), or an actor: a step-1 or "
                             "step-3 output folder, a registry name (tiny-opt, smollm2-135m), a hub id or a PEFT "
                             "adapter folder. An actor is served under this name (the requests' model field).")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to listen on (default 127.0.0.1: this machine only; the server has no TLS, "
                             "so another address gets a warning). Set DSCHAT_SERVE_API_KEY to require "
                             "'Authorization: Bearer <key>' on every route but /health.")
    parser.add_argument("--port", type=int, default=5000, help="Port to listen on (default 5000; 0: any free port).")
    parser.add_argument("--device", default="auto",
                        help="Torch device for the model: cpu, cuda or cuda:N (default auto: cuda if present).")
    parser.add_argument("--batch_size", type=int, default=16,
                        help="Reward model: texts scored per forward pass (default 16).")
    parser.add_argument("--max_seq_len", type=int, default=None,
                        help="Reward model: tokens of a text kept (its last ones: the score is read at the last "
                             "token). Default: the model's max_position_embeddings; more than a position table "
                             "holds (OPT, GPT-2, ...) is refused.")
    parser.add_argument("--max_batch_size", type=int, default=8,
                        help="Actor: requests (prompts) decoded together in one batch at most (default 8).")
    parser.add_argument("--max_wait_ms", type=float, default=5.0,
                        help="Actor: how long the first waiting request waits for others to join its batch "
                             "(default 5 ms; 0 to 60000).")
    parser.add_argument("--decoding_engine", default="auto", choices=("auto", "dschat", "loop"),
                        help="Actor: what decodes the batches, both step 3's own code. 'dschat': step 3's dschat "
                             "Hybrid Engine (its decode model: fused weights, a static KV cache; CUDA graphs on "
                             "CUDA, eager elsewhere); a model family its decode model does not cover is refused. "
                             "'loop': step 3's sample loop on the Hugging Face model (any causal LM). 'auto' "
                             "(default): 'dschat' where its decode model covers the family, else 'loop'. The "
                             "startup line says which serves and why.")
    parser.add_argument("--log_level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level (default info: one access line per request).")
    return parser


def is_reward_model(folder: Path) -> bool:
    """Whether ``folder`` is a step-2 reward model: a model folder that is one, or a LoRA adapter folder
    with the value head beside it (a step-2 LoRA output's ``lora_adapter/``: no ``config.json``)."""
    if (folder / "config.json").is_file():
        return is_reward_model_folder(folder)
    return is_adapter_folder(folder) and value_head_file(folder).is_file()


def check_device(spec: str) -> None:
    """One :class:`UserError` line for a ``--device`` that is not a torch device this machine has (the
    check the report and the chat CLI share: :func:`~dschat.eval.scoring.pick_device`)."""
    pick_device(spec)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``(host, port)`` (not yet listening); a busy port or an address this machine
    does not have is one :class:`UserError` line."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is not a port number; give one in 0-65535 (0: any free port)")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise UserError(f"--host {host!r} is not an address of this machine ({err.strerror})") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UserError(f"--port {port} on {host} is in use by another process; pick another --port "
                            "(0: any free port)") from None
        raise UserError(f"cannot listen on --host {host} --port {port}: {err.strerror}") from None
    return sock


#: --max_wait_ms's highest value: the batch's wait goes to threading's wait, which takes no more
#: than threading.TIMEOUT_MAX (inf raised in the decoding thread; every request then hung).
MAX_WAIT_MS = 60_000


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(_main, argv)


def _answering_first(handle_exit: Callable[[int, FrameType | None], None],
                     shut_down: Callable[[], None]) -> Callable[[int, FrameType | None], None]:
    """uvicorn's signal handler ``handle_exit``, calling ``shut_down`` (the batcher's: every open request
    answered 503 with OpenAI's error body) first, so that its graceful shutdown finds them answered
    rather than cancelling them at its limit without one."""
    def handle(sig: int, frame: FrameType | None) -> None:
        shut_down()
        handle_exit(sig, frame)
    return handle


def _main(argv: Sequence[str] | None) -> None:
    args = build_parser().parse_args(argv)
    if _MISSING is not None:
        raise UserError(f"python -m dschat.serve needs the serve extra ({_MISSING}); in the dschat checkout: "
                        "pip install -c constraints.txt '.[serve]'")
    folder = Path(args.model).expanduser()
    reward = not is_short_name(args.model) and is_reward_model(folder)  # a short name is the registry's
    if reward and is_adapter_folder(folder):
        resolve_model_path(str(folder))  # the adapter and the base it names: one line for a bad one
    elif reward:
        check_reward_folder(folder)
    else:
        actor = resolve_actor(args.model)  # one line for what is neither (before the port is bound)
        if args.decoding_engine == "dschat" and (refusal := engine_unsupported(load_config(actor), args.model)):
            raise UserError(refusal)
    if args.batch_size < 1:
        raise UserError(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.max_batch_size < 1:
        raise UserError(f"--max_batch_size must be >= 1, got {args.max_batch_size}")
    if not 0 <= args.max_wait_ms <= MAX_WAIT_MS:  # NaN fails too; inf stopped the decoding thread
        raise UserError(f"--max_wait_ms must be a number from 0 to {MAX_WAIT_MS} (a minute), got {args.max_wait_ms}")
    if args.max_seq_len is not None and args.max_seq_len < 1:
        raise UserError(f"--max_seq_len must be >= 1, got {args.max_seq_len}")
    if reward and args.max_seq_len is not None:
        check_seq_len_fits_positions(str(folder), args.max_seq_len)  # from the config, before any weight loads
    check_device(args.device)
    api_key = os.environ.get(API_KEY_ENV) or None
    if api_key is not None:
        check_api_key(api_key)  # before the port is bound: a key no client could send
    if not is_loopback_host(args.host):
        print(f"warning: --host {args.host} serves beyond this machine without TLS"
              + ("" if api_key else f" and without an API key ({API_KEY_ENV}): anyone who reaches the port can use "
                 "the model"), file=sys.stderr, flush=True)
    elif api_key is None:
        print(f"note: no {API_KEY_ENV} set: every account on this machine can use the model through the port",
              file=sys.stderr, flush=True)
    sock = bind(args.host, args.port)
    try:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        if reward:
            scorer = load_reward_scorer(folder, device=args.device, max_len=args.max_seq_len,
                                        batch_size=args.batch_size)
            app = build_app(scorer, api_key)
            print(f"serving reward model {folder} on http://{shown}:{port} (POST /get_reward, GET /health)",
                  flush=True)
        else:
            engine = load_actor_engine(args.model, device=args.device)
            batcher, decoding = start_batcher(engine, args.decoding_engine, args.max_batch_size,
                                              args.max_wait_ms / 1000)
            app = build_actor_app(engine, batcher, api_key)
            print(f"serving actor {args.model} on http://{shown}:{port} (GET /v1/models, POST /v1/completions, "
                  f"POST /v1/chat/completions, GET /health); decoding with {decoding}", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_keep_alive=75,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
        server = uvicorn.Server(config)
        if not reward:  # open requests are answered 503 as the server begins to stop
            server.handle_exit = _answering_first(server.handle_exit, batcher.shut_down)
        server.run(sockets=[sock])
    finally:
        sock.close()
