"""A development CA and its certificates (`specdec certs`, `specdec up --secure`).

write_certs writes ca.crt, server.crt / server.key (valid for localhost, 127.0.0.1, ::1
and the hosts given; draft, target and the coordinator's public port present it) and
client.crt / client.key (the coordinator presents it to draft and target under mutual
TLS). Key files are mode 0600. The CA's own key is not kept: to add a host, write them
again. For production use certificates from your own CA (docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

VALID_DAYS = 365
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
FILES = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")


def write_key_file(path: Path, data: bytes) -> None:
    """Write data readable by its owner only (mode 0600 from creation, then enforced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def write_certs(out: Path, hosts: list[str] | None = None) -> dict[str, Path]:
    """Generate the CA, server and client certificates into out; return their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specdec development"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def builder(subject: x509.Name, issuer: x509.Name,
                key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("specdec development CA")
    ca = (builder(ca_name, ca_name, ca_key)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))

    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*DEFAULT_HOSTS, *(h.strip() for h in hosts or ()
                                                 if h.strip())]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))

    def leaf(common: str, usage: x509.ObjectIdentifier,
             san: list[x509.GeneralName]) -> tuple[x509.Certificate, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert_builder = (builder(name(common), ca_name, key)
                        .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                       critical=True)
                        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                            ca_key.public_key()), critical=False))
        if san:
            cert_builder = cert_builder.add_extension(x509.SubjectAlternativeName(san),
                                                      critical=False)
        pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        return cert_builder.sign(ca_key, hashes.SHA256()), pem

    server, server_key = leaf("specdec server", ExtendedKeyUsageOID.SERVER_AUTH, names)
    client, client_key = leaf("specdec coordinator", ExtendedKeyUsageOID.CLIENT_AUTH,
                              [x509.DNSName("specdec-coordinator")])
    paths = {file: out / file for file in FILES}
    for file, cert in (("ca.crt", ca), ("server.crt", server), ("client.crt", client)):
        paths[file].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key_file(paths["server.key"], server_key)
    write_key_file(paths["client.key"], client_key)
    return paths
