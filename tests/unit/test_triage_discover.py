"""How triage numbers a job's ranks from their rendezvous store's connections (triage/discover.py)
when no process carries RANK: the store's server is rank 0 when it is also a peer of the others."""

from __future__ import annotations

from moedoctor.triage.discover import UNKNOWN_BASE, Socket, _is_store, _number

LISTEN, EST = "0A", "01"
STORE = 36149


def rank0(own_pair_port: int, peers: list[int]) -> list[Socket]:
    socks = [Socket(STORE, 0, LISTEN), Socket(48882, STORE, EST), Socket(own_pair_port, 0, LISTEN)]
    socks += [Socket(own_pair_port, p, EST) for p in peers]  # accepted Gloo pair connections
    return socks


def test_two_ranks_the_store_host_is_rank_0_the_other_rank_1():
    socks = {10: rank0(36985, [56370]), 11: [Socket(48890, STORE, EST), Socket(56370, 36985, EST)]}
    assert _is_store(10, STORE, socks)  # the listener is a client of its own port
    found = _number(10, STORE, [10, 11], socks)
    assert found.ranks == {0: 10, 1: 11} and found.world_size == 2 and not found.unidentified
    assert "the other is rank 1" in found.notes()[0]


def test_more_ranks_only_rank_0_is_identified_the_others_are_said_unknown():
    socks = {10: rank0(36985, [56370, 56371]), 11: [Socket(48890, STORE, EST), Socket(56370, 36985, EST)],
             12: [Socket(48891, STORE, EST), Socket(56371, 36985, EST)]}
    found = _number(10, STORE, [10, 11, 12], socks)
    assert found.ranks == {0: 10, UNKNOWN_BASE: 11, UNKNOWN_BASE + 1: 12} and found.unidentified == [11, 12]
    assert any("could not be identified" in n and "11, 12" in n for n in found.notes())


def test_a_launcher_hosting_the_store_is_not_taken_for_rank_0():
    # torchrun's agent: it serves the store and is its client, but no rank talks to it directly.
    socks = {5: [Socket(STORE, 0, LISTEN), Socket(48800, STORE, EST)],
             10: [Socket(48801, STORE, EST), Socket(36985, 0, LISTEN), Socket(36985, 56370, EST)],
             11: [Socket(48802, STORE, EST), Socket(56370, 36985, EST)]}
    found = _number(5, STORE, [5, 10, 11], socks)
    assert 0 not in found.ranks and found.world_size is None and sorted(found.unidentified) == [5, 10, 11]
