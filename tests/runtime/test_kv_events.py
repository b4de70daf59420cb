"""The KV event publisher against subscribers written here from the wire description alone
(raw zmq + msgpack, no project code on the receiving side), and the project's own subscriber
through gaps, a late join and a publisher restart. Everything listens on ipc:// in tmp_path."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from ipc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from runtime.kv_publisher import EventSink, KVEventPublisher
from runtime.kv_subscriber import KVEventSubscriber, receive_until


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def addresses(tmp_path, name="e"):
    return f"ipc://{tmp_path}/{name}.sock", f"ipc://{tmp_path}/{name}-replay.sock"


def stored(i: int) -> BlockStored:
    return BlockStored([1000 + i, 2**64 - 1 - i], i or None, list(range(8)), 4, "CPU")


def receive_all(subscriber, publisher, count):
    """The first ``count`` batches. A subscriber learns of a batch it missed only from a later
    one, so a batch is published per poll until they are in (a busy engine does the same)."""

    def more(got):
        publisher.publish([AllBlocksCleared()])
        return len(got) >= count

    return receive_until(subscriber, more, 20)[:count]


def raw_sub(ctx, address):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    return sub


def raw_replay(ctx, address, start: int) -> list[list[bytes]]:
    """What a DEALER gets for [b"", start]: every answer up to and including the sentinel."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    answers = []
    while dealer.poll(5000):
        answers.append(dealer.recv_multipart())
        if answers[-1][1] == (-1).to_bytes(8, "big", signed=True):
            break
    dealer.close(linger=0)
    return answers


def check_raw_payload(payload: bytes) -> list[dict]:
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 3
    for event in events:
        assert isinstance(event, dict) and event["type"] in {
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
        }
        if event["type"] == "BlockStored":
            assert set(event) == {
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
            }
            assert len(event["token_ids"]) == event["block_size"] * len(event["block_hashes"])
            assert event["lora_id"] is None and event["lora_name"] is None
    return events


def test_raw_subscriber_decodes_every_batch_without_gaps_and_replays_from_k(ctx, tmp_path):
    pub_addr, replay_addr = addresses(tmp_path)
    publisher = KVEventPublisher(
        ctx, [EventSink(pub_addr, replay_address=replay_addr)], data_parallel_rank=3
    )
    sub = raw_sub(ctx, pub_addr)
    try:
        # A SUB only gets what is sent after it has joined: probe until a batch arrives.
        while not sub.poll(100):
            publisher.publish([AllBlocksCleared()])
        first = int.from_bytes(sub.recv_multipart()[1], "big") + 1
        while sub.poll(100):
            first = int.from_bytes(sub.recv_multipart()[1], "big") + 1
        for i in range(first, first + 39):
            publisher.publish([stored(i), BlockRemoved([7, i], "CPU")] if i % 3 else [stored(i)])
        seqs = []
        for _ in range(39):
            assert sub.poll(5000), f"the batch after {seqs[-1:]} never came"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            events = check_raw_payload(payload)
            assert events[0]["block_hashes"] == [1000 + seqs[-1], 2**64 - 1 - seqs[-1]]
        assert seqs == list(range(first, first + 39))

        k = first + 25
        answers = raw_replay(ctx, replay_addr, k)
        assert [len(a) for a in answers] == [3] * len(answers) and all(a[0] == b"" for a in answers)
        assert [int.from_bytes(a[1], "big", signed=True) for a in answers] == [
            *range(k, first + 39),
            -1,
        ]
        assert answers[-1][2] == b""
        for answer in answers[:-1]:
            check_raw_payload(answer[2])
        assert [a[1] for a in raw_replay(ctx, replay_addr, 1000)] == [b"\xff" * 8]
    finally:
        sub.close(linger=0)
        publisher.close()


def test_replay_buffer_is_bounded_and_a_malformed_request_is_ignored(ctx, tmp_path):
    pub_addr, replay_addr = addresses(tmp_path)
    sink = EventSink(pub_addr, replay_address=replay_addr, buffer_steps=5, topic=b"kv")
    publisher = KVEventPublisher(ctx, [sink], data_parallel_rank=3)
    try:
        for i in range(12):
            publisher.publish([stored(i)])
        bad = ctx.socket(zmq.DEALER)
        bad.connect(replay_addr)
        bad.send_multipart([b"", b"short"])
        answers = raw_replay(ctx, replay_addr, 0)
        assert [int.from_bytes(a[1], "big", signed=True) for a in answers] == [7, 8, 9, 10, 11, -1]
        assert not bad.poll(200)  # no answer to a malformed request, and the publisher lives on
        bad.close(linger=0)
    finally:
        publisher.close()


def test_subscriber_fills_gaps_from_replay_and_joins_late(ctx, tmp_path):
    pub_addr, replay_addr = addresses(tmp_path)
    sink = EventSink(pub_addr, replay_address=replay_addr, hwm=4)
    publisher = KVEventPublisher(ctx, [sink])
    for i in range(50):  # before anyone listens: only a replay can bring these
        publisher.publish([stored(i)])
    # A tiny receive queue that is not read while 1,000 batches go out: the PUB drops most.
    subscriber = KVEventSubscriber(ctx, pub_addr, replay_addr, rcvhwm=4)
    try:
        for i in range(50, 1050):
            publisher.publish([stored(i)])
        got = receive_all(subscriber, publisher, 1050)
        assert [r.seq for r in got] == list(range(1050))
        assert all(r.lost_before == 0 for r in got) and subscriber.lost == 0
        assert [r.batch.events[0] for r in got[:3]] == [stored(0), stored(1), stored(2)]
    finally:
        subscriber.close()
        publisher.close()


def test_subscriber_starts_over_when_the_publisher_restarts(ctx, tmp_path):
    pub_addr, replay_addr = addresses(tmp_path)
    publisher = KVEventPublisher(ctx, [EventSink(pub_addr, replay_address=replay_addr)])
    for i in range(200):
        publisher.publish([stored(i)])
    subscriber = KVEventSubscriber(ctx, pub_addr, replay_addr)
    try:
        assert [r.seq for r in receive_all(subscriber, publisher, 200)] == list(range(200))
        publisher.close()
        receive_until(subscriber, lambda got: False, 0.3)  # the old publisher's last batches
        publisher = KVEventPublisher(ctx, [EventSink(pub_addr, replay_address=replay_addr)])
        publisher.publish([stored(0)])
        # The first live batch the subscriber sees after reconnecting has a number below what
        # it delivered: that tells a restart, and a replay from 0 brings the new batches.
        got = receive_all(subscriber, publisher, 6)
        assert [r.seq for r in got] == list(range(6)) and got[0].batch.events == [stored(0)]
        assert subscriber.lost == 0
        # Told of a restart by its owner (the supervisor's notice), it starts over the same way.
        subscriber.start_over()
        again = receive_all(subscriber, publisher, 3)
        assert [r.seq for r in again] == [0, 1, 2] and again[0].batch.events == [stored(0)]
    finally:
        subscriber.close()
        publisher.close()


def test_side_topics_have_their_own_numbers_and_leave_the_kv_topic_gap_free(ctx, tmp_path):
    """A replica's load goes out on the internal stream under b"load" between its KV batches:
    a raw subscriber sees KV seqs 0, 1, 2 and load seqs 0, 1; the project's subscriber
    delivers the KV batches with no gap and hands the load over through take_side. A sink not
    marked side (the user's endpoint) never carries it."""
    from ipc.codec import decode_as
    from ipc.messages import LOAD_TOPIC, ReplicaLoad

    address, replay = addresses(tmp_path)
    user, _ = addresses(tmp_path, "user")
    publisher = KVEventPublisher(
        ctx, [EventSink(address, replay_address=replay, side=True), EventSink(user)]
    )
    raw, raw_user = raw_sub(ctx, address), raw_sub(ctx, user)
    follower = KVEventSubscriber(ctx, address, replay, side_topics=(LOAD_TOPIC,))
    time.sleep(0.3)  # the SUBs are connected: nothing published below is missed live
    for i in range(3):
        publisher.publish([stored(i)])
        if i < 2:
            publisher.publish_side(LOAD_TOPIC, ReplicaLoad(0, 9, running=i, waiting=0))
    frames = []
    while len(frames) < 5 and raw.poll(5000):
        frames.append(raw.recv_multipart())
    assert [(t, int.from_bytes(s, "big")) for t, s, _ in frames if t == b""] == [
        (b"", 0),
        (b"", 1),
        (b"", 2),
    ]
    loads = [
        (int.from_bytes(s, "big"), decode_as(p, ReplicaLoad).running)
        for t, s, p in frames
        if t == LOAD_TOPIC
    ]
    assert loads == [(0, 0), (1, 1)]
    got = receive_until(follower, lambda got: len(got) >= 3, 10)
    assert [b.seq for b in got] == [0, 1, 2] and all(b.lost_before == 0 for b in got)
    assert [seq for _, seq, _ in follower.take_side()] == [0, 1] and follower.take_side() == []
    user_topics = []
    while raw_user.poll(500):
        user_topics.append(raw_user.recv_multipart()[0])
    assert user_topics == [b"", b"", b""]
    for sock in (raw, raw_user):
        sock.close(linger=0)
    follower.close()
    publisher.close()
