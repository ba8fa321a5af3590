"""What importing a module loads, seen from a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys


def modules_after_import(module: str) -> set[str]:
    """Every module in ``sys.modules`` of a new Python process after ``import module``."""
    code = f"import sys, json, {module}\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout))


def roots(modules: set[str]) -> set[str]:
    """The top-level packages of ``modules``."""
    return {m.split(".")[0] for m in modules}
