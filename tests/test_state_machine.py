"""Issue 55's state machine (tests/state_machine.py) on a few histories drawn from a fixed seed: real runs with
faults, every invariant checked after every rule. The soak draws many more:

    python tests/state_machine.py --histories 200
"""

import pytest

pytest.importorskip("hypothesis", reason="the state machine needs hypothesis (requirements-dev.txt)")
from state_machine import run_histories  # noqa: E402


@pytest.mark.slow
def test_random_histories_of_runs_with_faults_keep_the_state_table_and_its_invariants(tmp_path_factory):
    report = run_histories(tmp_path_factory.mktemp("state_machine"), histories=3, steps=5, seed=1, strict=True)
    print(report.summary())
    assert report.violations == []
    assert report.histories >= 3 and report.launches >= 6  # (a machine that ran nothing would pass the line above)
