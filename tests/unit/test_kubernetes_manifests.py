"""``deploy/kubernetes``: every kustomization renders (its resources list, read here without kubectl),
every manifest is valid against the Kubernetes schemas (offline, strict), and every ``stargate`` and
``pylon`` container command line is one the real CLIs accept, with its mounted lb-config loaded."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import orjson
import pytest
import yaml

from stargate.pylon.config import parse_settings
from stargate.router.cli import build_parser, settings_from_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
FIELD_SAMPLES = {"metadata.name": "pod-0", "metadata.namespace": "default", "status.podIP": "10.1.2.3"}
KUSTOMIZATIONS = sorted(DEPLOY.rglob("kustomization.yaml"))


def render(kustomization: Path) -> list[dict[str, Any]]:
    """The resources of a kustomization (files or nested kustomization directories) with its
    ``labels`` added and ``images`` tags applied: the parts of kustomize these files use."""
    spec = yaml.safe_load(kustomization.read_text())
    unsupported = set(spec) - {"apiVersion", "kind", "labels", "resources", "images"}
    assert not unsupported, f"{kustomization}: render() does not handle {unsupported}"
    docs: list[dict[str, Any]] = []
    for entry in spec["resources"]:
        path = kustomization.parent / entry
        if path.is_dir():
            docs.extend(render(path / "kustomization.yaml"))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    labels = {k: v for group in spec.get("labels", ()) for k, v in group["pairs"].items()}
    tags = {image["name"]: image["newTag"] for image in spec.get("images", ())}
    for doc in docs:
        doc["metadata"].setdefault("labels", {}).update(labels)
        for container in containers(doc):
            if container["image"] in tags:
                container["image"] = f"{container['image']}:{tags[container['image']]}"
    return docs


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] != "Deployment":
        return []
    return list(doc["spec"]["template"]["spec"]["containers"])


def expanded(container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The command line with ``$(VAR)`` references replaced the way the kubelet does, from
    ``env`` entries (field references get sample values)."""
    env: dict[str, str] = {}
    for var in container.get("env", ()):
        ref = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[var["name"]] = FIELD_SAMPLES[ref] if ref else var["value"]
    argv = [*container.get("command", ()), *container.get("args", ())]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in argv], env


def mounted_config_maps(doc: dict[str, Any], container: dict[str, Any], root: Path) -> dict[str, Path]:
    """Mount path → a local directory holding that ConfigMap's files, for the container's mounts."""
    volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"].get("volumes", ())}
    rendered = render(DEPLOY / "kustomization.yaml")
    maps = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "ConfigMap"}
    out: dict[str, Path] = {}
    for mount in container.get("volumeMounts", ()):
        name = volumes[mount["name"]]["configMap"]["name"]
        local = root / name
        local.mkdir(exist_ok=True)
        for file, content in maps[name]["data"].items():
            (local / file).write_text(content)
        out[mount["mountPath"].rstrip("/")] = local
    return out


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid_against_the_kubernetes_schemas(kustomization: Path) -> None:
    resources = yaml.safe_load(kustomization.read_text())["resources"]
    listed = {(kustomization.parent / r).resolve() for r in resources}
    on_disk = {p.resolve() for p in kustomization.parent.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk <= listed, f"not in {kustomization}: {sorted(on_disk - listed)}"
    docs = render(kustomization)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_stargate_deployment_has_probes_discovery_and_a_disruption_budget() -> None:
    docs = render(DEPLOY / "kustomization.yaml")
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget"} == {k for k, _ in kinds}
    (container,) = containers(kinds["Deployment", "stargate"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"]
    headless = kinds["Service", "stargate-headless"]["spec"]
    assert headless["clusterIP"] == "None"
    assert [p["name"] for p in headless["ports"]] == ["grpc"]  # SRV _grpc._tcp.<name>
    argv, env = expanded(container)
    options = build_parser(env).parse_args(argv[1:])
    assert options.stargate_discovery_dns_name.startswith("stargate-headless.")
    assert (options.pod_name, options.pod_namespace) == ("pod-0", "default")
    assert options.default_max_wait_ms > 0  # a new replica holds requests while its Pylons register
    port_names = {p["name"] for p in container["ports"]}
    for service in ("stargate", "stargate-headless"):
        assert {p["targetPort"] for p in kinds["Service", service]["spec"]["ports"]} <= port_names


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_container_command_lines_are_accepted_by_the_clis(kustomization: Path, tmp_path: Path) -> None:
    checked = 0
    for doc in render(kustomization):
        for container in containers(doc):
            argv, env = expanded(container)
            if argv[:1] == ["stargate"]:
                for mount, local in mounted_config_maps(doc, container, tmp_path).items():
                    argv = [arg.replace(f"={mount}/", f"={local}/") for arg in argv]
                settings = settings_from_args(build_parser(env).parse_args(argv[1:]))
                assert settings.discovery.srv_mode
                checked += 1
            elif argv[:1] == ["pylon"]:
                settings = parse_settings(argv[1:], env)
                assert settings.upstream_base_url.startswith("http://127.0.0.1:")
                checked += 1
    assert checked > 0


def test_the_routers_lb_config_is_the_recommended_file() -> None:
    rendered = render(DEPLOY / "kustomization.yaml")
    (config_map,) = [d for d in rendered if d["metadata"]["name"] == "stargate-lb-config"]
    recommended = orjson.loads((ROOT / "examples" / "lb-config" / "recommended.json").read_bytes())
    assert orjson.loads(config_map["data"]["lb-config.json"]) == recommended
