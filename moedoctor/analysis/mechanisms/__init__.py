"""Level 1: what the traces show happened at a divergence. ``vocabulary`` (the closed set of
mechanisms and one finding), ``detection`` (``mechanism_of``: the order in which the readings are
tried, one mechanism per divergence), the readings (``loops``, ``held_back``, ``alignment``,
``mismatch``, ``missing``), ``wording`` (a finding turned into the change to make), with the
wait-for graph (``waitfor``) and the culprits."""
