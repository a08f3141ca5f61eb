"""EventConsumer: one websocket per console tab; subscribe replaces the set of groups (AWX protocol).

Client -> server: {"action": "subscribe", "groups": ["fleet", "worker.3", "operation.7"]}.
Server -> client: control.subscribed {groups, joined, left}, control.error {message}, and every broadcast
envelope of the joined groups, forwarded verbatim.

Access follows the REST roles (``GROUP_READ_ROLES``, the read roles of the endpoints that serve the same
data): anonymous sockets are closed with 4401 before accept, a role that may read no group (agent) with
4403; a group the role may not read is refused with control.error. A socket opened with ``?token=`` is
closed with 4401 when that token is revoked (``token_revoke`` sends ``control.revoked`` to its
``token.<prefix>`` group) and re-checked on every subscribe (expiry).
"""

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.accounts.models import ApiToken
from controlplane.accounts.permissions import READ_ROLES
from controlplane.accounts.selectors import user_role
from controlplane.core.events import GROUP_PATTERN, envelope, token_group

MAX_GROUPS = 300
# Group kind -> roles that may read it: the same as REST (/telemetry/*, /inventory/workers, /operations,
# /rebalances).
GROUP_READ_ROLES = {
    "fleet": READ_ROLES,
    "worker": READ_ROLES,
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
def _still_active(token_id: int) -> bool:
    token = ApiToken.objects.select_related("user").filter(pk=token_id).first()
    return token is not None and token.is_active and token.user.is_active


class EventConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.role = await _role_of(user)
        if not any(self.role in roles for roles in GROUP_READ_ROLES.values()):
            await self.close(code=4403)
            return
        self.groups_joined: set[str] = set()
        self.token = self.scope.get("api_token")
        if self.token is not None:
            await self.channel_layer.group_add(token_group(self.token.prefix), self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        for group in getattr(self, "groups_joined", set()):
            await self.channel_layer.group_discard(group, self.channel_name)
        if getattr(self, "token", None) is not None:
            await self.channel_layer.group_discard(token_group(self.token.prefix), self.channel_name)

    async def receive_json(self, content, **kwargs):
        if self.token is not None and not await _still_active(self.token.pk):
            await self.close(code=4401)
            return
        groups = content.get("groups") if isinstance(content, dict) else None
        if (
            not isinstance(content, dict)
            or content.get("action") != "subscribe"
            or not isinstance(groups, list)
        ):
            await self.send_json(
                envelope("control.error", {"message": 'send {"action": "subscribe", "groups": [...]}'})
            )
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
        for group in left:
            await self.channel_layer.group_discard(group, self.channel_name)
        for group in joined:
            await self.channel_layer.group_add(group, self.channel_name)
        self.groups_joined = wanted
        await self.send_json(
            envelope(
                "control.subscribed",
                {"groups": sorted(wanted), "joined": sorted(joined), "left": sorted(left)},
            )
        )

    async def broadcast_event(self, message):
        if message["payload"].get("type") == "control.revoked":
            await self.close(code=4401)
            return
        await self.send_json(message["payload"])
