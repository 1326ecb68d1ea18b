from __future__ import annotations

import os

import pytest

from tests.helpers import EngineSet, Faults, Reference, ServerThread, base_config, free_port, save_random_weights

# The servers tests start as processes listen for HTTP only where a test asks (--http-port): the default port is
# one, which two servers at once, or anything else on the machine, would contend for.
os.environ.setdefault("RESNET_SERVER_HTTP_PORT", "0")


SERVERS_OF_THEIR_OWN = {"make_server", "engines", "hostile_target", "two_workers"}  # fixtures that start them


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow, besides the tests marked so: a lab test (`-m "not slow"` replaces the default `-m "not lab"`), and
    one that starts servers of its own (seconds each). The rest share the session's ``server``."""
    for item in items:
        if item.get_closest_marker("lab") or SERVERS_OF_THEIR_OWN & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "resnet18-seeded.pth"
    state = save_random_weights(path)
    return path, state


@pytest.fixture(scope="session")
def reference(weights_file) -> Reference:
    return Reference(weights_file[1])


@pytest.fixture(scope="session")
def server(weights_file):
    """One shared server on 127.0.0.1:0 serving the test-made weights file (the real file-loading path), as
    resnet-server runs: an engine process (its model, batcher and /metrics) fed through its shared slab by a
    front-end, here on a thread of the test's process, so that tests can read its series; gRPC and HTTP."""
    engines = EngineSet(base_config(str(weights_file[0]), metrics_port=free_port(), http_port=free_port()))
    yield engines.frontend()
    engines.stop()


@pytest.fixture()
def faults(tmp_path) -> Faults:
    """A fault file for a server started with ``runner=faults.runner``; no fault until the test sets one."""
    return Faults(tmp_path / "faults")


@pytest.fixture()
def make_server(weights_file):
    """Start servers with custom settings, each with engine processes of its own and its merged /metrics (on
    ``metrics_port``, a free port unless given); each is stopped at the end of the test."""
    started: list[EngineSet] = []

    def start(**overrides) -> ServerThread:
        weights = overrides.pop("weights", str(weights_file[0]))
        engines = EngineSet(base_config(weights, **{"metrics_port": free_port(), **overrides}))
        started.append(engines)
        return engines.frontend()

    yield start
    for engines in started:
        engines.stop()
