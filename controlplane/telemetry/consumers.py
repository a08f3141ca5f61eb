"""EventConsumer: one websocket per console tab; subscribe replaces the set of groups (AWX protocol).

Client -> server: {"action": "subscribe", "groups": ["fleet", "worker.3", "operation.7"]}.
Server -> client: control.subscribed {groups, joined, left}, control.error {message}, and every broadcast
envelope of the joined groups, forwarded verbatim. Anonymous sockets are closed with 4401 before accept.
Every role may read every group (viewers read everything).
"""

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.telemetry.events import GROUP_PATTERN, envelope

MAX_GROUPS = 300


class EventConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.groups_joined: set[str] = set()
        await self.accept()

    async def disconnect(self, code):
        for group in getattr(self, "groups_joined", set()):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content, **kwargs):
        groups = content.get("groups") if isinstance(content, dict) else None
        if content.get("action") != "subscribe" or not isinstance(groups, list):
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
        await self.send_json(message["payload"])
