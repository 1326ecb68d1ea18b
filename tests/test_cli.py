"""resnet-client: JSON shape, table, info, health and exit codes, against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from resnet_client import Client
from resnet_client.channel import with_default_port
from resnet_client.cli import main, parse_args
from resnet_client.connection_flags import BENCH_ATTEMPTS, DEFAULT_TIMEOUT, SERVER_ENV, TOKEN_ENV
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
    assert info["warning"] == ""  # a weights file: nothing to warn of, so the table leaves the row out
    assert main(["info", "--server", server.target]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert "weights" in rows and "warning" not in rows
    assert main(["health", "--server", server.target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_server_from_the_environment(server):
    """RESNET_CLIENT_SERVER names the server when --server does not (containers, scripts)."""
    env = {**os.environ, SERVER_ENV: server.target}
    done = subprocess.run([sys.executable, "-m", "resnet_client.cli", "health"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "SERVING")
    named = subprocess.run([sys.executable, "-m", "resnet_client.cli", "health", "--server", "127.0.0.1:1", "--timeout",
                            "5"], capture_output=True, text=True, timeout=60, env=env)
    assert named.returncode == 1 and named.stderr.startswith("resnet-client: error: UNAVAILABLE: ")  # the flag wins


def test_connection_flags_before_or_after_the_subcommand(server, capsys):
    """`resnet-client --server X info` works as `resnet-client info --server X`; given in both places, the
    one after the subcommand wins, and a flag before it is not undone by the subcommand's defaults."""
    assert main(["--server", server.target, "health"]) == 0
    assert main(["--server", "127.0.0.1:1", "--timeout", "5", "health", "--server", server.target]) == 0
    assert main(["--server", server.target, "--timeout", "5", "info", "--json"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == ["SERVING", "SERVING"]
    assert main(["--server", server.target, "health", "--server", "127.0.0.1:1", "--timeout", "5"]) == 1
    assert capsys.readouterr().err.startswith("resnet-client: error: UNAVAILABLE: ")


def test_parse_args_fills_each_connection_flag_given_nowhere(monkeypatch):
    """What a caller of ``parse_args`` gets: the flags given, wherever given, and the defaults (the
    environment's first) for the rest; bench keeps its own one try."""
    monkeypatch.setenv(SERVER_ENV, "10.0.0.5:50051")
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    args = parse_args(["--timeout", "7", "info", "--tls-ca", "ca.pem"])
    assert (args.server, args.timeout, args.tls_ca, args.tls_cert, args.token, args.attempts) == (
        "10.0.0.5:50051", 7.0, "ca.pem", None, "from-env", 3)
    bench = parse_args(["bench", "--server", "127.0.0.1:9"])
    assert (bench.server, bench.timeout, bench.attempts) == ("127.0.0.1:9", DEFAULT_TIMEOUT, BENCH_ATTEMPTS)


def test_failure_exits_non_zero_with_the_status_code(server, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"definitely not a jpeg")
    done = subprocess.run([sys.executable, "-m", "resnet_client.cli", "classify", str(bad), "--server", server.target],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"resnet-client: error: {bad}: INVALID_ARGUMENT: cannot decode image ({bad.stat().st_size} bytes): "
        "not a JPEG, PNG, GIF or WEBP file"]


def test_many_files_go_in_requests_and_a_bad_file_fails_alone(make_server, reference, tmp_path, capsys):
    """Nine paths, over the server's four images a request, in requests of three: one undecodable file and
    one missing file get their own errors, and every other file its result, in the order given."""
    running = make_server(max_images_per_request=4)
    paths = []
    for index in range(9):
        path = tmp_path / f"image{index}.png"
        if index == 1:
            path.write_bytes(b"not an image at all")
        elif index != 4:  # image4.png is never written
            path.write_bytes(encode(random_rgb(100 + index, 64, 80), "PNG"))
        paths.append(str(path))
    code = main(["classify", *paths, "--server", running.target, "--images-per-request", "3", "--concurrency", "2",
                 "--json", "--full"])
    assert code == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [record["image"] for record in records] == paths
    assert records[1]["error"] == {"code": "INVALID_ARGUMENT",
                                   "message": "cannot decode image (19 bytes): not a JPEG, PNG, GIF or WEBP file"}
    assert records[4]["error"]["code"] is None and "No such file" in records[4]["error"]["message"]
    for index in (0, 2, 3, 5, 6, 7, 8):
        expected = reference.probabilities(reference.input_from_bytes(Path(paths[index]).read_bytes()))
        np.testing.assert_allclose(records[index]["probabilities"], expected, atol=1e-5)
    # The first request (0-2) refused, naming image 1, then 0 and 2 sent again in one; 3 and 5 without the
    # missing 4; 6-8. Each image is counted once, by what happened to it.
    assert running.sample("resnet_requests_total", device="cpu", code="INVALID_ARGUMENT") == 1
    assert running.sample("resnet_requests_total", device="cpu", code="OK") == 3
    assert running.sample("resnet_images_total", device="cpu", code="OK") == 7
    assert running.sample("resnet_images_total", device="cpu", code="INVALID_ARGUMENT") == 1


def test_unreachable_server_is_unavailable(capsys, tmp_path):
    image = tmp_path / "x.png"
    image.write_bytes(encode(random_rgb(1), "PNG"))
    assert main(["classify", str(image), "--server", "127.0.0.1:1", "--timeout", "5"]) == 1
    assert capsys.readouterr().err.startswith("resnet-client: error: UNAVAILABLE: ")


def test_missing_file_is_a_clear_error(capsys):
    assert main(["classify", "/nonexistent/cat.jpg", "--server", "127.0.0.1:1"]) == 1
    assert "No such file" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["info"], ["classify", "IMAGE", "--json", "--full"]])
def test_the_cli_stops_quietly_when_its_reader_closes_the_pipe(server, tmp_path, command):
    image = tmp_path / "image.png"
    image.write_bytes(encode(random_rgb(3), "PNG"))
    process = subprocess.Popen(
        [sys.executable, "-m", "resnet_client.cli", *[str(image) if part == "IMAGE" else part for part in command],
         "--server", server.target], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader has gone before the first line is written, as `| head` may
    _, errors = process.communicate(timeout=60)
    assert (process.returncode, errors.decode()) == (0, "")


@pytest.mark.parametrize(("flags", "error"), [
    (["--top-k", "0"], "argument --top-k: must be between 1 and 1000, got 0"),
    (["--top-k", "1001"], "argument --top-k: must be between 1 and 1000, got 1001"),
    (["--temperature", "0"], "argument --temperature: must be a finite number > 0, got 0"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number > 0, got nan"),
    (["--images-per-request", "0"], "argument --images-per-request: must be between 1 and 1000, got 0"),
    (["--concurrency", "65"], "argument --concurrency: must be between 1 and 64, got 65"),
    (["--attempts", "9"], "argument --attempts: must be between 1 and 5, got 9"),
])
def test_a_bad_flag_value_is_one_usage_error_and_nothing_is_sent(server, image_files, flags, error, capsys):
    before = server.sample("resnet_requests_total", device="cpu", code="INVALID_ARGUMENT")
    with pytest.raises(SystemExit) as exited:
        main(["classify", *image_files, *image_files, "--server", server.target, *flags])
    assert exited.value.code == 2
    assert [line for line in capsys.readouterr().err.splitlines() if "error" in line] == \
        [f"resnet-client classify: error: {error}"]
    assert server.sample("resnet_requests_total", device="cpu", code="INVALID_ARGUMENT") == before


@pytest.mark.parametrize(("given", "target"), [
    ("localhost", "localhost:50051"), ("localhost:6000", "localhost:6000"), ("10.0.0.5", "10.0.0.5:50051"),
    ("dns:///resnet.internal", "dns:///resnet.internal:50051"), ("dns:///resnet.internal:7", "dns:///resnet.internal:7"),
    ("[::1]", "[::1]:50051"), ("[::1]:6000", "[::1]:6000"), ("::1", "[::1]:50051"), ("unix:/run/resnet.sock",
                                                                                  "unix:/run/resnet.sock"),
])
def test_a_target_without_a_port_means_the_servers_default_port(given, target):
    assert with_default_port(given) == target


@pytest.mark.parametrize("given", ["localhost:99999", "10.0.0.5:0", "[::1]:70000", "host:abc",
                                   "dns:///resnet.internal:65536"])
def test_a_target_with_an_impossible_port_is_refused_rather_than_wrapped(given, capsys, monkeypatch):
    """gRPC reads port 99999 as 34463 (mod 65536): the client refuses it, and the CLI says so as a usage error,
    whether the address came from --server or from RESNET_CLIENT_SERVER."""
    with pytest.raises(ValueError, match="the port must be a number from 1 to 65535"):
        with_default_port(given)
    with pytest.raises(SystemExit) as exited:
        main(["--server", given, "info"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"resnet-client: error: argument --server: {given!r}: the port must be a number from 1 to 65535")
    monkeypatch.setenv("RESNET_CLIENT_SERVER", f"10.0.0.6:6000,{given}")
    with pytest.raises(SystemExit) as exited:
        main(["health"])
    assert exited.value.code == 2


def test_the_client_completes_a_bare_host_with_the_default_port():
    assert Client("localhost")._config.target == "localhost:50051"
    assert Client("10.0.0.5,10.0.0.6:6000")._config.target == "ipv4:10.0.0.5:50051,10.0.0.6:6000"
