"""The messages between a front-end and an engine as each side reads them from a real socket pair."""

from __future__ import annotations

import os
import struct
from multiprocessing import Pipe

import msgspec
import pytest

from resnet_server.boundary.protocol import (
    FIRST_READ_BYTES,
    Answer,
    Cancel,
    Done,
    Failed,
    Health,
    Released,
    Submit,
    engine_messages,
    frontend_messages,
    send,
)
from resnet_server.common.statistics import BatchTiming


@pytest.fixture()
def pipe():
    ours, theirs = Pipe()
    yield ours, theirs
    ours.close()
    theirs.close()


def read_until(reader, count: int) -> list:
    messages = []
    while len(messages) < count:
        messages += reader.read()
    return messages


def test_every_message_waiting_is_read_at_once_in_order(pipe):
    ours, theirs = pipe
    sent = [Done(answers=[Answer(3, [(7, 0.5)], 0.001)], timing=BatchTiming(0.1, 0.2, 0.3), in_rotation=True,
                 weights_version=2), Health(False),
            Failed([1, 2], "Overloaded", "full", True), Released([4])]
    for message in sent:
        send(theirs, message)
    assert frontend_messages(ours).read() == sent  # one read: all four were waiting


def test_a_message_larger_than_the_first_buffer_is_read_whole(pipe):
    ours, theirs = pipe
    # 5 bytes a slot (a msgpack uint32): over twice the first buffer
    slots = list(range(100_000, 100_000 + FIRST_READ_BYTES // 2))
    send(theirs, Released(slots))
    send(theirs, Health(True))
    assert read_until(frontend_messages(ours), 2) == [Released(slots), Health(True)]


def test_a_message_that_comes_in_parts_is_read_once_whole(pipe):
    ours, theirs = pipe
    body = msgspec.msgpack.encode(Cancel([5, 6]))
    frame = struct.pack("!i", len(body)) + body
    reader = engine_messages(ours)
    os.write(theirs.fileno(), frame[:2])  # part of the length
    assert reader.read() == []
    os.write(theirs.fileno(), frame[2:7])  # the rest of it and part of the body
    assert reader.read() == []
    os.write(theirs.fileno(), frame[7:] + frame)  # the rest, and a whole second one
    assert reader.read() == [Cancel([5, 6]), Cancel([5, 6])]


def test_a_closed_socket_ends_the_reader(pipe):
    ours, theirs = pipe
    send(theirs, Submit([], [], [], [], []))
    theirs.close()
    reader = engine_messages(ours)
    assert reader.read() == [Submit([], [], [], [], [])]
    with pytest.raises(EOFError):
        reader.read()
