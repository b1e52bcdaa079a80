"""Ask the server started by examples/serve.sh (OpenAI-compatible API, standard library only).

    python examples/client.py [--port 8000] [--wait 600]

Waits up to ``--wait`` seconds for the server's /health (a first start loads the weights and compiles
kernels for a few minutes; a line every 15 s says so), then sends one completion and one chat request.
"""

import argparse
import json
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


def wait_for(base, seconds, every=15):
    """Poll /health until it answers; say what is awaited every ``every`` seconds, since a first start
    stays silent here for minutes (the server's own log shows its progress)."""
    start, said = time.time(), None
    while True:
        try:
            get(f"{base}/health")
            if said is not None:
                print(f"server ready after {time.time() - start:.0f} s", flush=True)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            waited = time.time() - start
            if waited > seconds:
                raise SystemExit(f"no server answered at {base}/health within {seconds:.0f} s: is it running "
                                 "(examples/serve.sh), on this port, and does its log end in an error?") from None
            if said is None or time.time() - said >= every:
                print(f"waiting for {base}/health (server still starting: loading weights, compiling) ... "
                      f"{waited:.0f} s of {seconds:.0f} s", flush=True)
                said = time.time()
            time.sleep(2)


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for the server")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    wait_for(base, args.wait)
    model = json.loads(get(f"{base}/v1/models"))["data"][0]["id"]
    comp = post(f"{base}/v1/completions", {"model": model, "prompt": "Hello, my name is",
                                           "max_tokens": 16, "temperature": 0})
    print("completion:", comp["choices"][0]["text"])
    chat = post(f"{base}/v1/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Say something."}]})
    print("chat:", chat["choices"][0]["message"]["content"])


if __name__ == "__main__":
    main()
