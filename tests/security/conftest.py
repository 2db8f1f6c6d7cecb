"""Fixtures for the security tests: development certificates from `pcpstack certs`, and loaded settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcpstack.cli.certs import write_certs
from pcpstack.common import security

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    """A CA with certificates for a server and a client covering the default names (localhost, 127.0.0.1):
    only those, so that a stack tested with them is one the default certificates serve."""
    out = tmp_path_factory.mktemp("certs")
    write_certs(out, names=["server", "client"])
    return out


@pytest.fixture(scope="session")
def other_ca_certs(tmp_path_factory) -> Path:
    """Certificates from an unrelated CA."""
    out = tmp_path_factory.mktemp("other-certs")
    write_certs(out, names=["client"])
    return out


def tls(folder: Path, name: str, token: str = "") -> security.Security:
    """Loaded security for one certificate of folder (and a token, when given)."""
    return security.load(
        security.SecuritySettings(
            ca_file=str(folder / "ca.pem"),
            cert_file=str(folder / f"{name}.pem"),
            key_file=str(folder / f"{name}-key.pem"),
            token=token,
        )
    )


def token_only(token: str) -> security.Security:
    """Plaintext with a bearer token."""
    return security.load(security.SecuritySettings(token=token))
