#!/usr/bin/env python3
"""Chat with a trained model: a thin wrapper that runs inference/chatbot.py (as upstream's chat.py).

    python chat.py --path output/step3-models/1.3b/actor [--max_new_tokens 128] [chatbot options]

Upstream built a shell string (``python3 ./inference/chatbot.py --path ...``) and needed to be run
from its folder; this runs the chatbot next to this file with an argument list, from anywhere, and
passes every other option (``--sample``, ``--format``, ...) through. The chatbot replaces this process
(``exec``): a terminal's Ctrl-C reaches it alone, so one pressed while an answer is written drops that
turn and the chat goes on, as with ``inference/chatbot.py`` itself.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn, Sequence

CHATBOT = Path(__file__).resolve().parent / "inference" / "chatbot.py"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(description="Chat with a trained actor (runs inference/chatbot.py).",
                                     epilog="Other options are passed to inference/chatbot.py (see its --help).")
    parser.add_argument("--path", type=str, required=True, help="Directory containing trained actor model")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="Maximum new tokens to generate per response")
    args, rest = parser.parse_known_args(argv)
    cmd = [sys.executable, str(CHATBOT), "--path", args.path, "--max_new_tokens", str(args.max_new_tokens), *rest]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    main()
