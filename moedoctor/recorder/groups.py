"""The process groups a recorder sees, by name: the group object, and its members' global ranks in
group-rank order (remembered: a group's members never change). Leaf of the recorder: torch only."""

from __future__ import annotations

import torch.distributed as dist


def process_group(name: str):
    """The process group named ``name`` (its ``group_name``), or None."""
    from torch.distributed.distributed_c10d import _world

    for pg, pg_name in list(_world.pg_names.items()):
        if pg_name == name:
            return pg
    return None


def description(name: str) -> str:
    """The group's ``group_desc`` (``default_pg``, ...), ``""`` when torch gives none."""
    return getattr(process_group(name), "group_desc", "")


class GroupRanks:
    """Each group's global ranks in group-rank order, looked up once per group."""

    def __init__(self) -> None:
        self.known: dict[str, tuple[int, ...]] = {}

    def of(self, name: str) -> tuple[int, ...]:
        ranks = self.known.get(name)
        if ranks is None:
            pg = process_group(name)
            if pg is None:
                ranks = ()
            else:
                from torch.distributed.distributed_c10d import _world

                mapping = _world.pg_group_ranks.get(pg, {})
                ranks = tuple(sorted(mapping, key=mapping.get)) or tuple(range(dist.get_world_size()))
            self.known[name] = ranks
        return ranks

    def global_rank(self, name: str, group_rank) -> int | None:
        """The global rank of member ``group_rank`` of the group (None stays None; a rank out of
        the group's range is taken as global already)."""
        if group_rank is None:
            return None
        ranks = self.of(name)
        return ranks[group_rank] if 0 <= group_rank < len(ranks) else int(group_rank)
