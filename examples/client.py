# SPDX-License-Identifier: Apache-2.0
"""Ask the server started by examples/serve.sh (OpenAI-compatible API, standard library only).

    python examples/client.py [--port 8000] [--wait 600]

Waits up to ``--wait`` seconds for the server's /health, saying what it sees (a line when that changes,
and every 15 s): no server on the port, a server starting (vLLM holds the port but opens it only once
the weights are loaded and the kernels compiled, minutes on a first start), a server that answers
but is not healthy, a server ready. Then it sends one completion and one chat request.
"""

import argparse
import errno
import json
import socket
import time
import urllib.error
import urllib.request


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def port_held(port):
    """Whether a process on this machine holds ``port``: vLLM's server binds it first and accepts
    connections only once its engine is up, so until then a connection is refused as if nothing were
    there. A bind without SO_REUSEADDR fails on a port another socket holds."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def look(base, port):
    """What answers at ``base`` now: (state, what to print), state one of "ready", "unhealthy",
    "starting", "none"."""
    try:
        get(f"{base}/health")
        return "ready", f"server ready at {base}"
    except urllib.error.HTTPError as e:  # a server answered, with an error status
        why = "its engine has stopped: see the server's log" if e.code == 503 else "is it a vLLM server?"
        return "unhealthy", f"a server answers at {base} but /health says HTTP {e.code} ({why})"
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            return "starting", f"a server is listening at {base} but /health did not answer within 5 s (busy?)"
        if port_held(port):
            return "starting", (f"a server is starting: port {port} is held but not open yet (vLLM opens it once "
                                "the weights are loaded and the kernels compiled)")
        return "none", f"no server listening on port {port} (start one with examples/serve.sh)"


def wait_for(base, port, seconds, every=15, poll=2.0):
    """Poll /health every ``poll`` seconds until it answers; say what is seen whenever that changes and
    every ``every`` seconds, since a first start stays silent here for minutes (the server's own log
    shows its progress)."""
    start, said, last = time.time(), None, None
    while True:
        state, text = look(base, port)
        waited = time.time() - start
        if state == "ready":
            if last is not None:
                print(f"{text} after {waited:.0f} s", flush=True)
            return
        if waited > seconds:
            raise SystemExit(f"no server ready at {base}/health within {seconds:.0f} s: {text}")
        if state != last or time.time() - said >= every:
            print(f"waiting for {base}/health, {waited:.0f} s of {seconds:.0f} s: {text}", flush=True)
            said, last = time.time(), state
        time.sleep(max(0.0, min(poll, seconds - waited + 0.1)))


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for the server")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    wait_for(base, args.port, args.wait)
    model = json.loads(get(f"{base}/v1/models"))["data"][0]["id"]
    comp = post(f"{base}/v1/completions", {"model": model, "prompt": "Hello, my name is",
                                           "max_tokens": 16, "temperature": 0})
    print("completion:", comp["choices"][0]["text"])
    chat = post(f"{base}/v1/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Say something."}]})
    print("chat:", chat["choices"][0]["message"]["content"])


if __name__ == "__main__":
    main()
