"""Every command-line entry point answers --help (exit 0, every flag listed), as the installed commands run it;
and the server's command in a client-only install says in one line what to install."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from resnet_client.cli import build_parser as client_parser
from resnet_server.common.config import build_parser as server_parser
from resnet_server.engine.bench_model import build_parser as bench_model_parser
from resnet_server.engine.quantize import parser as quantize_parser

BIN = Path(sys.executable).parent  # the venv's console scripts, beside its python
ROOT = Path(__file__).resolve().parent.parent


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(commands.choices)


COMMANDS = [
    (["resnet-server"], server_parser({})),
    (["resnet-server", "bench-model"], bench_model_parser()),
    (["resnet-server", "quantize"], quantize_parser()),
    (["resnet-client"], client_parser()),
    *((["resnet-client", name], sub) for name, sub in _subcommands(client_parser()).items()),
]


@pytest.mark.slow
@pytest.mark.parametrize(("command", "parser"), COMMANDS, ids=[" ".join(command) for command, _ in COMMANDS])
def test_every_command_answers_help_with_every_flag(command, parser):
    done = subprocess.run([str(BIN / command[0]), *command[1:], "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and done.stdout.startswith("usage: " + " ".join(command))
    missing = [option for option in _options(parser) if option not in done.stdout]
    assert not missing and len(_options(parser)) > 2


# The Python commands of scripts/, scripts/benchmarks/ and the container proof (check_args.py is a module of two).
SCRIPTS = sorted(path.relative_to(ROOT).as_posix() for path in
                 [*(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts" / "benchmarks").glob("*.py"),
                  *(ROOT / "tests" / "container").glob("*.py")]
                 if "__main__" in (text := path.read_text()) and ("argparse" in text or "check_parser(" in text))


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_with_flags_answers_help(script):
    done = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ")


SHELL_SCRIPTS = ["scripts/gpu_check.sh", "scripts/bench_cpu.sh", "tests/container/run.sh", ".ci/run"]


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_every_shell_script_answers_help_and_refuses_an_unknown_option(script, tmp_path):
    """--help prints the script's header comment and does nothing else; an unknown option is a usage error
    (exit 2) rather than the name of an output folder that a run of many minutes would then fill."""
    lines = (ROOT / script).read_text().splitlines()
    header = [line.lstrip("# ") for line in lines[1:] if line.startswith("#")][0]
    helped = subprocess.run(["bash", str(ROOT / script), "--help"], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert helped.returncode == 0 and helped.stderr == ""
    assert helped.stdout.splitlines()[0] == header and "set -" not in helped.stdout
    refused = subprocess.run(["bash", str(ROOT / script), "--out", "x"], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == f"{Path(script).name}: unknown option --out (--help says how to run it)\n"
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_container_proof_refuses_an_unknown_stage_before_it_starts_anything(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "tests/container/run.sh")], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={**os.environ, "STAGES": "build stak"})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "run.sh: unknown stage 'stak' in STAGES (build, compile, stack)\n"


@pytest.mark.slow
def test_the_server_help_shows_each_default_and_environment_twin():
    done = subprocess.run([str(BIN / "resnet-server"), "-h"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0
    assert "[env RESNET_SERVER_PORT; default 50051]" in done.stdout
    assert "GOAWAY, +-10% jitter" in done.stdout  # a literal %, which argparse once choked on


@pytest.mark.slow
@pytest.mark.parametrize(("absent", "named"), [("torch", "torch, torchvision"),  # torchvision needs torch
                                               ("grpc_reflection", "grpc_reflection")])
def test_a_client_only_install_says_how_to_get_the_server(absent, named):
    """The client's install lacks the server extra's packages (each absent here by the import system's own
    seam, a None in sys.modules); `resnet-server` then says what to install, in one line, exit 1."""
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.modules[{absent!r}] = None; from resnet_server.cli import main; "
         "sys.exit(main(['--help']))"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"resnet-server: error: this install has the client only (no {named}); the server "
                           "needs its extra: pip install 'resnet-grpc[server]'\n")


@pytest.mark.slow
def test_a_front_end_process_loads_none_of_the_engines_modules():
    """What a front-end process imports (its entry point and everything under it) holds no module of the engine
    package: the front-end reaches engines only through the boundary."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, resnet_server.frontend.main, resnet_server.frontend.server; "
         "print(sorted(name for name in sys.modules if name.startswith('resnet_server.')))"],
        capture_output=True, text=True, timeout=120, check=True)
    loaded = done.stdout.strip()
    assert "resnet_server.frontend.engine_client" in loaded and "resnet_server.boundary.protocol" in loaded
    assert "resnet_server.engine" not in loaded and "resnet_server.supervisor" not in loaded


def test_what_pip_installs_is_named_for_the_project(tmp_path):
    """The folders server/ and client/ hold the packages; the wheel holds resnet_server and resnet_client, never a
    top-level package called server or client that another distribution's could overwrite."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("resnet_grpc-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top_level = {name.split("/")[0] for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}
        entry_points = archive.read(next(n for n in archive.namelist() if n.endswith("entry_points.txt"))).decode()
    assert top_level == {"resnet_server", "resnet_client"}
    assert "resnet-server = resnet_server.cli:main" in entry_points
    assert "resnet-client = resnet_client.cli:main" in entry_points


def test_an_editable_install_puts_plain_folders_on_the_path(tmp_path):
    """What ``pip install -e`` installs (the build backend's editable wheel, built here as pip builds it): a .pth
    of the two folders that hold the packages, which editors, type checkers and drawing tools follow, and no
    import-hook finder, which they cannot."""
    built = subprocess.run([sys.executable, "-c", "from hatchling.build import build_editable; "
                            f"print(build_editable({str(tmp_path)!r}))"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    wheel = tmp_path / built.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (pth,) = [name for name in names if name.endswith(".pth")]
        paths = archive.read(pth).decode().split()
    assert not [name for name in names if "finder" in name], names
    assert sorted(paths) == sorted([str(ROOT / "client"), str(ROOT / "server")])
    for folder, package in (("server", "resnet_server"), ("client", "resnet_client")):
        assert (ROOT / folder / package / "__init__.py").exists()
