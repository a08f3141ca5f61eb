"""The Channels layer: channels_redis's, receiving a process's queued messages in batches.

channels_redis 4.3 receives one message per call, with four sequential Redis round trips (restore the
backup queue, BZPOPMIN, copy to the backup queue, then a cleaner's ZPOPMIN that the next receive waits for).
Every websocket of a daphne process shares that process's one receive loop, so the process delivers at most
one message per four round trips. On a loaded host each round trip waits for the event loop thread to get a
core and the GIL back from the request threads, and the process delivered about 2 messages a second while
its agents ingested 20: the backlog grew in Redis and the console's lag with it (measured when agents
still pushed every sample; the figures are in git history).

:class:`BatchReceiveLayer` takes every message waiting on a channel, up to ``RECEIVE_BATCH``, in one round
trip (a script: restore or drop the backup queue, pop the batch, copy it to the backup queue), keeps them in
process memory and hands them out one per ``receive_single`` call, in order. Only an empty channel falls back
to channels_redis's blocking receive. Loss semantics stay channels_redis's: a batch whose reply never arrived
(the receiving task was cancelled mid-call) is still in the backup queue and goes back to the channel on the
next call; once a reply arrived its messages are in memory, so the next call drops the backup queue.
Everything else (groups, sends, capacity, expiry) is channels_redis's.
"""

from __future__ import annotations

import collections

from channels_redis.core import RedisChannelLayer

RECEIVE_BATCH = 500

# KEYS[1] the channel, KEYS[2] its backup queue; ARGV[1] 1 when the backup queue's messages reached this
# process (drop them) else 0 (put them back first); ARGV[2] the batch size. Pops the oldest messages, copies
# them to the backup queue, returns [member, score, member, score, ...].
_POP_BATCH_LUA = """
if ARGV[1] == '1' then
    redis.call('DEL', KEYS[2])
else
    local backed_up = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    for i = #backed_up, 1, -2 do
        redis.call('ZADD', KEYS[1], backed_up[i], backed_up[i - 1])
    end
    redis.call('DEL', KEYS[2])
end
local popped = redis.call('ZPOPMIN', KEYS[1], tonumber(ARGV[2]))
for i = 1, #popped, 2 do
    redis.call('ZADD', KEYS[2], popped[i + 1], popped[i])
end
return popped
"""


class BatchReceiveLayer(RedisChannelLayer):
    """channels_redis's ``RedisChannelLayer`` with batched receives (see the module docstring). Same
    configuration; ``receive_single(channel)`` -> (channel name, message dict) as channels_redis's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fetched: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._delivered: set[str] = set()  # channel keys whose backup queue holds only fetched messages

    async def receive_single(self, channel):
        assert self.require_valid_channel_name(channel, receive=True), "Channel name invalid"
        index = self.consistent_hash(channel) if "!" in channel else next(self._receive_index_generator)
        key = self.prefix + channel
        fetched = self._fetched[key]
        while not fetched:
            await self._fetch_batch(index, key, fetched)
        message = self.deserialize(fetched.popleft())
        if "__asgi_channel__" in message:
            channel = message.pop("__asgi_channel__")
        return channel, message

    async def _fetch_batch(self, index: int, key: str, into: collections.deque) -> None:
        """Fill `into` with the channel's waiting messages (one round trip), or, when none waits, block for
        the next one as channels_redis does (up to ``brpop_timeout``; nothing when it passes)."""
        backup = self._backup_channel_name(key)
        connection = self.connection(index)
        dropping = "1" if key in self._delivered else "0"
        # Cancelled before the reply: the backup queue is put back next time (a duplicate at worst, as
        # channels_redis's own cancelled cleaners give), never dropped unread.
        self._delivered.discard(key)
        popped = await connection.eval(_POP_BATCH_LUA, 2, key, backup, dropping, RECEIVE_BATCH)
        self._delivered.add(key)  # the reply is here: the backup queue holds only what `into` gets
        if popped:
            into.extend(popped[0::2])
            return
        self._delivered.discard(key)
        member = await self._brpop_with_clean(index, key, timeout=self.brpop_timeout)
        if member is not None:
            self._delivered.add(key)
            into.append(member)  # in the backup queue too: the next fetch drops it
