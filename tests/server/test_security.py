"""Who may call what: TLS on every gRPC hop, API keys from a file, and the admin token of Terminate, on
fakes behind a real load balancer and on a real deployment (1 replica, CPU, demo model)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import mii_server
from mii_server.errors import Forbidden, ReplicaUnavailable, Unauthorized
from mii_server.serving.control import registry
from mii_server.serving.frontends.client import Client
from mii_server.serving.frontends.loop_thread import LoopThread
from mii_server.serving.security import ApiKeys, GrpcSecurity

from .fakes import ADMIN_TOKEN, start_balancer, start_fake
from .helpers import free_port_block

KEY = "file-key-0123456789"


def self_signed(directory: Path, stem: str = "server") -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost, and its key: (cert_file, key_file), PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mii-server test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_file.chmod(0o600)
    return str(cert_file), str(key_file)


def test_tls_on_every_hop_of_fakes_behind_a_balancer(bg: LoopThread, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    security = GrpcSecurity(ApiKeys([]), ADMIN_TOKEN, cert, key, cert)
    base = free_port_block(2)
    _, replica = bg.run(start_fake("r0", base + 1, security=security))
    balancer, server = bg.run(start_balancer([f"127.0.0.1:{base + 1}"], base, security=security))
    address = f"127.0.0.1:{base}"
    try:
        with Client(address, tls_ca_file=cert, admin_token=ADMIN_TOKEN) as trusted:
            assert [r.generated_text for r in trusted.generate(["hi"])] == ["hi@r0"]  # balancer -> replica is TLS too
            assert "".join(c.generated_text for c in trusted.generate_stream(["hi"])) == "hi@r0"
        with Client(address, timeout=5) as plaintext, pytest.raises(ReplicaUnavailable):
            plaintext.generate(["hi"])  # a TLS port does not speak plaintext
        stranger_cert, _ = self_signed(tmp_path, "stranger")
        with Client(address, timeout=5, tls_ca_file=stranger_cert) as untrusting, pytest.raises(ReplicaUnavailable):
            untrusting.generate(["hi"])  # a certificate that CA did not sign is refused
    finally:
        bg.run(server.stop(0))
        bg.run(replica.stop(0))
        bg.run(balancer.close())


def test_tls_needs_both_certificate_and_key() -> None:
    with pytest.raises(ValueError, match="both tls_cert_file and tls_key_file"):
        GrpcSecurity.load(tls_cert_file="/some/cert.pem")


# ---- a real deployment: TLS, a key file, the admin token -----------------------------------------


@pytest.fixture(scope="module")
def secured(registry_env: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, int, str]]:
    directory = tmp_path_factory.mktemp("secrets")
    cert, key = self_signed(directory)
    key_file = directory / "api-keys"
    key_file.write_text(f"# the deployment's keys\n{KEY}\n")
    key_file.chmod(0o600)
    base, http = free_port_block(3), free_port_block(1)
    old = os.environ.pop("MII_SERVER_API_KEY", None)  # only the file holds the key here
    try:
        client = mii_server.serve(
            deployment_name="secured", port_number=base, enable_openai_api=True, openai_api_port=http,
            api_key_file=str(key_file), tls_cert_file=cert, tls_key_file=key,
        )  # fmt: skip
    finally:
        if old is not None:
            os.environ["MII_SERVER_API_KEY"] = old
    yield client, http, cert
    client.terminate_server()


@pytest.mark.integration
def test_a_deployment_with_tls_and_a_key_file(secured: tuple[Client, int, str]) -> None:
    client, http, cert = secured
    assert len(client.generate(["To read a file,"], max_new_tokens=4)[0].generated_text) > 0  # serve() holds both
    # the OpenAI server reaches the balancer over TLS with the file's key; streaming too
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key=KEY, max_retries=0)
    stream = api.completions.create(model="mii-server-demo", prompt="To read a file,", max_tokens=4, stream=True)
    assert sum(len(c.choices[0].text) for c in stream) > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="guess", max_retries=0).models.list()
    with Client(client.address, tls_ca_file=cert, api_key="", timeout=10) as anonymous, pytest.raises(Unauthorized):
        anonymous.generate(["hi"])
    with Client(client.address, tls_ca_file=cert, api_key=KEY, timeout=10) as keyed:
        assert keyed.stats()[0].total_blocks > 0
        with pytest.raises(Forbidden):
            keyed.terminate_server(wait=False)  # a key holder who is not the owner cannot stop it
    with Client(client.address, timeout=5) as plaintext, pytest.raises(ReplicaUnavailable):
        plaintext.stats()


@pytest.mark.integration
def test_the_owner_only_record_holds_the_admin_token(secured: tuple[Client, int, str], registry_env: str) -> None:
    _, _, cert = secured
    path = registry.record_path("secured")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    record = json.loads(path.read_text())
    assert len(record["admin_token"]) >= 32 and record["tls_ca_file"] == cert
    again = mii_server.client("secured", api_key=KEY)  # what `mii-server stop` uses: token from the record
    assert again._admin_token == record["admin_token"]
    assert again.stats()[0].total_blocks > 0  # and it trusts the deployment's certificate
    again.close()
