"""``moedoctor verify``'s own rows, from constructed run records: the "before" column names the rank
that failed first and how, and a fix check's detail says what each rank compared when they differ."""

from __future__ import annotations

import pytest

from moedoctor.fixes.status import CheckStatus
from moedoctor.verification.verify import _per_rank_details, first_failure


def ranks(**codes):
    return {k.removeprefix("r"): {"exit_code": c, "source": "torchrun"} for k, c in codes.items()}


@pytest.mark.parametrize("codes, said", [
    # Gloo's size-mismatch abort: rank 1 died of SIGABRT, torchrun then stopped rank 0 with SIGTERM.
    ({"r0": -15, "r1": -6}, "rank 1 failed first: SIGABRT (exit -6); then rank 0 stopped by the launcher: "
                            "SIGTERM (exit -15)"),
    ({"r0": 1, "r1": -15}, "rank 0 failed first: exit 1; then rank 1 stopped by the launcher: SIGTERM (exit -15)"),
    ({"r0": 1, "r1": 1}, "ranks 0, 1 failed: rank 0 exit 1, rank 1 exit 1"),
    ({"r0": -9, "r1": -15}, "ranks 0, 1 stopped: SIGKILL (exit -9), SIGTERM (exit -15)"),
    ({"r0": 0, "r1": -11}, "rank 1 failed first: SIGSEGV (exit -11)"),
    ({"r0": 0, "r1": 0}, None),
    ({"r0": None, "r1": 0}, None),
])
def test_the_before_column_names_the_rank_that_failed_first_and_how(codes, said):
    assert first_failure(ranks(**codes)) == said


def test_first_failure_of_no_ranks_is_none():
    assert first_failure(None) is None and first_failure({"x": {"exit_code": 1}}) is None


def status(detail):
    return CheckStatus("dense output equals sparse", True, 2, 0, detail, 0.0)


def test_a_check_detail_is_given_per_rank_when_the_ranks_compared_different_things():
    same = [(0, status("4 calls compared")), (1, status("4 calls compared"))]
    assert _per_rank_details(same) == "4 calls compared"
    differ = [(0, status("4 calls compared, none with an idle expert")), (1, status("4 calls compared, 2 with an idle "
                                                                                    "expert"))]
    assert _per_rank_details(differ) == ("rank 0: 4 calls compared, none with an idle expert; "
                                         "rank 1: 4 calls compared, 2 with an idle expert")
