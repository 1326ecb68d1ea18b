"""--log-format json: every record the server logs is one JSON object per line."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys

import pytest

from resnet_server.common.logs import JsonFormatter, TextFormatter, current_request


def test_a_record_with_a_traceback_is_one_json_line():
    try:
        raise ValueError("broken batch")
    except ValueError:
        record = logging.LogRecord("server.batcher", logging.ERROR, __file__, 1, "batch of %d failed", (8,),
                                   sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "ERROR" and entry["logger"] == "server.batcher"
    assert entry["message"] == "batch of 8 failed"
    assert entry["exception"].startswith("Traceback") and "ValueError: broken batch" in entry["exception"]
    assert entry["time"].endswith("+00:00")


def test_a_line_written_while_a_call_is_served_names_its_request_id():
    record = logging.LogRecord("resnet_server.frontend.shared_memory", logging.WARNING, __file__, 1, "region left out",
                               (), None)
    assert "request_id" not in json.loads(JsonFormatter().format(record))  # no call: no id
    token = current_request.set("client-id-7")
    try:
        entry = json.loads(JsonFormatter().format(record))
        line = TextFormatter().format(record)
    finally:
        current_request.reset(token)
    assert entry["request_id"] == "client-id-7" and entry["message"] == "region left out"
    assert line.endswith("resnet_server.frontend.shared_memory: region left out request_id=client-id-7")


@pytest.mark.slow
def test_the_server_logs_json_from_start_to_stop(weights_file):
    process = subprocess.Popen(
        [sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
         "--device", "cpu", "--weights", str(weights_file[0]), "--log-format", "json"],
        stderr=subprocess.PIPE, text=True)
    logged = []
    try:
        for line in process.stderr:
            if line.startswith("{"):
                logged.append(json.loads(line))
                if "serving resnet18 on" in logged[-1]["message"]:
                    break
        process.send_signal(signal.SIGTERM)
        rest = process.stderr.read()
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
    logged += [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
    messages = [entry["message"] for entry in logged]
    (ready,) = [message for message in messages if message.startswith("replica cpu ready on cpu")]
    # How the engine runs its batches, and at which sizes (the CPU's default largest batch is 8).
    assert ready.endswith("; cpu runs fp32 eagerly at batch sizes 1, 2, 3, 4, 5, 6, 7, 8"), ready
    assert any(message.startswith("serving resnet18 on 127.0.0.1:") for message in messages), messages
    assert messages[-1] == "stopped"
    assert {entry["logger"] for entry in logged} >= {"resnet_server.frontend.server", "resnet_server.engine.replicas"}
