"""The slab's slots: taken, given back and taken again, by two front-ends' views of one real memfd."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from resnet_server.boundary.queue_share import ShareExceeded, caller_tag, share_limit
from resnet_server.boundary.slab import FREE, Slab, SlabLayout, create_slab_memory
from resnet_server.common.preprocess import RawImage, SlotBytes, copy_slots, gather_slots, raw_batch
from resnet_server.engine.registered_slab import device_rows, register_slab

A, B = 1, 2  # two front-ends' owner numbers


@pytest.fixture
def views():
    """Two views of one slab of eight slots, as two front-ends hold it."""
    layout = SlabLayout(8, 4096)
    fd = create_slab_memory(layout)
    first, second = Slab(fd, layout), Slab(fd, layout)
    yield first, second
    first.close()
    second.close()
    os.close(fd)


def test_a_slot_given_back_is_the_next_one_taken(views):
    a, _ = views
    assert a.take(3, A) == [0, 1, 2]  # nothing given back yet: the lowest free slots
    a.give_back([1], A)
    assert a.owners[1] == FREE
    assert a.take(1, A) == [1]
    a.give_back([2, 0], A)
    assert sorted(a.take(2, A)) == [0, 2]
    assert a.owners.tolist() == [A, A, A, FREE, FREE, FREE, FREE, FREE]


def test_a_given_back_slot_another_front_end_took_meanwhile_is_not_taken_again(views):
    a, b = views
    assert a.take(1, A) == [0]
    a.give_back([0], A)
    assert b.take(1, B) == [0]  # b scans: slot 0 is the lowest free one
    assert a.take(1, A) == [1]  # a's recent slot 0 is b's now: a scans instead
    assert a.owners[:2].tolist() == [B, A]


def test_one_take_never_hands_out_a_slot_twice(views):
    """A slot can be in a view's recent list twice (tried, put back, taken by a scan, given back again)."""
    a, _ = views
    assert a.take(2, A) == [0, 1]
    a.give_back([0, 1], A)
    assert sorted(a.take(3, A)) == [0, 1, 2]  # two recent slots are too few: they stay listed, and a scan takes
    a.give_back([0], A)  # slot 0 is now listed twice
    taken = a.take(2, A)
    assert len(set(taken)) == 2 and 0 in taken
    assert {slot for slot, owner in enumerate(a.owners.tolist()) if owner == A} == {1, 2, *taken}


def test_a_take_larger_than_what_is_free_takes_nothing(views):
    a, b = views
    assert a.take(6, A) == list(range(6))
    a.give_back([5], A)
    assert b.take(4, B) is None  # three free: refused, none taken
    assert a.owners.tolist() == [A, A, A, A, A, FREE, FREE, FREE]
    assert b.take(3, B) == [5, 6, 7]


def test_a_caller_over_its_share_of_the_queue_is_refused_and_one_holding_nothing_is_not():
    """32 slots, floor 2: a caller alone fills all but 2 of them; with a second caller holding slots, the first
    may hold at most 16 of them, and the second, holding nothing, is still admitted; both front-ends' views see
    the same holdings."""
    layout = SlabLayout(32, 4096)
    fd = create_slab_memory(layout)
    a, b = Slab(fd, layout), Slab(fd, layout)
    greedy, polite = caller_tag("greedy"), caller_tag("polite")
    try:
        assert a.take(20, A, greedy) is not None and b.take(10, B, greedy) is not None  # alone: up to 30
        with pytest.raises(ShareExceeded) as caught:
            b.take(1, B, greedy)
        assert (caught.value.held, caught.value.limit, caught.value.callers) == (30, 30, 1)
        assert b.take(2, B, polite) is not None  # holding nothing: admitted while two slots are free
        assert a.take(1, A) is None  # no share without a tag, and the queue is full
        a.give_back(list(range(20)), A)  # the greedy caller's answers go back: it holds 10, the polite one 2
        with pytest.raises(ShareExceeded, match="holds 10 images, over its share of 16 with 2 callers queued"):
            a.take(7, A, greedy)
        assert a.take(6, A, greedy) is not None and a.take(1, A, polite) is not None  # 16 and 3
        with pytest.raises(ShareExceeded):
            b.check_share(1, greedy)  # the same answer without the lock, before any decoding
        b.check_share(1, polite)
    finally:
        a.close()
        b.close()
        os.close(fd)


def test_share_limits_follow_the_callers_holding_slots():
    assert [share_limit(256, callers) for callers in (1, 2, 3, 64)] == [240, 128, 85, 16]
    assert [share_limit(8, callers) for callers in (1, 2, 9)] == [7, 4, 1]
    assert caller_tag("") == 0 and 0 < caller_tag("10.0.0.1") < 1 << 31


@pytest.mark.parametrize("dtype, shape", [("uint8", (32, 24, 3)), ("float32", (3, 224, 224))])
def test_images_read_from_their_slots_convert_as_their_bytes_do(views, dtype, shape):
    """What a front-end wrote into scattered slots, gathered by the engine a batch at once (SlotBytes), is the
    batch the same images' own bytes give."""
    front_end, engine = views
    written = _images_in_slots(front_end, dtype, shape)
    rows = torch.from_numpy(engine.input_rows())
    gathered = raw_batch([RawImage(dtype, shape, SlotBytes(rows, slot, len(data))) for slot, data in written],
                         torch.device("cpu"))
    expected = raw_batch([RawImage(dtype, shape, data) for _, data in written], torch.device("cpu"))
    for got, want in zip(gathered, expected, strict=True):
        assert torch.equal(got, want)
    del rows, gathered  # the slab's memory may then be unmapped


def _images_in_slots(front_end: Slab, dtype: str, shape: tuple[int, ...]) -> list[tuple[int, bytes]]:
    """Three random images written into slots 0, 2 and 4 (not side by side), as a front-end writes them."""
    rng = np.random.default_rng(7)
    images = [(rng.integers(0, 256, shape, dtype=np.uint8) if dtype == "uint8"
               else rng.standard_normal(shape).astype(np.float32)).tobytes() for _ in range(3)]
    slots = front_end.take(5, A)[::2]
    for slot, data in zip(slots, images, strict=True):
        front_end.input(slot, len(data))[:] = data
    return list(zip(slots, images, strict=True))


@pytest.mark.parametrize("dtype, shape", [("uint8", (224, 224, 3)), ("uint8", (31, 17, 3)),
                                          ("float32", (3, 224, 224))])
def test_copying_each_slot_into_its_row_gives_the_gathered_batch(views, dtype, shape):
    """What a GPU engine does with a registered slab (one copy a slot into the batch's rows, or one gather read
    as 8-byte words, or bytes where an image's size is odd), here on the CPU: both give the images written."""
    front_end, engine = views
    rows = torch.from_numpy(engine.input_rows())
    written = _images_in_slots(front_end, dtype, shape)
    slots = [SlotBytes(rows, slot, len(data)) for slot, data in written]
    batch_shape, torch_dtype = (len(slots), *shape), getattr(torch, dtype)
    copied = copy_slots(slots, torch.empty(batch_shape, dtype=torch_dtype))
    gathered = gather_slots(slots, torch.empty(batch_shape, dtype=torch_dtype))
    assert [image.numpy().tobytes() for image in gathered] == [data for _, data in written]
    assert torch.equal(copied, gathered)


@pytest.mark.skipif(torch.cuda.is_available(), reason="for a machine where CUDA cannot register the slab")
def test_without_cuda_the_engine_keeps_the_host_copy(views, caplog):
    _, engine = views
    with caplog.at_level(logging.WARNING, logger="resnet_server.engine.registered_slab"):
        assert not register_slab(engine, torch.device("cuda:0"))
    assert "cannot upload from the slab where it lies" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, shape", [("uint8", (224, 224, 3)), ("uint8", (31, 17, 3)),
                                          ("float32", (3, 224, 224))])
def test_a_gpu_uploads_images_from_a_registered_slab_as_the_host_copy_gives_them(views, dtype, shape):
    """The slab registered with CUDA: each image is uploaded from its slot into the device batch, and the batch
    equals what the host copy into pinned memory and its upload give; the check wrote only a free slot."""
    front_end, engine = views
    written = _images_in_slots(front_end, dtype, shape)
    device = torch.device("cuda:0")
    rows = torch.from_numpy(engine.input_rows())
    host_copied = raw_batch([RawImage(dtype, shape, SlotBytes(rows, slot, len(data))) for slot, data in written],
                            device)
    assert register_slab(engine, device) and rows.is_pinned()
    uploaded = raw_batch([RawImage(dtype, shape, SlotBytes(rows, slot, len(data))) for slot, data in written],
                         device)
    # And gathered in one kernel from the slab seen as a CUDA tensor at its own addresses (no copy of it made)
    on_device = device_rows(engine, device)
    assert on_device is not None and on_device.is_cuda and on_device.data_ptr() == engine.input_rows().ctypes.data
    gathered = raw_batch([RawImage(dtype, shape, SlotBytes(on_device, slot, len(data))) for slot, data in written],
                         device)
    for got, by_copy, want in zip(gathered, uploaded, host_copied, strict=True):
        assert got.is_cuda and torch.equal(by_copy, want) and torch.equal(got, want)
    assert [bytes(front_end.input(slot, len(data))) for slot, data in written] == [data for _, data in written]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(engine.address)  # before the fixture unmaps it
