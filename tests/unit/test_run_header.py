"""The console header of ``streamrft run`` says what a device of ``auto`` resolves to on
this host, as ``streamrft validate`` does; a named device is shown as it is."""

from __future__ import annotations

import pytest

from streamrft.app.placement import gpu_visible
from streamrft.app.supervisor import header
from streamrft.infra.config import load_config, with_run_id
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.unit


def test_auto_is_shown_with_what_it_resolves_to_here():
    cfg = with_run_id(load_config(EXAMPLE, ["model.device=auto"]), "r1")
    here = "cuda:0" if gpu_visible() else "cpu"
    placement = next(line for line in header(cfg, None).splitlines() if "placement" in line)
    assert placement == f"  placement trainer on auto: {here} here; explorer 0 on auto: {here} here"
    cfg = with_run_id(load_config(EXAMPLE, ["model.device=cpu"]), "r1")
    assert "  placement trainer on cpu; explorer 0 on cpu" in header(cfg, None)
