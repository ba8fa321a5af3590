"""Where a command finds the broker and the object store when its config names none.

One resolver for every command (``run``, ``train``/``explore``/``feed``, ``topics``/``tail``;
``runs`` reads every run's embedded services under ``run.dir``, :func:`runs_running`), in
this order, each only for what is still missing:

1. the config (``kafka.bootstrap_servers``, ``object_store.endpoint``) and the command line;
2. for a process joining a run (``--run-id``): the run's own embedded services, recorded in
   ``<run dir>/services/services.json`` while they run; else the run's resolved
   ``<run dir>/config.yaml``;
3. the services of ``streamrft infra up`` (``<run.dir>/infra``, or ``--dir``).

What is still missing after that, ``streamrft run`` starts itself (embedded services).

Embedded services have an object-store secret generated for them (never the public
default); an object store found in their state file comes with the credentials recorded
there (the file is readable by its owner only), so a process of the same user on the same
host joins with no secret of its own. A process elsewhere cannot reach them (they listen
on 127.0.0.1): it uses a real broker and store, whose credentials it is given in its
environment (``STREAMRFT_S3_SECRET_KEY``...) or config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import msgspec
import yaml

from streamrft.infra.config import Config, KafkaConfig, with_endpoints, with_store_credentials
from streamrft.infra.service_state import status
from streamrft.schemas.errors import ServiceError, StreamRFTError

log = logging.getLogger(__name__)

INFRA_DIR = "infra"
"""Folder under ``run.dir`` where ``streamrft infra up`` keeps its state by default."""


@dataclass(frozen=True)
class Found:
    """Endpoints found outside the config, and where (for the log)."""

    bootstrap_servers: str | None
    s3_endpoint: str | None
    source: str
    access_key: str | None = None
    secret_key: str | None = None
    """The object store's credentials, where recorded with it (embedded services)."""


def _recorded(eps: dict, source: str) -> Found:
    return Found(
        eps.get("bootstrap_servers"),
        eps.get("s3_endpoint"),
        source,
        eps.get("access_key"),
        eps.get("secret_key"),
    )


def infra_up(state_dir: Path) -> Found | None:
    """The running services of ``streamrft infra up`` in ``state_dir``, if any."""
    shared = status(state_dir)
    if not (shared and shared.get("running")):
        return None
    return _recorded(shared["endpoints"], f"`streamrft infra up` in {state_dir}")


def runs_running(runs_dir: Path) -> list[Found]:
    """The embedded services of every run under ``runs_dir`` (``<run dir>/services``) that
    are running now, by run id: what ``streamrft runs`` reads besides a broker it is named."""
    found = []
    for state_dir in sorted(Path(runs_dir).glob("*/services")):
        try:
            own = status(state_dir)
        except ServiceError as exc:  # one run's damaged state file: the others stand
            log.warning("%s", exc)
            continue
        if own and own.get("running"):
            run = state_dir.parent.name
            found.append(_recorded(own["endpoints"], f"run {run} (its embedded services)"))
    return found


def of_run(cfg: Config) -> Found | None:
    """The broker and store of the run ``cfg`` names (a process joining it).

    A run that started embedded services records them in ``<run dir>/services`` while they
    run (checked alive); otherwise its resolved ``<run dir>/config.yaml`` names them.
    """
    own = status(cfg.run_dir / "services")
    if own is not None:
        if not own.get("running"):
            raise StreamRFTError(
                f"run {cfg.run.id}: its embedded services ({cfg.run_dir / 'services'}) are "
                "not running; has the run ended?"
            )
        return _recorded(own["endpoints"], f"run {cfg.run.id} (its embedded services)")
    return of_run_config(cfg)


def of_run_config(cfg: Config) -> Found | None:
    """The endpoints the run's resolved ``<run dir>/config.yaml`` names, if any."""
    resolved = cfg.run_dir / "config.yaml"
    if not resolved.is_file():
        return None
    data = yaml.safe_load(resolved.read_text()) or {}
    found = Found(
        (data.get("kafka") or {}).get("bootstrap_servers"),
        (data.get("object_store") or {}).get("endpoint"),
        f"run {cfg.run.id} ({resolved})",
    )
    return found if found.bootstrap_servers or found.s3_endpoint else None


def resolve(cfg: Config, joining: bool) -> tuple[Config, str | None]:
    """``cfg`` with missing endpoints filled in (see the module docstring), and where they
    came from (None: nothing was missing, or nothing found)."""
    if cfg.kafka.bootstrap_servers and cfg.object_store.endpoint:
        return cfg, None
    found = (of_run(cfg) if joining else None) or infra_up(Path(cfg.run.dir) / INFRA_DIR)
    if found is None:
        return cfg, None
    filled = with_endpoints(
        cfg,
        None if cfg.kafka.bootstrap_servers else found.bootstrap_servers,
        None if cfg.object_store.endpoint else found.s3_endpoint,
    )
    if not cfg.object_store.endpoint and found.s3_endpoint:  # that store's own credentials
        filled = with_store_credentials(filled, found.access_key, found.secret_key)
    return filled, found.source


def kafka_for_tools(
    config_path: str | None, bootstrap: str | None, infra_dir: str | Path
) -> KafkaConfig:
    """The broker of ``topics`` / ``tail``: ``--bootstrap``, the config's, or ``infra up``'s;
    with a config, its security settings (TLS, SASL) too."""
    from streamrft.infra.config import load_config

    kafka_cfg = load_config(config_path).kafka if config_path else KafkaConfig()
    if bootstrap and not config_path:
        log.warning(
            "no config: connecting to %s in PLAINTEXT (no TLS, no SASL); pass a config "
            "naming kafka.security_protocol for a secured broker",
            bootstrap,
        )
    bootstrap = bootstrap or kafka_cfg.bootstrap_servers
    if not bootstrap:
        found = infra_up(Path(infra_dir))
        bootstrap = found.bootstrap_servers if found else None
    if not bootstrap:
        raise StreamRFTError(
            "no broker: pass --bootstrap HOST:PORT, a config naming one, or run `streamrft infra up`"
        )
    return msgspec.structs.replace(kafka_cfg, bootstrap_servers=bootstrap)
