#!/usr/bin/env bash
# Serve a Qwen3.6 checkpoint with prefill context parallel over PCP GPUs (default 2):
#   bash examples/serve.sh /tmp/qwen36-tiny &      # then: python examples/client.py
set -euo pipefail
MODEL=${1:?usage: serve.sh MODEL_DIR [PCP]}
exec vllm serve "$MODEL" \
  --hf-overrides '{"architectures": ["Qwen3_6ForCausalLM"]}' \
  -pcp "${2:-2}" \
  --max-model-len 32768 \
  --port "${PORT:-8000}"
