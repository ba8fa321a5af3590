"""The GSM8K recipes (``examples/gsm8k/``) validate and fit: each file, pointed at the local
GSM8K-shaped sample and a folder of Qwen2.5-1.5B-Instruct's shape, passes ``streamrft
validate`` (GPUs absent here are reported, not refused) and ``streamrft plan`` on 80 GiB,
and the plan in its comment block is what ``plan`` computes today."""

from __future__ import annotations

import pytest
import yaml

from streamrft.app.cli import main
from streamrft.app.plan import make_plan
from streamrft.infra.config import load_config
from streamrft.infra.memory_plan import parse_size
from tests.helpers.paths import ROOT
from tests.helpers.qwen_shape import write_qwen_shaped
from tests.helpers.recipes import RECIPES, comment_plan, local_overrides, plan_lines

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_qwen_shaped(tmp_path_factory.mktemp("qwen") / "qwen2.5-1.5b-instruct")


def test_there_are_the_five_recipes():
    names = [r.stem for r in RECIPES]
    assert names == ["eight_gpus", "one_gpu_full", "one_gpu_lora", "one_gpu_vllm", "two_gpus"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_validates_and_fits_as_its_comment_says(recipe, qwen, capsys):
    settings = local_overrides(qwen)
    assert main(["validate", str(recipe), *settings]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "config ok" in out and "1,543" not in out
    assert main(["plan", str(recipe), *settings, "--device-memory", "80GiB"]) == 0
    assert "does NOT fit" not in capsys.readouterr().out
    cfg = load_config(recipe, [settings[i + 1] for i in range(0, len(settings), 2)])
    expected = plan_lines(make_plan(cfg, None, parse_size("80GiB")))
    assert comment_plan(recipe.read_text()) == expected
    text = recipe.read_text()
    assert "never run" in text.split("\nrun:")[0]  # what ran where, said in its header


def needed_extras(recipe) -> list[str]:
    """The extras a recipe needs, from its fields: `data` for a Parquet task set, `vllm`
    when an explorer or the evaluator runs the vLLM engine."""
    raw = yaml.safe_load(recipe.read_text())
    extras = ["data"] if str(raw["taskset"]["path"]).endswith(".parquet") else []
    engines = {raw["explorer"].get("engine"), (raw.get("eval") or {}).get("engine")}
    return extras + (["vllm"] if "vllm" in engines else [])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_and_the_recipes_table_name_the_extras_it_needs(recipe):
    extras = needed_extras(recipe)
    header = recipe.read_text().split("\nrun:")[0]
    assert f"pip install -e '.[{','.join(extras)}]'" in header
    assert ("`vllm`" in header) == ("vllm" in extras)
    page = (ROOT / "docs" / "real-model.md").read_text()
    row = next(x for x in page.splitlines() if x.startswith(f"| `{recipe.name}` |"))
    assert row.split("|")[2].strip() == ", ".join(f"`{e}`" for e in extras), row
