"""`kvtier k8s check-crd`: refuse a KubeRay too old for the manifests (issue #61 item 6).

An older RayService CRD does not know every field the manifests set (`rayClusterConfig.authOptions`, Ray's
token auth, needs KubeRay >= 1.5.1), and the API server prunes unknown fields silently: the cluster would
run without token auth, or without GCS fault tolerance, and say nothing. This check walks each rendered
RayService against the cluster's CRD schema and lists every field the CRD lacks:

    kubectl get crd rayservices.ray.io -o yaml > crd.yaml
    kvtier k8s check-crd --crd crd.yaml --overlay gpu      # or --manifests rendered.yaml

Exit 0: the CRD knows every field; 1: it does not (each field named, with the release to install); 2: bad input.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Optional

import typer
import yaml

KUBERAY_RELEASE = "1.5.1"          # the oldest KubeRay whose RayService CRD has every field the manifests use
K8S = Path(__file__).resolve().parents[3] / "k8s"


def unknown_fields(obj: Any, schema: dict, path: str) -> list[str]:
    """The field paths of `obj` that the OpenAPI v3 `schema` does not declare (structural CRD schemas)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(obj, dict) and "properties" in schema:
        props, out = schema["properties"], []
        for key, value in obj.items():
            if key in props:
                out += unknown_fields(value, props[key], f"{path}.{key}")
            elif not schema.get("additionalProperties"):
                out.append(f"{path}.{key}")
        return out
    if isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        return [p for k, v in obj.items() for p in unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")]
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [p for i, v in enumerate(obj) for p in unknown_fields(v, schema["items"], f"{path}[{i}]")]
    return []


def check(crd: dict, manifests: list[dict]) -> list[str]:
    """Why the cluster's RayService CRD cannot take these manifests (empty: it can)."""
    if crd.get("kind") != "CustomResourceDefinition" or crd.get("spec", {}).get("names", {}).get("kind") != "RayService":
        return ["not the RayService CustomResourceDefinition (kubectl get crd rayservices.ray.io -o yaml)"]
    versions = {v["name"]: v for v in crd["spec"].get("versions", []) if v.get("served", True)}
    problems = []
    services = [m for m in manifests if m and m.get("kind") == "RayService"]
    if not services:
        return ["no RayService among the manifests"]
    for obj in services:
        version = obj["apiVersion"].rpartition("/")[2]
        if version not in versions:
            problems.append(f"the CRD serves {sorted(versions)}, not {obj['apiVersion']}")
            continue
        schema = versions[version]["schema"]["openAPIV3Schema"]
        problems += [f"RayService {obj['metadata']['name']}: the CRD lacks {p}"
                     for p in unknown_fields(obj.get("spec", {}), schema["properties"]["spec"], "spec")]
    return problems


def _render(overlay: str) -> str:
    proc = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"kubectl kustomize k8s/overlays/{overlay} failed: {proc.stderr.strip()}")
    return proc.stdout


def check_crd_command(
    crd: Path = typer.Option(..., "--crd", help="The cluster's CRD: kubectl get crd rayservices.ray.io -o yaml."),
    manifests: Optional[Path] = typer.Option(None, "--manifests", help="Rendered manifests (kubectl kustomize)."),
    overlay: str = typer.Option("gpu", "--overlay", help="Render this overlay of k8s/ when --manifests is not given."),
) -> None:
    """Refuse a KubeRay whose RayService CRD lacks a field the manifests set (needs KubeRay >= 1.5.1)."""
    try:
        crd_doc = yaml.safe_load(crd.read_text())
        text = manifests.read_text() if manifests is not None else _render(overlay)
        objs = [d for d in yaml.safe_load_all(text) if d]
    except (OSError, ValueError, yaml.YAMLError) as exc:
        typer.echo(f"kvtier k8s check-crd: {exc}", err=True)
        raise typer.Exit(2) from None
    problems = check(crd_doc or {}, objs)
    for p in problems:
        typer.echo(f"kvtier k8s check-crd: {p}", err=True)
    if problems:
        typer.echo(f"kvtier k8s check-crd: install KubeRay v{KUBERAY_RELEASE} or newer (its CRDs too: helm upgrade "
                   "does not update CRDs; docs/deploy.md \"Prerequisites\")", err=True)
        raise typer.Exit(1)
    typer.echo("kvtier k8s check-crd: the RayService CRD knows every field the manifests set")
