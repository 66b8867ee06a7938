from ckptd.core.psn import PSN_MOD, psn_add, psn_diff, psn_unwrap


def test_add_wraps_at_2_24():
    assert psn_add(PSN_MOD - 1, 1) == 0
    assert psn_add(PSN_MOD - 3, 10) == 7


def test_diff_is_signed_shortest_distance():
    assert psn_diff(5, PSN_MOD - 5) == 10
    assert psn_diff(PSN_MOD - 5, 5) == -10
    assert psn_diff(100, 100) == 0


def test_unwrap_keeps_counting_past_the_wrap():
    near = 3 * PSN_MOD - 2  # an unbounded position just below a wrap
    assert psn_unwrap(1, near) == 3 * PSN_MOD + 1
    assert psn_unwrap(PSN_MOD - 4, near) == 3 * PSN_MOD - 4  # a late packet before the wrap
