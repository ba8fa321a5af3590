"""The pure parts of a replay: the offsets file, start offsets against a topic's
partitions, and where a replay resumes (``consumers/replay.py``)."""

from __future__ import annotations

import pytest

from streamrft.consumers.replay import (
    ReplayBounds,
    ReplayCursor,
    check_start,
    parse_offsets,
    read_offsets_file,
)
from streamrft.schemas.errors import ConfigError

TOPIC = "streamrft.old.experiences"
FIRST = {0: 0, 1: 0, 2: 5}
END = {0: 10, 1: 0, 2: 20}


def test_an_offsets_file_maps_partitions_to_offsets(tmp_path):
    path = tmp_path / "offsets.json"
    path.write_text('{"0": 3, "1": 0, "2": 17}')
    assert read_offsets_file(path) == {0: 3, 1: 0, 2: 17}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object of partition to offset"),
        ("{}", "expected a JSON object of partition to offset"),
        ('{"zero": 1}', "partition 'zero' is not a partition number"),
        ('{"-1": 1}', "partition '-1' is not a partition number"),
        ('{"0": -4}', "partition 0: offset -4 is negative"),
        ('{"0": 1.5}', "partition 0: offset 1.5 is not an integer"),
        ('{"0": true}', "partition 0: offset True is not an integer"),
        ('{"0": "7"}', "partition 0: offset '7' is not an integer"),
    ],
)
def test_a_malformed_offsets_file_is_a_clear_error(text, message):
    with pytest.raises(ConfigError, match="--from-offsets") as err:
        parse_offsets(text)
    assert message in str(err.value)


def test_a_missing_offsets_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_offsets_file(tmp_path / "nope.json")


def test_start_offsets_are_checked_against_the_partitions():
    check_start(TOPIC, {0: 0, 1: 0, 2: 20}, FIRST, END)  # an end offset reads nothing: fine
    with pytest.raises(ConfigError, match="has partitions 0-2; no partition 3"):
        check_start(TOPIC, {0: 0, 1: 0, 2: 5, 3: 0}, FIRST, END)
    with pytest.raises(ConfigError, match="missing 1, 2"):
        check_start(TOPIC, {0: 0}, FIRST, END)
    with pytest.raises(
        ConfigError, match=r"partition 0: offset 11 is outside .* \(0 to its end 10\)"
    ):
        check_start(TOPIC, {0: 11, 1: 0, 2: 5}, FIRST, END)
    with pytest.raises(ConfigError, match=r"partition 2: offset 4 is outside"):
        check_start(TOPIC, {0: 0, 1: 0, 2: 4}, FIRST, END)  # below what the topic keeps


def test_a_checkpoint_of_the_same_stream_wins_over_the_start_and_another_is_refused():
    cursor = ReplayCursor(ReplayBounds(TOPIC, {0: 0, 1: 0, 2: 5}, END))
    assert cursor.first_offsets({}) == {0: 0, 1: 0, 2: 5}
    assert cursor.first_offsets({(TOPIC, 0): 7}) == {0: 7, 1: 0, 2: 5}
    with pytest.raises(ConfigError, match=r"trained from streamrft\.other\.experiences"):
        cursor.first_offsets({("streamrft.other.experiences", 0): 7})


def test_bounds_count_and_describe_the_records_between_them():
    bounds = ReplayBounds(TOPIC, {0: 2, 1: 0, 2: 5}, END)
    assert bounds.records == 8 + 0 + 15
    assert bounds.describe() == f"{TOPIC} offsets {{0: 2-10, 1: 0-0, 2: 5-20}} (23 records)"
