"""QWEN36_PCP_REUSE takes a saved engine result only if the same spec, code and stack made it."""

import json

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


def test_jobs_that_fit_one_gpu_are_the_pcp1_baselines():
    from tests.gpu import test_pcp_e2e

    one = e2e.module_jobs(test_pcp_e2e, 1)
    assert sorted(one) == ["case1_unequal_batch_pcp1", "case2_3_pcp1", "case2_3_pcp1_chunk4096",
                           "case3_repeat_pcp1"]
    two = e2e.module_jobs(test_pcp_e2e, 2)
    assert set(one) < set(two)
    assert {"case1_unequal_batch_pcp2", "case1_unequal_batch_tp2", "serve_pcp2"} <= set(two)
    assert all(spec["llm"]["prefill_context_parallel_size"] == 1 for spec, _ in one.values())
