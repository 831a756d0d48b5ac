"""`network = "proxy"`: a sandbox reaches only the allowed host:port pairs,
through the host's proxy, and every attempt is logged. Only addresses on this
machine are used: local HTTP servers stand in for the allowed host and for a
host that must stay unreached, checked on the host side."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from atelier.sandbox.base import SandboxConfig, parse_host_port
from atelier.sandbox.egress import BadRequest, is_allowed, parse_request
from atelier.sandbox.hostfs import python_executable, python_mounts

PY = python_executable()


# -- policy and parsing ----------------------------------------------------------

def test_policy_matches_host_and_port_exactly() -> None:
    allow = ["pypi.org:443", "*.pythonhosted.org:443", "[::1]:8080", "10.0.0.1:80"]
    assert is_allowed("pypi.org", 443, allow) and is_allowed("PyPI.org.", 443, allow)
    assert is_allowed("files.pythonhosted.org", 443, allow)
    assert is_allowed("::1", 8080, allow) and is_allowed("10.0.0.1", 80, allow)
    for host, port in [("pypi.org", 80), ("evil-pypi.org", 443), ("pypi.org.evil.com", 443),
                       ("pythonhosted.org", 443), ("evilpythonhosted.org", 443), ("10.0.0.2", 80)]:
        assert not is_allowed(host, port, allow), (host, port)


def test_request_parsing() -> None:
    req = parse_request(b"CONNECT Example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n")
    assert (req.method, req.host, req.port, req.head) == ("CONNECT", "example.org", 443, b"")
    req = parse_request(b"GET http://h.test:8080/a/b?q=1 HTTP/1.1\r\nHost: h.test:8080\r\n"
                        b"Proxy-Connection: keep-alive\r\nConnection: keep-alive\r\nAccept: */*\r\n\r\n")
    assert (req.host, req.port) == ("h.test", 8080)
    assert req.head == (b"GET /a/b?q=1 HTTP/1.1\r\nHost: h.test:8080\r\nAccept: */*\r\n"
                        b"Connection: close\r\n\r\n")
    assert parse_request(b"GET http://h.test/ HTTP/1.1\r\n\r\n").port == 80
    for bad in (b"GET / HTTP/1.1\r\n\r\n", b"CONNECT host HTTP/1.1\r\n\r\n", b"garbage\r\n\r\n",
                b"GET https://h.test/ HTTP/1.1\r\n\r\n", b"CONNECT h:99999 HTTP/1.1\r\n\r\n"):
        with pytest.raises(BadRequest):
            parse_request(bad)


def test_config_refuses_what_cannot_work() -> None:
    assert parse_host_port("[::1]:443") == ("::1", 443)
    for entry in ("pypi.org", "pypi.org:0", "pypi.org:http", ":443", "a/b:1", "user@h:1"):
        with pytest.raises(ValidationError):
            SandboxConfig(network="proxy", egress={"allow": [entry]})
    with pytest.raises(ValidationError, match="only with network = 'proxy'"):
        SandboxConfig(egress={"allow": ["pypi.org:443"]})
    with pytest.raises(ValidationError, match="bwrap backend"):
        SandboxConfig(backend="local", network="proxy")


# -- through a real sandbox ------------------------------------------------------

class Server:
    """A local HTTP server that answers GETs and records every path it saw."""

    def __init__(self) -> None:
        seen: list[str] = []
        self.seen = seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.path)
                body = f"served {self.path}\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    allowed, other = Server(), Server()
    yield allowed, other
    allowed.close()
    other.close()


CONNECT = """
import socket, sys
s = socket.create_connection(("127.0.0.1", 3128), timeout=10) if sys.argv[1] == "tcp" else socket.socket(socket.AF_UNIX)
if sys.argv[1] == "unix":
    s.connect("/run/atelier/egress.sock")
s.sendall(f"CONNECT {sys.argv[2]} HTTP/1.1\\r\\nHost: {sys.argv[2]}\\r\\n\\r\\n".encode())
status = s.recv(4096).decode().split("\\r\\n")[0]
print(status)
if " 200 " in status:
    s.sendall(b"GET /tunnel HTTP/1.0\\r\\n\\r\\n")
    reply = b""
    while chunk := s.recv(4096):  # HTTP/1.0: the server closes after the body, which may come in a later chunk
        reply += chunk
    print(reply.decode().rsplit("\\r\\n", 1)[-1], end="")
"""

URLOPEN = """
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(), end="")
except urllib.error.HTTPError as exc:
    print("HTTP", exc.code)
"""


@pytest.mark.timeout(90)
def test_only_allowed_pairs_get_through_and_each_attempt_is_logged(make_sandbox, snapshot, servers,
                                                                   tmp_path: Path) -> None:
    allowed, other = servers
    log_path = tmp_path / "egress.jsonl"
    sb = make_sandbox(snapshot, network="proxy", ro_mounts=python_mounts(),
                      egress={"allow": [f"127.0.0.1:{allowed.port}", "files.example.org:443"],
                              "log": str(log_path)})
    # The sandbox's own 127.0.0.1 is its own loopback: let urllib use the
    # proxy for it, as it would for any remote name.
    via_proxy = {"no_proxy": "", "NO_PROXY": ""}
    a, o = f"127.0.0.1:{allowed.port}", f"127.0.0.1:{other.port}"

    # Allowed: plain HTTP through HTTP_PROXY, a CONNECT tunnel on the loopback
    # port, and the same over the Unix socket bound inside.
    assert sb.exec([PY, "-c", URLOPEN, f"http://{a}/plain"], env=via_proxy).stdout == "served /plain\n"
    tunnel = sb.exec([PY, "-c", CONNECT, "tcp", a])
    assert tunnel.stdout == "HTTP/1.1 200 Connection established\nserved /tunnel\n", tunnel
    assert sb.exec([PY, "-c", CONNECT, "unix", a]).stdout.endswith("served /tunnel\n")

    # Denied: another port of the same host, a name that is never resolved,
    # by either request form.
    assert sb.exec([PY, "-c", URLOPEN, f"http://{o}/nope"], env=via_proxy).stdout == "HTTP 403\n"
    assert sb.exec([PY, "-c", CONNECT, "tcp", o]).stdout == "HTTP/1.1 403 Forbidden\n"
    assert sb.exec([PY, "-c", CONNECT, "tcp", "example.com:443"]).stdout == "HTTP/1.1 403 Forbidden\n"

    # No way around it: direct TCP to the host's servers, to an outside
    # address, and DNS all fail.
    direct = sb.exec(["bash", "-c", f"echo hi > /dev/tcp/127.0.0.1/{other.port}"], timeout=5)
    assert direct.exit_code != 0 and "Connection refused" in direct.stderr
    out = sb.exec(["bash", "-c", "echo hi > /dev/tcp/1.1.1.1/80"], timeout=5)
    assert out.exit_code != 0 and "Network is unreachable" in out.stderr
    dns = sb.exec([PY, "-c", "import socket; socket.getaddrinfo('example.com', 443)"])
    assert dns.exit_code != 0 and "gaierror" in dns.stderr
    assert sb.exec("getent hosts example.com").exit_code != 0

    assert allowed.seen == ["/plain", "/tunnel", "/tunnel"]
    assert other.seen == []
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [(r["method"], f"{r['host']}:{r['port']}", r["decision"]) for r in records] == [
        ("GET", a, "allowed"), ("CONNECT", a, "allowed"), ("CONNECT", a, "allowed"),
        ("GET", o, "denied"), ("CONNECT", o, "denied"), ("CONNECT", "example.com:443", "denied"),
    ]
    assert all(r["sandbox"] == sb.name for r in records)


@pytest.mark.timeout(60)
def test_the_proxy_ends_with_the_sandbox_and_forks_get_their_own(make_sandbox, snapshot, servers) -> None:
    allowed, _ = servers
    sb = make_sandbox(snapshot, network="proxy", ro_mounts=python_mounts(),
                      egress={"allow": [f"127.0.0.1:{allowed.port}"]})
    child = make_sandbox.track(sb.fork())
    sock = sb._proxy.path
    assert child._proxy.path != sock
    sb.close()
    assert not sock.exists()
    res = child.exec([PY, "-c", CONNECT, "tcp", f"127.0.0.1:{allowed.port}"])
    assert res.stdout.endswith("served /tunnel\n"), res


@pytest.mark.timeout(90)
@pytest.mark.usefixtures("bwrap_ready")
def test_cli_network_proxy(snapshot, servers, tmp_path: Path) -> None:
    allowed, other = servers
    log_path = tmp_path / "cli-egress.jsonl"
    cli = [sys.executable, "-m", "atelier.cli", "sandbox", "run", "-w", str(snapshot),
           "--network", "proxy", "--allow", f"127.0.0.1:{allowed.port}", "--egress-log", str(log_path), "--"]
    # bash alone (no interpreter mounted): a CONNECT by hand, then a denied one.
    script = ("exec 3<>/dev/tcp/127.0.0.1/3128; printf 'CONNECT %s HTTP/1.1\\r\\n\\r\\n' \"$0\" >&3;"
              " IFS= read -r status <&3; echo \"$status\"")
    for target, status in ((f"127.0.0.1:{allowed.port}", "200"), (f"127.0.0.1:{other.port}", "403")):
        res = subprocess.run([*cli, "bash", "-c", script, target], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and f" {status} " in res.stdout, res.stdout + res.stderr
    decisions = [json.loads(line)["decision"] for line in log_path.read_text().splitlines()]
    assert decisions == ["allowed", "denied"]
    bad = subprocess.run([*cli[:-1], "--allow", "nope", "--", "true"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "host:port" in bad.stderr and "Traceback" not in bad.stderr
