"""``bench/vs_trl.py``'s one-step check: TRL's GRPOTrainer and streamrft's train engine, from
the same warmed model folder on the same batch, compute the same log-probs, advantages
(up to TRL's documented epsilon), loss and update, so the bench compares systems, not math.
Skipped without TRL (the ``bench`` extra)."""

from __future__ import annotations

import pytest

from tests.helpers.benches import load_bench

pytestmark = [pytest.mark.unit, pytest.mark.numeric]

setup = load_bench("vs_trl_setup")
if setup.trl_missing():
    pytest.skip(setup.trl_missing(), allow_module_level=True)


def test_one_step_of_trl_and_of_streamrft_moves_the_weights_the_same_way(tmp_path):
    check = load_bench("vs_trl_check")
    folder, losses = setup.warm_folder(0, tmp_path / "warm")
    assert losses[-1] < losses[0] / 4  # the warm-up taught the format
    config = setup.write_config(tmp_path / "c.yaml", folder, 0, 2, 1, 0, tmp_path / "runs")

    r = check.check_step(config, tmp_path)

    assert r["rows"] == 256 and r["groups"] == 32
    assert 0.1 < r["reward_mean"] < 0.9  # groups with and without the answer: advantages
    # the rollout log-probs: TRL's recomputed ones and streamrft's for the same tokens
    assert r["as_run"]["logprob_max_diff"] < 1e-4
    # advantages differ by TRL's epsilon alone (std + 1e-4 against std + 1e-6)
    assert r["advantage_max_diff_trl_eps"] < 1e-5 < r["advantage_max_diff"]
    # with that epsilon, one loss and one update (Adam turns float noise on near-zero
    # gradients into whole steps: the update is compared as a whole, and its largest
    # element against the largest change)
    same = r["eps_matched"]
    assert same["loss_rel_diff"] < 1e-5
    assert same["update_rel_l2"] < 1e-3 and same["update_cosine"] > 0.99999
    assert same["weight_max_diff"] < 0.05 * same["weight_max_change"]
    # as streamrft runs: the epsilon moves the loss by a few 1e-4 of itself, not more
    run = r["as_run"]
    assert run["loss_rel_diff"] < 1e-3 and run["update_rel_l2"] < 1e-2
    assert run["weight_max_change"] > 1e-4  # the step did move the weights
    assert check.check_failures(r) == []
