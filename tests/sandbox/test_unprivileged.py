"""Users are not root: the sandbox must work for an ordinary account.

When the suite runs as root (as CI does), this test drops to `nobody` with
`setpriv` (the `nobody` fixture) and runs a sandbox there: overlay, fork,
the process cap, diff, and egress through the proxy. Memory: test_memory.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

SCRIPT = r"""
from atelier.sandbox import SandboxConfig, create_sandbox
with create_sandbox("snap", SandboxConfig(max_processes=32)) as sb:
    assert sb.mode == "overlay", sb.mode
    assert sb.exec("echo more >> a.txt").exit_code == 0
    child = sb.fork()
    assert child.read_file("a.txt") == "one\nmore\n"
    child.close()
    bomb = sb.exec("for i in $(seq 100); do sleep 5 & done", timeout=10)
    assert "fork" in bomb.stderr.lower(), bomb
    assert "+more" in sb.diff()

# Egress through the proxy works for an ordinary user too.
import http.server, threading
seen = []
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=httpd.serve_forever, daemon=True).start()
target = f"127.0.0.1:{httpd.server_address[1]}"
config = SandboxConfig(network="proxy", egress={"allow": [target], "log": "egress.jsonl"})
with create_sandbox("snap", config) as sb:
    script = ("exec 3<>/dev/tcp/127.0.0.1/3128; printf 'CONNECT %s HTTP/1.1\\r\\n\\r\\n' $0 >&3;"
              " IFS= read -r status <&3; read -r _ <&3; echo $status;"
              " printf 'GET /through HTTP/1.0\\r\\n\\r\\n' >&3; head -n 1 <&3")
    res = sb.exec(["bash", "-c", script, target])
    assert " 200 " in res.stdout and res.stdout.count("200") == 2, res
    denied = sb.exec(["bash", "-c", script, "127.0.0.1:9"])
    assert " 403 " in denied.stdout, denied
assert seen == ["/through"], seen
import json
assert [json.loads(line)["decision"] for line in open("egress.jsonl")] == ["allowed", "denied"]
print("UNPRIVILEGED-OK")
"""


def test_sandbox_works_for_an_unprivileged_user(nobody) -> None:
    work = Path(tempfile.mkdtemp(prefix="atelier-unpriv-"))
    try:
        (work / "snap").mkdir()
        (work / "snap" / "a.txt").write_text("one\n")
        res = nobody.run(work, SCRIPT)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "UNPRIVILEGED-OK" in res.stdout, res.stdout + res.stderr
