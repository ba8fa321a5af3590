"""The state file local services record themselves in (``<dir>/services.json``): where
they listen, their pids and the object store's credentials, readable by its owner only.
Written by the services that start (``infra/local``); read by any process that looks for
them (the endpoint resolver, ``streamrft infra status``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streamrft.infra.durable import replace_durably
from streamrft.infra.pids import pid_is, port_open
from streamrft.schemas.errors import ServiceError

STATE_FILE = "services.json"


def state_file(state_dir: Path) -> Path:
    """The state file of the services recorded in ``state_dir`` (owner-readable only: it
    holds the object store's credentials)."""
    return Path(state_dir).expanduser().absolute() / STATE_FILE


def write_state(state_dir: Path, state: dict[str, Any]) -> Path:
    """Write the state file atomically, readable by its owner only; returns its path."""
    path = state_file(state_dir)
    replace_durably(path, json.dumps(state, indent=2).encode(), mode=0o600)
    return path


def read_state(state_dir: Path) -> dict[str, Any] | None:
    path = state_file(state_dir)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ServiceError(f"unreadable state file {path}: {e}") from e


def status(state_dir: Path) -> dict[str, Any] | None:
    """The contents of ``state_dir/services.json`` with liveness added, or None if absent.

    Each entry of ``services`` gains ``alive`` (the pid is still the recorded process) and
    ``port_open`` (a TCP connect succeeds); ``running`` is true when every recorded
    service is alive and answering.
    """
    state = read_state(state_dir)
    if state is None:
        return None
    services = state.get("services", {})
    for rec in services.values():
        rec["alive"] = pid_is(int(rec["pid"]), rec.get("start_time"))
        rec["port_open"] = rec["alive"] and port_open(int(rec["port"]))
    state["running"] = bool(services) and all(
        r["alive"] and r["port_open"] for r in services.values()
    )
    return state
