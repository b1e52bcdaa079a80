#!/usr/bin/env bash
# Run GPU checks on a lent GPU machine (see tests/gpu/README.md). Usage, from the repo root there:
#   bash tests/gpu/run_on_device.sh SECONDS PYTEST_ARGS...
# Installs the vLLM bundle and this package, runs pytest with a time limit, packs every log and result
# under $OUT into one archive (the device tool returns at most 8 files).
set -u
limit=$1; shift
eval "$(bash .devbundle/part1/install-on-device.sh 2>/dev/null)" || { echo "bundle install failed"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . >/dev/null 2>&1 \
  || { echo "package install failed"; exit 1; }
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
results=${OUT:-/tmp/out}/work
mkdir -p "$results"
export OUT="$results"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "$limit" python3 -m pytest -q -s -rA -p no:cacheprovider "$@" 2>&1 | tee "$results/pytest.log" | grep -v "^INFO\|^(EngineCore\|^(Worker" | tail -n 150
tar czf "$results/../results.tgz" -C "$results" . && echo "packed $(ls "$results" | wc -l) files"
