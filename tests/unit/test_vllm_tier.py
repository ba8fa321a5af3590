"""The opt-in vLLM tier still resolves under its pins (tools/vllm_tier.py).

Nothing else runs the tier (``make test-vllm``, its own venv): a change of the package's
requirements that the tier's pins refuse would go unseen until someone builds it. The
first test decides it for this tree, without the index when the pins tell, else by pip's
dry run (skipped only when the index cannot be reached); the others check both steps on
small cases whose answer is known.
"""

from __future__ import annotations

import pytest

from tools import vllm_tier
from tools.vllm_tier import offline_verdict, pip_dry_run, render

PINS = "websockets==17.4\nopenai==3.57.0\npytest==9.2.0\n"


def test_the_vllm_tier_resolves_under_its_constraints():
    requirements = vllm_tier.tier_requirements()
    assert requirements[0] == vllm_tier.VLLM_SPEC
    assert "pytest>=8" in requirements  # the vllm-test extra, not the whole test extra
    verdict = offline_verdict(requirements, vllm_tier.CONSTRAINTS.read_text())
    assert verdict.resolves is not False, "\n".join(verdict.reasons)
    if verdict.resolves:
        return
    problem = vllm_tier.index_problem()
    if problem:
        pytest.skip(f"the pins leave it to pip ({'; '.join(verdict.reasons)}), and {problem}")
    answer = pip_dry_run(requirements, vllm_tier.CONSTRAINTS)
    assert answer.returncode == 0, (
        f"the vLLM tier does not resolve under {vllm_tier.CONSTRAINTS} "
        f"(make test-vllm would fail); pip says:\n{answer.output}"
    )


def test_a_requirement_that_refuses_a_pin_fails_without_the_index():
    """What broke the tier once: a test dependency asking for websockets<17 beside a
    tier that pins 17.4."""
    verdict = offline_verdict(["pytest>=8", "websockets<17"], render(PINS))
    assert verdict.resolves is False
    assert verdict.reasons == ("'websockets<17' refuses the tier's pin websockets==17.4",)


def test_pinned_requirements_resolve_and_markers_of_other_platforms_are_left_out():
    verdict = offline_verdict(
        [
            "pytest>=8",
            "Websockets>=15,<18",
            "openai>=1.40",
            "pywin32>=300; sys_platform == 'win32'",
        ],
        render(PINS),
    )
    assert verdict == vllm_tier.Verdict(True)


def test_what_the_pins_cannot_tell_is_left_to_pip():
    unpinned = offline_verdict(["pytest>=8", "openai-agents>=0.24"], render(PINS))
    assert unpinned.resolves is None
    assert "openai-agents" in unpinned.reasons[0]
    extras = offline_verdict(["openai[realtime]>=1.40"], render(PINS))
    assert extras.resolves is None and "extras ['realtime']" in extras.reasons[0]
    # a pin edited by hand: the digest no longer matches, so the set is not pip's
    edited = render(PINS).replace("openai==3.57.0", "openai==3.58.0")
    by_hand = offline_verdict(["openai>=1.40"], edited)
    assert by_hand.resolves is None and "edited by hand" in by_hand.reasons[0]
    loose = offline_verdict(["openai>=1.40"], render(PINS + "numpy>=2\n"))
    assert loose.resolves is None and "'numpy>=2' is not a pin" in loose.reasons[0]


def test_a_refused_pin_wins_over_open_questions():
    verdict = offline_verdict(["openai-agents>=0.24", "websockets<17"], render(PINS))
    assert verdict.resolves is False and len(verdict.reasons) == 1


@pytest.mark.timeout(300)
def test_pip_decides_with_its_own_error(tmp_path):
    """The second step on one small project, through the real index: a range the pin
    meets resolves, one it refuses fails with pip's ResolutionImpossible."""
    problem = vllm_tier.index_problem()
    if problem:
        pytest.skip(problem)
    constraints = tmp_path / "tier.constraints"
    constraints.write_text(render("websockets==17.0\n"))
    fine = pip_dry_run(["websockets>=16,<18"], constraints)
    assert fine.returncode == 0, fine.output
    assert fine.unpinned == ()
    refused = pip_dry_run(["websockets<17"], constraints)
    assert refused.returncode != 0
    assert "ResolutionImpossible" in refused.output, refused.output
    assert "websockets" in refused.output
