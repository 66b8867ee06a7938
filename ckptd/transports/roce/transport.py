"""NCCL over RoCEv2 as a Transport: decode each frame (parsers.roce), place it (Extractor)."""
from __future__ import annotations

from collections import Counter

from parsers.frame import CapturedFrame
from parsers.roce import FrameClass, decode_frame

from ckptd.transports.base import Placement
from ckptd.transports.roce.extract import Extractor
from ckptd.transports.roce.flows import ACK, Packet, carries_data


def decode_roce(cfg, stream: int, fr: CapturedFrame, classes: Counter) -> Packet | None:
    """A RoCE RDMA-write packet or ACK with an intact ICRC; the rest is counted by class."""
    f = decode_frame(fr.data, fr.linktype, fr.origlen)
    classes[f.cls.value] += 1
    fault = f.tunnel_fault
    if fault:  # of the "other" frames, those a mirror tunnel lost (ckptd.core.streams.stream_faults)
        classes[fault] += 1
    if f.cls is FrameClass.ROCE_ACK and f.bth.opcode == ACK:
        return Packet(stream, fr.index, str(f.src), str(f.dst), f.bth.dest_qp, ACK,
                      f.bth.psn, None, None, memoryview(b""), f.udp.sport)
    if f.cls is not FrameClass.ROCE_DATA:
        return None
    if not carries_data(cfg, f.bth.opcode, f.reth.dma_len if f.reth is not None else None):
        classes["other_roce"] += 1  # clear-to-send writes, sends, reads, UD
        return None
    return Packet(stream, fr.index, str(f.src), str(f.dst), f.bth.dest_qp, f.bth.opcode,
                  f.bth.psn, f.reth.dma_len if f.reth is not None else None,
                  f.immdt.raw if f.immdt is not None else None,
                  memoryview(f.data)[f.payload_offset:f.payload_offset + f.payload_len],
                  f.udp.sport)


# where every flow was first seen inside the job and some broke the schedule (suspects, cmd_replay)
MID_JOB = ("every flow was first seen after the job's first iteration had begun: the capture began mid-job; "
           "replay with --join (or --join-from N), which places each flow by its PSNs from where NCCL connected it")


class RoceTransport(Extractor):
    """The Transport for NCCL over RoCEv2 (see ckptd.transports.base)."""

    name = "roce"

    def feed_frame(self, stream: int, fr: CapturedFrame, classes: Counter) -> list[Placement]:
        pkt = decode_roce(self.cfg, stream, fr, classes)
        return self.feed(pkt) if pkt is not None else []

    def diagnostics(self) -> list[str]:
        return ([f"unmatched flow: {e}" for e in self.unmatched_flows()]
                + [f"unseen port: {e}" for e in self.binder.unseen_ports()])

    def suspects(self) -> list[str]:
        off = sorted(self.binder.off_ring)
        # data between the job's own ports on links its ring does not have: while other
        # links bind, nothing else says so (the flows are only counted as unrelated)
        off_ring = [f"off-ring data: RDMA writes between ports of the job that are neighbours in no channel of "
                    f"the plan's ring ({self.binder.link_names(off)}): its ring.rings or ranks[].addr may "
                    "not be the job's (or the job also runs Tree/NVLS traffic)"] if off else []
        mtu = self.wire_mtu()
        return off_ring + ([f"path MTU: {mtu}"] if mtu else []) + \
            [f"unknown address: {e}" for e in self.binder.strangers_in_place()] + \
            ([f"mid-job: packets broke the schedule, and {MID_JOB}"] if self.began_mid_job() else [])

    def wire_mtu(self) -> str | None:
        return self.binder.wire_mtu()

    def began_mid_job(self) -> bool:
        return self.binder.began_inside()

    def unmatched_flows(self) -> list[str]:
        return list(self.binder.errors)

    def join_unbound(self) -> list[str]:
        return self.binder.unbound_links()

    def join_iteration(self, force: bool = False) -> int | None:
        """The first training iteration every flow was seen from its start: the first
        whose first wire round is at or after the binder's first whole round."""
        r = self.binder.join_iteration(force=force)
        return None if r is None else -(-r // self.plan.allreduces_per_step)
