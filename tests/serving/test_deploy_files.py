"""The deploy/ files' security defaults (docs/scaling.md, "Security defaults"), read as YAML: the
API key comes from a Kubernetes Secret or the environment and is never written in the repository,
and the Ray dashboard, whose job API runs code, is on loopback, off, or token-authenticated.
No Ray cluster starts."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason='PyYAML comes with the cluster extra: pip install -e ".[cluster]"')

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KEY_ENV = "TERCEL_API_KEY"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
KEY_ARGS = {"api_key", "api-key"}


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def rayservice() -> dict:
    (service,) = [d for d in documents("rayservice.yaml") if d.get("kind") == "RayService"]
    return service


def serve_configs() -> list[dict]:
    """Every Serve config in deploy/: the config file and the RayService's serveConfigV2."""
    return [documents("serve_config.yaml")[0], yaml.safe_load(rayservice()["spec"]["serveConfigV2"])]


def ray_containers() -> list[dict]:
    cluster = rayservice()["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def walk(node):
    """Every mapping in a parsed YAML tree."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def test_every_ray_pod_gets_the_api_key_from_a_secret():
    """Head and worker containers set TERCEL_API_KEY from a non-optional secretKeyRef, no value."""
    for container in ray_containers():
        (env,) = [e for e in container.get("env", []) if e["name"] == KEY_ENV]
        assert "value" not in env, container["name"]
        ref = env["valueFrom"]["secretKeyRef"]
        assert ref["name"] and ref["key"] and not ref.get("optional", False), container["name"]


def test_no_literal_api_key_in_deploy():
    """No Serve args, env value, Secret data or command line in deploy/ carries an API key."""
    for config in serve_configs():
        for app in config["applications"]:
            assert not KEY_ARGS & set(app.get("args", {})), app["name"]
    for name in ("rayservice.yaml", "serve_config.yaml"):
        for node in walk(documents(name)):
            assert not (node.get("kind") == "Secret" and (node.get("data") or node.get("stringData"))), name
            if node.get("name") == KEY_ENV:
                assert "value" not in node, name
    for path in DEPLOY.iterdir():
        text = path.read_text()
        assert not re.search(r"--api-key(=|\s+)\S", text), path.name     # a flag given a value
        assert not re.search(rf"^\s*(ENV|ARG)\s+{KEY_ENV}\b", text, re.M), path.name


def test_ray_dashboard_is_on_loopback_off_or_token_authenticated():
    """The RayService head's dashboard binds loopback, is disabled, or Ray token auth is on."""
    cluster = rayservice()["spec"]["rayClusterConfig"]
    params = {k: str(v).lower() for k, v in cluster["headGroupSpec"]["rayStartParams"].items()}
    token = (cluster.get("authOptions") or {}).get("mode") == "token"
    # KubeRay binds the dashboard to 0.0.0.0 unless dashboard-host says otherwise
    assert params.get("dashboard-host", "0.0.0.0") in LOOPBACK or params.get("include-dashboard") == "false" or token


def test_the_rayservice_turns_ray_token_auth_on():
    """KubeRay's operator needs the dashboard on the pod IP, so the RayService requires Ray's token."""
    cluster = rayservice()["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    major, minor, *_ = (int(x) for x in cluster["rayVersion"].split("."))
    assert (major, minor) >= (2, 52)        # Ray's token authentication


def test_serve_configs_start_no_dashboard_on_all_interfaces():
    """No Serve config in deploy/ sets a dashboard host (a local `serve run` keeps Ray's 127.0.0.1)."""
    for config in serve_configs():
        assert not any("dashboard_host" in node or "dashboard-host" in node for node in walk(config))


def test_the_api_key_reaches_the_replicas_from_the_environment(monkeypatch):
    """deploy/serve_config.yaml's args built with TERCEL_API_KEY set: each replica's args hold it."""
    pytest.importorskip("ray.serve", reason='Ray Serve is an optional extra: pip install -e ".[cluster]"')
    from serving.cluster.replicas import app_builder
    monkeypatch.setenv(KEY_ENV, "from-the-environment")
    app = app_builder(serve_configs()[0]["applications"][0]["args"])
    (engine,) = app._bound_deployment.init_args          # TercelIngress(engine), engine = TercelReplica(args)
    assert engine._bound_deployment.name == "TercelReplica"
    assert engine._bound_deployment.init_args[0].api_key == "from-the-environment"
