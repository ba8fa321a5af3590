"""Security settings: TLS/SASL rules, credentials from the environment, redaction, and the
options every aiokafka client and the S3 client get."""

from __future__ import annotations

import asyncio
import ssl

import pytest
import yaml
from aiokafka.admin import AIOKafkaAdminClient

from streamrft.infra import kafka
from streamrft.infra.config import (
    ENV_CREDENTIALS,
    REDACTED,
    UNUSED_SECRET,
    from_dict,
    load_config,
    to_yaml,
)
from streamrft.schemas.errors import ConfigError
from streamrft.sync.object_store import tls_options
from tests.helpers.certs import make_certs
from tests.helpers.configs import cfg_of, write_config

pytestmark = pytest.mark.unit

PASSWORD = "pw-9f3a61c7e2"
SECRET = "sk-5b0d8e44a1"


@pytest.fixture(autouse=True)
def _no_credentials_in_env(monkeypatch):
    for var in ENV_CREDENTIALS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def on_disk(**sections) -> dict:
    """A config dict whose taskset is the one :func:`write_config` writes."""
    return {"taskset": {"path": "data/tasks.jsonl"}, **sections}


def sasl(**kafka) -> dict:
    return {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "alice",
        "sasl_password": PASSWORD,
        **kafka,
    }


# -- cross-field rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sections", "pattern"),
    [
        (
            {"kafka": {"security_protocol": "TLS"}},
            r"^kafka\.security_protocol: Invalid enum value 'TLS'; expected one of PLAINTEXT, "
            r"SASL_PLAINTEXT, SASL_SSL, SSL$",
        ),
        (
            {"kafka": sasl(sasl_mechanism=None, security_protocol="SASL_SSL")},
            r"^kafka\.sasl_mechanism: required with kafka\.security_protocol SASL_SSL$",
        ),
        (
            {"kafka": sasl(sasl_username=None)},
            r"^kafka\.sasl_username: required .* \(or set STREAMRFT_KAFKA_SASL_USERNAME\)$",
        ),
        (
            {"kafka": sasl(sasl_password="")},
            r"^kafka\.sasl_password: required .* \(or set STREAMRFT_KAFKA_SASL_PASSWORD\)$",
        ),
        (
            {"kafka": {"sasl_mechanism": "PLAIN"}},
            r"^kafka\.sasl_mechanism: only used with .* not PLAINTEXT$",
        ),
        (
            {"kafka": sasl(ssl_cafile="/etc/hosts")},
            r"^kafka\.ssl_cafile: only used with kafka\.security_protocol SSL or SASL_SSL",
        ),
        (
            {"kafka": {"security_protocol": "SSL", "ssl_cafile": "/nonexistent/ca.pem"}},
            r"^kafka\.ssl_cafile: file '/nonexistent/ca\.pem' does not exist$",
        ),
        (
            {"kafka": {"security_protocol": "SSL", "ssl_keyfile": "/etc/hosts"}},
            r"^kafka\.ssl_keyfile: needs kafka\.ssl_certfile",
        ),
        (
            {"object_store": {"ca_file": "/etc/hosts"}},
            r"^object_store\.ca_file: only used with object_store\.secure: true$",
        ),
        (
            {"object_store": {"secure": True, "cert_check": False, "ca_file": "/etc/hosts"}},
            r"^object_store\.ca_file: unused with object_store\.cert_check: false",
        ),
        (
            {"object_store": {"secure": True, "ca_file": "/nonexistent/ca.pem"}},
            r"^object_store\.ca_file: file '/nonexistent/ca\.pem' does not exist$",
        ),
        (
            {"object_store": {"cert_check": False}},
            r"^object_store\.cert_check: only used with object_store\.secure: true$",
        ),
    ],
)
def test_security_rules_name_the_field(sections, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(cfg_of(**sections))


def test_valid_security_settings(certs):
    kafka_tls = {
        "security_protocol": "SASL_SSL",
        "ssl_cafile": str(certs.ca),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
    }
    cfg = from_dict(
        cfg_of(
            kafka=sasl(**kafka_tls),
            object_store={"secure": True, "ca_file": str(certs.ca)},
        )
    )
    assert cfg.kafka.security_protocol == "SASL_SSL"
    assert cfg.kafka.ssl_check_hostname is True
    assert cfg.object_store.ca_file == str(certs.ca) and cfg.object_store.cert_check is True
    # the defaults stay plain: nothing to configure for the embedded services
    plain = from_dict(cfg_of())
    assert plain.kafka.security_protocol == "PLAINTEXT" and plain.kafka.sasl_password is None


# -- credentials from the environment ------------------------------------------------------------


def test_env_fills_credentials(tmp_path, monkeypatch):
    kafka_sasl = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"}
    path = write_config(tmp_path, on_disk(kafka=kafka_sasl))
    with pytest.raises(ConfigError, match=r"^kafka\.sasl_username: required"):
        load_config(path)
    monkeypatch.setenv("STREAMRFT_KAFKA_SASL_USERNAME", "alice")
    monkeypatch.setenv("STREAMRFT_KAFKA_SASL_PASSWORD", PASSWORD)
    monkeypatch.setenv("STREAMRFT_S3_ACCESS_KEY", "ak-from-env")
    monkeypatch.setenv("STREAMRFT_S3_SECRET_KEY", SECRET)
    cfg = load_config(path)
    assert (cfg.kafka.sasl_username, cfg.kafka.sasl_password) == ("alice", PASSWORD)
    assert (cfg.object_store.access_key, cfg.object_store.secret_key) == ("ak-from-env", SECRET)


def test_env_wins_over_the_file_and_overrides_win_over_env(tmp_path, monkeypatch):
    path = write_config(tmp_path, on_disk(object_store={"secret_key": "from-the-file"}))
    assert load_config(path).object_store.secret_key == "from-the-file"
    monkeypatch.setenv("STREAMRFT_S3_SECRET_KEY", SECRET)
    assert load_config(path).object_store.secret_key == SECRET
    cfg = load_config(path, ["object_store.secret_key=from-the-command-line"])
    assert cfg.object_store.secret_key == "from-the-command-line"
    monkeypatch.setenv("STREAMRFT_S3_SECRET_KEY", "")  # empty counts as unset
    assert load_config(path).object_store.secret_key == "from-the-file"


def test_env_fills_a_section_left_empty(tmp_path, monkeypatch):
    path = write_config(tmp_path, "taskset: {path: data/tasks.jsonl}\nobject_store:\n")
    monkeypatch.setenv("STREAMRFT_S3_SECRET_KEY", SECRET)
    assert load_config(path).object_store.secret_key == SECRET


def test_tls_paths_resolve_against_the_config_folder(tmp_path, certs, monkeypatch):
    folder = tmp_path / "conf"
    (folder / "tls").mkdir(parents=True)
    for src in (certs.ca, certs.client_cert, certs.client_key):
        (folder / "tls" / src.name).write_bytes(src.read_bytes())
    kafka_tls = {
        "security_protocol": "SSL",
        "ssl_cafile": "tls/ca.pem",
        "ssl_certfile": "tls/client.pem",
        "ssl_keyfile": "tls/client.key",
    }
    store = {"secure": True, "ca_file": "tls/ca.pem"}
    path = write_config(folder, on_disk(kafka=kafka_tls, object_store=store))
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config(path)
    tls = folder.resolve() / "tls"
    assert cfg.kafka.ssl_cafile == str(tls / "ca.pem")
    assert cfg.kafka.ssl_certfile == str(tls / "client.pem")
    assert cfg.kafka.ssl_keyfile == str(tls / "client.key")
    assert cfg.object_store.ca_file == str(tls / "ca.pem")


# -- redaction -------------------------------------------------------------------------------------


def _secret_config(taskset: str = "tasks.jsonl"):
    return from_dict(
        cfg_of(
            taskset={"path": taskset},
            kafka=sasl(security_protocol="SASL_PLAINTEXT"),
            object_store={"secret_key": SECRET, "access_key": "ak-visible"},
        )
    )


def test_yaml_dump_holds_no_secret():
    cfg = _secret_config()
    text = to_yaml(cfg)
    assert PASSWORD not in text and SECRET not in text
    data = yaml.safe_load(text)
    assert data["kafka"]["sasl_password"] == REDACTED
    assert data["object_store"]["secret_key"] == REDACTED
    # identities stay visible, so a log still says who connected
    assert data["kafka"]["sasl_username"] == "alice"
    assert data["object_store"]["access_key"] == "ak-visible"
    # an unset secret stays null; redact=False is the full config
    assert yaml.safe_load(to_yaml(from_dict(cfg_of())))["kafka"]["sasl_password"] is None
    assert from_dict(yaml.safe_load(to_yaml(cfg, redact=False))) == cfg


def test_repr_and_str_hold_no_secret():
    cfg = _secret_config()
    for text in (repr(cfg), str(cfg), repr(cfg.kafka), repr(cfg.object_store)):
        assert PASSWORD not in text and SECRET not in text
    assert "sasl_password=***" in repr(cfg.kafka) and "sasl_username='alice'" in repr(cfg.kafka)
    assert "secret_key=***" in repr(cfg) and "bucket='streamrft'" in repr(cfg)
    assert "sasl_password=None" in repr(from_dict(cfg_of()).kafka)


def test_redacted_file_loads_with_secrets_from_env(tmp_path, monkeypatch):
    """What a child process of ``streamrft run`` does: redacted file + credentials in env."""
    from streamrft.infra.config import credentials_env

    path = write_config(tmp_path, {})  # for its taskset
    cfg = _secret_config(taskset=str(tmp_path / "data" / "tasks.jsonl"))
    path.write_text(to_yaml(cfg))
    with pytest.raises(ConfigError, match=r"^kafka\.sasl_password: redacted in .*; set STREAMRFT"):
        load_config(path)
    env = credentials_env(cfg)
    assert env == {
        "STREAMRFT_KAFKA_SASL_USERNAME": "alice",
        "STREAMRFT_KAFKA_SASL_PASSWORD": PASSWORD,
        "STREAMRFT_S3_ACCESS_KEY": "ak-visible",
        "STREAMRFT_S3_SECRET_KEY": SECRET,
    }
    monkeypatch.setenv("STREAMRFT_KAFKA_SASL_PASSWORD", PASSWORD)
    with pytest.raises(ConfigError, match=r"^object_store\.secret_key: redacted .*_S3_SECRET_KEY"):
        load_config(path)
    monkeypatch.setenv("STREAMRFT_S3_SECRET_KEY", SECRET)
    assert load_config(path) == cfg


def test_a_command_that_needs_no_secret_loads_a_redacted_file(tmp_path, monkeypatch):
    """``streamrft export`` on a run folder's config.yaml: the redacted secrets stay
    placeholders, nothing else changes, and no environment is needed."""
    for var in ("STREAMRFT_KAFKA_SASL_PASSWORD", "STREAMRFT_S3_SECRET_KEY"):
        monkeypatch.delenv(var, raising=False)
    path = write_config(tmp_path, {})
    cfg = _secret_config(taskset=str(tmp_path / "data" / "tasks.jsonl"))
    path.write_text(to_yaml(cfg))
    loaded = load_config(path, needs_secrets=False)
    assert loaded.kafka.sasl_password == loaded.object_store.secret_key == UNUSED_SECRET
    assert loaded.kafka.sasl_username == "alice"
    assert loaded.model == cfg.model and loaded.trainer == cfg.trainer
    # a tool that reads the broker only (status, tail, dashboard, export-metrics) needs the
    # Kafka secret, never the store's
    with pytest.raises(ConfigError, match=r"^kafka\.sasl_password: redacted .*_SASL_PASSWORD"):
        load_config(path, needs_secrets=("kafka",))
    monkeypatch.setenv("STREAMRFT_KAFKA_SASL_PASSWORD", PASSWORD)
    reader = load_config(path, needs_secrets=("kafka",))
    assert reader.kafka.sasl_password == PASSWORD
    assert reader.object_store.secret_key == UNUSED_SECRET


# -- what the clients get ----------------------------------------------------------------------


def _kafka(**fields):
    return from_dict(cfg_of(kafka={"bootstrap_servers": "127.0.0.1:1", **fields})).kafka


def test_plaintext_options_are_just_the_protocol():
    assert kafka.security_options(_kafka()) == {"security_protocol": "PLAINTEXT"}


def test_sasl_options():
    options = kafka.security_options(_kafka(**sasl()))
    assert options == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "alice",
        "sasl_plain_password": PASSWORD,
    }


def test_ssl_options_load_the_ca_and_client_certificate(certs):
    cfg = _kafka(
        **sasl(security_protocol="SASL_SSL", sasl_mechanism="PLAIN"),
        ssl_cafile=str(certs.ca),
        ssl_certfile=str(certs.client_cert),
        ssl_keyfile=str(certs.client_key),
    )
    options = kafka.security_options(cfg)
    context = options.pop("ssl_context")
    assert options["security_protocol"] == "SASL_SSL" and options["sasl_mechanism"] == "PLAIN"
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    subjects = [dict(x[0] for x in ca["subject"]) for ca in context.get_ca_certs()]
    assert {"commonName": "streamrft-test-ca"} in subjects
    unchecked = kafka.security_options(
        _kafka(security_protocol="SSL", ssl_cafile=str(certs.ca), ssl_check_hostname=False)
    )["ssl_context"]
    assert not unchecked.check_hostname and unchecked.verify_mode == ssl.CERT_REQUIRED


def test_ssl_file_that_is_not_pem_names_the_fields(tmp_path):
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"^kafka\.ssl_cafile / ssl_certfile / ssl_keyfile: "):
        kafka.security_options(_kafka(security_protocol="SSL", ssl_cafile=str(bad)))


def test_every_client_constructor_takes_the_options(certs):
    cfg = _kafka(
        **sasl(security_protocol="SASL_SSL"),
        ssl_cafile=str(certs.ca),
        ssl_certfile=str(certs.client_cert),
        ssl_keyfile=str(certs.client_key),
    )

    async def settings() -> list[tuple]:
        clients = [
            kafka.data_producer(cfg, "p"),
            kafka.event_producer(cfg, "e"),
            kafka.task_consumer(cfg, "t", "g", "c"),
            kafka.experience_consumer(cfg, "x", "g", "c"),
            kafka.event_reader(cfg, ["a"], "r"),
            kafka.admin_client(cfg),
        ]
        try:  # aiokafka keeps the connection settings on each client's inner AIOKafkaClient
            inner = [getattr(c, "client", None) or c._client for c in clients]
            return [
                (
                    i._security_protocol,
                    i._sasl_mechanism,
                    i._sasl_plain_username,
                    i._sasl_plain_password,
                    type(i._ssl_context),
                )
                for i in inner
            ]
        finally:
            for c in clients:
                await (c.close() if isinstance(c, AIOKafkaAdminClient) else c.stop())

    expected = ("SASL_SSL", "SCRAM-SHA-512", "alice", PASSWORD, ssl.SSLContext)
    assert asyncio.run(settings()) == [expected] * 6


def test_s3_tls_options(certs):
    def store(**fields):
        return from_dict(cfg_of(object_store={"endpoint": "s3.example:443", **fields})).object_store

    assert tls_options(store()) == {}
    assert tls_options(store(secure=True)) == {}  # urllib3 verifies against the system CAs
    assert tls_options(store(secure=True, ca_file=str(certs.ca))) == {
        "cert_reqs": "CERT_REQUIRED",
        "ca_certs": str(certs.ca),
    }
    assert tls_options(store(secure=True, cert_check=False)) == {"cert_reqs": "CERT_NONE"}


def test_topics_and_tail_use_the_configs_security_settings(tmp_path, certs):
    from streamrft.app.cli import build_parser
    from streamrft.infra.endpoints import kafka_for_tools

    def _kafka_config(args):
        return kafka_for_tools(args.config, args.bootstrap, args.dir)

    tls = {"bootstrap_servers": "k.example:9093", "security_protocol": "SSL"}
    path = write_config(tmp_path, on_disk(kafka=tls | {"ssl_cafile": str(certs.ca)}))
    k = _kafka_config(build_parser().parse_args(["topics", str(path)]))
    assert (k.bootstrap_servers, k.security_protocol) == ("k.example:9093", "SSL")
    assert k.ssl_cafile == str(certs.ca)
    argv = ["tail", str(path), "a.topic", "--bootstrap", "other.example:9093"]
    k = _kafka_config(build_parser().parse_args(argv))
    assert (k.bootstrap_servers, k.security_protocol) == ("other.example:9093", "SSL")


def test_a_tracking_uri_with_credentials_is_refused_without_showing_them():
    """At 41ac149 ``monitor.mlflow.tracking_uri`` with ``user:token@`` went into the run's
    config.yaml and error messages as it was."""
    from streamrft.infra.config import from_dict
    from tests.helpers.configs import cfg_of

    uri = "https://me:tok-s3cr3t@mlflow.example:5000"
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_USERNAME") as caught:
        from_dict(cfg_of(monitor={"mlflow": {"tracking_uri": uri}}))
    assert "tok-s3cr3t" not in str(caught.value)
    plain = from_dict(cfg_of(monitor={"mlflow": {"tracking_uri": "https://mlflow.example:5000"}}))
    assert plain.monitor.mlflow.tracking_uri == "https://mlflow.example:5000"


def test_a_kafka_tool_without_a_config_says_it_connects_in_plaintext(tmp_path, caplog):
    from streamrft.infra.endpoints import kafka_for_tools

    with caplog.at_level("WARNING"):
        kafka_cfg = kafka_for_tools(None, "broker.example:9092", tmp_path)
    assert kafka_cfg.security_protocol == "PLAINTEXT"
    assert "PLAINTEXT (no TLS, no SASL)" in caplog.text
