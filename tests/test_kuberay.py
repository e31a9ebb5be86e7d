"""The example KubeRay RayService manifests (deploy/kuberay/) are checked, not applied: against the schema written
down from the CRD's required fields, their serveConfigV2 against Ray Serve's own config schema, and the pdserve
application in it against pdserve's config loader. No Kubernetes cluster is needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pdserve.cli import serve_option_names
from pdserve.deploy.ray.config import check_engine_options, config_from_dict

KUBERAY = Path(__file__).resolve().parent.parent / "deploy" / "kuberay"
MANIFESTS = sorted(KUBERAY.glob("rayservice-*.yaml"))
SCHEMA = json.loads((KUBERAY / "rayservice.schema.json").read_text())


def test_both_topologies_have_a_manifest() -> None:
    assert {p.stem for p in MANIFESTS} == {"rayservice-colocated", "rayservice-disaggregated"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_manifest_matches_the_crd_schema(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    jsonschema.validate(doc, SCHEMA)
    for group in doc["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        assert group.get("minReplicas", 0) <= group.get("replicas", 0) <= group.get("maxReplicas", 2**31), group


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_serve_config_builds_a_pdserve_application(path: Path) -> None:
    serve_schema = pytest.importorskip("ray.serve.schema", reason="Ray Serve is not installed (pdserve[ray])")
    doc = yaml.safe_load(path.read_text())
    serve_cfg: dict[str, Any] = yaml.safe_load(doc["spec"]["serveConfigV2"])
    serve_schema.ServeDeploySchema.model_validate(serve_cfg)  # Ray Serve's own schema of a config file
    (app,) = serve_cfg["applications"]
    assert app["import_path"] == "pdserve.deploy.ray.app:app_builder"
    cfg = config_from_dict(app["args"])  # what app_builder does with these args
    check_engine_options(cfg, serve_option_names())
    from ray.serve import Application

    from pdserve.deploy.ray.app import app_builder

    assert isinstance(app_builder(app["args"]), Application)
    assert cfg.topology == path.stem.removeprefix("rayservice-")
    # every deployment fits on some worker pod: its num_cpus and custom resources are there
    pods = [g["rayStartParams"] for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    for role, group in cfg.groups().items():
        need = group.ray_actor_options.get("resources", {})
        fits = [p for p in pods if float(p["num-cpus"]) >= group.num_cpus
                and all(json.loads(json.loads(p.get("resources", '"{}"'))).get(k, 0) >= v for k, v in need.items())]
        assert fits, f"{path.name}: no worker group fits the {role} replicas ({group.num_cpus} CPUs, {need})"
