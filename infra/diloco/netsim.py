"""Simulate N data centers on one host: network namespaces, veth links, ``tc tbf`` bandwidth,
and a delay proxy for latency (this kernel has no ``netem``).

Topology: a switch namespace holding a bridge, and one namespace per DC (``pcdl-<i>``) joined to
it by a veth pair. The DC's side of the pair (``eth0``, ``10.77.0.<i + 1>/24``) shapes its upload
and the switch side shapes its download, each with ``tbf`` at ``rate_mbit``. A DC's origin binds
its own address, so every byte between two DCs crosses two shaped links, as over the internet.

Latency: ``DelayProxy`` is a TCP relay that holds every chunk for ``delay_ms`` before passing it
on (a delay line: throughput is unchanged). Start one per peer inside the downloading DC's
namespace and point that peer's URL at it.

Capture: ``capture(i, path, max_bytes)`` records every frame on DC ``i``'s veth (switch side,
an ``AF_PACKET`` socket in the switch namespace) into ``path``, up to ``max_bytes``: everything a
third party on the path between the DCs could see.

NAT: ``block_inbound(net, i)`` drops every TCP SYN that arrives at DC ``i`` (``iptables`` in its
namespace): it can open connections (replies to them pass) but accept none, as behind NAT or a
stateful firewall. Such a DC takes part through the relay (``prime_composer.diloco.relay``).

Needs root (``ip netns``, ``tc``; ``iptables`` for ``block_inbound``). Use::

    with NetSim(num_dcs=2, rate_mbit=20) as net:
        subprocess.run([*net.prefix(0), "python", ...])     # runs inside DC 0's namespace
        net.address(1)                                      # "10.77.0.2"
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import threading
import time
from types import TracebackType

_SUBNET = "10.77.0"


def available() -> str | None:
    """None when this host can run the simulation, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing (apt-get install iproute2)"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


class NetSim:
    """Namespaces ``pcdl-<tag>-<i>`` for ``num_dcs`` DCs, shaped to ``rate_mbit`` each way."""

    def __init__(self, num_dcs: int, rate_mbit: float, tag: str | None = None) -> None:
        self.num_dcs = num_dcs
        self.rate_mbit = rate_mbit
        self.tag = tag or str(os.getpid() % 100000)
        self.switch = f"pcdl{self.tag}sw"

    def namespace(self, i: int) -> str:
        return f"pcdl{self.tag}-{i}"

    def address(self, i: int) -> str:
        return f"{_SUBNET}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside DC ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def __enter__(self) -> NetSim:
        reason = available()
        if reason:
            raise RuntimeError(f"NetSim {reason}")
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        # tbf: a burst of ~10 ms at the rate (at least 16 kB) and a queue of up to 200 ms.
        burst = f"{max(16, int(self.rate_mbit * 1000 / 8 / 100))}kb"
        shape = ["root", "tbf", "rate", f"{self.rate_mbit}mbit", "burst", burst, "latency", "200ms"]
        for i in range(self.num_dcs):
            ns = self.namespace(i)
            _run("ip", "netns", "add", ns)
            _run(
                "ip",
                "link",
                "add",
                f"pcdl{self.tag}d{i}",
                "type",
                "veth",
                "peer",
                "name",
                f"pcdl{self.tag}s{i}",
            )
            _run("ip", "link", "set", f"pcdl{self.tag}d{i}", "netns", ns)
            _run("ip", "link", "set", f"pcdl{self.tag}s{i}", "netns", sw)
            _run("ip", "-n", ns, "link", "set", f"pcdl{self.tag}d{i}", "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", sw, "link", "set", f"pcdl{self.tag}s{i}", "master", "br0")
            _run("ip", "-n", sw, "link", "set", f"pcdl{self.tag}s{i}", "up")
            _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *shape)
            _run("tc", "-n", sw, "qdisc", "add", "dev", f"pcdl{self.tag}s{i}", *shape)

    def capture(self, i: int, path: str, max_bytes: int = 64 << 20) -> subprocess.Popen[bytes]:
        """Start recording every frame on DC ``i``'s link into ``path`` (raw bytes, up to
        ``max_bytes``); stop it with ``terminate()``. Returns once the socket is bound."""
        import sys

        ready = f"{path}.ready"
        script = (
            "import socket,sys\n"
            "s=socket.socket(socket.AF_PACKET,socket.SOCK_RAW,socket.htons(3))\n"
            f"s.bind(({f'pcdl{self.tag}s{i}'!r},0))\n"
            f"open({ready!r},'w').close()\n"
            f"out=open({path!r},'wb',buffering=0);n=0\n"
            f"while n<{max_bytes}:\n"
            "    d=s.recv(65536);out.write(d);n+=len(d)\n"
        )
        proc = subprocess.Popen(["ip", "netns", "exec", self.switch, sys.executable, "-c", script])
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the capture did not start")
            time.sleep(0.05)
        return proc

    def close(self) -> None:
        for ns in [*(self.namespace(i) for i in range(self.num_dcs)), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def block_inbound(net: NetSim, i: int) -> None:
    """Drop every inbound TCP connection attempt to DC ``i`` (IPv4 and IPv6), outbound ones pass."""
    for tool in ("iptables", "ip6tables"):
        _run(*net.prefix(i), tool, "-A", "INPUT", "-i", "eth0", "-p", "tcp", "--syn", "-j", "DROP")


class DelayProxy:
    """Relay ``listen -> target`` that delays each direction by ``delay_ms`` (a delay line).

    Runs in the calling process's network namespace; start it inside a namespace with
    ``setns`` or from a program run under ``NetSim.prefix``.
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_ms: float) -> None:
        self.target = target
        self.delay_s = delay_ms / 1000
        self._server = socket.create_server(listen)
        self.port = int(self._server.getsockname()[1])
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                line: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(a, line), daemon=True).start()
                threading.Thread(target=self._write, args=(b, line), daemon=True).start()

    def _read(self, sock: socket.socket, line: queue.Queue[tuple[float, bytes]]) -> None:
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""
            line.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _write(self, sock: socket.socket, line: queue.Queue[tuple[float, bytes]]) -> None:
        while True:
            due, data = line.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                if not data:
                    sock.shutdown(socket.SHUT_WR)
                    return
                sock.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._server.close()
