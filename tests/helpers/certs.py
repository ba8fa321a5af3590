"""A throwaway certificate authority for TLS tests, made with the ``openssl`` command.

``make_certs(folder)`` writes a CA, a server certificate for ``127.0.0.1`` / ``localhost``,
a server certificate for another host name, and a client certificate, all signed by the CA
(P-256 keys: quick to make). Tests skip when ``openssl`` is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

EC_KEY = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    other_host_cert: Path
    other_host_key: Path
    client_cert: Path
    client_key: Path


def _openssl(command: str, *args: str, cwd: Path) -> None:
    argv = ["openssl", *command.split(), *args]
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(folder: Path, name: str, subject: str, san: str | None, usage: str) -> None:
    _openssl(f"req {EC_KEY} -keyout {name}.key -out {name}.csr -subj", subject, cwd=folder)
    ext = folder / f"{name}.ext"
    ext.write_text((f"subjectAltName={san}\n" if san else "") + f"extendedKeyUsage={usage}\n")
    sign = "x509 -req -CA ca.pem -CAkey ca.key -CAcreateserial -days 2"
    _openssl(f"{sign} -in {name}.csr -out {name}.pem -extfile {ext.name}", cwd=folder)


def make_certs(folder: Path) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)
    ca = f"req -x509 {EC_KEY} -keyout ca.key -out ca.pem -days 2 -subj"
    _openssl(ca, "/CN=streamrft-test-ca", cwd=folder)
    _signed(folder, "server", "/CN=localhost", "IP:127.0.0.1,DNS:localhost", "serverAuth")
    _signed(folder, "other", "/CN=elsewhere.example", "DNS:elsewhere.example", "serverAuth")
    _signed(folder, "client", "/CN=streamrft-client", None, "clientAuth")
    return Certs(
        ca=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        other_host_cert=folder / "other.pem",
        other_host_key=folder / "other.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
    )
