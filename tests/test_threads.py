"""A thread's torch thread count stays what it asked for, whatever other threads set later."""

from __future__ import annotations

import threading

import torch

from resnet_server.common.threads import use_torch_threads


def test_a_thread_keeps_its_own_count_after_another_thread_sets_one():
    asked, other_set, seen = threading.Event(), threading.Event(), []

    def replica_worker() -> None:
        use_torch_threads(3)
        asked.set()
        other_set.wait(timeout=30)
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    worker = threading.Thread(target=replica_worker)
    worker.start()
    try:
        assert asked.wait(timeout=30)
        torch.set_num_threads(1)  # as a preprocessing thread does, after the replica's worker started
        other_set.set()
        worker.join(timeout=30)
    finally:
        torch.set_num_threads(before)
    assert seen == [3]
