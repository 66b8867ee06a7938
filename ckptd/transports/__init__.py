"""Transports: decode + place, one per kind of traffic, behind ckptd.transports.base.Transport."""
from __future__ import annotations

from ckptd.core.plan import Plan
from ckptd.errors import CkptdError
from ckptd.transports.base import MAX_EXAMPLES, Placement, Transport


def transport_for(plan: Plan, join_from: int | None = None) -> Transport:
    """The decode + place stage for the plan's transport; everything after is shared."""
    if plan.transport == "gloo":
        if join_from is not None:
            raise CkptdError("joining a running job needs PSN arithmetic: RoCE plans only "
                             "(a gloo capture must start before the job's first iteration)")
        from ckptd.transports.gloo.extract import GlooExtractor
        return GlooExtractor(plan)
    from ckptd.transports.roce.transport import RoceTransport
    return RoceTransport(plan, join_from)


__all__ = ["MAX_EXAMPLES", "Placement", "Transport", "transport_for"]
