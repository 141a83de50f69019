"""The JSON rendering of a ``Report``. The encoding itself belongs to the analysis, which owns the
report's schema (``moedoctor/analysis/report_json.py``, documented in ``docs/report-format.md``), so
that layers below the renderers (verification) write ``report.json`` without importing them."""

from moedoctor.analysis.report_json import (
    CUT_TO,
    MAX_REPORT_BYTES,
    MAX_SHAPES,
    divergence_to_dict,
    dumps,
    dumps_with_params,
    op_to_dict,
    report_to_dict,
    write_json,
)

__all__ = [
    "CUT_TO",
    "MAX_REPORT_BYTES",
    "MAX_SHAPES",
    "divergence_to_dict",
    "dumps",
    "dumps_with_params",
    "op_to_dict",
    "report_to_dict",
    "write_json",
]
