"""The processes that load no model start without torch: ``streamrft run``'s supervisor
(its resume checks read the checkpoint folders' names only; its clean-up of ``/dev/shm``
the files' names), the feeder and the run monitor. torch and transformers take seconds of CPU to import; every run pays it per
process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LIGHT = [
    "streamrft.app.cli",
    "streamrft.app.supervisor",
    "streamrft.sync.shm_files",
    "streamrft.app.resume",
    "streamrft.consumers.checkpoint_folders",
    "streamrft.producers.feeder",
    "streamrft.app.watch.monitor",
]


@pytest.mark.parametrize("module", LIGHT)
def test_a_process_that_loads_no_model_imports_no_torch(module):
    code = (
        f"import sys, json, {module}\n"
        "heavy = ('torch', 'transformers', 'safetensors')\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(heavy))))\n"
        f"print({module!r} in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded, imported = out.stdout.strip().splitlines()
    assert json.loads(loaded) == []
    assert imported == "True"  # the probe does see imported modules
