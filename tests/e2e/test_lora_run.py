"""The LoRA example end to end: it learns, only adapters travel after version 0, export works."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from streamrft.infra.consume import read_history
from streamrft.schemas import CONTROL, ModelVersionReady
from tests.helpers.cli import env, run_argv, run_ok, streamrft_cmd
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.e2e

LORA_EXAMPLE = ROOT / "examples" / "arithmetic_lora.yaml"


def test_lora_run_learns_publishes_adapters_and_exports(services, make_config, tmp_path):
    run_id = f"lora-{tmp_path.name[-10:]}"
    steps = 40
    runs = tmp_path / "runs"
    run_ok(
        run_argv(
            LORA_EXAMPLE,
            run_id,
            steps,
            runs,
            services,
            "eval.interval=20",
            summary=tmp_path / "s.json",
        ),
        tmp_path,
    )
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["eval_accuracy_last"] >= s["eval_accuracy_first"] + 0.15, s["eval_accuracy"]
    assert s["books"]["trained_twice"] == 0 and s["versions_rejected"] == {"explorer-0": 0}
    assert s["versions_applied"]["explorer-0"] >= steps // 2

    cfg = make_config(run={"id": run_id})
    events = [
        e
        for e in asyncio.run(read_history(cfg.kafka, cfg.topics().control, CONTROL, "lora-test"))
        if isinstance(e, ModelVersionReady)
    ]
    full, adapters = events[0], events[1:]
    assert full.version == 0 and not full.lora and full.bytes > 500_000
    assert len(adapters) == steps
    for ev in adapters:  # a few hundred KB at most, never the full model
        assert ev.lora and ev.base_version == 0
        assert ev.bytes < 200_000 and ev.bytes < full.bytes / 4

    # exported with the run folder's own config.yaml (its store secret redacted) and no
    # credentials in the environment: export talks to neither broker nor store
    out = tmp_path / "hf"
    resolved = runs / run_id / "config.yaml"
    assert "secret_key: '***'" in resolved.read_text()
    proc = subprocess.run(
        streamrft_cmd(
            "export", str(resolved), "--checkpoint", str(runs / run_id), "--out", str(out)
        ),
        env={k: v for k, v in env().items() if not k.startswith("STREAMRFT_")},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert Path(out, "tokenizer.json").is_file()
