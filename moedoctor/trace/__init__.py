"""The per-rank trace format: writing (``format``) and reading (``reader``). No torch here."""
