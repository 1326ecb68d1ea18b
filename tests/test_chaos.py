"""One process of a running server killed under load, for each kind of process: only the calls in flight in
that process may fail, only with UNAVAILABLE; no answer is wrong; the server serves again, and SIGTERM afterwards
drains it and exits 0 with nothing left behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from resnet_client import ClassifierError, Client
from tests.helpers import random_rgb, wait_for
from tests.server_process import Workers, gone, helper_pid

PIXELS = random_rgb(61, 224, 224)  # raw pixels: no decoding, so the load stays on the processes under test
CALLERS = 6


class Load:
    """``CALLERS`` threads, each on a connection of its own, calling until stopped; every answer checked."""

    def __init__(self, target: str, expected: np.ndarray) -> None:
        self.expected = expected
        self.codes: dict[grpc.StatusCode, int] = {}
        self.wrong = 0
        self.answered: list[float] = []  # when each OK answer came
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._call, args=(target,), daemon=True) for _ in range(CALLERS)]
        for thread in self._threads:
            thread.start()

    def _call(self, target: str) -> None:
        with Client(target, timeout=30, attempts=1, own_connection=True) as client:
            while not self._stop.is_set():
                try:
                    (result,) = client.classify([PIXELS], top_k=1)
                    code = grpc.StatusCode.OK
                except ClassifierError as exc:
                    code, result = exc.code, None
                    time.sleep(0.05)  # the server is restarting a process: don't spin
                with self._lock:
                    self.codes[code] = self.codes.get(code, 0) + 1
                    if result is not None:
                        self.answered.append(time.monotonic())
                        best = result.top_k[0]
                        self.wrong += best.index != self.top or abs(best.probability - self.expected[self.top]) > 1e-5

    @property
    def top(self) -> int:
        return int(np.argmax(self.expected))

    def answers_since(self, moment: float) -> int:
        with self._lock:
            return sum(when > moment for when in self.answered)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def victim_pid(workers: Workers, kind: str, frontends: list[int]) -> int:
    if kind == "fork server":
        return helper_pid(workers.process.pid, "forkserver")
    if kind == "resource tracker":
        return helper_pid(workers.process.pid, "resource_tracker")
    return workers.engine_pids()[0] if kind == "engine" else frontends[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fork server", "resource tracker", "engine", "front-end"])
def test_one_process_killed_under_load_costs_at_most_its_own_calls(kind, weights_file, reference):
    shared_memory = set(os.listdir("/dev/shm"))
    workers = Workers(str(weights_file[0]))
    try:
        port, frontends = workers.serving()
        children = [*frontends, *workers.engine_pids()]
        load = Load(f"127.0.0.1:{port}", reference.probabilities(reference.input_from_array(PIXELS)))
        wait_for(lambda: load.answers_since(0) >= 10, timeout=60)
        killed = time.monotonic()
        os.kill(victim_pid(workers, kind, frontends), signal.SIGKILL)
        if kind == "fork server":  # a child that ends now is started again through a new fork server
            os.kill(frontends[1], signal.SIGKILL)
            workers.read_until(3, "started resnet-frontend")
        wait_for(lambda: load.answers_since(killed + 1) >= 20, timeout=120)  # serving again
        load.stop()
        assert load.wrong == 0
        assert set(load.codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, load.codes
        if kind in ("fork server", "resource tracker"):  # neither holds a call
            assert workers.count("ended") == (1 if kind == "fork server" else 0)  # the front-end killed with it
            assert workers.count("Traceback") == 0
        now = [pid for pid in children if not gone(pid)]
        workers.process.send_signal(signal.SIGTERM)
        assert workers.process.wait(timeout=60) == 0, "".join(workers.lines)
        assert all(gone(pid) for pid in now)
        assert set(os.listdir("/dev/shm")) == shared_memory
    finally:
        workers.close()
