"""The committed gRPC code in client/resnet_client/api/ must be exactly what proto/ generates now."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT, load_script

# The grpcio-tools release that wrote a file stamps it (the least grpcio it runs with): a newer patch release
# writes the same code under a newer stamp.
_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE)


def _code(text: str) -> str:
    return _STAMP.sub("GRPC_GENERATED_VERSION = ...", text)


def test_generated_code_is_fresh(tmp_path):
    fresh = {path.name: _code(path.read_text()) for path in load_script("gen_proto").generate(tmp_path)}
    committed = {path.name: _code(path.read_text())
                 for path in (ROOT / "client" / "resnet_client" / "api").glob("*_pb2*.py*")}
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}: run python scripts/gen_proto.py"


def test_client_package_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, resnet_client, resnet_client.cli; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


@pytest.mark.slow
def test_what_each_process_imports_loads_no_library_it_does_not_use():
    """At run time, not only as lint-imports reads the imports: the boundary the processes share (the slab, its
    protocol, the control pipes) loads neither torch nor grpc, the engine no grpc (the client package's names load
    on first use, so the server's one import from it, the refused-batch wire format, brings no grpc with it),
    and the client's names still resolve."""
    import subprocess
    import sys

    code = ("import sys, resnet_server.boundary.link, resnet_server.boundary.control; "
            "assert not {'torch', 'grpc'} & set(sys.modules), sorted({'torch', 'grpc'} & set(sys.modules)); "
            "import resnet_server.engine.main; assert 'grpc' not in sys.modules; "
            "from resnet_client import Client, SharedMemory, classify_files; assert 'grpc' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
