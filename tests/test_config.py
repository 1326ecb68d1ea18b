"""Flags, their RESNET_SERVER_* twins (flags win), validation, and device resolution."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resnet_server.common.config import FLAGS, ConfigError, ServerConfig, env_name, flags_table, parse_config
from resnet_server.common.devices import replica_names, resolve_devices
from resnet_server.common.errors import StartupError
from resnet_server.common.event_loop import resolved


def test_defaults():
    config = parse_config([], env={})
    assert config == ServerConfig()
    assert config.port == 50051 and config.metrics_port == 8000 and config.devices == ("auto",)


def test_env_twins_and_flags_win():
    env = {"RESNET_SERVER_DEVICE": "cuda:1", "RESNET_SERVER_PORT": "6000", "RESNET_SERVER_TEMPERATURE": "2.5",
           "RESNET_SERVER_MAX_BATCH_DELAY_MS": "3", "RESNET_SERVER_WEIGHTS": "random"}
    config = parse_config(["--port", "7000"], env=env)
    assert config.port == 7000
    assert config.devices == ("cuda:1",)
    assert config.temperature == 2.5 and config.max_batch_delay_ms == 3.0 and config.weights == "random"
    assert parse_config(["--device", "cpu,cpu"], env=env).devices == ("cpu", "cpu")
    assert parse_config([], env={"RESNET_SERVER_REPLICA_PROBE_INTERVAL": "0"}).replica_probe_interval == 0.0
    assert parse_config([], env={"RESNET_SERVER_FRONTENDS": "4"}).frontends == 4
    assert parse_config(["--frontends", "auto"], env={"RESNET_SERVER_FRONTENDS": "4"}).frontends == 0  # auto
    assert parse_config([], env={}).frontends == 0
    # --workers (and its environment twin) is the old name of --frontends.
    assert parse_config([], env={"RESNET_SERVER_WORKERS": "3"}).frontends == 3
    assert parse_config(["--workers", "2"], env={}).frontends == 2
    assert parse_config([], env={}).unhealthy_exit_after == 300.0
    assert parse_config([], env={"RESNET_SERVER_UNHEALTHY_EXIT_AFTER": "0"}).unhealthy_exit_after == 0.0
    assert parse_config([], env={}).max_connection_age == 0.0
    assert parse_config(["--max-connection-age", "60"], env={}).max_connection_age == 60.0
    assert parse_config([], env={}).switch_interval_ms == 0.5
    assert parse_config([], env={"RESNET_SERVER_SWITCH_INTERVAL_MS": "5"}).switch_interval_ms == 5.0
    assert parse_config([], env={}).wait_for_callers_ms == 0.0
    assert parse_config([], env={"RESNET_SERVER_WAIT_FOR_CALLERS_MS": "30"}).wait_for_callers_ms == 30.0


def test_a_boolean_flag_alone_means_true():
    assert parse_config(["--compile"], env={}).compile is True
    assert parse_config(["--compile", "false"], env={"RESNET_SERVER_COMPILE": "1"}).compile is False
    assert parse_config([], env={"RESNET_SERVER_COMPILE": "yes"}).compile is True
    assert parse_config(["--channels-last", "off"], env={}).channels_last is False


def test_a_compile_mode_other_than_default_needs_compile():
    assert parse_config(["--compile", "--compile-mode", "reduce-overhead"], env={}).compile_mode == "reduce-overhead"
    assert parse_config(["--compile"], env={"RESNET_SERVER_COMPILE_MODE": "reduce-overhead"}).compile_mode == \
        "reduce-overhead"
    with pytest.raises(ConfigError, match="--compile-mode reduce-overhead needs --compile"):
        parse_config(["--compile-mode", "reduce-overhead"], env={})
    assert parse_config(["--compile", "--compile-mode", "max-autotune"], env={}).compile_mode == "max-autotune"
    with pytest.raises(ConfigError, match="--compile-mode max-autotune needs --compile"):
        parse_config(["--compile-mode", "max-autotune"], env={})


def test_torchscript_is_off_by_default_and_excludes_compile():
    assert parse_config([], env={}).torchscript is False
    assert parse_config(["--torchscript"], env={}).torchscript is True
    assert parse_config([], env={"RESNET_SERVER_TORCHSCRIPT": "true"}).torchscript is True
    with pytest.raises(ConfigError, match="--compile and --torchscript exclude each other: choose one"):
        parse_config(["--torchscript"], env={"RESNET_SERVER_COMPILE": "1"})


def test_cuda_graphs_are_auto_by_default_and_yield_to_compile_and_torchscript():
    default = parse_config([], env={})
    assert default.cuda_graphs == "auto" and default.uses_cuda_graphs is True
    # auto leaves the runner to --compile or --torchscript when one is asked for, without an error
    assert parse_config(["--compile"], env={}).uses_cuda_graphs is False
    assert parse_config(["--torchscript"], env={}).uses_cuda_graphs is False
    assert parse_config(["--cuda-graphs", "false"], env={}).uses_cuda_graphs is False
    assert parse_config([], env={"RESNET_SERVER_CUDA_GRAPHS": "off"}).uses_cuda_graphs is False
    assert parse_config(["--cuda-graphs"], env={}).cuda_graphs == "true"
    assert parse_config([], env={"RESNET_SERVER_CUDA_GRAPHS": "true"}).uses_cuda_graphs is True
    with pytest.raises(ConfigError, match="--torchscript and --cuda-graphs exclude each other: choose one"):
        parse_config(["--cuda-graphs", "--torchscript"], env={})
    with pytest.raises(ConfigError, match="--compile and --cuda-graphs exclude each other: choose one"):
        parse_config(["--cuda-graphs", "true", "--compile"], env={})


def test_decode_on_device_is_auto_true_or_false():
    assert parse_config([], env={}).decode_on_device == "auto"
    assert parse_config(["--decode-on-device"], env={}).decode_on_device == "true"
    assert parse_config([], env={"RESNET_SERVER_DECODE_ON_DEVICE": "off"}).decode_on_device == "false"
    assert parse_config(["--decode-on-device", "AUTO"], env={}).decode_on_device == "auto"


def test_the_event_loop_is_auto_uvloop_or_asyncio(monkeypatch):
    assert parse_config([], env={}).event_loop == "auto"
    assert parse_config([], env={"RESNET_SERVER_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    assert parse_config(["--event-loop", "uvloop"], env={}).event_loop == "uvloop"
    assert resolved("auto") == "uvloop"  # the server extra installs it
    # Where uvloop is missing, auto falls back to asyncio's loop and naming uvloop is a clear error.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    assert resolved("auto") == "asyncio"
    with pytest.raises(ConfigError, match="--event-loop uvloop: uvloop is not installed"):
        parse_config(["--event-loop", "uvloop"], env={})


@pytest.mark.parametrize("argv", [["--temperature", "0"], ["--temperature", "nan"], ["--temperature", "-1"],
                                  ["--temperature", "inf"], ["--max-batch-size", "-1"], ["--max-queue", "-3"],
                                  ["--port", "x"], ["--compile", "maybe"],
                                  ["--decode-on-device", "gpu"], ["--compile", "--compile-mode", "fast"],
                                  ["--replica-probe-interval", "-1"], ["--replica-probe-interval", "inf"],
                                  ["--unhealthy-exit-after", "-5"],
                                  ["--max-connection-age", "nan"], ["--workers", "0"],
                                  ["--switch-interval-ms", "0"], ["--switch-interval-ms", "inf"],
                                  ["--event-loop", "trio"], ["--port", "99999"], ["--port", "-1"],
                                  ["--metrics-port", "70000"], ["--weights", "imagnet"],
                                  ["--weights", "/no/such/weights.pth"], ["--log-level", "LOUD"],
                                  ["--runner", "bogus"], ["--runner", "free:abc"], ["--runner", "faulty:"],
                                  ["--runner", "model:x"], ["--max-batch-size", "1025"], ["--device", "tpu"],
                                  ["--device", "cpu,cuda:x"], ["--tls-cert", "/no/such.pem"],
                                  ["--auth-token-file", "/no/such/tokens"], ["--temperature-file", "/no/such.json"]])
def test_bad_flags_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_config(argv, env={})
    assert caught.value.code == 2
    assert "error" in capsys.readouterr().err


def test_a_compile_cache_is_a_folder_made_if_missing_and_writable(tmp_path, capsys):
    folder = tmp_path / "cache" / "inductor"
    assert parse_config(["--compile-cache", str(folder)], env={}).compile_cache == str(folder) and folder.is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as caught:
        parse_config(["--compile-cache", str(tmp_path / "file" / "cache")], env={})
    assert caught.value.code == 2
    assert f"cannot make the folder '{tmp_path / 'file' / 'cache'}': Not a directory" in capsys.readouterr().err
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    if not os.access(read_only, os.W_OK):  # root writes anywhere
        with pytest.raises(ConfigError, match="RESNET_SERVER_COMPILE_CACHE=.*is not writable by this user"):
            parse_config([], env={"RESNET_SERVER_COMPILE_CACHE": str(read_only)})


def _refusal(argv: list[str], capsys) -> str:
    """What the flag check says of ``argv``: argparse's error (exit 2), or a ConfigError's (main() exits 2)."""
    try:
        parse_config(argv, env={})
    except SystemExit as exc:
        assert exc.code == 2
        return capsys.readouterr().err.splitlines()[-1].removeprefix("resnet-server: error: ")
    except ConfigError as exc:
        return str(exc)
    pytest.fail(f"{argv} was accepted")


def test_what_a_process_would_refuse_is_refused_before_any_process_starts(tmp_path, capsys):
    """A file the front-ends would read (TLS material, tokens, a fitted temperature) that is missing, unreadable
    or holds nothing usable, a device name no engine knows, a batch no queue could fill: each is a usage error of
    resnet-server's own, not a child's failed start."""
    pem, empty, folder = tmp_path / "server.pem", tmp_path / "empty", tmp_path / "folder"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    empty.write_text("# only a comment\n\n")
    folder.mkdir()
    (tmp_path / "t.json").write_text('{"temperature": 1.5}')
    (tmp_path / "zero.json").write_text('{"temperature": 0}')
    config = parse_config(["--tls-cert", str(pem), "--tls-key", str(pem), "--temperature-file",
                           str(tmp_path / "t.json")], env={})
    assert (config.tls_cert, config.temperature_file) == (str(pem), str(tmp_path / "t.json"))
    refused = {
        ("--tls-cert", str(pem)): "TLS needs both --tls-cert and --tls-key",
        ("--tls-key", str(pem)): "TLS needs both --tls-cert and --tls-key",
        ("--tls-client-ca", str(pem)): "--tls-client-ca needs --tls-cert and --tls-key",
        ("--tls-key", str(folder)): f"argument --tls-key: cannot read '{folder}': Is a directory",
        ("--auth-token-file", str(empty)): f"argument --auth-token-file: {empty} holds no token (one a line; "
                                            "blank lines and # comments are skipped)",
        ("--temperature-file", str(tmp_path / "zero.json")):
            f"argument --temperature-file: the temperature in {tmp_path / 'zero.json'} must be finite and > 0, got 0.0",
        ("--max-batch-size", "4096"): "argument --max-batch-size: must be between 0 and 1024, got 4096",
        ("--device", "cpu,mps"): "argument --device: unknown device 'mps': use cpu, cuda, cuda:N, auto, or a "
                                 "comma-separated list",
        ("--port", "8000"): "--port and --metrics-port are both 8000: gRPC and /metrics need a port each",
        ("--http-port", "50051"): "--port and --http-port are both 50051: gRPC and HTTP need a port each",
        ("--http-port", "8000"): "--http-port and --metrics-port are both 8000: HTTP and /metrics need a port each",
        ("--host", "999.1.1.1"): "argument --host: '999.1.1.1' is neither an IP address nor a name this machine "
                                 "resolves",
        ("--metrics-host", "192.0.2.1"): "argument --metrics-host: '192.0.2.1' is not an address of this machine",
        ("--max-batch-size", "512"): "--max-batch-size 512 is over --max-queue 256, the images a device holds at "
                                     "once: no batch could fill; raise --max-queue or lower the batch",
        ("--max-queue", "16"): "--max-images-per-request 64 is over --max-queue 16, the images a device holds at "
                               "once: such a request would be refused for ever; raise --max-queue or lower the "
                               "request limit",
    }
    for argv, message in refused.items():
        assert _refusal(list(argv), capsys) == message
    two_hosts = ["--port", "9000", "--metrics-port", "9000", "--host", "127.0.0.1", "--metrics-host", "127.0.0.2"]
    assert parse_config(two_hosts, env={}).metrics_port == 9000  # two sockets after all


@pytest.mark.slow
def test_a_flag_that_does_not_go_with_another_exits_2_before_any_process_starts(tmp_path):
    """ConfigError (flags each valid, together not) is the same usage error as argparse's, from the command."""
    (tmp_path / "server.pem").write_text("")
    command = [str(Path(sys.executable).parent / "resnet-server"), "--tls-cert", str(tmp_path / "server.pem")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "resnet-server: error: TLS needs both --tls-cert and --tls-key\n"


def test_a_blank_otlp_endpoint_leaves_tracing_off():
    """compose passes RESNET_SERVER_OTLP_ENDPOINT through, empty unless the tracing profile's receiver is named."""
    assert parse_config([], env={"RESNET_SERVER_OTLP_ENDPOINT": ""}).otlp_endpoint is None
    assert parse_config(["--otlp-endpoint", " jaeger:4317 "], env={}).otlp_endpoint == "jaeger:4317"


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="RESNET_SERVER_TEMPERATURE='0'"):
        parse_config([], env={"RESNET_SERVER_TEMPERATURE": "0"})
    with pytest.raises(ConfigError, match="RESNET_SERVER_METRICS_PORT='70000': must be a port from 0 to 65535"):
        parse_config([], env={"RESNET_SERVER_METRICS_PORT": "70000"})
    with pytest.raises(ConfigError, match="RESNET_SERVER_WEIGHTS='imagnet': must be imagenet, random or the path"):
        parse_config([], env={"RESNET_SERVER_WEIGHTS": "imagnet"})


def test_weights_are_a_name_or_a_file_that_exists(tmp_path):
    assert parse_config(["--weights", "random"], env={}).weights == "random"
    (tmp_path / "mine.pth").write_bytes(b"")  # whether it loads is the engine's to say
    assert parse_config(["--weights", str(tmp_path / "mine.pth")], env={}).weights == str(tmp_path / "mine.pth")
    assert parse_config(["--log-level", "debug"], env={}).log_level == "DEBUG"


def test_devices():
    assert resolve_devices(("cpu",)) == [torch.device("cpu")]
    assert resolve_devices(("cpu", "cpu")) == [torch.device("cpu")] * 2
    expected_auto = ([torch.device("cuda", i) for i in range(torch.cuda.device_count())]
                     if torch.cuda.is_available() else [torch.device("cpu")])
    assert resolve_devices(("auto",)) == expected_auto
    for bad in ("tpu", "gpu:0", "cuda:99"):
        with pytest.raises(StartupError):
            resolve_devices((bad,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(StartupError, match="CUDA is not available"):
        resolve_devices(("cuda:0",))


def test_replica_names_are_unique_per_device():
    cpu = torch.device("cpu")
    assert replica_names([cpu]) == ["cpu"]
    assert replica_names([cpu, cpu]) == ["cpu#0", "cpu#1"]
    assert replica_names([torch.device("cuda", 0), cpu]) == ["cuda:0", "cpu"]


def test_the_readme_flag_table_is_the_help_of_every_flag():
    """One source: the README's table is flags_table(), which --help's text also comes from. After changing a
    flag, paste the output of
    `python -c 'from resnet_server.common.config import flags_table; print(flags_table())'`."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert flags_table() in readme
    defaults = ServerConfig()
    for line in flags_table().splitlines()[2:]:
        flag, env, written = (cell.strip().strip("`") for cell in line.split("|")[1:4])
        kind = {f"--{name}": kind for name, kind, _ in FLAGS}[flag]
        assert env == env_name(flag.removeprefix("--"))
        # The default as written, read with the flag's own type, is the default the server starts with.
        default = getattr(defaults, "devices" if flag == "--device" else flag[2:].replace("-", "_"))
        assert (None if written == "none" and default is None else kind(written)) == default, flag


@pytest.mark.parametrize(("field", "value", "error"), [
    ("cuda_graphs", True, "cuda_graphs must be str, got True (bool)"),  # "true", "false" or "auto"
    ("cuda_graphs", "yes", "cuda_graphs must be one of true, false, auto, got 'yes'"),
    ("port", "50051", "port must be int, got '50051' (str)"),
    ("grace_period", True, "grace_period must be float, got True (bool)"),
    ("devices", "cpu", "devices must be tuple[str, ...], got 'cpu' (str)"),
    ("precision", "fp8", "precision must be one of fp32, fp16, bf16, int8, got 'fp8'"),
    ("tls_cert", 3, "tls_cert must be str | None, got 3 (int)"),
])
def test_a_configuration_built_in_code_is_checked_as_the_flags_are(field, value, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        ServerConfig(**{field: value})
    assert ServerConfig(grace_period=5, tls_cert="server.pem").grace_period == 5  # an int is a float's value
