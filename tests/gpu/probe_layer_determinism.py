"""Which module makes a repeated prefill differ? (diagnostic, 1 GPU)

    python -m tests.gpu.probe_layer_determinism [--lengths 2049 4097 16384] [--repeats 3]
        [--preset tiny] [--llm-kwargs '{"async_scheduling": false}']

One engine in this process (pcp=1, eager). Each prompt runs ``--repeats`` times with a forward hook
on every module that fingerprints its input and output on prefill-sized calls, then as many times
without hooks (the hooks synchronise the GPU on every module, which would hide a race). For every
repeat it prints whether the outputs equal the first run's and, with hooks, the first modules (in
call order) whose output differs: one whose input was identical is where the difference starts.
The GDN kernels inside vLLM's custom op (no module of their own) are wrapped the same way (WRAPPED):
the first call whose output differs while all its inputs are identical is the culprit
(``probe_gdn_kernels`` then runs it alone).
It found vLLM 0.20.2's ``chunk_scaled_dot_kkt_fwd`` (2026-12-01); prefix the command with
QWEN36_PCP_DETERMINISTIC_GDN=1 to run with the workaround (``runner_hooks.race_free_gdn_kkt``).
"""

import argparse
import hashlib
import importlib
import json
import os
import sys

from . import e2e

MIN_TOKENS = 64  # calls with fewer rows are decode steps
MAX_FINGERPRINT_BYTES = 1 << 28  # the whole state caches are passed too: skip those
WRAPPED = {  # module: functions called through its globals in the GDN prefill path
    "vllm.model_executor.layers.mamba.gdn_linear_attn":
        ("causal_conv1d_fn", "fused_post_conv_prep", "fla_chunk_gated_delta_rule"),
    "vllm.model_executor.layers.fla.ops.chunk":
        ("chunk_local_cumsum", "chunk_scaled_dot_kkt_fwd", "solve_tril", "recompute_w_u_fwd",
         "chunk_gated_delta_rule_fwd_h", "chunk_fwd_o"),
}
CALLS: list = []  # (name, input fingerprints, output fingerprints) of wrapped calls


def _digest(t) -> str:
    import torch

    return hashlib.blake2b(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes(),
                           digest_size=8).hexdigest()


def _fingerprint(x):
    """A module's first tensor, on prefill-sized calls only."""
    import torch

    if isinstance(x, (tuple, list)):
        x = next((t for t in x if isinstance(t, torch.Tensor)), None)
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] < MIN_TOKENS:
        return None
    return _digest(x)


def _value_fp(x):
    """Any argument or result of a wrapped call: tensors by digest, small values by repr."""
    import torch

    if isinstance(x, torch.Tensor):
        return "big" if x.numel() * x.element_size() > MAX_FINGERPRINT_BYTES else _digest(x)
    if isinstance(x, (tuple, list)):
        return [_value_fp(t) for t in x]
    return repr(x) if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__


def _wrap_functions():
    for mod_name, names in WRAPPED.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            fn, label = getattr(mod, name), f"{mod_name.rsplit('.', 1)[-1]}.{name}"

            def wrapper(*args, _fn=fn, _label=label, **kwargs):
                ins = _value_fp([*args, *kwargs.values()])
                out = _fn(*args, **kwargs)
                CALLS.append((_label, ins, _value_fp(out)))
                return out

            setattr(mod, name, wrapper)


def _install_hooks(model):
    """Hooks on every named module; records (name, input fp, output fp) per prefill-sized call."""
    model._probe_log, model._probe_handles = [], []

    def hook(module, args, output):
        out = _fingerprint(output)
        if out is not None:
            model._probe_log.append((module._probe_name, [_fingerprint(args)], out))

    for name, module in model.named_modules():
        module._probe_name = name
        model._probe_handles.append(module.register_forward_hook(hook))
    return len(model._probe_handles)


def _take_log(model):
    log, model._probe_log = model._probe_log, []
    return log


def _remove_hooks(model):
    for h in model._probe_handles:
        h.remove()
    return len(model._probe_handles)


def _first_differences(ref, other, limit=3):
    """First entries (call order) of two logs of (name, input fps, output fp) whose output differs,
    with the positions of the inputs that differed (or were not fingerprinted): an entry whose
    inputs all agree is where the difference starts."""
    if [r[0] for r in ref] != [o[0] for o in other]:
        return [{"at": "<call sequence differs>"}]
    found = []
    for (name, ref_in, ref_out), (_, in_, out) in zip(ref, other):
        if out != ref_out:
            found.append({"at": name, "inputs_differing": [
                i for i, (x, y) in enumerate(zip(ref_in, in_)) if x != y or x is None]})
            if len(found) == limit:
                break
    return found


def main(args) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _wrap_functions()
    ckpt = e2e.checkpoint(args.preset)
    llm = LLM(**e2e.base_llm_kwargs(ckpt, max_model_len=17000, enforce_eager=True,
                                    **args.llm_kwargs))
    sp = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5)
    prompts = e2e.prompt_ids(args.lengths, vocab=e2e.vocab_size(ckpt), seed=2)

    def generate(p):
        return e2e.request_outputs(llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False))

    report = {"preset": args.preset, "llm_kwargs": args.llm_kwargs, "prompts": []}
    for hooked in (True, False):
        if hooked:
            print(f"hooks on {llm.apply_model(_install_hooks)[0]} modules", flush=True)
        for p in prompts:
            runs, logs, calls = [], [], []
            for _ in range(args.repeats):
                CALLS.clear()
                runs.append(generate(p))
                calls.append(list(CALLS))
                if hooked:
                    logs.append(llm.apply_model(_take_log)[0])
            row = {"tokens": len(p), "hooked": hooked, "repeats": []}
            for k in range(1, args.repeats):
                cmp = e2e.compare(runs[0], runs[k])
                rep = {"identical": runs[k] == runs[0], **cmp,
                       "first_differing_calls": _first_differences(calls[0], calls[k])}
                if hooked:
                    rep["first_differences"] = _first_differences(logs[0], logs[k], limit=4)
                    rep["prefill_calls"] = len(logs[k])
                row["repeats"].append(rep)
                where = f" first differing modules: {rep['first_differences']}" if hooked else ""
                print(f"{'hooked' if hooked else 'plain '} {len(p):6d} tokens run {k} vs 0: "
                      f"identical={rep['identical']} max|dlogprob|={cmp['max_logprob_diff']:.4g}"
                      f" diverged={cmp['diverged_at']}{where}"
                      f" first differing GDN calls: {rep['first_differing_calls']}", flush=True)
            report["prompts"].append(row)
        if hooked:
            llm.apply_model(_remove_hooks)
    e2e.save(f"probe_layers_{args.preset}", report)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1000, 2049, 4097, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="tiny", help="checkpoint preset (tiny, tiny-dense)")
    parser.add_argument("--llm-kwargs", type=json.loads, default={}, help="more LLM(...) kwargs (JSON)")
    sys.exit(main(parser.parse_args()))
