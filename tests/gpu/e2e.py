"""End-to-end GPU checks: engines run in child processes (clean GPU state, bounded by timeouts).

    python -m tests.gpu.e2e engine SPEC.json OUT.json     # one engine: run prompts, dump outputs

``SPEC.json``: {"llm": {...LLM kwargs...}, "prompts": [[token ids], ...], "max_tokens": 32,
"logprobs": 5, "actions": [...optional...]}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = {"architectures": ["Qwen3_6ForCausalLM"]}


def base_llm_kwargs(model: str, **kw) -> dict:
    args = dict(model=model, hf_overrides=OVERRIDES, gdn_prefill_backend="triton", seed=0,
                gpu_memory_utilization=0.5, max_model_len=70000, enable_prefix_caching=False)
    args.update(kw)
    return args


def prompt_ids(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token ids (ids 10.. avoid special tokens at the top of the vocab)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 300) for _ in range(n)] for n in lengths]


# ------------------------------------------------------------------------------ child side
def _outputs(results):
    out = []
    for r in results:
        c = r.outputs[0]
        lps = []
        for step in c.logprobs or []:
            lps.append({str(t): lp.logprob for t, lp in step.items()})
        out.append({"token_ids": list(c.token_ids), "logprobs": lps, "text": c.text,
                    "finish_reason": c.finish_reason, "num_cached_tokens": r.num_cached_tokens})
    return out


def run_engine(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(**spec["llm"])
    startup = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 32),
                        logprobs=spec.get("logprobs", 5))
    result = {"startup_s": startup, "runs": []}
    for batch in spec.get("batches", [spec.get("prompts", [])]):
        batch = [batch] if batch and isinstance(batch[0], int) else batch
        t1 = time.time()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        result["runs"].append({"outputs": _outputs(res), "seconds": time.time() - t1})
    for action in spec.get("actions", []):
        result[action] = ACTIONS[action](llm, spec)
    t2 = time.time()
    llm.llm_engine.engine_core.shutdown()
    result["shutdown_s"] = time.time() - t2
    return result


def _abort_mid_prefill(llm, spec):
    """Start a long prompt under chunked prefill, abort it after two steps, finish the others."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    long_p = {"prompt_token_ids": spec["abort_prompt"]}
    engine.add_request("victim", long_p, sp)
    engine.add_request("survivor", {"prompt_token_ids": spec["abort_prompt"][:500]}, sp)
    steps, finished = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
        if steps == 2:
            engine.abort_request(["victim"])
    return {"steps": steps, "finished": finished}


def _max_tokens_one(llm, spec):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]],
                       SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return [len(r.outputs[0].token_ids) for r in res]


ACTIONS = {"abort_mid_prefill": _abort_mid_prefill, "max_tokens_one": _max_tokens_one}


# ----------------------------------------------------------------------------- parent side
def checkpoint(preset: str = "tiny") -> str:
    """The tiny random checkpoint (made once per machine, deterministic for the seed)."""
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    path = Path(os.environ.get("QWEN36_PCP_CKPT_DIR", "/tmp/qwen36_pcp_ckpt")) / preset
    if not (path / "config.json").exists():
        make_checkpoint(path, preset=preset, seed=0)
    return str(path)


def vocab_size(ckpt: str) -> int:
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    return cfg.get("text_config", cfg)["vocab_size"]


def out_dir() -> Path:
    d = Path(os.environ.get("OUT") or "/tmp/qwen36_pcp_gpu_results")
    d.mkdir(parents=True, exist_ok=True)
    return d


def serve(args: list[str], requests, timeout: float = 400, name: str = "serve") -> list:
    """Start ``vllm serve`` (same code as the CLI), run ``requests(base_url)``, stop it."""
    import urllib.request

    port = 8000 + os.getpid() % 1000
    log_path = out_dir() / f"{name}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args,
                                 "--port", str(port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=env)
        try:
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"{name}: server exited\n" + log_path.read_text()[-6000:])
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if time.time() > deadline:
                        raise AssertionError(f"{name}: not ready in {timeout} s\n"
                                             + log_path.read_text()[-4000:])
                    time.sleep(2)
            return requests(f"http://127.0.0.1:{port}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def post(url: str, body: dict, timeout: float = 300) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def save(name: str, data) -> None:
    (out_dir() / f"{name}.json").write_text(json.dumps(data, indent=1))

def engine(spec: dict, timeout: float = 420, name: str = "engine", gpus: str | None = None) -> dict:
    """Run one engine spec in a child process; raises with the log tail if it fails or hangs."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        log_path = out_dir() / f"{name}.log"
        with open(log_path, "w") as log:
            t0 = time.time()
            try:
                env = dict(os.environ)
                if gpus is not None:
                    env["CUDA_VISIBLE_DEVICES"] = gpus
                proc = subprocess.run([sys.executable, "-m", "tests.gpu.e2e", "engine", str(spec_path),
                                       str(out_path)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=timeout, env=env)
            except subprocess.TimeoutExpired as e:
                raise AssertionError(f"{name}: no answer within {timeout} s (stall)\n"
                                     + log_path.read_text()[-4000:]) from e
        if proc.returncode != 0 or not out_path.exists():
            raise AssertionError(f"{name}: exit code {proc.returncode}\n" + log_path.read_text()[-6000:])
        result = json.loads(out_path.read_text())
        result["wall_s"] = time.time() - t0
        save(name, result)
        return result


def engines(jobs: dict, timeout: float = 480) -> dict:
    """Run several engine specs, side by side on disjoint GPUs when the machine has enough.

    jobs: {name: (spec, number of GPUs)}. Each job gets its own CUDA_VISIBLE_DEVICES set.
    """
    import threading

    import torch

    total = torch.cuda.device_count()
    free = list(range(total))
    cond = threading.Condition()
    results, errors = {}, {}

    def run(name, spec, n):
        with cond:
            cond.wait_for(lambda: len(free) >= n)
            gpus = [free.pop(0) for _ in range(n)]
        try:
            results[name] = engine(spec, timeout=timeout, name=name, gpus=",".join(map(str, gpus)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[name] = e
        finally:
            with cond:
                free.extend(gpus)
                free.sort()
                cond.notify_all()

    threads = []
    for name, (spec, n) in sorted(jobs.items(), key=lambda kv: -kv[1][1]):  # big jobs first
        if n > total:
            raise AssertionError(f"{name} needs {n} GPUs, the machine has {total}")
        t = threading.Thread(target=run, args=(name, spec, n))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if errors:
        raise AssertionError("; ".join(f"{k}: {v}" for k, v in errors.items()))
    return results


def compare(ref: list[dict], other: list[dict]) -> dict:
    """vLLM's check_logprobs_close rule, plus the largest |logprob| difference over the shared prefix."""
    ok, max_diff, diverged = True, 0.0, []
    for i, (a, b) in enumerate(zip(ref, other)):
        for step, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"])):
            la, lb = a["logprobs"][step], b["logprobs"][step]
            if ta != tb:
                diverged.append((i, step))
                if str(ta) not in lb or str(tb) not in la:
                    ok = False
                break
            max_diff = max(max_diff, abs(la[str(ta)] - lb[str(tb)]))
    return {"ok": ok, "max_logprob_diff": max_diff, "diverged_at": diverged}


def main(argv):
    if argv[0] == "engine":
        spec = json.loads(Path(argv[1]).read_text())
        result = run_engine(spec)
        Path(argv[2]).write_text(json.dumps(result))
        return 0
    raise SystemExit(f"unknown command {argv[0]}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
