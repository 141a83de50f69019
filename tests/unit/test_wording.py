"""``moedoctor.wording``: lists of ranks, worded once for every report."""

from moedoctor.wording import rank_names, rank_numbers


def test_rank_names():
    assert rank_names([]) == "no rank"
    assert rank_names([3]) == "rank 3"
    assert rank_names([5, 0, 2]) == "ranks 0,2,5"
    assert rank_names([8, 0, 1, 2, 3], ranges=True) == "ranks 0-3,8"


def test_rank_numbers_are_capped():
    assert rank_numbers([2, 1]) == "1, 2"
    assert rank_numbers(range(12)) == "0, 1, 2, 3, 4, 5, 6, 7 and 4 more"
