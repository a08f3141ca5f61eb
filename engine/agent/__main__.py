"""Entry point of ``python -m engine.agent`` and the ``kvfleet-agent`` console script."""

import sys

from engine.agent.cli import main as _cli_main


def main() -> int:
    return _cli_main()


if __name__ == "__main__":
    sys.exit(main())
