"""Ask the server started by examples/serve.sh (OpenAI-compatible API, standard library only).

    python examples/client.py [--port 8000] [--wait 600]

Waits up to ``--wait`` seconds for the server's /health (a first start compiles kernels for a few
minutes), then sends one completion and one chat request.
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


def wait_for(base, seconds):
    deadline = time.time() + seconds
    while True:
        try:
            get(f"{base}/health")
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.time() > deadline:
                raise SystemExit(f"no server answered at {base}/health within {seconds} s")
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
