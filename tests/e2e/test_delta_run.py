"""A bf16 run with delta versions: the trainer sends most versions as the changed elements,
every explorer rebuilds each one on the weights it holds, checks the rebuilt state's sha256
and ends on the trainer's exact weights."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from streamrft.consumers.checkpoint_folders import latest_checkpoint
from streamrft.infra.consume import read_history
from streamrft.schemas.codec import CONTROL, STATUS
from streamrft.schemas.events import ModelVersionReady, VersionsRetired
from streamrft.sync import delta
from streamrft.sync.filesystem import FilesystemLoader
from tests.helpers.cli import run_argv, run_ok
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e


def _rebuild(loader: FilesystemLoader, versions: dict[int, ModelVersionReady], target: int):
    """Version ``target`` as whole tensors, from its newest full version through the deltas."""
    chain = [versions[target]]
    while chain[-1].delta_base >= 0:
        chain.append(versions[chain[-1].delta_base])
    state = loader.fetch(chain[-1])
    for event in reversed(chain[:-1]):
        state = delta.decode(loader.fetch(event), state)
    return state


def test_a_bf16_run_with_deltas_ends_with_the_trainers_exact_weights(
    services, make_config, tmp_path
):
    run_id = f"delta-{tmp_path.name[-10:]}"
    steps, full_every = 5, 3
    fs_dir = tmp_path / "versions"
    run_ok(
        run_argv(
            EXAMPLE,
            run_id,
            steps,
            tmp_path / "runs",
            services,
            "model.dtype=bfloat16",
            "synchronizer.method=filesystem",
            f"synchronizer.fs_dir={fs_dir}",
            "synchronizer.delta=always",
            f"synchronizer.full_every={full_every}",
            "synchronizer.keep_versions=2",
            "trainer.lr=1e-5",  # a fine-tuning step: few bf16 elements change
            "trainer.batch_size=8",
            "explorer.batch_size=8",
            "trainer.warmup_sft_steps=5",
            "eval.interval=0",
            explorers=2,
            summary=tmp_path / "s.json",
        ),
        tmp_path,
        timeout=500,
    )
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == steps and s["versions_published"] == steps + 1
    assert s["versions_rejected"] == {"explorer-0": 0, "explorer-1": 0}

    cfg = make_config(run={"id": run_id, "dir": str(tmp_path / "runs")})
    control = asyncio.run(read_history(cfg.kafka, cfg.topics().control, CONTROL, "delta-ctl"))
    versions = {e.version: e for e in control if isinstance(e, ModelVersionReady)}
    last = max(versions)
    bases = [versions[v].delta_base for v in sorted(versions)]
    # version 0 full, then deltas on the version before, a full one after every 3
    assert bases == [-1, 0, 1, 2, -1, 4], bases
    full = versions[0].bytes
    assert all(versions[v].bytes < full / 2 for v in versions if versions[v].delta_base >= 0)
    assert all(e.state_sha256 for e in versions.values())

    # the explorers applied the last version (each delta checked against its state_sha256
    # on the weights the explorer held), with no failed rebuild
    assert s["explorer_final_version"] == {"explorer-0": last, "explorer-1": last}
    status = asyncio.run(read_history(cfg.kafka, cfg.topics().status, STATUS, "delta-st"))
    final = {e.component: e.counters for e in status if e.component.startswith("explorer")}
    assert {name: c.get("delta_refetches", 0) for name, c in final.items()} == {
        "explorer-0": 0,
        "explorer-1": 0,
    }

    # ...and that state is the trainer's final weights (its last checkpoint), in bf16
    ckpt = latest_checkpoint(cfg.run_dir / "checkpoints")
    trainer = {
        k: v.to(torch.bfloat16) for k, v in load_file(str(ckpt / "model.safetensors")).items()
    }
    assert delta.state_sha256(trainer) == versions[last].state_sha256
    # keep_versions 2: versions 4 (full) and 5 (a delta on it) are kept; 0 to 3 were kept
    # while 3 needed its chain down to 0, then retired and deleted once 4 and 5 were out
    retired = sorted(v for e in control if isinstance(e, VersionsRetired) for v in e.versions)
    assert retired == [0, 1, 2, 3], retired
    assert sorted(p.name for p in (fs_dir / run_id).iterdir()) == ["v00000004", "v00000005"]
    rebuilt = _rebuild(FilesystemLoader(fs_dir), versions, last)
    for name, tensor in trainer.items():
        assert torch.equal(rebuilt[name], tensor), name
