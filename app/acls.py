"""``streamrft acls``: the ``kafka-acls.sh`` command lines that give each role's principal
what it needs on one run (``infra/access.py``'s table; docs/reference/kafka-acls.md)."""

from __future__ import annotations

import shlex

from streamrft.infra.access import ROLES, acl_rows
from streamrft.schemas.errors import ConfigError
from streamrft.schemas.topics import TopicNames


def parse_principals(pairs: list[str]) -> dict[str, str]:
    """``ROLE=PRINCIPAL`` pairs (``trainer=User:trainer``) by role."""
    out: dict[str, str] = {}
    for pair in pairs:
        role, sep, principal = pair.partition("=")
        if not sep or not principal:
            raise ConfigError(f"--principal {pair!r}: give ROLE=PRINCIPAL, e.g. trainer=User:rl")
        if role not in ROLES:
            raise ConfigError(f"--principal {pair!r}: no role {role!r}; roles: {', '.join(ROLES)}")
        out[role] = principal
    if not out:
        raise ConfigError("give at least one --principal ROLE=PRINCIPAL")
    return out


def kafka_acls_lines(topics: TopicNames, principals: dict[str, str], bootstrap: str) -> list[str]:
    """One ``kafka-acls.sh --add`` line per ACL of each role in ``principals``."""
    lines = []
    for row in acl_rows(topics, tuple(principals)):
        argv = [
            "kafka-acls.sh", "--bootstrap-server", bootstrap, "--add",
            "--allow-principal", principals[row.role], "--operation", row.operation,
            f"--{row.kind}", row.name,
        ]  # fmt: skip
        if row.pattern == "prefixed":
            argv += ["--resource-pattern-type", "prefixed"]
        lines.append(shlex.join(argv))
    return lines
