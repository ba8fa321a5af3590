"""Secrets given only through the environment reach every process and no file or log."""

from __future__ import annotations

import json
import secrets
import subprocess

import pytest

from tests.helpers.cli import env, run_argv
from tests.helpers.paths import EXAMPLE

pytestmark = pytest.mark.e2e


def test_secrets_from_env_work_and_are_written_nowhere(services, tmp_path):
    """The object store the run starts takes its secret key from the environment only; the
    children must get it too (their config.yaml has it redacted) for the run to finish."""
    s3_secret = f"s3-{secrets.token_hex(12)}"
    sasl_password = f"sasl-{secrets.token_hex(12)}"  # loaded but unused (PLAINTEXT broker)
    secret_env = env() | {
        "STREAMRFT_S3_SECRET_KEY": s3_secret,
        "STREAMRFT_KAFKA_SASL_PASSWORD": sasl_password,
    }
    runs = tmp_path / "runs"
    proc = subprocess.run(
        run_argv(
            EXAMPLE,
            None,
            3,
            runs,
            None,  # the run starts its own object store, keyed from the environment
            "eval.interval=0",
            "trainer.warmup_sft_steps=0",
            f"kafka.bootstrap_servers={services.bootstrap_servers}",
            "monitor.log_level=DEBUG",  # the resolved config is logged at DEBUG
        ),
        env=secret_env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["exit_codes"] == {"trainer": 0, "explorer-0": 0, "feeder": 0}
    assert summary["versions_applied"]["explorer-0"] >= 1  # weights went through the store
    # the resolved config is logged (at DEBUG) and written, with the secrets redacted
    assert "secret_key: '***'" in proc.stderr and "sasl_password: '***'" in proc.stderr
    config_yaml = (run_dir / "config.yaml").read_text()
    assert "secret_key: '***'" in config_yaml and "sasl_password: '***'" in config_yaml
    # ... and in nothing else: logs, config, summary, checkpoints, the services' own logs
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "trainer.log" for p in files)
    assert any(p.parent.name == "logs" and p.parent.parent.name == "services" for p in files)
    for secret in (s3_secret, sasl_password):
        assert secret not in proc.stdout and secret not in proc.stderr
        leaks = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert not leaks, f"secret found in {leaks}"
