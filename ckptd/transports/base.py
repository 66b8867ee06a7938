"""The transport interface: what the pipeline asks of the stage that turns frames into
gradient placements. NCCL over RoCEv2 (ckptd.transports.roce) and gloo over TCP
(ckptd.transports.gloo) are the two implementations; the schedule, merge, shadow model
and checkpoints after them are shared.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from parsers.frame import CapturedFrame

MAX_EXAMPLES = 20  # rejected-packet examples a transport keeps for the report


@dataclass
class Placement:
    """Bytes of one bucket of one iteration, as one mirror stream delivered them."""
    stream: int
    iteration: int  # wire iteration (0: the communicator's first allreduces)
    phase: int  # schedule.RS (partial sums) or schedule.AG (final values)
    bucket: int
    start: int  # first element within the bucket
    raw: bytes  # little-endian element bytes
    sender: int  # rank that sent it
    ring_step: int  # 0: the sender's own values (first reduce-scatter send of a loop)


@runtime_checkable
class Transport(Protocol):
    """Decode + place. `counters` counts what happened to every frame by reason,
    `examples` keeps a few rejected packets in words, and `done` is set by the pipeline
    to the newest finalized wire iteration (so a transport can forget state for it)."""

    name: str
    counters: Counter
    examples: list[str]
    done: int

    def feed_frame(self, stream: int, fr: CapturedFrame, classes: Counter) -> list[Placement]:
        """Every placement this frame (and whatever it releases) yields; frames that
        carry no collective data are counted in `classes` (per stream)."""

    def flush(self) -> list[Placement]:
        """End of input: place whatever was held back waiting for more evidence."""

    def idle(self) -> list[Placement]:
        """The capture has been quiet for a while (a paused or dead job): place what was
        held back only for want of later traffic, keeping state for traffic to come."""

    def stream_loss(self, stream: int, iteration: int) -> float | None:
        """Share of the iteration's data this stream should have carried and did not;
        None if it carried none."""

    def diagnostics(self) -> list[str]:
        """One line each for flows or connections the transport could not explain."""

    def suspects(self) -> list[str]:
        """One line each for traffic that may explain lost iterations (a plan of another
        ring, a rank at another address); shown only where iterations were lost, since a
        job may also carry such traffic for reasons of its own (p2p sends, storage)."""
        return []

    def unmatched_flows(self) -> list[str]:
        """The flows (one line each, among the diagnostics) that no connection of the plan
        explains."""

    def join_iteration(self, force: bool = False) -> int | None:
        """Joining a running job: the first wire iteration every flow shows whole, once
        known (force: with the flows bound so far). Transports that cannot join refuse
        at construction."""

    def forget_before(self, iteration: int) -> None:
        """Joining: drop every state kept for wire iterations before this one."""

    # -- what one transport can tell and the other cannot: these defaults say nothing --
    def join_unbound(self) -> list[str]:
        """Joining: where flows of the job were not yet seen (one name each) when the join
        was taken without them (forced, FINALIZE_LAG iterations on): the joined iteration
        may lack their packets from before the capture saw them."""
        return []

    # Whether each stream's copy of the data becomes a placement of its own (RoCE), so
    # the pipeline can tell from placements how far a stream's copies have come; gloo
    # compares copies in its reassembler and places the bytes once.
    places_every_copy = False

    def copies_conflict(self, iteration: int) -> tuple[int, int, str] | None:
        """Where mirror copies of `iteration`'s gradient bytes disagreed, found by the
        transport itself (gloo's reassembler): (bucket, stream whose copy differed, where);
        else None. RoCE's copies are compared where they are placed (IterationAssembly)."""
        return None

    def buffers_conflict(self, iteration: int) -> str | None:
        """Where copies of DDP's broadcast of the module buffers after `iteration`
        disagreed, or None."""
        return None

    def layout_conflict(self, iteration: int) -> str | None:
        """Where copies of what `iteration`'s bucket layout was learned from disagreed
        (gloo: DDP's rebuilt-bucket broadcast, with a plan that says learn), or None."""
        return None

    def why_unplaced(self, iteration: int) -> str | None:
        """Why nothing (more) of training iteration `iteration` can be placed (gloo: a
        capture gap hid whole collectives), or None."""
        return None

    def unplaced_from(self) -> int | None:
        """The first training iteration why_unplaced speaks of, or None."""
        return None

    def wire_mtu(self) -> str | None:
        """Where the unplaced traffic shows another path MTU than the plan's, or None."""
        return None

    def began_mid_job(self) -> bool:
        """Whether the capture began after the job had, without --join (every flow first
        seen inside the job, and some broke the schedule)."""
        return False
