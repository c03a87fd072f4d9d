"""``splitserve certs DIR``: a cluster CA and one certificate per identity, for TLS and mTLS.

Every hop inside the cluster is mutual TLS under one CA: a worker accepts calls only from a
certificate the CA signed for the router or the controller identity (``services.common.tls``).
The router's certificate also serves its client port, so it names the hosts clients dial
(``--hosts``). Each certificate also carries its identity's service name
(``<identity>.splitserve.internal``): cluster members verify each other by identity, not by the
pod address they happen to dial.

Files (keys readable by the owner only), one directory per identity in the layout of a
cert-manager Secret, which a service's ``--tls-dir`` takes::

    ca.crt  ca.key                        the cluster CA (keep ca.key out of the cluster)
    <identity>/tls.crt  tls.key  ca.crt   router, prefill, decode, controller, client

For development and tests; production clusters take the same files from cert-manager or their
own PKI (README, "Security").
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.roles import Role
from services.common.tls import CA_FILE, CERT_FILE, KEY_FILE, service_name

_DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def configure(parser: argparse.ArgumentParser) -> None:
    """Declare ``certs``' flags on its sub-parser."""
    parser.add_argument("out_dir", type=Path, help="directory to write the files to")
    parser.add_argument(
        "--hosts",
        default="",
        help="comma-separated extra DNS names and IPs clients dial the router by "
        f"(always: {', '.join(_DEFAULT_HOSTS)})",
    )
    parser.add_argument("--days", type=int, default=365, help="validity of every certificate")
    parser.add_argument(
        "--force", action="store_true", help="overwrite the files of an existing directory"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.out_dir / CA_FILE).exists() and not args.force:
        print(
            f"splitserve certs: {args.out_dir / CA_FILE} exists (--force to replace it)",
            file=sys.stderr,
        )
        return 2
    hosts = [*_DEFAULT_HOSTS, *(h.strip() for h in args.hosts.split(",") if h.strip())]
    for path in write_cluster_certs(args.out_dir, hosts, args.days):
        print(f"wrote {path}")
    return 0


def write_cluster_certs(out_dir: Path, hosts: Sequence[str], days: int = 365) -> list[Path]:
    """Write a new CA and a certificate per ``Role`` (each party of the cluster) under
    ``out_dir``; return the paths. Every certificate names its role's service name and
    ``hosts``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    not_after = now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitserve cluster CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after)
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
        )
        .sign(ca_key, hashes.SHA256())
    )
    written = [
        _write(out_dir / CA_FILE, ca_cert.public_bytes(serialization.Encoding.PEM)),
        _write_key(out_dir / "ca.key", ca_key),
    ]
    for identity in Role:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.value)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_subject_alt_names(service_name(identity), hosts), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        identity_dir = out_dir / identity.value
        identity_dir.mkdir(exist_ok=True)
        written += [
            _write(identity_dir / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM)),
            _write_key(identity_dir / KEY_FILE, key),
            _write(identity_dir / CA_FILE, ca_cert.public_bytes(serialization.Encoding.PEM)),
        ]
    return written


def _subject_alt_names(name: str, hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = [x509.DNSName(name)]
    for host in dict.fromkeys(hosts):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)
    return path
