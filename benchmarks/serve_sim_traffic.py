# SPDX-License-Identifier: Apache-2.0
"""The traffic ``serve_sim.py`` replays: a Poisson process (or a burst) with prompt and output lengths from a
distribution, a ``vllm bench serve`` dataset file, or a trace (the simulator's JSONL or the result file of
``vllm bench serve --save-result --save-detailed``, whose measured start times then replay exactly).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from benchmarks.serve_sim_engine import Arrival

CHARS_PER_TOKEN = 4.0  # a dataset's text length in tokens without a tokenizer (assumed; pass --tokenizer)


def parse_lengths(spec: str):
    """A length distribution: ``N`` (fixed), ``LO:HI`` (uniform integers), ``A,B,C`` (uniform choice), or
    ``lognormal:MEDIAN:SIGMA[:MAX]``; returns ``draw(rng) -> int``."""
    spec = str(spec)
    if spec.startswith("lognormal:"):
        median, sigma, *cap = (float(x) for x in spec.split(":")[1:])
        hi = cap[0] if cap else math.inf
        return lambda rng: int(max(1, min(hi, round(rng.lognormvariate(math.log(median), sigma)))))
    if ":" in spec:
        lo, hi = (int(x) for x in spec.split(":"))
        if not 1 <= lo <= hi:
            raise ValueError(f"length range {spec!r}: need 1 <= LO <= HI")
        return lambda rng: rng.randint(lo, hi)
    if "," in spec:
        values = [int(x) for x in spec.split(",")]
        return lambda rng: rng.choice(values)
    value = int(spec)
    if value < 1:
        raise ValueError(f"length {spec!r}: need >= 1")
    return lambda rng: value


def arrival_times(n: int, rate: float, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """``n`` arrival times at ``rate`` requests/s: gamma-distributed gaps (burstiness 1: Poisson, as
    ``vllm bench serve --burstiness``); rate inf: all at once."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def synthetic(n: int, rate: float, prompt: str, output: str, seed: int = 0, burstiness: float = 1.0) -> list[Arrival]:
    rng = random.Random(seed)
    draw_prompt, draw_output = parse_lengths(prompt), parse_lengths(output)
    return [Arrival(t, draw_prompt(rng), draw_output(rng)) for t in arrival_times(n, rate, rng, burstiness)]


def _token_counter(tokenizer: str | None):
    if tokenizer is None:
        return lambda text: max(1, round(len(text) / CHARS_PER_TOKEN))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda text: max(1, len(tok(text).input_ids))


def dataset_lengths(path: str, tokenizer: str | None = None, output_len: int | None = None) -> list[tuple[int, int]]:
    """(prompt, output) lengths of a ``vllm bench serve`` dataset file: ``custom`` JSONL (``prompt``,
    ``output_tokens``) or ShareGPT JSON (the first human turn, the reply after it), as bench serve reads them;
    ``output_len`` replaces the file's output lengths."""
    count = _token_counter(tokenizer)
    text = Path(path).read_text(encoding="utf-8")
    out = []
    if path.endswith(".jsonl"):
        for line in text.splitlines():
            if line.strip():
                item = json.loads(line)
                n_out = output_len or int(item.get("output_tokens", 0))
                if not n_out:
                    raise ValueError(f"{path}: a line without output_tokens; pass --output-len")
                out.append((count(item["prompt"]), n_out))
        return out
    for item in json.loads(text):
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue  # bench serve keeps conversations with at least two turns
        out.append((count(turns[0]["value"]), output_len or count(turns[1]["value"])))
    return out


def from_dataset(path: str, n: int, rate: float, seed: int = 0, tokenizer: str | None = None,
                 output_len: int | None = None, burstiness: float = 1.0) -> list[Arrival]:
    """``n`` requests of the dataset (shuffled with ``seed``, repeated if short) at ``rate``."""
    lengths = dataset_lengths(path, tokenizer, output_len)
    if not lengths:
        raise ValueError(f"{path}: no request read")
    rng = random.Random(seed)
    rng.shuffle(lengths)
    times = arrival_times(n, rate, rng, burstiness)
    return [Arrival(t, *lengths[i % len(lengths)]) for i, t in enumerate(times)]


def from_trace(path: str) -> list[Arrival]:
    """A trace: JSONL of ``{"time": s, "prompt": tokens, "output": tokens}``, or a ``vllm bench serve
    --save-result --save-detailed`` result (its requests' measured start times and lengths)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("{") and '"start_times"' in text:
        return from_bench_result(json.loads(text))
    items = [json.loads(line) for line in text.splitlines() if line.strip()]
    return sorted(Arrival(float(i["time"]), int(i["prompt"]), int(i["output"])) for i in items)


def from_bench_result(result: dict) -> list[Arrival]:
    """The requests ``vllm bench serve --save-result --save-detailed`` sent (vLLM 0.20.2's result keys): each
    one's measured start (``start_times``, the client's clock, from the first), prompt tokens (``input_lens``:
    the server's count where it reported one) and output tokens (``output_lens``); a failed request (bench
    serve counts its output as 0 tokens) is left out, as bench serve leaves it out of its metrics."""
    missing = [k for k in ("start_times", "input_lens", "output_lens") if not isinstance(result.get(k), list)]
    if missing:
        raise ValueError(f"not a vllm bench serve result saved with --save-detailed: no {', '.join(missing)}")
    rows = [(s, p, o) for s, p, o in zip(result["start_times"], result["input_lens"], result["output_lens"]) if o]
    if not rows:
        raise ValueError("the result holds no successful request")
    t0 = min(result["start_times"])  # the first request sent, failed or not
    return sorted(Arrival(s - t0, int(p), int(o)) for s, p, o in rows)


def write_trace(arrivals: list[Arrival], path: str) -> None:
    Path(path).write_text("".join(json.dumps({"time": round(a.time, 6), "prompt": a.prompt, "output": a.output})
                                  + "\n" for a in arrivals), encoding="utf-8")
