"""Reliability drills: kill, cut off and corrupt parts of a real run; check the books.

    python bench/reliability.py [--drills explorer_kill,trainer_kill,...] [--dir DIR]

Each drill (see ``tests.harness.drills``) runs ``streamrft run`` on its own local broker
and object store with two explorers, injects one fault mid-run, lets the run finish and
reads the topics back. Printed: a table (drill, recovered, time to recover, tasks lost,
duplicates trained, dead letters) and a final JSON line with the totals.

"recovered" means: the run finished every step with exit code 0, every fed task was
trained exactly once (or dropped for a counted reason), every dead letter came from a
message the drill injected as invalid, and the drill's own evidence of the fault (a
restart, a rejected version, 1,000+ injected messages) is there. "time to recover" is
from the end of the fault to the first training step completed after it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# the drills are test tooling (tests/harness/), not part of the installed package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness.drills import DRILLS, run_drill

COLUMNS = (
    ("drill", 15),
    ("recovered", 9),
    ("recover_s", 9),
    ("tasks_fed", 9),
    ("tasks_lost", 10),
    ("duplicates_trained", 18),
    ("dead_letters", 12),
    ("dead_letters_unaccounted", 24),
    ("wall_s", 7),
)


def _cell(row: dict, key: str) -> str:
    value = row[key]
    if key == "recovered":
        return "y" if value else "n"
    if value is None:
        return "-"
    return str(value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drills", default=",".join(DRILLS), help="comma-separated drill names")
    p.add_argument("--dir", help="work folder (default: a temporary one)")
    args = p.parse_args()
    names = [n for n in args.drills.split(",") if n]
    unknown = sorted(set(names) - set(DRILLS))
    if unknown:
        p.error(f"unknown drills {unknown}; choose from {sorted(DRILLS)}")
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="reliability-"))
    print(f"# drills in {workdir}", file=sys.stderr)
    rows = []
    started = time.monotonic()
    header = " | ".join(k.ljust(w) for k, w in COLUMNS)
    print(header)
    print("-" * len(header))
    for name in names:
        row = run_drill(name, workdir).row()
        rows.append(row)
        print(" | ".join(_cell(row, k).ljust(w) for k, w in COLUMNS), flush=True)
        print(f"#   {name}: {json.dumps(row['detail'])}", file=sys.stderr)
    totals = {
        "bench": "reliability",
        "drills": len(rows),
        "recovered": sum(1 for r in rows if r["recovered"]),
        "tasks_lost": sum(r["tasks_lost"] for r in rows),
        "duplicates_trained": sum(r["duplicates_trained"] for r in rows),
        "dead_letters": sum(r["dead_letters"] for r in rows),
        "dead_letters_unaccounted": sum(r["dead_letters_unaccounted"] for r in rows),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(totals))
    return 0 if totals["recovered"] == totals["drills"] else 1


if __name__ == "__main__":
    sys.exit(main())
