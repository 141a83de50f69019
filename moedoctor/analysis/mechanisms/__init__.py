"""Level 1: what the traces show happened at a divergence. ``vocabulary`` (the closed set of
mechanisms and one finding), ``detection`` (one mechanism per divergence), ``wording`` (a finding
turned into the change to make), with the wait-for graph (``waitfor``) and the culprits."""
