"""pass@k against hand-computed values of 1 - C(n-c, k) / C(n, k)."""
import pytest

from rlctl.commands.eval_cmd import mean_pass_at_k, pass_at_k, report_ks


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 2, 1 - 3 / 10),        # C(3,2)=3, C(5,2)=10
    (10, 3, 5, 1 - 21 / 252),     # C(7,5)=21, C(10,5)=252
    (4, 1, 1, 0.25),              # pass@1 = c/n
    (8, 3, 1, 3 / 8),
    (5, 0, 3, 0.0),               # nothing correct
    (3, 2, 2, 1.0),               # n-c < k: every pair holds a correct one
    (4, 1, 4, 1.0),               # k = n: 1 iff any correct
    (4, 0, 4, 0.0),
    (6, 2, 3, 1 - 4 / 20),        # C(4,3)=4, C(6,3)=20
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_mean_over_prompts_and_reported_ks():
    # two prompts, n=4: c=1 -> pass@2 = 1 - C(3,2)/C(4,2) = 1/2; c=0 -> 0
    assert mean_pass_at_k(4, [1, 0], 2) == pytest.approx(0.25)
    assert report_ks(1) == [1]
    assert report_ks(8) == [1, 2, 4, 8]
    assert report_ks(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
