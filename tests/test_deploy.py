"""deploy/: every `ray up` config is valid for Ray's own schema and validator, and the
KubeRay manifest and the Dockerfile carry the fields a GPU deployment depends on."""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.autoscaler
import yaml

ROOT = Path(__file__).resolve().parent.parent
# docs/deploy.md's command that writes the head's settings (tests/test_readme_commands.py maps it here).
DEPLOY_ENV_COMMAND = ("(umask 077; printf '%s\\n' KVSERVE_NUM_GPUS=2 KVSERVE_MODEL=/home/ubuntu/models/Llama-3.2-1B "
                      "> deploy/ray/kvserve.env)")
RAY_CONFIGS = sorted((ROOT / "deploy" / "ray").glob("*.yaml"))
KUBERAY = ROOT / "deploy" / "kuberay" / "kvserve.yaml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
# gRPC and Prometheus metrics of the two routers, Locust web UI: (from, to) port ranges.
ROUTER_PORTS = {(50051, 50052), (9400, 9401), (8089, 8089)}


def _ray_schema() -> dict[str, Any]:
    path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    return dict(json.loads(path.read_text()))


def test_there_is_a_config_per_cloud() -> None:
    assert {p.name for p in RAY_CONFIGS} >= {"aws-gpu.yaml", "gcp-gpu.yaml"}


@pytest.mark.parametrize("path", RAY_CONFIGS, ids=lambda p: p.name)
def test_ray_up_config_is_valid_for_ray(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, _ray_schema())
    # Ray's own validator wants the provider's defaults filled in, as `ray up` does.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


@pytest.mark.parametrize("path", RAY_CONFIGS, ids=lambda p: p.name)
def test_ray_up_config_starts_kvserve_on_gpu_workers(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    node_types = config["available_node_types"]
    head = node_types[config["head_node_type"]]
    workers = {name: t for name, t in node_types.items() if name != config["head_node_type"]}
    assert workers, "no worker node type"
    for name, node_type in workers.items():
        assert 0 < node_type["min_workers"] <= node_type["max_workers"] <= config["max_workers"], name
        node = json.dumps(node_type["node_config"])
        assert re.search(r'"InstanceType": "(g[4-6]|p[3-5])', node) or "guestAccelerators" in node, (
            f"{name} is not a GPU node type"
        )
    assert "guestAccelerators" not in json.dumps(head["node_config"])

    setup = "\n".join(config["setup_commands"])
    assert "pip install" in setup and "~/kvserve" in setup and "protos.generate" in setup
    assert "download.pytorch.org/whl/cu" in setup  # the CUDA build of torch
    assert config["file_mounts"] == {"~/kvserve": "."}
    head_start = "\n".join(config["head_start_ray_commands"])
    assert head_start.index("ray start --head") < head_start.index("kvserve up --ray-address auto")
    assert "--host 0.0.0.0" in head_start and "--port 50051" in head_start and "--metrics-port 9400" in head_start
    assert "--routers 2" in head_start
    assert "wait_for_gpus.py" in head_start
    # The managed Redis's URL reaches kvserve up in its environment, its password out of `ps`
    # (it was on the command line: a review's find).
    assert "export KVSERVE_REDIS_URL;" in head_start and "--redis-url" not in head_start
    assert any("ray start --address=$RAY_HEAD_IP:6380" in c for c in config["worker_start_ray_commands"])

    provider = config["provider"]
    if provider["type"] == "aws":
        opened = {(rule["FromPort"], rule["ToPort"]) for rule in provider["security_group"]["IpPermissions"]}
        assert opened == ROUTER_PORTS
    else:  # GCP: a firewall rule on the head's network tag, created as the header says
        assert head["node_config"]["tags"]["items"] == ["kvserve-router"]
        assert "--allow tcp:50051-50052,tcp:9400-9401,tcp:8089 \\\n#       --target-tags kvserve-router" in path.read_text()


def test_wait_for_gpus_script_parses_its_arguments() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "deploy" / "ray" / "wait_for_gpus.py"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "num_gpus" in result.stdout


def _manifests() -> dict[str, dict[str, Any]]:
    documents = [d for d in yaml.safe_load_all(KUBERAY.read_text()) if d]
    by_key = {f"{d['kind']}/{d['metadata']['name']}": d for d in documents}
    assert len(by_key) == len(documents), "two manifests share a kind and name"
    return by_key


def test_kuberay_raycluster_gpu_workers_and_router() -> None:
    manifests = _manifests()
    cluster = manifests["RayCluster/kvserve"]
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray.__version__  # the image installs this project's Ray

    head_pod = spec["headGroupSpec"]["template"]["spec"]
    head, router, second = head_pod["containers"]  # KubeRay starts Ray in the first container
    assert head["name"] == "ray-head"
    assert {p["containerPort"] for p in head["ports"]} >= {6379, 8265, 10001}
    assert "nvidia.com/gpu" not in json.dumps(head["resources"])
    command = " ".join(router["command"] + router["args"])
    assert "kvserve up --ray-address 127.0.0.1:6379" in command and "--host 0.0.0.0" in command
    assert "--redis-url" not in command and "wait_for_gpus.py" in command  # the URL is in its env, out of `ps`
    assert {p["containerPort"] for p in router["ports"]} == {50051, 9400}
    assert router["readinessProbe"]["grpc"]["port"] == 50051
    # The second router joins the same Ray and Redis, and serves on the next ports.
    second_command = " ".join(second["command"] + second["args"])
    assert "kvserve router --ray-address 127.0.0.1:6379" in second_command and "--port 50052" in second_command
    assert {p["containerPort"] for p in second["ports"]} == {50052, 9401}
    assert second["readinessProbe"]["grpc"]["port"] == 50052
    second_env = {e["name"]: e for e in second["env"]}
    assert second_env["KVSERVE_REDIS_URL"] == env_of(router)["KVSERVE_REDIS_URL"]
    assert {m["mountPath"] for m in second["volumeMounts"]} == {"/tmp/ray"}
    # The router is a driver on the head node: it must see the head's Ray session dir.
    assert {m["mountPath"] for m in head["volumeMounts"]} & {m["mountPath"] for m in router["volumeMounts"]} == {
        "/tmp/ray"}
    env = {e["name"]: e for e in router["env"]}
    assert env["KVSERVE_REDIS_URL"]["value"].endswith("@kvserve-redis:6379/0")
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "kvserve-redis"

    (group,) = spec["workerGroupSpecs"]
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["rayStartParams"]["num-gpus"] == "1"
    pod = group["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1

    images = {c["image"] for c in head_pod["containers"] + pod["containers"]}
    assert images == {"kvserve:latest"}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container["env"]}


def test_kuberay_router_service_and_redis_statefulset() -> None:
    manifests = _manifests()
    service = manifests["Service/kvserve-router"]
    assert service["spec"]["selector"] == {"ray.io/cluster": "kvserve", "ray.io/node-type": "head"}
    assert {(p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        (50051, 50051), (9400, 9400), (50052, 50052), (9401, 9401)}

    redis = manifests["StatefulSet/kvserve-redis"]
    assert redis["spec"]["serviceName"] == "kvserve-redis" and "Service/kvserve-redis" in manifests
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("redis:")
    assert "--appendonly" in container["args"] and "--requirepass" in container["args"]
    assert container["ports"][0]["containerPort"] == 6379
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == container["volumeMounts"][0]["name"]
    assert claim["spec"]["resources"]["requests"]["storage"]


def test_dockerfile_builds_on_cuda_and_installs_the_project() -> None:
    text = DOCKERFILE.read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    assert "download.pytorch.org/whl/cu" in text
    assert 'pip install --no-cache-dir -e ".[worker,loadtest,bench]"' in text and "python -m protos.generate" in text
    for folder in ("protos", "router", "workers", "cluster", "loadtest", "deploy"):
        assert f"COPY {folder} ./{folder}" in text
    assert re.search(r"^EXPOSE 50051 9400 8089$", text, flags=re.MULTILINE)
    assert 'CMD ["kvserve", "up"' in text
    assert (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()[:2] == [".git", ".venv"]


@pytest.mark.parametrize("path", RAY_CONFIGS, ids=lambda p: p.name)
def test_ray_up_config_exposes_nothing_to_the_internet(path: Path) -> None:
    """The router binds 0.0.0.0 on the head, so what guards it is the network rule (a private
    range, never 0.0.0.0/0) and the bearer token the head generates for it."""
    text = path.read_text()
    config = yaml.safe_load(text)
    setup = "\n".join(config["setup_commands"])
    assert "apt-get install" not in setup or "redis" not in setup, "a system redis-server collides with Ray's port"
    head_start = "\n".join(config["head_start_ray_commands"])
    assert "--port=6379" not in head_start, "Ray's GCS on 6379, where an image's Redis may already listen"
    token_made = head_start.index("~/kvserve-token")
    assert "umask 077" in head_start and "secrets.token_urlsafe(32)" in head_start
    up = head_start.index("kvserve up")
    assert token_made < up and "--auth-token-file ~/kvserve-token" in head_start[up:]
    assert "0.0.0.0/0" not in json.dumps(config["provider"])
    ranges = re.findall(r"(?:CidrIp: |--source-ranges )(\S+?)[,}\s]", text)
    assert ranges, "no allowed address range is set"
    for cidr in ranges:
        assert ipaddress.ip_network(cidr).is_private, f"{cidr} is a public range"


def test_kuberay_router_requires_a_token() -> None:
    router = _manifests()["RayCluster/kvserve"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    env = {e["name"]: e for e in router["env"]}
    assert env["KVSERVE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "kvserve-auth", "key": "token"}
    assert "kubectl create secret generic kvserve-auth" in KUBERAY.read_text()
    service = _manifests()["Service/kvserve-router"]
    assert service["spec"]["type"] == "ClusterIP"  # inside the cluster only, until the user says otherwise


def test_kuberay_head_pod_gives_the_routers_drain_time_before_ray_stops() -> None:
    """Deleting the head pod SIGTERMs every container at once: the routers drain for
    --drain-grace, and need Ray meanwhile, so ray-head's preStop outlasts the drain and the
    pod's grace period outlasts both (Kubernetes' default 30 s is the drain itself)."""
    from cluster.up import router_only_parser

    drain_grace = router_only_parser().parse_args([]).drain_grace
    pod = _manifests()["RayCluster/kvserve"]["spec"]["headGroupSpec"]["template"]["spec"]
    head = pod["containers"][0]
    command = head["lifecycle"]["preStop"]["exec"]["command"]
    (held,) = [int(n) for n in re.findall(r"\bsleep (\d+)", " ".join(command))]
    assert drain_grace < held < pod["terminationGracePeriodSeconds"]
    for router in pod["containers"][1:]:
        assert "--drain-grace" not in " ".join(router["args"])  # the default, which this test reads


def test_the_head_reads_its_settings_from_the_env_file_docs_deploy_md_writes(tmp_path: Path) -> None:
    """docs/deploy.md had the user `export KVSERVE_NUM_GPUS ...` before `ray up`, and said
    the head's start command reads them: `ray up` passes no variable of the user's shell
    to the nodes (ray-project/ray#29016), so the head ran its defaults (2 GPUs, the small
    model, an embedded Redis) without a word. The settings now go in deploy/ray/kvserve.env,
    which file_mounts copies with the working tree, read as literal KEY=value lines (a
    review: sourced as shell, a password's `$word` vanished; and a model path with a space
    was split). Here the head's start command runs as written, on that file as the docs
    write it (and a few lines more), with `python` and `kvserve` standing in: what reaches
    the router's command line and environment."""
    import os
    import shlex
    import stat
    import time

    head_start = yaml.safe_load(RAY_CONFIGS[0].read_text())["head_start_ray_commands"]
    (command,) = [c for c in head_start if "kvserve up" in c]
    tree = tmp_path / "kvserve" / "deploy" / "ray"
    tree.mkdir(parents=True)
    (tmp_path / "kvserve-token").write_text("x" * 32)
    # The command docs/deploy.md gives, in the working tree that file_mounts copies.
    subprocess.run(["bash", "-c", DEPLOY_ENV_COMMAND], cwd=tmp_path / "kvserve", check=True)
    assert stat.S_IMODE((tree / "kvserve.env").stat().st_mode) == 0o600  # it may hold a Redis password
    with open(tree / "kvserve.env", "a") as env_file:
        env_file.write("# a comment\nKVSERVE_MODEL=/home/ubuntu/my models/Llama-3.2-1B\n"
                       "KVSERVE_REDIS_URL=redis://:Pa$word1&x=y@my-redis:6379/0\n")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    record = tmp_path / "calls"
    for name in ("python", "kvserve"):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/bash\n{{ printf "%s|" {name} "$@"; echo "REDIS=${{KVSERVE_REDIS_URL:-}}"; }} '
                        f'>> {shlex.quote(str(record))}\n')
        stub.chmod(0o755)
    env = {"HOME": str(tmp_path), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    subprocess.run(["bash", "-c", command], env=env, check=True)
    deadline = time.monotonic() + 20
    while "kvserve|up|" not in (record.read_text() if record.exists() else ""):
        assert time.monotonic() < deadline, (tmp_path / "kvserve-up.log").read_text()
        time.sleep(0.1)
    python_call, kvserve_call = record.read_text().splitlines()
    assert python_call.startswith("python|deploy/ray/wait_for_gpus.py|2|")
    assert "|--workers|2|--model|/home/ubuntu/my models/Llama-3.2-1B|" in kvserve_call, kvserve_call
    assert "--redis-url" not in kvserve_call and kvserve_call.endswith("REDIS=redis://:Pa$word1&x=y@my-redis:6379/0")
