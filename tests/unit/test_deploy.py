"""The deployment files under deploy/: every YAML and TOML file parses, every config they
carry passes ``gossipd check-config`` exactly as the node starts with it, the Kubernetes
objects hang together, and the systemd unit, the manifests and the Dockerfile pass the
tools that check them where those tools can run here (a skip says why where they cannot).
Also the facts the manifests rely on: a bootstrap or advertised address may be a DNS name,
resolved when it is dialed."""

from __future__ import annotations

import base64
import importlib
import importlib.util
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

import gossip
from daemon import config as config_module
from daemon.cli import main
from daemon.config import from_dict
from daemon.keys import write_swarm_key
from gossip.config import NodeConfig
from gossip.errors import PeerGone
from gossip.network import TcpNetwork
from gossip.roster import open_roster

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "gossipd.service"
GOSSIPD = Path(sys.executable).parent / "gossipd"
POD_IP = "10.244.1.7"  # stands in for $(POD_IP), which Kubernetes fills in from the pod


@pytest.fixture(autouse=True)
def _no_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config_module.ENV, raising=False)


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_yaml(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifests() -> dict[str, dict[str, Any]]:
    """The Kubernetes objects under deploy/kubernetes, by kind (one of each)."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in load_yaml(path):
                assert doc["kind"] not in objects, f"{path.name}: a second {doc['kind']}"
                objects[doc["kind"]] = doc
    return objects


def container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (c,) = objects["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return c


# --- every file parses ------------------------------------------------------------------


def test_there_is_something_to_check() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()}
    for expected in ("systemd/gossipd.service", "systemd/gossipd.toml", "container/Dockerfile",
                     "compose.yaml", "compose/gossipd.toml", "kubernetes/kustomization.yaml",
                     "kubernetes/statefulset.yaml", "kubernetes/configmap.yaml"):
        assert expected in names


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_yaml_parses(path: Path) -> None:
    docs = load_yaml(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.toml")),
                         ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_toml_parses(path: Path) -> None:
    assert tomllib.loads(path.read_text())


def test_kubernetes_objects_are_whole() -> None:
    for kind, obj in manifests().items():
        assert set(obj) >= {"apiVersion", "kind", "metadata"}, kind
        assert obj["metadata"]["name"], kind
        assert "spec" in obj or "data" in obj, kind


# --- every config passes check-config, as the node starts with it ------------------------


def check_config(tmp_path: Path, text: str, overrides: list[str]) -> None:
    """``gossipd check-config`` on ``text`` with the node's own ``--set`` arguments. The swarm
    key exists only where the node runs: ``swarm.key_file`` points at a fresh one here."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "gossipd.toml"
    path.write_text(text)
    key = tmp_path / "swarm.key"
    write_swarm_key(key, bytes(range(32)))
    assert main(["check-config", "-c", str(path), *overrides,
                 "--set", f"swarm.key_file={key}"]) == 0


def sets(args: list[str]) -> list[str]:
    """The ``--set`` pairs of a ``gossipd`` argument list."""
    return [x for i, a in enumerate(args) if a == "--set" for x in ("--set", args[i + 1])]


def test_systemd_config_passes_check_config(tmp_path: Path) -> None:
    check_config(tmp_path, (DEPLOY / "systemd" / "gossipd.toml").read_text(), [])


def compose_nodes() -> dict[str, dict[str, Any]]:
    (compose,) = load_yaml(DEPLOY / "compose.yaml")
    return {name: s for name, s in compose["services"].items() if name.startswith("node")}


@pytest.mark.parametrize("name", sorted(compose_nodes()))
def test_compose_node_config_passes_check_config(tmp_path: Path, name: str) -> None:
    service = compose_nodes()[name]
    (mount,) = [v for v in service["volumes"] if v.endswith(":/etc/gossipd/gossipd.toml:ro")]
    text = (DEPLOY / mount.split(":")[0]).read_text()
    check_config(tmp_path, text, sets(service["command"]))


def test_kubernetes_config_passes_check_config(tmp_path: Path) -> None:
    objects = manifests()
    text = objects["ConfigMap"]["data"]["gossipd.toml"]
    replicas = objects["StatefulSet"]["spec"]["replicas"]
    # One shard per pod: every pod's index is a valid shard, and no shard is left out.
    assert tomllib.loads(text)["task"]["shards"] == replicas
    for index in range(replicas):
        args = [a.replace("$(POD_IP)", POD_IP).replace("$(POD_INDEX)", str(index))
                for a in container(objects)["args"]]
        check_config(tmp_path / str(index), text, sets(args))


# --- the files agree with each other and with the daemon ----------------------------------


def test_compose_swarm() -> None:
    (compose,) = load_yaml(DEPLOY / "compose.yaml")
    nodes = compose_nodes()
    assert len(nodes) == 3
    config = tomllib.loads((DEPLOY / "compose" / "gossipd.toml").read_text())
    assert config["swarm"]["bootstrap"][0] == "node1:7070"  # the first node's service name
    for name, service in nodes.items():
        advertise = f"node.advertise={name}:7070"
        assert advertise in service["command"]
        # healthy once joined and training (status finds the socket without advertise)
        assert service["healthcheck"]["test"] == ["CMD", "gossipd", "status", "--ready"]
        assert f"{name}:7070" in config["swarm"]["bootstrap"]
        assert service["depends_on"]["swarm-key"]["condition"] == "service_completed_successfully"
    # the key is made by a service into a volume, never kept in the repository
    assert "keygen" in compose["services"]["swarm-key"]["command"][0]
    assert not list(DEPLOY.rglob("swarm.key"))


def test_kubernetes_swarm_hangs_together() -> None:
    objects = manifests()
    sts, svc, pdb = objects["StatefulSet"], objects["Service"], objects["PodDisruptionBudget"]
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # headless, and a pod's name resolves before it is ready (it becomes ready by joining)
    assert spec["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert spec["podManagementPolicy"] == "Parallel"
    # bootstrap addresses are the pods' DNS names, of pods that exist
    config = tomllib.loads(objects["ConfigMap"]["data"]["gossipd.toml"])
    name, service = sts["metadata"]["name"], svc["metadata"]["name"]
    expected = [f"{name}-{i}.{service}:7070" for i in range(spec["replicas"])]
    assert config["swarm"]["bootstrap"] == expected
    # one port, both protocols, in the container, the Service and the NetworkPolicy
    c = container(objects)
    assert {(p["containerPort"], p["protocol"]) for p in c["ports"]} >= {(7070, "TCP"), (7070, "UDP")}
    assert {(p["port"], p["protocol"]) for p in svc["spec"]["ports"]} >= {(7070, "TCP"), (7070, "UDP")}
    assert config["node"]["listen"].endswith(":7070")
    assert config["metrics"]["prometheus"].endswith(":9464")
    # the files the config names are where the pod mounts them
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert config["node"]["data_dir"] == mounts["state"]
    assert config["swarm"]["key_file"] == mounts["swarm-key"] + "/swarm.key"
    env = {e["name"]: e for e in c["env"]}
    assert env["GOSSIPD_CONFIG"]["value"] == mounts["config"] + "/gossipd.toml"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # probes: alive = the control socket answers; ready = joined and training. They read
    # the config from $GOSSIPD_CONFIG, which the daemon reads too.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["gossipd", "status"]
        assert ("--ready" in command) == (probe == "readinessProbe")
    assert "node.advertise=$(POD_IP):7070" in c["args"]
    # non-root, and a grace period that fits the graceful stop, as in the systemd unit
    assert pod["securityContext"]["runAsNonRoot"]
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert f"TimeoutStopSec={pod['terminationGracePeriodSeconds']}" in UNIT.read_text()
    assert "nvidia.com/gpu" in (KUBERNETES / "statefulset.yaml").read_text()


def test_dockerfile() -> None:
    text = (DEPLOY / "container" / "Dockerfile").read_text()
    assert "ARG VARIANT=cpu" in text and "FROM base-${VARIANT}" in text
    assert "AS base-cpu" in text and "AS base-cuda" in text
    assert "USER gossipd" in text and "VOLUME /var/lib/gossipd" in text
    assert 'CMD ["gossipd", "status"]' in text
    assert "EXPOSE 7070/tcp 7070/udp" in text
    # a base and torch from elsewhere than the registries (make deploy-check builds it so)
    assert "FROM ${BASE_CPU} AS base-cpu" in text and "FROM ${BASE_CUDA} AS base-cuda" in text
    assert '--index-url "${TORCH_INDEX:-$TORCH_INDEX_DEFAULT}"' in text
    assert "--mount=type=bind,source=deploy/container/wheels,target=/wheels" in text
    assert "--uid 10001 --gid 10001" in text  # runAsUser and runAsGroup in statefulset.yaml
    ignore = (DEPLOY / "container" / "Dockerfile.dockerignore").read_text().splitlines()
    assert "!deploy/container/wheels/" in ignore
    assert (DEPLOY / "container" / "wheels").is_dir()


@pytest.fixture
def deploy_check(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Imports a module of deploy/check by name (they import each other as top-level
    modules); whatever they were, the names are as before after the test (bench/ has a
    common.py too)."""
    folder = DEPLOY / "check"
    names = [p.stem for p in folder.glob("*.py") if not p.stem.startswith("__")]
    monkeypatch.syspath_prepend(str(folder))
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module
    for name in names:
        sys.modules.pop(name, None)


def test_deploy_check_steps_exist(deploy_check: Any) -> None:
    """make deploy-check's table of steps names functions its modules have (the modules
    import with this Python, though the check itself needs root and podman)."""
    spec = importlib.util.spec_from_file_location("deploy_check_main",
                                                  DEPLOY / "check" / "__main__.py")
    assert spec is not None and spec.loader is not None
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    for name, target, needs in main.STEPS:
        module, function = target.split(":")
        assert callable(getattr(deploy_check(module), function)), name
        assert set(needs) <= {n for n, _, _ in main.STEPS}


def test_deploy_check_takes_the_makefiles_torch(deploy_check: Any) -> None:
    """The image make deploy-check builds holds the torch release make test tests."""
    makefile = (DEPLOY.parent / "Makefile").read_text()
    assert f"TORCH ?= torch=={deploy_check('image').TORCH_VERSION}\n" in makefile


def test_deploy_check_renders_the_statefulsets_pods(deploy_check: Any) -> None:
    """What make deploy-check plays under podman is the StatefulSet's pod as Kubernetes would
    make it: the controller's name and labels, the kubelet's $(VAR) expansion from the pod's
    IP and index, the Secret kustomize makes, the Service's names for the bootstrap list."""
    kube = deploy_check("kube")
    sts, config = kube._load("statefulset.yaml"), kube._load("configmap.yaml")
    ips = ["10.89.0.10", "10.89.0.11"]
    docs, notes = kube.render(sts, config, "a2V5\n", ips, "localhost/gossipd:cpu", "4.9.0")
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "Secret", "PersistentVolumeClaim", "Pod",
                     "PersistentVolumeClaim", "Pod"]
    # the Secret holds swarm.key's text as kustomize makes it (base64 of the file)
    assert docs[1]["data"] == {"swarm.key": base64.b64encode(b"a2V5").decode()}
    pods = [d for d in docs if d["kind"] == "Pod"]
    for i, pod in enumerate(pods):
        assert pod["metadata"]["name"] == f"gossipd-{i}"
        assert pod["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == str(i)
        (c,) = pod["spec"]["containers"]
        assert c["image"] == "localhost/gossipd:cpu" and "ports" not in c
        assert c["args"] == ["run", "--set", f"node.advertise={ips[i]}:7070",
                             "--set", f"task.shard={i}"]
        aliases = {h["hostnames"][0]: h["ip"] for h in pod["spec"]["hostAliases"]}
        assert aliases == {"gossipd-0.gossipd": ips[0], "gossipd-1.gossipd": ips[1]}
        claims = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert claims[0]["persistentVolumeClaim"]["claimName"] == f"gossipd-kcheck-state-gossipd-{i}"
    assert any("status.podIP" in n for n in notes)
    old, _ = kube.render(sts, config, "a2V5\n", ips, "localhost/gossipd:cpu", "4.3.1")
    # podman 4.3 writes a Secret's data undecoded: the data is the file's text itself
    assert old[1]["data"] == {"swarm.key": "a2V5"}
    assert kube._expand("$(A)-$$(A)-$(B)", {"A": "x"}) == "x-$(A)-$(B)"


# --- the tools that check these files, where they can run ---------------------------------


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kwargs)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: the unit names /opt/gossipd, where the
    # operator installs it; the copy verified here names the gossipd installed with this test.
    text = UNIT.read_text()
    assert "ExecStart=/opt/gossipd/bin/gossipd " in text
    copy = tmp_path / "gossipd.service"
    copy.write_text(text.replace("ExecStart=/opt/gossipd/bin/gossipd ", f"ExecStart={GOSSIPD} "))
    result = run(["systemd-analyze", "verify", str(copy)])
    # Unknown keys and bad values are only warnings, with exit code 0: none is allowed.
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.fixture
def kustomize_dir(tmp_path: Path) -> Path:
    """deploy/kubernetes with the swarm key file the operator makes (never committed)."""
    directory = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, directory)
    write_swarm_key(directory / "swarm.key", bytes(range(32)))
    return directory


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize(kustomize_dir: Path) -> None:
    result = run(["kubectl", "kustomize", str(kustomize_dir)])
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Secret", "Service",
                     "StatefulSet"]
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("registry.example.com/gossipd:")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_apply_dry_run(kustomize_dir: Path) -> None:
    result = run(["kubectl", "apply", "--dry-run=client", "-k", str(kustomize_dir)])
    if result.returncode != 0 and any(s in result.stderr for s in (
            "connection refused", "failed to download openapi", "no such host",
            "couldn't get current server API group list")):
        pytest.skip("kubectl apply --dry-run=client needs an API server for its schemas, "
                    "and none is reachable")
    assert result.returncode == 0, result.stderr


def docker_daemon() -> bool:
    return shutil.which("docker") is not None and run(["docker", "info"]).returncode == 0


@pytest.mark.skipif(not docker_daemon(), reason="no docker daemon answers (docker build "
                    "--check runs in the daemon's BuildKit)")
@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_docker_build_check(variant: str) -> None:
    result = run(["docker", "build", "--check", "--build-arg", f"VARIANT={variant}",
                  "-f", str(DEPLOY / "container" / "Dockerfile"), str(DEPLOY.parent)])
    assert result.returncode == 0, result.stdout + result.stderr


# --- DNS names as addresses ----------------------------------------------------------------


def test_config_takes_dns_names() -> None:
    config = from_dict({
        "node": {"listen": "0.0.0.0:7070", "advertise": "gossipd-1.gossipd:7070"},
        "swarm": {"name": "s", "bootstrap": ["gossipd-0.gossipd:7070", "node1:7070"]},
        "task": {"entry": "daemon.tasks.digits:task"},
    })
    assert config.swarm.bootstrap == ("gossipd-0.gossipd:7070", "node1:7070")


class Resolver(trio.abc.HostnameResolver):
    """A DNS stand-in: ``names`` to IPv4 addresses; anything else does not exist."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names
        self.asked: list[str] = []

    async def getaddrinfo(self, host: Any, port: Any, family: int = 0, type: int = 0,
                          proto: int = 0, flags: int = 0) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        self.asked.append(name)
        if name not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        kind = type or socket.SOCK_STREAM
        return [(socket.AF_INET, kind, 0, "", (self.names[name], int(port)))]

    async def getnameinfo(self, sockaddr: Any, flags: int) -> Any:
        raise NotImplementedError


async def test_a_host_name_is_resolved_when_dialed() -> None:
    resolver = Resolver({})
    trio.socket.set_custom_hostname_resolver(resolver)
    network = TcpNetwork()

    async def handler(stream: trio.abc.Stream) -> None:
        await stream.send_all(b"hi")

    async with trio.open_nursery() as nursery:
        address = await nursery.start(network.serve, "127.0.0.1:0", handler)
        port = address.rsplit(":", 1)[1]
        with pytest.raises(PeerGone, match=rf"^cannot connect to gossipd-0\.gossipd:{port}: "
                                           r"Name or service not known$"):
            await network.dial(f"gossipd-0.gossipd:{port}")
        resolver.names["gossipd-0.gossipd"] = "127.0.0.1"  # the pod came up: asked again
        with trio.fail_after(10):
            stream = await network.dial(f"gossipd-0.gossipd:{port}")
            assert await stream.receive_some(2) == b"hi"
        await stream.aclose()
        assert resolver.asked == ["gossipd-0.gossipd", "gossipd-0.gossipd"]
        nursery.cancel_scope.cancel()


async def test_joining_through_a_host_name() -> None:
    trio.socket.set_custom_hostname_resolver(Resolver({"seed.gossipd": "127.0.0.1"}))
    swarm, network = gossip.Swarm.generate("dns"), TcpNetwork()
    async with open_roster(network, gossip.Identity.generate(), swarm,
                           NodeConfig(listen="127.0.0.1:0")) as seed:
        port = seed.address.rsplit(":", 1)[1]
        async with open_roster(network, gossip.Identity.generate(), swarm,
                               NodeConfig(listen="127.0.0.1:0",
                                          bootstrap=[f"seed.gossipd:{port}"])) as joiner:
            with trio.fail_after(20):
                await joiner.wait_joined()
            assert joiner.joined
