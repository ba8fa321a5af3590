"""The processes that load no model start without torch: ``streamrft run``'s supervisor
(its resume checks read the checkpoint folders' names only; its clean-up of ``/dev/shm``
the files' names), the feeder and the run monitor. torch and transformers take seconds
of CPU to import; every run pays it per process."""

from __future__ import annotations

import pytest

from tests.helpers.imports import modules_after_import, roots

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
    loaded = modules_after_import(module)
    assert sorted(roots(loaded) & {"torch", "transformers", "safetensors"}) == []
    assert module in loaded  # the probe does see imported modules
