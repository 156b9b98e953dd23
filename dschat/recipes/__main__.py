"""``python -m dschat.recipes``."""
from dschat.errors import cli_main
from dschat.recipes.cli import main

if __name__ == "__main__":
    raise SystemExit(cli_main(main))
