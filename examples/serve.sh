#!/usr/bin/env bash
# Serve a Qwen3.6 checkpoint with prefill context parallel 2 (2 GPUs), then query it:
#   bash examples/serve.sh /tmp/qwen36-tiny          # in one shell
#   python examples/client.py                         # in another
set -euo pipefail
MODEL=${1:?model directory}
exec vllm serve "$MODEL" \
  --hf-overrides '{"architectures": ["Qwen3_6ForCausalLM"]}' \
  -pcp 2 \
  --gdn-prefill-backend triton \
  --max-model-len 32768 \
  --port "${PORT:-8000}"
