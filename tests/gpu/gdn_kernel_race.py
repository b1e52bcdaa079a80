# SPDX-License-Identifier: Apache-2.0
"""Are vLLM's GDN prefill kernels deterministic on their own? (1 GPU, no engine)

    python -m tests.gpu.diagnose kkt-race [--lengths 2049 4097 16384] [--runs 20] [--shape tiny|35b]
    python -m tests.gpu.diagnose kkt-race --sweep-configs --lengths 16384 --runs 10

Runs each step of vLLM's ``chunk_gated_delta_rule`` (and the whole) ``--runs`` times on fixed random
inputs, with the memory the caching allocator hands out refilled with garbage between runs, and
prints how many distinct outputs each gave and, for a nondeterministic one, where they differ.
``--sweep-configs`` pins ``chunk_scaled_dot_kkt_fwd`` to each of its autotune configs in turn and
times it (what keeping only the race-free ones costs). ``--config-sensitivity`` pins each autotuned
kernel of the GDN prefill path in turn to each of its configs and runs the whole
``chunk_gated_delta_rule`` (q/k L2-normalised in the kernel, as vLLM's GDN layer calls it): the
kernels whose choice of config alone changes the output, which an autotuner picking by speed turns
into answers that differ between cold starts, and for each which configs give which output (the
configs to keep for one answer) and the whole call's time under the fastest of them and of the
configs ``qwen36_pcp.deterministic_gdn`` pins it to (what keeping those costs).
On H200 (2026-12-01) that kernel alone was nondeterministic from 3000 tokens on, under 9 of its 27
configs at the tiny shape and 10-11 at the 35b one; the BK=128 ones were exact.
``qwen36_pcp.deterministic_gdn.pin_gdn_configs`` keeps those, and keeps the two kernels ``--config-sensitivity``
found (``chunk_fwd_kernel_o``, ``solve_tril``'s 64x64
merge) to one output's configs; ``--pin-cost`` times what that costs.
"""

import contextlib

import torch

SHAPES = {"tiny": (4, 8, 128), "35b": (16, 32, 128)}  # key heads, value heads, head dim


def _inputs(T: int, hk: int, hv: int, d: int, seed: int = 0):
    from vllm.model_executor.layers.fla.ops.index import prepare_chunk_indices, prepare_chunk_offsets

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, **dev).to(dtype)

    q, k = (torch.nn.functional.normalize(rand(1, T, hk, d).float(), dim=-1).to(torch.bfloat16)
            for _ in range(2))
    v = rand(1, T, hv, d)
    g = -torch.nn.functional.softplus(rand(1, T, hv, dtype=torch.float32))  # log decay < 0
    beta = torch.sigmoid(rand(1, T, hv, dtype=torch.float32))
    cu = torch.tensor([0, T], dtype=torch.int32, **dev)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu,
                chunk_indices=prepare_chunk_indices(cu.cpu(), 64).cuda(),
                chunk_offsets=prepare_chunk_offsets(cu.cpu(), 64).cuda(),
                h0=torch.zeros(1, hv, d, d, dtype=torch.float32, **dev))


def _steps(x):
    """name -> zero-argument call, each step fed the (fixed) output of the steps before it."""
    from vllm.model_executor.layers.fla.ops import chunk_gated_delta_rule
    from vllm.model_executor.layers.fla.ops.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
    from vllm.model_executor.layers.fla.ops.cumsum import chunk_local_cumsum
    from vllm.model_executor.layers.fla.ops.solve_tril import solve_tril

    meta = dict(cu_seqlens=x["cu_seqlens"], chunk_indices=x["chunk_indices"])
    gc = chunk_local_cumsum(x["g"], chunk_size=64, **meta)
    A = chunk_scaled_dot_kkt_fwd(k=x["k"], beta=x["beta"], g=gc, output_dtype=torch.float32, **meta)
    return {
        "chunk_local_cumsum": lambda: chunk_local_cumsum(x["g"], chunk_size=64, **meta),
        "chunk_scaled_dot_kkt_fwd": lambda: chunk_scaled_dot_kkt_fwd(
            k=x["k"], beta=x["beta"], g=gc, output_dtype=torch.float32, **meta),
        "solve_tril": lambda: solve_tril(A=A, output_dtype=x["k"].dtype, **meta),
        "chunk_gated_delta_rule": lambda: chunk_gated_delta_rule(
            q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"].clone(),
            output_final_state=True, chunk_offsets=x["chunk_offsets"], **meta),
    }


def _garbage(fill: float):
    """Hand the next allocations memory full of ``fill`` (what torch.empty would expose)."""
    junk = torch.full((1 << 28,), fill, dtype=torch.float32, device="cuda")
    del junk


def _describe(ref: torch.Tensor, other: torch.Tensor) -> str:
    bad = (ref != other) & ~(ref.isnan() & other.isnan())
    idx = bad.nonzero()
    if not len(idx):
        return "same values, different bits (NaN payloads?)"
    finite = ref.isfinite() & other.isfinite() & bad
    diff = (ref[finite].float() - other[finite].float()).abs().max().item() if finite.any() else None
    return (f"{bad.sum().item()} of {ref.numel()} elements differ, max |diff| {diff}, "
            f"non-finite involved: {(bad & ~finite).sum().item()}; first indices {idx[:4].tolist()}; "
            f"token index mod 64 of differing: {sorted(set((idx[:, 1] % 64).tolist()))[:16]}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equal to itself, -0.0 not to 0.0), whatever the dtype."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _add_to_class(outs: list, members: list, out: torch.Tensor, cfg) -> None:
    """Files ``cfg`` under the output it gave: ``members[i]`` the configs whose output is ``outs[i]``
    bit for bit (a new class for an output unlike all)."""
    i = next((i for i, u in enumerate(outs) if _same_bits(out, u)), len(outs))
    if i == len(outs):
        outs.append(out)
        members.append([])
    members[i].append(cfg)


def _distinct(call, runs: int) -> list:
    fills = [float("nan"), 1e30, -1e30, 0.0, 123.0]
    distinct, run_ids = [], []
    for r in range(runs):
        _garbage(fills[r % len(fills)])
        out = call()
        _add_to_class(distinct, run_ids, (out[0] if isinstance(out, tuple) else out).clone(), r)
    return distinct


@contextlib.contextmanager
def _kkt_race_free():
    """``chunk_scaled_dot_kkt_fwd`` kept to its race-free configs (as where PCP runs) for the block, so
    that its races do not pass for another kernel's sensitivity; yields its pin."""
    from qwen36_pcp.deterministic_gdn import PINS, pin_gdn_configs, restore_gdn_configs

    kkt = next(p for p in PINS if p.kernel == "chunk_scaled_dot_kkt_fwd_kernel")
    pin_gdn_configs([kkt])
    try:
        yield kkt
    finally:
        restore_gdn_configs([kkt])


@contextlib.contextmanager
def _pinned(tuner):
    """(the autotuner's configs, pin): ``pin(cfg)`` makes ``cfg`` its only config (its choice
    forgotten); its configs and choices come back after."""
    configs, cache = tuner.configs, tuner.cache  # the objects themselves come back

    def pin(cfg):
        tuner.configs, tuner.cache = [cfg], {}

    try:
        yield list(configs), pin
    finally:
        tuner.configs, tuner.cache = configs, cache


def sweep_kkt_configs(args) -> int:
    """chunk_scaled_dot_kkt_fwd pinned to each of its autotune configs in turn; then fla's own."""
    from triton.testing import do_bench
    from vllm.model_executor.layers.fla.ops import chunk_scaled_dot_kkt as mod

    tuner = mod.chunk_scaled_dot_kkt_fwd_kernel.fn
    hk, hv, d = SHAPES[args.shape]
    T = args.lengths[-1]
    x = _inputs(T, hk, hv, d)
    step = _steps(x)["chunk_scaled_dot_kkt_fwd"]
    step()
    print(f"autotuner's choice: {[str(c) for c in tuner.cache.values()]}", flush=True)
    with _pinned(tuner) as (configs, pin):
        for cfg in configs:
            pin(cfg)
            n = len(_distinct(step, args.runs))
            ms = do_bench(step)
            print(f"{args.shape} T={T} {cfg}: {n} distinct outputs in {args.runs} runs, {ms:.4f} ms",
                  flush=True)
    try:
        from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd as fla_kkt
    except ImportError as e:
        print(f"fla-core not importable: {e}")
        return 0
    n = len(_distinct(lambda: fla_kkt(k=x["k"], g=x["g"], beta=x["beta"], cu_seqlens=x["cu_seqlens"],
                                      chunk_indices=x["chunk_indices"]), args.runs))
    print(f"{args.shape} T={T} fla-core's chunk_scaled_dot_kkt_fwd: {n} distinct outputs", flush=True)
    return 0


def _tuners():
    """(module.kernel name, triton Autotuner) of every autotuned kernel on the GDN prefill path."""
    import importlib

    from triton.runtime.autotuner import Autotuner

    found, seen = [], set()
    for name in ("cumsum", "l2norm", "chunk_scaled_dot_kkt", "solve_tril", "wy_fast", "chunk_delta_h", "chunk_o"):
        mod = importlib.import_module(f"vllm.model_executor.layers.fla.ops.{name}")
        for attr, obj in sorted(vars(mod).items()):
            tuner = obj if isinstance(obj, Autotuner) else getattr(obj, "fn", None)  # under @heuristics
            if isinstance(tuner, Autotuner) and id(tuner) not in seen:
                seen.add(id(tuner))
                found.append((f"{name}.{attr}", tuner))
    return found


def config_sensitivity(args) -> int:
    """Each autotuned kernel the whole chunk_gated_delta_rule launches, pinned to each of its configs in
    turn (the others as autotuned; chunk_scaled_dot_kkt_fwd kept to its race-free configs, as where PCP
    runs, so that its races do not pass for another kernel's sensitivity): how many distinct repeatable
    outputs its configs give, and how far apart. 1 when any kernel's config changes the output."""
    from triton.runtime.errors import OutOfResources, PTXASError

    from qwen36_pcp.deterministic_gdn import PINS

    hk, hv, d = SHAPES[args.shape]
    sensitive = []
    pins = {f"{p.module}.{p.kernel}": p for p in PINS}  # by ``_tuners``' names
    with _kkt_race_free():
        for T in args.lengths:
            call, run = _whole_call(_inputs(T, hk, hv, d))
            base = run().clone()
            base_ms = _time(call)
            print(f"{args.shape} T={T:6d} chunk_gated_delta_rule, every kernel autotuned: {base_ms:.4f} ms",
                  flush=True)
            # kernels this call launched: their autotuners hold a choice (others, e.g. variants for
            # another normalisation or chunk size, would look insensitive without running)
            for name, tuner in (t for t in _tuners() if t[1].cache):
                outs, members, repeat_fail, failed = [], [], 0, 0  # distinct outputs, their configs
                ms = {}  # config -> the whole call's time with this kernel pinned to it
                with _pinned(tuner) as (configs, pin):
                    for cfg in configs:
                        pin(cfg)
                        try:
                            a, b = run().clone(), run().clone()
                        except (OutOfResources, PTXASError):  # a config the shape cannot take
                            failed += 1
                            continue
                        if not _same_bits(a, b):
                            repeat_fail += 1  # a race of its own, not a choice of config
                            continue
                        _add_to_class(outs, members, a, cfg)
                        ms[id(cfg)] = _time(call)
                spread = max(((u - base).abs().max().item() for u in outs), default=0.0)
                print(f"{args.shape} T={T:6d} {name:55s}: {len(configs)} configs, {len(outs)} distinct repeatable "
                      f"outputs, max |diff| vs autotuned {spread:.3g}, not repeatable under {repeat_fail}, "
                      f"failed {failed}", flush=True)
                if len(outs) > 1:
                    sensitive.append(name)
                    for u, cfgs in zip(outs, members):  # which configs to keep for one answer, at what cost
                        same = "the autotuned output" if _same_bits(u, base) else "another output"
                        print(f"    {same}: {'; '.join(map(str, cfgs))}", flush=True)
                        print(f"      {_fastest(cfgs, ms)}", flush=True)
                    config_pin = pins.get(name)
                    kept = [c for c in configs if config_pin is not None and config_pin.keep(c) and id(c) in ms]
                    if kept:
                        print(f"    the pinned {config_pin.kept} configs: {_fastest(kept, ms)}", flush=True)
    print(f"kernels whose config changes the output: {sorted(set(sensitive))}", flush=True)
    return 1 if sensitive else 0


def _whole_call(x):
    """(call, run): vLLM's chunk_gated_delta_rule as its GDN layer calls it (q/k L2-normalised in the
    kernel), timed as is (``call``), and its output and final state as one flat tensor (``run``)."""
    from vllm.model_executor.layers.fla.ops import chunk_gated_delta_rule

    def call():
        return chunk_gated_delta_rule(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"],
                                      initial_state=x["h0"].clone(), output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"],
                                      chunk_indices=x["chunk_indices"], chunk_offsets=x["chunk_offsets"])

    def run():
        o, h = call()
        return torch.cat([o.float().flatten(), h.float().flatten()])
    return call, run


def _time(call) -> float:
    """Median ms of ``call`` over about 200 ms of runs (one sample when it was 25 ms and a call 14)."""
    from triton.testing import do_bench

    return do_bench(call, warmup=25, rep=200, return_mode="median")


def pin_cost(args) -> int:
    """What each of ``qwen36_pcp.deterministic_gdn.PINS`` costs: the whole chunk_gated_delta_rule timed
    with the pinned kernel autotuned at the prompt's own length among all its configs, among the kept
    ones and among the others (every other kernel autotuned at that length first, as a process whose
    first prefill had it would; Triton's on-disk cache of choices, keyed without the length, bypassed).
    The kept configs' outputs are checked to be one."""
    from qwen36_pcp.deterministic_gdn import ORIGINAL_CONFIGS, PINS

    hk, hv, d = SHAPES[args.shape]
    tuners = dict(_tuners())
    with _kkt_race_free() as kkt:  # while the other pins' outputs are compared
        for T in args.lengths:
            call, run = _whole_call(_inputs(T, hk, hv, d))
            for tuner in tuners.values():
                tuner.cache.clear()
                tuner.cache_results = False
            run()  # every kernel autotuned at T
            for pin in sorted(PINS, key=lambda p: p is kkt):  # the kkt kernel's cost last
                tuner = pin.tuner()
                line, outs = [], []
                with _pinned(tuner) as (current, _):
                    configs = getattr(tuner, ORIGINAL_CONFIGS, current)
                    for label, subset in (("all", configs), ("kept", [c for c in configs if pin.keep(c)]),
                                          ("others", [c for c in configs if not pin.keep(c)])):
                        if not subset:
                            continue
                        tuner.configs, tuner.cache = subset, {}
                        out = run().clone()  # autotuned at T among ``subset``
                        if label == "kept":
                            outs, members = [out], [[]]
                            for cfg in subset:  # the kept configs give one output
                                tuner.configs, tuner.cache = [cfg], {}
                                _add_to_class(outs, members, run().clone(), cfg)
                            tuner.configs, tuner.cache = subset, {}
                            run()
                        line.append(f"{label} {_time(call):.4f} ms ({tuner.best_config})")
                print(f"{args.shape} T={T:6d} {pin.kernel:40s} kept {pin.kept}: {len(outs) or 'no'} output(s) under "
                      f"the kept configs; the whole call, autotuned among " + "; ".join(line), flush=True)
    return 0


def _fastest(cfgs: list, ms: dict) -> str:
    best = min(cfgs, key=lambda c: ms[id(c)])
    return f"fastest {ms[id(best)]:.4f} ms ({best})"


def main(args) -> int:
    if args.config_sensitivity:
        return config_sensitivity(args)
    if args.pin_cost:
        return pin_cost(args)
    if args.sweep_configs:
        return sweep_kkt_configs(args)
    hk, hv, d = SHAPES[args.shape]
    bad_total = 0
    for T in args.lengths:
        x = _inputs(T, hk, hv, d)
        for name, call in _steps(x).items():
            distinct = _distinct(call, args.runs)
            bad_total += len(distinct) > 1
            line = f"{args.shape} T={T:6d} {name:26s}: {len(distinct)} distinct outputs in {args.runs} runs"
            if len(distinct) > 1:
                line += " -- " + _describe(distinct[0], distinct[1])
            print(line, flush=True)
    return 0 if bad_total == 0 else 1


def add_arguments(parser) -> None:
    parser.add_argument("--lengths", nargs="+", type=int, default=[1000, 2049, 3000, 4097, 16384])
    parser.add_argument("--runs", type=int, default=20)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep-configs", action="store_true",
                      help="chunk_scaled_dot_kkt_fwd under each autotune config (longest length)")
    mode.add_argument("--config-sensitivity", action="store_true",
                      help="which autotuned GDN prefill kernels change the output with their config")
    mode.add_argument("--pin-cost", action="store_true",
                      help="the whole GDN prefill's time with each pinned kernel's kept configs against all")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
