"""Where the repository's files are, for tests and the test harness."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""
EXAMPLE = ROOT / "examples" / "arithmetic.yaml"
"""The default example config."""
ADDITION = ROOT / "examples" / "data" / "addition.jsonl"
"""The example taskset (100 single-digit additions)."""
