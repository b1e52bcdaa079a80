# SPDX-License-Identifier: Apache-2.0
"""examples/client.py says what it sees while it waits: no server on the port, a server starting (vLLM
holds its port from the start but accepts connections only once its engine is up), a server that
answers but is not healthy, a server ready; then it asks its two questions (a stand-in server here)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_client():
    spec = importlib.util.spec_from_file_location("example_client", REPO / "examples" / "client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


client = _load_client()


class StandIn(BaseHTTPRequestHandler):
    """vLLM's OpenAI server as the client uses it; ``health`` is the status /health answers."""

    health = 200

    def _send(self, status, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # http.server's name
        if self.path == "/health":
            return self._send(self.health)
        return self._send(200, {"data": [{"id": "tiny"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/completions":
            return self._send(200, {"choices": [{"text": " Alice"}]})
        return self._send(200, {"choices": [{"message": {"content": "Hello."}}]})

    def log_message(self, *args):
        pass


def _bound_port():
    """A socket bound to a free port and not listening: vLLM's server while its engine starts."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds it
    sock.bind(("", 0))
    return sock, sock.getsockname()[1]


def _serve(sock, health=200):
    """Start answering on ``sock`` (it listens from now on)."""
    handler = type("Handler", (StandIn,), {"health": health})
    server = HTTPServer(("", 0), handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_activate()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_nothing_listening(capsys):
    sock, port = _bound_port()
    sock.close()  # a free port: nobody holds it
    with pytest.raises(SystemExit) as e:
        client.wait_for(f"http://127.0.0.1:{port}", port, 0.2, poll=0.1)
    said = capsys.readouterr().out
    assert f"no server listening on port {port}" in said and "starting" not in said, said
    assert f"within 0 s: no server listening on port {port}" in str(e.value)


def test_starting_then_ready(capsys):
    sock, port = _bound_port()
    base = f"http://127.0.0.1:{port}"
    assert client.look(base, port)[0] == "starting"
    timer = threading.Timer(0.5, lambda: servers.append(_serve(sock)))
    servers = []
    timer.start()
    try:
        client.wait_for(base, port, 10, poll=0.1)
    finally:
        timer.join()
        for server in servers:
            server.shutdown()
        sock.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines  # one line per state seen
    assert "a server is starting: port" in lines[0] and "held but not open yet" in lines[0], lines
    assert lines[1].startswith(f"server ready at {base} after "), lines


def test_unhealthy_server(capsys):
    sock, port = _bound_port()
    server = _serve(sock, health=503)
    try:
        with pytest.raises(SystemExit) as e:
            client.wait_for(f"http://127.0.0.1:{port}", port, 0.2, poll=0.1)
    finally:
        server.shutdown()
        sock.close()
    assert "/health says HTTP 503 (its engine has stopped" in str(e.value)
    assert "HTTP 503" in capsys.readouterr().out


def test_the_example_asks_a_ready_server():
    sock, port = _bound_port()
    server = _serve(sock)
    try:
        run = subprocess.run([sys.executable, "examples/client.py", "--port", str(port), "--wait", "5"],
                             capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    finally:
        server.shutdown()
        sock.close()
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["completion:  Alice", "chat: Hello."], run.stdout
