# SPDX-License-Identifier: Apache-2.0
"""The GPU tests' engine harness on the CPU: QWEN36_PCP_REUSE takes a saved engine result only if the
same spec, code and stack made it; every spec runs through ``run_engine``; an engine child that lost
its rendezvous port starts again once."""

import json
from pathlib import Path

import pytest

from tests.gpu import e2e


def test_reuse_only_what_the_same_spec_code_and_stack_made(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN36_PCP_REUSE", str(tmp_path))
    spec = {"llm": {"model": "m", "max_num_batched_tokens": 2048}, "prompts": [[11, 12]]}
    made_by = e2e.fingerprint(spec)
    (tmp_path / "job.json").write_text(json.dumps({"runs": ["saved"], "made_by": made_by}))
    (tmp_path / "unmarked.json").write_text(json.dumps({"runs": ["saved"]}))  # from before fingerprints

    assert e2e._reused("job", made_by)["runs"] == ["saved"]
    assert e2e._reused("job", e2e.fingerprint({**spec, "prompts": [[11, 13]]})) is None
    assert e2e._reused("job", {**made_by, "code": "0" * 16}) is None
    assert e2e._reused("job", {**made_by, "stack": "vllm 0.20.1"}) is None
    monkeypatch.setenv("QWEN36_PCP_DETERMINISTIC_GDN", "0")
    assert e2e._reused("job", e2e.fingerprint(spec)) is None
    assert e2e._reused("unmarked", made_by) is None
    assert e2e._reused("missing", made_by) is None


def test_layout_jobs_cover_every_layout_and_engine():
    from tests.gpu import test_pcp_e2e as t

    jobs = e2e.module_jobs(t)
    compiled = {f"compiled_{lay}" for lay in t.COMPILED_LAYOUTS}
    assert {f"{e}_{lay}" for e in t.ENGINES for lay in t.LAYOUTS} | {"serve_pcp2"} | compiled == set(jobs)
    assert "enforce_eager" not in jobs["compiled_pcp2"][0]["llm"] and jobs["defaults_pcp2"][0]["llm"]["enforce_eager"]
    ranks = {name: n for name, (_, n) in jobs.items()}
    assert ranks["defaults_pcp8"] == 8 and ranks["chunked_tp2_pcp2"] == 4 and ranks["defaults_pcp1"] == 1
    for name, (spec, n) in jobs.items():
        if name != "serve_pcp2":
            llm = spec["llm"]
            assert llm["tensor_parallel_size"] * llm["prefill_context_parallel_size"] == n
    assert set(t.REFERENCE) == set(t.LAYOUTS) - {"pcp1", "tp2"} and set(t.START_ORDER) == set(t.LAYOUTS)
    assert {case for case, (engine, _) in t.CASE_RUNS.items()} == {c for cs in t.ENGINES.values() for c in cs}


def _out(tokens, lp=-0.5, finish="length"):
    return {"token_ids": tokens, "logprobs": [{str(t): lp, "999": lp - 1} for t in tokens],
            "finish_reason": finish}


def test_compare_rules():
    a = [_out([1, 2, 3]), _out([4, 5])]
    assert e2e.compare(a, a)["ok"] and e2e.compare(a, a)["max_logprob_diff"] == 0
    assert not e2e.compare(a, a[:1])["ok"]  # a prompt missing
    assert not e2e.compare(a, [a[0], _out([4])])["ok"]  # same tokens, one fewer
    assert not e2e.compare(a, [a[0], _out([4, 5], lp=float("nan"))])["ok"]  # NaN logprobs
    swapped = [_out([1, 999, 3]), a[1]]  # diverges to a token in the other's top-5: rule (a) holds
    swapped[0]["logprobs"][1]["2"] = -0.6
    c = e2e.compare(a, swapped)
    assert c["ok"] and c["diverged_at"] == [(0, 1)]
    assert not e2e.compare(a, [_out([1, 7, 3]), a[1]])["ok"]  # a token outside the top-5
    assert e2e.compare(a, [_out([1, 2, 3], lp=-0.75), a[1]])["max_logprob_diff"] == 0.25
    # prompt logprobs: the same bits, the mean and largest difference, NaN, a prompt cut short
    p = [[-1.0, -2.0, -3.0], [-4.0]]
    assert e2e.compare_prompt_logprobs(p, p) == {"mean_logprob_diff": 0.0, "max_logprob_diff": 0.0,
                                                 "identical": True, "nonfinite": 0}
    c = e2e.compare_prompt_logprobs(p, [[-1.0, -2.5, -3.0], [-4.5]])
    assert (c["mean_logprob_diff"], c["max_logprob_diff"], c["identical"]) == (0.25, 0.5, False)
    assert e2e.compare_prompt_logprobs(p, [[-1.0, float("nan"), -3.0], [-4.0]])["nonfinite"] == 1
    assert e2e.compare_prompt_logprobs(p, [[-1.0, -2.0], [-4.0]])["mean_logprob_diff"] == float("inf")


def test_every_engine_spec_runs_through_run_engine(monkeypatch, tmp_path):
    """Each engine job's spec through ``run_engine`` against a stand-in for vLLM's LLM: every batch
    and every action finds what it needs in the spec (a missing key would only show on a GPU)."""
    import sys
    import types

    from tests.gpu import test_pcp_e2e as t

    class Output:
        def __init__(self, n):
            self.token_ids, self.text, self.finish_reason = list(range(n)), "x", "length"
            self.logprobs = [{i: types.SimpleNamespace(logprob=-0.5)} for i in range(n)]

    class Engine:
        def __init__(self, kw):
            self.pending, self.engine_core = {}, types.SimpleNamespace(shutdown=lambda: None)
            self.vllm_config = types.SimpleNamespace(
                model_config=types.SimpleNamespace(quantization=kw.get("quantization")),
                compilation_config=types.SimpleNamespace(mode=0 if kw.get("enforce_eager") else 3),
                scheduler_config=types.SimpleNamespace(max_num_batched_tokens=16384))

        def add_request(self, rid, prompt, sp):
            assert prompt["prompt_token_ids"]
            # steps run, its prefill's steps (one per 1000 prompt tokens begun), tokens wanted
            self.pending[rid] = [0, 1 + len(prompt["prompt_token_ids"]) // 1000, sp.max_tokens]

        def has_unfinished_requests(self):
            return bool(self.pending)

        def step(self):  # vLLM's cumulative outputs: one token per step from the prefill's last step on
            outs = []
            for rid, req in list(self.pending.items()):
                req[0] += 1
                tokens = req[0] - req[1] + 1
                if tokens > 0:
                    outs.append(types.SimpleNamespace(request_id=rid, finished=tokens == req[2], num_cached_tokens=0,
                                                      outputs=[Output(tokens)]))
                if tokens == req[2]:
                    del self.pending[rid]
            return outs

        def abort_request(self, ids):
            for rid in ids:
                self.pending.pop(rid, None)

    class LLM:
        def __init__(self, **kw):
            assert kw["model"] and kw["hf_overrides"]
            self.llm_engine = Engine(kw)

        def generate(self, prompts, sp, use_tqdm=False):
            assert all(p["prompt_token_ids"] for p in prompts)
            logprob = types.SimpleNamespace(logprob=-1.0)

            def prompt_logprobs(ids):  # vLLM's shape: None for the first token, then {token: Logprob}
                if not getattr(sp, "prompt_logprobs", None):
                    return None  # as vLLM: only when the sampling parameters ask for them
                return [None] + [{t: logprob} for t in ids[1:]]
            return [types.SimpleNamespace(outputs=[Output(sp.max_tokens)], num_cached_tokens=0,
                                          prompt_logprobs=prompt_logprobs(p["prompt_token_ids"]))
                    for p in prompts]

    fake = types.ModuleType("vllm")
    fake.LLM = LLM
    fake.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 8192}}))
    monkeypatch.setattr(e2e, "checkpoint", lambda preset="tiny", fp8=False: str(tmp_path))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    from tests.gpu import test_decode_spread_e2e as spread
    from tests.gpu import test_fp8_gpu

    specs = {**t.layout_jobs(), **t.compiled_jobs(), **test_fp8_gpu.fp8_jobs(),
             "spread_main": spread.spread_jobs()["spread_main_pcp2"]}
    results = {}
    for name, (spec, _) in specs.items():
        result = results[name] = e2e.run_engine(spec)
        assert len(result["runs"]) == len(spec["batches"]), name
        for action in spec.get("actions", []):
            assert action in result, (name, action)
        if "max_tokens_one" in spec.get("actions", []):
            assert result["max_tokens_one"] == [1] * len(spec["batches"][0])
            assert result["abort_mid_prefill"]["finished"] == {"survivor": 8}
    # aborted once every request had 4 tokens (the 5000-token prompt's 6 prefill steps, then 4 tokens),
    # the held-back prompt in two steps later
    abort = results["spread_main"]["abort_mid_decode"]
    assert abort["aborted_at"] == 9 and abort["ids"] == ["late", "r0", "r2", "r3", "r5", "r6", "r7"], abort
    assert all(len(o["token_ids"]) == 24 for o in abort["outputs"])


def test_serve_prompts_fit_the_servers_context(tmp_path):
    from tokenizers import Tokenizer

    from qwen36_pcp.tools.make_checkpoint import make_checkpoint
    from tests.gpu import test_pcp_e2e as t

    ckpt = make_checkpoint(tmp_path / "tiny", preset="tiny", seed=0, config_only=True)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    lengths = [len(tok.encode(p).ids) for p in t.serve_prompts()]
    assert len(lengths) == 64 and max(lengths) + t.SERVE_MAX_TOKENS <= t.SERVE_MAX_MODEL_LEN, max(lengths)
    assert max(lengths) > 8192 > min(lengths)  # mixed lengths, some long


def test_an_engine_that_lost_its_rendezvous_port_starts_again_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.delenv("QWEN36_PCP_REUSE", raising=False)
    port_taken = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                  "network address. port: 38307, useIpv6: false, code: -98, name: EADDRINUSE\n")
    starts, killed, failures = [], [], []

    class Child:  # the engine child: it fails with the next of ``failures`` while any are left
        def __init__(self, argv, stdout, **kw):
            starts.append(argv)
            self.returncode = 1 if failures else 0
            if failures:
                stdout.write(failures.pop(0))
            else:
                Path(argv[-1]).write_text(json.dumps({"runs": []}))

        def wait(self, timeout=None):
            return self.returncode

    monkeypatch.setattr(e2e.subprocess, "Popen", Child)
    monkeypatch.setattr(e2e, "_kill_group", lambda proc, dump: killed.append(proc))

    def run(*fail):
        starts.clear(), killed.clear()
        failures[:] = fail
        return e2e.engine({"llm": {}}, name="racer")

    # lost the port once: its group stopped, its log kept, started again
    assert run(port_taken)["restarts"] == 1 and len(starts) == 2 and len(killed) == 1
    assert "EADDRINUSE" in (tmp_path / "racer.1.log").read_text()
    # lost it twice: once more only
    with pytest.raises(AssertionError, match="racer: exit code 1"):
        run(port_taken, port_taken)
    assert len(starts) == 2
    # any other failure, even one naming the same errno elsewhere: not started again
    with pytest.raises(AssertionError, match="racer: exit code 1"):
        run("RuntimeError: CUDA out of memory (the NCCL socket said EADDRINUSE earlier)\n", port_taken)
    assert len(starts) == 1 and not killed
