"""TLS, mutual TLS and bearer tokens, with throwaway CAs: exact status codes for every refusal."""

from __future__ import annotations

import grpc
import pytest

from resnet_client import ClassifierError, Client
from resnet_client.cli import main as client_main
from tests.certs import Authority
from tests.helpers import encode, random_rgb

IMAGE = encode(random_rgb(8))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca, other_ca = Authority(folder, "test-ca"), Authority(folder, "other-ca")
    return {
        "ca": ca.cert_path,
        "server": ca.issue("server", "localhost", server=True),
        "client": ca.issue("client", "alice", server=False),
        "stranger": other_ca.issue("stranger", "mallory", server=False),
    }


def target_for(running) -> str:
    return f"localhost:{running.app.port}"


def test_tls_works_and_plaintext_is_refused(make_server, pki):
    cert, key = pki["server"]
    running = make_server(tls_cert=cert, tls_key=key)
    with Client(target_for(running), tls_ca=pki["ca"], timeout=30) as client:
        assert client.classify([IMAGE])[0].top_k
        assert client.health() == "SERVING"
    with Client(target_for(running), timeout=5) as plaintext, pytest.raises(ClassifierError) as caught:
        plaintext.health()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_certificate_from_the_right_ca(make_server, pki):
    cert, key = pki["server"]
    running = make_server(tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"])
    client_cert, client_key = pki["client"]
    with Client(target_for(running), tls_ca=pki["ca"], tls_cert=client_cert, tls_key=client_key) as client:
        assert client.classify([IMAGE])[0].top_k
    with Client(target_for(running), tls_ca=pki["ca"], timeout=5) as no_cert, pytest.raises(ClassifierError) as caught:
        no_cert.health()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    stranger_cert, stranger_key = pki["stranger"]
    with Client(target_for(running), tls_ca=pki["ca"], tls_cert=stranger_cert, tls_key=stranger_key,
                timeout=5) as stranger, pytest.raises(ClassifierError) as caught:
        stranger.health()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.fixture()
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# accepted tokens\nfirst-secret-token\n\nsecond-secret-token\n")
    return str(path)


def test_bearer_token_over_plaintext(make_server, token_file):
    running = make_server(auth_token_file=token_file)
    for token in ("first-secret-token", "second-secret-token"):
        with Client(running.target, token=token) as client:
            assert client.classify([IMAGE])[0].top_k
            assert client.model_info().name == "resnet18"
    for token in (None, "wrong", "first-secret-tokenX", ""):
        with Client(running.target, token=token) as client, pytest.raises(ClassifierError) as caught:
            client.classify([IMAGE])
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    with Client(running.target) as anonymous:
        assert anonymous.health() == "SERVING"  # probes carry no token
        with pytest.raises(ClassifierError) as caught:
            list(anonymous.classify_stream([]))
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_auth_health_closes_the_health_service_too(make_server, token_file, capsys, monkeypatch):
    running = make_server(auth_token_file=token_file, auth_health=True)
    with Client(running.target) as anonymous, pytest.raises(ClassifierError) as caught:
        anonymous.health()
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    monkeypatch.setenv("RESNET_CLIENT_TOKEN", "second-secret-token")
    assert client_main(["health", "--server", running.target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_token_with_tls(make_server, pki, token_file):
    cert, key = pki["server"]
    running = make_server(tls_cert=cert, tls_key=key, auth_token_file=token_file)
    with Client(target_for(running), tls_ca=pki["ca"], token="first-secret-token") as client:
        assert client.classify([IMAGE])[0].top_k
    with Client(target_for(running), tls_ca=pki["ca"], token="nope") as client, \
            pytest.raises(ClassifierError) as caught:
        client.classify([IMAGE])
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("value", ["Bearer alpha", " Bearer alpha", "Bearer  alpha ", "bearer alpha", "\tBearer alpha"])
def test_whitespace_around_a_bearer_token_is_not_part_of_it(value):
    from resnet_server.frontend.security import presented_token, token_is_valid

    assert presented_token([("authorization", value)]) == b"alpha"
    assert token_is_valid([("authorization", value)], [b"alpha", b"bravo"])
    assert not token_is_valid([("authorization", value.replace("alpha", "alphax"))], [b"alpha"])
    assert not token_is_valid([("authorization", "Basic alpha")], [b"alpha"])
