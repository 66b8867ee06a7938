"""`ckptd mirror-risk`: how often an iteration's gradients cannot be completed.

The model and its formula are in MODEL (also the command's --help and docs/MIRRORS.md).
`--simulate` checks this by Monte Carlo through the real merge code: one stream per
mirrored link places every packet it did not lose into a ckptd.core.assemble
IterationAssembly, and the iteration counts as failed when `.complete` is False.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from ckptd.core.plan import MAX_RANKS

MODEL = """\
Model (the setting of the FlowCheck paper's Eq. 2, derived here from the ring schedule):

  * A ring of N ranks; M distinct directed links of it are mirrored (M is capped at
    N: a ring has N directed links; at H with H multi-GPU nodes, see below).  Each
    mirrored link reaches its own stream.
  * In allgather the link s -> next(s) carries the final value of every chunk except
    next(s)'s (ckptd.core.schedule.ring_steps).  So of the N chunks, a chunk whose owner is
    the receiving end of a mirrored link is carried by M-1 mirrored links, the others
    by M.  With M < N distinct links there are exactly M chunks of the first kind
    (distinct links have distinct receivers), whether the links are consecutive or
    not; with M = N all N chunks have N-1 copies.
  * Each mirrored link carries K allgather packets per iteration (all channels
    together), so each chunk it carries is P = K/(N-1) packets on it, at the same
    positions on every link (the chunk is cut into packets the same way everywhere).
  * Every mirrored copy of a packet is lost independently with probability p (the
    mirror port's drop rate), on every stream independently of the others.  Real
    drops come in bursts, which packs them into fewer iterations, and streams fed
    by the same ring at the same moments may drop together: read the result as the
    estimate for spread-out, uncorrelated loss.
  * A packet position with c copies is lost only if all c copies are: p^c.  The
    iteration fails if any position of any chunk is lost:

        P_fail = 1 - prod_chunks (1 - p^c_chunk)^P
               = 1 - (1 - p^(M-1))^(M*P) * (1 - p^M)^((N-M)*P)      M < N
               = 1 - (1 - p^(N-1))^(N*P)                             M >= N

    M = 1 gives P_fail = 1 (the chunk of the link's receiving rank never crosses
    it), p = 0 gives 0 for M >= 2.  Expected iterations between failures: 1 / P_fail
    (the wait for a geometric event).

Multi-GPU nodes (--nodes H, or a plan with nodes): only the ring's H hops between
nodes reach a switch; the others run over NVLink/PCIe. M is then capped at H, and the
copies are counted over those H links: the same rule (a chunk misses the link into
its owner) gives M-1 copies to the M chunks owned by receiving ends and M to the
other N-M chunks, so mirroring all H links leaves H chunks with H-1 copies, however
many GPUs a node has: nodes of different sizes (N not a multiple of H) give the same
result as even ones (--ring/--nodes takes node r*H//N for rank r). A plan whose ring
enters a node more than once has more hops than nodes: H is then its hops; one whose
rings differ in their number of hops is refused. --nodes with --plan must name the
plan's nodes (on one-GPU hosts, its ranks): the plan says where every rank runs, so a
different count is a mistake in one of them, refused rather than one silently winning.

Merged NICs (--ports P, or a plan whose ranks list ports): NCCL stripes each
connection's QPs over the P ports (QP q on port q % P at both ends), so a link is P
port pairs, each carrying its share of every chunk's packets. A link counts as mirrored
only when all P of its ports are: M links take M*P mirror sessions. The formula is the
same (a packet position is lost when every copy of it is).
"""

ELEMS_PER_PACKET = 2   # the simulation's packets: small, since only coverage matters


def mirrorable_links(n: int, nodes: int | None = None) -> list[tuple[int, int]]:
    """The directed links of the ring 0 > 1 > ... > n-1 that can be mirrored: all of
    them on one-GPU hosts; with `nodes` nodes of consecutive ranks, the hop out of
    each node into the next (ckptd.core.schedule.network_connections)."""
    if not nodes or nodes >= n:
        return [(s, (s + 1) % n) for s in range(n)]
    node = [r * nodes // n for r in range(n)]
    return [(s, (s + 1) % n) for s in range(n) if node[s] != node[(s + 1) % n]]


def mirrored_links(n: int, m: int, nodes: int | None = None) -> list[tuple[int, int]]:
    """M distinct mirrorable links (capped at how many there are), consecutive ones first."""
    return mirrorable_links(n, nodes)[:m]


def _ring(n: int):
    from ckptd.core.schedule import RingConfig
    return RingConfig(nranks=n, rings=(tuple(range(n)),))


# Reading a link's chunks off the schedule costs O(N) time and memory per link, and
# ckptd.core.schedule.ring_steps caches every ring position it is asked about: past this
# many (link, chunk) pairs the chunks come from the rule the schedule shows (a link
# s -> d carries every chunk but d's; test_risk checks the two agree) instead, so that
# --ring 65536 --mirrors 65536 takes O(N), not 4e9 steps and tens of GB.
MAX_SCHEDULE_READ = 1 << 18


def _by_rule(n: int, links: list[tuple[int, int]]) -> bool:
    """Past MAX_SCHEDULE_READ (link, chunk) pairs the chunks come from the rule, not the schedule."""
    return n * len(links) > MAX_SCHEDULE_READ


def carried_chunks(n: int, links: list[tuple[int, int]]) -> list[list[int]]:
    """The chunks (owner ranks) each link carries in allgather, sorted."""
    if _by_rule(n, links):
        return [[k for k in range(n) if k != d] for _, d in links]
    from switch_config.select import link_chunks
    ring = _ring(n)
    return [sorted(link_chunks(ring, 0, s)) for s, _ in links]


def chunk_copies(n: int, m: int, nodes: int | None = None) -> list[int]:
    """How many mirrored links carry each chunk's final value (chunk k = rank k's),
    read off the ring schedule rather than assumed (up to MAX_SCHEDULE_READ)."""
    links = mirrored_links(n, m, nodes)
    if _by_rule(n, links):  # every link carries all chunks but its receiver's
        copies = [len(links)] * n
        for _, d in links:
            copies[d] -= 1
        return copies
    copies = [0] * n
    for chunks in carried_chunks(n, links):
        for owner in chunks:
            copies[owner] += 1
    return copies


def failure_probability(n: int, m: int, p: float, k: float, nodes: int | None = None) -> float:
    """P(an iteration cannot be completed) for the model in this module's docstring."""
    per_chunk = k / (n - 1)
    # Summed in log space: for small p, (1 - p^c)^P is 1 - tiny, and 1 - prod would
    # lose every digit; log1p/expm1 keep them.
    log_ok = 0.0
    for c in chunk_copies(n, m, nodes):
        q = p ** c            # 0**0 == 1: a chunk no mirrored link carries is always lost
        if q >= 1.0:
            return 1.0
        log_ok += per_chunk * math.log1p(-q)
    return -math.expm1(log_ok) + 0.0   # + 0.0: never print P = -0


def _sim_per_chunk(n: int, k: float) -> int:
    """Packets per chunk in a simulation of K per link: whole, at least 1. run() sizes --simulate
    by it and check() simulates it, so the two must agree."""
    return max(1, round(k / (n - 1)))


def simulate(n: int, m: int, p: float, per_chunk: int, trials: int, seed: int = 0,
             nodes: int | None = None) -> int:
    """Failed iterations out of `trials`, through ckptd.core.assemble.IterationAssembly."""
    from ckptd.core.assemble import IterationAssembly
    from ckptd.core.schedule import Bucket

    links = mirrored_links(n, m, nodes)
    carried = carried_chunks(n, links)
    count = n * per_chunk * ELEMS_PER_PACKET
    bucket = Bucket(count, np.dtype(np.float32))
    raw = np.arange(count, dtype="<f4").tobytes()    # every copy of a packet is identical
    width = ELEMS_PER_PACKET * 4
    rng = np.random.default_rng(seed)
    failed = 0
    for _ in range(trials):
        asm = IterationAssembly(0, [bucket], len(links))
        lost = rng.random((len(links), n, per_chunk)) < p
        for j, chunks in enumerate(carried):
            for k in chunks:
                for i in np.flatnonzero(~lost[j, k]):
                    pos = (k * per_chunk + int(i)) * ELEMS_PER_PACKET
                    asm.place(j, 0, pos, raw[pos * 4:pos * 4 + width])
        failed += not asm.complete
    return failed


def packets_from_plan(path: str) -> tuple[int, float, int | None, int]:
    """(N, K, H, P) from a plan's own schedule (iteration 1's bucket layout): K is the
    mean, over the ring positions that can be mirrored, of the allgather packets one
    such link carries per iteration on all channels and QPs (one-GPU hosts: what
    mirroring a rank's port RX sees); H the hops between nodes per ring (None on
    one-GPU hosts); P the ports of each merged NIC (ring.ndevs). Empty Simple slices (0-byte writes) count as packets; they carry
    no gradient, so K is a slight overestimate for Simple."""
    t = plan_topology(path)
    return t["ranks"], t["packets"], t["hops"], t["ports"]


def plan_topology(path: str) -> dict:
    """packets_from_plan's N, K, H and P as ranks, packets, hops and ports, and the
    plan's nodes (None on one-GPU hosts). H is each ring's hops between nodes, which
    is the number of nodes where every node's ranks are consecutive in the ring, and
    more where a ring enters a node twice. Rings that cross between nodes different
    numbers of times, or never, are refused (ValueError naming the plan): the model
    takes one ring of H hops."""
    from ckptd.core.plan import load_plan
    from ckptd.core.schedule import AG
    plan = load_plan(path, check_optimizer=False)  # the ring and buckets only: no torch
    wire = plan.network_connections
    per_ring = [sum(1 for (_, _, c) in wire if c == ch) for ch in range(plan.ring.channels)]
    names = plan.node_names
    if not wire:
        raise ValueError(f"{path}: every rank is on node {names[0]!r}: no hop of the ring crosses the network, "
                         "so nothing can be mirrored")
    if len(set(per_ring)) > 1:
        counts = ", ".join(f"{h} (channel {c})" for c, h in enumerate(per_ring))
        raise ValueError(f"{path}: the rings cross between nodes different numbers of times, {counts}: the model "
                         "takes rings of one number of hops; give --ring, --nodes and --packets instead")
    total = 0
    for (s, d, c, _q), flow in plan.schedule(1).flows.items():
        if (s, d, c) in wire:
            total += sum(msg.npkts for msg in flow.messages if msg.send.phase == AG)
    hops = per_ring[0]
    one_host = plan.one_host_per_rank
    return {"ranks": plan.nranks, "packets": total / hops, "hops": None if one_host else hops,
            "ports": plan.ring.ndevs, "nodes": None if one_host else len(set(names))}


# -- command ---------------------------------------------------------------------------
MAX_PACKETS = 1e15  # a link's allgather packets per iteration: ~4 EB at 4 KiB each
MAX_TRIALS = 1_000_000  # a simulated iteration walks every chunk's packets in Python
# --simulate draws one loss per packet copy, mirrored links x N x packets per chunk of
# them per iteration, and keeps the iteration's bucket (N x packets per chunk) in an
# IterationAssembly: memory is O(copies of one iteration), capped here (~10 MB), and
# every copy is placed through the merge code in Python (~20 us), so all trials
# together are capped too (a few minutes). The formula has no such limit.
MAX_SIM_ITERATION = 1 << 18
MAX_SIM_COPIES = 10_000_000


def add_subparser(subparsers) -> argparse.ArgumentParser:
    from ckptd.cli import _path  # an empty --plan read as no plan at all ("--ring N ... is needed")
    p = subparsers.add_parser(
        "mirror-risk", help="probability that an iteration cannot be recovered from M mirrors",
        description="Print the per-iteration probability that the gradients cannot be completed from "
        "M mirrored links, and the expected iterations between such failures.\n\n" + MODEL
        + "\n--simulate checks the formula by Monte Carlo through ckptd.core.assemble.IterationAssembly "
        "(the real merge code).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ring", type=int, help="N: ranks in the ring (or --plan)")
    p.add_argument("--mirrors", type=int, required=True, help="M: mirrored directed links of the ring (capped at N)")
    p.add_argument("--loss", type=float, required=True, help="p: loss probability of each mirrored packet copy")
    p.add_argument("--packets", type=float,
                   help="K: allgather packets one link carries per iteration, all channels (or --plan): "
                        "a whole number, at least N-1 (a link carries N-1 chunks, each at least one packet)")
    p.add_argument("--nodes", type=int,
                   help="H: multi-GPU nodes of consecutive ranks; only the ring's H hops between nodes can be "
                        "mirrored, so M is capped at H (default: every rank its own host; or --plan, "
                        "and with it only the plan's node count)")
    p.add_argument("--plan", type=_path, help="take N, K (and H, if the plan has multi-GPU nodes) from a plan's schedule "
                                  "(K: mean over the links that can be mirrored)")
    p.add_argument("--ports", type=int,
                   help="P: ports of each merged NIC (NCCL_IB_MERGE_NICS; or --plan; default 1): a link is "
                        "mirrored only when all P of its ports are")
    p.add_argument("--iteration-seconds", type=float, help="also give the mean time between failures")
    p.add_argument("--simulate", action="store_true",
                   help="check by Monte Carlo through the merge code (for small K: an iteration may draw at "
                        f"most {MAX_SIM_ITERATION} packet copies, mirrored links x N x K/(N-1), and all "
                        f"trials together {MAX_SIM_COPIES:.0e})")
    p.add_argument("--trials", type=int, default=2000,
                   help=f"Monte Carlo iterations (default 2000, at most {MAX_TRIALS})")
    p.add_argument("--seed", type=int, default=0, help="Monte Carlo seed, >= 0 (default 0)")
    p.add_argument("--json", action="store_true",
                   help="print the result as JSON (iterations_between_failures and seconds_between_failures "
                        "are null where no failure is expected: P_fail is 0, or the wait is past 1.8e308)")
    p.set_defaults(func=run)
    return p


def run(a) -> int:
    n, k, nodes, ports = a.ring, a.packets, a.nodes, a.ports
    node_count = nodes  # --nodes H: H nodes of consecutive ranks, H hops
    if a.plan:
        try:
            t = plan_topology(a.plan)
            n, k_plan, h_plan, p_plan = t["ranks"], t["packets"], t["hops"], t["ports"]
        except ValueError as e:
            print("error: " + " ".join(str(e).split()), file=sys.stderr)  # one line
            return 2
        if a.ring is not None and a.ring != n:  # it was dropped for the plan's, without a word
            print(f"error: --ring {a.ring} disagrees with the plan {a.plan} ({n} ranks): give one of them",
                  file=sys.stderr)
            return 2
        plan_nodes = t["nodes"] or n  # one-GPU hosts: every rank a node of its own
        if nodes is not None and nodes != plan_nodes:  # it replaced the plan's hops without a word
            where = f"{plan_nodes} nodes" if t["nodes"] else f"{n} ranks, each its own host"
            print(f"error: --nodes {nodes} disagrees with the plan {a.plan} ({where}): give one of them",
                  file=sys.stderr)
            return 2
        if ports is not None and ports != p_plan:  # it replaced the plan's without a word
            print(f"error: --ports {ports} disagrees with the plan {a.plan} ({p_plan} port(s) a NIC): give one "
                  "of them", file=sys.stderr)
            return 2
        # --packets with a plan is a what-if (another batch or model on this topology):
        # taken, and the output says it replaced the schedule's K (it did so without a word)
        packets_plan, k = k_plan, k if k is not None else k_plan
        nodes, node_count = h_plan, t["nodes"]  # the plan's hops between nodes, and (to show) its nodes
        ports = p_plan
    ports = 1 if ports is None else ports
    problems = []
    if n is None or not 2 <= n <= MAX_RANKS:
        problems.append(f"--ring N (2..{MAX_RANKS}) or --plan is needed")
    if k is None or not 1 <= k <= MAX_PACKETS:  # NaN fails this too
        problems.append(f"--packets K (1..{MAX_PACKETS:.0e}) or --plan is needed")
    elif a.packets is not None and n is not None and 2 <= n <= MAX_RANKS and (not k.is_integer() or k < n - 1):
        # a count of packets, at least one per chunk: with fewer the formula took
        # fractional packets, the simulation one, and the two disagreed
        problems.append(f"--packets K must be a whole number of packets, {n - 1}..{MAX_PACKETS:.0e} (a link of a "
                        f"ring of {n} carries {n - 1} chunks, each at least one packet), not {k:g}")
    if a.iteration_seconds is not None and not 0 < a.iteration_seconds < math.inf:
        problems.append("--iteration-seconds must be a number > 0")
    if a.mirrors < 1:
        problems.append("--mirrors must be at least 1")
    if not 0.0 <= a.loss <= 1.0:
        problems.append("--loss is a probability, 0..1")
    if not 1 <= ports <= 4:
        problems.append("--ports must be 1..4 (NCCL_IB_MAX_DEVS_PER_NIC)")
    if a.simulate and not 1 <= a.trials <= MAX_TRIALS:
        problems.append(f"--trials must be 1..{MAX_TRIALS}")
    if a.simulate and a.seed < 0:
        problems.append(f"--seed must be >= 0 (numpy's generators take no negative seed), not {a.seed}")
    if a.simulate and not problems:
        links = min(a.mirrors, len(mirrorable_links(n, nodes)))
        per_chunk = _sim_per_chunk(n, k)
        copies = links * n * per_chunk
        if copies > MAX_SIM_ITERATION:
            problems.append(f"--simulate with --packets {k:g}: one simulated iteration would draw {copies:.3g} "
                            f"packet copies ({links} mirrored links x {n} chunks x {per_chunk} packets), more "
                            f"than {MAX_SIM_ITERATION} (its memory and time grow with them); simulate a "
                            "smaller --packets (the formula holds for any K) or drop --simulate")
        elif copies * a.trials > MAX_SIM_COPIES:
            problems.append(f"--simulate: --trials {a.trials} x {copies} packet copies an iteration is "
                            f"{copies * a.trials:.3g}, more than {MAX_SIM_COPIES:.0e} (~20 us each through "
                            "the merge code); lower --trials or --packets")
    if nodes is not None and n is not None and not 2 <= nodes <= n:
        problems.append(f"--nodes must be 2..N ({n}): a ring inside one node never reaches a switch")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    res = evaluate(n, a.mirrors, a.loss, k, a.iteration_seconds, nodes, ports, node_count)
    if a.plan and a.packets is not None:
        res["packets_of_plan"] = packets_plan
    if a.simulate:
        res["simulation"] = check(n, a.mirrors, a.loss, k, a.trials, a.seed, nodes)
    print(json.dumps(res, indent=1) if a.json else format_result(res))
    return 0


def evaluate(n: int, m: int, p: float, k: float, iteration_seconds: float | None = None,
             nodes: int | None = None, ports: int = 1, node_count: int | None = None) -> dict:
    """`nodes`: the ring's hops between nodes (H); `node_count`: the nodes, where a plan's
    ring enters a node more than once (default H)."""
    mirrorable = len(mirrorable_links(n, nodes))
    m_eff = min(m, mirrorable)
    copies = chunk_copies(n, m, nodes)
    pf = failure_probability(n, m, p, k, nodes)
    res = {"ranks": n, "nodes": node_count if node_count is not None else nodes, "mirrorable_links": mirrorable, "mirrors": m, "mirrored_links": m_eff,
           "ports_per_nic": ports, "mirror_ports": m_eff * ports, "loss": p, "packets_per_link": k,
           "packets_per_chunk": k / (n - 1),
           "chunks_by_copies": {str(c): copies.count(c) for c in sorted(set(copies))},
           "p_fail": pf, "iterations_between_failures": _finite(1.0 / pf if pf > 0 else math.inf)}
    if iteration_seconds:
        ibf = res["iterations_between_failures"]
        res["seconds_between_failures"] = None if ibf is None else _finite(ibf * iteration_seconds)
    return res


def _finite(x: float) -> float | None:
    """None for a wait with no end (P_fail 0) or past the float range: JSON has no Infinity."""
    return x if math.isfinite(x) else None


def _wait(x: float | None, p_fail: float, scale: float = 1.0, unit: str = "") -> str:
    if x is None:
        return "never" if p_fail == 0 else f"more than {sys.float_info.max / scale:.2g}{unit} (never, in practice)"
    return f"{x / scale:.6g}{unit}"


def check(n: int, m: int, p: float, k: float, trials: int, seed: int, nodes: int | None = None) -> dict:
    """Monte Carlo with a whole number of packets per chunk, and the formula at that K."""
    per_chunk = _sim_per_chunk(n, k)
    k_sim = per_chunk * (n - 1)
    failed = simulate(n, m, p, per_chunk, trials, seed, nodes)
    rate = failed / trials
    expect = failure_probability(n, m, p, k_sim, nodes)
    se = math.sqrt(expect * (1 - expect) / trials)
    z = (rate - expect) / se if se > 0 else (0.0 if rate == expect else math.inf)
    return {"trials": trials, "packets_per_chunk": per_chunk, "packets_per_link": k_sim,
            "failures": failed, "rate": rate, "analytic": expect, "stderr": se, "z": z}


def format_result(r: dict) -> str:
    n, m, p = r["ranks"], r["mirrored_links"], r["loss"]
    h = r["mirrorable_links"]
    where = f" on {r['nodes']} nodes ({h} hops between nodes can be mirrored)" if r.get("nodes") else ""
    lines = [
        f"model: ring of {n} ranks{where}, {m} mirrored directed link(s)"
        + (f" (asked {r['mirrors']}: a ring has {h} that can be)" if r["mirrors"] > h else "")
        + (f" = {r['mirror_ports']} mirrored switch ports ({r['ports_per_nic']} ports a merged NIC: "
           "a link is mirrored only with all of them)" if r.get("ports_per_nic", 1) > 1 else "")
        + f", {r['packets_per_link']:g} allgather packets per link per iteration "
          f"({r['packets_per_chunk']:g} per chunk)"
        + (f" (--packets; the plan's schedule gives {r['packets_of_plan']:g})" if "packets_of_plan" in r else "")
        + f", each mirrored copy lost independently with p={p:g}",
        "chunks by number of mirrored copies: "
        + ", ".join(f"{cnt} chunk(s) with {c}" for c, cnt in r["chunks_by_copies"].items()),
        f"P(iteration cannot be completed) = {r['p_fail']:.6g}",
        f"expected iterations between failures: {_wait(r['iterations_between_failures'], r['p_fail'])}",
    ]
    if "seconds_between_failures" in r:
        lines.append("expected time between failures: "
                     + _wait(r["seconds_between_failures"], r["p_fail"], 3600, " h"))
    s = r.get("simulation")
    if s:
        lines.append(
            f"Monte Carlo through ckptd.core.assemble.IterationAssembly: {s['failures']} of {s['trials']} "
            f"iterations incomplete = {s['rate']:.4g} +- {s['stderr']:.2g} (1 s.e.); formula at "
            f"{s['packets_per_chunk']} packet(s) per chunk: {s['analytic']:.4g} ({s['z']:+.2f} s.e.)")
    return "\n".join(lines)
