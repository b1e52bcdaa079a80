#!/usr/bin/env bash
# Run GPU checks on a lent GPU machine (see tests/gpu/README.md). From the repo root there:
#   bash tests/gpu/run_on_device.sh SECONDS 'COMMAND' ['COMMAND' ...]
# e.g. bash tests/gpu/run_on_device.sh 540 'python3 -m pytest -q -s tests/gpu'
# Installs the vLLM bundle and this package, runs the commands one after the other within SECONDS in
# total (packing included: the steps get SECONDS - 60), and packs every log and result (under
# $OUT/work) into $OUT/results.tgz.
set -u
deadline=$(( $(date +%s) + $1 - 60 )); shift
eval "$(bash .devbundle/part1/install-on-device.sh 2>/dev/null)" || { echo "bundle install failed"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1 \
  || { echo "package install failed"; exit 1; }
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
# Triton kernels and autotuning results of an earlier machine: a fresh machine spends most of an
# engine's start compiling and autotuning them (pcp=2: 246 s -> 39 s). Saved at the end as
# $OUT/triton_cache.tar.xz (~2 MB); carry it back as .devcache/triton_cache.tar.xz.
if [ -f .devcache/triton_cache.tar.xz ]; then
  tar xJf .devcache/triton_cache.tar.xz -C "$HOME" && echo "restored Triton cache ($(find "$HOME/.triton" -name '*.cubin' | wc -l) kernels)"
fi
# saved engine results for QWEN36_PCP_REUSE, packed (the call carries at most 64 MiB, the bundle ~61)
if [ -f .devcache/reuse.tar.xz ]; then
  mkdir -p .devcache/reuse && tar xJf .devcache/reuse.tar.xz -C .devcache/reuse \
    && echo "restored $(ls .devcache/reuse | wc -l) saved engine results"
fi
final=${OUT:-/tmp/out}
export OUT="$final/work"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
i=0
for cmd in "$@"; do
  i=$((i + 1))
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 10 ] || { echo "== skipped (no time left): $cmd"; continue; }
  echo "== [$i] ($left s left) $cmd"
  timeout "$left" bash -c "$cmd" > "$OUT/step$i.log" 2>&1
  echo "== [$i] exit $?"
  # engines and servers run in their own sessions: stop what a timed-out step left behind (not this
  # script, whose command line may name them)
  for pid in $(pgrep -f 'tests[.]gpu[.]e2e engine|vllm[.]entrypoints[.]cli[.]main|spawn_main'); do
    [ "$pid" != "$$" ] && kill -9 "$pid" 2>/dev/null
  done
  grep -v "^INFO\|^(EngineCore\|^(Worker\|Warning\|warn" "$OUT/step$i.log" | tail -n 40
done
tar czf "$final/results.tgz" -C "$OUT" . && echo "packed $(ls "$OUT" | wc -l) files"
# compiled kernels and metadata only (the .ptx/.llir/.ttgir sources are not needed to load a cached kernel)
(cd "$HOME" && find .triton/cache .cache/vllm -path '*triton*' \( -name '*.cubin' -o -name '*.json' \) 2>/dev/null \
  | tar cf - -T - | xz -9 -T0 > /tmp/triton_cache.tar.xz) \
  && mv /tmp/triton_cache.tar.xz "$final/" \
  && echo "Triton cache: $(du -b "$final/triton_cache.tar.xz" | cut -f1) bytes"  # whole, or not there
