"""Merged NICs (NCCL_IB_MERGE_NICS): several ports behind one net device, each QP of a
connection on port q % ndevs at both ends (docs/NCCL.md section 4, docs/PLAN.md ranks[].ports)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ckptd.core.plan import PlanError, load_plan, plan_from_json
from ckptd.core.schedule import Bucket, RingConfig, RingSchedule, ScheduleError
from ckptd.tools.nccl_log import NcclLogError, parse_nccl_log
from ckptd.transports.roce.flows import FlowBinder
from helpers import pcaps, synth
from test_fastpath import assert_same, run_both, synth_pair


def _cfg(version, **kw):
    return RingConfig(nranks=2, rings=((0, 1),), nccl_version=version, **kw)


def test_qps_parts_and_cts_follow_net_ib_by_hand():
    # 2.22, 2 QPs a port, 2 ports: 4 QPs; without split a send is cut over ndevs = 2 of
    # them, qpIndex advancing one per post (net_ib.cc:1644-1688@v2.22.3-1)
    c = _cfg((2, 22), qps_per_connection=2, ndevs=2)
    assert (c.data_qps, c.parts_per_send, c.rotation_modulus) == (4, 2, 4)
    assert [[c.qp_of_part(k, j, 2) for j in range(2)] for k in range(3)] == [[0, 1], [2, 3], [0, 1]]
    assert [c.port_of_qp(q) for q in range(4)] == [0, 1, 0, 1]
    assert [c.cts_qp(k) for k in range(4)] == [0, 1, 0, 1]
    # with split every send goes over all 4 QPs from where qpIndex stands
    s = _cfg((2, 22), qps_per_connection=2, ndevs=2, split_data_on_qps=True)
    assert (s.parts_per_send, s.rotation_modulus) == (4, 1)
    # 2.29+: part i of send k on QP (k + i) % nqps (net_ib/common.h:325-330@v2.29.7-1)
    n = _cfg((2, 29), qps_per_connection=2, ndevs=2)
    assert [[n.qp_of_part(k, j, 2) for j in range(2)] for k in range(3)] == [[0, 1], [1, 2], [2, 3]]
    # one port: nothing changes
    one = _cfg((2, 29), qps_per_connection=3)
    assert (one.data_qps, one.parts_per_send, one.cts_qp(5)) == (3, 1, 0)


@pytest.mark.parametrize("version, ndevs, why", [
    ((2, 19), 2, "only from 2.20"), ((2, 23), 3, "NCCL_IB_MAX_DEVS_PER_NIC is 2"),
    ((2, 24), 5, "NCCL_IB_MAX_DEVS_PER_NIC is 4")])
def test_merged_nics_refused_where_nccl_has_none(version, ndevs, why):
    with pytest.raises(ScheduleError, match=why):
        _cfg(version, ndevs=ndevs)


@pytest.mark.parametrize("version", [(2, 22), (2, 29)])
def test_every_send_is_cut_over_both_ports(version):
    cfg = RingConfig(nranks=3, rings=((0, 1, 2),), nccl_version=version, ndevs=2, mtu=1024)
    sched = RingSchedule(cfg, [Bucket(100_000, np.dtype("float32"))])
    conn = (0, 1, 0)
    by_send: dict[int, list] = {}
    for q in range(cfg.data_qps):
        for m in sched.flows[conn + (q,)].messages:
            by_send.setdefault(id(m.send), []).append((cfg.port_of_qp(q), m.wire_offset, m.wire_len))
    assert len(by_send) == len(sched.sends[conn])
    for s in sched.sends[conn]:
        parts = sorted(by_send[id(s)], key=lambda p: p[1])
        half = -(-(-(-s.wire_bytes // 2)) // 128) * 128  # DIVUP(DIVUP(size, 2), 128) * 128
        assert {p for p, _, _ in parts} == {0, 1}
        assert [(o, n) for _, o, n in parts] == [(0, min(half, s.wire_bytes)),
                                                (half, max(0, s.wire_bytes - half))]


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    d = tmp_path_factory.mktemp("merged")
    synth(d, ranks=3, channels=2, protocol="simple", mirrors=4, nccl_version="2.29", merged_nics=2,
          qps=2, iterations=2)
    return d


def test_plan_records_ports_and_the_binder_expects_each_qp_on_its_port_pair(merged):
    plan = load_plan(merged / "plan.json")
    doc = json.loads((merged / "plan.json").read_text())
    assert doc["ranks"][1]["ports"] == ["10.77.0.2", "10.78.0.2"]
    assert [m.get("port", 0) for m in doc["mirrors"]] == [0, 1, 0, 1]
    assert plan.ring.ndevs == 2 and plan.port_of("10.78.0.2") == (1, 1) and plan.rank_of("10.78.0.2") == 1
    assert plan_from_json(doc).to_json() == doc
    binder = FlowBinder(plan)
    for (sport, dport), slots in binder.expected.items():
        assert sport[1] == dport[1]  # QP q: port q % ndevs at both ends
        assert all(q % 2 == sport[1] and plan.link_of((s, d, c)) == (sport[0], dport[0])
                   for s, d, c, q in slots)
    assert sorted(s for slots in binder.expected.values() for s in slots) == sorted(
        k for k in plan.schedule(0).flows)


def test_a_plan_of_one_port_keeps_its_format(tmp_path):
    synth(tmp_path, ranks=2, channels=1, mirrors=1, iterations=1)
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert not any("ports" in r for r in doc["ranks"]) and not any("port" in m for m in doc["mirrors"])
    assert load_plan(tmp_path / "plan.json").ring.ndevs == 1


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["ranks"][2].update(ports=["10.77.0.3"]), r"ranks\[2\]\.ports lists 1 port\(s\) where the job's NICs have 2"),
    (lambda d: d["ranks"][0].update(ports=["10.78.0.1", "10.77.0.1"]), r"ranks\[0\]\.ports\[0\] is 10\.78\.0\.1, not the rank's addr"),
    (lambda d: d["ranks"][0].update(ports=["10.77.0.1", "10.78.0.2"]), r"10\.78\.0\.2 is a port of rank 0's NIC too|a port of rank 1's NIC too"),
    (lambda d: d["ranks"][0].update(ports=["10.77.0.1", "bogus"]), r"ranks\[0\]\.ports: "),
    (lambda d: d["mirrors"][0].update(port=2), r"mirrors\[0\]\.port is 2, but rank 0's NIC has 2 port"),
    (lambda d: d["ring"].update(nccl_version="2.19"), r"ranks\[0\]\.ports: merged NICs \(2 ports\) with NCCL 2\.19"),
])
def test_bad_ports_are_one_line_errors_naming_the_key(merged, edit, message):
    doc = json.loads((merged / "plan.json").read_text())
    edit(doc)
    with pytest.raises(PlanError, match=message) as e:
        plan_from_json(doc)
    assert "\n" not in str(e.value)


SCENARIOS = {  # K = 2 ports a NIC, every version family with merging x simple/ll
    "2.22-simple-2ranks-1qp": dict(nccl_version="2.22", protocol="simple", ranks=2, qps=1),
    "2.22-ll-3ranks-2qps": dict(nccl_version="2.22", protocol="ll", ranks=3, qps=2),
    "2.27-simple-4ranks-2qps": dict(nccl_version="2.27", protocol="simple", ranks=4, qps=2),
    "2.27-ll-2ranks-1qp": dict(nccl_version="2.27", protocol="ll", ranks=2, qps=1),
    "2.29-simple-3ranks-1qp": dict(nccl_version="2.29", protocol="simple", ranks=3, qps=1),
    "2.29-ll-4ranks-2qps": dict(nccl_version="2.29", protocol="ll", ranks=4, qps=2),
    "2.32-simple-2ranks-2qps": dict(nccl_version="2.32", protocol="simple", ranks=2, qps=2),
    "2.32-ll-3ranks-1qp": dict(nccl_version="2.32", protocol="ll", ranks=3, qps=1),
    # the first merging releases (2.20-2.21's contiguous layout), LL128, and split sends
    "2.21-simple-3ranks-2qps-split": dict(nccl_version="2.21", protocol="simple", ranks=3, qps=2,
                                          split_data_on_qps=True),
    "2.24-ll128-2ranks-1qp": dict(nccl_version="2.24", protocol="ll128", ranks=2, qps=1),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_merged_nics_replay_bit_exact_on_both_paths(tmp_path, name):
    k = sorted(SCENARIOS).index(name)
    ref, fast = synth_pair(tmp_path, seed=k, channels=2, mirrors=4, merged_nics=2, loss=1e-3,
                           **SCENARIOS[name])
    assert_same(ref, fast)
    assert [(r.status, r.exact) for r in fast.reports] == [("committed", True)] * 3
    # the data really went over both ports of every NIC
    plan = load_plan(tmp_path / "plan.json")
    assert {p for (s, d), slots in FlowBinder(plan).expected.items() for p in (s[1], d[1])} == {0, 1}
    assert all(c > 0 for r in fast.reports for c in r.coverage)  # every port's mirror saw its share


def test_a_port_not_mirrored_is_reported_missing_never_misplaced(merged):
    plan = load_plan(merged / "plan.json")
    paths = pcaps(merged)
    full_ref, _ = run_both(plan, paths, merged / "init.pt", reference=str(merged / "reference"))
    assert [r.status for r in full_ref.reports] == ["committed"] * 2
    # only port 0 of ranks 0 and 1 mirrored (mirror0, mirror2): port 1's QPs are unseen
    port0 = [p for p in paths if p.endswith(("mirror0.pcap", "mirror2.pcap"))]
    ref, fast = run_both(plan, port0, merged / "init.pt", reference=str(merged / "reference"))
    assert_same(ref, fast)
    unseen = fast.extract.diagnostics()
    # ranks 0 and 1 each mirrored on port 0 with both directions: every port-1 link into or
    # out of them is named, and no port-0 link
    assert unseen and all(e.startswith("unseen port: port 10.78.") and "-> port 10.78." in e for e in unseen)
    assert len(unseen) == sum(1 for (s, d) in FlowBinder(plan).expected if s[1] == 1 and {s[0], d[0]} & {0, 1})
    assert ref.extract.diagnostics() == unseen and full_ref.extract.diagnostics() == []
    for r in fast.reports:
        assert r.status == "unrecoverable" and r.missing
        assert 0.3 < max(r.coverage) < 0.7  # about half of each NIC's traffic is on port 1
    for part, whole in zip(fast.snaps, full_ref.snaps):
        assert not part["conflicts"]
        for data, cov, full in zip(part["data"], part["cov"], whole["data"]):
            seen = np.unpackbits(cov, bitorder="little")[:len(full)].astype(bool)
            assert seen.any() and not seen.all()
            np.testing.assert_array_equal(data[seen], full[seen])  # what was placed is right
        missing = {(m.bucket, m.start, m.end) for r in fast.reports if r.iteration == part["it"] for m in r.missing}
        holes = set()
        for b, cov in enumerate(part["cov"]):
            seen = np.unpackbits(cov, bitorder="little")[:len(part["data"][b])].astype(bool)
            edges = np.flatnonzero(np.diff(np.r_[True, seen, True].astype(np.int8)))
            holes |= {(b, int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])}
        assert missing == holes  # the report names exactly the elements no mirror carried


@pytest.mark.parametrize("line", [
    "h1:1:2 [0] NCCL INFO NET/IB : Using [0]={[0] mlx5_0:1/RoCE, [1] mlx5_1:1/RoCE} [1]mlx5_2:1/RoCE [RO]; OOB eth0:10.0.0.1<0>",
    "h1:1:2 [0] NCCL INFO NET/IB : Made virtual device [2] name=mlx5_0+mlx5_1 speed=400000 ndevs=2",
    "h1:1:2 [0] NCCL INFO NET/IB : Made virtual device [2] name=mlx5_0+mlx5_1 speed=400000 ndevs=2 rail=0 plane=0",
])
def test_nccl_log_with_a_merged_device_is_refused_in_one_line(line):
    with pytest.raises(NcclLogError, match=r"log:1: NCCL merged NIC ports into one net device on h1") as e:
        parse_nccl_log(line)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("line", [
    "h1:1:2 [0] NCCL INFO NET/IB : Made virtual device [0] name=mlx5_0 speed=400000 ndevs=1",
    "h1:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.0.0.1<0>",
])
def test_nccl_log_with_plain_devices_is_read(line):
    assert parse_nccl_log(line).version is None  # parsed, nothing refused


def test_mirror_config_mirrors_every_port_of_a_merged_nic(merged, tmp_path):
    from switch_config.cabling import cabling_from_doc
    from switch_config.select import select_mirrors
    plan = load_plan(merged / "plan.json")
    doc = {"format": "ckptd-cabling", "version": 1,
           "switches": [{"name": "leaf", "os": "sonic", "mode": "span", "max_sessions": 8, "max_source_ports": 8}],
           "collectors": [{"name": f"ck{i}", "switch": "leaf", "port": f"Ethernet{100 + i}", "capacity": 2}
                          for i in range(3)],
           "ranks": [{"rank": r, "switch": "leaf", "port": f"Ethernet{2 * r}",
                      "ports": [f"Ethernet{2 * r}", f"Ethernet{2 * r + 1}"]} for r in range(3)]}
    sel = select_mirrors(plan.ring, cabling_from_doc(doc), links=2, min_streams=1)
    for p, _ in sel.chosen:
        src = {sp for s in sel.sessions for sp in s.ports}
        assert {f"Ethernet{2 * p.rank}", f"Ethernet{2 * p.rank + 1}"} <= src
    # a collector that takes one port direction cannot take a 2-port NIC
    doc1 = json.loads(json.dumps(doc))
    for c in doc1["collectors"]:
        c["capacity"] = 1
    from switch_config.select import SelectionError
    with pytest.raises(SelectionError, match="merged NIC has 2 ports"):
        select_mirrors(plan.ring, cabling_from_doc(doc1), links=2, min_streams=1)


def test_mirror_risk_counts_every_port(merged, capsys):
    from ckptd.tools.risk import evaluate, packets_from_plan
    n, k, h, p = packets_from_plan(str(merged / "plan.json"))
    assert (n, h, p) == (3, None, 2) and k > 0
    r = evaluate(n, 2, 1e-3, k, ports=p)
    assert (r["mirrored_links"], r["mirror_ports"]) == (2, 4)
    assert r["p_fail"] == evaluate(n, 2, 1e-3, k)["p_fail"]  # the same positions, split over ports
