"""Throwaway TLS material for the trunk's gRPC transport: loopback runs, tests and benchmarks only.

Everything here is made fresh in memory on each call, with unencrypted private keys and a one-day validity,
and the CA's key is thrown away. Never use it for a real deployment: there, certificates come from the
operator's own CA and keys stay in files only the server (or client) can read.
"""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["throwaway_certificates"]

_CA_NAME = "fedlm throwaway CA"


def throwaway_certificates(hostname: str = "localhost") -> dict[str, bytes]:
    """A throwaway CA, a server certificate for ``hostname`` (subject alternative name, DNS) and a client
    certificate, all signed by the CA, as PEM bytes under ``ca``, ``server_cert``, ``server_key``,
    ``client_cert`` and ``client_key``. For loopback runs, tests and benchmarks; never for a real deployment.
    """
    ca_key, server_key, client_key = _key(), _key(), _key()
    return {
        "ca": _cert(_CA_NAME, ca_key, ca_key, ca=True),
        "server_cert": _cert(hostname, server_key, ca_key, dns=hostname),
        "server_key": _pem(server_key),
        "client_cert": _cert("fedlm throwaway client", client_key, ca_key),
        "client_key": _pem(client_key),
    }


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    dns: str | None = None,
) -> bytes:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _CA_NAME)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
