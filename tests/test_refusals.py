# SPDX-License-Identifier: Apache-2.0
"""What the plugin refuses before an engine exists: the engine and the doctor refuse the same things
in the same words, and an uncaught refusal ends a program with its message alone and exit code 1.

One table of configurations drives both sides: the engine's (a real ``VllmConfig`` built on
``tests.fake_cuda``'s platform, every startup check ours included) and the doctor's (``python -m
qwen36_pcp doctor`` on the same checkpoint, GPUs faked). The doctor's problem lines, joined as
``checks.validate_pcp_config`` joins them, must be the engine's message exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from qwen36_pcp import doctor, refusal
from qwen36_pcp.__main__ import main
from qwen36_pcp.config import PCPConfig

ARCH = "Qwen3_6ForCausalLM"
OVERRIDES = {"architectures": [ARCH]}
MTP = {"method": "mtp", "num_speculative_tokens": 1}
H200 = doctor.Gpu("NVIDIA H200", (9, 0), 141 * 2**30)

# (name, the qwen36_pcp options, further engine arguments, words the refusal holds): a bad value of
# every option (one row per PCPConfig field, so that a new option gets its row), then the rest
REFUSED = [
    *((f"bad_{f.name}", {f.name: "bogus" if isinstance(f.default, str) else 0}, {}, f"{f.name} must be")
      for f in dataclasses.fields(PCPConfig)),
    ("unknown_option", {"layuot": "zigzag"}, {}, "unknown option(s) ['layuot']"),
    ("options_not_an_object", "relay", {}, "must be a JSON object of options, got 'relay'"),
    ("spread_sharded_experts", {"decode": "spread", "moe_experts": "sharded"}, {},
     "decode='spread' together with moe_experts='sharded'"),
    ("spread_mtp_prefix_caching", {"decode": "spread"}, {"speculative_config": MTP, "enable_prefix_caching": True},
     "decode='spread' together with speculative decoding and prefix caching"),
    ("spread_sharded_mtp_prefix_caching", {"decode": "spread", "moe_experts": "sharded"},
     {"speculative_config": MTP, "enable_prefix_caching": True}, "; decode='spread' together with moe_experts"),
    ("ngram", {}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                          "prompt_lookup_min": 1}}, "speculative decoding method 'ngram'"),
    ("mtp_draft_tp", {}, {"tensor_parallel_size": 2, "speculative_config": {**MTP, "draft_tensor_parallel_size": 1}},
     "draft_tensor_parallel_size=1"),
]
# what both accept
ACCEPTED = [
    ("defaults", {}, {}),
    ("spread", {"decode": "spread"}, {}),
    ("sharded", {"moe_experts": "sharded"}, {}),
    ("spread_mtp", {"decode": "spread"}, {"speculative_config": MTP, "enable_prefix_caching": False}),
    ("others", {"layout": "contiguous", "gdn_mode": "state_passing", "min_split_tokens": 8192}, {}),
]


def doctor_argv(kwargs: dict) -> list[str]:
    """The doctor's arguments for these engine arguments (every one must have its flag)."""
    flags = {"tensor_parallel_size": lambda v: ["--tp", str(v)],
             "speculative_config": lambda v: ["--speculative-config", json.dumps(v)],
             "enable_prefix_caching": lambda v: ["--enable-prefix-caching" if v else "--no-enable-prefix-caching"]}
    return [a for key, value in kwargs.items() for a in flags[key](value)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", config_only=True))


def _engine(ckpt, rows):
    """Each row's engine config at pcp=2: the refusal's type and message, or the doctor's stand-in
    compared with the real config where the engine accepts it."""
    from tests.fake_cuda import engine_config, use_fake_cuda

    use_fake_cuda()
    import qwen36_pcp

    qwen36_pcp.register()
    from qwen36_pcp import patches

    out = {"hook": sys.excepthook is refusal.excepthook}
    for name, options, kwargs in rows:
        try:
            cfg = engine_config(ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2,
                                additional_config={"qwen36_pcp": options}, **kwargs)
        except Exception as e:  # noqa: BLE001 - the refusal is what is tested
            out[name] = (type(e).__name__, isinstance(e, refusal.ConfigRefusal), isinstance(e, ValueError), str(e))
            continue
        with open(Path(ckpt) / "config.json", encoding="utf-8") as f:
            like = doctor.engine_config_like(json.load(f), kwargs.get("tensor_parallel_size", 1), 2,
                                             cfg.additional_config, kwargs.get("speculative_config"),
                                             bool(kwargs.get("enable_prefix_caching")),
                                             cfg.cache_config.gpu_memory_utilization)
        out[name] = differences(like, cfg)
    patches.uninstall()
    out["hook_after_uninstall"] = sys.excepthook is refusal.excepthook
    return out


# what the plugin's config hook sets after its checks ran: the stand-in has the value they saw
SET_AFTER_THE_CHECKS = {("config.parallel_config", "worker_cls"): ("auto", "qwen36_pcp.worker.PCPWorker")}


def differences(like, real, where="config") -> list[str]:
    """Where the doctor's stand-in says another value than the real config (the model's config.json
    fields excepted: both read the same file; ``additional_config``: ours may add keys)."""
    out = []
    for name, value in vars(like).items():
        if where == "config.model_config" and name in ("hf_text_config", "hf_config", "dtype"):
            continue  # read from config.json itself
        if where.endswith("speculative_config") and name == "draft_model_config":
            value, real_value = value.hf_config.architectures, real.draft_model_config.hf_config.architectures
        else:
            real_value = getattr(real, name)
        if hasattr(value, "__dict__") and real_value is not None:
            out += differences(value, real_value, f"{where}.{name}")
        elif value != real_value and not (name == "additional_config" and value.items() <= real_value.items()) \
                and SET_AFTER_THE_CHECKS.get((where, name)) != (value, real_value):
            out.append(f"{where}.{name}: {value!r} here, {real_value!r} in vLLM")
    return out


def run_doctor(argvs: list[list[str]], gpus: list) -> list[tuple[int, list[str]]]:
    """``python -m qwen36_pcp doctor ARGV`` for each, with these GPUs: exit code and lines. Run in a process
    of its own (``--speculative-config`` imports vLLM's config modules, which bind the platform there)."""
    import contextlib
    import io

    os.environ.pop("VLLM_PLUGINS", None)
    doctor.visible_gpus = lambda: list(gpus)
    out = []
    for argv in argvs:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            rc = main(["doctor", *argv])
        out.append((rc, text.getvalue().splitlines()))
    return out


def test_the_doctor_refuses_what_the_engine_refuses(ckpt, fake_cuda_ranks):
    rows = [(name, options, kwargs) for name, options, kwargs, _ in REFUSED] + ACCEPTED
    engine = fake_cuda_ranks.isolated(_engine, ckpt, rows)
    assert engine.pop("hook") and not engine.pop("hook_after_uninstall")
    told = iter(fake_cuda_ranks.isolated(run_doctor, [
        [ckpt, "--pcp", "2", "--additional-config", json.dumps({"qwen36_pcp": options}), *doctor_argv(kwargs)]
        for _, options, kwargs in rows], [H200] * 4))
    for name, options, kwargs, words in REFUSED:
        kind, is_refusal, is_value_error, message = engine[name]
        # the refusal itself, not pydantic's ValidationError around it (still a ValueError for callers)
        assert kind == "ConfigRefusal" and is_refusal and is_value_error, (name, kind)
        assert words in message, (name, message)
        tp = kwargs.get("tensor_parallel_size", 1)
        rc, lines = next(told)
        assert rc == 1, (name, lines)
        found = [s.removeprefix("PROBLEM options: ").removeprefix("PROBLEM -pcp 2 does not support ")
                 for s in lines if s.startswith(("PROBLEM options: ", "PROBLEM -pcp 2 does not support "))]
        assert len(found) == sum(s.startswith("PROBLEM") for s in lines), (name, lines)  # nothing else is one
        if len(found) == 1 and found[0].startswith("qwen36_pcp: "):  # a bad value: refused before the config
            assert message == found[0], (name, message, lines)
        else:
            assert message == (f"qwen36_pcp: prefill_context_parallel_size=2 with {ARCH} does not support: "
                               + "; ".join(found) + "."), (name, message, lines)
        assert f"-tp {tp} x -pcp 2 needs {2 * tp}" in "\n".join(lines)
    for name, options, kwargs in ACCEPTED:
        assert engine[name] == [], (name, engine[name])  # the doctor's stand-in is the engine's config
        rc, lines = next(told)
        assert rc == 0, (name, lines)


# ------------------------------------------------------------------------ how a refusal ends
def test_an_uncaught_refusal_is_its_message_alone(capsys, monkeypatch):
    import pydantic

    seen = []
    monkeypatch.setattr(refusal, "_previous_hook", lambda *exc: seen.append(exc[1]))
    monkeypatch.setattr(refusal, "_active", True)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)

    @pydantic.dataclasses.dataclass
    class Checked:  # as vLLM's VllmConfig runs our config check
        x: int = 0

        def __post_init__(self):
            raise refusal.ConfigRefusal("qwen36_pcp: refused, because")

    try:
        Checked()
    except ValueError as e:
        wrapped = e
    assert type(wrapped).__name__ == "ValidationError" and str(refusal.refusal_in(wrapped)) == \
        "qwen36_pcp: refused, because"
    for exc in (refusal.MachineRefusal("qwen36_pcp: no GPU"), wrapped):
        refusal.excepthook(type(exc), exc, None)
    assert capsys.readouterr().err == "qwen36_pcp: no GPU\nqwen36_pcp: refused, because\n" and not seen
    other = ValueError("not ours")
    refusal.excepthook(ValueError, other, None)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the traceback, for whoever debugs the plugin
    refusal.excepthook(type(wrapped), wrapped, None)
    assert seen == [other, wrapped] and capsys.readouterr().err == ""


def test_the_hook_goes_back():
    before = sys.excepthook
    try:
        refusal.install_excepthook()
        refusal.install_excepthook()  # idempotent
        assert sys.excepthook is refusal.excepthook and refusal._previous_hook is before
        refusal.uninstall_excepthook()
        assert sys.excepthook is before and not refusal._active
    finally:
        refusal.uninstall_excepthook()
        sys.excepthook = before


def _llm_refused(ckpt):
    """``LLM(...)`` refused by our config check, and what the hook the plugin installed prints for it."""
    import contextlib
    import io

    from tests.fake_cuda import use_fake_cuda

    use_fake_cuda()
    from vllm import LLM

    try:
        LLM(model=ckpt, hf_overrides=OVERRIDES, prefill_context_parallel_size=2,
            additional_config={"qwen36_pcp": {"decode": "spread", "moe_experts": "sharded"}})
    except BaseException as e:  # noqa: BLE001 - what ends the program is what is tested
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            sys.excepthook(type(e), e, e.__traceback__)  # what Python calls before it exits with 1
        return type(e).__name__, err.getvalue()
    return None


def test_llm_refusal_is_one_line(ckpt, fake_cuda_ranks):
    """``LLM(...)`` in a script: our config check's refusal (raised inside pydantic's validation), uncaught,
    is one line on stderr, without a traceback (the interpreter then exits with 1)."""
    kind, err = fake_cuda_ranks.isolated(_llm_refused, ckpt)
    assert kind == "ConfigRefusal" and "Traceback" not in err and len(err.splitlines()) == 1, (kind, err)
    assert err.startswith(f"qwen36_pcp: prefill_context_parallel_size=2 with {ARCH} does not support: "
                          "decode='spread' together with moe_experts='sharded'"), err
