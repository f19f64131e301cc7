"""The analytic model: published rows, limits, best γ, and the CLI."""

import math
import subprocess
import sys

import pytest

from selfspec.tools.calc import best_gamma, ceiling, expected_tokens, parse_values, speedup


@pytest.mark.parametrize("cost, alpha, gamma, tokens, gain", [
    (0.25, 0.70, 4, 2.77, 1.39),
    (0.10, 0.78, 4, 3.23, 2.31),
])
def test_published_rows(cost, alpha, gamma, tokens, gain):
    assert round(expected_tokens(alpha, gamma), 2) == tokens
    assert round(speedup(alpha, gamma, cost), 2) == gain


def test_the_second_published_row_does_not_follow_the_formula():
    """The issue lists c = 0.125, α = 0.65, γ = 4 → 2.50, 1.67×; the formula it states gives 2.53
    and 1.68× (2.50 would need α ≈ 0.645). We keep the formula."""
    assert round(expected_tokens(0.65, 4), 2) == 2.53
    assert round(speedup(0.65, 4, 0.125), 2) == 1.68
    assert round(expected_tokens(0.645, 4), 2) == 2.50


def test_limits_and_best_gamma():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert speedup(0.5, 0, 0.3) == 1.0  # no draft: AR
    assert ceiling(0.75) == 4.0 and math.isinf(ceiling(1.0))
    assert best_gamma(0.1, 0.5) == 0  # drafting never pays
    g = best_gamma(0.8, 0.05)
    assert g > 3 and speedup(0.8, g, 0.05) >= max(speedup(0.8, x, 0.05) for x in range(65))
    assert best_gamma(0.8, 0.05, verify=1.5) <= 64
    with pytest.raises(ValueError):
        expected_tokens(1.2, 3)


def test_value_lists():
    assert parse_values("0.6:0.8:0.1") == [0.6, 0.7, 0.8]
    assert parse_values("1,2,4", int) == [1, 2, 4]
    with pytest.raises(ValueError, match="bad value list"):
        parse_values("a")


def test_calc_cli_prints_the_table_and_best_gamma():
    out = subprocess.run([sys.executable, "-m", "selfspec.cli", "calc", "--alpha", "0.7", "--draft-len", "4",
                          "--cost", "0.25"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2.77" in out.stdout and "1.39" in out.stdout and "3.33" in out.stdout  # tokens, speedup, ceiling
    assert "best γ" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "selfspec.cli", "calc", "--alpha", "2"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "α must be in [0, 1]" in bad.stderr
