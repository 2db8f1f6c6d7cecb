"""`pcpstack certs` refuses a flag value that would break the CA or make a certificate no peer can use, naming
the flag, before it writes anything; valid values still make certificates."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cryptography import x509

from pcpstack.cli.certs import write_certs
from pcpstack.cli.launch import cli_command
from pcpstack.common.config import ConfigError


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"days": 3_000_000}, "--days=3000000: must be in 1..36500"),
        ({"days": 0}, "--days=0: must be in 1..36500"),
        ({"names": ["ca"]}, "--name='ca': would overwrite the CA's"),
        ({"names": ["ca-key"]}, "--name='ca-key': would overwrite the CA's"),
        (
            {"names": ["decode", "decode-key"]},
            "--name='decode-key': would overwrite the key of --name='decode'",
        ),
        ({"names": ["my service"]}, "--name='my service': must be a host name"),
        ({"names": [".hidden"]}, "--name='.hidden': must be a host name"),
        ({"names": ["../up"]}, "--name='../up': must be a host name"),
        ({"dns": [""]}, "--dns='': must be a host name"),
        ({"dns": ["a b"]}, "--dns='a b': must be a host name"),
        ({"dns": ["-a.example"]}, "--dns='-a.example': must be a host name"),
        ({"dns": ["*."]}, "--dns='*.': must be a host name"),
        ({"ips": ["foo"]}, "--ip='foo': must be an IPv4 or IPv6 address"),
    ],
)
def test_certs_refuses_a_bad_value_naming_its_flag_before_writing(tmp_path, kwargs, named) -> None:
    with pytest.raises(ConfigError) as refused:
        write_certs(tmp_path / "certs", **kwargs)
    assert str(refused.value).startswith(named), refused.value
    assert not (tmp_path / "certs").exists()


def test_certs_refuses_a_name_that_would_replace_the_ca_of_an_existing_folder(tmp_path) -> None:
    write_certs(tmp_path, names=["registry"])
    ca_pem = (tmp_path / "ca.pem").read_bytes()
    with pytest.raises(ConfigError, match="--name='ca'"):
        write_certs(tmp_path, names=["ca"])
    assert (tmp_path / "ca.pem").read_bytes() == ca_pem
    constraints = x509.load_pem_x509_certificate(ca_pem).extensions.get_extension_for_class(
        x509.BasicConstraints
    )
    assert constraints.value.ca


def test_certs_refuses_an_out_that_is_a_file(tmp_path) -> None:
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ConfigError, match=r"^--out='.*/file': must be a folder"):
        write_certs(file)
    with pytest.raises(ConfigError, match=r"^--out='.*/file/certs': must be a folder"):
        write_certs(file / "certs")


def test_certs_accepts_a_wildcard_dns_name_and_an_ipv6_address(tmp_path) -> None:
    written = write_certs(
        tmp_path, names=["gateway"], dns=["*.pcp.example", "localhost"], ips=["::1"], days=36_500
    )
    cert = x509.load_pem_x509_certificate((tmp_path / "gateway.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "*.pcp.example" in names.get_values_for_type(x509.DNSName)
    assert Path(tmp_path / "gateway-key.pem") in written


def test_certs_cli_refuses_a_bad_flag_in_one_line(child_env, tmp_path) -> None:
    run = subprocess.run(
        cli_command("certs", "--out", str(tmp_path), "--ip", "foo"),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr == "pcpstack certs: --ip='foo': must be an IPv4 or IPv6 address\n", run.stderr
    assert not list(tmp_path.iterdir())
