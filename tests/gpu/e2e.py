# SPDX-License-Identifier: Apache-2.0
"""End-to-end GPU checks: engines run in child processes (clean GPU state, bounded by timeouts).

    python -m tests.gpu.e2e engine SPEC.json OUT.json     # one engine: run prompts, dump outputs
    python -m tests.gpu.e2e jobs tests.gpu.test_pcp_e2e [SUFFIX ...]  # the module's jobs (names
                                                                     # ending so), results saved

``jobs`` saves each result as $OUT/<job>.json, for QWEN36_PCP_REUSE (a long run spread over several
calls: each reuses what the earlier ones saved).

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
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = {"architectures": ["Qwen3_6ForCausalLM"]}
# vLLM 0.20.2's GDN kernel chunk_scaled_dot_kkt_fwd races under some autotune configs, so vLLM did
# not repeat its own answers past ~2k tokens (qwen36_pcp.deterministic_gdn.pin_gdn_configs). Every
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


def spec_batches(spec: dict) -> list[list]:
    """A spec's batches of prompts (token ids, or ``media.vision_prompt`` dicts): ``batches`` (a batch
    may be one prompt), or ``prompts``."""
    batches = spec.get("batches", [spec.get("prompts", [])])
    return [[b] if b and isinstance(b[0], int) else b for b in batches]


def engine_prompt(prompt):
    """What ``LLM.generate`` takes for a spec's prompt: token ids, with images and videos if any."""
    from vllm.inputs import TokensPrompt

    if isinstance(prompt, dict):
        from tests.media import multi_modal_data

        return TokensPrompt(prompt_token_ids=prompt["ids"], multi_modal_data=multi_modal_data(prompt))
    return TokensPrompt(prompt_token_ids=prompt)


def run_engine(spec: dict) -> dict:
    if spec.get("engine_core_in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    drafts_log = None
    if spec.get("record_drafts"):
        from harness.shared_gpu import DRAFTS_ENV

        drafts_log = Path(tempfile.mkdtemp()) / "drafts.jsonl"
        os.environ[DRAFTS_ENV] = str(drafts_log)  # the workers (this process's children) append to it
    steps_log = None
    if spec.get("record_steps"):
        from harness.shared_gpu import STEPS_ENV

        steps_log = Path(tempfile.mkdtemp()) / "steps.txt"
        os.environ[STEPS_ENV] = str(steps_log)  # the workers (this process's children) append to it
    t0 = time.time()
    llm = LLM(**spec["llm"])
    startup = time.time() - t0
    config = llm.llm_engine.vllm_config
    sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 32),
                        logprobs=spec.get("logprobs", 5))
    result = {"startup_s": startup, "runs": [],
              "quantization": config.model_config.quantization,
              "compilation_mode": str(config.compilation_config.mode),
              "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens}
    for batch in spec_batches(spec):
        t1 = time.time()
        res = llm.generate([engine_prompt(p) for p in batch], sp, use_tqdm=False)
        result["runs"].append({"outputs": request_outputs(res), "seconds": time.time() - t1})
    if drafts_log is not None:
        workers_settled(llm)
        per_rank = [_drafts_per_request(f) for f in sorted(drafts_log.parent.glob(drafts_log.name + ".*"))]
        result["drafts"] = per_rank[0] if per_rank else []
        result["drafts_ranks_agree"] = all(r == per_rank[0] for r in per_rank)
        result["drafts_ranks"] = len(per_rank)
    for action in spec.get("actions", []):
        result[action] = ACTIONS[action](llm, spec)
    if steps_log is not None:  # per rank: how many model forwards of each kind
        workers_settled(llm)
        from harness.shared_gpu import read_step_kinds, read_step_tokens

        result["step_kinds"] = read_step_kinds(steps_log)
        result["step_tokens"] = read_step_tokens(steps_log)
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


def _abort_mid_decode(llm, spec):
    """Prompts of mixed lengths (``spec["abort_decode_prompts"]``, the last one held back) decode together;
    once every one has 4 tokens, those at ``spec["abort_decode_victims"]`` are aborted (on a spread engine:
    requests that ranks own while they decode), and two steps later the held-back prompt joins the batch.
    The outputs of the requests that finished, by request id, and the step of the abort."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=spec.get("logprobs", 5))
    *prompts, late = spec["abort_decode_prompts"]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    tokens, finished, aborted_at, steps = {}, {}, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if aborted_at is None and all(tokens.get(f"r{i}", 0) >= 4 for i in range(len(prompts))):
            engine.abort_request([f"r{i}" for i in spec["abort_decode_victims"]])
            aborted_at = steps
        elif aborted_at is not None and steps == aborted_at + 2:
            engine.add_request("late", {"prompt_token_ids": late}, sp)
    if aborted_at is None or "late" not in finished:
        raise RuntimeError(f"abort_mid_decode: the requests ended before the abort or the late request: {tokens}")
    ids = sorted(finished)
    return {"ids": ids, "outputs": request_outputs([finished[i] for i in ids]), "aborted_at": aborted_at}


def _prompts_under_load(llm, spec):
    """Long prompts arriving while requests decode (with MTP: verify drafts). The chats
    (``spec["load_chats"]``, ``spec["load_chat_tokens"]`` tokens each) start first; once every chat has
    two tokens, the long prompts (``spec["load_long"]``, 16 tokens each, the first ``max_tokens=1``)
    join one every ``spec["load_gap"]`` steps. The step after the first long prompt joined (its first
    chunk computed beside the chats' rows), the chats at ``spec["load_abort"]`` are aborted. With
    ``spec["load_turns"]`` each chat that finishes asks again: its prompt, its answer and 64 tokens more
    (a second turn, which hits the prefix cache on the decoded answer where it is on). With
    ``spec["load_seeded"]`` every request samples at temperature 1 with a seed of its own. Each finished
    request's output by id, the steps, and the step the first long prompt joined at."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    seeds = iter(range(100, 10 ** 6))

    def params(max_tokens: int) -> SamplingParams:
        sampling = (dict(temperature=1.0, top_p=0.95, seed=next(seeds)) if spec.get("load_seeded")
                    else dict(temperature=0.0))
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=spec.get("logprobs", 5), **sampling)

    chats, longs = spec["load_chats"], list(spec["load_long"])
    more = prompt_ids([64] * len(chats), spec["vocab"], seed=41)
    for i, p in enumerate(chats):
        engine.add_request(f"c{i}", {"prompt_token_ids": p}, params(spec["load_chat_tokens"]))
    tokens, finished, steps, joined_at, aborted = {}, {}, 0, None, False
    while engine.has_unfinished_requests() or longs:
        for out in engine.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)
            if not out.finished:
                continue
            finished[out.request_id] = out
            kind, i = out.request_id[0], int(out.request_id[1:])
            if spec.get("load_turns") and kind == "c":
                follow = chats[i] + list(out.outputs[0].token_ids) + more[i]
                engine.add_request(f"t{i}", {"prompt_token_ids": follow}, params(spec["load_chat_tokens"]))
        steps += 1
        joined = len(spec["load_long"]) - len(longs)
        decoding = all(tokens.get(f"c{i}", 0) >= 2 for i in range(len(chats)))
        if longs and decoding and (joined_at is None or steps >= joined_at + spec["load_gap"] * joined):
            engine.add_request(f"l{joined}", {"prompt_token_ids": longs.pop(0)}, params(1 if joined == 0 else 16))
            joined_at = steps if joined_at is None else joined_at
        elif joined_at is not None and steps == joined_at + 1 and not aborted:
            engine.abort_request([f"c{i}" for i in spec["load_abort"]])
            aborted = True
    ids = sorted(finished)
    return {"ids": ids, "outputs": request_outputs([finished[i] for i in ids]), "steps": steps,
            "joined_at": joined_at}


def _max_tokens_one(llm, spec):
    """The first batch again with max_tokens=1: how many tokens each prompt got."""
    from vllm import SamplingParams

    first = spec_batches(spec)[0]
    res = llm.generate([engine_prompt(p) for p in first],
                       SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return [len(r.outputs[0].token_ids) for r in res]


def _prompt_logprobs(llm, spec):
    """``spec["prompt_logprobs_prompts"]`` with prompt_logprobs=1 and one token: per prompt, the
    logprob of each prompt token after the first (the rows a split step gathers only for these)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = spec["prompt_logprobs_prompts"]
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return [[step[t].logprob for step, t in zip(r.prompt_logprobs[1:], p[1:])]
            for r, p in zip(res, prompts)]


def compare_prompt_logprobs(ref: list[list[float]], other: list[list[float]]) -> dict:
    """The mean and the largest |difference| of the prompt tokens' logprobs, whether they are the
    same bits, and how many are NaN/Inf on either side."""
    import math

    pairs = [(a, b) for ra, rb in zip(ref, other) for a, b in zip(ra, rb)]
    lengths_agree = [len(r) for r in ref] == [len(r) for r in other]
    nonfinite = sum(not math.isfinite(x) for pair in pairs for x in pair)
    diffs = [abs(a - b) for a, b in pairs] if lengths_agree and not nonfinite else [float("inf")]
    return {"mean_logprob_diff": sum(diffs) / max(len(diffs), 1), "max_logprob_diff": max(diffs, default=0.0),
            "identical": lengths_agree and ref == other, "nonfinite": nonfinite}


def workers_settled(llm) -> None:
    """Returns once every rank has finished the steps so far. vLLM's executor takes a step's answer
    from the output rank alone, so when ``generate`` returns the other ranks may still be in their last
    step, their per-rank logs one line short; a collective call is queued behind that step on every
    rank and answered by all of them."""
    llm.collective_rpc("check_health")


def _drafts_per_request(path: Path) -> list[list[list[int]]]:
    """Each request's drafts, step by step, from the workers' log (``harness.shared_gpu``); requests
    in the order they first drafted (vLLM adds a random suffix to request ids)."""
    per_req: dict[str, list[list[int]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            for req, drafts in json.loads(line).items():
                per_req.setdefault(req, []).append(drafts)
    return list(per_req.values())


def _spec_decode_metrics(llm, spec):
    """vLLM's speculative-decoding counters so far (drafts, draft tokens, accepted tokens, accepted per
    position), as the Prometheus endpoint would report them."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "value", None) if not hasattr(m, "values") else list(m.values)
    return out


def _preemptions(llm, spec):
    """How many times vLLM's scheduler preempted a request so far (``vllm:num_preemptions``)."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def _seeded_sampling(llm, spec):
    """The first batch sampled at temperature 1 with a seed per request: the tokens."""
    from vllm import SamplingParams

    first = spec_batches(spec)[0]
    res = llm.generate([engine_prompt(p) for p in first],
                       [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=16)
                        for i in range(len(first))], use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


def _answer_prefix_hits(llm, spec):
    """Prefix hits on blocks that decoding filled: prompts ``spec["answer_prefix_short"]`` tokens short
    of a block (of the engine's block size) decode ``spec["answer_prefix_decode"]`` tokens, so decoding
    fills their first block; then each prompt with the first ``spec["answer_prefix_keep"]`` tokens of
    its answer and 8 more asks again (the hit covers the filled block), and once more after the prefix
    cache is reset (no hit). The answers, both follow-ups' outputs and their cached token counts.

    The prefix cache is reset first, so that the blocks whose states are hashed on every rank are the
    ones the answers filled (their owners' states, sent to every rank: the same bits everywhere),
    not blocks an earlier prompt filled on every rank at once (each rank its own computation: the
    same bits only where every rank's Triton autotuner picked the same kernel configs)."""
    from vllm import SamplingParams

    block = llm.llm_engine.vllm_config.cache_config.block_size
    llm.reset_prefix_cache()
    prompts = prompt_ids([block - spec["answer_prefix_short"]] * spec["answer_prefix_count"], spec["vocab"],
                         seed=31)
    greedy = dict(temperature=0.0, logprobs=spec.get("logprobs", 5))
    first = llm.generate([engine_prompt(p) for p in prompts],
                         SamplingParams(max_tokens=spec["answer_prefix_decode"], **greedy), use_tqdm=False)
    # every rank's GDN states of the blocks in the prefix cache (here: those the answers filled)
    digests = llm.collective_rpc(_cached_state_digest, args=(_cached_blocks_by_group(llm),))
    extra = prompt_ids([8], spec["vocab"], seed=32)[0]
    follow = [p + list(r.outputs[0].token_ids[: spec["answer_prefix_keep"]]) + extra for p, r in zip(prompts, first)]
    sp = SamplingParams(max_tokens=16, **greedy)
    hit = llm.generate([engine_prompt(p) for p in follow], sp, use_tqdm=False)
    llm.reset_prefix_cache()
    miss = llm.generate([engine_prompt(p) for p in follow], sp, use_tqdm=False)
    return {"block_size": block, "answers": request_outputs(first), "hit": request_outputs(hit),
            "miss": request_outputs(miss), "state_digests": digests}


def _cached_blocks_by_group(llm) -> dict[int, list[int]]:
    """The ids of the blocks in the prefix cache, by KV-cache group (the engine core in this process)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    out: dict[int, list[int]] = {}
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        for b in blocks.values() if isinstance(blocks, dict) else [blocks]:
            out.setdefault(get_group_id(key), []).append(b.block_id)
    return out


def _cached_state_digest(worker, blocks_by_group: dict[int, list[int]]) -> tuple[str, int]:
    """In a worker (``collective_rpc``): a digest of its GDN layers' conv and SSM states in the given
    blocks, and how many blocks of GDN groups that is."""
    import hashlib

    import torch
    from vllm.v1.worker import mamba_utils

    runner = worker.model_runner
    group_ids, _ = mamba_utils.get_mamba_groups(runner.kv_cache_config)
    layers = runner.compilation_config.static_forward_context
    digest, count = hashlib.sha256(), 0
    for g in group_ids:
        ids = sorted(blocks_by_group.get(g, []))
        count += len(ids)
        if not ids:
            continue
        idx = torch.tensor(ids, device=runner.device)
        for name in runner.kv_cache_config.kv_cache_groups[g].layer_names:
            for state in layers[name].kv_cache:
                digest.update(state.index_select(0, idx).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest(), count


ACTIONS = {"abort_mid_prefill": _abort_mid_prefill, "abort_mid_decode": _abort_mid_decode,
           "prompts_under_load": _prompts_under_load,
           "max_tokens_one": _max_tokens_one, "prompt_logprobs": _prompt_logprobs,
           "spec_decode_metrics": _spec_decode_metrics, "seeded_sampling": _seeded_sampling,
           "preemptions": _preemptions, "answer_prefix_hits": _answer_prefix_hits}


# ----------------------------------------------------------------------------- parent side
def checkpoint(preset: str = "tiny", fp8: bool = False) -> str:
    """The tiny random checkpoint (made once per machine, deterministic for the seed); ``fp8``: the
    same weights in the block-wise FP8 layout of the published FP8 release."""
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    path = Path(os.environ.get("QWEN36_PCP_CKPT_DIR", "/tmp/qwen36_pcp_ckpt")) / (preset + "-fp8" * fp8)
    if not (path / "config.json").exists():
        make_checkpoint(path, preset=preset, seed=0, fp8=fp8)
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
            stop_group(proc)


def cli_flags(llm_kwargs: dict) -> list[str]:
    """The ``vllm serve`` flags for ``LLM(**llm_kwargs)``'s engine arguments (``model`` aside):
    ``--key-with-dashes value``, ``--flag`` / ``--no-flag`` for booleans, JSON for dicts and lists."""
    args = []
    for key, value in llm_kwargs.items():
        if key == "model":
            continue
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args += [f"--{flag}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return args


def pcp_serve_args(ckpt: str, gpus: str, pcp: int, max_model_len: int, overrides: dict = OVERRIDES) -> list[str]:
    """``vllm serve`` arguments for our model at ``pcp`` ranks: on GPU 0 with host-memory collectives
    when the pool gave the server fewer GPUs than ranks (``on_shared_gpu`` for a server)."""
    args = [ckpt, "--hf-overrides", json.dumps(overrides), "-pcp", str(pcp),
            "--max-model-len", str(max_model_len)]
    if len(gpus.split(",")) < pcp:
        args += cli_flags(on_shared_gpu({"llm": {}})["llm"])
    return args


def post(url: str, body: dict, timeout: float = 300) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def save(name: str, data) -> None:
    (out_dir() / f"{name}.json").write_text(json.dumps(data, indent=1))


def stop_group(proc: subprocess.Popen, timeout: float = 60, drain_s: float = 30) -> int:
    """Stop a launcher started with ``start_new_session`` and everything it started: SIGTERM, up to
    ``timeout`` s for it to exit (then its group's stacks are dumped and the group killed), up to
    ``drain_s`` s for the rest of its process group (workers, multiprocessing helpers) to exit, then
    SIGKILL to whatever is left. Returns how many processes were left to kill."""
    import signal

    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc, dump=True)
    deadline = time.time() + drain_s
    while (left := _group_size(proc.pid)) and time.time() < deadline:
        time.sleep(1)
    if left:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _group_size(pgid: int) -> int:
    """Live (not zombie) processes in a process group."""
    rows = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout.splitlines()
    return sum(1 for row in rows if row.split()[:1] == [str(pgid)] and not row.split()[1].startswith("Z"))


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


# a failed engine's rendezvous error when an engine starting beside it took its free port (``engine``)
PORT_TAKEN = re.compile(r"DistNetworkError: .*failed to listen.*EADDRINUSE")


def engine(spec: dict, timeout: float = 420, name: str = "engine", gpus: str | None = None) -> dict:
    """Run one engine spec in a child process; raises with the log tail if it fails or hangs.

    With QWEN36_PCP_REUSE=DIR, a result saved earlier as DIR/<name>.json is used instead when the
    same spec, checkpoint, code and stack made it (``fingerprint``): a long run spread over several
    runs (``jobs`` below).
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
        t0, restarts = time.time(), 0
        for attempt in range(2):
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
            # engines starting side by side can take the same free port for their ranks' rendezvous:
            # the one that lost it starts again (nothing ran yet), its first log kept beside
            if proc.returncode == 0 or attempt or not PORT_TAKEN.search(log_path.read_text()):
                break
            _kill_group(proc, dump=False)
            log_path.replace(log_path.with_suffix(".1.log"))
            restarts += 1
            print(f"[engine] {name}: its rendezvous port was taken, starting again", flush=True)
        if proc.returncode != 0 or not out_path.exists():
            raise AssertionError(f"{name}: exit code {proc.returncode}\n" + log_path.read_text()[-6000:])
        result = json.loads(out_path.read_text())
        result["wall_s"], result["restarts"] = time.time() - t0, restarts
        result["made_by"] = made_by
        save(name, result)
        return result


# package files that cannot change an engine's answers (the checkpoint maker: its output is hashed)
NOT_IN_FINGERPRINT = ("qwen36_pcp/tools/",)
# the test-side code that runs inside engines
ENGINE_SIDE = ("tests/media.py", "tests/gpu/e2e.py", "harness/shared_gpu.py", "tests/gpu/layer_dump.py")


def fingerprint(spec: dict) -> dict:
    """What an engine's result depends on: its spec, the checkpoint's bytes, this package's code (the
    checkpoint maker aside) and the test code that runs in engines, the GDN setting, the software and
    GPU. A saved result is reused only where all of it matches."""
    import hashlib
    import importlib.metadata as md

    import torch

    code = hashlib.sha256()
    paths = [p for p in (REPO / "qwen36_pcp").rglob("*.py")
             if not str(p.relative_to(REPO)).startswith(NOT_IN_FINGERPRINT)]
    for path in sorted([*paths, *(REPO / name for name in ENGINE_SIDE)]):
        code.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    model = Path(spec.get("llm", {}).get("model", ""))
    ckpt = hashlib.sha256()
    for path in sorted(model.glob("*.json")) + sorted(model.glob("*.safetensors")) if model.is_dir() else []:
        ckpt.update(path.name.encode() + b"\0" + path.read_bytes())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return {"spec": hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16],
            "code": code.hexdigest()[:16], "checkpoint": ckpt.hexdigest()[:16],
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


SHARED_WORKER = "harness.shared_gpu.SharedGPUWorker"
SHARED_UTILIZATION, SHARED_KV_BYTES = 0.2, 4 << 30  # per engine on the shared GPU
SHARED_GPU_ENV = "QWEN36_PCP_SHARED_GPU"
# ranks of all engines running at once on the shared GPU (each rank is a process on GPU 0)
SHARED_RANKS = int(os.environ.get("QWEN36_PCP_SHARED_RANKS", "12"))


def shared_gpu_mode(max_ranks: int) -> bool:
    """Every engine on GPU 0 (``shared_gpu``) when the machine has fewer GPUs than the largest layout
    needs; ``QWEN36_PCP_SHARED_GPU=1``/``0`` forces it on or off."""
    import torch

    forced = os.environ.get(SHARED_GPU_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return torch.cuda.device_count() < max_ranks


def on_shared_gpu(spec: dict) -> dict:
    """The engine spec with every worker on GPU 0, collectives through host memory, a fixed KV cache
    (memory profiling cannot tell several processes on one GPU apart; a spec may set a smaller one)."""
    import copy

    spec = copy.deepcopy(spec)
    spec["llm"] = {"kv_cache_memory_bytes": SHARED_KV_BYTES, **spec["llm"], "worker_cls": SHARED_WORKER,
                   "distributed_executor_backend": "mp", "gpu_memory_utilization": SHARED_UTILIZATION}
    return spec


def engines(jobs: dict, timeout: float = 480, shared: bool = False) -> dict:
    """Run several jobs in order (first in, first started), side by side when they fit.

    jobs: {name: (spec or callable, number of ranks)}. A spec runs through ``engine``; a callable is
    called with the CUDA_VISIBLE_DEVICES string. On GPUs of their own, a job takes as many GPUs as it
    has ranks; with ``shared`` every job runs on GPU 0 and jobs run together up to ``SHARED_RANKS``
    ranks. Returns {name: result, or the exception it raised}.
    """
    import threading

    import torch

    total = torch.cuda.device_count()
    free = list(range(total))
    busy = [0]  # ranks running on the shared GPU
    cond = threading.Condition()
    results = {}
    queue = [name for name in jobs if shared or jobs[name][1] <= total]
    for name in set(jobs) - set(queue):
        results[name] = AssertionError(f"{name} needs {jobs[name][1]} GPUs, the machine has {total}")

    def fits(n):
        return (busy[0] == 0 or busy[0] + n <= SHARED_RANKS) if shared else len(free) >= n

    def run(name, job, n):
        with cond:
            cond.wait_for(lambda: queue[0] == name and fits(n))
            queue.pop(0)
            gpus = [0] if shared else [free.pop(0) for _ in range(n)]
            busy[0] += n if shared else 0
            cond.notify_all()
        visible = ",".join(map(str, gpus))
        t0 = time.time()
        try:
            if callable(job):
                results[name] = job(visible)
            else:
                results[name] = engine(on_shared_gpu(job) if shared else job, timeout, name, visible)
        except BaseException as e:  # noqa: BLE001 - handed to the test that owns the job
            results[name] = e
        finally:
            print(f"[pool] {name} on GPUs {visible}: {time.time() - t0:.0f} s", flush=True)
            with cond:
                if shared:
                    busy[0] -= n
                else:
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
    """vLLM's check_logprobs_close rule per prompt, plus the largest |logprob difference| over the
    shared prefix. Not ok as well: a different number of prompts, a prompt whose tokens agree but
    whose length differs, and any NaN/Inf logprob (``nonfinite`` counts them on either side)."""
    import math

    if len(ref) != len(other):
        return {"ok": False, "max_logprob_diff": float("inf"), "diverged_at": [],
                "nonfinite": 0, "error": f"{len(ref)} prompts vs {len(other)}"}
    ok, max_diff, diverged, nonfinite = True, 0.0, [], 0
    for i, (a, b) in enumerate(zip(ref, other)):
        nonfinite += sum(not math.isfinite(lp) for side in (a, b) for step in side["logprobs"]
                         for lp in step.values())
        for step, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"])):
            la, lb = a["logprobs"][step], b["logprobs"][step]
            if ta != tb:
                diverged.append((i, step))
                if str(ta) not in lb or str(tb) not in la:
                    ok = False
                break
            max_diff = max(max_diff, abs(la[str(ta)] - lb[str(tb)]))
        else:
            ok &= len(a["token_ids"]) == len(b["token_ids"])
    return {"ok": ok and nonfinite == 0, "max_logprob_diff": max_diff, "diverged_at": diverged,
            "nonfinite": nonfinite}


def marked_jobs(marks) -> dict:
    """The engine jobs that ``engine_jobs(builder=fn)`` marks declare."""
    jobs = {}
    for mark in marks:
        if mark.name == "engine_jobs":
            jobs.update(mark.kwargs["builder"]())
    return jobs


def module_jobs(module) -> dict:
    """The engine jobs of a test module's tests."""
    return marked_jobs(m for fn in vars(module).values() for m in getattr(fn, "pytestmark", []))


def run_jobs(jobs: dict, timeout: float = 480) -> dict:
    """``engines`` on this machine: on GPUs of their own when it has enough, else on the shared GPU."""
    shared = shared_gpu_mode(max((n for _, n in jobs.values()), default=1))
    print(f"[pool] {len(jobs)} jobs, {'all on GPU 0 (shared)' if shared else 'one GPU per rank'}", flush=True)
    return engines(jobs, timeout, shared=shared)


def main(argv):
    if argv[0] == "engine":
        spec = json.loads(Path(argv[1]).read_text())
        result = run_engine(spec)
        Path(argv[2]).write_text(json.dumps(result))
        return 0
    if argv[0] == "jobs":  # python -m tests.gpu.e2e jobs tests.gpu.test_pcp_e2e [SUFFIX ...]
        import importlib

        jobs = module_jobs(importlib.import_module(argv[1]))
        jobs = {k: v for k, v in jobs.items() if k.endswith(tuple(argv[2:]) or "")}
        failed = {k: r for k, r in run_jobs(jobs).items() if isinstance(r, BaseException)}
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
