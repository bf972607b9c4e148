"""The TCP listener: TLS with client certificates or nothing; read-only calls only (no identity over TCP)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from conftest import cli
from inproc import InProcessServer, free_port, in_process_server

from unisched.scheduler.config import ConfigError, DaemonConfig, check_listener
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc

x509 = pytest.importorskip("cryptography.x509", reason="needs the cryptography package (pip install -e '.[test]')")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


def _write_pem(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _cert(name: str, issuer: tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None, *, ca: bool = False,
          server: bool = False) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(subject)
         .issuer_name(issuer[1].subject if issuer else subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return key, b.sign(issuer[0] if issuer else key, hashes.SHA256())


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    """A client certificate from another CA."""
    rogue_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = _cert("unisched test CA", None, ca=True)
    ca_cert, _ = _write_pem(d / "ca", *ca)
    server_cert, server_key = _write_pem(d / "server", *_cert("unisched daemon", ca, server=True))
    client_cert, client_key = _write_pem(d / "client", *_cert("monitoring", ca))
    other_ca = _cert("someone else's CA", None, ca=True)
    rogue_cert, rogue_key = _write_pem(d / "rogue", *_cert("monitoring", other_ca))
    return Pki(ca_cert, server_cert, server_key, client_cert, client_key, rogue_cert, rogue_key)


@pytest.fixture
def tls_server(tmp_path: Path, pki: Pki) -> Iterator[InProcessServer]:
    listen = f"127.0.0.1:{free_port()}"
    with in_process_server(tmp_path / "state", listen=listen, tls_cert=str(pki.server_cert),
                           tls_key=str(pki.server_key), tls_client_ca=str(pki.ca)) as srv:
        with DaemonClient(srv.socket) as c:
            c.register(pb.RegisterRequest(tenant="web", weight=250))
        yield srv


def test_a_client_with_a_certificate_lists_tenants_read_only(tls_server: InProcessServer, pki: Pki) -> None:
    assert tls_server.config.listen is not None
    with DaemonClient(target=tls_server.config.listen, tls=(pki.ca, pki.client_cert, pki.client_key)) as c:
        assert [(t.name, t.weight) for t in c.tenants()] == [("web", 250)]
        assert c.status().caller_pid == 0  # no identity over TCP
        for call in (lambda: c.register(pb.RegisterRequest(tenant="remote")), lambda: c.set_weight("web", 9000),
                     lambda: c.remove("web")):
            with pytest.raises(DaemonError) as e:
                call()
            assert e.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert [t.weight for t in tls_server.engine.snapshots()] == [250]


@pytest.mark.parametrize("how", ["no client certificate", "certificate from another CA", "plaintext"])
def test_clients_without_a_trusted_certificate_are_refused(tls_server: InProcessServer, pki: Pki, how: str) -> None:
    target = tls_server.config.listen
    assert target is not None
    ca = pki.ca.read_bytes()
    if how == "no client certificate":
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca))
    elif how == "certificate from another CA":
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=pki.rogue_key.read_bytes(), certificate_chain=pki.rogue_cert.read_bytes()))
    else:
        channel = grpc.insecure_channel(target)
    stub = pb_grpc.UnischedStub(channel)  # type: ignore[no-untyped-call]
    with channel, pytest.raises(grpc.RpcError) as e:
        stub.ListTenants(pb.ListTenantsRequest(), timeout=5)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def test_the_client_names_a_refused_handshake(tls_server: InProcessServer, pki: Pki) -> None:
    assert tls_server.config.listen is not None
    with DaemonClient(target=tls_server.config.listen, timeout=5, tls=(pki.ca, pki.rogue_cert, pki.rogue_key)) as c, \
            pytest.raises(DaemonError) as e:
        c.tenants()
    assert e.value.code is grpc.StatusCode.UNAVAILABLE
    assert f"cannot reach the unisched daemon at {tls_server.config.listen}" in str(e.value)
    with pytest.raises(DaemonError, match="cannot read TLS file"):
        DaemonClient(target=tls_server.config.listen, tls=(pki.ca, pki.client_cert, "/no/such.key"))


def test_cli_reaches_the_listener_with_its_tls_flags(tls_server: InProcessServer, pki: Pki) -> None:
    assert tls_server.config.listen is not None
    tls = ("--target", tls_server.config.listen, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert),
           "--tls-key", str(pki.client_key))
    out = cli("tenants", "--json", *tls)
    assert out.returncode == 0, out.stderr
    assert [t["name"] for t in json.loads(out.stdout)] == ["web"]
    out = cli("status", *tls)
    assert out.returncode == 0 and "1 tenants" in out.stdout, out.stderr
    out = cli("top", "--once", *tls)
    assert out.returncode == 0 and "web" in out.stdout, out.stderr
    out = cli("tenants", "--target", tls_server.config.listen, "--tls-ca", str(pki.ca))
    assert out.returncode == 2 and "--target needs --tls-cert, --tls-key" in out.stderr
    out = cli("tenants", "--tls-ca", str(pki.ca))
    assert out.returncode == 2 and "--tls-ca applies only with --target" in out.stderr and "usage: unisched tenants" in out.stderr
    out = cli("tenants", "--target", tls_server.config.listen, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.rogue_cert),
              "--tls-key", str(pki.rogue_key))
    assert out.returncode == 1 and "cannot reach the unisched daemon" in out.stderr


def test_serve_listen_without_certificates_exits_2_naming_the_keys(tmp_path: Path, pki: Pki) -> None:
    base = ("serve", "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state"), "--no-nvml",
            "--listen", "127.0.0.1:1")
    out = cli(*base)
    assert out.returncode == 2, out.stderr
    assert "requires TLS with client certificates; missing tls_cert, tls_key, tls_client_ca" in out.stderr
    out = cli(*base, "--tls-cert", str(pki.server_cert))
    assert out.returncode == 2 and "missing tls_key, tls_client_ca (flags --tls-key, --tls-client-ca)" in out.stderr
    out = cli(*base, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
              "--tls-client-ca", str(tmp_path / "nope.pem"))
    assert out.returncode == 2 and "'tls_client_ca': cannot read" in out.stderr
    cfg = tmp_path / "listen.toml"
    cfg.write_text('[daemon]\nlisten = "127.0.0.1:1"\ntls_key = "/x.key"\n')
    out = cli("serve", "--config", str(cfg), "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "st"))
    assert out.returncode == 2 and "missing tls_cert, tls_client_ca" in out.stderr
    assert not (tmp_path / "s.sock").exists()  # refused before serving anything


def test_config_keys_and_the_in_process_refusal(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ConfigError, match="missing tls_cert, tls_key, tls_client_ca"):
        check_listener(DaemonConfig(listen="127.0.0.1:9"))
    check_listener(DaemonConfig())  # no listener: nothing needed
    check_listener(DaemonConfig(listen="127.0.0.1:9", tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                tls_client_ca=str(pki.ca)))
    with pytest.raises(ConfigError, match="'tls_cert': must be a non-empty string"):
        DaemonConfig().with_overrides(tls_cert="")
    # serve_async refuses too (a caller that skipped the CLI), before it touches anything
    with pytest.raises(ConfigError, match="missing tls_cert"), \
            in_process_server(tmp_path / "state", listen=f"127.0.0.1:{free_port()}"):
        pass


def test_a_tls_call_never_has_a_unix_callers_identity(tls_server: InProcessServer, pki: Pki) -> None:
    """Identity is bound to the connection it was read on: a TLS call made while a Unix connection of root's is
    open has none, and may not act (a lookup by peer address could be repeated by a TCP client)."""
    assert tls_server.config.listen is not None
    with DaemonClient(tls_server.socket) as unix, \
            DaemonClient(target=tls_server.config.listen, tls=(pki.ca, pki.client_cert, pki.client_key)) as remote:
        assert unix.status().caller_pid == os.getpid()
        seen = remote.status()
        assert (seen.caller_pid, seen.caller_uid, seen.caller_is_admin) == (0, 0, False)
        with pytest.raises(DaemonError) as e:
            remote.set_weight("web", 9000)
        assert e.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert unix.status().caller_pid == os.getpid()


def test_serve_cli_with_certificates_serves_tls(daemon_factory, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    """The real daemon from the command line (root, real cgroups): TLS listener up, plaintext refused."""
    listen = f"127.0.0.1:{free_port()}"
    d = daemon_factory("--listen", listen, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                       "--tls-client-ca", str(pki.ca))
    out = cli("status", "--json", "--target", listen, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert),
              "--tls-key", str(pki.client_key))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["caller"]["pid"] == 0
    with DaemonClient(target=listen, timeout=5) as plain, pytest.raises(DaemonError):
        plain.status()
    assert d.proc.poll() is None
