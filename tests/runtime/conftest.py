"""Fixtures for the runtime tests: a PKI made with `cryptography`, and real servers built on
`oma.runtime` that serve probe servicers for every generated OMA service."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from runtime_probe import ProbeState, ServiceSpec, oma_services, probe_services

from oma.runtime.auth import TokenTable
from oma.runtime.client import ClientTls, connect
from oma.runtime.server import RunningServer, ServerOptions, ServerTls, start_server


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    subject: str,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throwaway CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    directory = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("oma test CA")
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server_cert, server_key = _issue(
        ca_key,
        ca_name,
        "localhost",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_cert, client_key = _issue(
        ca_key, ca_name, "oma test client", ExtendedKeyUsageOID.CLIENT_AUTH, []
    )
    pem = serialization.Encoding.PEM
    pki = Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
    pki.ca.write_bytes(ca_cert.public_bytes(pem))
    pki.server_cert.write_bytes(server_cert.public_bytes(pem))
    pki.client_cert.write_bytes(client_cert.public_bytes(pem))
    _write_key(server_key, pki.server_key)
    _write_key(client_key, pki.client_key)
    return pki


@pytest.fixture(scope="session")
def specs() -> list[ServiceSpec]:
    found = oma_services()
    assert found, "no generated OMA services found under oma.*.v1"
    return found


@pytest.fixture
def tokens() -> TokenTable:
    return TokenTable.generate()


@dataclass
class ProbeServer:
    """A running probe server and how to reach it."""

    running: RunningServer
    state: ProbeState
    tokens: TokenTable
    client_tls: ClientTls | None

    @property
    def address(self) -> str:
        return self.running.address

    def channel(self, role: str | None = "admin", token: str | None = None) -> grpc.aio.Channel:
        if token is None and role is not None:
            token = self.tokens.token_for(role)
        return connect(self.address, token=token, tls=self.client_tls)


@pytest.fixture
async def start_probe(
    tokens: TokenTable, specs: list[ServiceSpec]
) -> AsyncIterator[Callable[..., object]]:
    """Factory: `await start_probe(listen=..., tls=..., client_tls=...)`; all are stopped
    at the end of the test."""
    started: list[ProbeServer] = []

    async def start(
        *,
        listen: str = "127.0.0.1:0",
        tls: ServerTls | None = None,
        client_tls: ClientTls | None = None,
        grace_seconds: float = 5.0,
        max_message_bytes: int = 4 * 1024 * 1024,
        state: ProbeState | None = None,
    ) -> ProbeServer:
        state = state or ProbeState()
        options = ServerOptions(
            tokens=tokens,
            listen=listen,
            tls=tls,
            grace_seconds=grace_seconds,
            max_message_bytes=max_message_bytes,
        )
        running = await start_server(probe_services(state, specs), options)
        probe = ProbeServer(running, state, tokens, client_tls)
        started.append(probe)
        return probe

    yield start
    for probe in started:
        await probe.running.stop(0)


@pytest.fixture(params=["plain", "tls"])
async def probe(
    request: pytest.FixtureRequest, start_probe: Callable[..., object], pki: Pki
) -> ProbeServer:
    """One probe server serving every OMA service, plain or with TLS."""
    if request.param == "tls":
        server = await start_probe(  # type: ignore[operator]
            tls=ServerTls(cert=pki.server_cert, key=pki.server_key),
            client_tls=ClientTls(ca=pki.ca),
        )
    else:
        server = await start_probe()  # type: ignore[operator]
    assert isinstance(server, ProbeServer)
    return server
