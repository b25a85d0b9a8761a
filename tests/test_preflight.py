"""Preflight and the network environment: formulas, parsers, precedence, checks (real local runs:
tests/test_preflight_local.py).

The cluster behaviour (slow node, wrong interface, blocked port, missing path on one node) is in
test_preflight_cluster.py; here every check runs on this machine, with real sockets.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from runner import checks, spec
from runner.checks import FAIL, PASS, WARN
from runner.errors import PreflightError
from runner.job import ifname, netenv, preflight
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
SAMPLES = Path(__file__).parent / "fixtures" / "preflight"


# ------------------------------------------------------------------------------------------ busbw formula


def nccl_tests_allreduce_busbw(algbw: float, nranks: int) -> float:
    """nccl-tests' definition (src/all_reduce.cu, AllReduceGetBw): factor = 2*(nranks-1)/nranks."""
    factor = (2 * (nranks - 1)) / nranks
    return algbw * factor


@pytest.mark.parametrize("n, factor", [(2, 1.0), (8, 1.75), (16, 1.875)])
def test_busbw_matches_nccl_tests_definition(n: int, factor: float) -> None:
    assert checks.busbw_factor(n) == pytest.approx(factor)
    for alg in (0.5, 24.37, 180.71):
        assert checks.busbw(alg, n) == pytest.approx(nccl_tests_allreduce_busbw(alg, n))
    # A public 16-rank H100 run printed algbw 180.71 and busbw 338.82 for 8 GiB (both rounded to 0.01).
    assert checks.busbw(180.71, 16) == pytest.approx(338.82, abs=0.02)


def test_algbw_is_size_over_time_in_gb() -> None:
    assert checks.algbw(256 << 20, 0.011017) == pytest.approx(24.37, abs=0.01)


@pytest.mark.parametrize("n", [2, 8, 16])
def test_all_reduce_perf_sample_busbw_is_algbw_times_factor(n: int) -> None:
    r = checks.parse_all_reduce_perf((SAMPLES / f"all_reduce_perf_n{n}.txt").read_text())
    assert r["ranks"] == n
    assert [row["size_bytes"] for row in r["rows"]] == [1 << k for k in range(20, 29)]
    for row in r["rows"]:
        # both columns are printed rounded to 0.01
        assert row["busbw_gbps"] == pytest.approx(checks.busbw(row["algbw_gbps"], n), abs=0.01 * 2 + 0.005)
        assert row["wrong"] == 0
    assert r["largest"]["size_bytes"] == 256 << 20
    assert r["avg_busbw_gbps"] is not None


def test_all_reduce_perf_garbage_raises_one_line() -> None:
    with pytest.raises(PreflightError, match="no result rows") as e:
        checks.parse_all_reduce_perf("Failed: NCCL error init.cc:1234 'unhandled system error'\n")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("times, cap, done", [
    ([0.040], 5, False),  # one transfer says nothing about how steady the link is
    ([0.040, 0.042], 5, True),  # two that agree: a steady link, measured in 2 instead of 5
    ([0.040, 0.080], 5, False),  # a link that varies gets more transfers
    ([0.040, 0.080, 0.041, 0.079], 5, False),
    ([0.040, 0.080, 0.041, 0.079, 0.040], 5, True),  # ... up to the cap, and their mean is the result
    ([0.9], 1, True),  # a budget for one full-size transfer
    ([0.100, 0.116], 5, False), ([0.100, 0.114], 5, True),  # within 15% of the faster one
])
def test_the_probe_stops_once_two_transfers_agree_or_at_its_cap(times: list[float], cap: int, done: bool) -> None:
    assert preflight.measured(times, cap) is done


def test_nccl_tests_check_fails_on_wrong_results() -> None:
    text = (SAMPLES / "all_reduce_perf_n8.txt").read_text()
    last = [ln for ln in text.splitlines() if ln.strip().startswith("268435456")][0]
    bad = text.replace(last, last[: last.index("      0  ")] + "     12  " + last[last.index("      0  ") + 9:])
    assert checks.nccl_tests_check(text, "a01").status == PASS
    check = checks.nccl_tests_check(bad, "a01")
    assert check.status == FAIL and "8 GPUs" in check.value


def test_ib_write_bw_parser_gbits_and_mbytes() -> None:
    g = checks.parse_ib_write_bw((SAMPLES / "ib_write_bw_gbits.txt").read_text())
    assert g == {"device": "mlx5_0", "link_type": "IB", "size_bytes": 65536, "iterations": 41250,
                 "peak_gbits": 392.14, "avg_gbits": 391.87, "msg_rate_mpps": 0.747433}
    m = checks.parse_ib_write_bw((SAMPLES / "ib_write_bw_mbytes.txt").read_text())
    assert m["device"] == "mlx5_2" and m["link_type"] == "Ethernet"
    assert m["avg_gbits"] == pytest.approx(11198.62 * 8 * 2**20 / 1e9)  # ~93.9 Gb/s: a 100G RoCE port
    with pytest.raises(PreflightError, match="no result table"):
        checks.parse_ib_write_bw(" Couldn't connect to 10.0.0.2:18515\n")


# ------------------------------------------------------------------------------------------ bandwidth verdicts


MEDIAN = (0.5, 0.8)  # preflight.fail_below_median and warn_below_median: the schema's defaults


def test_the_median_thresholds_here_are_the_schemas_defaults(tmp_path: Path) -> None:
    pf = spec.load(QUICKSTART, [f"run_root={tmp_path}"]).data["preflight"]
    assert (pf["fail_below_median"], pf["warn_below_median"]) == MEDIAN


def pair(a: str, b: str, bw: float) -> dict[str, object]:
    return {"nodes": [a, b], "busbw_gbps": bw, "algbw_gbps": bw, "size_bytes": 16 << 20, "ranks": 2}


def test_ring_pairs_put_every_node_in_two_pairs() -> None:
    assert checks.ring_pairs(1) == []
    assert checks.ring_pairs(2) == [(0, 1)]
    assert checks.ring_pairs(4) == [(0, 1), (1, 2), (2, 3), (3, 0)]


def test_slow_node_is_named_with_its_bandwidth() -> None:
    pairs = [pair("n1", "n2", 1.2), pair("n2", "n3", 0.05), pair("n3", "n1", 0.051)]
    results = checks.evaluate_bandwidth(None, pairs, 0.5, *MEDIAN)
    bad = [c for c in results if c.status == FAIL]
    assert [c.node for c in bad] == ["n3"]
    assert bad[0].value == "0.051 GB/s" and bad[0].threshold == ">= 0.5 GB/s"
    assert "n2-n3 0.050" in bad[0].note


def test_without_threshold_a_node_far_below_the_median_fails() -> None:
    """A node at a tenth of the median (the issue saw 1%) must stop the job, not warn and train."""
    pairs = [pair("n1", "n2", 1.2), pair("n2", "n3", 1.1), pair("n3", "n4", 0.1), pair("n4", "n1", 0.1)]
    results = checks.evaluate_bandwidth(None, pairs, None, *MEDIAN)
    assert {c.node: c.status for c in results} == {"n1": PASS, "n2": PASS, "n3": PASS, "n4": FAIL}
    n4 = next(c for c in results if c.node == "n4")
    assert n4.threshold == ">= 0.5 x median 1.150 GB/s" and n4.hint
    assert checks.report_status(results, fail_on_warn=False) == FAIL


BANDS = [  # n4's bandwidth with the others at 1.0 GB/s -> its status (default thresholds 0.5 and 0.8)
    (0.01, None, FAIL), (0.49, None, FAIL), (0.5, None, WARN), (0.79, None, WARN), (0.8, None, PASS),
    (0.6, (0.7, 0.9), FAIL), (0.3, (0.2, 0.4), WARN), (0.3, (0.0, 0.0), PASS),  # preflight.*_below_median
]


@pytest.mark.parametrize("bw, ratios, status", BANDS)
def test_bands_around_the_median(bw: float, ratios: tuple[float, float] | None, status: str) -> None:
    pairs = [pair("n1", "n2", 1.0), pair("n2", "n3", 1.0), pair("n3", "n4", bw), pair("n4", "n1", bw)]
    results = checks.evaluate_bandwidth(None, pairs, None, *(ratios or MEDIAN))
    assert {c.node: c.status for c in results} == {"n1": PASS, "n2": PASS, "n3": PASS, "n4": status}


def test_a_probe_cut_short_names_the_slow_link() -> None:
    slow = {**pair("n2", "n3", 0.005), "size_bytes": 1 << 20, "cut": True}
    results = checks.evaluate_bandwidth(None, [pair("n1", "n2", 1.0), slow, {**slow, "nodes": ["n3", "n1"]}], None,
                                       *MEDIAN)
    n3 = next(c for c in results if c.node == "n3")
    assert n3.status == FAIL and "probe stopped early on a slow link: n2-n3 after 1 MiB, n3-n1 after 1 MiB" in n3.note


def test_two_nodes_name_both_ends_of_the_link() -> None:
    job = {"busbw_gbps": 0.04, "algbw_gbps": 0.027, "size_bytes": 16 << 20, "ranks": 4}
    results = checks.evaluate_bandwidth(job, [pair("n1", "n2", 0.05)], 0.5, *MEDIAN)
    assert [(c.name, c.node, c.status) for c in results] == [
        ("busbw", "job", FAIL), ("busbw node", "n1", FAIL), ("busbw node", "n2", FAIL)]
    assert "cannot be pinned on one end" in results[1].note


# ------------------------------------------------------------------------------------------ node checks

IFACES = {"lo": {"addr": "127.0.0.1", "up": True}, "eth0": {"addr": "10.77.0.2", "up": True},
          "ib0": {"addr": None, "up": False}}


def test_wrong_interface_fails_naming_it_and_the_existing_ones() -> None:
    c = checks.check_interface("eth9", "n2", IFACES, "eth0", "n1")
    assert c.status == FAIL and c.value == "eth9 not found"
    assert "lo (127.0.0.1)" in c.hint and "eth0 (10.77.0.2)" in c.hint and "network.ifname: eth0" in c.hint


def test_interface_down_or_without_address_fails() -> None:
    c = checks.check_interface("ib0", "n2", IFACES, "eth0", "n1")
    assert c.status == FAIL and "not up or without an address" in c.value


def test_interface_checks_follow_nccl_syntax() -> None:
    assert checks.check_interface("eth0", "n2", IFACES, "eth0", "n1").status == PASS
    assert checks.check_interface("eth", "n2", IFACES, "eth0", "n1").status == PASS  # NCCL prefix match
    assert checks.check_interface("=eth", "n2", IFACES, "eth0", "n1").status == FAIL  # '=' means exact
    assert checks.check_interface("^docker,lo", "n2", IFACES, "eth0", "n1").status == PASS
    off_route = checks.check_interface("lo", "n2", IFACES, "eth0", "n1")
    assert off_route.status == WARN and "eth0" in off_route.threshold


def test_interfaces_of_this_machine_include_loopback() -> None:
    found = ifname.interfaces()
    assert found["lo"] == {"addr": "127.0.0.1", "up": True}


def test_gpu_check() -> None:
    cpu = checks.check_gpus("cpu", 2, 0, "n1", "0,1")
    assert cpu.status == PASS and "CPU run" in cpu.note
    # CUDA_VISIBLE_DEVICES=0,1 as the dev cluster's fake gres sets it: the devices are fake (/dev/null), and
    # what counts is what the CUDA runtime sees (here 1): the check fails and says so.
    fake = checks.check_gpus("gpu", 2, 1, "n1", "0,1")
    assert fake.status == FAIL and fake.value == "1 visible" and "CUDA_VISIBLE_DEVICES=0,1" in fake.note
    assert checks.check_gpus("gpu", 2, 2, "n1", "0,1").status == PASS


def test_path_checks(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-0").write_bytes(b"x")
    assert checks.check_path(str(data), "n1", write=False).status == PASS
    assert checks.check_path(str(data / "shard-0"), "n1", write=False).status == PASS
    missing = checks.check_path(str(tmp_path / "nope"), "n2", write=False)
    assert missing.status == FAIL and missing.node == "n2" and missing.value.endswith("missing")
    assert checks.check_path(str(data), "n1", write=True).status == PASS
    assert list(data.iterdir()) == [data / "shard-0"]  # the write probe leaves nothing behind
    assert checks.check_free_space(str(tmp_path), "n1", 0).status == PASS
    assert checks.check_free_space(str(tmp_path), "n1", 1e9).status == FAIL


def test_versions_mismatch_names_the_odd_node() -> None:
    same = {"code": "aaa", "python": "3.11.2", "packages": {"torch": "2.13.0", "lightning": "2.6.0"}}
    odd = {"code": "bbb", "python": "3.11.2", "packages": {"torch": "2.12.0", "lightning": "2.6.0"}}
    results = checks.compare_versions({"n1": same, "n2": same, "n3": odd})
    assert [(c.name, c.node, c.status) for c in results] == [("code", "n3", FAIL), ("packages", "n3", FAIL)]
    assert "n3: torch 2.12.0 (others 2.13.0)" in results[1].value
    assert all(c.status == PASS for c in checks.compare_versions({"n1": same, "n2": same}))


def test_versions_of_this_process_are_stable() -> None:
    cfg = spec.load("conf/quickstart.yaml").data  # model: runner.dev.example.TinyRegressor
    a, b = checks.versions(cfg), checks.versions(cfg)
    assert a == b and len(a["code"]) == 16 and a["packages"]["pyyaml"]
    assert any(p.name == "example.py" for p in checks.code_to_compare(cfg))


# ------------------------------------------------------------------------------------------ reachability


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_probe_reaches_a_listener_that_starts_late() -> None:
    port = free_port()
    srv = socket.socket()

    def listen_later() -> None:
        time.sleep(0.5)  # the late start is what this test is about, not a wait for something
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen()

    t = threading.Thread(target=listen_later)
    t.start()
    try:
        ok, what, seconds = preflight.probe_tcp("127.0.0.1", port, 5)
    finally:
        t.join()
        srv.close()
    assert ok and what == "connected" and 0.4 < seconds < 2


def test_probe_gives_up_at_its_deadline_and_says_why() -> None:
    t = time.monotonic()
    ok, what, _ = preflight.probe_tcp("127.0.0.1", free_port(), 1.0)
    assert not ok and "refused" in what and time.monotonic() - t < 1.5
    ok, what, _ = preflight.probe_tcp("no-such-host.invalid", 80, 1.0)
    assert not ok and "cannot resolve" in what


# ------------------------------------------------------------------------------------------ environment precedence


def cfg(**network: object) -> dict[str, object]:
    return {"network": {"ifname": None, "ib_hca": None, "debug": False, "pg_timeout_s": 60, **network}, "env": {}}


def test_env_defaults_and_detected_interface(tmp_path: Path) -> None:
    ne = netenv.plan(cfg(), tmp_path / "logs", {"MASTER_ADDR": "n1"}, detected="eth0")
    v = {k: (x.value, x.source) for k, x in ne.vars.items()}
    assert v["NCCL_DEBUG"] == ("WARN", netenv.RUNNER)
    assert v["NCCL_DEBUG_SUBSYS"] == ("INIT,NET", netenv.RUNNER)
    assert v["NCCL_DEBUG_FILE"] == (str(tmp_path / "logs" / "nccl" / "nccl-%h-%p.log"), netenv.RUNNER)
    assert v["NCCL_SOCKET_IFNAME"] == v["GLOO_SOCKET_IFNAME"] == ("eth0", netenv.DETECTED)
    assert v["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == ("1", netenv.RUNNER)
    assert "TORCH_DISTRIBUTED_DEBUG" not in v and "NCCL_IB_HCA" not in v
    assert ne.overridden() == [] and ne.report() == [] and ne.pg_timeout_s == 60


def test_env_debug_and_config_interface(tmp_path: Path) -> None:
    # the batch script exports network.ifname: the same value, still the config's, and the config beats detection
    environ = {"MASTER_ADDR": "n1", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    ne = netenv.plan(cfg(debug=True, ifname="ib0", ib_hca="mlx5_0,mlx5_1"), tmp_path, environ,
                     detected="eth0")
    assert ne.vars["NCCL_DEBUG"].value == "INFO"
    assert ne.vars["TORCH_DISTRIBUTED_DEBUG"].value == "DETAIL"
    assert (ne.vars["GLOO_SOCKET_IFNAME"].value, ne.vars["GLOO_SOCKET_IFNAME"].source) == ("ib0", netenv.CONFIG)
    assert ne.vars["NCCL_IB_HCA"].value == "mlx5_0,mlx5_1"


def test_user_values_win_and_are_reported(tmp_path: Path) -> None:
    c = cfg()
    c["env"] = {"NCCL_SOCKET_IFNAME": "^docker,lo", "NCCL_IB_GID_INDEX": 3}
    environ = {"MASTER_ADDR": "n1", "NCCL_DEBUG": "TRACE", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_ALGO": "Ring"}
    ne = netenv.plan(c, tmp_path, environ, detected="eth0")
    assert ne.vars["NCCL_SOCKET_IFNAME"] == netenv.Var("^docker,lo", netenv.USER, "eth0")
    assert ne.vars["NCCL_DEBUG"] == netenv.Var("TRACE", netenv.INHERITED, "WARN")
    # the batch script or an earlier step exported the same value runner wants: still runner's, no report
    assert ne.vars["GLOO_SOCKET_IFNAME"] == netenv.Var("eth0", netenv.DETECTED)
    assert ne.vars["NCCL_IB_GID_INDEX"] == netenv.Var("3", netenv.USER)
    assert ne.vars["NCCL_ALGO"] == netenv.Var("Ring", netenv.INHERITED)
    assert ne.overridden() == ["NCCL_DEBUG", "NCCL_SOCKET_IFNAME"]
    assert ne.report() == [
        "env NCCL_DEBUG='TRACE' from environment wins over runner's 'WARN'",
        "env NCCL_SOCKET_IFNAME='^docker,lo' from config env: wins over runner's 'eth0'"]
    assert ne.ifname == "eth0"  # gloo's name is the one the preflight checks


def test_a_user_nccl_pattern_stays_and_gloo_gets_the_detected_name(tmp_path: Path) -> None:
    """NCCL's value may be a pattern like ``^docker,lo`` that gloo would not understand."""
    env: dict[str, str] = {}
    netenv.apply(netenv.plan(cfg(), tmp_path, {"MASTER_ADDR": "10.77.0.2", "NCCL_SOCKET_IFNAME": "^docker,lo"},
                             detected="eth0"), env)
    assert env["NCCL_SOCKET_IFNAME"] == "^docker,lo" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    environ = {"MASTER_ADDR": "10.77.0.2", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert netenv.plan(cfg(ifname="ib0"), tmp_path, environ, detected="eth0").ifname == "ib0"  # config wins
    ne = netenv.plan(cfg(), tmp_path, {}, detected=None)  # no MASTER_ADDR: nothing detected, nothing set
    assert ne.ifname is None and not set(ifname.IFNAME_VARS) & set(ne.vars)


def test_a_value_exported_by_the_user_wins_over_the_config_and_is_reported(tmp_path: Path) -> None:
    environ = {"MASTER_ADDR": "n1", "GLOO_SOCKET_IFNAME": "eth1"}
    ne = netenv.plan(cfg(ifname="ib0"), tmp_path, environ, detected="eth0")
    assert ne.vars["GLOO_SOCKET_IFNAME"] == netenv.Var("eth1", netenv.INHERITED, "ib0")
    assert ne.overridden() == ["GLOO_SOCKET_IFNAME"]


def test_setup_detects_once_exports_and_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(netenv, "detect_ifname", lambda addr: calls.append(addr) or "lo")
    env = {"MASTER_ADDR": "127.0.0.1"}
    ne = netenv.setup(cfg(), RunDir(tmp_path), 0, env)
    assert calls == ["127.0.0.1"] and ne.detected == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert json.loads((tmp_path / "env.json").read_text())["detected"] == "lo"
    netenv.setup(cfg(), RunDir(tmp_path / "other"), 1, {"MASTER_ADDR": "127.0.0.1"})
    assert not (tmp_path / "other" / "env.json").exists()  # rank 0 records, the others do not


# ------------------------------------------------------------------------------------------ the report


def test_table_and_summary() -> None:
    results = [checks.Check("interface", "n2", FAIL, "eth9 not found", "an existing interface that is up",
                            "interfaces here: lo, eth0"),
               checks.Check("gpus", "n1", PASS, "cpu run", note="CPU run: no GPUs needed")]
    text = checks.summary(results, FAIL)
    assert text == "preflight fail: interface on n2: eth9 not found (expected an existing interface that is up)"
    report = {"status": FAIL, "summary": text, "duration_s": 1.23, "nodes": ["n1", "n2"], "world_size": 4,
              "backend": None, "master": "n1:12345", "checks": [c.__dict__ for c in results]}
    out = checks.table(report)
    assert out.startswith("preflight FAIL in 1.2 s: 2 nodes, 4 ranks, no probe, master n1:12345\n")
    assert "interface  n2    fail    eth9 not found" in out and "    note: CPU run: no GPUs needed" in out


def test_table_shows_a_check_that_passed_everywhere_once_and_problems_per_node() -> None:
    def gpus(node: str) -> dict[str, str]:
        return checks.Check("gpus", node, PASS, "cpu run").__dict__

    results = [gpus("n1"), gpus("n2"), checks.Check("path", "n2", FAIL, "/d missing").__dict__, gpus("n3"),
               checks.Check("path", "n1", PASS, "/d").__dict__, checks.Check("path", "n3", PASS, "/d").__dict__]
    rows = [ln.split() for ln in checks.table({"status": FAIL, "checks": results}).splitlines()[2:-1]]
    assert rows == [["gpus", "n1,n2,n3", "pass", "cpu", "run"], ["path", "n2", "fail", "/d", "missing"],
                    ["path", "n1,n3", "pass", "/d"]]
    assert [c["node"] for c in results] == ["n1", "n2", "n2", "n3", "n1", "n3"]  # the report itself is untouched


# ------------------------------------------------------------------------------------------ real local runs


@pytest.mark.parametrize("change, reused", [
    ({}, True),
    ({"nodes": ["n2", "n1"]}, False),  # other nodes (or another order): measure again
    ({"per_node": {"n1": ["eth0", "other-code", "p", "3.11"]}}, False),  # another image
    ({"status": "warn"}, False),
    ({"age_s": 120}, False),  # older than reuse_s
    ({"reuse_s": 0}, False),  # reuse turned off
])
def test_a_restart_reuses_the_measurements_only_on_the_same_nodes_and_image(
        tmp_path: Path, change: dict[str, object], reused: bool) -> None:
    fingerprint = {"nodes": ["n1", "n2"], "world_size": 4, "per_node": {"n1": ["eth0", "c", "p", "3.11"]},
                   "probe_mib": 16, "accelerator": "cpu"}
    rd = RunDir(tmp_path)
    now = {k: change.get(k, v) for k, v in fingerprint.items()}
    previous = {"status": change.get("status", PASS), "time": time.time() - float(change.get("age_s", 5)),  # type: ignore[arg-type]
                "fingerprint": fingerprint, "bandwidth": {"job": {"busbw_gbps": 1.0}}}
    rd.preflight.write_text(json.dumps(previous))
    job = preflight._Job(rd, {"preflight": {"reuse_s": change.get("reuse_s", 60)}}, 0, 0, 0, 4, None)  # type: ignore[arg-type, typeddict-item]
    assert (preflight._reusable(job, now) is not None) is reused


@pytest.mark.parametrize("status", [PASS, FAIL])
def test_other_ranks_hear_a_failure_only_once_its_report_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   status: str) -> None:
    """On a pass the other ranks go on to train while rank 0 writes the report; on a failure they exit 77, and
    srun's --kill-on-bad-exit would stop rank 0 mid-report: they hear it only once preflight.json is there."""
    from datetime import timedelta

    import torch.distributed as dist

    monkeypatch.setenv("SLURM_JOB_ID", "1")  # under Slurm the exit hook alerts, not rank 0
    cfg = spec.load(QUICKSTART, [f"run_root={tmp_path}"]).data
    rd = RunDir(tmp_path / "run")
    rd.logs.mkdir(parents=True)
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timedelta(seconds=10))
    heard: list[tuple[str, bool]] = []

    def other_rank() -> None:
        client.wait(["final"], timedelta(seconds=10))
        heard.append((client.get("final").decode(), rd.preflight.exists()))

    t = threading.Thread(target=other_rank)
    t.start()
    check = checks.Check("free space", "n1", status, "0.5 GB free" if status == FAIL else "80 GB free", ">= 1 GB")
    job = preflight._Job(rd, cfg, 0, 0, 0, 2, None)  # type: ignore[arg-type]
    assert preflight._finish(job, [check], {"nodes": ["n1"], "backend": None}, server) == status
    t.join(10)
    assert heard and heard[0][0] == status
    if status == FAIL:
        assert heard[0][1], "the other ranks heard the failure before its report was written"
    assert json.loads(rd.preflight.read_text())["status"] == status


def test_a_restart_that_reuses_the_measurements_keeps_the_runs_median_thresholds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that passed with ``preflight.fail_below_median: 0.3`` must pass its restart on the same nodes too: the
    reused bandwidth is judged by the run's thresholds, never by checks.py's defaults (0.5 / 0.8)."""
    import torch.distributed as dist

    cfg = spec.load(QUICKSTART, [f"run_root={tmp_path}", "preflight.fail_below_median=0.3",
                                 "preflight.warn_below_median=0.4"]).data
    # n3's best pair is 0.45 x the median: a pass at 0.3 / 0.4, a failure at the defaults 0.5 / 0.8.
    pairs = [pair("n1", "n2", 1.0), pair("n2", "n3", 0.45), pair("n3", "n1", 0.45)]
    prev = {"status": PASS, "time": time.time() - 5, "backend": "gloo", "tools": [],
            "bandwidth": {"job": None, "pairs": pairs}}
    facts = [{"rank": r, "host": f"n{r + 1}", "node": r, "local": 0} for r in range(3)]
    judged: list[checks.Check] = []

    class Store:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def set(self, key: str, value: object) -> None:
            pass

        def wait(self, keys: object, timeout: object = None) -> None:
            pass

    def finish(job: object, found: list[checks.Check], extra: object, store: object = None) -> str:
        judged.extend(found)
        return checks.report_status(found, False)

    monkeypatch.setattr(dist, "TCPStore", Store)
    monkeypatch.setattr(preflight, "_local_facts", lambda job: {"checks": [], "versions": None})
    monkeypatch.setattr(preflight, "_collect", lambda job, store: (facts, []))
    monkeypatch.setattr(preflight, "_evaluate_local", lambda job, found: [])
    monkeypatch.setattr(preflight, "_fingerprint", lambda job, found, hosts: {"nodes": hosts})
    monkeypatch.setattr(preflight, "_reusable", lambda job, fingerprint: prev)
    monkeypatch.setattr(preflight, "_finish", finish)
    monkeypatch.setattr(preflight, "_hand_over", lambda job, status: None)
    job = preflight._Job(RunDir(tmp_path / "run"), cfg, 0, 0, 0, 3, None, train=False)  # type: ignore[arg-type]
    assert preflight.run_checks(job) == PASS, [c for c in judged if c.status != PASS]
    assert {c.node: c.status for c in judged if c.name == "busbw node"} == {"n1": PASS, "n2": PASS, "n3": PASS}
