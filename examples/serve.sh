#!/usr/bin/env bash
# Serve a Qwen3.6 checkpoint with prefill context parallel over PCP GPUs (default 2):
#   bash examples/serve.sh /tmp/qwen36-tiny &              # then: python examples/client.py --wait 600
#   bash examples/serve.sh MODEL 4 --max-num-seqs 64 &     # further arguments go to vllm serve
set -euo pipefail
MODEL=${1:?usage: serve.sh MODEL_DIR [PCP [VLLM_SERVE_ARGS...]]}
PCP=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
exec vllm serve "$MODEL" \
  --hf-overrides '{"architectures": ["Qwen3_6ForCausalLM"]}' \
  -pcp "$PCP" \
  --max-model-len 32768 \
  --port "${PORT:-8000}" \
  "$@"
