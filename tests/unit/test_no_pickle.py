"""No pickle anywhere: messages are msgspec, weights and checkpoints are safetensors + JSON.

The project's source is parsed (not grepped, so docstrings saying "no pickle" are fine) and
every way of reaching pickle is refused: the pickle-based libraries, ``torch.load`` without
``weights_only=True``, ``torch.save``, numpy's ``allow_pickle=True``, pandas'
``read_pickle``, and a Hugging Face model load that could fall back to a ``.bin`` file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.unit

SOURCE_DIRS = (
    "schemas",
    "producers",
    "consumers",
    "sync",
    "infra",
    "client",
    "bench",
    "tools",
    "examples",
)
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve"}


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(
        kw.arg == name and isinstance(kw.value, ast.Constant) and kw.value.value is True
        for kw in call.keywords
    )


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def pickle_uses(source: str, filename: str = "<string>") -> list[str]:
    """Every pickle route in ``source``, as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLING_MODULES:
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLING_MODULES:
                found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and _dotted(node).split(".")[0] in PICKLING_MODULES:
            found.append(f"{where}: {_dotted(node)}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            short = name.rsplit(".", 1)[-1]
            if name == "torch.load" and not _keyword_is_true(node, "weights_only"):
                found.append(f"{where}: torch.load without weights_only=True")
            elif name == "torch.save":
                found.append(f"{where}: torch.save (pickle); use safetensors")
            elif short == "read_pickle" or short == "to_pickle":
                found.append(f"{where}: {name}")
            elif short == "load" and _keyword_is_true(node, "allow_pickle"):
                found.append(f"{where}: {name}(allow_pickle=True)")
            elif (
                short == "from_pretrained"
                and "Model" in name
                and "PeftModel" not in name
                and not _keyword_is_true(node, "use_safetensors")
                and not any(k.arg == "gguf_file" for k in node.keywords)  # GGUF: no pickle
            ):
                found.append(f"{where}: {name} without use_safetensors=True")
    return found


def test_the_scanner_finds_every_route():
    bad = """
import pickle
import cloudpickle as cp
from dill import dumps
import joblib.externals
x = pickle.loads(b"")
torch.load("w.pt")
torch.load("w.pt", weights_only=False)
torch.save(model.state_dict(), "w.pt")
pd.read_pickle("f")
np.load("a.npy", allow_pickle=True)
AutoModelForCausalLM.from_pretrained(path)
"""
    assert len(pickle_uses(bad)) == 11
    fine = '''
"""No pickle anywhere."""
torch.load("w.pt", weights_only=True)
np.load("a.npy")
AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)
AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf")
AutoTokenizer.from_pretrained(path)
safetensors.torch.save_file(tensors, "w.safetensors")
'''
    assert pickle_uses(fine) == []


def test_no_pickle_in_the_project():
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 30
    found = [hit for p in files for hit in pickle_uses(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


class _Trap:
    """Unpickling this creates a file: proof that a loader ran pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickled_checkpoint_is_refused_not_loaded(tmp_path):
    import pickle  # the test writes the hostile file; the project never imports pickle

    from streamrft.infra.config import ModelConfig
    from streamrft.infra.modeling import load_policy, save_policy
    from streamrft.schemas import ConfigError

    tiny = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)
    model, tokenizer = load_policy(tiny)
    folder = save_policy(model, tokenizer, tmp_path / "hf")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(marker)))
    with pytest.raises(ConfigError, match=r"model\.path: .*model\.safetensors"):
        load_policy(ModelConfig(source="path", path=str(folder)))
    assert not marker.exists()
