"""``python -m engine.launch_server``: an SGLang-compatible engine worker (same flags, same HTTP API).

Start-up errors print one line naming the flag or path and exit before anything is served:

- 2: arguments (unknown flag, bad value) or ``--host``/``--port`` that cannot be bound (e.g. the port is in
  use); the address is bound before the model loads, so this fails fast.
- 1: the model (``--model-path`` unusable).

Flags are parsed before the model stack (torch, the model, the HTTP server) is imported, so ``--help`` and
a flag error answer at once. An unknown flag names the closest real ones, and an upstream SGLang flag this
engine does not implement says so (:mod:`engine.server.upstream_flags`).

Once serving, a scheduler thread that dies (a crash) stops the server and the process exits with 3 (the cause
is logged), so a supervisor restarts the worker instead of keeping a process that can only answer 503.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from engine.server.args import ArgumentError, parse_args

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger("engine.launch_server")
EXIT_SCHEDULER_DIED = 3
HARD_EXIT_AFTER_S = 15.0  # uvicorn's graceful shutdown is 5 s; past this the process is ended outright


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` contains ':'); ``ArgumentError`` naming
    ``--port`` when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ArgumentError(f"--port {port}: cannot listen on {host}:{port}: {reason}") from None


def exit_when_scheduler_dies(scheduler, server: uvicorn.Server) -> threading.Thread:
    """Watch ``scheduler``: when its thread ends with a crash, log the cause and ask ``server`` to stop
    (pending requests were already failed with 503 by the scheduler); if the process is still up
    ``HARD_EXIT_AFTER_S`` later, exit it with ``EXIT_SCHEDULER_DIED``. A deliberate ``stop`` exits quietly."""

    def watch() -> None:
        scheduler.join()
        if scheduler.error is None:
            return
        logger.error(
            "scheduler thread died (%r); stopping the server, exit code %d",
            scheduler.error,
            EXIT_SCHEDULER_DIED,
        )
        server.should_exit = True
        time.sleep(HARD_EXIT_AFTER_S)
        logger.error("server did not stop within %.0fs of the scheduler's death; exiting", HARD_EXIT_AFTER_S)
        os._exit(EXIT_SCHEDULER_DIED)

    thread = threading.Thread(target=watch, name="scheduler-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        sock = bind_listen_socket(args.host, args.port)
        sidecar = _bind_sidecar(args) if args.grpc_mode else None
    except ArgumentError as exc:
        return _launch_error(exc)
    with sock:
        logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
        # the model stack (torch, the model, the HTTP app) loads only once the flags are known to be good
        from engine.model.errors import ModelLoadError
        from engine.server.app import create_app
        from engine.server.builder import build_engine

        if args.encoder_only:
            return _serve_encoder(args, sock)
        try:
            engine = build_engine(args)
        except (ArgumentError, ModelLoadError) as exc:
            return _launch_error(exc)
        if args.grpc_mode:
            assert sidecar is not None, "bound above for --grpc-mode"
            return _serve_grpc(engine, args, sock, sidecar)
        server = _uvicorn_server(create_app(engine), args)
        exit_when_scheduler_dies(engine.scheduler, server)
        try:
            server.run(sockets=[sock])
        finally:
            engine.shutdown()
    return EXIT_SCHEDULER_DIED if engine.scheduler.error is not None else 0


def _launch_error(exc: Exception) -> int:
    """Print why the worker cannot start; its exit status: 2 for bad flags (as argparse), 1 for a model
    that does not load (``ModelLoadError``, named by ``--model-path``)."""
    from engine.model.errors import ModelLoadError

    if isinstance(exc, ModelLoadError):
        print(f"engine.launch_server: error: --model-path {exc}", file=sys.stderr)
        return 1
    print(f"engine.launch_server: error: {exc}", file=sys.stderr)
    return 2


def _uvicorn_server(app, args):
    import uvicorn

    # asyncio, not uvicorn's "auto" (uvloop when importable): uvloop comes with requirements-aibrix.txt and
    # must not change the server's event loop
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        loop="asyncio",
    )
    return uvicorn.Server(config)


def _bind_sidecar(args) -> socket.socket:
    """``--grpc-mode``'s HTTP sidecar socket (``--smg-http-sidecar-port``, default ``--port`` + 1);
    ``ArgumentError`` naming that flag when it cannot be bound."""
    port = args.smg_http_sidecar_port or args.port + 1
    try:
        return bind_listen_socket(args.host, port)
    except ArgumentError as exc:
        raise ArgumentError(str(exc).replace("--port", "--smg-http-sidecar-port", 1)) from None


def _serve_grpc(engine, args, sock: socket.socket, sidecar: socket.socket) -> int:
    """``--grpc-mode``: smg's gRPC service on ``--port`` (``engine/server/grpc_service.py``; the port held
    since start-up is handed over to the gRPC server) and the HTTP app on the sidecar socket, until
    SIGTERM / SIGINT (uvicorn's handlers) or the scheduler thread ends; then both stop."""
    import asyncio

    from engine.server import grpc_service
    from engine.server.app import create_app

    sock.close()
    events = None if args.disable_kv_events else grpc_service.attach_events(engine)
    server = _uvicorn_server(create_app(engine), args)

    async def both() -> None:
        stop = asyncio.Event()
        rpc = asyncio.create_task(grpc_service.serve(engine, events, args.host, args.port, stop))
        http = asyncio.create_task(server.serve(sockets=[sidecar]))
        await asyncio.wait({rpc, http}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        stop.set()
        await asyncio.gather(rpc, http)

    try:
        with sidecar:
            asyncio.run(both())
    finally:
        engine.shutdown()
    return EXIT_SCHEDULER_DIED if engine.scheduler.error is not None else 0


def _serve_encoder(args, sock: socket.socket) -> int:
    """``--encoder-only``: the EPD encoder worker (``engine/server/encoder_server.py``)."""
    from engine.model.errors import ModelLoadError
    from engine.server.encoder_server import EncoderService, create_encoder_app

    try:
        service = EncoderService(args)
    except (ArgumentError, ModelLoadError) as exc:
        return _launch_error(exc)
    _uvicorn_server(create_encoder_app(service), args).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
