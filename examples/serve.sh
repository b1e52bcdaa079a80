#!/usr/bin/env bash
# Serve a Qwen3.6 checkpoint with prefill context parallel over PCP GPUs (default 2), for prompts of up
# to MAX_MODEL_LEN tokens (default 32768; vLLM reads 128k as 128000 and 128K as 131072):
#   bash examples/serve.sh /tmp/qwen36-tiny &              # then: python examples/client.py --wait 600
#   bash examples/serve.sh MODEL 4 131072 &                # pcp=4, 128K-token context
#   bash examples/serve.sh MODEL 4 --max-num-seqs 64 &     # further arguments go to vllm serve
# Check the setup first (GPUs, options, expert memory): python -m qwen36_pcp doctor MODEL --pcp 2
# The KV cache is whole on every PCP rank: a longer context takes as much memory on each GPU as on one.
# MAX_MODEL_LEN and PORT may also come from the environment; a third argument starting with "-" is the
# first vllm serve argument, not a length.
set -euo pipefail
MODEL=${1:?usage: serve.sh MODEL_DIR [PCP [MAX_MODEL_LEN] [VLLM_SERVE_ARGS...]]}
PCP=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
if [[ $# -gt 0 && $1 != -* ]]; then
  MAX_MODEL_LEN=$1
  shift
fi
ARGS=("$MODEL"
  --hf-overrides '{"architectures": ["Qwen3_6ForCausalLM"]}'
  -pcp "$PCP"
  --max-model-len "${MAX_MODEL_LEN:-32768}"
  --port "${PORT:-8000}"
  "$@")
# what the plugin refuses before an engine exists (no GPU, too few, a bad option) ends here in one line
# and exit code 1, before vLLM's start prints its own lines around the same message
python -c 'import sys; from qwen36_pcp.early_refusals import command_line_refusal as r; e = r(sys.argv[1:]); sys.exit(e and str(e))' \
  serve "${ARGS[@]}"
exec vllm serve "${ARGS[@]}"
