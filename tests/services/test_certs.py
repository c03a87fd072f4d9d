"""``splitserve certs``: a CA and one certificate per identity, checked with ``cryptography``."""

from __future__ import annotations

import ipaddress
import stat
import subprocess
import sys

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.roles import Role
from services.common.tls import TlsMaterial, service_name


def test_certs_writes_a_ca_and_one_verifiable_certificate_per_identity(tmp_path):
    out = tmp_path / "certs"
    run = [
        sys.executable,
        "-m",
        "services.cli",
        "certs",
        str(out),
        "--hosts",
        "router.example,10.1.2.3",
    ]
    first = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for identity in Role:
        material = TlsMaterial.from_dir(out / identity.value)
        assert material.ca_pem == (out / "ca.crt").read_bytes()
        cert = x509.load_pem_x509_certificate(material.cert_pem)
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(names.get_values_for_type(x509.DNSName)) >= {
            service_name(identity),
            "localhost",
            "router.example",
        }
        assert ipaddress.ip_address("10.1.2.3") in names.get_values_for_type(x509.IPAddress)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        key_path = out / identity.value / "tls.key"
        assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
        assert isinstance(
            x509.load_pem_x509_certificate(material.cert_pem).public_key(),
            ec.EllipticCurvePublicKey,
        )
    again = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--force" in again.stderr
    assert (out / "ca.crt").read_bytes() == TlsMaterial.from_dir(out / "router").ca_pem
