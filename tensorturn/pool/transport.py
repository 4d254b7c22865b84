"""kombu's Redis transport, with a message's lease taken and given back in one command each.

kombu emulates acknowledgements on Redis: delivering a message writes it to the ``unacked`` hash
and its delivery time to ``unacked_index`` in a MULTI/EXEC transaction (four commands), and the
acknowledgement removes both in another (four more). On a home link every command is paid for,
and these eight were a quarter of what a fused shard task cost the broker
(``benchmarks/broker_commands.py``). Here each is one Lua script, as atomic as the transaction it
replaces, writing the same keys with the same values (:func:`tensorturn.state.queues.take_lease`,
:func:`~tensorturn.state.queues.give_back_lease`), but the lease's time is the broker's clock
(:mod:`tensorturn.state.clock`), and so is the restore sweep's; everything else — requeue on
reject, the queues — is kombu's own (:class:`kombu.transport.redis.Transport`).

Used for ``redis://`` brokers (:func:`tensorturn.pool.celery_app.settings_for`); any other URL
keeps kombu's transport as its scheme names it.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.transport.redis import Mutex, MutexHeld
from kombu.utils.json import dumps
from kombu.utils.uuid import uuid

from tensorturn.state.clock import broker_now
from tensorturn.state.queues import give_back_lease, lapsed_leases, take_lease

NAME = "tensorturn.pool.transport:Transport"


class QoS(kombu_redis.QoS):
    """kombu's QoS for Redis, its two transactions one script each (unless keys are prefixed:
    then kombu's own, which prefixes them)."""

    def _plain(self) -> bool:
        return not getattr(self.channel, "global_keyprefix", "")

    def append(self, message: Any, delivery_tag: Any) -> None:
        """Take the delivered message's lease — unless a fresh lease under its tag is held:
        then it is a copy of a message another consumer holds, alive (someone with the Redis
        password replayed it), and it gets a tag and lease of its own. Its acknowledgement then
        gives back only its own lease, never the holder's (which would leave the running task
        unleased: lost for good should its machine die), and the attempt protocol finds it a copy
        (:meth:`tensorturn.state.attempts.Attempts.begin`)."""
        if not self._plain():
            super().append(message, delivery_tag)
            return
        delivery = message.delivery_info
        with self.channel.conn_or_acquire() as client:
            now = broker_now(client)
            raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
            if not take_lease(client, self.unacked_index_key, self.unacked_key, delivery_tag, raw, now,
                              unless_held_s=self.visibility_timeout):
                delivery_tag = message.delivery_tag = message.properties["delivery_tag"] = uuid()
                raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
                take_lease(client, self.unacked_index_key, self.unacked_key, delivery_tag, raw, now)
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: Any) -> None:
        if not self._plain():
            super().ack(delivery_tag)
            return
        self._give_back(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        if requeue or not self._plain():
            super().reject(delivery_tag, requeue)
            return
        self._give_back(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu's restore sweep (every ``interval``-th call, under its mutex: the ``num``
        newest leases older than the visibility timeout go back to their queues), with the
        lapse reckoned on the broker's clock, as the leases are written (:mod:`tensorturn.state.clock`):
        a machine whose clock runs ahead would otherwise requeue every other machine's running
        task."""
        if not self._plain():
            super().restore_visible(start, num, interval)
            return
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        with self.channel.conn_or_acquire() as client:
            ceil = broker_now(client) - self.visibility_timeout
            try:
                with Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    for tag in lapsed_leases(client, self.unacked_index_key, ceil, start, num):
                        self.restore_by_tag(tag, client)
            except MutexHeld:
                pass

    def _give_back(self, delivery_tag: Any) -> None:
        with self.channel.conn_or_acquire() as client:
            give_back_lease(client, self.unacked_index_key, self.unacked_key, delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel
