"""The import-direction check (tools/check_layers.py) passes on the repo and catches a
wrong import of every kind it forbids."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tools import check_layers

pytestmark = pytest.mark.unit


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_repository_imports_run_one_way(capsys):
    assert check_layers.main([str(ROOT)]) == 0
    assert "all run one way" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("schemas/x.py", "from streamrft.infra.config import Config\n"),
        ("infra/x.py", "import streamrft.sync.weights\n"),
        ("infra/x.py", "def f():\n    from streamrft.app import cli\n"),  # lazy
        ("infra/local/x.py", "from streamrft.sync import lora\n"),
        ("sync/x.py", "from streamrft.producers.engine import Rollout\n"),
        ("consumers/x.py", "from streamrft.producers import evaluation\n"),  # sideways
        ("producers/x.py", "from streamrft.consumers.buffer import ExperienceBuffer\n"),
        ("producers/x.py", "from streamrft.infra.local.services import LocalServices\n"),
        ("sync/x.py", "from ..producers import engines\n"),  # relative
        ("infra/local/x.py", "from ...app import cli\n"),
        ("client/x.py", "from streamrft.app.process import setup_logging\n"),
    ],
)
def test_a_forbidden_import_fails_the_check(tmp_path, capsys, path, source):
    root = _tree(tmp_path, {path: source})
    assert check_layers.main([str(root)]) == 1
    assert f"{path}:" in capsys.readouterr().out


def test_allowed_imports_pass(tmp_path):
    root = _tree(
        tmp_path,
        {
            "app/x.py": "from streamrft.infra.local import services\n"
            "from streamrft.consumers import trainer\nfrom streamrft.producers import engine\n",
            "producers/x.py": "from streamrft.sync import styles\nfrom streamrft.infra import bus\n",
            "infra/local/x.py": "from streamrft.infra.config import Config\n",
            "schemas/x.py": "import msgspec\nfrom streamrft.schemas import codec\n",
            "sync/y.py": "from . import weights\nfrom ..infra import kafka\n",
        },
    )
    assert check_layers.main([str(root)]) == 0


def test_graph_lists_layer_edges(tmp_path, capsys):
    root = _tree(tmp_path, {"sync/x.py": "from streamrft.infra import kafka\n"})
    assert check_layers.main([str(root), "--graph"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        "sync -> infra: 1 imports",
        "import circles: none (registries apart: "
        "streamrft.sync.transport, streamrft.consumers.train_engine)",
    ]


def test_an_import_circle_fails_even_through_a_lazy_import(tmp_path, capsys):
    root = _tree(
        tmp_path,
        {
            "consumers/a.py": "from streamrft.consumers.b import B\n",
            "consumers/b.py": "from streamrft.consumers import c\n",
            "consumers/c.py": "def f():\n    from streamrft.consumers.a import A\n",
        },
    )
    assert check_layers.main([str(root)]) == 1
    out = capsys.readouterr().out
    assert "import circle: streamrft.consumers.a <-> streamrft.consumers.b <-> " in out


def test_a_registry_line_may_close_a_circle(tmp_path):
    registry = "def make(name):\n    from streamrft.consumers import fsdp_engine\n"
    files = {
        "consumers/train_engine.py": registry,
        "consumers/fsdp_engine.py": "from streamrft.consumers.train_engine import make\n",
    }
    assert check_layers.main([str(_tree(tmp_path, files))]) == 0
    # the same import at the top of the registry's module is a circle
    files["consumers/train_engine.py"] = "from streamrft.consumers import fsdp_engine\n"
    assert check_layers.main([str(_tree(tmp_path, files))]) == 1
