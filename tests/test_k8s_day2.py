"""Day two on Kubernetes (issue #61), offline like tests/test_k8s.py: the edge (an Ingress with TLS from
cert-manager), PodDisruptionBudgets, GCS fault tolerance as the overlay gpu-ha (Redis), and the check that
refuses a KubeRay whose RayService CRD is older than the manifests. Needs kubectl (with kustomize)."""

from __future__ import annotations

import copy

import pytest
import yaml

import test_k8s
from test_k8s import K8S, one, pod_templates, render, serve_config

pytestmark = test_k8s.pytestmark
HA = "gpu-ha"


# -- the edge ------------------------------------------------------------------------------------------------
def test_the_gpu_overlay_has_an_ingress_with_tls_from_cert_manager():
    objs = render("gpu")
    ing = one(objs, "Ingress", "kvtier")
    ann = ing["metadata"]["annotations"]
    assert ann["cert-manager.io/cluster-issuer"]
    hosts = {r["host"] for r in ing["spec"]["rules"]}
    tls = ing["spec"]["tls"]
    assert hosts and hosts <= {h for t in tls for h in t["hosts"]} and all(t["secretName"] for t in tls)
    assert ann["nginx.ingress.kubernetes.io/ssl-redirect"] == "true"
    args = serve_config("gpu")["applications"][0]["args"]
    assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) > args["server"]["request_timeout_s"]
    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"           # streams pass chunk by chunk
    port = serve_config("gpu")["http_options"]["port"]
    paths = [p for r in ing["spec"]["rules"] for p in r["http"]["paths"]]
    assert {p["path"] for p in paths} == {"/v1", "/health"}                     # nothing else of the proxies
    for p in paths:                                                                 # KubeRay's serve Service
        assert p["backend"]["service"] == {"name": "kvtier-serve-svc", "port": {"number": port}}
    # the API NetworkPolicy admits the controller by namespace label, as the Ingress's comment says
    api = one(objs, "NetworkPolicy", "kvtier-serve-api")
    peers = [peer for r in api["spec"]["ingress"] for peer in r["from"]]
    assert any(peer.get("namespaceSelector", {}).get("matchLabels") == {"kvtier.io/api-client": "true"}
               for peer in peers)
    assert "kvtier.io/api-client=true" in (K8S / "components" / "ingress" / "ingress.yaml").read_text()


# -- single points of failure ----------------------------------------------------------------------------------
@pytest.mark.parametrize("target", test_k8s.TARGETS + (HA,))
def test_every_ray_pod_group_has_a_disruption_budget(target):
    objs = render(target)
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for where, pod in pod_templates(one(objs, "RayService")):
        labels = pod["metadata"]["labels"]
        mine = [p for p in pdbs if all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items())]
        assert len(mine) == 1, f"{where}: {len(mine)} PodDisruptionBudgets select it"
        budget = mine[0]["spec"]
        if where == "head":                 # the head is the cluster unless its GCS lives in Redis
            assert budget["maxUnavailable"] == (1 if target == HA else 0)
        else:
            assert budget["maxUnavailable"] == 1


def test_gcs_fault_tolerance_overlay_validates_and_keeps_the_gcs_in_redis():
    test_k8s.test_every_object_validates(HA)                    # kubernetes-validate and the CRD, strict
    test_k8s.test_pods_are_non_root_unprivileged_and_bounded(HA)
    objs = render(HA)
    gcs = one(objs, "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    svc = one(objs, "Service", "kvtier-redis")
    host, _, port = gcs["redisAddress"].rpartition(":")
    assert host == svc["metadata"]["name"] and int(port) == svc["spec"]["ports"][0]["port"]
    secret = gcs["redisPassword"]["valueFrom"]["secretKeyRef"]
    redis = one(objs, "Deployment", "kvtier-redis")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": secret}} in redis["env"]
    assert "--appendonly" in redis["args"] and "$(REDIS_PASSWORD)" in redis["args"]
    pol = one(objs, "NetworkPolicy", "kvtier-redis")
    assert [peer["podSelector"]["matchLabels"] for r in pol["spec"]["ingress"] for peer in r["from"]] == [
        {"app.kubernetes.io/name": "kvtier"}]
    # the same service as the gpu overlay otherwise
    assert serve_config(HA) == serve_config("gpu")
    assert secret["name"] in (test_k8s.REPO / "docs" / "deploy.md").read_text()


# -- KubeRay version ---------------------------------------------------------------------------------------------
def _crd() -> dict:
    return yaml.safe_load((test_k8s.schemas_dir() / "ray.io_rayservices.yaml").read_text())


def _drop(schema: dict, path: list[str]) -> None:
    node = schema
    for key in path[:-1]:
        node = node["properties"][key]
    del node["properties"][path[-1]]


@pytest.mark.parametrize("target", test_k8s.TARGETS + (HA,))
def test_the_vendored_crd_knows_every_field_the_manifests_set(target):
    from kvtier.service.k8s_crd import check

    assert check(_crd(), render(target)) == []


def test_an_older_crd_is_refused_naming_the_fields_and_the_release(tmp_path):
    from typer.testing import CliRunner

    from kvtier.cli import app
    from kvtier.service.k8s_crd import KUBERAY_RELEASE, check

    old = copy.deepcopy(_crd())
    (v1,) = [v for v in old["spec"]["versions"] if v["name"] == "v1"]
    _drop(v1["schema"]["openAPIV3Schema"], ["spec", "rayClusterConfig", "authOptions"])   # before KubeRay 1.5.1
    assert check(old, render("base")) == ["RayService kvtier: the CRD lacks spec.rayClusterConfig.authOptions"]
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(old))
    (tmp_path / "rendered.yaml").write_text(test_k8s._render_text("gpu"))
    result = CliRunner().invoke(app, ["k8s", "check-crd", "--crd", str(tmp_path / "crd.yaml"),
                                      "--manifests", str(tmp_path / "rendered.yaml")])
    assert result.exit_code == 1
    assert "authOptions" in result.output and f"KubeRay v{KUBERAY_RELEASE} or newer" in result.output
    guide = (test_k8s.REPO / "docs" / "deploy.md").read_text()
    assert f"KubeRay v{KUBERAY_RELEASE}" in guide and "kvtier k8s check-crd" in guide
    (tmp_path / "crd.yaml").write_text((test_k8s.schemas_dir() / "ray.io_rayservices.yaml").read_text())
    result = CliRunner().invoke(app, ["k8s", "check-crd", "--crd", str(tmp_path / "crd.yaml"),
                                      "--manifests", str(tmp_path / "rendered.yaml")])
    assert result.exit_code == 0, result.output
