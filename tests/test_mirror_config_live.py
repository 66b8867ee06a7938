"""mirror-config's Linux output, applied for real: the rules it chooses for a job are
installed on a network-namespace bridge (switch_config.linux through pyroute2), every
host sends its synthesized frames, and each collector port captures exactly the
traffic of the ports and directions the selection says (on the interfaces the daemon
config mirror-config writes names), enough to rebuild every iteration bit-exact."""
import json
from collections import Counter

import pytest

from ckptd.testing import netlab
from ckptd.testing.netlab import NetLab
from ckptd.pipeline import ReplayOptions, replay
from ckptd.core.checkpoint import load_checkpoint
from ckptd.core.plan import Mirror, load_plan
from ckptd.live.daemon import load_config
from ckptd.live.ring import RingCapture
from parsers.pcap import read_pcap, write_pcap
from switch_config import linux, linux_render
from switch_config.cabling import load_cabling
from switch_config.daemon_interfaces import daemon_interfaces
from switch_config.select import select_mirrors

from helpers import synth

RING = dict(block_size=1 << 22, block_nr=16, retire_ms=10)


def test_selected_rules_mirror_what_the_plan_needs(tmp_path):
    reason = netlab.lab_unavailable()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    run = tmp_path / "run"
    synth(run, ranks=4, channels=2, protocol="ll", mtu=1024, mirrors=3, iterations=2,
          write_hosts=True, seed=2)
    plan = load_plan(run / "plan.json")
    frames = {r: [(f.ts_ns, f.data) for f in read_pcap(run / "hosts" / f"rank{r}.pcap")]
              for r in range(plan.nranks)}
    prefix = netlab.unique_prefix()
    try:
        with NetLab(plan, prefix=prefix) as lab:
            # Replace the lab's own mirror rules with the ones mirror-config chooses.
            for h in lab.hosts:
                linux.remove_mirrors(h.port, netns=lab.switch_ns)
            cabling = {
                "format": "ckptd-cabling", "version": 1,
                "switches": [{"name": "leaf", "os": "linux", "mode": "span", "max_sessions": 8,
                              "max_source_ports": 8, "netns": lab.switch_ns}],
                "collectors": [{"name": f"c{k}", "switch": "leaf", "port": m.port,
                                "ifname": m.capture_ifname, "netns": lab.ckpt_ns}
                               for k, m in enumerate(lab.mirrors)],
                "ranks": [{"rank": r, "switch": "leaf", "port": h.port} for r, h in enumerate(lab.hosts)],
            }
            (tmp_path / "cabling.json").write_text(json.dumps(cabling))
            sel = select_mirrors(plan.ring, load_cabling(tmp_path / "cabling.json"), links=3)
            switch = load_cabling(tmp_path / "cabling.json").switches[0]
            rules = linux_render.rules(sel, switch)
            linux_render.apply(rules, linux.add_mirror, netns=lab.switch_ns)
            installed = linux.list_mirrors(netns=lab.switch_ns)
            assert len(installed) >= len(rules)
            # capture where the daemon's interfaces that mirror-config writes say
            text, notes = daemon_interfaces(sel)
            assert notes == []
            cfg = tmp_path / "ckptd.yaml"
            cfg.write_text("plan: plan.json\ninit: init.pt\nout: out\n" + text)
            ifs = {i.name: i for i in load_config(cfg).interfaces}
            assert sorted(ifs) == [f"c{k}" for k in range(len(lab.mirrors))]
            caps = [RingCapture(ifs[f"c{k}"].ifname, netns=ifs[f"c{k}"].netns, **RING)
                    for k in range(len(lab.mirrors))]
            try:
                lab.send(frames, timing="original")
                got = [c.drain(0.2) for c in caps]
                assert all(c.stats()["drops"] == 0 for c in caps)
            finally:
                for c in caps:
                    c.close()
    finally:
        assert not netlab.down(prefix, exact=True)
    port_rank = {h.port: r for r, h in enumerate(lab.hosts)}
    for k, m in enumerate(lab.mirrors):
        mine = [(port_rank[p], d) for p, cap, d in rules if cap == m.port]
        # rx at a switch port: what that host sends; tx: what it receives
        want = Counter(f for r in frames for _, f in frames[r]
                       if any(Mirror("x", rank, "tx" if d == "rx" else "rx" if d == "tx" else "both")
                              .sees(r, plan.rank_of(_dst(f))) for rank, d in mine)
                       and _roce(f))
        assert Counter(fr.data for fr in got[k]) == want, m.port
    # and the captures rebuild the job
    paths = []
    for k, g in enumerate(got):
        paths.append(str(tmp_path / f"c{k}.pcap"))
        write_pcap(paths[-1], g)
    pipe = replay(plan, paths, load_checkpoint(run / "init.pt"),
                  ReplayOptions(reference=str(run / "reference")))
    assert [r.status for r in pipe.reports] == ["committed", "committed"]
    assert all(r.exact for r in pipe.reports)


def _dst(frame: bytes) -> str:
    return ".".join(str(b) for b in frame[30:34])


def _roce(frame: bytes) -> bool:  # what the capture filter passes (IPv4 UDP 4791)
    return frame[12:14] == b"\x08\x00" and frame[23] == 17 and frame[36:38] == b"\x12\xb7"
