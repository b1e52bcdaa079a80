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
