"""The reference pages (configuration, topics and schemas, command line) are generated from
the code."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from streamrft.infra.config import Config
from streamrft.schemas import (
    DeadLetter,
    Experience,
    ExperienceGroup,
    MetricsEvent,
    ModelVersionReady,
    ShardInfo,
    Shutdown,
    StatusEvent,
    SyncRequest,
    Task,
    TrainedGroup,
    WeightManifest,
)
from streamrft.schemas.codec import CODEC_BY_KIND
from streamrft.schemas.topics import TOPIC_KINDS
from tests.helpers.paths import ROOT
from tools import docgen

pytestmark = pytest.mark.unit

WIRE_STRUCTS = (
    Task,
    Experience,
    ExperienceGroup,
    ModelVersionReady,
    Shutdown,
    SyncRequest,
    StatusEvent,
    TrainedGroup,
    MetricsEvent,
    DeadLetter,
    ShardInfo,
    WeightManifest,
)
MARKED = """# Title

intro

<!-- BEGIN GENERATED: config -->
OLD GENERATED TEXT
<!-- END GENERATED: config -->

between

<!-- BEGIN GENERATED: schemas -->
<!-- END GENERATED: schemas -->

outro
"""


def split_sections(markdown: str, level: str) -> dict[str, str]:
    """Heading text -> the Markdown under it (up to the next heading of that level)."""
    parts = re.split(rf"^{level} (.+)$", markdown, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def rows(table: str) -> dict[str, list[str]]:
    """Field name -> the cells of its table row (``\\|`` inside a cell kept)."""
    out = {}
    for line in table.splitlines():
        m = re.match(r"^\| `([^`]+)` \|", line)
        if m:
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            out[m.group(1)] = [c.strip() for c in cells]
    return out


def expected_default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return "*required*"
    return "`" + json.dumps(msgspec.to_builtins(value)).replace("|", "\\|") + "`"


def config_page_sections(name: str) -> dict[str, str]:
    """The ``## `` sections of one Config section's page."""
    cls = dict(docgen.config_sections())[name]
    return split_sections(docgen.config_section_page(name, cls), "##")


def test_config_reference_has_every_field_with_its_default():
    assert [name for name, _ in docgen.config_sections()] == [
        f.name for f in msgspec.structs.fields(Config)
    ]
    for section in msgspec.structs.fields(Config):
        table = rows(config_page_sections(section.name)[section.name])
        fields = msgspec.structs.fields(section.type)
        assert list(table) == [f.name for f in fields], section.name
        for f in fields:
            assert table[f.name][2] == expected_default(f), f"{section.name}.{f.name}"
            assert table[f.name][4], f"{section.name}.{f.name} has no description"


def test_each_config_section_has_a_page_the_index_links_and_voice_accepts():
    from tools import voice

    index = docgen.config_reference()
    pages = docgen.config_pages()
    assert len(pages) == len(msgspec.structs.fields(Config))
    for section in msgspec.structs.fields(Config):
        path = f"{docgen.CONFIG_DIR}/{section.name}.md"
        assert f"[`{section.name}`](config/{section.name}.md)" in index, section.name
        assert pages[path].startswith(f"# Configuration: {section.name}\n")
        assert "[All sections](../configuration.md)" in pages[path]
        assert len(pages[path].splitlines()) < voice.MAX_LINES, path


def test_structs_inside_a_section_have_tables_of_their_own():
    from streamrft.infra.config import LoraConfig, TaskSource

    for section, title, cls in (
        ("model", "model.lora", LoraConfig),
        ("taskset", "taskset.sources[]", TaskSource),
    ):
        table = rows(config_page_sections(section)[title])
        assert list(table) == [f.name for f in msgspec.structs.fields(cls)], title
        assert all(cells[4] for cells in table.values()), title


def test_config_reference_types_bounds_and_descriptions():
    kafka = rows(config_page_sections("kafka")["kafka"])
    assert kafka["compression"][1] == r"`none \| gzip \| lz4 \| zstd \| snappy`"
    assert kafka["bootstrap_servers"][1] == r"`str \| None`"
    assert kafka["max_request_bytes"][2] == f"`{16 << 20}`"
    assert kafka["control_fetch_max_wait_ms"][3] == ">= 1, <= 1000"
    assert kafka["partitions"][1:4] == ["`int`", "`4`", "> 0"]
    assert kafka["topic_prefix"][4].startswith("First part of every topic name")
    run = rows(config_page_sections("run")["run"])
    assert "pattern `^[A-Za-z0-9_-]+$`" in run["id"][3]  # Meta inside `... | None`
    trainer = rows(config_page_sections("trainer")["trainer"])
    assert trainer["betas"][1:3] == ["`tuple[float, float]`", "`[0.9, 0.999]`"]
    # a docstring after a run of fields describes each of them
    model = rows(config_page_sections("model")["model"])
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "max_positions"):
        assert model[name][4] == "Tiny model shape.", name
    assert model["seed"][4] == "Seed of the tiny model's initial weights."


def test_section_pages_are_written_checked_and_pruned(tmp_path, monkeypatch, capsys):
    """The section pages are wholly generated: a missing or stale one fails --check and is
    written; a page of no section fails --check and is removed."""
    monkeypatch.chdir(tmp_path)
    reference = tmp_path / "docs" / "reference"
    reference.mkdir(parents=True)
    for page in docgen.PAGES:
        (tmp_path / page).write_text(docgen.render_page((ROOT / page).read_text()))
    assert docgen.main(["--check"]) == 1
    assert f"{docgen.CONFIG_DIR}/run.md is missing" in capsys.readouterr().out
    assert docgen.main([]) == 0
    assert docgen.main(["--check"]) == 0
    run_page = tmp_path / docgen.CONFIG_DIR / "run.md"
    run_page.write_text(run_page.read_text().replace("| `seed` |", "| `sead` |"))
    gone = tmp_path / docgen.CONFIG_DIR / "old_section.md"
    gone.write_text("# Configuration: old_section\n")
    capsys.readouterr()
    assert docgen.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "run.md is stale" in out and "old_section.md: no Config section" in out
    assert docgen.main([]) == 0
    assert not gone.exists()
    assert docgen.main(["--check"]) == 0


def test_schema_reference_has_every_wire_struct_and_field():
    text = docgen.schema_reference()
    structs = split_sections(text, "####")
    headings = {h.split()[0]: h for h in structs}
    for cls in WIRE_STRUCTS:
        assert cls.__name__ in headings, cls.__name__
        table = rows(structs[headings[cls.__name__]])
        fields = msgspec.structs.fields(cls)
        assert list(table) == [f.name for f in fields], cls.__name__
        for f in fields:
            assert table[f.name][2] == expected_default(f), f"{cls.__name__}.{f.name}"
    assert headings["ModelVersionReady"] == "ModelVersionReady (`type: model_version_ready`)"
    assert headings["Shutdown"] == "Shutdown (`type: shutdown`)"
    task = rows(structs["Task"])
    assert task["id"][3].startswith("Stable id of the task")
    # in schemas a docstring belongs to the field directly above it, never to its neighbours
    ready = rows(structs[headings["ModelVersionReady"]])
    assert ready["version"][3].startswith("The new version")
    assert ready["method"][3].startswith("How the weights travel")
    # and every wire field is documented
    for cls in WIRE_STRUCTS:
        table = rows(structs[headings[cls.__name__]])
        undocumented = [name for name, row in table.items() if not row[3]]
        assert not undocumented, f"{cls.__name__}: {undocumented}"


def test_schema_reference_topics_and_headers():
    text = docgen.schema_reference()
    assert "`streamrft-schema`" in text and "`streamrft-type`" in text
    for kind in TOPIC_KINDS:
        line = next(x for x in text.splitlines() if x.startswith(f"| `<prefix>.<run id>.{kind}`"))
        assert f"`{CODEC_BY_KIND[kind].name}`" in line
        partitions = line.rstrip(" |").rsplit("|", 1)[-1].strip()
        want = {
            "tasks": "`kafka.partitions`, at least `explorer.count`",
            "experiences": "`kafka.partitions`",
        }.get(kind, "1")
        assert partitions == want, kind
    assert set(docgen.TOPIC_KEYS) == set(TOPIC_KINDS)


def test_render_page_replaces_blocks_and_is_idempotent():
    once = docgen.render_page(MARKED)
    assert "OLD GENERATED TEXT" not in once
    assert once.startswith("# Title\n\nintro\n\n<!-- BEGIN GENERATED: config -->\n")
    assert once.endswith("<!-- END GENERATED: schemas -->\n\noutro\n")
    assert "\nbetween\n" in once
    assert docgen.config_reference().strip() in once
    assert docgen.schema_reference().strip() in once
    assert docgen.render_page(once) == once


@pytest.mark.parametrize(
    "broken",
    [
        "no markers at all\n",
        MARKED.replace("<!-- END GENERATED: config -->\n", ""),
        MARKED.replace("<!-- BEGIN GENERATED: schemas -->\n", ""),
        MARKED + "<!-- BEGIN GENERATED: config -->\n<!-- END GENERATED: config -->\n",
    ],
)
def test_render_page_raises_on_missing_markers(broken):
    with pytest.raises(ValueError, match=r"GENERATED|generated"):
        docgen.render_page(broken)


def test_main_check_and_write(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(MARKED)
    assert docgen.main(["--check", str(readme)]) == 1
    assert "stale" in capsys.readouterr().out
    assert readme.read_text() == MARKED
    assert docgen.main([str(readme)]) == 0
    assert docgen.main(["--check", str(readme)]) == 0
    (tmp_path / "bare.md").write_text("nothing\n")
    assert docgen.main(["--check", str(tmp_path / "bare.md")]) == 2


@pytest.mark.parametrize("page", docgen.PAGES)
def test_the_reference_pages_are_up_to_date(page):
    text = (ROOT / page).read_text()
    assert docgen.render_page(text) == text, f"{page} is stale; run: python -m tools.docgen"


def test_the_cli_reference_has_every_command_and_argument():
    from streamrft.app.cli import build_parser

    text = docgen.cli_reference()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    names = {c.dest for c in sub._choices_actions}
    for name in names:
        assert f"### streamrft {name}\n" in text, name
    assert "### streamrft bench" not in text and "(also: `bench`)" in text  # an alias
    score = text.split("### streamrft score")[1].split("### ")[0]
    assert "`--checkpoint CHECKPOINT`" in score and "`--require-publish`" in score
    assert "&lt;run dir&gt;/score.json" in score  # no HTML tag in the Markdown
    assert "--config" not in text.split("### streamrft status")[1].split("### ")[0]  # hidden
