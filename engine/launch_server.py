"""``python -m engine.launch_server``: an SGLang-compatible engine worker (same flags, same HTTP API).

Start-up errors (unknown flag, bad value, unusable model path) print one line naming the flag or path and
exit with status 2 (arguments) or 1 (model); nothing is served then.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from engine.model.errors import ModelLoadError
from engine.server.app import create_app
from engine.server.args import ArgumentError, parse_args
from engine.server.builder import build_engine


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ArgumentError as exc:
        print(f"engine.launch_server: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    try:
        engine = build_engine(args)
    except ArgumentError as exc:
        print(f"engine.launch_server: error: {exc}", file=sys.stderr)
        return 2
    except ModelLoadError as exc:
        print(f"engine.launch_server: error: --model-path {exc}", file=sys.stderr)
        return 1
    try:
        uvicorn.run(
            create_app(engine),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.scheduler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
