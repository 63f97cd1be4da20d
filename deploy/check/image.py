"""The first steps of ``make deploy-check``: the tools, a base image made without a registry,
and deploy/container/Dockerfile built with podman."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

from common import ROOT, Context, Failed, Skip, trust_host_cas

# What the check installs with apt where it is missing (Debian and Ubuntu), and the command
# each package brings.
PACKAGES = {"podman": "podman", "debootstrap": "debootstrap",
            "systemd-nspawn": "systemd-container", "runc": "runc"}
SUITE = "bookworm"  # the Debian of the base image: its python3 is CPython 3.11, as the image's
PYTHON = "cp311"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
TORCH_VERSION = "2.13.0"  # the Makefile's pin (tests/unit/test_deploy.py keeps them equal)
COMPOSE = "podman-compose==1.6.0"  # the release this check ran with


def check_tools(ctx: Context) -> dict[str, object]:
    """Installs what is missing (podman, debootstrap, systemd-nspawn, runc with apt; and
    podman-compose from PyPI into a venv in the cache), or skips saying what is missing."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise Skip(f"needs Linux on x86-64, this is {platform.system()} {platform.machine()}")
    if os.geteuid() != 0:
        raise Skip("needs root (podman's networks, debootstrap and systemd-nspawn)")
    missing = [pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None]
    if missing:
        if shutil.which("apt-get") is None:
            raise Skip(f"missing {', '.join(missing)}, and no apt-get to install them")
        ctx.say(f"installing {' '.join(missing)} with apt-get")
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        try:
            ctx.sh(["apt-get", "update", "-q"], env=env)
            ctx.sh(["apt-get", "install", "-y", "-q", *missing], env=env, timeout=900)
        except Failed as e:
            raise Skip(f"cannot install {', '.join(missing)}: {e}") from None
    venv = ctx.cache / "compose-venv"
    compose = venv / "bin" / "podman-compose"
    if not compose.exists():
        ctx.say("installing podman-compose into " + str(venv))
        ctx.sh([sys.executable, "-m", "venv", str(venv)])
        ctx.sh([str(venv / "bin" / "pip"), "install", "-q", COMPOSE], timeout=300)
    version = ctx.podman("--version").stdout.strip()
    return {"podman": version.rsplit(" ", 1)[-1]}


def configure_podman(ctx: Context) -> None:
    """Finds how containers run here. crun refuses hybrid cgroups (v1 controllers beside a
    v2 tree that has some), and a machine whose hard limits are below podman's defaults
    refuses its rlimits: then every podman command of the check reads a containers.conf of
    its own (runc, and limits below this machine's). Nothing of the machine's is changed."""
    probe = ["run", "--rm", "--network", "none", ctx.base_image, "true"]
    if ctx.podman(*probe, check=False).returncode == 0:
        return
    import resource

    # This machine's hard limits, and no more processes than it has process ids (a kernel
    # may refuse an nproc limit above pid_max).
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    nofile = 1 << 20 if nofile == resource.RLIM_INFINITY else nofile
    conf = ctx.cache / "containers.conf"
    conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", '
                    f'"nproc={nproc}:{nproc}"]\n[engine]\nruntime = "runc"\n')
    ctx.podman_env["CONTAINERS_CONF"] = str(conf)
    result = ctx.podman(*probe, check=False)
    if result.returncode != 0:
        raise Skip("podman cannot start a container here: " + result.stderr.strip()[-300:])
    ctx.say(f"containers run with runc and lower rlimits here ({conf})")


def make_base(ctx: Context) -> dict[str, object]:
    """A minimal Debian with python3 and python3-venv, by debootstrap, imported as
    ``ctx.base_image``: the Dockerfile's BASE_CPU without a registry. Kept in the cache and
    in podman's storage: later runs reuse both."""
    tar = ctx.cache / f"base-{SUITE}.tar"
    if not tar.exists():
        rootfs = ctx.work / "base-rootfs"
        ctx.say(f"debootstrap {SUITE} (minbase, python3) into {rootfs}: a few minutes")
        ctx.sh(["debootstrap", "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates", SUITE, str(rootfs), MIRROR],
               timeout=1200)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / junk).glob("*"):
                if path.is_file():
                    path.unlink()
        trust_host_cas(rootfs)
        partial = tar.with_suffix(".partial")
        ctx.sh(["tar", "-C", str(rootfs), "-cf", str(partial), "."], timeout=600)
        partial.rename(tar)
        shutil.rmtree(rootfs)
    if ctx.podman("image", "exists", ctx.base_image, check=False).returncode != 0:
        ctx.podman("import", "--change", 'CMD ["/bin/bash"]', str(tar), ctx.base_image)
    configure_podman(ctx)
    return {"base_image": ctx.base_image}


def torch_wheel(ctx: Context) -> Path:
    """A CPU torch wheel for the image's Python, in ctx.cache/wheels: from PyTorch's CPU
    index where it answers, else from what this machine's pip finds for the Makefile's pin
    (a local build here); refused if that is the CUDA build."""
    wheels = ctx.cache / "wheels"
    pattern = f"torch-{TORCH_VERSION}+cpu-{PYTHON}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.11", "--implementation", "cp",
                "--platform", "manylinux_2_28_x86_64", "-d", str(wheels)]
        index = ["--index-url", "https://download.pytorch.org/whl/cpu"]
        ctx.say("downloading a CPU torch wheel for the image")
        pin = f"torch=={TORCH_VERSION}"
        if ctx.sh([*base, *index, pin], check=False, timeout=900).returncode != 0:
            ctx.sh([*base, pin], timeout=900)
        found = sorted(wheels.glob(pattern))
        if not found:
            raise Skip("no CPU build of torch for CPython 3.11 could be had (PyTorch's index "
                       "does not answer, and pip finds only the CUDA build): put one in "
                       f"{wheels}")
    ctx.wheels, ctx.torch = wheels, f"torch=={TORCH_VERSION}+cpu"
    return found[-1]


def build_image(ctx: Context) -> dict[str, object]:
    """deploy/container/Dockerfile, built with podman as it is, given the base image and a
    torch wheel through its build arguments and wheels folder."""
    wheel = torch_wheel(ctx)
    before = ctx.podman("image", "inspect", "--format", "{{.Id}}", ctx.image, check=False)
    if before.returncode == 0 and ctx.replaced is None:
        ctx.replaced = before.stdout.strip()  # put back at the end (restore_image)
    drop = ROOT / "deploy" / "container" / "wheels" / wheel.name
    placed = not drop.exists()
    if placed:
        shutil.copyfile(wheel, drop)
    try:
        ctx.say(f"building {ctx.image} with {ctx.torch}")
        # Buildah before 1.29 (podman 4.3, Debian 12's) does not see that FROM base-${VARIANT}
        # uses a stage, and skips it: it must build every stage, the CUDA one too (from the
        # same base here: it only installs python3).
        ctx.podman("build", "--skip-unused-stages=false", "-f", "deploy/container/Dockerfile",
                   "--build-arg", f"BASE_CPU={ctx.base_image}",
                   "--build-arg", f"BASE_CUDA={ctx.base_image}",
                   "--build-arg", "TORCH_INDEX=https://pypi.org/simple",
                   "--build-arg", f"TORCH={ctx.torch}", "-t", ctx.image, ".", timeout=1200)
    finally:
        if placed:
            drop.unlink()
    size = int(ctx.podman("image", "inspect", "--format", "{{.Size}}", ctx.image)
               .stdout.strip())
    torch_mb = ctx.podman("run", "--rm", "--network", "none", "--entrypoint", "du",
                          ctx.image, "-sm", "/opt/gossipd/lib/python3.11/site-packages/torch")
    user = ctx.podman("run", "--rm", "--network", "none", "--entrypoint", "id", ctx.image)
    if "uid=10001(gossipd) gid=10001(gossipd)" not in user.stdout:
        raise Failed(f"the image's user is not gossipd 10001:10001: {user.stdout.strip()}")
    return {"image_mb": round(size / 2**20), "torch_mb": int(torch_mb.stdout.split()[0]),
            "torch": ctx.torch}


def restore_image(ctx: Context) -> None:
    """Tags the image that was ``ctx.image`` before the check built its own (on its own base,
    trusting this machine's CAs) as it was; the check's stays as ``<image>-deploy-check``."""
    if ctx.replaced is None:
        return
    now = ctx.podman("image", "inspect", "--format", "{{.Id}}", ctx.image, check=False)
    if now.returncode == 0 and now.stdout.strip() != ctx.replaced:
        ctx.podman("tag", ctx.image, f"{ctx.image}-deploy-check", check=False)
        ctx.podman("tag", ctx.replaced, ctx.image, check=False)
        ctx.say(f"{ctx.image} is again the image it was; the check's is "
                f"{ctx.image}-deploy-check")
