"""Reading answers out of responses, and the math and format rewards, on hand-made cases."""

from __future__ import annotations

from fractions import Fraction

import pytest

from streamrft.producers.answers import (
    answers_match,
    boxed_contents,
    extract_answer,
    has_answer_format,
    last_number,
    parse_number,
)
from streamrft.producers.rewards import (
    REWARDS,
    answer_format,
    get_reward,
    math_answer,
    math_answer_format,
)
from streamrft.producers.rewards import last_number as last_number_reward
from streamrft.schemas.experience import Task

pytestmark = pytest.mark.unit


def task(answer: str) -> Task:
    return Task(id="t", prompt="?", answer=answer)


# -- extraction ------------------------------------------------------------------------------


def test_boxed_keeps_nested_braces_and_skips_an_unclosed_one():
    assert boxed_contents(r"so \boxed{\frac{3}{4}} done") == [r"\frac{3}{4}"]
    assert boxed_contents(r"\boxed{a{b{c}}d} and \boxed{2}") == ["a{b{c}}d", "2"]
    assert boxed_contents(r"\boxed{12") == []
    assert boxed_contents(r"\boxed{1} then \boxed{2") == ["1"]
    assert boxed_contents("no box") == []


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("The answer is <answer>12</answer>.", "12"),
        ("<answer> 7 </answer>", "7"),
        ("<answer>3</answer> wait, <answer>4</answer>", "4"),  # the last tag counts
        ("<ANSWER>5</ANSWER>", "5"),
        ("<answer>\n41\n</answer>", "41"),
        (r"so \boxed{8}", "8"),
        (r"\boxed{8} no, \boxed{9}", "9"),  # the last box counts
        (r"<answer>\boxed{6}</answer>", "6"),  # a box inside the tag is unwrapped
        (r"<answer>6</answer> and \boxed{7}", "6"),  # a tag wins over a box
        ("12", None),
        ("<answer>12", None),  # an unclosed tag marks nothing
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected
    assert has_answer_format(response) == (expected is not None)


# -- numbers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12", Fraction(12)),
        ("-3", Fraction(-3)),
        ("+3", Fraction(3)),
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{1}{3}", Fraction(1, 3)),
        ("1,234", Fraction(1234)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("$12", Fraction(12)),
        (r"\$12", Fraction(12)),
        ("12.", Fraction(12)),
        (" 42 ", Fraction(42)),
        ("12 apples", None),
        ("1,23", None),  # not a thousands separator
        ("1/0", None),
        ("1/2/3", None),
        ("abc", None),
        ("", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_answers_match_numbers_within_tolerance_else_normalized_text():
    assert answers_match("12", "12.0")
    assert answers_match("0.75", "3/4")
    assert answers_match("1,000", "1000")
    assert answers_match("$5.", "5")
    assert answers_match("1000000.5", "1000000")  # within a relative 1e-6
    assert not answers_match("1000002", "1000000")  # beyond it
    assert not answers_match("12", "13")
    assert answers_match(" Paris. ", "paris")
    assert answers_match("x  +  1", "X + 1")
    assert not answers_match("12 apples", "12")


@pytest.mark.parametrize("digits", [400, 5000])
def test_a_very_long_number_is_no_number_and_scores_zero(digits):
    """``float`` overflows past ~308 digits and ``Fraction`` refuses 4300: a response of
    thousands of digits is not read as a number (compared as text), and never raises."""
    long = "9" * digits
    assert parse_number(long) is None and parse_number(f"1/{long}") is None
    assert not answers_match(long, "12") and not answers_match("12", long)
    for response in (f"<answer>{long}</answer>", long, f"so \\boxed{{{long}}}"):
        for reward in (math_answer, math_answer_format, last_number_reward):
            value, info = reward(response, task("12"))
            assert info["correct"] == 0.0 and value <= 0.1 + 1e-9  # at most the format bonus
    assert answers_match(long, long)  # equal text is still equal


def test_numbers_compare_exactly_without_float():
    """Huge and tiny numbers within :data:`MAX_NUMBER_CHARS` compare as exact fractions."""
    big = "1" + "0" * 90
    assert answers_match(big, big + ".0") and not answers_match(big, "2" + "0" * 90)
    assert answers_match("1" + "0" * 80 + "1", "1" + "0" * 81)  # within 1e-6
    assert not answers_match("1e-400", "0")  # text, not a number
    assert answers_match("0", "0.0") and not answers_match("0", "0.000001")


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("the answer is 1,234", "1,234"),
        ("it costs 1,234,567.25 dollars", "1,234,567.25"),
        ("3 then -2,000", "-2,000"),
        ("a list 3,4,5", "5"),
        ("1,2345", "2345"),  # not a thousands group
        ("x=-7.5.", "-7.5"),
        ("no digits", None),
    ],
)
def test_last_number_reads_thousands_separators(text, number):
    assert last_number(text) == number


def test_the_last_number_fallback_and_reward_read_thousands_separators():
    assert math_answer("the answer is 1,234", task("1234"))[0] == 1.0
    assert last_number_reward("the answer is 1,234", task("1234")) == (
        1.0,
        {"correct": 1.0, "has_number": 1.0},
    )
    assert last_number_reward("the answer is 1,234", task("234"))[0] == 0.0


# -- rewards ---------------------------------------------------------------------------------


def test_rewards_are_registered():
    for name, fn in (
        ("math_answer", math_answer),
        ("format", answer_format),
        ("math_answer_format", math_answer_format),
    ):
        assert REWARDS[name] is fn and get_reward(name) is fn


@pytest.mark.parametrize(
    ("response", "answer", "correct", "fmt"),
    [
        ("Tom has 12. <answer>12</answer>", "12", 1.0, 1.0),
        ("<answer>11</answer>", "12", 0.0, 1.0),
        (r"7 + 5 = \boxed{12}", "12", 1.0, 1.0),
        ("7 + 5 = 12", "12", 1.0, 0.0),  # no mark: the last number written
        ("12 ... or 13", "12", 0.0, 0.0),
        ("<answer>12</answer> or 13", "12", 1.0, 1.0),  # the mark wins over the last number
        ("no idea", "12", 0.0, 0.0),
        ("<answer>3/4</answer>", "0.75", 1.0, 1.0),
    ],
)
def test_math_format_and_combined_rewards(response, answer, correct, fmt):
    value, info = math_answer(response, task(answer))
    assert value == correct and info == {"correct": correct, "format": fmt}
    assert answer_format(response, task(answer)) == (fmt, {"format": fmt})
    combined, info = math_answer_format(response, task(answer))
    assert combined == pytest.approx(0.9 * correct + 0.1 * fmt)
    assert info["correct"] == correct
