"""Preflight inside the job: every rank checks its node and the interconnect, in seconds, before training.

Why: NCCL on the wrong interface trains at a fraction of its speed without an error, and a rendezvous
that cannot complete surfaces only after the process-group timeout. The launcher runs ``in_job`` on
every rank before Lightning builds its own process group; it names the node and the value that is wrong,
and stops the job (exit 77) before any training step. The checks and the report are ``runner.checks``;
``runner preflight`` (``runner.host.preflight``) runs this as a short job.

How, in phases, never blocking longer than ``preflight.timeout_s`` on the network:
1. every rank checks its own node (GPUs, interface, paths, free space, code and package hashes);
2. rank 0 opens a TCPStore on MASTER_ADDR next to MASTER_PORT; the other ranks first probe that port with a
   plain TCP connect (seconds, never a hang), then join and post their results to the store;
3. if nothing failed so far, the job's process group (gloo on CPU, nccl on GPU) is built on that store and
   measures all-reduce bandwidth over the whole job and, from three nodes on, between pairs of nodes, so that a
   slow node is named;
4. rank 0 writes ``preflight.json`` and ``preflight.txt`` and tells every rank the outcome; on failure the
   alert goes out from rank 0 in a local run, from the batch script's exit hook (host side) under Slurm. On a
   pass the process group stays up (the launcher gives it the training's timeout): Lightning finds it and trains in
   it.
   A rank that cannot reach rank 0 writes its own result under ``logs/preflight/``.

torch is imported inside the functions that need it, when the launcher has already imported it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from runner import proc
from runner.checks import (
    FAIL,
    PASS,
    WARN,
    Check,
    algbw,
    busbw,
    check_free_space,
    check_gpus,
    check_interface,
    check_path,
    compare_versions,
    evaluate_bandwidth,
    ib_write_bw_check,
    nccl_tests_check,
    report_status,
    ring_pairs,
    summary,
    table,
    versions,
    worst,
)
from runner.errors import PreflightError
from runner.job import container, ifname, imports, jobenv, program
from runner.job.netenv import NetEnv
from runner.rundir import EXIT_PREFLIGHT, RunDir, atomic_write, read_json
from runner.spec.typed import RunConfig

log = logging.getLogger(__name__)

SIZING_BYTES = 1 << 20  # the first transfers of a probe: they connect and size the loop (whole on a slow link)
# Full-size transfers a probe times, at most: their mean tells a link at half the median apart with room to spare,
# and each one more holds every rank back from training (with 20, 0.5 s of a 2-node job's 1.1 s preflight here).
PROBE_ITERS = 5
# A steady link is measured once two transfers in a row agree this closely: on the dev cluster 2 transfers took
# 0.1 s where 5 took 0.24 s of a 0.4 s preflight, and the first step waits for every one of them.
STEADY = 0.15
JOB_SHARE = 0.4  # of preflight.probe_budget_s for the whole-job all-reduce; the pairs (3+ nodes) share the rest
STORE_GRACE_S = 30  # extra time a TCPStore may take to start once its port answers (slow DNS, see run_checks)
SLOW_STORE_S = 2.0  # slower than this is reported (warn)


# ---------------------------------------------------------------------------------------------- reachability


def probe_tcp(host: str, port: int, timeout_s: float) -> tuple[bool, str, float]:
    """Connect to host:port, retrying while rank 0 is not listening yet; never longer than timeout_s.

    Returns (reached, what happened, seconds). Refused means nothing listens (yet): retried quickly. A
    connect timeout means packets are dropped (a firewall, a wrong address): retried until the deadline.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, last, time.monotonic() - t0
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return True, "connected", time.monotonic() - t0
        except socket.gaierror as e:
            return False, f"cannot resolve {host}: {e.strerror}", time.monotonic() - t0
        except ConnectionRefusedError:
            last = "connection refused (nothing listening: wrong MASTER_PORT, or rank 0 not started)"
        except TimeoutError:
            last = "connection timed out (packets dropped: a firewall or a wrong address?)"
        except OSError as e:
            last = f"{e.strerror or e}"
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))  # rank 0 listens within ms of the others


def _is_local_address(host: str, ifaces: Mapping[str, Mapping[str, Any]]) -> bool:
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return False
    return ip.startswith("127.") or any(i["addr"] == ip for i in ifaces.values())


def rank_file(rd: RunDir, rank: int) -> Path:
    """Where a rank that could not reach rank 0 leaves its own result (the run directory is shared)."""
    return rd.preflight_rank(rank)


# ---------------------------------------------------------------------------------------------- inside the job


@dataclass
class _Job:
    rd: RunDir
    cfg: RunConfig
    rank: int
    local: int
    node: int
    world: int
    ne: NetEnv
    train: bool = True  # training follows in this process (not `runner preflight`): the process group is kept
    host: str = field(default_factory=socket.gethostname)
    t0: float = field(default_factory=time.monotonic)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, in order (rank 0's in the report)

    def phase(self, name: str) -> None:
        """The phase `name` ended now: it took the time since the previous one ended."""
        now = time.monotonic() - self.t0
        self.phases[name] = max(0.0, round(now - sum(self.phases.values()), 3))

    @property
    def pf(self) -> dict[str, Any]:
        return dict(self.cfg["preflight"])

    @property
    def master(self) -> tuple[str, int]:
        # Its own port, next to MASTER_PORT: ranks that finish preflight early must never reach a preflight
        # store that is closing when they rendezvous for Lightning on MASTER_PORT ("Failed to recv").
        at = jobenv.current().rendezvous
        return at.addr, at.preflight_port


def check_python(job: _Job) -> Check:
    """The Python the ranks run (this one; its container, when any) and, in program mode, whether it finds the
    program's third-party packages (``program.needs``; looked up, never imported): a wrong Python (runner's own venv
    for an ESPnet3 recipe) is one line here, before any rank trains, instead of a ModuleNotFoundError on every rank
    10 s in. It fails on every node alike, so no node is named bad and the run waits for a person (no requeue)."""
    where = container.describe(job.rd.manifest_record() or {})
    python = sys.executable + (f" in {where['runtime']} {where['image']}" if where["in_container"] else "")
    command = job.cfg["command"] or []
    needs = program.needs(command, Path.cwd()) if command else []
    lacking = imports.lacking(needs)
    if lacking:
        return Check("python", job.host, FAIL, program.refusal(lacking, python),
                     "the ranks' Python finds every package the program imports", program.HINTS["missing_package"])
    return Check("python", job.host, PASS, python, f"finds {', '.join(n.package for n in needs)}" if needs else "",
                 note=f"Python {sys.version.split()[0]}")


def _local_facts(job: _Job) -> dict[str, Any]:
    """What this rank checks on its own node; only the first rank of a node checks node-wide things."""
    facts: dict[str, Any] = {"rank": job.rank, "host": job.host, "node": job.node, "local": job.local,
                             "checks": [], "versions": None}
    if job.local != 0:
        return facts
    import torch

    cfg, pf, host = job.cfg, job.pf, job.host
    ifaces = ifname.interfaces()
    master = job.master[0]
    checks = [check_gpus(cfg["trainer"]["accelerator"], int(cfg["trainer"]["devices"]),
                         torch.cuda.device_count() if torch.cuda.is_available() else 0, host,
                         os.environ.get("CUDA_VISIBLE_DEVICES")),
              check_interface(job.ne.ifname, host, ifaces, job.ne.detected, master)]
    if job.rank == 0 and not _is_local_address(master, ifaces):
        checks.append(Check("master addr", host, FAIL, f"MASTER_ADDR {master} is not this node",
                            "rank 0's node", "MASTER_ADDR must be the node of rank 0 (first node of the job)"))
    checks += [check_path(str(p), host, write=False) for p in pf.get("paths") or []]
    checks.append(check_path(str(job.rd.checkpoints), host, write=True))
    checks.append(check_free_space(str(job.rd.checkpoints), host, float(pf["min_free_gb"])))
    checks.append(python := check_python(job))
    if python.status == FAIL:  # the one line a user reads in the rank's log (the report's table says it too)
        log.error("preflight: %s; expected %s. hint: %s", python.value, python.threshold, python.hint)
    facts["checks"] = [asdict(c) for c in checks]
    facts["versions"] = versions(cfg)
    facts["ifname"] = job.ne.ifname
    return facts


def measured(times: list[float], cap: int) -> bool:
    """Whether the full-size transfers timed so far (every rank has the same list) measure the link: `cap` of them,
    or the last two within STEADY of each other. Their mean is the result; a link that varies gets more."""
    return len(times) >= cap or (len(times) >= 2 and abs(times[-1] - times[-2]) <= STEADY * min(times[-2:]))


def _measure(torch: Any, dist: Any, nbytes: int, group: Any, n: int, device: Any, budget_s: float) -> dict[str, Any]:
    """Time all-reduces in `group` within about ``budget_s``: a small transfer first (it connects, and tells how
    long the full size would take), then the full size as often as fits. On a link so slow that one full-size
    transfer would not fit, the small transfers are the measurement (``cut``): the slow link is named in a
    fraction of a second instead of after minutes."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    small = min(nbytes, SIZING_BYTES)

    def timed(size: int, iters: int) -> float:
        part = x[: size // 4]
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(part, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([(time.perf_counter() - t) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # everyone agrees on the slowest rank's time
        return float(dt.item())  # the same on every rank: so is every decision taken from it

    timed(small, 1)  # connects
    first = timed(small, 1)
    full = first * nbytes / small
    if full > budget_s:
        size, sec, iters = small, first, 1
    else:
        cap = max(1, min(PROBE_ITERS, int(budget_s / max(full, 1e-6))))
        times = [timed(nbytes, 1)]
        while not measured(times, cap):
            times.append(timed(nbytes, 1))
        size, sec, iters = nbytes, sum(times) / len(times), len(times)
    alg = algbw(size, sec)
    return {"size_bytes": size, "ranks": n, "iters": iters, "time_s": sec, "algbw_gbps": alg,
            "busbw_gbps": busbw(alg, n), "cut": size < nbytes}


def _join(job: _Job, store: Any) -> Any:
    """The job's process group, on the preflight's store: the one Lightning trains in when the checks pass (its
    DDP finds torch.distributed initialized and keeps it), so the job builds one rendezvous and one group, not
    two. The backend and device are Lightning's choice for the config (nccl on a GPU, gloo on CPU). Returns the
    device the probe runs on."""
    import torch
    import torch.distributed as dist

    gpu = job.cfg["trainer"]["accelerator"] != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", job.local) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    # The preflight's short timeout while it probes (a dead link fails in seconds); the training's after it.
    timeout = timedelta(seconds=2 * job.pf["timeout_s"])
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.PrefixStore("pg", store), rank=job.rank,
                            world_size=job.world, timeout=timeout, device_id=device if gpu else None)
    return device


def _hand_over(job: _Job, status: str) -> None:
    """After the verdict: keep the process group for the training, or take it down. Kept, it still has the
    preflight's short timeout: the launcher sets the training's once it has imported Lightning (``internals``,
    which holds torch's private setter, imports it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if job.train and status != FAIL:
        if dist.get_backend() == "nccl":  # as Lightning does for a group it built: torch warns at exit otherwise
            atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    else:
        dist.destroy_process_group()


def _probe(job: _Job, store: Any, leaders: list[int], hosts: list[str], device: Any) -> dict[str, Any]:
    """Bandwidth over the whole job and between ring pairs of nodes, in the job's process group; results on
    rank 0."""
    import torch
    import torch.distributed as dist

    nbytes = int(job.pf["probe_mib"]) << 20
    budget = float(job.pf["probe_budget_s"])
    # Two nodes have one link between them, which the whole-job all-reduce has just measured: probing the
    # pair as well took 60% of the budget to measure it again, and it could not tell which end is slow
    # either. The pairs start at three nodes, where they name the slow node.
    pairs = ring_pairs(len(leaders)) if len(leaders) > 2 else []
    out: dict[str, Any] = {"job": _measure(torch, dist, nbytes, None, job.world, device, JOB_SHARE * budget),
                           "pairs": []}
    if len(leaders) == 2 and job.rank == 0:
        out["pairs"].append({**out["job"], "nodes": hosts, "from": "job"})
    groups = [dist.new_group([leaders[a], leaders[b]]) for a, b in pairs]
    for (a, b), group in zip(pairs, groups, strict=True):
        if job.rank in (leaders[a], leaders[b]):
            res = _measure(torch, dist, nbytes, group, 2, device, (1 - JOB_SHARE) * budget / len(pairs))
            out["pairs"].append({**res, "nodes": [hosts[a], hosts[b]]})
        dist.barrier()
    for group in groups:  # the training keeps the job's group, never these (a no-op where a rank is not in one)
        dist.destroy_process_group(group)
    if job.rank != 0 and out["pairs"]:
        store.set(f"pairs/{job.rank}", json.dumps(out["pairs"]))
    dist.barrier()
    if job.rank == 0:
        seen = {tuple(p["nodes"]) for p in out["pairs"]}
        for r in leaders[1:]:
            for p in json.loads(store.get(f"pairs/{r}")) if store.check([f"pairs/{r}"]) else []:
                if tuple(p["nodes"]) not in seen:
                    seen.add(tuple(p["nodes"]))
                    out["pairs"].append(p)
    return out


def _tools(job: _Job, store: Any, leaders: list[int], hosts: list[str]) -> list[dict[str, Any]]:
    """nccl-tests and perftest, when the image has them: intra-node all_reduce_perf, ib_write_bw between pairs."""
    checks: list[Check] = []
    if job.local != 0:
        return []
    import torch

    mib = int(job.pf["probe_mib"])
    limit = 5 * job.pf["timeout_s"]
    if job.cfg["trainer"]["accelerator"] != "cpu" and torch.cuda.is_available() and shutil.which("all_reduce_perf"):
        argv = ["all_reduce_perf", "-b", f"{mib}M", "-e", f"{mib}M", "-g", str(torch.cuda.device_count()),
                "-w", "2", "-n", "10"]
        checks.append(_run_tool("nccl-tests", job.host, argv, limit, nccl_tests_check))
    devices = sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
    if shutil.which("ib_write_bw") and devices and len(leaders) >= 2:
        hca = re.split(r"[,:]", str(job.cfg["network"].get("ib_hca") or devices[0]).lstrip("=^"))[0]
        me = leaders.index(job.rank)
        port = str(job.master[1] + 1)
        for i, (a, b) in enumerate(ring_pairs(len(leaders))):
            base = ["ib_write_bw", "-d", hca, "-p", port, "-F", "--report_gbits", "-D", "1"]
            if me == b:  # server: listens until the client of this pair has run (a child we stop, hence Popen)
                server = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                store.set(f"ib/ready/{i}", "1")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.communicate(timeout=limit)
                server.kill()
                server.wait()
            elif me == a:
                store.wait([f"ib/ready/{i}"], timedelta(seconds=limit))
                time.sleep(0.5)
                checks.append(_run_tool(f"ib_write_bw {hosts[a]}->{hosts[b]}", job.host, [*base, hosts[b]], limit,
                                        ib_write_bw_check))
    return [asdict(c) for c in checks]


def _run_tool(name: str, host: str, argv: list[str], limit: float, judge: Callable[[str, str], Check]) -> Check:
    out = proc.run(argv, timeout=limit, check=False)
    if out.returncode == proc.TIMED_OUT:
        return Check(name, host, FAIL, f"no result within {limit:g} s", "", "run it by hand: " + " ".join(argv))
    if out.returncode != 0:
        err = (out.stderr or out.stdout).strip().splitlines()
        return Check(name, host, FAIL, f"exit {out.returncode}: {err[-1] if err else ''}", "exit 0",
                     "run it by hand: " + " ".join(argv))
    try:
        return judge(out.stdout, host)
    except PreflightError as e:
        return Check(name, host, FAIL, str(e), "")


def _collect(job: _Job, store: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """Rank 0: every rank's facts from the store, or from its own file when it could not reach us."""
    deadline = time.monotonic() + job.pf["timeout_s"] + 3  # the common case: an unreachable rank wrote its file
    with contextlib.suppress(RuntimeError):  # blocks until the last rank reports: no polling delay on a pass
        store.wait([f"local/{r}" for r in range(job.world)], timedelta(seconds=job.pf["timeout_s"] + 3))
    got: dict[int, dict[str, Any]] = {}
    while True:
        for r in range(job.world):
            if r not in got and store.check([f"local/{r}"]):
                got[r] = json.loads(store.get(f"local/{r}"))
        missing = [r for r in range(job.world) if r not in got]
        if not missing or (time.monotonic() > deadline and all(rank_file(job.rd, r).exists() for r in missing)):
            break
        if time.monotonic() > deadline + STORE_GRACE_S:  # a rank neither reported nor wrote: it never started
            break
        time.sleep(0.05)
    facts = [got[r] for r in sorted(got)]
    for r in missing:
        data = read_json(rank_file(job.rd, r))
        facts.append(data if data else {"rank": r, "host": f"rank {r}", "checks": [asdict(Check(
            "reach master", f"rank {r}", FAIL, f"did not report within {job.pf['timeout_s']} s", "reports",
            f"see {job.rd.rank_log(r).relative_to(job.rd.root)}; the rank may not have started"))],
            "versions": None})
    return facts, missing


def _evaluate_local(job: _Job, facts: list[dict[str, Any]]) -> list[Check]:
    checks = [Check(**c) for f in facts for c in f["checks"]]
    by_node = {f["host"]: f["versions"] for f in facts if f.get("versions")}
    checks += compare_versions(by_node)
    slow = max((f for f in facts if "store_s" in f), key=lambda f: f["store_s"], default=None)
    if slow is not None:
        bad = slow["store_s"] > SLOW_STORE_S
        checks.append(Check("rendezvous", slow["host"] if bad else "all", WARN if bad else PASS,
                            f"TCPStore up in {slow['store_s']:.1f} s", f"< {SLOW_STORE_S:g} s",
                            "slow name resolution (c10d looks up peer names): fix the DNS server in "
                            "/etc/resolv.conf or list the nodes in /etc/hosts; every job pays this" if bad else "",
                            f"slowest rank {slow['rank']}"))
    return checks


def _fingerprint(job: _Job, facts: list[dict[str, Any]], hosts: list[str]) -> dict[str, Any]:
    """What a bandwidth measurement depends on: the nodes in order, their interfaces, code, packages, size."""
    per_node = {f["host"]: [f.get("ifname"), (f.get("versions") or {}).get("code"),
                            (f.get("versions") or {}).get("packages_hash"), (f.get("versions") or {}).get("python")]
                for f in facts if f.get("local") == 0}
    return {"nodes": hosts, "world_size": job.world, "per_node": per_node, "probe_mib": job.pf["probe_mib"],
            "accelerator": job.cfg["trainer"]["accelerator"]}


def _reusable(job: _Job, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """The previous report, when a restart lands on the same nodes and image within ``preflight.reuse_s``: its
    bandwidth and tool measurements are taken instead of measured again (the node checks always run)."""
    prev = read_json(job.rd.preflight, {}) or {}
    age = time.time() - float(prev.get("time", 0))
    if prev.get("status") != PASS or prev.get("fingerprint") != fingerprint or not 0 <= age <= job.pf["reuse_s"]:
        return None
    return prev


def _finish(job: _Job, checks: list[Check], extra: dict[str, Any], store: Any = None) -> str:
    """Rank 0: status, report files, ledger, alert on failure. With the store, the other ranks hear the verdict:
    on a pass before the files are written (they go on to train; fsyncs on a shared file system take a while),
    on a failure after (they exit 77, and srun's --kill-on-bad-exit would stop this rank mid-report)."""
    status = report_status(checks, bool(job.pf["fail_on_warn"]))
    if store is not None and status != FAIL:
        store.set("final", status)
    text = summary(checks, status)
    addr, port = job.master
    report = {"status": status, "summary": text, "time": time.time(), "duration_s": time.monotonic() - job.t0,
              "phases_s": job.phases,
              "world_size": job.world, "master": f"{addr}:{port}", "checks": [asdict(c) for c in checks],
              "thresholds": {k: job.pf[k] for k in ("min_busbw_gbps", "fail_below_median", "warn_below_median",
                                                    "probe_mib", "probe_budget_s", "timeout_s", "min_free_gb")},
              **extra}
    atomic_write(job.rd.preflight_table, table(report))
    log.info("preflight report:\n%s", table(report).rstrip("\n"))
    job.rd.record("preflight", status=status, duration_s=round(report["duration_s"], 2), summary=text)
    atomic_write(job.rd.preflight, json.dumps(report, indent=2) + "\n")
    if store is not None and status == FAIL:
        store.set("final", status)
    return status


def _unreachable(job: _Job, facts: dict[str, Any], what: str, seconds: float) -> str:
    """A rank that cannot reach rank 0: leave its result where rank 0 reads it, wait for the report, fail."""
    addr, port = job.master
    facts["checks"].append(asdict(Check(
        "reach master", job.host, FAIL, f"{addr}:{port} not reachable from {job.host} after {seconds:.1f} s: {what}",
        f"connect within {job.pf['timeout_s']} s",
        "a firewall between nodes, a wrong MASTER_ADDR/MASTER_PORT, or rank 0 failed to start (see its log)")))
    with contextlib.suppress(OSError):  # a run directory that is not shared: rank 0 still names the rank
        atomic_write(rank_file(job.rd, job.rank), json.dumps(facts) + "\n")
    log.error("preflight: %s", facts["checks"][-1]["value"])
    deadline = time.monotonic() + job.pf["timeout_s"] + 30  # rank 0 may still be sending the alert
    while not job.rd.preflight.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return FAIL


def _bandwidth(bw: dict[str, Any], pf: dict[str, Any]) -> list[Check]:
    """The bandwidth checks by the run's thresholds, measured now or reused from the previous report alike."""
    return evaluate_bandwidth(bw.get("job"), bw.get("pairs", []), pf["min_busbw_gbps"], pf["fail_below_median"],
                              pf["warn_below_median"])


def run_checks(job: _Job) -> str:
    """Every rank: the whole preflight; returns the overall status (the same on every rank that got it)."""
    import torch.distributed as dist

    pf = job.pf
    facts = _local_facts(job)
    job.phase("node")
    addr, port = job.master
    if job.world == 1:
        checks = [Check(**c) for c in facts["checks"]]
        checks += compare_versions({job.host: facts["versions"]})
        return _finish(job, checks, {"nodes": [job.host], "backend": None,
                                     "bandwidth": {"note": "one rank: nothing to measure"}})
    # The port is known to answer (or is our own) when a store is built, so a slow store is name resolution:
    # c10d looks up the peers' names, and a DNS server that does not answer costs 10-20 s on every job.
    timeout = timedelta(seconds=pf["timeout_s"] + STORE_GRACE_S)
    t_store = time.monotonic()
    if job.rank == 0:
        try:
            store = dist.TCPStore(addr, port, job.world, True, timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            checks = [Check(**c) for c in facts["checks"]] + [Check(
                "listen", job.host, FAIL, f"cannot listen on {addr}:{port}: {str(e).splitlines()[0]}", "",
                "another process holds MASTER_PORT on this node")]
            return _finish(job, checks, {"nodes": [job.host], "backend": None})
    else:
        ok, what, seconds = probe_tcp(addr, port, pf["timeout_s"])
        if not ok:
            return _unreachable(job, facts, what, seconds)
        facts["reach_s"] = seconds
        store = dist.TCPStore(addr, port, job.world, False, timeout)
    facts["store_s"] = time.monotonic() - t_store
    store.set(f"local/{job.rank}", json.dumps(facts))
    wait = timedelta(seconds=2 * (pf["timeout_s"] + STORE_GRACE_S) + 10)
    if job.rank == 0:
        all_facts, missing = _collect(job, store)
        checks = _evaluate_local(job, all_facts)
        leader_facts = sorted((f for f in all_facts if f.get("local") == 0), key=lambda f: f["node"])
        leaders, hosts = [f["rank"] for f in leader_facts], [f["host"] for f in leader_facts]
        go = not missing and worst(c.status for c in checks) != FAIL
        fingerprint = _fingerprint(job, all_facts, hosts)
        prev = _reusable(job, fingerprint) if go else None
        store.set("decision", json.dumps({"go": go, "leaders": leaders, "hosts": hosts, "reuse": prev is not None}))
    else:
        store.wait(["decision"], wait)
        d = json.loads(store.get("decision"))
        go, leaders, hosts, prev = d["go"], d["leaders"], d["hosts"], {} if d["reuse"] else None
    job.phase("rendezvous")
    extra: dict[str, Any] = {"nodes": hosts, "backend": None}
    if job.rank == 0:
        extra["fingerprint"] = fingerprint
    if prev is not None and job.rank == 0:  # a restart onto the same nodes and image: the measurements hold
        extra.update(backend=prev.get("backend"), bandwidth=prev.get("bandwidth") or {},
                     tools=prev.get("tools", []),
                     reused={"from": prev["time"], "age_s": round(time.time() - prev["time"], 1),
                             "parts": ["bandwidth", "tools"]})
        bw = extra["bandwidth"]
        checks += [Check(**c) for c in extra["tools"]]
        checks += _bandwidth(bw, pf)
    measure = go and prev is None
    grouped = go and (measure or job.train)  # the job's process group: probed in, and kept for the training
    if grouped:
        tools: list[dict[str, Any]] = []
        try:
            device = _join(job, store)
            job.phase("group")
            if measure:
                extra.update(backend=dist.get_backend(), bandwidth=_probe(job, store, leaders, hosts, device))
                tools = _tools(job, store, leaders, hosts)
                job.phase("probe")
        except RuntimeError as e:  # a timeout or a connect error inside gloo/nccl: the data plane is broken
            tools = [asdict(Check("probe", job.host, FAIL, str(e).splitlines()[0][:300], "completes",
                                  "the data plane between nodes is broken: check the interface and "
                                  "firewalls for the ports gloo/NCCL open"))]
        store.set(f"tools/{job.rank}", json.dumps(tools))
    tools_s = 5 * pf["timeout_s"] + 10  # nccl-tests and ib_write_bw, when present, get this long
    if job.rank != 0:
        store.wait(["final"], timedelta(seconds=tools_s + 30))  # + rank 0 sending the alert
        status = str(store.get("final").decode())
        _hand_over(job, status)
        store.set(f"bye/{job.rank}", "1")
        return status
    if grouped:
        keys = [f"tools/{r}" for r in range(job.world)]
        with contextlib.suppress(RuntimeError):  # a rank that has not reported by then is left out
            store.wait(keys, timedelta(seconds=tools_s))
        new = [c for k in keys if store.check([k]) for c in json.loads(store.get(k))]
        extra["tools"] = extra.get("tools", []) + new
        checks += [Check(**c) for c in new]
    if measure:
        bw = extra.get("bandwidth") or {}
        checks += _bandwidth(bw, pf)
    job.phase("verdict")
    status = _finish(job, checks, extra, store)
    _hand_over(job, status)
    with contextlib.suppress(RuntimeError):  # let the others disconnect before the server goes away
        store.wait([f"bye/{r}" for r in range(1, job.world)], timedelta(seconds=5))
    return status


def runs(cfg: RunConfig) -> bool:
    """Whether the preflight runs in this job: enabled, or `runner preflight` (the checks alone)."""
    return bool(cfg["preflight"]["enabled"]) or cfg["preflight"].get("only") is True


def in_job(rd: RunDir, cfg: RunConfig, rank: int, local: int, node: int, world: int, ne: NetEnv,
           keep_group: bool = True) -> int | None:
    """The launcher's hook, after ``netenv.setup`` gave ``ne``: run the checks; an exit code, or None to train.
    ``keep_group``: training goes on in the process group the checks built (else it is taken down)."""
    only = cfg["preflight"].get("only") is True  # `runner preflight`: the checks alone
    if not runs(cfg):
        return None
    job = _Job(rd, cfg, rank, local, node, world, ne, train=keep_group and not only)
    status = run_checks(job)
    log.info("preflight %s (%.1f s)", status, time.monotonic() - job.t0)
    if status == FAIL:
        return EXIT_PREFLIGHT
    return 0 if only else None
