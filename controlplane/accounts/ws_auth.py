"""Websocket authentication: the console's session cookie, or `?token=cp_...` for automation."""

from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware

from controlplane.accounts.selectors import token_get_by_plaintext


@database_sync_to_async
def _user_for_token(value: str):
    token = token_get_by_plaintext(value)
    return token.user if token else None


class TokenAuthMiddleware(BaseMiddleware):
    async def __call__(self, scope, receive, send):
        query = parse_qs(scope.get("query_string", b"").decode())
        if "token" in query:
            user = await _user_for_token(query["token"][0])
            if user is not None:
                scope["user"] = user
        return await super().__call__(scope, receive, send)


def TokenOrSessionAuthMiddlewareStack(inner):  # noqa: N802 (Channels naming convention for stacks)
    return AuthMiddlewareStack(TokenAuthMiddleware(inner))
