"""`ckptd plan --nccl-log`: the ring, nodes and NICs read from NCCL_DEBUG=INFO output.

The logs in tests/data/nccl-logs/ are a 2-node x 4-GPU job with 4 channels, written
from the print formats of NVIDIA/nccl v2.19.4-1, v2.27.5-1 and v2.29.3-1 (README there).
"""
import json
import re
import sys
from pathlib import Path

import pytest

from ckptd.cli import main
from ckptd.core.algorithms import CollectiveRefused, enabled
from ckptd.core.plan import load_plan
from ckptd.tools.nccl_log import NcclLogError, parse_nccl_log, ring_topology

LOGS = Path(__file__).parent / "data" / "nccl-logs"
VERSIONS = {"2.19": (2, 19, 3), "2.27": (2, 27, 5), "2.29": (2, 29, 3)}
NIC_ADDRS = {"dgx-a07": [f"10.10.{k}.7" for k in range(4)], "dgx-a08": [f"10.10.{k}.8" for k in range(4)]}

# By hand, from the job's layout: ranks 0-3 on dgx-a07, 4-7 on dgx-a08; channel c enters
# each node at local GPU c and leaves from the GPU before it; channel c's network hops
# use NIC c on both nodes (rails), every GPU owns the NIC of its index.
HAND_RINGS = ((0, 1, 2, 3, 4, 5, 6, 7), (0, 5, 6, 7, 4, 1, 2, 3),
              (0, 1, 6, 7, 4, 5, 2, 3), (0, 1, 2, 7, 4, 5, 6, 3))


def hand_ranks() -> list[dict]:
    out = []
    for r in range(8):
        host, local = ("dgx-a07", "dgx-a08")[r // 4], r % 4
        nic = NIC_ADDRS[host]
        per = [nic[local]] * 4
        for c in range(4):
            if local == c or local == (c + 3) % 4:  # enters the node on channel c, or leaves it
                per[c] = nic[c]
        entry = {"rank": r, "addr": nic[local], "node": host}
        if per != [nic[local]] * 4:
            entry["nics"] = per
        out.append(entry)
    return out


def log(version: str) -> str:
    return (LOGS / f"nccl-{version}-2x4.log").read_text()


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_log_gives_the_hand_made_topology(version):
    job = parse_nccl_log(log(version), version)
    assert job.version == VERSIONS[version] and job.nranks == 8 and job.coll_channels == 4
    assert job.nnodes == (None if version == "2.19" else 2)  # 2.19 prints no nNodes line: counted from hosts
    topo = ring_topology(job, NIC_ADDRS)
    assert topo.rings == HAND_RINGS
    assert topo.protocol == "simple" and topo.nccl_version == VERSIONS[version][:2]
    ranks = hand_ranks()
    assert topo.addresses == tuple(x["addr"] for x in ranks)
    assert topo.nodes == tuple(x["node"] for x in ranks)
    assert topo.channel_nics == tuple(tuple(x.get("nics", [x["addr"]] * 4)) for x in ranks)


def test_plan_command_writes_the_hand_made_plan(tmp_path):
    """NCCL 2.19 is decoded end to end today (2.22+ waits on the partition rules)."""
    sys.path.insert(0, str(Path(__file__).parent))
    nics = tmp_path / "nics.json"
    nics.write_text(json.dumps(NIC_ADDRS))
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                 "--nccl-log", str(LOGS / "nccl-2.19-2x4.log"),
                 "--nic-addrs", str(nics), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ranks"] == hand_ranks()
    assert doc["ring"]["rings"] == [list(r) for r in HAND_RINGS]
    assert doc["ring"]["nccl_version"] == "2.19" and doc["ring"]["protocol"] == "simple"
    plan = load_plan(out)
    # channel 0: 3 -> 4 and 7 -> 0 cross hosts, on NIC 0 of each (owned by ranks 0 and 4)
    assert sorted(c for c in plan.network_connections if c[2] == 0) == [(3, 4, 0), (7, 0, 0)]
    assert plan.link_of((3, 4, 0)) == (0, 4) and plan.link_of((7, 0, 0)) == (4, 0)
    assert len(plan.network_connections) == 8  # 2 of the 8 hops of each of 4 rings
    # every channel's network hops mirrored on both NICs they use: channel c's are NIC c of
    # each host (ranks c and 4 + c own them). Before, only channel 0's NICs (0, 4) were,
    # and no iteration could complete from them
    assert [m.rank for m in plan.mirrors] == [0, 1, 2, 3, 4, 5, 6, 7]
    for c in range(4):
        hops = [conn for conn in plan.network_connections if conn[2] == c]
        assert {n for conn in hops for n in plan.link_of(conn)} == {c, 4 + c}


@pytest.mark.parametrize("version", ["2.19", "2.27"])
def test_adaptive_routing_set_in_the_log_goes_into_the_plan(version, tmp_path):
    """NCCL prints every parameter read from the environment ("NCCL_IB_ADAPTIVE_ROUTING set by
    environment to 1.", misc/param.cc:75@v2.19.4-1): the plan's ring then says so, and ckptd
    reads its sends as RDMA WRITE + 0-byte WRITE_WITH_IMM; without the line it stays unset."""
    sys.path.insert(0, str(Path(__file__).parent))
    nics = tmp_path / "nics.json"
    nics.write_text(json.dumps(NIC_ADDRS))
    text = log(version)
    line = next(x for x in text.splitlines() if "NCCL_ALGO set by environment" in x)
    prefix = line[:line.index("NCCL INFO ") + len("NCCL INFO ")]
    edited = text.replace(line, line + f"\n{prefix}NCCL_IB_ADAPTIVE_ROUTING set by environment to 1."
                                       f"\n{prefix}NCCL_IB_AR_THRESHOLD set by environment to 16384.")
    for name, body, ar, threshold in [("on", edited, True, 16384), ("unset", text, None, 8192)]:
        (tmp_path / f"{name}.log").write_text(body)
        out = tmp_path / f"{name}.json"
        assert main(["plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                     "--nccl-log", str(tmp_path / f"{name}.log"), "--nic-addrs", str(nics), "--out", str(out)]) == 0
        ring = load_plan(out).ring
        assert (ring.adaptive_routing, ring.ar_threshold, ring.ar_writes) == (ar, threshold, bool(ar))
    bad = text.replace(line, line + f"\n{prefix}NCCL_IB_AR_THRESHOLD set by environment to lots.")
    with pytest.raises(NcclLogError, match="NCCL_IB_AR_THRESHOLD='lots' is not an integer"):
        ring_topology(parse_nccl_log(bad, version), NIC_ADDRS)


@pytest.mark.parametrize("edit, cause, fix", [
    (lambda t: t.replace("NCCL_ALGO set by environment to Ring", "NCCL_ALGO set by environment to Tree,Ring"),
     "Tree", "NCCL_ALGO=Ring"),
    (lambda t: "\n".join(x for x in t.splitlines() if "NCCL_ALGO set" not in x), "Tree", "NCCL_ALGO=Ring"),
    (lambda t: t.replace("NCCL_ALGO set by environment to Ring", "NCCL_ALGO set by environment to ^Tree")
     .replace("0 nvls channels", "16 nvls channels"), "NVLS", "NCCL_ALGO=Ring"),
    (lambda t: t.replace("NCCL_ALGO set by environment to Ring", "NCCL_ALGO set by environment to ^Tree")
     .replace("NCCL_PROTO set by environment to Simple",
              "NCCL_PROTO set by environment to Simple\ndgx-a07:1:1 [0] NCCL INFO NCCL_COLLNET_ENABLE set by environment to 1."),
     "CollNetDirect/CollNetChain", "NCCL_ALGO=Ring"),
    (lambda t: t.replace("NCCL_PROTO set by environment to Simple", "NCCL_PROTO set by environment to LL,Simple"),
     "LL/Simple", "NCCL_PROTO=Simple"),
])
def test_log_asking_for_another_algorithm_is_refused(edit, cause, fix, tmp_path, capsys):
    text = edit(log("2.27"))
    with pytest.raises(CollectiveRefused, match=cause):
        ring_topology(parse_nccl_log(text), NIC_ADDRS)
    f = tmp_path / "job.log"
    f.write_text(text)
    nics = tmp_path / "nics.json"
    nics.write_text(json.dumps(NIC_ADDRS))
    sys.path.insert(0, str(Path(__file__).parent))
    assert main(["plan", "--model", "test_cli:build_model", "--nccl-log", str(f), "--nic-addrs", str(nics),
                 "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and cause in err and fix in err
    assert not (tmp_path / "p.json").exists()


def test_incomplete_logs_name_what_is_missing():
    text = log("2.27")
    no_send = "\n".join(x for x in text.splitlines() if "3[3] -> 4[0] [send]" not in x)
    with pytest.raises(NcclLogError, match=r"channel 0 hop 3 -> 4 .*\[send\] via NET"):
        ring_topology(parse_nccl_log(no_send), NIC_ADDRS)
    with pytest.raises(NcclLogError, match="NET device 3 of host dgx-a08"):
        ring_topology(parse_nccl_log(text), {**NIC_ADDRS, "dgx-a08": NIC_ADDRS["dgx-a08"][:3]})
    wrong_local = text.replace("nNodes 2 localRanks 4 localRank 1", "nNodes 2 localRanks 3 localRank 1")
    with pytest.raises(NcclLogError, match="rank 1 says localRanks 3, but 4 ranks"):
        ring_topology(parse_nccl_log(wrong_local), NIC_ADDRS)
    two = text + text.replace("Channel 01/04 : 0 5 6 7 4 1 2 3", "Channel 01/04 : 0 1 2 3 4 5 6 7")
    with pytest.raises(NcclLogError, match="several communicators"):
        parse_nccl_log(two)


def test_cut_ring_lines_are_rebuilt_from_ring_graph_lines():
    """NCCL cuts a ring line at 128 characters (rings.cc:27@v2.27.5-1); every rank's
    'Ring NN : prev -> rank -> next' line (NCCL_GRAPH) gives the ring back."""
    lines = []
    for raw in log("2.27").splitlines():
        if " NCCL INFO Channel 00/04 :" in raw:
            raw = raw[:raw.index(":", raw.index("Channel")) + 6] + " ..."
        lines.append(raw)
    host = {r: ("dgx-a07", "dgx-a08")[r // 4] for r in range(8)}
    ring = HAND_RINGS[0]
    for i, r in enumerate(ring):
        lines.append(f"{host[r]}:1:1 [{r % 4}] NCCL INFO Ring 00 : {ring[i - 1]} -> {r} -> {ring[(i + 1) % 8]}")
    topo = ring_topology(parse_nccl_log("\n".join(lines)), NIC_ADDRS)
    assert topo.rings == HAND_RINGS


def test_nccl_list_syntax():
    """src/graph/tuning.cc:53 parseList@v2.27.5-1: function prefixes, ^ negation."""
    algos = ("Tree", "Ring", "NVLS")
    assert enabled(None, algos) == {"Tree", "Ring", "NVLS"}
    assert enabled("ring", algos) == {"Ring"}
    assert enabled("^tree", algos) == {"Ring", "NVLS"}
    assert enabled("tree;allreduce:ring", algos) == {"Ring"}
    assert enabled("ring;broadcast:tree", algos) == {"Ring"}
    assert enabled("tree;broadcast:ring", algos) == {"Tree"}
    with pytest.raises(CollectiveRefused, match="unknown name 'rign'"):
        enabled("rign", algos)


def test_a_job_split_over_several_logs_reads_as_one_and_errors_name_their_file(tmp_path, capsys):
    """`--nccl-log` given once per host's log: the logs are read one by one into the same
    job (the plan is the one the whole log gives, even where a file does not end in a
    newline), and an error names the file it is in and the line within that file."""
    sys.path.insert(0, str(Path(__file__).parent))
    nics = tmp_path / "nics.json"
    nics.write_text(json.dumps(NIC_ADDRS))
    lines = log("2.19").splitlines()
    half = len(lines) // 2
    first, second = tmp_path / "host0.log", tmp_path / "host1.log"
    first.write_text("\n".join(lines[:half]))  # no newline at its end
    second.write_text("\n".join(lines[half:]) + "\n")
    args = ["plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch", "--nic-addrs", str(nics)]
    assert main(args + ["--nccl-log", str(LOGS / "nccl-2.19-2x4.log"), "--out", str(tmp_path / "whole.json")]) == 0
    assert main(args + ["--nccl-log", str(first), "--nccl-log", str(second), "--out", str(tmp_path / "split.json")]) == 0
    assert json.loads((tmp_path / "split.json").read_text()) == json.loads((tmp_path / "whole.json").read_text())
    capsys.readouterr()
    bad = lines[half:]
    prefix = bad[2][:bad[2].index("NCCL INFO ") + len("NCCL INFO ")]
    bad[2] = prefix + "Channel 00/04 : 0 1" + "2" * 40  # a 41-digit rank: no line NCCL prints
    second.write_text("\n".join(bad) + "\n")
    out = tmp_path / "bad.json"
    assert main(args + ["--nccl-log", str(first), "--nccl-log", str(second), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {second}:3: ") and "\n" not in err and not out.exists(), err
    assert main(args + ["--nccl-log", str(tmp_path / "absent.log"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --nccl-log {tmp_path / 'absent.log'}: No such file or directory", err
    # the log gives the rings, protocol and version: an option that says otherwise was dropped
    for opt in (["--channels", "8"], ["--protocol", "ll"], ["--nccl-version", "2.27"]):
        assert main(args + ["--nccl-log", str(LOGS / "nccl-2.19-2x4.log"), *opt, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --nccl-log gives the rings, the protocol and the NCCL version: leave out {opt[0]}"
        assert not out.exists()


def _plan_from(tmp_path, text: str, name: str, *extra) -> tuple[int, str]:
    nics = tmp_path / "nics.json"
    nics.write_text(json.dumps(NIC_ADDRS))
    (tmp_path / f"{name}.log").write_text(text)
    sys.path.insert(0, str(Path(__file__).parent))
    return main(["plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                 "--nccl-log", str(tmp_path / f"{name}.log"), "--nic-addrs", str(nics),
                 "--out", str(tmp_path / f"{name}.json"), *extra]), str(tmp_path / f"{name}.log")


def _with_settings(text: str, *settings: str) -> str:
    line = next(x for x in text.splitlines() if "NCCL_ALGO set by environment" in x)
    prefix = line[:line.index("NCCL INFO ") + len("NCCL INFO ")]
    return text.replace(line, line + "".join(f"\n{prefix}{s} set by environment to {v}."
                                             for s, v in (x.split("=") for x in settings)))


def test_settings_that_cut_the_messages_differently_go_from_the_log_into_the_plan(tmp_path, capsys):
    """NCCL prints every parameter the environment sets: NCCL_BUFFSIZE, NCCL_NTHREADS,
    NCCL_IB_QPS_PER_CONNECTION and NCCL_IB_SPLIT_DATA_ON_QPS each change the messages
    on the wire (chunk sizes, QPs), and the plan's ring now says what the log does
    (before, they were dropped: a plan of 4 MiB chunks and one QP for a job of 1 MiB
    chunks on 4 QPs). NCCL_LL128_NTHREADS, which a plan cannot say, is refused with
    LL128, and a value that is no number is named."""
    text = _with_settings(log("2.27"), "NCCL_BUFFSIZE=1048576", "NCCL_NTHREADS=256",
                          "NCCL_IB_QPS_PER_CONNECTION=4", "NCCL_IB_SPLIT_DATA_ON_QPS=1")
    rc, _ = _plan_from(tmp_path, text, "set")
    assert rc == 0, capsys.readouterr().err
    ring = load_plan(tmp_path / "set.json").ring
    assert (ring.buffsize, ring.max_threads, ring.qps_per_connection, ring.split_data_on_qps) == \
        (1048576, 256, 4, True)
    rc, _ = _plan_from(tmp_path, log("2.27"), "unset")
    assert rc == 0
    ring = load_plan(tmp_path / "unset.json").ring
    assert (ring.buffsize, ring.max_threads, ring.qps_per_connection) == (None, 512, 1)
    ll128 = _with_settings(log("2.27").replace("NCCL_PROTO set by environment to Simple",
                                               "NCCL_PROTO set by environment to LL128"), "NCCL_LL128_NTHREADS=320")
    with pytest.raises(NcclLogError, match="NCCL_LL128_NTHREADS=320"):
        ring_topology(parse_nccl_log(ll128, "x.log"), NIC_ADDRS, "x.log")
    with pytest.raises(NcclLogError, match="NCCL_BUFFSIZE='4M' is not an integer"):
        ring_topology(parse_nccl_log(_with_settings(log("2.27"), "NCCL_BUFFSIZE=4M"), "x.log"), NIC_ADDRS, "x.log")


@pytest.mark.parametrize("launcher", ["[default0]:", "[default3]:", "0: ", "12: ", "[1,0]<stdout>:"])
def test_a_launchers_prefix_on_every_line_reads_as_the_bare_log(launcher):
    """torchrun (--tee, or its console with --log-dir) puts "[default0]:" before every
    line, srun -l "0: ", mpirun --tag-output "[1,0]<stdout>:": the log was refused as
    lacking its Init COMPLETE lines."""
    text = "\n".join(launcher + x for x in log("2.27").splitlines())
    topo = ring_topology(parse_nccl_log(text, "prefixed.log"), NIC_ADDRS, "prefixed.log")
    assert topo == ring_topology(parse_nccl_log(log("2.27"), "bare.log"), NIC_ADDRS, "bare.log")


def test_a_log_of_tcp_sockets_or_a_native_infiniband_link_is_refused(tmp_path, capsys):
    """NET/Socket is NCCL's TCP transport and a NET/IB device on an InfiniBand link layer
    ("mlx5_0:1/IB") carries no UDP/IP: neither is RoCEv2 on an Ethernet mirror port,
    and both were taken as RoCE (a plan whose captures could never match)."""
    socket = log("2.27").replace("via NET/IB/", "via NET/Socket/")
    rc, path = _plan_from(tmp_path, socket, "socket")
    err = capsys.readouterr().err
    assert rc == 2 and "NET/Socket" in err and "TCP" in err and path in err, err
    native = log("2.27").replace("mlx5_0:1/RoCE", "mlx5_0:1/IB")
    rc, path = _plan_from(tmp_path, native, "native")
    err = capsys.readouterr().err
    assert rc == 2 and "InfiniBand link layer" in err and "device 0 of dgx-a07" in err and path in err, err


def test_an_nccl_version_ckptd_does_not_decode_is_named_with_the_log(tmp_path, capsys):
    text = re.sub(r"NCCL version 2\.27\.5", "NCCL version 2.12.12", log("2.27"))
    rc, path = _plan_from(tmp_path, text, "old")
    err = capsys.readouterr().err
    assert rc == 2 and f"--nccl-log {path}:" in err and "2.12" in err, err


@pytest.mark.parametrize("name, text, message", [
    ("twice.yaml", "h1: [10.0.0.1]\nh1: [10.0.0.2]\n", "key 'h1' given twice"),
    ("twice.json", '{"h1": ["10.0.0.1"], "h1": ["10.0.0.2"]}', "key 'h1' given twice"),
    ("same.yaml", "h1: [10.0.0.1, 10.0.0.1]\n", r"\[1\] 10.0.0.1 is also host 'h1''s \[0\]"),
    ("shared.yaml", "h1: [10.0.0.1]\nh2: [10.0.0.1]\n", r"host 'h2': NIC address \[0\] 10.0.0.1 is also host 'h1'"),
    ("mixed.yaml", "h1: [10.0.0.1]\nh2: ['fd00::2']\n", "both IPv4 and IPv6"),
    ("zone.yaml", "h1: ['fe80::1%eth0']\n", r"has a zone \(%eth0\)"),
])
def test_nic_addresses_that_name_no_one_nic_each_are_refused(tmp_path, name, text, message):
    """Each NIC address names one NIC (the plan tells ranks and channels apart by it),
    of the one IP family the job's GIDs use, as packets carry it: a host given twice
    (the last list silently won), one address for two NICs, v4 beside v6, or a zone id
    were all taken."""
    from ckptd.tools.nccl_log import load_nic_addrs
    (tmp_path / name).write_text(text)
    with pytest.raises(NcclLogError, match=message):
        load_nic_addrs(str(tmp_path / name))
    assert load_nic_addrs(str(tmp_path / "ok.yaml") if (tmp_path / "ok.yaml").write_text(
        "h1: [10.0.0.1, 10.0.1.1]\nh2: [10.0.0.2, 10.0.1.2]\n") else "") == \
        {"h1": ["10.0.0.1", "10.0.1.1"], "h2": ["10.0.0.2", "10.0.1.2"]}
