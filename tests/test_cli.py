"""resnet-client: JSON shape, table, info, health and exit codes, against a real server."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from client.cli import main
from tests.helpers import encode, random_rgb


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i, fmt in enumerate(["JPEG", "PNG"]):
        path = folder / f"picture{i}.{fmt.lower()}"
        path.write_bytes(encode(random_rgb(40 + i), fmt))
        paths.append(str(path))
    return paths


def test_classify_json_lines(server, reference, image_files, capsys):
    code = main(["classify", *image_files, "--server", server.target, "--top-k", "3", "--temperature", "2",
                 "--full", "--json"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for path, line in zip(image_files, lines, strict=True):
        record = json.loads(line)
        assert record["image"] == path and record["device"] == "cpu"
        assert len(record["top_k"]) == 3 and set(record["top_k"][0]) == {"index", "label", "probability"}
        assert len(record["probabilities"]) == 1000
        with open(path, "rb") as handle:
            expected = reference.probabilities(reference.input_from_bytes(handle.read()), 2.0)
        np.testing.assert_allclose(record["probabilities"], expected, atol=1e-5)
        assert record["top_k"][0]["index"] == int(np.argmax(expected))


def test_classify_table(server, image_files, capsys):
    assert main(["classify", image_files[0], "--server", server.target]) == 0
    out = capsys.readouterr().out
    assert image_files[0] in out and "device cpu" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("1.", "2.", "3.", "4.", "5."))]) == 5


def test_info_and_health(server, capsys):
    assert main(["info", "--server", server.target, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "resnet18" and len(info["labels"]) == 1000 and info["devices"] == ["cpu"]
    assert main(["health", "--server", server.target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_failure_exits_non_zero_with_the_status_code(server, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"definitely not a jpeg")
    done = subprocess.run([sys.executable, "-m", "client.cli", "classify", str(bad), "--server", server.target],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"resnet-client: error: INVALID_ARGUMENT: cannot decode image ({bad.stat().st_size} bytes): "
        "not a JPEG, PNG, GIF or WEBP file"]


def test_unreachable_server_is_unavailable(capsys, tmp_path):
    image = tmp_path / "x.png"
    image.write_bytes(encode(random_rgb(1), "PNG"))
    assert main(["classify", str(image), "--server", "127.0.0.1:1", "--timeout", "5"]) == 1
    assert capsys.readouterr().err.startswith("resnet-client: error: UNAVAILABLE: ")


def test_missing_file_is_a_clear_error(capsys):
    assert main(["classify", "/nonexistent/cat.jpg", "--server", "127.0.0.1:1"]) == 1
    assert "No such file" in capsys.readouterr().err
