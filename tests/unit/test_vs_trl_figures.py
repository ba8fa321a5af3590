"""``bench/vs_trl.py``'s figures from arms' timelines: times to an accuracy, speeds, the
accuracy at equal wall time, the ratios, and what a crash cost (steps redone, batches
sampled again, groups dropped as stale)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.benches import load_bench

pytestmark = pytest.mark.unit

pytest.importorskip("psutil", reason="the bench extra (pip install -e '.[bench]')")


bench = load_bench("vs_trl")
Timeline = sys.modules["vs_trl_runs"].Timeline


def timeline(t0, steps, evals, gens=(), kills=(), tokens=100, summary=None, end=None):
    line = Timeline(t0=t0, end=end or steps[-1][0] + 5, exit_code=0)
    line.steps, line.evals, line.gens, line.kills = (
        list(steps),
        list(evals),
        list(gens),
        list(kills),
    )
    line.step_tokens = {s: tokens for _, s in steps}
    line.summary = summary or {}
    line.meter = {"peak_rss_mb": 100.0, "peak_pss_mb": 80.0, "cpu_s": 10.0}
    return line


def test_times_speeds_and_the_ratio_to_trl():
    trl = timeline(
        1000.0,
        [(1020.0 + 2 * i, i) for i in range(1, 9)],
        [(1018.0, 0, 0.8), (1028.0, 4, 0.92), (1036.0, 8, 0.97)],
    )
    ours = timeline(
        1000.0,
        [(1010.0 + i, i) for i in range(1, 9)],
        [(1009.0, 0, 0.8), (1014.0, 4, 0.96), (1018.0, 8, 0.97)],
        tokens=50,
    )
    points = [bench.figures("trl", 0, trl), bench.figures("fixed-1", 0, ours)]
    p_trl, p_ours = points
    assert (p_trl["t90_s"], p_trl["t95_s"], p_trl["ready_s"]) == (28.0, 36.0, 18.0)
    assert (p_ours["t90_s"], p_ours["t95_s"], p_ours["first_step_s"]) == (14.0, 14.0, 11.0)
    assert p_trl["steps_per_s"] == 0.5 and p_ours["steps_per_s"] == 1.0  # 7 gaps in 14 s, 7 s
    assert p_trl["tokens_per_s"] == 50.0 and p_ours["tokens_per_s"] == 50.0  # steps 2..8
    bench.equal_wall(points)
    # the shortest arm's last evaluation came 18 s in: TRL then held its start's model
    assert p_ours["equal_wall_s"] == p_trl["equal_wall_s"] == 18.0
    assert (p_ours["acc_at_equal_wall"], p_trl["acc_at_equal_wall"]) == (0.97, 0.8)
    [row] = bench.ratios(points)
    assert row["t95_s_ratio"] == round(14 / 36, 3) and row["steps_per_s_ratio"] == 2.0
    assert row["acc_at_equal_wall_diff"] == pytest.approx(0.17)
    goals = bench.summary([row])["goals"]
    assert (
        goals["fixed-1_t95_s_ratio_lt_1.0"] is True and goals["fixed-2_t95_s_ratio_le_0.8"] is None
    )


def test_what_a_crash_cost_each():
    whole_steps = [(100.0 + i, i) for i in range(1, 13)]
    # TRL: killed after step 6, resumed from its step-4 checkpoint: batches 5 and 6 again
    steps = [(100.0 + i, i) for i in range(1, 7)] + [(130.0 + i, i) for i in range(5, 13)]
    gens = [(99.5 + i, "trl", i, 256) for i in range(1, 7)]
    gens += [(129.5 + i, "trl", i, 256) for i in range(5, 13)]
    trl = bench.crash_figures(
        "trl",
        0,
        timeline(90.0, steps, [(140.0, 12, 0.97)], gens, kills=[(106.5, 6)]),
        timeline(90.0, whole_steps, [(112.0, 12, 0.98)]),
        8,
    )
    assert (trl["steps_redone"], trl["rollouts_regenerated"], trl["rollouts_dropped"]) == (
        2,
        512,
        0,
    )
    assert trl["recovery_s"] == 137.0 - 106.5  # step 7, the first past 6
    assert trl["wall_lost_s"] == 142.0 - 112.0
    assert (trl["final_accuracy"], trl["final_accuracy_whole"]) == (0.97, 0.98)
    # streamrft: no batch sampled twice, but 8 groups sampled with lost versions dropped
    gens = [(99.0 + i, "explorer-0", i, 256) for i in range(1, 15)]
    ours = bench.crash_figures(
        "fixed-1",
        0,
        timeline(
            90.0, steps, [(140.0, 12, 0.97)], gens, [(106.5, 6)], summary={"stale_dropped": 8}
        ),
        timeline(90.0, whole_steps, [(112.0, 12, 0.98)], summary={"stale_dropped": 0}),
        8,
    )
    assert (ours["rollouts_regenerated"], ours["rollouts_dropped"], ours["rollouts_lost"]) == (
        0,
        64,
        64,
    )
