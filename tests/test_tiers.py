"""The fast tier's guard (tests/tiers.py), run by pytest on a small suite of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ("pytester",)

TESTS = Path(__file__).resolve().parent

SUITE = """
import time
import pytest

@pytest.fixture
def slow_own_fixture():
    time.sleep(0.6)

@pytest.fixture(scope="session")
def slow_shared_fixture():
    time.sleep(0.6)

def test_quick():
    pass

def test_slow_call():
    time.sleep(0.6)

def test_slow_own_fixture(slow_own_fixture):
    pass

def test_slow_shared_fixture(slow_shared_fixture):
    pass

@pytest.mark.fast_budget(5)
def test_slow_within_its_budget():
    time.sleep(0.6)

def test_failing_on_its_own():
    assert False, "its own failure"

@pytest.mark.full
def test_slow_in_the_full_tier():
    time.sleep(0.6)
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\npytest_plugins = ('tiers',)\n")
    markers = "    fast_budget(seconds): allowed more than the limit\n    full: the full tier\n"
    pytester.makeini(f"[pytest]\nmarkers =\n{markers}")
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_a_test_over_the_limit_fails_and_tells_its_author_to_mark_it_full(suite: pytest.Pytester) -> None:
    result = suite.runpytest("--fast-tier-limit=0.3", "-m", "not full")
    result.assert_outcomes(passed=3, failed=3, deselected=1)
    failed = {line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("FAILED")}
    # the call and the test's own fixture count; a shared fixture, paid once for everyone, does not
    assert failed == {"test_slow_call", "test_slow_own_fixture", "test_failing_on_its_own"}
    result.stdout.fnmatch_lines(
        [
            "*test_slow_call passed but took 0.6 s (call and own fixtures), over the fast tier's limit of 0.3 s.*",
            "Mark it @pytest.mark.full to run it in the full tier (make test-all)*",
        ]
    )
    assert "its own failure" in result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*fast tier: 6 tests in * s (target 480 s on 2 cores)",
            "fast tier's per-test limit 0.3 s (call and own fixtures); over it: 2",
            "  shared fixture slow_shared_fixture (session): 0.6 s",
        ]
    )


def test_both_tiers_in_one_session_hold_only_the_fast_tier_to_the_limit(suite: pytest.Pytester) -> None:
    result = suite.runpytest("--fast-tier-limit=0.3")
    result.assert_outcomes(passed=4, failed=3)  # the slow full-tier test passes
    result.stdout.fnmatch_lines(
        [
            "fast tier: 6 tests, * s of their own (calls and own fixtures)",
            "full tier: 1 tests, 1 s of their own",
            "both tiers, with shared fixtures and collection: * s",
        ]
    )


def test_a_fast_budget_is_itself_a_limit(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_budget="import time, pytest\n\n@pytest.mark.fast_budget(0.2)\ndef test_t():\n    time.sleep(0.5)\n"
    )
    result = suite.runpytest("--fast-tier-limit=10", "test_budget.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*over its fast_budget of 0.2 s*"])


def test_the_whole_run_is_printed_against_its_budget_and_fails_above_its_limit(suite: pytest.Pytester) -> None:
    within = suite.runpytest("--suite-budget=60", "--suite-limit=120", "-m", "full")
    within.assert_outcomes(passed=1, deselected=6)
    assert within.ret == 0
    within.stdout.fnmatch_lines(["whole run: * s (budget 60 s, fails above 120 s)"])
    assert "over the budget" not in within.stdout.str()

    # The one selected test sleeps 0.6 s, so the run is over a 0.3 s budget and a 0.5 s limit: every test passes,
    # yet the session fails, and the summary names where the time went.
    over = suite.runpytest("--suite-budget=0.3", "--suite-limit=0.5", "-m", "full")
    over.assert_outcomes(passed=1, deselected=6)
    assert over.ret == pytest.ExitCode.TESTS_FAILED
    over.stdout.fnmatch_lines(
        [
            "whole run: * s (budget 0.3 s, fails above 0.5 s)",
            "over the budget by * s; the slowest full-tier tests:",
            "  1 s test_suite.py::test_slow_in_the_full_tier",
            "FAILED: the whole run took * s, over its limit of 0.5 s",
        ]
    )

    # Over the budget alone is a warning, not a failure.
    warned = suite.runpytest("--suite-budget=0.3", "-m", "full")
    assert warned.ret == 0
    warned.stdout.fnmatch_lines(["whole run: * s (budget 0.3 s)", "over the budget by * s; *"])


def test_without_a_limit_nothing_is_guarded_or_summarised(suite: pytest.Pytester) -> None:
    result = suite.runpytest()
    result.assert_outcomes(passed=6, failed=1)
    assert "fast tier:" not in result.stdout.str()
