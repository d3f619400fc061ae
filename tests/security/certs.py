"""A throwaway certificate authority plus server and client certificates, made with ``cryptography``.

Every certificate names ``IP:127.0.0.1`` and ``DNS:localhost`` so that one pair serves the coordinator
and the peer endpoints alike (a rank is both a TLS client and a TLS server).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from collsvc.options import TlsFiles


@dataclass(frozen=True)
class Certs:
    directory: Path
    server: TlsFiles  # for the coordinator
    client: TlsFiles  # for ranks (client of the coordinator, client and server of peers)
    rogue: TlsFiles  # signed by a different CA: must be refused


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _ca(directory: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(key, hashes.SHA256())
    )
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _leaf(
    directory: Path, name: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], ca_name: str
) -> TlsFiles:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(directory / f"{name}.key", key)
    return TlsFiles(
        cert=str(directory / f"{name}.pem"), key=str(directory / f"{name}.key"), ca=str(directory / f"{ca_name}.pem")
    )


def make_certs(directory: Path) -> Certs:
    """Writes a CA, a server and a client certificate signed by it, and a rogue one signed by another CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    other = _ca(directory, "other-ca")
    return Certs(
        directory=directory,
        server=_leaf(directory, "server", ca, "ca"),
        client=_leaf(directory, "client", ca, "ca"),
        rogue=_leaf(directory, "rogue", other, "ca"),
    )


def tls_env(files: TlsFiles) -> dict[str, str]:
    """The ``COLLSVC_TLS_*`` variables a rank reads (``collsvc.config.tls_from_env``)."""
    return {"COLLSVC_TLS_CERT": files.cert, "COLLSVC_TLS_KEY": files.key, "COLLSVC_TLS_CA": files.ca}
