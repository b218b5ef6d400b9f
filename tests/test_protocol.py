"""experiments/protocol.py: the statistics every claim's verdict rests on, on examples worked by hand."""
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import protocol  # noqa: E402


def test_paired_difference_and_its_standard_error():
    a = {0: 1.0, 1: 2.0, 2: 4.0, 7: 9.0}                 # seed 7 has no partner: left out
    b = {0: 0.5, 1: 1.0, 2: 2.5, 3: 0.0}
    p = protocol.paired(a, b)
    assert p.seeds == [0, 1, 2] and p.diffs == [0.5, 1.0, 1.5]
    assert p.diff == pytest.approx(1.0) and p.mean_a == pytest.approx(7 / 3) and p.mean_b == pytest.approx(4 / 3)
    assert p.se == pytest.approx(0.5 / math.sqrt(3))     # stdev(0.5, 1, 1.5) = 0.5
    assert p.holds(+1) == 3 and p.holds(-1) == 0
    with pytest.raises(ValueError, match="no seed in common"):
        protocol.paired({0: 1.0}, {1: 1.0})


def test_verdicts():
    clear = protocol.paired({0: 1.0, 1: 1.1, 2: 0.9}, {0: 2.0, 1: 2.1, 2: 1.8})        # a lower by ~1, SE ~0.03
    assert protocol.verdict(clear, sign=-1) == protocol.REPRODUCES
    assert protocol.verdict(clear, sign=+1) == protocol.DOES_NOT                       # reversed
    assert protocol.verdict(clear, sign=-1, control_passed=False) == protocol.NOT_TESTABLE
    noisy = protocol.paired({0: 1.0, 1: 2.0, 2: 0.0}, {0: 1.1, 1: 1.0, 2: 1.2})       # mean -0.1, SE ~0.58
    assert protocol.verdict(noisy, sign=-1) == protocol.DOES_NOT
    one_seed = protocol.paired({0: 0.0}, {0: 5.0})
    assert math.isnan(one_seed.se) and protocol.verdict(one_seed, sign=-1) == protocol.DOES_NOT
    same = protocol.paired({0: 1.00, 1: 1.01, 2: 0.99}, {0: 1.00, 1: 1.00, 2: 1.00})    # |d| + 2 SE = 0.0115
    assert protocol.equivalence_verdict(same, margin=0.02) == protocol.REPRODUCES
    assert protocol.equivalence_verdict(same, margin=0.01) == protocol.DOES_NOT
    better = protocol.paired({0: 0.90, 1: 0.95, 2: 0.92}, {0: 1.0, 1: 1.0, 2: 1.0})   # a lower: not worse
    assert protocol.noninferiority_verdict(better, margin=0.02) == protocol.REPRODUCES
    assert protocol.equivalence_verdict(better, margin=0.02) == protocol.DOES_NOT      # but not "the same"
    assert protocol.noninferiority_verdict(protocol.paired({0: 1.05, 1: 1.04}, {0: 1.0, 1: 1.0}), 0.02) == protocol.DOES_NOT


def test_curve_readings():
    assert protocol.best_lr({1e-3: [3.0, 3.2], 3e-3: [2.9, 3.0], 1e-2: [3.5, 2.6]}) == 3e-3   # means 3.1, 2.95, 3.05
    assert protocol.best_lr({1e-3: [0.5], 3e-3: [0.9]}, lower_is_better=False) == 3e-3
    losses = [(1000, 5.0), (2000, 4.0), (3000, 3.5)]
    assert protocol.tokens_to_reach(losses, 4.5) == pytest.approx(1500)    # halfway between the two evals
    assert protocol.tokens_to_reach(losses, 5.5) == 1000 and protocol.tokens_to_reach(losses, 3.0) is None


def _square(x):
    return x * x


def test_run_jobs_keeps_order_in_two_processes():
    jobs = [dict(x=i) for i in range(5)]
    assert protocol.run_jobs(_square, jobs, processes=2) == protocol.run_jobs(_square, jobs) == [0, 1, 4, 9, 16]


@pytest.mark.parametrize("script,extra,claims", [("hybrid.py", [], 2), ("qk_clip.py", [], 3), ("muon_vs_adamw.py", [], 1),
                                                  ("attnres_compare.py", [], 9), ("attnres_compare.py", ["--full"], 10)])
def test_judged_experiments_quick_runs_write_their_verdicts(script, extra, claims, tmp_path, monkeypatch):
    # the whole protocol in seconds: tuning runs, judging runs on seeds apart, a verdict row per claim
    import runpy
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setattr(sys, "argv", [script, "--quick", f"--out_dir={tmp_path}"] + extra)
    runpy.run_path(os.path.join(root, "experiments", script), run_name="__main__")
    table = (tmp_path / script.replace(".py", ".md")).read_text()
    verdicts = [line for line in table.splitlines() if line.endswith(("**reproduces** |", "**does not reproduce** |"))]
    assert len(verdicts) == claims, table
    assert (tmp_path / script.replace(".py", ".png")).stat().st_size > 0
