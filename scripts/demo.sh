#!/usr/bin/env bash
# The main job on the default model: installs what is missing, fetches SmolLM2-135M-Instruct,
# builds, then answers a batch of chat prompts that share a system prompt in one continuous
# batch, printing the page tables so the shared prefix pages are visible.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
model=$(scripts/fetch_model.sh)
# The CUDA kernels for this machine's GPU only (a build for every GPU from sm_80 on takes many
# minutes more); without a GPU none at all, and the demo runs on the CPU.
if nvidia-smi -L >/dev/null 2>&1; then
  export PAGEDLM_CMAKE_ARGS="-DPAGEDLM_CUDA_ARCHS=native ${PAGEDLM_CMAKE_ARGS:-}"
else
  export PAGEDLM_CMAKE_ARGS="-DPAGEDLM_CUDA=OFF ${PAGEDLM_CMAKE_ARGS:-}"
fi
scripts/build.sh pagedlm  # the binary only: the tests are scripts/test.sh's
build/pagedlm generate --model "$model" --chat --show-cache --max-tokens 64 \
  --system "You are a concise and friendly assistant. Answer every question in one or two short
sentences of plain English. If you are not sure of an answer, say so instead of guessing." \
  --prompt "What is the capital of France?" \
  --prompt "Name three primary colors." \
  --prompt "What is 12 times 12?" \
  --prompt "Why is the sky blue?" \
  --prompt "Translate 'thank you' into Spanish." \
  --prompt "What is the largest planet in our solar system?" \
  --prompt "Give me a synonym for 'happy'." \
  --prompt "How many days are in a leap year?" \
  "$@"
