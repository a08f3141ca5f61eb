"""An ASGI handler that runs each HTTP request's whole Django part in one pooled thread.

Django's own ``ASGIHandler`` loads the middleware in async mode: every ``MiddlewareMixin`` then moves its
``process_request`` and ``process_response`` to a thread and back (two thread hops each), a sync-only
middleware moves the rest of the chain back to the event loop, the view moves to a thread again, and each
request gets a thread of its own (``ThreadSensitiveContext``). On the agent ingest path that was about 30
hops and two new threads per request, more CPU than the request's own work.

``OneThreadASGIHandler`` loads the middleware in sync mode, as under WSGI, and runs the request-started
signal, the middleware chain, the view and (for a response that is not streamed) ``response.close()``
with its request-finished signal in one call on a bounded thread pool (``ASGI_THREADS`` threads, by
default ``DB_POOL_MAX_SIZE``: one pooled database connection per thread, handed back at the end of each
request). Only reading the body and sending the response run on the event loop. A streamed response (a
static file) is sent by Django's code and closed after it.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.http import FileResponse
from django.urls import set_script_prefix

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def request_executor() -> ThreadPoolExecutor:
    """The process's request threads: ``settings.ASGI_THREADS`` of them (created on first use)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=max(1, settings.ASGI_THREADS), thread_name_prefix="http-request"
            )
        return _executor


class OneThreadASGIHandler(ASGIHandler):
    """Django's ASGI HTTP handler with a sync middleware chain run in one thread per request (see module)."""

    def __init__(self):
        base.BaseHandler.__init__(self)
        self.load_middleware(is_async=False)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await self.handle(scope, receive, send)

    def _respond(self, scope, body_file):
        """Everything of one request that runs Django code: returns (response, closed). Closes the body:
        this thread is its only reader, even when the client has gone and the awaiting task was cancelled."""
        try:
            set_script_prefix(get_script_prefix(scope))
            signals.request_started.send(sender=self.__class__, scope=scope)
            request, response = self.create_request(scope, body_file)
            if request is not None:
                response = self.get_response(request)
                response._handler_class = self.__class__
                if isinstance(response, FileResponse):
                    response.block_size = self.chunk_size
        finally:
            body_file.close()
        if response.streaming:
            return response, False
        response.content  # noqa: B018 - rendered here, before close() ends the request
        response.close()  # request_finished: the database connection goes back to the pool now
        return response, True

    async def handle(self, scope, receive, send):
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        respond = sync_to_async(self._respond, thread_sensitive=False, executor=request_executor())
        response, closed = await respond(scope, body_file)
        try:
            await self.send_response(response, send)
        finally:
            if not closed:
                await sync_to_async(response.close, thread_sensitive=False, executor=request_executor())()
