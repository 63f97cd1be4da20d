"""The Kubernetes step of ``make deploy-check``: what runs without a cluster. Two pods of the
StatefulSet in deploy/kubernetes, rendered as kustomize, the StatefulSet controller and the
kubelet would make them, with the ConfigMap and the swarm key Secret, under ``podman kube
play`` on an internal network of their own. Where podman (4.3, Debian 12's) does not do what
Kubernetes does, the nearest honest thing is rendered and named in ``kube_substituted``;
``kube_not_run`` names what has still run nowhere."""

from __future__ import annotations

import base64
import copy
import ipaddress
import json
import re
import shutil
import time
from typing import Any

import yaml

from common import ROOT, Context, Failed, Skip, wait_for

KUBERNETES = ROOT / "deploy" / "kubernetes"
PREFIX = "gossipd-kcheck"  # the network, volumes and secret made here (the pods: gossipd-N)
REPLICAS = 2
NOT_RUN = [
    "the StatefulSet controller: podManagementPolicy, rolling updates, replicas: 3 (two pods "
    "run here), a pod rescheduled onto its claim",
    "the PodDisruptionBudget",
    "the NetworkPolicy (podman enforces none)",
    "the headless Service: its DNS names and publishNotReadyAddresses",
    "kustomize itself (its labels, images and secretGenerator are rendered here)",
    "the kubelet's probes on their schedules (each probe's command runs once here)",
    "fsGroup, fsGroupChangePolicy, runAsNonRoot, seccompProfile, the Secret's defaultMode "
    "0440, requests.cpu, terminationGracePeriodSeconds: podman 4.3 ignores them",
]
Doc = dict[str, Any]


def check_kube(ctx: Context) -> dict[str, object]:
    """Play the pods; each runs, sees the other alive at its pod IP, trains its own shard with
    steps going up, passes its probes' commands, and stops with exit 0 and a final checkpoint
    within the grace period. The pods, volumes, secret and network made here are removed at
    the end, whatever happened."""
    if shutil.which("podman") is None:
        raise Skip("podman is not installed")
    if ctx.podman("image", "exists", ctx.image, check=False).returncode != 0:
        raise Skip(f"no image {ctx.image} (the image step builds it)")
    version = ctx.podman("version", "--format", "{{.Client.Version}}").stdout.strip()
    sts, config = _load("statefulset.yaml"), _load("configmap.yaml")
    template = sts["spec"]["template"]["spec"]
    (main,) = template["containers"]
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(REPLICAS)]
    ctrs = [f"{pod}-{main['name']}" for pod in pods]  # kube play's names
    for pod in pods:
        if ctx.podman("pod", "exists", pod, check=False).returncode == 0 and not _ours(ctx, pod):
            raise Skip(f"a pod {pod} exists that this step did not make; not touching it")
    started, ok = time.monotonic(), False
    _clean(ctx, pods)  # what an interrupted run may have left
    try:
        ctx.podman("network", "create", "--internal", PREFIX)
        subnet = json.loads(ctx.podman("network", "inspect", PREFIX).stdout)[0]["subnets"][0]
        first = ipaddress.ip_network(subnet["subnet"]).network_address + 10
        ips = [str(first + i) for i in range(REPLICAS)]
        docs, substituted = render(sts, config, _swarm_key(ctx), ips, ctx.image, version)
        played = ctx.work / "kube.yaml"
        played.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        ctx.podman("kube", "play", "--network", PREFIX,
                   *[a for ip in ips for a in ("--ip", ip)], str(played), timeout=180)
        figures: dict[str, object] = {"kube_podman": version}
        figures["kube_ready_s"] = _ready(ctx, ctrs, ips, main, started)
        figures["kube_steps"] = _steps_go_up(ctx, ctrs)
        figures["kube_confined"] = _confined(ctx, ctrs, template)
        figures["kube_memory"] = ctx.podman("stats", "--no-stream", "--format", "{{.MemUsage}}",
                                            *ctrs, check=False).stdout.strip().splitlines()
        for c in ctrs:  # the livenessProbe, as podman's health check
            ctx.podman("healthcheck", "run", c, timeout=60)
        figures["kube_stop"] = _stop(ctx, pods, ctrs, template)
        ctx.podman("kube", "down", str(played), timeout=120)
        figures["kube_substituted"] = substituted
        figures["kube_not_run"] = NOT_RUN
        figures["kube_seconds"] = round(time.monotonic() - started, 1)
        ok = True
        return figures
    finally:
        if not ok:
            for c in ctrs:
                ctx.podman("logs", "--tail", "40", c, check=False)
        _clean(ctx, pods)


def render(sts: Doc, config: Doc, key: str, ips: list[str], image: str,
           version: str) -> tuple[list[Doc], list[str]]:
    """The ConfigMap, the Secret kustomize makes from swarm.key (``key``: its text) and, for
    each IP of ``ips``, the pod the StatefulSet makes and its claim; with, in words, what was
    rendered in podman's place."""
    kustomization = _load("kustomization.yaml")
    labels = {k: v for entry in kustomization.get("labels", []) for k, v in entry["pairs"].items()}
    (generator,) = kustomization["secretGenerator"]
    (wanted,) = [i for i in kustomization["images"] if i["name"] == "gossipd"]
    names = {n: f"{PREFIX}-{n}" for n in (config["metadata"]["name"], generator["name"])}
    notes = [f"image {image} for {wanted['newName']}:{wanted['newTag']} (kustomization images)",
             f"ConfigMap, Secret and claims named {PREFIX}-... (podman makes host-wide volumes "
             "and secrets of them)"]
    old = tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < (4, 4)
    secret = key.strip().encode()
    if old:
        secret = base64.b64decode(secret, validate=True)
        notes.append(f"the Secret's data decoded once more (podman {version} writes a Secret "
                     "volume's files base64-encoded) and its volume's optional: false spelled "
                     "out (podman < 4.4 crashes without it)")
    cm = {**copy.deepcopy(config), "metadata": {"name": names[config["metadata"]["name"]],
                                                "labels": labels}}
    docs: list[Doc] = [cm, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                            "metadata": {"name": names[generator["name"]], "labels": labels},
                            "data": {"swarm.key": base64.b64encode(secret).decode()}}]
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    hosts = [{"ip": ip, "hostnames": [f"{name}-{i}.{service}"]} for i, ip in enumerate(ips)]
    notes.append(f"the Service's names {name}-N.{service}: hostAliases (/etc/hosts) to the pods' "
                 "IPs (podman's DNS knows the pod names only)")
    for i, ip in enumerate(ips):
        pod = f"{name}-{i}"
        template = copy.deepcopy(sts["spec"]["template"])
        meta = {"name": pod, "labels": {**template["metadata"].get("labels", {}), **labels,
                                        "statefulset.kubernetes.io/pod-name": pod,
                                        "apps.kubernetes.io/pod-index": str(i)},
                "annotations": template["metadata"].get("annotations", {})}
        spec = template["spec"]
        spec.update(hostname=pod, subdomain=service, hostAliases=hosts)
        for claim in sts["spec"].get("volumeClaimTemplates", []):
            claim_name = f"{PREFIX}-{claim['metadata']['name']}-{pod}"
            docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "metadata": {"name": claim_name, "labels": labels},
                         "spec": claim["spec"]})
            spec["volumes"].append({"name": claim["metadata"]["name"],
                                    "persistentVolumeClaim": {"claimName": claim_name}})
        for volume in spec["volumes"]:
            if "emptyDir" in volume:
                renamed = f"{PREFIX}-{pod}-{volume['name']}"
                for mount in (m for c in spec["containers"] for m in c.get("volumeMounts", [])):
                    mount["name"] = renamed if mount["name"] == volume["name"] else mount["name"]
                volume["name"] = renamed
                notes.append(f"emptyDir volumes named {PREFIX}-<pod>-<name> (podman 4.3 makes "
                             "one volume named as the pod's, shared by pods naming it alike)")
            if "configMap" in volume:
                volume["configMap"]["name"] = names[volume["configMap"]["name"]]
            if "secret" in volume:
                volume["secret"]["secretName"] = names[volume["secret"]["secretName"]]
                if old:
                    volume["secret"].setdefault("optional", False)
        for c in spec["containers"]:
            notes += _container(c, image, wanted["name"], meta, ip)
        docs.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
    notes.append("the probes: each one's command run by this step (podman ignores startupProbe "
                 "and readinessProbe, and runs a livenessProbe's health check only under systemd)")
    notes.append("the graceful stop: podman pod stop -t terminationGracePeriodSeconds before "
                 "kube down (podman 4.3's kube down stops with no grace period)")
    return docs, list(dict.fromkeys(notes))


def _container(c: Doc, image: str, wanted: str, meta: Doc, ip: str) -> list[str]:
    """Renders container ``c`` of pod ``meta`` at ``ip`` in place; returns what it substituted."""
    if c["image"].split(":")[0] != wanted:
        raise Failed(f"kustomization images: does not name the image {c['image']}")
    c["image"] = image
    notes: list[str] = []
    env: dict[str, str] = {}
    if c.pop("ports", None):
        notes.append("containerPort entries left out (podman 4.3 publishes each on the host; "
                     "Kubernetes does not)")
    for e in c.get("env", []):
        path = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[e["name"]] = _field(path, meta, ip) if path else _expand(e.get("value", ""), env)
        if path == "status.podIP":
            e.pop("valueFrom")
            e["value"] = ip
            notes.append("status.podIP: the IP given to the pod with kube play --ip (podman has "
                         "no status.podIP fieldRef)")
    for field in ("command", "args"):
        if field in c and c[field] != (done := [_expand(a, env) for a in c[field]]):
            c[field] = done
            notes.append(f"$(VAR) in {field} expanded as the kubelet does (podman passes it on "
                         "as it is)")
    return notes


def _load(name: str) -> Doc:
    (doc,) = [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]
    return doc


def _field(path: str, meta: Doc, ip: str) -> str:
    """The value the kubelet gives an env var from ``fieldRef: {fieldPath: path}``."""
    if path == "status.podIP":
        return ip
    if path == "metadata.name":
        return str(meta["name"])
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return str(meta[m[1]].get(m[2], ""))
    raise Failed(f"fieldRef {path}: this step does not render it")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined VAR is replaced, $$ is a $, the rest stays."""
    return re.sub(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.-]*)\))",
                  lambda m: "$" if m[1] == "$" else env.get(m[2], m[0]), text)


def _swarm_key(ctx: Context) -> str:
    """A new swarm key's text, made with the image as the operator makes swarm.key."""
    (keys := ctx.work / "swarm-key").mkdir(mode=0o777, parents=True, exist_ok=True)
    keys.chmod(0o777)  # the image's user writes it (mkdir's mode passes through the umask)
    ctx.podman("run", "--rm", "--network", "none", "-v", f"{keys}:/out", ctx.image,
               "keygen", "--swarm-key", "/out/swarm.key", timeout=120)
    text = (keys / "swarm.key").read_text()
    (keys / "swarm.key").unlink()
    return text


def _inspect(ctx: Context, container: str) -> Doc:
    return json.loads(ctx.podman("container", "inspect", container).stdout)[0]


def _status(ctx: Context, container: str) -> Doc:
    result = ctx.podman("exec", container, "gossipd", "status", "--json", check=False)
    try:
        return json.loads(result.stdout) if result.returncode == 0 else {}
    except json.JSONDecodeError:
        return {}


def _confined(ctx: Context, ctrs: list[str], template: Doc) -> str:
    """Each pod's daemon runs as the pod's runAsUser and runAsGroup, holds no capability, and
    cannot write its root file system, only its state volume."""
    pod, (c,) = template["securityContext"], template["containers"]
    want = f"{pod['runAsUser']}:{pod['runAsGroup']}"
    for ctr in ctrs:
        ids = ctx.podman("exec", ctr, "sh", "-c", 'echo "$(id -u):$(id -g)"').stdout.strip()
        caps = ctx.podman("exec", ctr, "sh", "-c", "grep CapEff /proc/1/status").stdout.split()
        root = ctx.podman("exec", ctr, "touch", "/probe", check=False)
        state = ctx.podman("exec", ctr, "sh", "-c",
                           "touch /var/lib/gossipd/.probe && rm /var/lib/gossipd/.probe",
                           check=False)
        if ids != want or caps[-1:] != ["0000000000000000"]:
            raise Failed(f"{ctr} runs as {ids} with CapEff {caps[-1:]}, not {want} without "
                         "capabilities")
        read_only = c["securityContext"].get("readOnlyRootFilesystem")
        if (root.returncode == 0) == bool(read_only) or state.returncode != 0:
            raise Failed(f"{ctr}: writing / {'worked' if root.returncode == 0 else 'failed'} "
                         f"(readOnlyRootFilesystem {read_only}), writing its state volume "
                         f"{'worked' if state.returncode == 0 else 'failed'}")
    return f"uid:gid {want}, no capabilities, read-only root"


def _ready(ctx: Context, ctrs: list[str], ips: list[str], main: Doc, started: float) -> float:
    """Waits until each pod passes its startup and readiness probes' commands and sees every
    other pod alive at its IP; checks that it advertises its own IP and trains the shard of its
    index. Returns the seconds since the step began."""
    probes = [main[p]["exec"]["command"] for p in ("startupProbe", "readinessProbe")]

    def joined(i: int) -> bool:
        found = _inspect(ctx, ctrs[i])
        if found["State"]["Status"] != "running" or found["RestartCount"]:
            raise Failed(f"{ctrs[i]} is {found['State']['Status']} (exit "
                         f"{found['State']['ExitCode']}) or was restarted: see the log")
        if any(ctx.podman("exec", ctrs[i], *p, check=False).returncode for p in probes):
            return False
        s = _status(ctx, ctrs[i])
        if s and (s["address"], s["shard"]) != (f"{ips[i]}:7070", i):
            raise Failed(f"{ctrs[i]} advertises {s['address']} and trains shard {s['shard']}, "
                         f"not {ips[i]}:7070 and shard {i}")
        alive = {m["address"] for m in s.get("members", []) if m["state"] == "alive"}
        return {f"{ip}:7070" for j, ip in enumerate(ips) if j != i} <= alive

    for i, c in enumerate(ctrs):
        wait_for(f"{c} to be ready and see the other pods", lambda i=i: joined(i), 200, 3)
    return round(time.monotonic() - started, 1)


def _steps_go_up(ctx: Context, ctrs: list[str]) -> list[list[int]]:
    """Each pod's own steps, twice: the second larger."""
    def higher() -> list[int] | None:
        now = [int(_status(ctx, c).get("own_steps") or 0) for c in ctrs]
        return now if all(b > a for a, b in zip(first, now)) else None

    first = [int(_status(ctx, c).get("own_steps") or 0) for c in ctrs]
    return [list(pair) for pair in zip(first, wait_for("steps to go up", higher, 60, 3))]


def _stop(ctx: Context, pods: list[str], ctrs: list[str], spec: Doc) -> dict[str, object]:
    """Stops the pods within the grace period: each must exit 0 after a final checkpoint."""
    grace = int(spec.get("terminationGracePeriodSeconds", 30))
    since, started = str(int(time.time()) - 1), time.monotonic()
    ctx.podman("pod", "stop", "-t", str(grace), *pods, timeout=grace + 60)
    seconds = round(time.monotonic() - started, 1)
    codes = [_inspect(ctx, c)["State"]["ExitCode"] for c in ctrs]
    if codes != [0] * len(ctrs):
        raise Failed(f"the pods stopped with exit codes {codes}, not 0")
    final = []
    for c in ctrs:
        result = ctx.podman("logs", "--since", since, c)
        out = result.stdout + result.stderr  # the daemon logs to stderr
        written = re.findall(r"checkpoint path=\S+ step=(\d+)",
                             out[max(out.find("stopping signal=SIGTERM"), 0):])
        if "stopping signal=SIGTERM" not in out or not written:
            raise Failed(f"{c} wrote no final checkpoint after SIGTERM")
        final.append(int(written[-1]))
    return {"seconds": seconds, "exit_codes": codes, "final_checkpoint_steps": final}


def _ours(ctx: Context, pod: str) -> bool:
    """Whether ``pod`` is on this step's network, and so this step's."""
    result = ctx.podman("pod", "inspect", pod, "--format", "{{json .InfraConfig.Networks}}",
                        check=False)
    try:
        return result.returncode == 0 and PREFIX in (json.loads(result.stdout) or [])
    except json.JSONDecodeError:
        return False


def _clean(ctx: Context, pods: list[str]) -> None:
    """Removes this step's pods (those on its network), volumes, secrets and network."""
    for pod in pods:
        if _ours(ctx, pod):
            ctx.podman("pod", "rm", "-f", "-t", "0", pod, check=False)

    def named(kind: str) -> list[str]:
        out = ctx.podman(kind, "ls", "--format", "{{.Name}}", check=False).stdout.split()
        return [n for n in out if n.startswith(PREFIX)]

    if volumes := named("volume"):
        ctx.podman("volume", "rm", *volumes, check=False)
    if secrets := named("secret"):
        ctx.podman("secret", "rm", *secrets, check=False)
    if PREFIX in named("network"):
        ctx.podman("network", "rm", PREFIX, check=False)
