"""End-to-end GPU checks: engines run in child processes (clean GPU state, bounded by timeouts).

    python -m tests.gpu.e2e engine SPEC.json OUT.json     # one engine: run prompts, dump outputs
    python -m tests.gpu.e2e jobs tests.gpu.test_pcp_e2e [SUFFIX ...]  # the module's jobs that fit
                                                                     # this machine (names ending so)

``jobs`` saves each result as $OUT/<job>.json, for QWEN36_PCP_REUSE: on a 1-GPU machine it makes the
pcp=1 baselines, so the 2-GPU machine only runs the pcp=2 and tp=2 engines; with suffixes (e.g.
``_pcp2``) a short session runs those first.

``SPEC.json``: {"llm": {...LLM kwargs...}, "prompts": [[token ids], ...], "max_tokens": 32,
"logprobs": 5, "actions": [...optional...], "engine_core_in_process": false}.

With ``engine_core_in_process`` the engine core runs in the engine's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0; workers stay processes of their own). Then ``generate`` hands the
scheduler every prompt of a batch before the first step. With the engine core in its own process,
that process starts stepping as soon as the first request arrives, so how a batch is cut into steps
varies from run to run, and vLLM's kernels are not batch-invariant.
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
# vLLM 0.20.2's GDN kernel chunk_scaled_dot_kkt_fwd races under some autotune configs, so vLLM did
# not repeat its own answers past ~2k tokens (qwen36_pcp.runner_hooks.race_free_gdn_kkt). Every
# engine and server here, pcp=1, tp=2 and vLLM's own model included, runs without the race, so a
# comparison measures the two setups and not the race. QWEN36_PCP_DETERMINISTIC_GDN=0 in the
# environment overrides this (to see vLLM as it is).
CHILD_ENV = {"QWEN36_PCP_DETERMINISTIC_GDN": "1"}


def child_env(gpus: str | None = None, **extra) -> dict:
    env = {**CHILD_ENV, **os.environ, **extra}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


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
def request_outputs(results):
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
    if spec.get("engine_core_in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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
        result["runs"].append({"outputs": request_outputs(res), "seconds": time.time() - t1})
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


def serve(args: list[str], requests, timeout: float = 400, name: str = "serve",
          gpus: str | None = None) -> list:
    """Start ``vllm serve`` (same code as the CLI), run ``requests(base_url)``, stop it."""
    import urllib.request

    port = 8000 + (os.getpid() + sum(map(ord, name))) % 1000
    log_path = out_dir() / f"{name}.log"
    env = child_env(gpus, HF_HUB_OFFLINE="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args,
                                 "--port", str(port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
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
                _kill_group(proc, dump=True)


def post(url: str, body: dict, timeout: float = 300) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def save(name: str, data) -> None:
    (out_dir() / f"{name}.json").write_text(json.dumps(data, indent=1))


def _kill_group(proc: subprocess.Popen, dump: bool) -> None:
    """Stop a child and everything it started (engine core, workers); with ``dump``, first ask every
    process of the group for its Python stacks (registered below), so a stall says where it was."""
    import signal

    try:
        if dump:
            os.killpg(proc.pid, signal.SIGUSR1)
            time.sleep(5)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def engine(spec: dict, timeout: float = 420, name: str = "engine", gpus: str | None = None) -> dict:
    """Run one engine spec in a child process; raises with the log tail if it fails or hangs.

    With QWEN36_PCP_REUSE=DIR, a result saved earlier as DIR/<name>.json is used instead when the
    same spec, code and stack made it (``fingerprint``): to split a long acceptance run over several
    machine sessions, or to make the 1-GPU baselines on a 1-GPU machine (``jobs`` below).
    """
    made_by = fingerprint(spec)
    reused = _reused(name, made_by)
    if reused is not None:
        save(name, reused)
        return reused
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        log_path = out_dir() / f"{name}.log"
        env = child_env(gpus)
        t0 = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tests.gpu.e2e", "engine", str(spec_path),
                                     str(out_path)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                _kill_group(proc, dump=True)
                raise AssertionError(f"{name}: no answer within {timeout} s (stall)\n"
                                     + log_path.read_text()[-6000:]) from e
        if proc.returncode != 0 or not out_path.exists():
            raise AssertionError(f"{name}: exit code {proc.returncode}\n" + log_path.read_text()[-6000:])
        result = json.loads(out_path.read_text())
        result["wall_s"] = time.time() - t0
        result["made_by"] = made_by
        save(name, result)
        return result


def fingerprint(spec: dict) -> dict:
    """What an engine's result depends on: its spec, this package's and this file's code, the GDN
    setting and the software and GPU it ran on. A saved result is reused only where all of it matches."""
    import hashlib
    import importlib.metadata as md

    import torch

    code = hashlib.sha256()
    for path in sorted([*(REPO / "qwen36_pcp").rglob("*.py"), Path(__file__).resolve()]):
        code.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return {"spec": hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16],
            "code": code.hexdigest()[:16],
            "env": {k: child_env()[k] for k in sorted(CHILD_ENV)},
            "stack": f"vllm {md.version('vllm')}, torch {torch.__version__}, "
                     f"triton {md.version('triton')}, {gpu}"}


def _reused(name: str, made_by: dict):
    """The result saved as $QWEN36_PCP_REUSE/<name>.json if it was made by the same ``made_by``."""
    path = Path(os.environ.get("QWEN36_PCP_REUSE", "/nonexistent")) / f"{name}.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    stale = [k for k in made_by if saved.get("made_by", {}).get(k) != made_by[k]]
    if stale:
        print(f"[pool] {name}: not reusing {path}, its {'/'.join(stale)} differ(s); running it", flush=True)
        return None
    print(f"[pool] {name}: reusing {path}", flush=True)
    return saved


def _queue_order(jobs: dict) -> list[str]:
    """Jobs in the given order, each 1-GPU job followed by the next 1-GPU job (they run side by side)."""
    names, order = list(jobs), []
    for name in names:
        if name in order:
            continue
        order.append(name)
        if jobs[name][1] == 1:
            partner = next((m for m in names if m not in order and jobs[m][1] == 1), None)
            if partner:
                order.append(partner)
    return order


def engines(jobs: dict, timeout: float = 480) -> dict:
    """Run several jobs in order (first in, first started), side by side on disjoint GPUs when free.

    jobs: {name: (spec or callable, number of GPUs)}. A spec runs through ``engine``; a callable is
    called with the CUDA_VISIBLE_DEVICES string. Returns {name: result, or the exception it raised}.
    """
    import threading

    import torch

    total = torch.cuda.device_count()
    free = list(range(total))
    cond = threading.Condition()
    results = {}
    queue = [name for name in _queue_order(jobs) if jobs[name][1] <= total]
    for name in set(jobs) - set(queue):
        results[name] = AssertionError(f"{name} needs {jobs[name][1]} GPUs, the machine has {total}")

    def run(name, job, n):
        with cond:
            cond.wait_for(lambda: queue[0] == name and len(free) >= n)
            queue.pop(0)
            gpus = [free.pop(0) for _ in range(n)]
            cond.notify_all()
        visible = ",".join(map(str, gpus))
        t0 = time.time()
        try:
            results[name] = job(visible) if callable(job) else engine(job, timeout, name, visible)
        except BaseException as e:  # noqa: BLE001 - handed to the test that owns the job
            results[name] = e
        finally:
            print(f"[pool] {name} on GPUs {visible}: {time.time() - t0:.0f} s", flush=True)
            with cond:
                free.extend(gpus)
                free.sort()
                cond.notify_all()

    threads = [threading.Thread(target=run, args=(name, *jobs[name])) for name in queue]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def result(results: dict, name: str):
    """One job's result from ``engines``; re-raises its failure in the test that asked for it."""
    r = results[name]
    if isinstance(r, BaseException):
        raise r
    return r


def outputs(result: dict, runs=None) -> list[dict]:
    """One job's per-prompt outputs, its batches (``runs``: their indices, default all) in order."""
    picked = result["runs"] if runs is None else [result["runs"][i] for i in runs]
    return [out for run in picked for out in run["outputs"]]


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


def marked_jobs(marks, max_gpus: int | None = None) -> dict:
    """The engine jobs that ``engine_jobs(builder=fn)`` marks declare (those needing at most
    ``max_gpus``, if given)."""
    jobs = {}
    for mark in marks:
        if mark.name == "engine_jobs":
            jobs.update({k: v for k, v in mark.kwargs["builder"]().items()
                         if max_gpus is None or v[1] <= max_gpus})
    return jobs


def module_jobs(module, max_gpus: int) -> dict:
    """The engine jobs of a test module's tests that need at most ``max_gpus``."""
    return marked_jobs((m for fn in vars(module).values() for m in getattr(fn, "pytestmark", [])), max_gpus)


def main(argv):
    if argv[0] == "engine":
        spec = json.loads(Path(argv[1]).read_text())
        result = run_engine(spec)
        Path(argv[2]).write_text(json.dumps(result))
        return 0
    if argv[0] == "jobs":  # python -m tests.gpu.e2e jobs tests.gpu.test_pcp_e2e [SUFFIX ...]
        import importlib

        import torch

        jobs = module_jobs(importlib.import_module(argv[1]), torch.cuda.device_count())
        jobs = {k: v for k, v in jobs.items() if k.endswith(tuple(argv[2:]) or "")}
        failed = {k: r for k, r in engines(jobs).items() if isinstance(r, BaseException)}
        for name, err in failed.items():
            print(f"[jobs] {name} failed: {str(err)[-2000:]}", flush=True)
        print(f"[jobs] {len(jobs) - len(failed)} of {len(jobs)} saved under {out_dir()}", flush=True)
        return 1 if failed else 0
    raise SystemExit(f"unknown command {argv[0]}")


if __name__ in ("__main__", "__mp_main__"):  # the engine child and the processes it spawns
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
