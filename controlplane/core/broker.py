"""Kombu's Redis transport with one fix: a Celery worker survives a Redis restart (CELERY_BROKER_TRANSPORT).

After the broker connection drops, Celery closes the old channel, which restores the messages it held
(acks_late steps), and acks steps that finished meanwhile, through a connection it was already detached from:
kombu 5.7 raises AttributeError there, which Celery does not count as a connection error, so the worker
exited ("Unrecoverable error: AttributeError ... 'hostname'"). Here a detached channel raises redis's
ConnectionError instead, which Celery handles as the lost connection it is (reconnect and go on); the messages
left unacked are redelivered by the visibility sweep if Redis kept its data.
"""

from kombu.transport import redis
from redis.exceptions import ConnectionError as RedisConnectionError


class Channel(redis.Channel):
    def _connparams(self, asynchronous=False):
        if self.connection is None or self.connection.client is None:
            raise RedisConnectionError("broker channel closed: the connection to Redis was lost")
        return super()._connparams(asynchronous=asynchronous)


class Transport(redis.Transport):
    Channel = Channel
