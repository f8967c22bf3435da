"""Seeds from a stated effect and a pilot's spread: known values of the paired t-test."""

from __future__ import annotations

import json

import pytest

from megatron_pdm.analysis.power import check_independent, pilot_sd, pilot_seeds, seeds_needed


@pytest.mark.parametrize("d, n_t", [(0.5, 34), (0.3, 90), (0.8, 15)])
def test_paired_t_test_seed_counts_match_the_tables(d, n_t):
    # the one-sample / paired t-test, two-sided alpha 0.05, power 0.8 (Cohen's tables, G*Power)
    assert seeds_needed(d, 1.0)["t_test"] == n_t


def test_the_papers_effect_at_the_measured_spread():
    out = seeds_needed(-0.027, 0.059)  # -2.7 pp at SD 5.9 pp
    assert out["n_normal_exact"] == pytest.approx(37.48, abs=0.01)
    assert (out["normal"], out["t_test"]) == (38, 40)
    # halving the spread quarters the normal-approximation count
    assert seeds_needed(-0.027, 0.0295)["n_normal_exact"] == pytest.approx(37.48 / 4, abs=0.01)


@pytest.mark.parametrize("kw", [dict(effect=0.0, sd=1.0), dict(effect=0.1, sd=0.0),
                                dict(effect=0.1, sd=1.0, alpha=1.5)])
def test_bad_inputs_are_refused(kw):
    with pytest.raises(ValueError, match="power analysis"):
        seeds_needed(**kw)


def test_pilot_sd_reads_the_paired_differences(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"summary": {"paired": [
        {"criterion": "pdm-agg", "per_seed_difference": [0.1, None, -0.1, 0.0]}]}}))
    sd, n = pilot_sd(str(path))
    assert n == 3 and sd == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no paired comparison"):
        pilot_sd(str(path), "pdm-exact")


def test_a_pilot_that_shares_seeds_with_the_study_is_refused(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"setup": {"seeds": [1, 2, 3, 4]}, "summary": {"paired": []}}))
    seeds = pilot_seeds(str(path))
    check_independent(str(path), seeds, list(range(101, 141)))  # independent: accepted
    with pytest.raises(ValueError) as err:
        check_independent(str(path), seeds, list(range(1, 41)))  # an internal pilot
    msg = str(err.value)
    assert "[1, 2, 3, 4]" in msg and "[1, 2, 3, 4, 5" in msg and "shared: [1, 2, 3, 4]" in msg
    assert "--first-seed 5" in msg
    path.write_text(json.dumps({"summary": {"paired": []}}))
    with pytest.raises(ValueError, match="no setup.seeds"):
        pilot_seeds(str(path))
