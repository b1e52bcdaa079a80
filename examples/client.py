"""Query the server started by examples/serve.sh (OpenAI-compatible API, standard library only)."""

import json
import os
import urllib.request

BASE = f"http://127.0.0.1:{os.environ.get('PORT', '8000')}"


def post(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


model = json.loads(urllib.request.urlopen(BASE + "/v1/models").read())["data"][0]["id"]
comp = post("/v1/completions", {"model": model, "prompt": "Hello, my name is", "max_tokens": 16,
                                "temperature": 0})
print("completion:", comp["choices"][0]["text"])
chat = post("/v1/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                                     "messages": [{"role": "user", "content": "Say something."}]})
print("chat:", chat["choices"][0]["message"]["content"])
