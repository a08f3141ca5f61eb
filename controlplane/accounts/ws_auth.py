"""Websocket authentication: the console's session cookie, or ``?token=cp_...`` for automation.

A socket that presents ``?token=`` is authenticated by that token alone (an invalid, expired or revoked one
is anonymous, never the session's user), and may come without an Origin header: browsers always send one,
so only non-browser clients (scripts, ``websockets``, ``wscat``) connect that way and the origin check that
guards the session cookie against cross-site pages still applies to every socket that has an Origin.
"""

from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser

from controlplane.accounts.selectors import token_get_by_plaintext


def _query_token(scope) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode()).get("token")
    return values[0] if values else None


@database_sync_to_async
def _token_for(value: str):
    token = token_get_by_plaintext(value)
    return token, (token.user if token else None)


class TokenAuthMiddleware(BaseMiddleware):
    """Sets ``scope["user"]`` and ``scope["api_token"]`` (the ApiToken, or None) from ``?token=``."""

    async def __call__(self, scope, receive, send):
        scope = dict(scope, api_token=None)
        value = _query_token(scope)
        if value is not None:
            token, user = await _token_for(value)
            scope["user"], scope["api_token"] = (user, token) if token else (AnonymousUser(), None)
        return await super().__call__(scope, receive, send)


class TokenOrOriginValidator:
    """Origin check of ``ALLOWED_HOSTS`` for every socket that sends an Origin; a socket without one is let
    through only with ``?token=`` (then the token alone authenticates it)."""

    def __init__(self, inner):
        self.inner = inner
        self.checked = AllowedHostsOriginValidator(inner)

    async def __call__(self, scope, receive, send):
        has_origin = any(name == b"origin" for name, _ in scope.get("headers", []))
        if not has_origin and _query_token(scope) is not None:
            return await self.inner(scope, receive, send)
        return await self.checked(scope, receive, send)


def TokenOrSessionAuthMiddlewareStack(inner):  # noqa: N802 (Channels naming convention for stacks)
    return TokenOrOriginValidator(AuthMiddlewareStack(TokenAuthMiddleware(inner)))
