"""EventConsumer: one websocket per console tab; subscribe replaces the set of groups (AWX protocol).

Client -> server: {"action": "subscribe", "groups": ["fleet", "worker.3", "pools.2", "operation.7"]}.
Server -> client: control.subscribed {groups, joined, left}, control.error {message}, and every broadcast
envelope of the joined groups, forwarded verbatim.

Access follows the REST roles (``GROUP_READ_ROLES``, the read roles of the endpoints that serve the same
data): an anonymous socket is accepted and closed at once with 4401, a role that may read no group (agent)
with 4403 (closing before the accept would make the server answer the handshake with a bare HTTP 403, and
the client would never see the code); a group the role may not read is refused with control.error. A
socket opened with ``?token=`` is closed with 4401 when that token is revoked (``token_revoke`` sends
``control.revoked`` to its ``token.<prefix>`` group) and re-checked on every subscribe (expiry). Every
socket is also closed with 4401 when its user is deactivated or deleted (``user.<id>`` group), and a console
socket when its session logs out (``session.<digest>`` group; ``controlplane.accounts.signals``); a
subscribe re-checks that the user is still active.

A message that is not a JSON text frame (a typo, a binary frame) is answered with ``control.error`` naming
the problem; the socket stays open and keeps its groups.
"""

import asyncio
import json

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.contrib.auth import get_user_model

from controlplane.accounts.models import ApiToken
from controlplane.accounts.permissions import READ_ROLES
from controlplane.accounts.selectors import user_role
from controlplane.core.events import GROUP_PATTERN, envelope, session_group, token_group, user_group
from controlplane.telemetry import watchers

MAX_GROUPS = 300
SUBSCRIBE_HINT = 'send {"action": "subscribe", "groups": [...]}'
JOIN_CONCURRENCY = 8  # group joins/leaves of one subscribe in flight at once
# Group kind -> roles that may read it: the same as REST (/telemetry/*, /inventory/workers, /inventory/alerts,
# /operations, /rebalances; pools: /telemetry/workers/<id>/, the scrapes it pushes).
GROUP_READ_ROLES = {
    "fleet": READ_ROLES,
    "alerts": READ_ROLES,
    "worker": READ_ROLES,
    "pools": READ_ROLES,
    "operations": READ_ROLES,
    "operation": READ_ROLES,
    "rebalances": READ_ROLES,
    "rebalance": READ_ROLES,
}


def group_kind(group: str) -> str:
    return group.split(".", 1)[0]


@database_sync_to_async
def _role_of(user) -> str | None:
    return user_role(user)


@database_sync_to_async
def _still_active(user_id: int, token_id: int | None) -> bool:
    if token_id is None:
        return get_user_model().objects.filter(pk=user_id, is_active=True).exists()
    token = ApiToken.objects.select_related("user").filter(pk=token_id).first()
    return token is not None and token.is_active and token.user.is_active


def _control_groups(scope) -> list[str]:
    """The server-internal groups a socket joins: its user's, and its token's or its login session's."""
    groups = [user_group(scope["user"].pk)]
    token, session = scope.get("api_token"), scope.get("session")
    if token is not None:
        groups.append(token_group(token.prefix))
    elif session is not None and session.session_key:
        groups.append(session_group(session.session_key))
    return groups


class EventConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.refuse(4401)
            return
        self.role = await _role_of(user)
        if not any(self.role in roles for roles in GROUP_READ_ROLES.values()):
            await self.refuse(4403)
            return
        self.groups_joined: set[str] = set()
        self.token = self.scope.get("api_token")
        self.control_groups = _control_groups(self.scope)
        for group in self.control_groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def refuse(self, code: int) -> None:
        """Accept, then close with ``code``: a close before the accept reaches the client as HTTP 403."""
        await self.accept()
        await self.close(code=code)

    async def disconnect(self, code):
        joined = getattr(self, "groups_joined", set())
        for group in joined | set(getattr(self, "control_groups", [])):
            await self.channel_layer.group_discard(group, self.channel_name)
        await sync_to_async(watchers.change_groups)([], joined)

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        """Decodes a JSON text frame for :meth:`receive_json`; anything else gets ``control.error``."""
        if text_data is None:
            await self.send_error("binary frame: send JSON text frames")
            return
        try:
            content = await self.decode_json(text_data)
        except json.JSONDecodeError as exc:
            await self.send_error(f"not JSON ({exc.msg} at character {exc.pos}): {SUBSCRIBE_HINT}")
            return
        await self.receive_json(content, **kwargs)

    async def send_error(self, message: str) -> None:
        await self.send_json(envelope("control.error", {"message": message}))

    async def receive_json(self, content, **kwargs):
        token_id = self.token.pk if self.token is not None else None
        if not await _still_active(self.scope["user"].pk, token_id):
            await self.close(code=4401)
            return
        groups = content.get("groups") if isinstance(content, dict) else None
        if (
            not isinstance(content, dict)
            or content.get("action") != "subscribe"
            or not isinstance(groups, list)
        ):
            await self.send_error(SUBSCRIBE_HINT)
            return
        bad = [g for g in groups if not isinstance(g, str) or not GROUP_PATTERN.match(g)]
        if bad or len(groups) > MAX_GROUPS:
            await self.send_json(
                envelope("control.error", {"message": f"unknown or too many groups: {bad[:5]}"})
            )
            return
        denied = sorted(g for g in set(groups) if self.role not in GROUP_READ_ROLES[group_kind(g)])
        if denied:
            await self.send_json(
                envelope("control.error", {"message": f"role {self.role} may not read: {denied[:5]}"})
            )
            return
        wanted = set(groups)
        joined, left = wanted - self.groups_joined, self.groups_joined - wanted
        # a few at a time: 300 one after the other took seconds on a loaded process, and all at once would
        # take more Redis connections than the layer's pool holds
        changes = [self.channel_layer.group_discard(g, self.channel_name) for g in left]
        changes += [self.channel_layer.group_add(g, self.channel_name) for g in joined]
        for start in range(0, len(changes), JOIN_CONCURRENCY):
            await asyncio.gather(*changes[start : start + JOIN_CONCURRENCY])
        self.groups_joined = wanted
        # the publishers query the TSDB for open worker and rebalance pages only (telemetry.watchers)
        await sync_to_async(watchers.change_groups)(joined, left)
        await self.send_json(
            envelope(
                "control.subscribed",
                {"groups": sorted(wanted), "joined": sorted(joined), "left": sorted(left)},
            )
        )

    async def broadcast_event(self, message):
        """A group's event (`core.broadcast.wire`): its JSON text, encoded once for every socket."""
        if message["event"] == "control.revoked":
            await self.close(code=4401)
            return
        await self.send(text_data=message["text"])
