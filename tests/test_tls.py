"""HTTPS on the gateway's port (``gateway.tls``): the files checked with the config at their line, clients served
over TLS by every gateway process (plain HTTP refused), the daemon's own batch runner through it, and a
certificate renewed in place served after a reload (a broken one refused, the old one served on)."""

from __future__ import annotations

import io
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from conftest import ROOT, fleet_config, sim_model, wait_for
from orchestrator.fleetfile import load_config
from orchestrator.yamlsrc import ConfigError


def make_cert(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed EC certificate and its key (openssl), CN ``name``."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def trusting(cert: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(cert))
    ctx.check_hostname = False   # (dialled by address)
    return ctx


def served_cert(port: int) -> bytes:
    """The certificate a new TLS connection to the gateway gets (DER)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s, ctx.wrap_socket(s) as t:
        return t.getpeercert(binary_form=True)


def der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def test_tls_files_are_read_with_the_config_and_told_at_their_line(tmp_path):
    cert, key = make_cert(tmp_path / "tls", "gw.test")
    other_cert, _ = make_cert(tmp_path / "other", "other.test")
    base = "fleet: f\nstate_dir: /tmp/x\ngateway:\n  tls:\n    cert_file: {c}\n    key_file: {k}\nmodels: []\n"
    f = tmp_path / "f.yaml"
    f.write_text(base.format(c="tls/cert.pem", k="tls/key.pem"))   # relative to the config file
    assert load_config(f).gateway.tls._paths == (str(cert), str(key))
    for c, k, where, says in (("tls/none.pem", "tls/key.pem", 5, "cannot read"),
                              ("other/cert.pem", "tls/key.pem", 5, "do not load as a pair"),   # not its key
                              ("tls/cert.pem", "tls/cert.pem", 5, "do not load as a pair")):
        f.write_text(base.format(c=c, k=k))
        with pytest.raises(ConfigError) as e:
            load_config(f)
        assert str(e.value.problems[0]).startswith(f"{f}:{where}:") and says in str(e.value), str(e.value)
    f.write_text(base.replace("    key_file: {k}\n", "").format(c="tls/cert.pem"))
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "gateway.tls.key_file" in str(e.value)
    f.write_text("fleet: f\nstate_dir: /tmp/x\ndaemon:\n  admin_tls: true\nmodels: []\n")   # no certificate to serve
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value.problems[0]).startswith(f"{f}:4:") and "set gateway.tls" in str(e.value), str(e.value)


@pytest.mark.cluster
@pytest.mark.parametrize("workers", [1, 2])   # the daemon's own gateway, and worker processes
def test_clients_batches_and_a_renewed_certificate_over_tls(tmp_path, fleet_name, daemons, workers):
    cert, key = make_cert(tmp_path / "tls", "gw.test")
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", 1)],
                        gateway={"workers": workers, "tls": {"cert_file": "tls/cert.pem", "key_file": "tls/key.pem"}},
                        daemon={"admin_tls": workers == 2})   # (the admin API over HTTPS too, with two workers)
    d = daemons(path)
    port, admin = d.cfg["gateway"]["port"], d.cfg["daemon"]["admin_port"]
    wait_for(lambda: d.ready("m"), 60, "READY")
    base = f"https://127.0.0.1:{port}/v1"
    c = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30,
                      http_client=openai.DefaultHttpx2Client(verify=trusting(cert)))
    for _ in range(4):   # (new connections: both processes take some)
        r = c.completions.create(model="m", prompt="hello", max_tokens=3)
        assert r.usage.completion_tokens >= 1
    with pytest.raises(OSError):   # no plain HTTP on the port
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    # a batch: the daemon's runner sends its lines through the gateway, over TLS
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}) + "\n" for i in range(3))
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait_for(lambda: (x := c.batches.retrieve(b.id)).status in ("completed", "failed") and x, 90, "batch done")
    assert b.status == "completed" and b.request_counts.completed == 3, b
    # slurmfleet's own client of the gateway (the batch CLI) over HTTPS, trusting the configured certificate
    out = subprocess.run([sys.executable, "-m", "orchestrator", "batch", "--config", str(path), "status", b.id,
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SLURMFLEET_API_KEY": "x"})
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "completed", out.stdout + out.stderr
    if workers == 2:   # the admin API: HTTPS with the same certificate, and the CLI trusting it
        assert served_cert(admin) == der(cert)
        out = subprocess.run([sys.executable, "-m", "orchestrator", "status", "--config", str(path), "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "SLURMFLEET_ADMIN_KEY": "admin-secret"})
        assert out.returncode == 0 and json.loads(out.stdout)["models"][0]["model"] == "m", out.stdout + out.stderr
    # a broken certificate in place: the reload is refused at its line, the certificate served so far goes on
    good = cert.read_bytes()
    cert.write_text("not a certificate\n")
    code, res = d.request("POST", "/admin/reload")
    assert res["ok"] is False and "do not load as a pair" in res["errors"][0], res
    cert.write_bytes(good)
    assert served_cert(port) == der(cert)
    # renewed in place (a new pair at the same paths) and reloaded: every new connection gets the new one
    new_cert, new_key = make_cert(tmp_path / "new", "gw.test")
    cert.write_bytes(new_cert.read_bytes())
    key.write_bytes(new_key.read_bytes())
    code, res = d.request("POST", "/admin/reload")
    assert res["ok"] is True, res
    wait_for(lambda: all(served_cert(port) == der(new_cert) for _ in range(8)), 20, "the new certificate served")
    if workers == 2:
        assert served_cert(admin) == der(new_cert)
    c2 = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30,
                       http_client=openai.DefaultHttpx2Client(verify=trusting(new_cert)))
    assert c2.completions.create(model="m", prompt="hello", max_tokens=2).usage.completion_tokens >= 1
    # turning TLS off takes a restart
    doc = yaml.safe_load(path.read_text())
    doc["gateway"].pop("tls")
    doc["daemon"]["admin_tls"] = False
    path.write_text(yaml.safe_dump(doc))
    code, res = d.request("POST", "/admin/reload")
    assert res["ok"] is False and "gateway.tls" in res["errors"][0] and "restart the daemon" in res["errors"][0], res
    time.sleep(0.5)
    assert served_cert(port) == der(new_cert)


def ca_chain(folder: Path) -> dict[str, Path]:
    """root CA -> intermediate CA -> leaves ``gw`` and ``evil`` (openssl): their certificates and keys."""
    folder.mkdir(parents=True, exist_ok=True)
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, timeout=60, cwd=folder)  # noqa: E731
    ca_ext = folder / "ca.ext"
    ca_ext.write_text("basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n")
    leaf_ext = folder / "leaf.ext"
    leaf_ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "root.key", "-out", "root.pem", "-days", "2", "-subj", "/CN=root",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, issuer, ext in (("inter", "root", ca_ext), ("gw", "inter", leaf_ext), ("evil", "inter", leaf_ext)):
        run("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}.example.org")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{issuer}.pem", "-CAkey", f"{issuer}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", str(ext))
    return {n: folder / n for n in ("root", "inter", "gw", "evil")}


def test_the_clis_trust_is_the_gateways_own_certificate_not_the_ca_of_its_chain(tmp_path):
    """``cert_file`` is the certificate with its chain (a fullchain.pem): the CLI (admin commands with the admin
    key, ``slurmfleet batch`` with a client's) trusted every certificate in it, so any certificate its CA issued,
    for any name, passed for the gateway's."""
    from orchestrator.keys import GatewayConfig
    from orchestrator.tlsfiles import client_context
    c = ca_chain(tmp_path / "pki")
    full = tmp_path / "fullchain.pem"
    full.write_text(Path(f"{c['gw']}.pem").read_text() + Path(f"{c['inter']}.pem").read_text())
    ctx = client_context(GatewayConfig(tls={"cert_file": str(full), "key_file": f"{c['gw']}.key"}))

    def handshake(leaf: str) -> None:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        chain = tmp_path / f"{leaf}-chain.pem"
        chain.write_text(Path(f"{c[leaf]}.pem").read_text() + Path(f"{c['inter']}.pem").read_text())
        server.load_cert_chain(str(chain), f"{c[leaf]}.key")
        with socket.socket() as ls:
            ls.bind(("127.0.0.1", 0))
            ls.listen(1)

            def serve() -> None:
                conn, _ = ls.accept()
                try:
                    with server.wrap_socket(conn, server_side=True) as t:
                        t.recv(1)
                except (ssl.SSLError, OSError):
                    pass
            th = threading.Thread(target=serve, daemon=True)
            th.start()
            try:
                with socket.create_connection(ls.getsockname(), timeout=10) as s, ctx.wrap_socket(s) as t:
                    t.sendall(b"x")
            finally:
                th.join(10)
    handshake("gw")   # the gateway's own certificate, served with its chain
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake("evil")   # another name the same CA signed
