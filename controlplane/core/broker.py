"""Kombu's Redis transport with one fix: a Celery worker survives a Redis restart (CELERY_BROKER_TRANSPORT).

When the broker connection drops, Celery closes it and the closing channel restores the messages it held
(acks_late steps) through a client built from a connection it was already detached from: kombu 5.7 raises
AttributeError there, which Celery does not count as a connection error, so the worker exited ("Unrecoverable
error: AttributeError ... 'hostname'"). Here that restore is skipped with a warning; the held messages stay in
Redis's unacked set, from which the visibility sweep redelivers them if Redis kept its data.
"""

import logging

from kombu.transport import redis

logger = logging.getLogger(__name__)


class QoS(redis.QoS):
    def restore_unacked(self, client=None):
        if client is None and self.channel.connection.client is None:
            logger.warning(
                "broker connection lost: %d held message(s) left to the visibility timeout",
                len(self._delivered),
            )
            self._delivered.clear()
            return
        super().restore_unacked(client)


class Channel(redis.Channel):
    QoS = QoS


class Transport(redis.Transport):
    Channel = Channel
