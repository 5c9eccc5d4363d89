"""Another host, on this machine: a process that shares nothing with the tests but the network.

``Host`` is a network namespace of its own, joined to this one by a veth pair on a /30 of its own (iproute2:
``ip netns``, ``ip link``), so the only addresses its processes reach are its end of the link and this
namespace's (``gateway``): not this namespace's loopback, where a server bound to 127.0.0.1 listens. A server
a host must reach binds beyond the loopback, which needs a key (the exposure guard). Its processes also run
in a mount namespace of their own (``unshare -m``) in which the given directories (the run's) are empty
tmpfs mounts: the run dir does not exist there. ``cut()`` takes the link down (packets are dropped, as on
a pulled cable: no connection is refused or reset), ``restore()`` brings it back.

Needs root (the tests' machines run them as root) and iproute2.
"""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
import sys
from pathlib import Path

from runs import ROOT, Output

_numbers = itertools.count()


def ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(("netns", "exec", netns, "ip") if netns else ()), *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


class Host:
    def __init__(self) -> None:
        n = next(_numbers)
        tag = f"{os.getpid() % 100000}{n}"
        self.name = f"agl{tag}"  # the namespace
        self.link = f"ah{tag}"[:15]  # this side of the veth pair (15 characters at most)
        peer = f"ar{tag}"[:15]
        subnet = (os.getpid() * 7 + n) % (64 * 256)  # 10.64.0.0/12 in /30s: one per host of every test process
        a, b = 64 + subnet // 1024, (subnet % 1024) // 4
        c = (subnet % 4) * 64
        self.gateway, self.address = f"10.{a}.{b}.{c + 1}", f"10.{a}.{b}.{c + 2}"
        self.procs: list[HostProcess] = []
        ip("netns", "add", self.name)
        try:
            ip("link", "add", self.link, "type", "veth", "peer", "name", peer)
            ip("link", "set", peer, "netns", self.name)
            ip("addr", "add", f"{self.gateway}/30", "dev", self.link)
            ip("link", "set", self.link, "up")
            ip("addr", "add", f"{self.address}/30", "dev", peer, netns=self.name)
            ip("link", "set", peer, "up", netns=self.name)
            ip("link", "set", "lo", "up", netns=self.name)
        except BaseException:
            self.close()
            raise

    def harness(self, *args: str, hide: list[Path], env: dict) -> HostProcess:
        """``python harness.py *args`` on this host, with ``hide`` not there (its process: ``.pid``)."""
        proc = HostProcess(self.name, list(args), [str(h) for h in hide], env)
        self.procs.append(proc)
        return proc

    def cut(self) -> None:
        ip("link", "set", self.link, "down")

    def restore(self) -> None:
        ip("link", "set", self.link, "up")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostProcess(Output, subprocess.Popen):
    """A harness process in a host's namespaces. Every step execs the next (``ip netns exec``, ``unshare``,
    ``sh``), so ``pid`` is the harness's own."""

    def __init__(self, netns: str, args: list[str], hide: list[str], env: dict):
        self._open_log()
        mounts = "".join(f"mount -t tmpfs agl-hidden {shlex.quote(h)} && " for h in hide)
        script = f"{mounts}exec {shlex.quote(sys.executable)} harness.py " + " ".join(shlex.quote(a) for a in args)
        command = ["ip", "netns", "exec", netns, "unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        super().__init__(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
