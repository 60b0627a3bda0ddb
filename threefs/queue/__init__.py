"""A message queue on threefs: topics, partitions, producers, consumer groups (Kafka's client shape).

    from threefs.queue import Admin, Producer, Consumer
    Admin(fs).create_topic("events", partitions=4)
    with Producer(fs) as p:
        p.send("events", b"hello", key=b"k").get(timeout=10)
    c = Consumer(fs, "events", group_id="g")
    records = c.poll(timeout_ms=1000)

See docs/queue.md for the design (segment files, the index of symlinks, leases) and its limits.
"""

from threefs.queue.admin import Admin
from threefs.queue.consumer import Consumer, ConsumerRecord, TopicPartition
from threefs.queue.log import DEFAULT_ROOT, TopicConfig
from threefs.queue.producer import Producer, RecordFuture, RecordMetadata

__all__ = ["Admin", "Consumer", "ConsumerRecord", "DEFAULT_ROOT", "Producer", "RecordFuture", "RecordMetadata",
           "TopicConfig", "TopicPartition"]
