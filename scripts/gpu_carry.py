"""Gather what a lent GPU machine lacks for ``scripts/gpu_check.sh`` into one folder that travels with the checkout.

The lent machines' Python has torch, torchvision, numpy, pillow and pytest, and nothing else this project runs
on. This writes, into ``--out`` (``.whl/gpu``, git-ignored; gpu_check.sh installs from it offline):
- the wheels of the Python packages the server and the check need there, at the versions this environment runs
  (so the GPU runs what the tests ran), for the lent machine's Python (``--python-version``);
- ``bin/perf_analyzer``, Triton's load generator, from the tritonclient wheel of the test extra, and in ``lib/``
  the two libraries it links that such a machine lacks: libb64 (Debian's libb64-0d) and the CUDA 12 runtime
  (the nvidia-cuda-runtime-cu12 wheel of the test extra).
The wheels are fetched with pip (the only step that needs the network); ``--no-wheels`` gathers the rest.

Usage: python scripts/gpu_carry.py [--out .whl/gpu] [--python-version 3.12] [--no-wheels]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from perf_analyzer import binary, environment  # its folder is the first path entry

# What a lent machine's Python has and nothing carried may replace: torch's build is the machine's own (CUDA), and
# torchvision, numpy and pillow are built against it. Everything else the server and its CUDA tests import travels,
# with all it requires: the generated code needs grpcio >= 1.85.1 and protobuf >= 7.35.1, pytest-asyncio a pytest
# >= 8.4, grpcio a typing-extensions >= 4.12, newer than such a machine may have.
LENT = ("torch", "torchvision", "numpy", "pillow")
# What a GPU's checks never run and would only fill the carry: ONNX Runtime serves CPUs (--runtime onnxruntime),
# and its tests skip where it is not installed.
CPU_ONLY = ("onnxruntime", "onnx")
# Beside the server's own: pytest and the plugins pyproject's pytest options name (asyncio_mode, timeout), and the
# check's profiler.
TOOLS = ("pytest", "pytest-asyncio", "pytest-timeout", "py-spy")


def required(name: str, extra: str = "") -> list[str]:
    """What the installed distribution ``name`` requires (with ``extra``); nothing where it is not installed here
    (py-spy: a program, imported by none)."""
    try:
        requirements = map(Requirement, importlib.metadata.requires(name) or ())
    except importlib.metadata.PackageNotFoundError:
        return []
    return [req.name for req in requirements if req.marker is None or req.marker.evaluate({"extra": extra})]


def closure(names: list[str], leave: tuple[str, ...] = ()) -> list[str]:
    """``names`` and everything they require, transitively, as installed here; ``leave`` and what only they
    require are left out."""
    left = {canonicalize_name(name) for name in leave}
    todo, seen = list(names), []
    while todo:
        if (name := canonicalize_name(todo.pop(0))) not in left and name not in seen:
            seen.append(name)
            todo += required(name)
    return seen


def carried_packages() -> list[str]:
    """The distributions to carry: the project's dependencies and its server extra (read from its installed
    metadata, so a package added to pyproject travels too) and TOOLS, with all they require, less LENT and
    CPU_ONLY."""
    return closure([*required("resnet-grpc", extra="server"), *TOOLS], leave=LENT + CPU_ONLY)


PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# What perf_analyzer links that a lent machine lacks (it has the C and C++ runtimes, OpenSSL and zlib).
CARRIED_LIBRARIES = re.compile(r"^(libb64\.so\S*|libcudart\.so\.12)$")


def requirement(name: str) -> str:
    """``name==VERSION`` as installed here; the newest release where it is not installed."""
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def download_wheels(out: Path, python_version: str) -> None:
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "--dest", str(out),
                    *map(requirement, carried_packages())], check=True)


def linked_libraries(executable: str) -> dict[str, Path]:
    """The libraries ``executable`` links, by name, where the loader finds them (with the CUDA 12 runtime wheel's
    folder on the library path, as scripts/perf_analyzer.py runs it)."""
    listing = subprocess.run(["ldd", executable], env=environment(), capture_output=True, text=True, check=True)
    found = re.findall(r"^\s*(\S+) => (/\S+)", listing.stdout, re.MULTILINE)
    missing = re.findall(r"^\s*(\S+) => not found", listing.stdout, re.MULTILINE)
    if missing:
        raise SystemExit(f"perf_analyzer links {', '.join(missing)}, not found here: install the test extra "
                         "(nvidia-cuda-runtime-cu12) and Debian's libb64-0d")
    return {name: Path(path) for name, path in found}


def gather_perf_analyzer(out: Path) -> None:
    executable = binary()
    if executable is None:
        raise SystemExit("no perf_analyzer here: install the test extra (its tritonclient wheel carries it)")
    (out / "bin").mkdir(parents=True, exist_ok=True)
    (out / "lib").mkdir(exist_ok=True)
    shutil.copy2(executable, out / "bin" / "perf_analyzer")
    for name, path in linked_libraries(executable).items():
        if CARRIED_LIBRARIES.match(name):
            shutil.copy2(path.resolve(), out / "lib" / name)  # under the name it is linked by, not the file's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".whl/gpu"), help="the folder to fill (default .whl/gpu)")
    parser.add_argument("--python-version", default="3.12", help="the lent machine's Python (default 3.12)")
    parser.add_argument("--no-wheels", action="store_true", help="gather perf_analyzer and its libraries only")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_wheels:
        download_wheels(args.out, args.python_version)
    gather_perf_analyzer(args.out)
    size = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    print(f"{args.out}: {len(list(args.out.glob('*.whl')))} wheels, perf_analyzer and "
          f"{len(list((args.out / 'lib').iterdir()))} libraries, {size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
