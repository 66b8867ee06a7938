"""Multi-GPU nodes: only hops between nodes reach a NIC and a mirror; and traffic or
plans that are not ring allreduce are refused by name."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.core.checkpoint import load_checkpoint
from ckptd.core.plan import PlanError, load_plan, plan_from_json
from ckptd.fast.pipeline import fast_replay
from ckptd.pipeline import ReplayOptions
from ckptd.transports.roce.flows import FlowBinder
from parsers.capfile import open_capture
from parsers.roce import FrameClass, decode_frame

from helpers import pcaps, run_replay, synth

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nodes4(tmp_path_factory):
    """4 nodes x 4 GPUs, 2 channels on 2 rails; mirror k on NIC k of node 0 (both ways)."""
    d = tmp_path_factory.mktemp("nodes4")
    synth(d, nodes=4, gpus_per_node=4, channels=2, iterations=2, mirrors=2)
    return d


def test_plan_knows_nodes_nics_and_network_hops(nodes4):
    plan = load_plan(nodes4 / "plan.json")
    assert plan.nranks == 16 and len(set(plan.node_names)) == 4
    # NCCL-style rings: each node's ranks consecutive, channel 1 enters each node at GPU 1
    assert plan.ring.rings[1][:4] == (1, 2, 3, 0)
    wire = plan.network_connections
    assert len(wire) == 8  # 4 of each ring's 16 hops cross a node boundary
    assert all(plan.node_names[s] != plan.node_names[d] for s, d, _ in wire)
    # channel 0 leaves node 0 from GPU 3 through NIC 0 (GPU 0's: PXN) into GPU 4's NIC 0
    assert (3, 4, 0) in wire and plan.link_of((3, 4, 0)) == (0, 4)
    assert plan.nic(3, 0) == plan.addresses[0] and plan.nic(3, 1) == plan.addresses[3]
    # the binder expects the network links only, never an NVLink hop
    binder = FlowBinder(plan)
    assert set(binder.expected) == {plan.qp_link(c, 0) for c in wire}
    assert sorted(s[:3] for slots in binder.expected.values() for s in slots) == sorted(wire)
    again = plan_from_json(json.loads((nodes4 / "plan.json").read_text()))
    assert again.to_json() == plan.to_json()


def test_captures_hold_only_network_hops(nodes4):
    plan = load_plan(nodes4 / "plan.json")
    links = {(plan.nic(s, c), plan.nic(d, c)) for s, d, c in plan.network_connections}
    mirrored = {link for link in links
                if any(m.sees(plan.rank_of(link[0]), plan.rank_of(link[1])) for m in plan.mirrors)}
    noise = {(plan.addresses[0], plan.addresses[1])}  # the synth's unrelated p2p flow
    seen = set()
    for path in pcaps(nodes4):
        for fr in open_capture(path):
            f = decode_frame(fr.data, fr.linktype, fr.origlen)
            if f.cls is FrameClass.ROCE_DATA and f.bth.opcode in (6, 7, 8, 9, 11):
                seen.add((str(f.src), str(f.dst)))
    assert seen - noise == mirrored
    # two mirror ports, each on one rail: every ring has exactly 2 mirrored links
    for c in range(plan.ring.channels):
        assert sum((plan.nic(s, cc), plan.nic(d, cc)) in mirrored
                   for s, d, cc in plan.network_connections if cc == c) == 2


def test_replays_bit_exact_from_two_links_per_ring(nodes4):
    ref = run_replay(nodes4)
    assert [r.iteration for r in ref.reports] == [0, 1]
    assert all(r.ok and r.exact for r in ref.reports), [r.status for r in ref.reports]
    assert ref.extract.counters["schedule_mismatch"] == 0 and not ref.extract.diagnostics()
    plan = load_plan(nodes4 / "plan.json")
    opts = ReplayOptions(out=str(nodes4 / "fast"), reference=str(nodes4 / "reference"))
    fast = fast_replay(plan, pcaps(nodes4), load_checkpoint(nodes4 / "init.pt"), opts)
    assert [(r.iteration, r.ok, r.exact) for r in fast.reports] == [(0, True, True), (1, True, True)]
    assert fast.extract.counters == ref.extract.counters


def _share_nic(doc, rank, owner):
    """rank gives up its own NIC and shares owner's (a node with fewer NICs than GPUs)."""
    old, new = doc["ranks"][rank]["addr"], doc["ranks"][owner]["addr"]
    for r in doc["ranks"]:
        r["nics"] = [new if a == old else a for a in r.get("nics", [r["addr"]] * 2)]
    doc["ranks"][rank]["addr"] = new


def _doc(nodes4) -> dict:
    return json.loads((nodes4 / "plan.json").read_text())


@pytest.mark.parametrize("change, message", [
    (lambda d: d["ranks"][4].update(addr=d["ranks"][0]["addr"]), "share NIC .* nodes 'node0' and 'node1'"),
    (lambda d: d["ranks"][3].update(nics=["10.99.0.1", d["ranks"][3]["addr"]]), r"ranks\[3\].nics\[0\] .* no rank's own NIC"),
    (lambda d: d["ranks"][3].update(nics=[d["ranks"][3]["addr"]]), "one NIC address per channel"),
    (lambda d: _share_nic(d, 3, 2) or d["mirrors"][1].update(rank=3), r"mirrors\[1\] names rank 3, whose NIC .* rank 2's"),
])
def test_bad_topologies_name_the_field(nodes4, change, message):
    doc = _doc(nodes4)
    change(doc)
    with pytest.raises(PlanError, match=message):
        plan_from_json(doc, "p.json")


def test_one_gpu_per_host_plans_read_as_before(tmp_path):
    synth(tmp_path, ranks=3, channels=2, iterations=1)
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert all(set(r) == {"rank", "addr"} for r in doc["ranks"])  # no node, no nics
    plan = plan_from_json(doc)
    assert plan.one_host_per_rank and len(plan.network_connections) == 6
    assert plan.link_of((0, 1, 1)) == (0, 1)


def _replay_cli(run: Path, plan: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(plan), "--init",
                           str(run / "init.pt"), *extra, *pcaps(run)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def _one_line_refusal(res, *words):
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, err
    assert "committed" not in res.stdout  # nothing was placed, let alone committed


@pytest.mark.parametrize("fast", [False, True])
def test_reduce_scatter_traffic_is_refused(tmp_path_factory, fast):
    run = tmp_path_factory.getbasetemp() / "refuse-reduce_scatter"
    if not (run / "plan.json").exists():
        synth(run, ranks=4, channels=2, iterations=2, mirrors=2, collective="reduce_scatter")
    _one_line_refusal(_replay_cli(run, run / "plan.json", *([] if fast else ["--reference-path"])),
                      "reduce-scatter with no allgather", "FSDP/ZeRO", "NCCL_ALGO=Ring")


# 2 ranks (or nodes): every tree edge is a ring hop both ways; 3 and 4: some are, the
# others are pairs that are ring neighbours in no channel, but the tree's messages on the
# ring hops name it first
@pytest.mark.parametrize("ranks, protocol, version, nodes", [
    (2, "simple", "2.19", 0), (2, "ll", "2.27", 0), (2, "ll128", "2.29", 0),
    (3, "simple", "2.27", 0), (3, "ll", "2.19", 0), (3, "ll128", "2.27", 0),
    (4, "simple", "2.29", 0), (4, "ll", "2.22", 0), (4, "ll128", "2.19", 0),
    (4, "simple", "2.27", 2),  # 2 nodes of 2 GPUs
])
@pytest.mark.parametrize("fast", [False, True])
def test_tree_traffic_on_ring_links_is_refused_by_name(tmp_path_factory, ranks, protocol, version, nodes, fast):
    run = tmp_path_factory.getbasetemp() / f"refuse-tree-{ranks}-{protocol}-{nodes}"
    if not (run / "plan.json").exists():
        shape = {"nodes": nodes, "gpus_per_node": ranks // nodes} if nodes else {"ranks": ranks}
        synth(run, channels=2, iterations=2, mirrors=2, protocol=protocol, nccl_version=version,
              collective="tree", **shape)
    res = _replay_cli(run, run / "plan.json", *([] if fast else ["--reference-path"]))
    _one_line_refusal(res, "NCCL's Tree allreduce", "NCCL_ALGO=Ring")
    assert "link rank " in res.stderr or "link NIC " in res.stderr


@pytest.mark.parametrize("setting, words", [
    ({"algorithm": "Tree"}, ("NCCL_ALGO=Tree", "Tree", "NCCL_ALGO=Ring")),
    ({"algorithm": "NVLS,Ring", "nvls_channels": 16}, ("NVLS", "NCCL_ALGO=Ring")),
    ({"algorithm": "allreduce:ring;broadcast:tree"}, None),
])
def test_plan_asking_for_another_algorithm_is_refused(nodes4, tmp_path, setting, words):
    doc = _doc(nodes4)
    doc["ring"].update(setting)
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    if words is None:  # Ring for allreduce: accepted
        assert plan_from_json(doc).nranks == 16
        return
    _one_line_refusal(_replay_cli(nodes4, tmp_path / "plan.json"), *words)


def test_mirror_config_selects_only_links_between_nodes(nodes4):
    """Selection over NIC ports: each port carries its NIC's network hops of every
    channel; the ring facts hold per hop, so 2 network hops of a ring see every chunk."""
    import numpy as np

    from ckptd.core.schedule import AG, Bucket, RingSchedule
    from switch_config.cabling import cabling_from_doc
    from switch_config.select import network_links, select_mirrors
    from test_mirror_config import cabling

    plan = load_plan(nodes4 / "plan.json")
    network = network_links(plan)
    sel = select_mirrors(plan.ring, cabling_from_doc(cabling(16, collectors=4, ports=8)), links=2,
                         min_streams=1, network=network)
    wire = plan.network_connections
    sched = RingSchedule(plan.ring, [Bucket(16 * 65536, np.dtype("float32"))])
    for ch in range(plan.ring.channels):
        links = {link for p, _ in sel.chosen for link in p.links(plan.ring, ch, network)}
        assert len(links) >= 2 and all(link + (ch,) in wire for link in links)
        chunks = {s.chunk for link in links for s in sched.sends[link + (ch,)] if s.phase == AG and s.nelem}
        assert chunks == set(range(16))  # every chunk of the channel reaches a mirrored network hop
    assert {p.rank for p, _ in sel.chosen} <= {nic for _, nic, _ in network}
    doc = sel.to_json()
    assert all(m["rank"] in {0, 1, 4, 5, 8, 9, 12, 13} for m in doc["plan_mirrors"])  # NICs 0 and 1 (rails)
    more = select_mirrors(plan.ring, cabling_from_doc(cabling(16, collectors=8, ports=8)), links=6,
                          min_streams=1, network=network)
    assert any("only 4 hops between nodes" in n for n in more.notes)


def test_mirror_risk_counts_copies_over_links_between_nodes(nodes4):
    from ckptd.tools.risk import evaluate, failure_probability, packets_from_plan
    r = evaluate(16, 5, 1e-3, 10000, nodes=4)
    assert r["mirrorable_links"] == 4 and r["mirrored_links"] == 4
    assert r["chunks_by_copies"] == {"3": 4, "4": 12}
    assert failure_probability(16, 5, 1e-3, 10000, nodes=4) == failure_probability(16, 4, 1e-3, 10000, nodes=4)
    assert failure_probability(16, 5, 1e-3, 10000, nodes=4) > failure_probability(16, 5, 1e-3, 10000)
    n, k, h, p = packets_from_plan(str(nodes4 / "plan.json"))
    assert (n, h) == (16, 4) and k > 0


def test_shared_nic_ll_ipv6_replays_bit_exact(tmp_path):
    """One NIC per node shared by its GPUs: the NIC pair between the nodes carries
    channel 0's hop 1 -> 2 and channel 1's hop 0 -> 3 (different rank pairs), told
    apart by QP number in channel order; LL flags, IPv6."""
    synth(tmp_path, nodes=2, gpus_per_node=2, nics_per_node=1, channels=2, protocol="ll", ipv6=True,
          iterations=2, mirrors=2)
    plan = load_plan(tmp_path / "plan.json")
    assert plan.addresses[0] == plan.addresses[1] and plan.link_of((1, 2, 0)) == plan.link_of((0, 3, 1)) == (0, 2)
    assert FlowBinder(plan).expected[((0, 0), (2, 0))] == [(1, 2, 0, 0), (0, 3, 1, 0)]
    ref = run_replay(tmp_path)
    assert [(r.ok, r.exact) for r in ref.reports] == [(True, True)] * 2
    opts = ReplayOptions(out=str(tmp_path / "fast"), reference=str(tmp_path / "reference"))
    fast = fast_replay(plan, pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"), opts)
    assert [(r.ok, r.exact) for r in fast.reports] == [(True, True)] * 2
