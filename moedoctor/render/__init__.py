"""Renderers: a ``Report`` (and, for the timeline, the ``RunData`` it came from) as a terminal page
(``terminal``), JSON (``json_report``), a self-contained HTML page (``html``) or a Perfetto /
Chrome trace (``perfetto``). Renderers only render: every finding comes from the analysis."""
