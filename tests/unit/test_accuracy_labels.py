"""``benchmarks/diagnosis_accuracy.py``'s mechanism scoring: a yaml's single ``mechanism`` label
counts another name only where it is the same trace fact (``same_trace_fact``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "diagnosis_accuracy.py"
spec = importlib.util.spec_from_file_location("diagnosis_accuracy", BENCH)
acc = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = acc  # its dataclasses look their module up
spec.loader.exec_module(acc)


def test_a_skip_by_the_culprit_is_an_extra_collective_by_exactly_the_others():
    extra_by_0 = {"mechanism": "extra-collective", "ranks": [0], "others": [1]}
    assert acc.mechanism_right({"skipped-collective"}, extra_by_0, culprits=[1])
    assert not acc.mechanism_right({"skipped-collective"}, extra_by_0, culprits=[0])  # the culprit's own extra
    assert not acc.mechanism_right({"skipped-collective"}, {**extra_by_0, "others": [1, 2]}, culprits=[1, 3])
    assert not acc.mechanism_right({"skipped-collective", "different-op"}, extra_by_0, culprits=[1])  # no label


def test_the_same_op_from_two_call_sites_with_other_sizes_is_different_op_or_different_shape():
    ops = [("all_reduce", "t.py:56", [[1088]]), ("all_reduce", "t.py:102", [[]])]
    assert acc.mechanism_right({"different-shape"}, {"mechanism": "different-op", "ops": ops})
    one_site = [("all_reduce", "t.py:56", [[1088]]), ("all_reduce", "t.py:56", [[]])]
    assert not acc.mechanism_right({"different-shape"}, {"mechanism": "different-op", "ops": one_site})
    two_ops = [("all_reduce", "t.py:56", [[8]]), ("all_gather", "t.py:60", [[4]])]
    assert not acc.mechanism_right({"different-shape"}, {"mechanism": "different-op", "ops": two_ops})
