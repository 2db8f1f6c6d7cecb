"""`pcpstack certs`: make a development CA and one certificate per service, for mutual TLS.

Writes ca.pem and ca-key.pem (reused when the folder already has them, so more services can be added
later) and <name>.pem / <name>-key.pem for each --name. Every service certificate is valid for both server
and client authentication and covers the --dns names, the --ip addresses and the service's own name. Keys
are written readable by their owner only. This is for development and tests: production should use the
organisation's CA. The defaults (localhost, 127.0.0.1) cover a local stack, whose services all listen on
127.0.0.1:

    pcpstack certs
    export PCPSTACK_TLS_CA=certs/ca.pem PCPSTACK_TLS_CERT=certs/registry.pem \\
           PCPSTACK_TLS_KEY=certs/registry-key.pem PCPSTACK_TOKEN=$(openssl rand -hex 32)
    pcpstack up --pcp 2
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pcpstack.common import security
from pcpstack.common.config import ConfigError

DEFAULT_NAMES = ("registry", "kvstore", "prefill", "decode", "gateway")
DEFAULT_DNS = ("localhost",)
DEFAULT_IPS = ("127.0.0.1",)
# The one address every service of a local stack (`pcpstack up`) binds and advertises.
LOCAL_STACK_HOST = "127.0.0.1"
# Longest --days, a century: far more would push the expiry date past the last one Python can hold.
MAX_DAYS = 36_500
# The CA's own files in --out (ca.pem, ca-key.pem): a service named after them would overwrite the CA.
CA_NAMES = ("ca", "ca-key")
# A DNS name: labels of letters, digits and inner hyphens, 1..63 characters each, joined by dots.
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DNS_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")
DNS_NAME_MAX_CHARS = 253


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack certs`."""
    parser.add_argument("--out", default="certs", help="folder to write into (default ./certs)")
    parser.add_argument(
        "--name",
        action="append",
        default=None,
        help="a service to make a certificate for, a host name other than ca; repeat "
        f"(default: {', '.join(DEFAULT_NAMES)})",
    )
    parser.add_argument(
        "--dns",
        action="append",
        default=None,
        help=f"DNS name every certificate covers (default: {DEFAULT_DNS[0]})",
    )
    parser.add_argument(
        "--ip", action="append", default=None, help=f"IP every certificate covers (default: {DEFAULT_IPS[0]})"
    )
    parser.add_argument(
        "--days", type=int, default=365, help=f"validity in days, at most {MAX_DAYS} (default 365)"
    )


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    if private:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)
    else:
        path.write_bytes(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pcpstack development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_ca(days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA certificate and its key."""
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("pcpstack development CA"))
        .issuer_name(_name("pcpstack development CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_service_cert(
    name: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    dns: Sequence[str],
    ips: Sequence[str],
    days: int,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for one service, signed by the CA, for server and client authentication."""
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in dict.fromkeys([name, *dns])]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(ips)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def certificate_covers(cert_pem: bytes, host: str) -> bool:
    """Whether the (first) certificate in cert_pem names host, an IP or a DNS name, among its subject
    alternative names: what a TLS peer that dials host checks."""
    cert = x509.load_pem_x509_certificates(cert_pem)[0]
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower() in (name.lower() for name in names.get_values_for_type(x509.DNSName))
    return ip in names.get_values_for_type(x509.IPAddress)


def local_stack_certificate_problem(env: Mapping[str, str]) -> str | None:
    """Why the TLS certificate env names cannot serve a local stack, or None. Every service of a local stack
    listens on LOCAL_STACK_HOST and its peers verify that address against the certificate; settings that
    do not load are left to the services, which exit naming the broken rule."""
    try:
        tls = security.from_env(env).tls
    except security.SecurityConfigError:
        return None
    if tls is None or certificate_covers(tls.cert, LOCAL_STACK_HOST):
        return None
    return (
        f"{security.CERT_ENV}={env.get(security.CERT_ENV)!r} does not name {LOCAL_STACK_HOST}, the address "
        "every service of a local stack listens on, so its peers would refuse every connection; make "
        f"certificates with `pcpstack certs` (its defaults name it) or add `--ip {LOCAL_STACK_HOST}`"
    )


def _load_or_make_ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_path, key_path = out / "ca.pem", out / "ca-key.pem"
    if ca_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path} must hold an EC private key")
        return x509.load_pem_x509_certificate(ca_path.read_bytes()), key
    cert, key = make_ca(days)
    _write(ca_path, cert.public_bytes(serialization.Encoding.PEM))
    _write(key_path, _key_pem(key), private=True)
    return cert, key


def is_dns_name(name: str) -> bool:
    """Whether name is a host name a certificate can cover: letters, digits, hyphens and dots."""
    return len(name) <= DNS_NAME_MAX_CHARS and _DNS_NAME.fullmatch(name) is not None


def check_certs_arguments(names: Sequence[str], dns: Sequence[str], ips: Sequence[str], days: int) -> None:
    """Raises ConfigError naming the flag (--name, --dns, --ip, --days), its value and the rule."""
    if not 0 < days <= MAX_DAYS:
        raise ConfigError.broken("--days", days, f"must be in 1..{MAX_DAYS}")
    for name in names:
        # A service's name is its files' name and a DNS name its certificate covers.
        if not is_dns_name(name):
            raise ConfigError.broken("--name", name, "must be a host name: letters, digits, '-' and '.'")
        if name.lower() in CA_NAMES:  # lower: a folder may not tell CA.pem from ca.pem
            raise ConfigError.broken("--name", name, "would overwrite the CA's ca.pem or ca-key.pem")
        if name.endswith("-key") and name.removesuffix("-key") in names:
            rule = f"would overwrite the key of --name={name.removesuffix('-key')!r}"
            raise ConfigError.broken("--name", name, rule)
    for name in dns:
        if not is_dns_name(name.removeprefix("*.")):
            rule = "must be a host name: letters, digits, '-' and '.', optionally after '*.'"
            raise ConfigError.broken("--dns", name, rule)
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ConfigError.broken("--ip", ip, "must be an IPv4 or IPv6 address") from None


def _make_out(out: Path) -> None:
    """Makes the --out folder (and its parents) unless it is there; ConfigError naming --out when it
    cannot be made or written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError.broken(
            "--out", str(out), f"must be a folder, or where one can be made ({reason})"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError.broken("--out", str(out), "must be a folder this process can write")


def write_certs(
    out: Path,
    names: Sequence[str] = DEFAULT_NAMES,
    dns: Sequence[str] = DEFAULT_DNS,
    ips: Sequence[str] = DEFAULT_IPS,
    days: int = 365,
) -> list[Path]:
    """Writes the CA (unless out has one) and each service's certificate and key; returns the paths.
    Raises ConfigError naming the flag of the first value that breaks a rule, before writing anything."""
    check_certs_arguments(names, dns, ips, days)
    _make_out(out)
    ca_cert, ca_key = _load_or_make_ca(out, days)
    written = [out / "ca.pem"]
    for name in names:
        cert, key = make_service_cert(name, ca_cert, ca_key, dns, ips, days)
        _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        _write(out / f"{name}-key.pem", _key_pem(key), private=True)
        written += [out / f"{name}.pem", out / f"{name}-key.pem"]
    return written


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack certs`."""
    try:
        written = write_certs(
            Path(args.out),
            names=args.name or DEFAULT_NAMES,
            dns=args.dns or DEFAULT_DNS,
            ips=args.ip or DEFAULT_IPS,
            days=args.days,
        )
    except (ValueError, OSError) as exc:
        print(f"pcpstack certs: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
