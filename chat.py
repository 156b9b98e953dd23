#!/usr/bin/env python3
"""Chat with a trained model: a thin wrapper that runs inference/chatbot.py (as upstream's chat.py).

    python chat.py --path output/step3-models/1.3b/actor [--max_new_tokens 128] [chatbot options]

Upstream built a shell string (``python3 ./inference/chatbot.py --path ...``) and needed to be run
from its folder; this runs the chatbot next to this file with an argument list, from anywhere, and
passes every other option (``--sample``, ``--format``, ...) through.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Sequence

CHATBOT = Path(__file__).resolve().parent / "inference" / "chatbot.py"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Chat with a trained actor (runs inference/chatbot.py).",
                                     epilog="Other options are passed to inference/chatbot.py (see its --help).")
    parser.add_argument("--path", type=str, required=True, help="Directory containing trained actor model")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="Maximum new tokens to generate per response")
    args, rest = parser.parse_known_args(argv)
    cmd = [sys.executable, str(CHATBOT), "--path", args.path, "--max_new_tokens", str(args.max_new_tokens), *rest]
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
