"""Online detection at scale, simulated: the digest layer (moedoctor/runner/digest.py) on synthetic
streams shaped like a TP 8 x EP 8 x DP mesh job, with one planted desync.

Ranks: ``rank = (dp * 8 + ep) * 8 + tp``; a node holds 8 ranks (one TP group). Groups: TP (the node's
8 ranks), EP (8 ranks on 8 nodes, same dp and tp), FSDP (every rank of one tp index: N/8 ranks, one
per node; dense parameters sharded over DP x EP) and expert DP (same ep and tp: N/64 ranks). Each
step is 100 collectives per rank (ranks issue 100 collectives per second): per layer, forward:
FSDP all_gather, TP all_reduce, EP all_to_all (dispatch, combine: uneven splits that pair up, new ones
every step and layer), TP all_reduce; backward: the same plus FSDP reduce_scatter and expert-DP
reduce_scatter; then the step's small all_reduces.

Every node is its own ``NodeDigest`` and its own ``Coordinator`` (groups sharded over nodes by
``coordinator_of``); every ``period`` simulated seconds each node's messages are delivered in-process
and counted in bytes, coordinators poll, and expansion requests are answered by the nodes that hold
the ranks (one more period is counted for that round trip). Planted desyncs (``--plant``): ``extra``:
one rank issues one extra 1-element all_reduce on its FSDP group in step 1 and runs on (its later
FSDP collectives are shifted by one: no hang to help); ``hang``: the same extra collective, and every
rank stops right after it (found at the frontier, no block closes); ``split``: one rank's all_to_all
expects one more row from a peer than the peer sends (a broken split contract).

Printed per size: detection latency after the mismatching record was issued (simulated time: the
period in which the mismatch's digests arrive, plus one period for the expansion's round trip, plus
the measured wall time of the coordinator's work in that period), the digest layer's CPU per
collective (measured with ``time.process_time`` around every node's and coordinator's calls, not
around generating the streams), the supervisor CPU per node at 100 collectives per rank per second
(mean and busiest node; the busiest figure is the one on the last line), the tracker's own cost of
parsing the node's 8 trace files (measured on node 0's records written as real trace files) added,
memory (the whole simulation's peak RSS and per node), and the bytes exchanged per node per second.

    python benchmarks/online_scale.py [--sizes 64,1024,16384] [--seconds 3] [--plant extra|split|hang]
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from moedoctor.events import CallSite, CollectiveEvent, Group, Phase  # noqa: E402
from moedoctor.runner.digest import BLOCK, FANIN, Coordinator, NodeDigest, _mix, coordinator_of  # noqa: E402

TP = EP = 8
RATE = 100  # collectives per rank per second = one step
LAYERS = 7
SITE = CallSite("/job/train.py", 10, "step", ("/job/train.py:10 step",))
HIDDEN = 1024


def mesh(n: int) -> tuple[list[list[Group]], int]:
    """Per rank its groups [tp, ep, fsdp, edp]; and the number of nodes."""
    dp = n // (TP * EP)
    groups: list[list[Group]] = []
    cache: dict[str, Group] = {}

    def group(name: str, desc: str, ranks: list[int]) -> Group:
        g = cache.get(name)
        if g is None:
            g = cache[name] = Group(name, desc, tuple(ranks))
        return g

    for r in range(n):
        tp, rest = r % TP, r // TP
        ep, d = rest % EP, rest // EP
        groups.append(
            [
                group(f"tp{rest}", "tp", [rest * TP + i for i in range(TP)]),
                group(f"ep{d}.{tp}", "ep", [(d * EP + i) * TP + tp for i in range(EP)]),
                group(f"fsdp{tp}", "dp_shard", [k * TP + tp for k in range(n // TP)]),
                group(f"edp{ep}.{tp}", "edp", [(i * EP + ep) * TP + tp for i in range(dp)]),
            ]
        )
    return groups, n // TP


def schedule() -> list[tuple]:
    """One step: (group index, op, kind); 100 entries."""
    s: list[tuple] = []
    for layer in range(LAYERS):
        s += [(2, "all_gather", ("ag", layer)), (0, "all_reduce", ("ar",)), (1, "all_to_all", ("a2a", layer, 0))]
        s += [(1, "all_to_all", ("a2a", layer, 1)), (0, "all_reduce", ("ar",))]
    for layer in reversed(range(LAYERS)):
        s += [(2, "all_gather", ("ag", layer)), (0, "all_reduce", ("ar",)), (1, "all_to_all", ("a2a", layer, 2))]
        s += [(1, "all_to_all", ("a2a", layer, 3)), (0, "all_reduce", ("ar",)), (2, "reduce_scatter", ("rs", layer))]
        s += [(3, "reduce_scatter", ("ers", layer)), (0, "all_reduce", ("ar",))]
    while len(s) < RATE:
        s.append((0 if len(s) % 2 else 2, "all_reduce", ("small",)))
    return s[:RATE]


class Rank:
    """One rank's synthetic stream."""

    __slots__ = ("rank", "groups", "seqs", "pos", "extra", "broken", "stop")

    def __init__(self, rank: int, groups: list[Group]):
        self.rank = rank
        self.groups = groups
        self.seqs = [0, 0, 0, 0]
        self.pos = 0  # collectives issued (position in the run)
        self.extra: int | None = None  # issue an extra FSDP all_reduce before this position
        self.broken: int | None = None  # break the split contract at this position
        self.stop: int | None = None  # issue nothing from this position on (a hang)

    def issue(self, count: int, sched: list[tuple], seed: int) -> tuple[list[CollectiveEvent], float | None]:
        out = []
        planted = None
        for _ in range(count):
            pos = self.pos
            step, i = divmod(pos, RATE)
            t = pos / RATE
            if self.extra == pos:
                out.append(self._event(2, "all_reduce", ((1,),), ((1,),), "float32", "sum", step, t))
                planted = t
            if self.stop is not None and pos >= self.stop:
                break
            gi, op, kind = sched[i]
            g = self.groups[gi]
            if op == "all_to_all":
                # rows from member a to member b: uneven, different every step and layer, consistent
                h = _mix(seed ^ (step << 20) ^ (kind[1] << 8) ^ kind[2] ^ (hash(g.name) & 0xFFFF))
                a, b, c = h & 31, (h >> 5) & 31, (h >> 10) & 31
                me = g.ranks.index(self.rank)
                send = tuple(1 + (a * me + b * j + c) % 32 for j in range(EP))
                recv = tuple(1 + (a * j + b * me + c) % 32 for j in range(EP))
                if self.broken == pos:
                    recv = (recv[0] + 1,) + recv[1:]
                    planted = t
                e = self._event(gi, op, ((sum(send), HIDDEN),), ((sum(recv), HIDDEN),), "bfloat16", None, step, t)
                e = _with_splits(e, send, recv)
            elif op == "all_gather":
                e = self._event(gi, op, ((4096,),), ((4096 * len(g.ranks),),), "bfloat16", None, step, t)
            elif op == "reduce_scatter":
                e = self._event(gi, op, ((4096 * len(g.ranks),),), ((4096,),), "float32", "avg", step, t)
            elif kind[0] == "small":
                e = self._event(gi, op, ((1,),), ((1,),), "float32", "sum", step, t)
            else:
                e = self._event(gi, op, ((2048, HIDDEN),), ((2048, HIDDEN),), "bfloat16", "sum", step, t)
            out.append(e)
            self.pos += 1
        return out, planted

    def _event(self, gi, op, ins, outs, dtype, red, step, t) -> CollectiveEvent:
        g = self.groups[gi]
        self.seqs[gi] += 1
        return CollectiveEvent(
            self.rank, self.pos, t, g, self.seqs[gi], op, op, ins, outs, (dtype,), red, True, "MainThread",
            SITE, Phase.OTHER, int(t), completed=t + 0.005,
        )


def _with_splits(e: CollectiveEvent, send: tuple, recv: tuple) -> CollectiveEvent:
    object.__setattr__(e, "in_splits", send)
    object.__setattr__(e, "out_splits", recv)
    return e


def parse_cost(events: dict[int, list[CollectiveEvent]]) -> float:
    """CPU seconds per record for the tracker to parse node 0's records from real trace files."""
    from event_factory import TraceBuilder, encode_trace

    from moedoctor.runner.progress import ProgressTracker

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        n = 0
        for rank, evs in events.items():
            b = TraceBuilder(rank, world_size=len(evs[0].group.ranks))
            b.events = evs
            (folder / f"rank-{rank:05d}.jsonl").write_bytes(encode_trace(b))
            n += len(evs)
        tracker = ProgressTracker(folder, listener=None)
        t0 = time.process_time()
        tracker.poll()
        return (time.process_time() - t0) / n


def simulate(n: int, seconds: float, period: float, plant: str, seed: int = 7, quiet: bool = False) -> dict:
    groups, nodes_n = mesh(n)
    sched = schedule()
    ranks = [Rank(r, groups[r]) for r in range(n)]
    victim = n // 2 + 3
    if plant in ("extra", "hang"):
        at = RATE + 3 * 5  # step 1, right before the 4th layer's forward FSDP all_gather
        assert sched[at % RATE][:2] == (2, "all_gather")
        ranks[victim].extra = at
        if plant == "hang":  # every rank stops there: the others after that all_gather, the victim before
            for x in ranks:
                x.stop = at + (x.rank != victim)
    else:
        a2a = [i for i, s in enumerate(sched) if s[1] == "all_to_all"]
        ranks[victim].broken = RATE + a2a[5]
    route = coordinator_of(nodes_n, lambda r: r // TP, fanin=FANIN)
    nodes = [NodeDigest(k, retain=4 * BLOCK) for k in range(nodes_n)]
    coords = [Coordinator(clock=lambda: 0.0, node=k, fanin=FANIN, route=route) for k in range(nodes_n)]
    later: list[list[bytes]] = [[] for _ in range(nodes_n)]  # chunk summaries, delivered next period
    cpu = [0.0] * nodes_n
    sent = [0] * nodes_n
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    per_tick = int(RATE * period)
    ticks = int(seconds / period)
    issued_at = None
    found = None
    detected = None
    fed = 0
    sample: dict[int, list[CollectiveEvent]] = {r: [] for r in range(TP)}
    clock = time.process_time
    # One process holds every node's objects here: a cyclic collection over all of them would land
    # on whichever node's call triggered it. A node's supervisor collects only its own few objects;
    # the streams make no cycles (reference counting frees them), so the collector is off.
    gc.disable()
    for tick in range(ticks):
        now = (tick + 1) * period
        for k, node in enumerate(nodes):
            base = k * TP
            for r in range(base, base + TP):
                evs, planted = ranks[r].issue(per_tick, sched, seed)
                if planted is not None:
                    issued_at = planted
                if k == 0 and tick < 4:
                    sample[r].extend(evs)
                t0 = clock()
                node.feed(r, evs)
                cpu[k] += clock() - t0
                fed += len(evs)
        inbox, later = later, [[] for _ in range(nodes_n)]
        for k, node in enumerate(nodes):
            t0 = clock()
            msgs = node.messages(now, None, route)
            cpu[k] += clock() - t0
            for dest, msg in msgs.items():
                if dest != k:
                    sent[k] += len(msg)
                inbox[dest].append(msg)
        for k, coord in enumerate(coords):
            w0, t0 = time.perf_counter(), clock()
            for msg in inbox[k]:
                coord.receive(msg, now)
            out = coord.poll(now)
            work = time.perf_counter() - w0
            round_trip = 0.0
            if out.requests:
                round_trip = period
                for req in out.requests:
                    data = req.to_bytes()
                    for node_id in req.nodes:
                        sent[k] += len(data)
                        t1 = clock()
                        ans = nodes[node_id].answer(data)
                        cpu[node_id] += clock() - t1
                        sent[node_id] += len(ans)
                        coord.receive_records(ans)
                w1 = time.perf_counter()
                out = coord.poll(now)
                work += time.perf_counter() - w1
            for dest, msg in out.up.items():
                if dest != k:
                    sent[k] += len(msg)
                later[dest].append(msg)
            cpu[k] += clock() - t0
            if out.desync is not None and found is None:
                found = out.desync
                detected = now + round_trip + work
        if found is not None and tick * period >= 2.0:
            break
    gc.enable()
    sim_seconds = (tick + 1) * period
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gc.freeze()  # the simulation's millions of objects are not the tracker's to collect
    parse = parse_cost(sample)
    gc.unfreeze()
    per_node = [c / sim_seconds for c in cpu]
    expanded = sum(c.expanded for c in coords)
    unconfirmed = sum(c.unconfirmed for c in coords)
    res = {
        "ranks": n,
        "nodes": nodes_n,
        "sim_seconds": sim_seconds,
        "collectives": fed,
        "found": found,
        "victim": victim,
        "latency": None if found is None or issued_at is None else detected - issued_at,
        "cpu_per_collective_us": sum(cpu) / fed * 1e6,
        "node_cpu_mean": sum(per_node) / nodes_n,
        "node_cpu_max": max(per_node),
        "parse_per_node": parse * TP * RATE,
        "bytes_per_node_s": sum(sent) / nodes_n / sim_seconds,
        "bytes_per_node_s_max": max(sent) / sim_seconds,
        "rss_mb": rss / 1024,
        "rss_per_node_kb": max(rss - rss0, 0) / nodes_n,
        "expanded": expanded,
        "unconfirmed": unconfirmed,
    }
    if not quiet:
        d = found
        what = "NOT FOUND" if d is None else d.line()
        print(
            f"{n:6d} ranks ({nodes_n} nodes, {sim_seconds:.1f} s simulated, {fed:,} collectives): {what}\n"
            f"       detected {res['latency'] if res['latency'] is None else round(res['latency'], 3)} s after "
            f"the mismatch was issued; ranges expanded {expanded} ({unconfirmed} not confirmed)\n"
            f"       digest CPU {res['cpu_per_collective_us']:.2f} us per collective; per node "
            f"{res['node_cpu_mean'] * 100:.2f}% of a core (busiest {res['node_cpu_max'] * 100:.2f}%), "
            f"+ trace parsing {res['parse_per_node'] * 100:.2f}%\n"
            f"       exchanged {res['bytes_per_node_s']:.0f} B per node per s (busiest "
            f"{res['bytes_per_node_s_max']:.0f}); peak RSS {res['rss_mb']:.0f} MB "
            f"(+{res['rss_per_node_kb']:.0f} kB per node)",
            flush=True,
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,1024,16384")
    ap.add_argument("--seconds", type=float, default=3.0, help="simulated seconds at most (the desync is in 1-2)")
    ap.add_argument("--period", type=float, default=0.5, help="exchange period, simulated seconds")
    ap.add_argument("--plant", choices=["extra", "split", "hang"], default="extra")
    args = ap.parse_args()
    last = None
    for n in (int(x) for x in args.sizes.split(",")):
        if n % (TP * EP):
            sys.exit(f"online_scale: {n} ranks is not a multiple of {TP * EP}")
        last = simulate(n, args.seconds, args.period, args.plant)
    assert last is not None
    lat = "never" if last["latency"] is None else f"{last['latency']:.2f}"
    cpu = (last["node_cpu_max"] + last["parse_per_node"]) * 100
    print(f"online-scale: {last['ranks']} ranks, detected in {lat} s, supervisor CPU {cpu:.1f}% of a core")


if __name__ == "__main__":
    main()
