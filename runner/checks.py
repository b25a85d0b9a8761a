"""The preflight's checks and verdicts, and the report table.

Each check is a function of values the caller measured (interfaces, GPU count, bandwidth, tool output) or of
the local filesystem (paths, free space, code hashes), and returns a ``Check`` naming the node, the value
found, what was expected and what to do about it. Used inside the job by ``runner.job.preflight`` (which
measures) and on the login node by ``runner.host.preflight`` (which prints the report), so this module
imports the standard library only: no torch, no sockets, no processes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import runner
from runner.errors import PreflightError
from runner.spec.typed import RunConfig

PASS, WARN, FAIL = "pass", "warn", "fail"
_ORDER = {PASS: 0, WARN: 1, FAIL: 2}


@dataclass
class Check:
    """One result: what was measured where, against what, and what to do about it."""

    name: str
    node: str
    status: str
    value: str = ""
    threshold: str = ""
    hint: str = ""
    note: str = ""

    def line(self) -> str:
        """One line for alerts and summaries."""
        text = f"{self.name} on {self.node}: {self.value}"
        return text + (f" (expected {self.threshold})" if self.threshold else "")


def worst(statuses: Iterable[str]) -> str:
    return max(statuses, key=lambda s: _ORDER[s], default=PASS)


# ---------------------------------------------------------------------------------------------- bandwidth


def busbw_factor(n: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor 2(n-1)/n: what each rank's link carries per byte reduced."""
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes), as nccl-tests reports it: message size over time."""
    return nbytes / seconds / 1e9


def busbw(algbw_gbps: float, n: int) -> float:
    """Bus bandwidth in GB/s: comparable with the link speed whatever the number of ranks."""
    return algbw_gbps * busbw_factor(n)


def node_bandwidth(pairs: list[dict[str, Any]]) -> dict[str, float]:
    """Each node's bandwidth: the best pair it is part of (a slow node drags down every pair it is in)."""
    out: dict[str, float] = {}
    for p in pairs:
        for node in p["nodes"]:
            out[node] = max(out.get(node, 0.0), p["busbw_gbps"])
    return out


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """Pairs of node indices such that every node is in two pairs (one pair for two nodes)."""
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def evaluate_bandwidth(job: dict[str, Any] | None, pairs: list[dict[str, Any]], min_busbw: float | None,
                       fail_below: float, warn_below: float) -> list[Check]:
    """Checks for the whole job and for each node; a node is named when its pairs are slow.

    A node fails below ``min_busbw`` (GB/s, when set) or below ``fail_below`` x the median node (the job would
    run at that node's pace: a 100x slower node must never let training start); it warns from ``fail_below``
    to ``warn_below`` x the median. The thresholds are the run's (``preflight.fail_below_median`` and
    ``warn_below_median``), never a default of this module: a restart judges as its first attempt did.
    """
    checks = []
    thr = f">= {min_busbw:g} GB/s" if min_busbw is not None else ""
    hint = ("check NCCL_SOCKET_IFNAME / NCCL_IB_HCA (TCP instead of InfiniBand?) and the node's link; "
            "see logs/nccl/ with network.debug: true")
    if job is not None:
        low = min_busbw is not None and job["busbw_gbps"] < min_busbw
        checks.append(Check("busbw", "job", FAIL if low else PASS, _bw_text(job), thr, hint if low else "",
                            f"all-reduce of {_size(job)} over {job['ranks']} ranks"))
    per_node = node_bandwidth(pairs)
    if not per_node:
        return checks
    median = statistics.median(per_node.values())
    two = len(per_node) == 2
    for node, bw in per_node.items():
        mine = [p for p in pairs if node in p["nodes"]]
        detail = ", ".join(f"{'-'.join(p['nodes'])} {p['busbw_gbps']:.3f}" for p in mine)
        note = f"pairs (busbw GB/s): {detail}"
        cut = [f"{'-'.join(p['nodes'])} after {_size(p)}" for p in mine if p.get("cut")]
        if cut:
            note += f"; probe stopped early on a slow link: {', '.join(cut)}"
        if two:
            note += "; with 2 nodes a slow link cannot be pinned on one end"
        relative = f">= {{:g}} x median {median:.3f} GB/s"
        if min_busbw is not None and bw < min_busbw:
            checks.append(Check("busbw node", node, FAIL, f"{bw:.3f} GB/s", thr, hint, note))
        elif bw < fail_below * median:
            checks.append(Check("busbw node", node, FAIL, f"{bw:.3f} GB/s", relative.format(fail_below), hint, note))
        elif bw < warn_below * median:
            checks.append(Check("busbw node", node, WARN, f"{bw:.3f} GB/s", relative.format(warn_below), hint, note))
        else:
            checks.append(Check("busbw node", node, PASS, f"{bw:.3f} GB/s", thr, "", note))
    return checks


def _size(r: Mapping[str, Any]) -> str:
    return f"{r['size_bytes'] / (1 << 20):g} MiB"


def _bw_text(r: Mapping[str, Any]) -> str:
    return f"busbw {r['busbw_gbps']:.3f} GB/s (algbw {r['algbw_gbps']:.3f})"


# ---------------------------------------------------------------------------------------------- tool parsers


def parse_all_reduce_perf(text: str) -> dict[str, Any]:
    """nccl-tests ``all_reduce_perf`` output -> ranks, rows (size, algbw, busbw, wrong), average busbw.

    Rows give out-of-place then in-place columns; the out-of-place ones are kept (nccl-tests' own gate,
    NCCL_TESTS_MIN_BW, also looks at the large sizes). ``#wrong`` is "N/A" when validation is off.
    """
    rows = []
    ranks = 0
    avg = None
    for line in text.splitlines():
        if re.match(r"#\s+Rank\s+\d+\s", line):
            ranks += 1
            continue
        m = re.match(r"#\s*Avg bus bandwidth\s*:\s*([\d.]+)", line)
        if m:
            avg = float(m.group(1))
            continue
        parts = line.split()
        if len(parts) >= 9 and parts[0].isdigit() and parts[1].isdigit():
            wrong = parts[8]
            rows.append({"size_bytes": int(parts[0]), "time_us": float(parts[5]), "algbw_gbps": float(parts[6]),
                         "busbw_gbps": float(parts[7]), "wrong": int(wrong) if wrong.isdigit() else None})
    if not rows:
        raise PreflightError("all_reduce_perf: found no result rows in its output; expected nccl-tests' table. "
                             "hint: run it by hand to see its error")
    return {"ranks": ranks, "rows": rows, "avg_busbw_gbps": avg, "largest": rows[-1]}


def parse_ib_write_bw(text: str) -> dict[str, Any]:
    """perftest ``ib_write_bw`` output -> device, link type, message size, peak and average bandwidth in Gb/s.

    perftest reports MB/sec unless run with ``--report_gbits``; both are converted to Gb/s (MB = 2^20 bytes).
    """
    dev = re.search(r"Device\s*:\s*(\S+)", text)
    link = re.search(r"Link type\s*:\s*(\S+)", text)
    header = re.search(r"#bytes\s+#iterations\s+BW peak\[(\w+)/sec\]\s+BW average\[(\w+)/sec\]", text)
    if not header:
        raise PreflightError("ib_write_bw: found no result table; expected perftest's '#bytes #iterations' "
                             "header. hint: run it by hand to see its error")
    unit = header.group(1)
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", text[header.end():], re.M)
    if not rows:
        raise PreflightError("ib_write_bw: found the header but no result row. hint: run it by hand")
    size, iters, peak, avg, rate = rows[-1]
    scale = 1.0 if unit == "Gb" else 8 * 2**20 / 1e9
    return {"device": dev.group(1) if dev else None, "link_type": link.group(1) if link else None,
            "size_bytes": int(size), "iterations": int(iters), "peak_gbits": float(peak) * scale,
            "avg_gbits": float(avg) * scale, "msg_rate_mpps": float(rate)}


def nccl_tests_check(text: str, host: str) -> Check:
    """The verdict on ``all_reduce_perf`` inside one node: the largest message's bandwidth, no wrong results."""
    r = parse_all_reduce_perf(text)
    big = r["largest"]
    bad = bool(big["wrong"])
    return Check("nccl-tests", host, FAIL if bad else PASS, f"busbw {big['busbw_gbps']:.1f} GB/s at "
                 f"{big['size_bytes'] >> 20} MiB, {r['ranks']} GPUs", "#wrong = 0",
                 "results were wrong: check the GPUs and NVLink (nvidia-smi topo -m)" if bad else "",
                 "all_reduce_perf inside the node")


def ib_write_bw_check(text: str, host: str) -> Check:
    """The verdict on ``ib_write_bw`` between two nodes: reported, never judged (link speeds differ)."""
    r = parse_ib_write_bw(text)
    return Check("ib_write_bw", host, PASS, f"{r['avg_gbits']:.1f} Gb/s average on {r['device']}",
                 "", "", f"link {r['link_type']}, {r['size_bytes']} B messages")


# ---------------------------------------------------------------------------------------------- node checks


def _matches(spec: str, names: Iterable[str]) -> list[str] | None:
    """Interfaces selected by an NCCL-style spec (``eth`` prefix, ``=eth0`` exact, lists); None for ``^...``."""
    if spec.startswith("^"):
        return None
    exact = spec.startswith("=")
    items = [i for i in spec.lstrip("=").split(",") if i]
    return [n for n in names if any(n == i or (not exact and n.startswith(i)) for i in items)]


def check_interface(spec: str | None, node: str, ifaces: Mapping[str, Mapping[str, Any]],
                    route_ifname: str | None, master: str) -> Check:
    """The interface the job will use exists here, is up, has an address, and (warn) routes to MASTER_ADDR."""
    listing = ", ".join(f"{n} ({i['addr'] or 'no IPv4'})" for n, i in sorted(ifaces.items()))
    if not spec:
        return Check("interface", node, WARN, "none chosen", "an interface", "set network.ifname",
                     f"MASTER_ADDR {master} did not resolve to a route; interfaces here: {listing}")
    chosen = _matches(spec, ifaces)
    if chosen is None:
        return Check("interface", node, PASS, spec, "", "", f"exclusion list, not checked; here: {listing}")
    usable = [n for n in chosen if ifaces[n]["up"] and ifaces[n]["addr"]]
    if not usable:
        found = "not up or without an address" if chosen else "not found"
        better = f"set network.ifname: {route_ifname}" if route_ifname else "set network.ifname to one of them"
        return Check("interface", node, FAIL, f"{spec} {found}", "an existing interface that is up",
                     f"interfaces here: {listing}; {better} or leave it null to detect it", "")
    value = ", ".join(f"{n} {ifaces[n]['addr']}" for n in usable)
    if route_ifname and route_ifname not in usable:
        return Check("interface", node, WARN, value, f"the route to MASTER_ADDR ({route_ifname})",
                     "fine when this interface's subnet joins all nodes (e.g. IPoIB); else set network.ifname",
                     f"MASTER_ADDR {master} is reached through {route_ifname}")
    return Check("interface", node, PASS, value, "exists, up, routes to MASTER_ADDR")


def check_gpus(accelerator: str, devices: int, visible: int | None, node: str,
               cuda_visible: str | None) -> Check:
    """GPUs this node's ranks can see = trainer.devices (a CPU run passes with a note; so does ``auto`` without
    GPUs: Lightning then trains on the CPU)."""
    if accelerator == "cpu" or accelerator == "auto" and not visible:
        return Check("gpus", node, PASS, "cpu run", "", "", "CPU run: no GPUs needed"
                     + (f" (CUDA_VISIBLE_DEVICES={cuda_visible})" if cuda_visible else ""))
    seen = visible or 0
    ok = seen >= devices
    return Check("gpus", node, PASS if ok else FAIL, f"{seen} visible", f">= {devices} (trainer.devices)",
                 "" if ok else "check --gres=gpu:N / slurm.gpus_per_node, the driver (nvidia-smi) and --nv",
                 f"CUDA_VISIBLE_DEVICES={cuda_visible}" if cuda_visible is not None else "")


def check_path(path: str, node: str, write: bool) -> Check:
    """A dataset path readable (or the checkpoint folder writable) on this node."""
    p = Path(path)
    need = "writable" if write else "readable"
    name = "checkpoint dir" if write else "path"
    if not p.exists():
        return Check(name, node, FAIL, f"{path} missing", f"exists, {need}",
                     "stage it on every node or fix preflight.paths (node-local disks differ)")
    try:
        if write:
            with tempfile.NamedTemporaryFile(dir=p, prefix=".preflight-"):
                pass
        elif p.is_dir():
            with os.scandir(p) as it:
                next(it, None)
        else:
            with open(p, "rb") as f:
                f.read(1)
    except OSError as e:
        return Check(name, node, FAIL, f"{path}: {e.strerror}", f"exists, {need}", "check permissions and mounts")
    return Check(name, node, PASS, path, f"exists, {need}")


def check_free_space(path: str, node: str, min_free_gb: float) -> Check:
    try:
        free = shutil.disk_usage(path).free / 1e9
    except OSError as e:
        return Check("free space", node, FAIL, f"{path}: {e.strerror}", f">= {min_free_gb:g} GB")
    ok = free >= min_free_gb
    return Check("free space", node, PASS if ok else FAIL, f"{free:.1f} GB free", f">= {min_free_gb:g} GB",
                 "" if ok else f"free space on {path} or move run_root; checkpoints will not fit")


def code_to_compare(cfg: RunConfig) -> list[Path]:
    """The code every node must run the same: the runner package, the modules of the model and data targets, and
    in program mode the Python files its command names (relative to the program's working directory, the current one).

    Not the files copied into an image (``runner.host.build.image_code_files``): these are hashed on each node.
    """
    package = Path(runner.__file__).resolve().parent
    files = [f for f in package.rglob("*.py") if "__pycache__" not in f.parts]
    files += [Path(a).resolve() for a in cfg["command"] or [] if a.endswith(".py") and Path(a).is_file()]
    for section in ("model", "data"):
        target = str(cast(dict[str, Any], cfg.get(section) or {}).get("_target_", ""))
        module = target.rpartition(".")[0]
        try:
            spec = importlib.util.find_spec(module) if module else None
        except (ImportError, ValueError):
            spec = None
        if spec and spec.origin and spec.origin.endswith(".py"):
            files.append(Path(spec.origin))
    return sorted(set(files))


def versions(cfg: RunConfig) -> dict[str, Any]:
    """Hashes of the code and the installed packages, plus the versions people ask about first."""
    package = Path(runner.__file__).resolve().parent
    h = hashlib.sha256()
    for f in code_to_compare(cfg):
        # Paths inside the package, so that nodes with the package installed in different places agree.
        name = str(f.relative_to(package)) if f.is_relative_to(package) else f.name
        h.update(name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    packages = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"]
        if name:
            packages[name.lower()] = d.version
    return {"code": h.hexdigest()[:16], "python": sys.version.split()[0], "packages": packages,
            "packages_hash": hashlib.sha256(json.dumps(packages, sort_keys=True).encode()).hexdigest()[:16]}


def compare_versions(by_node: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """Code and packages must be the same on every node; the nodes outside the majority are named."""
    nodes = list(by_node)
    if not nodes:
        return []

    def odd(key: Callable[[Mapping[str, Any]], Any]) -> tuple[list[str], Any]:
        groups: dict[str, list[str]] = {}
        for n in nodes:
            groups.setdefault(json.dumps(key(by_node[n]), sort_keys=True), []).append(n)
        ref = max(groups.values(), key=len)  # ties: the group seen first, i.e. the one with node 0
        return [n for n in nodes if n not in ref], key(by_node[ref[0]])

    checks = []
    bad, ref = odd(lambda v: v["code"])
    checks.append(Check("code", ", ".join(bad) or "all", FAIL if bad else PASS,
                        ", ".join(f"{n}: {by_node[n]['code']}" for n in bad) or ref,
                        f"same on every node (majority: {ref})" if bad else "same on every node",
                        "different code on a node: sync the checkout or rebuild/pull the image" if bad else ""))
    bad, ref = odd(lambda v: (v["python"], v["packages"]))
    diffs = []
    for n in bad:
        mine, theirs = by_node[n]["packages"], ref[1]
        names = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        diffs += [f"{n}: {k} {mine.get(k, 'missing')} (others {theirs.get(k, 'missing')})" for k in names[:5]]
        if by_node[n]["python"] != ref[0]:
            diffs.append(f"{n}: python {by_node[n]['python']} (others {ref[0]})")
    checks.append(Check("packages", ", ".join(bad) or "all", FAIL if bad else PASS,
                        "; ".join(diffs) or f"python {ref[0]}, {len(ref[1])} packages identical",
                        "same on every node", "install the same environment everywhere (use the image)" if bad else ""))
    return checks

# ---------------------------------------------------------------------------------------------- the report


def report_status(checks: list[Check], fail_on_warn: bool) -> str:
    status = worst(c.status for c in checks)
    return FAIL if status == WARN and fail_on_warn else status


def summary(checks: list[Check], status: str) -> str:
    bad = [c for c in checks if c.status == FAIL] or [c for c in checks if c.status == WARN]
    if not bad:
        return f"preflight {status}: {len(checks)} checks passed"
    more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
    return f"preflight {status}: " + "; ".join(c.line() for c in bad[:3]) + more


def _collapse(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row for a check that passed on several nodes (the json keeps every node); problems stay per node."""
    out: list[dict[str, Any]] = []
    groups: dict[str, dict[str, Any]] = {}
    for c in checks:
        key = f"{c['name']}\0{(c['value'].split() or [''])[0]}"  # same check, same interface / path / tool
        if c["status"] != PASS or c["name"] in ("busbw node",):
            out.append(dict(c))
        elif key not in groups:
            groups[key] = dict(c, nodes=[c["node"]])
            out.append(groups[key])
        else:
            g = groups[key]
            g["nodes"].append(c["node"])
            if c["value"] != g["value"] and not g["value"].endswith(" (varies)"):
                g["value"] += " (varies)"
            if c.get("note") != g.get("note"):
                g["note"] = ""
    for g in groups.values():
        n = g.pop("nodes")
        g["node"] = n[0] if len(n) == 1 else ",".join(n) if len(n) <= 4 else f"{len(n)} nodes"
    return out


def table(report: Mapping[str, Any]) -> str:
    """The report as a plain-text table (preflight.txt, `runner preflight`, the rank-0 log)."""
    head = (f"preflight {report['status'].upper()} in {report.get('duration_s', 0):.1f} s: "
            f"{len(report.get('nodes', []))} nodes, {report.get('world_size')} ranks, "
            f"{report.get('backend') or 'no'} probe, master {report.get('master')}")
    cols = ("name", "node", "status", "value", "threshold", "hint")
    checks = _collapse(report["checks"])
    rows = [[str(c.get(k, "")) for k in cols] for c in checks]
    widths = [min(48, max([len(h)] + [len(r[i]) for r in rows])) for i, h in enumerate(cols)]
    lines = [head, "  ".join(h.upper().ljust(w) for h, w in zip(cols, widths, strict=True)).rstrip()]
    for r, c in zip(rows, checks, strict=True):
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
        if c.get("note"):
            lines.append(f"    note: {c['note']}")
    lines.append(report.get("summary", ""))
    if report.get("phases_s"):  # rank 0's view: the rendezvous includes waiting for the slowest rank to start
        lines.append("time: " + ", ".join(f"{k} {v:.2f} s" for k, v in report["phases_s"].items()))
    if report.get("reused"):
        r = report["reused"]
        lines.append(f"reused from the preflight {r['age_s']:.0f} s ago (same nodes and image): "
                     + ", ".join(r["parts"]))
    return "\n".join(lines) + "\n"
