"""Throwaway mutual-TLS material for tests, generated with the ``cryptography`` package.

:func:`make_tls` writes a CA and one certificate signed by it, usable as server and
client (SANs 127.0.0.1, 127.0.0.2, 127.0.0.3 and localhost: every loopback "machine"
the tests start), and :func:`make_foreign_tls` a second, unrelated CA with its own
certificate: a peer that the cluster must refuse.
"""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from podium.auth import TlsConfig

LOOPBACK_NAMES = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "localhost")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: pathlib.Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def make_tls(directory: str | pathlib.Path, prefix: str = "") -> TlsConfig:
    """Write ``{prefix}ca.pem``, ``{prefix}node.pem`` and ``{prefix}node.key`` under
    ``directory``; return the TlsConfig naming them."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"podium-test-ca{prefix}")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) if n == "localhost" else x509.IPAddress(ipaddress.ip_address(n))
            for n in LOOPBACK_NAMES]
    cert = (x509.CertificateBuilder().subject_name(_name("podium-test-node")).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))

    paths = out / f"{prefix}ca.pem", out / f"{prefix}node.pem", out / f"{prefix}node.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(paths[2], key)
    return TlsConfig(cert=str(paths[1]), key=str(paths[2]), ca=str(paths[0]))


def make_foreign_tls(directory: str | pathlib.Path) -> TlsConfig:
    """Material from another, unrelated CA (same SANs): the cluster must not trust it."""
    return make_tls(directory, prefix="foreign-")
