"""One rank of the FSDP2 equality test: ``python -m tests.helpers.fsdp_rank OUT`` under
``app.launch.launch`` (torchrun's environment).

For each case of :data:`CASES`, every rank builds the ``fsdp2`` engine from
:func:`case_config`; rank 0 prepares it, takes one step on :func:`batch` and saves a
checkpoint (the others follow its commands), then writes ``OUT/<case>/metrics.json``
and ``OUT/<case>/weights.safetensors`` (the gathered weights after the step).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from streamrft.infra.config import Config, from_dict
from streamrft.schemas import ExperienceGroup
from tests.helpers.groups import make_group
from tests.helpers.paths import ADDITION

CASES: dict[str, dict] = {
    # 24 rows in micro-batches of 23 (split 11/12) and 1 (rank 0 runs a stand-in row with
    # weight 0), two epochs, a KL term against a sharded reference copy, grad clipping
    "token_mean_micro_kl": {
        "trainer": {"micro_batch_size": 23, "ppo_epochs": 2, "grad_clip": 0.5, "lr": 1e-3},
        "algorithm": {"kl_loss_coef": 0.1},
    },
    # the whole batch at once, per-sequence normalisation, no clipping
    "seq_mean_whole": {
        "trainer": {"grad_clip": 0.0},
        "algorithm": {"loss_agg_mode": "seq-mean-token-mean"},
    },
    # two optimizer updates of 3 groups each, at the cosine schedule's warm-up lr (step 0
    # of 2 warm-up steps: half of lr); resumed, the next step is at the full lr
    "mini_batches_schedule": {
        "trainer": {
            "mini_batch_size": 3,
            "micro_batch_size": 5,
            "lr_schedule": "cosine",
            "lr_warmup_steps": 2,
            "max_steps": 6,
        },
    },
    # LoRA: only the adapter trains; KL against the base (adapter off)
    "lora_kl": {
        "model": {"lora": {"enabled": True, "rank": 4}},
        "trainer": {"lr": 5e-3},
        "algorithm": {"kl_loss_coef": 0.05},
    },
}


def case_config(case: str, out: Path, nproc: int) -> Config:
    sections = CASES[case]
    return from_dict(
        {
            "run": {"name": "fsdp", "id": f"fsdp-{case}", "dir": str(out / "runs"), "seed": 3},
            "taskset": {"path": str(ADDITION)},
            "model": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_layers": 2,
                "num_heads": 4,
                **sections.get("model", {}),
            },
            "trainer": {"lr": 1e-2, "nproc": nproc, **sections.get("trainer", {})},
            "algorithm": sections.get("algorithm", {}),
        }
    )


def batch() -> list[ExperienceGroup]:
    """6 groups of 4 rollouts of varied prompt and response lengths, some masked tokens."""
    rng = random.Random(7)
    groups = []
    for g in range(6):
        prompt = rng.randint(2, 6)
        tokens, logps, masks = [], [], []
        for _ in range(4):
            resp = rng.randint(1, 5)
            tokens.append([rng.randint(4, 60) for _ in range(prompt + resp)])
            logps.append([rng.uniform(-5.0, -1.0) for _ in range(resp)])
            masks.append([int(rng.random() > 0.2) for _ in range(resp)])
        rewards = [float(rng.random() > 0.5) for _ in range(4)]
        groups.append(
            make_group(
                "fsdp",
                f"t{g}",
                0,
                4,
                rewards,
                tokens=tokens,
                prompt_length=prompt,
                logprobs=logps,
                masks=masks,
            )
        )
    return groups


def main(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from streamrft.app.launch import die_with_launcher
    from streamrft.consumers.distributed import join_group, leave_group
    from streamrft.consumers.fsdp_engine import FsdpTrainEngine
    from streamrft.consumers.state import TrainerState
    from streamrft.sync.weights import unique_state_dict

    die_with_launcher()
    torch.set_num_threads(1)
    ranks = join_group(2)
    for case in CASES:
        engine = FsdpTrainEngine(case_config(case, out, ranks.world))
        if not ranks.leader:
            engine.follow()
            continue
        engine.prepare()
        metrics = engine.train_step(batch(), 0)
        engine.save(TrainerState(step=1))
        engine.release()
        folder = out / case
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metrics.json").write_text(json.dumps(metrics))
        assert engine.replica is not None
        save_file(unique_state_dict(engine.replica), str(folder / "weights.safetensors"))
    leave_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
