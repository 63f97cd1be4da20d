"""The systemd step of ``make deploy-check``: deploy/systemd/ installed as docs/OPERATIONS.md
("With systemd") says, in a Debian bookworm booted with systemd-nspawn, and the unit run.

The machine boots from a debootstrapped tree (kept as a tar in the cache) with the host's
network, a copy of the checkout in /root/gossipd and the torch wheel folder bound read-only at
/wheels; every command runs in it through ``nsenter`` into its PID 1 (this host has no
systemd, so no machinectl). The only departures from the documented commands: torch comes
from /wheels (``ctx.torch``), the project from the copied checkout rather than PyPI, and the
node listens on port 17070, not 7070, which the container checks may hold.

How the sandbox is verified, from the running daemon's own view: a probe enters the mount
namespace of the unit's main process (``nsenter -t MainPID -m``), the one systemd built for
it, and tries to create a file in each place the daemon must not write, *as root with every
capability*: only a read-only mount (EROFS) stops root there, so the probe shows the
sandbox, not file permissions (the user gossipd is refused /etc with or without any
sandbox). The same probe in the machine's own namespace writes in those places (the
control), and the same probe as the user gossipd without capabilities (``setpriv``) in the
daemon's namespace writes its state directory. Markers left in /home, /root and /tmp outside
must be invisible inside. The process itself is read in /proc/MainPID/status: its user, no
capability in its effective or bounding set, and no_new_privs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from common import ROOT, Context, Failed, Skip, trust_host_cas, wait_for
from image import torch_wheel

SUITE = "bookworm"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = "systemd,systemd-sysv,dbus,python3,python3-venv,sudo,ca-certificates"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CONFIG = "/var/lib/gossipd/gossipd.toml"
AS_GOSSIPD = "sudo -u gossipd /opt/gossipd/bin/gossipd"
MUST_NOT_WRITE = ["/", "/etc", "/usr", "/opt/gossipd", "/var", "/var/lib", "/srv"]
MARKERS = ["/home/gd-probe/secret", "/root/gd-probe", "/tmp/gd-probe"]  # made outside
# Tries to create a file in each directory given; prints what happened, and which MARKERS
# this process sees.
PROBE = f"""import errno, json, os, sys
def attempt(d):
    p = os.path.join(d, ".gd-probe")
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        return errno.errorcode[e.errno]
    os.unlink(p)
    return "written"
print(json.dumps({{"uid": os.getuid(), "writes": {{d: attempt(d) for d in sys.argv[1:]}},
                  "sees": [m for m in {MARKERS!r} if os.path.exists(m)]}}))
"""


class Machine:
    """A booted nspawn machine; :meth:`sh` runs a shell script in it as root."""

    def __init__(self, ctx: Context, root: Path, binds: list[str]) -> None:
        self.ctx, self.console = ctx, ctx.work / "systemd-console.log"
        argv = ["systemd-nspawn", "--boot", "-D", str(root), "-M", f"gd-sys-{os.getpid()}",
                "--register=no", "--keep-unit", "--console=read-only", *binds]
        ctx.say("booting: " + " ".join(argv))
        with self.console.open("w") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)
        try:
            self.leader = wait_for("the machine's PID 1", self._leader, 30, 0.2)
        except BaseException:
            self.close()
            raise

    def _leader(self) -> int | None:
        if self.proc.poll() is not None:
            tail = "\n".join(self.console.read_text().splitlines()[-5:])
            raise Skip(f"systemd-nspawn cannot boot a machine here:\n{tail}")
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            pids = children.read_text().split()
            # nspawn's first child is a helper that forks the machine's PID 1 and exits: take
            # only a process that is PID 1 of a namespace of its own.
            for pid in pids:
                status = Path(f"/proc/{pid}/status").read_text()
                nspid = [line.split()[1:] for line in status.splitlines()
                         if line.startswith("NSpid:")]
                if nspid and len(nspid[0]) > 1 and nspid[0][-1] == "1":
                    return int(pid)
        except FileNotFoundError:
            pass  # gone meanwhile: asked again
        return None

    def sh(self, script: str, *, check: bool = True, timeout: float = 120,
           input: str | None = None) -> str:
        argv = ["nsenter", "-t", str(self.leader), "-a", "env", "-i", f"PATH={PATH}",
                "HOME=/root", "LANG=C.UTF-8", "sh", "-ec", script]
        return self.ctx.sh(argv, check=check, timeout=timeout, input=input).stdout

    def close(self) -> None:
        """Powers it off (nspawn turns SIGTERM into an orderly shutdown), else kills it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def base_system(ctx: Context) -> tuple[Path, bool]:
    """The debootstrapped system as a tar in the cache, made on the first run; and whether
    it was there already."""
    tar = ctx.cache / f"system-{SUITE}.tar"
    if tar.exists():
        return tar, True
    tree = ctx.work / "debootstrap"
    ctx.say(f"debootstrapping Debian {SUITE} with systemd into {tree}")
    ctx.sh(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(tree),
            MIRROR], timeout=900)
    partial = tar.with_suffix(".partial")
    ctx.sh(["tar", "-cf", str(partial), "--numeric-owner", "--xattrs", "-C", str(tree), "."])
    partial.rename(tar)
    shutil.rmtree(tree)
    return tar, False


def prepare(ctx: Context, tar: Path) -> Path:
    """A fresh tree from ``tar``, trusting this host's CAs, with a copy of the checkout (what
    pip needs and deploy/systemd) in /root/gossipd."""
    root = ctx.work / "systemd-machine"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    ctx.sh(["tar", "-xf", str(tar), "--numeric-owner", "--xattrs", "-C", str(root)])
    trust_host_cas(root)
    # debootstrap leaves no /etc/hosts, and the host's /etc/hostname: sudo wants its name.
    (root / "etc/hostname").write_text("gossipd-check\n")
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n127.0.1.1 gossipd-check\n")
    src = root / "root/gossipd"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("gossip", "daemon", "deploy/systemd"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    return root


def install(m: Machine, ctx: Context) -> None:
    """docs/OPERATIONS.md, "With systemd", on the first machine."""
    links = "--find-links /wheels " if ctx.wheels else ""
    m.sh(f"""cd /root/gossipd
python3 -m venv /opt/gossipd
/opt/gossipd/bin/pip install -q {links}'{ctx.torch}'
/opt/gossipd/bin/pip install -q '.[demo]'
install -D -m 0644 deploy/systemd/gossipd.sysusers /etc/sysusers.d/gossipd.conf && systemd-sysusers
install -m 0644 deploy/systemd/gossipd.service /etc/systemd/system/gossipd.service
install -d -o gossipd -g gossipd -m 0700 /var/lib/gossipd
{AS_GOSSIPD} init --swarm my-swarm --dir /var/lib/gossipd --listen 0.0.0.0:17070
systemctl enable --now gossipd""", timeout=600)


def probe(m: Machine, pid: int | None, *, user: bool = False) -> dict[str, Any]:
    """PROBE's answer: in the machine's namespace (``pid`` None), else in ``pid``'s mount
    namespace as root or (``user``) as gossipd without capabilities."""
    enter = f"nsenter -t {pid} -m -- " if pid else ""
    drop = ("setpriv --reuid=gossipd --regid=gossipd --clear-groups --inh-caps=-all "
            "--bounding-set=-all --no-new-privs " if user else "")
    dirs = " ".join(["/var/lib/gossipd", *([] if user else MUST_NOT_WRITE)])
    answer: dict[str, Any] = json.loads(m.sh(f"{enter}{drop}python3 - {dirs}", input=PROBE))
    return answer


def check_sandbox(m: Machine, pid: int) -> dict[str, object]:
    """The daemon's credentials and file system view (the module's docstring says how)."""
    status = dict(line.split(":\t", 1) for line in
                  m.sh(f"cat /proc/{pid}/status").splitlines() if ":\t" in line)
    passwd = m.sh("getent passwd gossipd").strip().split(":")
    uid = passwd[2]
    ids = status["Uid"].split() + status["Gid"].split()
    if int(uid) >= 1000 or ids != [uid] * 4 + [passwd[3]] * 4:
        raise Failed(f"the daemon runs as uid {status['Uid']}, not the system user gossipd "
                     f"({uid})")
    if int(status["CapEff"], 16) or int(status["CapBnd"], 16) or status["NoNewPrivs"] != "1":
        raise Failed(f"the daemon holds capabilities or may gain privileges: {status}")
    m.sh(f"for f in {' '.join(MARKERS)}; do mkdir -p ${{f%/*}}; echo outside > $f; done")
    outside, inside = probe(m, None), probe(m, pid)
    as_gossipd = probe(m, pid, user=True)
    if any(v != "written" for v in outside["writes"].values()) or len(outside["sees"]) < 3:
        raise Failed(f"the probe's control failed in the machine itself: {outside}")
    writable = [d for d, v in inside["writes"].items() if v != "EROFS"]
    if writable != ["/var/lib/gossipd"] or inside["sees"]:
        raise Failed(f"in the daemon's mount namespace root writes {writable} (only "
                     f"/var/lib/gossipd expected) and sees {inside['sees']}")
    if as_gossipd["writes"] != {"/var/lib/gossipd": "written"}:
        raise Failed(f"the user gossipd cannot write its state directory: {as_gossipd}")
    kill_mode = m.sh("systemctl show -p KillMode --value gossipd").strip()
    if kill_mode != "mixed":
        raise Failed(f"KillMode={kill_mode}, not mixed")
    return {"user": f"{passwd[0]} uid={uid} shell={passwd[6]}", "kill_mode": kill_mode,
            "read_only": list(inside["writes"])[1:], "hidden": MARKERS}


def steps(m: Machine) -> int | None:
    """The node's step from ``gossipd status``, None while it does not answer."""
    out = m.sh(f"{AS_GOSSIPD} status -c {CONFIG} --json", check=False)
    try:
        return int(json.loads(out)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def check_systemd(ctx: Context) -> dict[str, object]:
    """Boots the machine, installs and starts the unit, checks that it trains, that its
    sandbox holds and that it stops with exit 0 and a final checkpoint."""
    if os.geteuid() != 0:
        raise Skip("needs root (debootstrap, systemd-nspawn)")
    for tool in ("debootstrap", "systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            raise Skip(f"no {tool} here")
    started = time.monotonic()
    if ctx.wheels is None:
        torch_wheel(ctx)  # torch's CPU build, as the image step takes it; PyPI's is CUDA's
    tar, cached = base_system(ctx)
    root = prepare(ctx, tar)
    binds = [f"--bind-ro={ctx.wheels}:/wheels"] if ctx.wheels else []
    figures: dict[str, object] = {"base_cached": cached}
    booting = time.monotonic()
    m = Machine(ctx, root, binds)
    try:
        def booted() -> str | None:
            state = m.sh("systemctl is-system-running", check=False).strip()
            return state if state in ("running", "degraded") else None

        figures["boot"] = wait_for("the machine's systemd to finish booting", booted, 90, 1)
        m.sh("systemctl --failed --no-pager")
        figures["boot_s"] = round(time.monotonic() - booting, 1)
        installing = time.monotonic()
        install(m, ctx)
        figures["install_s"] = round(time.monotonic() - installing, 1)
        started_unit = time.monotonic()
        first = wait_for("gossipd status to report a step", lambda: steps(m), 180)
        later = wait_for("the step to go up",
                         lambda: s if (s := steps(m)) is not None and s > first else None, 60)
        figures["first_step_s"] = round(time.monotonic() - started_unit, 1)
        figures["steps"] = [first, later]
        m.sh(f"{AS_GOSSIPD} status -c {CONFIG}")  # as the docs show it, for the log
        restarts = m.sh("systemctl show -p NRestarts --value gossipd").strip()
        if restarts != "0":
            raise Failed(f"gossipd restarted {restarts} times")
        pid = int(m.sh("systemctl show -p MainPID --value gossipd"))
        figures.update(check_sandbox(m, pid))
        stopping = time.monotonic()
        m.sh("systemctl stop gossipd", timeout=90)
        figures["stop_s"] = round(time.monotonic() - stopping, 1)
        shown = m.sh("systemctl show -p ExecMainStatus,ExecMainCode,Result gossipd").split()
        if sorted(shown) != ["ExecMainCode=1", "ExecMainStatus=0", "Result=success"]:
            raise Failed(f"gossipd did not exit 0 on systemctl stop: {' '.join(shown)}")
        log = m.sh("journalctl -u gossipd --no-pager -o cat")
        if "stopping signal=SIGTERM" not in log:
            raise Failed("journalctl -u gossipd has no 'stopping signal=SIGTERM' line")
        final = log.split("stopping signal=SIGTERM", 1)[1]
        saved = [line for line in final.splitlines() if line.find("checkpoint path=") >= 0]
        files = m.sh("ls /var/lib/gossipd/checkpoints").split()
        if not saved or not any(saved[-1].find(f) >= 0 for f in files):
            raise Failed(f"no final checkpoint after SIGTERM: {saved} in the log, {files}")
        if "stopped step=" not in final:
            raise Failed("no 'stopped' line in journalctl -u gossipd after SIGTERM")
        figures["checkpoint"] = saved[-1].split("path=", 1)[1].split()[0]
        figures["exit"] = " ".join(sorted(shown))
    finally:
        m.close()
    figures["seconds"] = round(time.monotonic() - started, 1)
    return figures
