"""Egress through a policy: `network = "proxy"`.

The sandbox keeps its own network namespace with only a loopback: no route,
no DNS, the host's listeners unreachable. What it may reach goes through an
HTTP(S) proxy that runs on the host, in this process:

```
 sandbox: pip ──► 127.0.0.1:3128 ─(forwarder)─► /run/atelier/egress.sock ─┐
                                                                          │ Unix socket,
 host:   EgressProxy ◄────────────────────────────────────────────────────┘ bound in
           │ allowed host:port?  yes: connect, relay bytes · no: 403
           └─ one log line per attempt (allowed / denied, and why)
```

- `EgressProxy` listens on a Unix socket (in this user's runtime directory,
  bound read-only into the sandbox at `SOCKET_INSIDE`). It accepts `CONNECT
  host:port` (HTTPS and any TLS: the tunnel is opaque) and absolute-form
  `http://host:port/…` requests, matches the host *name the client asked
  for* and the port against `egress.allow`, resolves and connects on the
  host, and relays bytes. A denied or malformed request gets 403/400 and is
  never resolved. Each attempt is one JSON line in `egress.log` and one INFO
  log record.
- `LoopbackForwarder` gives tools that only know TCP proxies a port: a
  listening socket created *inside the sandbox's network namespace* (by a
  short-lived helper that enters it and hands the socket back) and served by
  a thread here, which relays each connection to the Unix socket. Commands
  get `HTTP(S)_PROXY=http://127.0.0.1:<port>`.

What this guarantees: bytes leave the sandbox only to listed host:port pairs,
and only over TCP through the proxy; UDP, ICMP, raw sockets and DNS have no
way out. What it does not: a listed host is trusted with whatever the sandbox
sends it (a listed package index receives whatever a command uploads), and
the name is resolved by the host's resolver at connect time.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from atelier.sandbox.base import EgressConfig, SandboxError, parse_host_port

log = logging.getLogger(__name__)

SOCKET_INSIDE = "/run/atelier/egress.sock"
MAX_HEAD = 64 * 1024
IO_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
HOP_HEADERS = ("proxy-connection", "proxy-authorization", "connection", "keep-alive")


# -- policy and parsing (pure) ---------------------------------------------------

def is_allowed(host: str, port: int, allow: list[str]) -> bool:
    """Whether `host:port` matches an entry of `allow` (exact host, or
    `*.domain` for its subdomains; the port always exactly)."""
    host = host.lower().rstrip(".")
    for entry in allow:
        want_host, want_port = parse_host_port(entry)
        if want_port != port:
            continue
        if want_host == host or (want_host.startswith("*.") and host.endswith(want_host[1:])):
            return True
    return False


@dataclass(frozen=True)
class Request:
    method: str
    host: str
    port: int
    head: bytes
    """For plain HTTP, the head to send upstream (origin-form request line,
    hop-by-hop headers dropped, `Connection: close`); empty for CONNECT."""


class BadRequest(ValueError):
    pass


def parse_request(head: bytes) -> Request:
    """Read the head of a proxy request (up to and including the blank line)."""
    try:
        text = head.decode("latin-1")
        line, *headers = text.split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise BadRequest("malformed request line") from None
    if not version.startswith("HTTP/"):
        raise BadRequest("not HTTP")
    if method == "CONNECT":
        try:
            host, port = parse_host_port(target)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return Request(method, host, port, b"")
    url = urllib.parse.urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise BadRequest("expected CONNECT host:port or an absolute http:// URL")
    try:
        port = url.port or 80
    except ValueError:
        raise BadRequest(f"bad port in {target!r}") from None
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    kept = [h for h in headers if h and h.split(":", 1)[0].strip().lower() not in HOP_HEADERS]
    upstream = "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""])
    return Request(method, url.hostname.lower(), port, upstream.encode("latin-1"))


# -- relaying --------------------------------------------------------------------

def relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until both sides have finished (or one fails);
    close both."""
    open_dirs = {a: b, b: a}
    try:
        while open_dirs:
            ready, _, _ = select.select(list(open_dirs), [], [], IO_TIMEOUT_S * 10)
            if not ready:
                return
            for src in ready:
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                dst = open_dirs[src]
                if data:
                    dst.sendall(data)
                    continue
                del open_dirs[src]
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
    except OSError:
        pass
    finally:
        a.close()
        b.close()


def _read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    """(head, bytes after it) of the request on `conn`."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            raise BadRequest("connection closed before the request was complete")
        buf += chunk
        if len(buf) > MAX_HEAD:
            raise BadRequest("request head too large")
    end = buf.index(b"\r\n\r\n") + 4
    return buf[:end], buf[end:]


class _Server:
    """A listening socket served by a daemon thread, one thread per
    connection; `close()` stops accepting and closes open connections."""

    def __init__(self, listener: socket.socket, name: str) -> None:
        self._listener = listener
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.handle(conn)
        except OSError:
            conn.close()
        finally:
            with self._lock:
                self._conns.discard(conn)

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)


class EgressProxy(_Server):
    """The policy point: an HTTP(S) proxy on a Unix socket at `path`."""

    def __init__(self, config: EgressConfig, path: Path, sandbox_name: str) -> None:
        self.config = config
        self.path = path
        self.sandbox_name = sandbox_name
        self._log_lock = threading.Lock()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        # The sandbox's uid connects through the bind mount; on the host, the
        # socket's directory is this user's private runtime directory.
        os.chmod(path, 0o666)
        listener.listen(64)
        super().__init__(listener, f"egress-proxy-{sandbox_name}")

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        try:
            head, rest = _read_head(conn)
            req = parse_request(head)
        except (BadRequest, socket.timeout) as exc:
            self._record("?", "?", 0, False, f"bad request: {exc}")
            _reply(conn, 400, f"bad proxy request: {exc}")
            return
        if not is_allowed(req.host, req.port, self.config.allow):
            self._record(req.method, req.host, req.port, False, "not in egress.allow")
            _reply(conn, 403, f"{req.host}:{req.port} is not in this sandbox's egress.allow")
            return
        try:
            upstream = socket.create_connection((req.host, req.port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            self._record(req.method, req.host, req.port, True, f"allowed; connect failed: {exc}")
            _reply(conn, 502, f"cannot reach {req.host}:{req.port}: {exc}")
            return
        self._record(req.method, req.host, req.port, True, "allowed")
        try:
            if req.method == "CONNECT":
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream.sendall(req.head)
            if rest:
                upstream.sendall(rest)
        except OSError:
            upstream.close()
            raise
        conn.settimeout(None)
        upstream.settimeout(None)
        relay(conn, upstream)

    def _record(self, method: str, host: str, port: int, allowed: bool, why: str) -> None:
        verdict = "allowed" if allowed else "denied"
        log.info("egress %s: %s %s:%s (%s) from sandbox %s", verdict, method, host, port, why,
                 self.sandbox_name)
        if self.config.log is None:
            return
        line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sandbox": self.sandbox_name,
                           "method": method, "host": host, "port": port, "decision": verdict,
                           "reason": why})
        with self._log_lock:
            path = Path(self.config.log)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")


def _reply(conn: socket.socket, status: int, message: str) -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[status]
    body = (message + "\n").encode()
    try:
        conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    finally:
        conn.close()


# -- the loopback port inside the sandbox ---------------------------------------

# Run by `nsenter` in the sandbox's user and network namespaces: listen on its
# loopback, hand the socket to the parent over the inherited Unix socket, exit.
LISTEN_HELPER = r"""
import socket, sys
port, chan = int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2]))
s = socket.socket()
s.bind(("127.0.0.1", port))
s.listen(64)
socket.send_fds(chan, [b"L"], [s.fileno()])
"""


def listen_inside(holder_pid: int, port: int) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:`port` in the network namespace of
    `holder_pid` (entered through its user namespace)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = ["nsenter", "-t", str(holder_pid), "-U", "-n", "--preserve-credentials",
            "--", sys.executable, "-I", "-S", "-c", LISTEN_HELPER, str(port), str(theirs.fileno())]
    try:
        # The helper keeps our uid, so that it can read this interpreter
        # wherever it lives (for root, possibly where the sandbox's uid cannot).
        # It has no capabilities after exec (not the namespace's root), shares
        # only the sandbox's user and network namespaces (the sandbox cannot
        # see or signal it) and exits once it has handed the socket over.
        res = subprocess.run(argv, pass_fds=[theirs.fileno()], capture_output=True, text=True,
                             timeout=30, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd="/")
        theirs.close()
        if res.returncode != 0:
            raise SandboxError(f"could not open the proxy port {port} inside the sandbox: "
                               f"{res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}",
                               hint="pick another `egress.port`")
        ours.settimeout(10)
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()
    return socket.socket(fileno=fds[0])


class LoopbackForwarder(_Server):
    """Relays each connection to the sandbox's loopback port to the proxy's
    Unix socket."""

    def __init__(self, listener: socket.socket, proxy_path: Path, sandbox_name: str) -> None:
        self.proxy_path = proxy_path
        super().__init__(listener, f"egress-forwarder-{sandbox_name}")

    def handle(self, conn: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(str(self.proxy_path))
        except OSError:
            upstream.close()
            conn.close()
            return
        relay(conn, upstream)


def proxy_env(port: int) -> dict[str, str]:
    """The variables that make common tools (pip, curl, requests, urllib, git)
    use the proxy, and keep the sandbox's own loopback direct."""
    url = f"http://127.0.0.1:{port}"
    env = {}
    for name in ("http_proxy", "https_proxy"):
        env[name] = env[name.upper()] = url
    env["no_proxy"] = env["NO_PROXY"] = "localhost,127.0.0.1,::1"
    return env
