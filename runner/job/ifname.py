"""Which network interface a rank talks to its peers on: ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``.

Set from the config (``network.ifname``, exported by the batch script) or, when not set, detected by each
rank on its own node from the route to ``MASTER_ADDR``, because interface names differ between nodes (and
between a node and the login node). A wrong name fails at once ("Unable to find address for: eth9"); no
name lets gloo pick the address the hostname resolves to, which is often a management network or loopback.

On the master node the route to its own address goes through ``lo`` ("local 10.0.0.1 dev lo"); the interface
that owns that address is the one the other ranks reach, so it is looked up by address instead.

Runs in each rank (``runner.job.netenv.setup`` detects once per rank; the preflight checks what it found).
Standard library and ``ip`` only: no torch.
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
from typing import Any

from runner import proc

# The variables that name the interface for gloo and NCCL (NCCL's may be a pattern such as ``^docker,lo``).
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR, _SIOCGIFFLAGS, _IFF_UP = 0x8915, 0x8913, 0x1


def parse_route_get(text: str) -> tuple[str | None, str | None, bool]:
    """``ip -o route get ADDR`` -> (device, source address, whether ADDR is one of this host's own)."""
    dev = re.search(r"\bdev (\S+)", text)
    src = re.search(r"\bsrc (\S+)", text)
    return (dev.group(1) if dev else None, src.group(1) if src else None, text.lstrip().startswith("local "))


def parse_addr_show(text: str) -> str | None:
    """``ip -o addr show to ADDR/32`` -> the interface holding ADDR ("2: eth0    inet 10.77.0.1/24 ...")."""
    m = re.match(r"\s*\d+:\s+([^\s:@]+)", text)
    return m.group(1) if m else None


def _ip(*args: str) -> str | None:
    out = proc.run(["ip", "-o", *args], timeout=5, check=False)
    return out.stdout if out.returncode == 0 else None


def interfaces() -> dict[str, dict[str, Any]]:
    """This node's interfaces: name -> IPv4 address (or None) and whether it is up (ioctl, no iproute2)."""
    out: dict[str, dict[str, Any]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr: str | None = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                addr = None
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
            except OSError:
                flags = 0
            out[name] = {"addr": addr, "up": bool(flags & _IFF_UP)}
    return out


def _ifname_by_address(addr: str) -> str | None:
    """The interface that holds ``addr`` (works in containers without iproute2)."""
    return next((name for name, i in interfaces().items() if i["addr"] == addr), None)


def _source_address(ip: str) -> str | None:
    """The local address the kernel would use to reach ``ip`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def detect_ifname(master_addr: str) -> str | None:
    """The interface this node uses to reach ``master_addr`` (a hostname or an IPv4 address)."""
    try:
        ip = socket.gethostbyname(master_addr)
    except OSError:
        return None
    out = _ip("route", "get", ip)
    if out is not None:
        dev, src, local = parse_route_get(out)
        if not local and dev:
            return dev
        if local:
            owner = parse_addr_show(_ip("addr", "show", "to", f"{ip}/32") or "")
            if owner:
                return owner
            return "lo" if ipaddress.ip_address(ip).is_loopback else _ifname_by_address(src or ip)
    src = _source_address(ip)
    return _ifname_by_address(src) if src else None
