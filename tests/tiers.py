"""The two test tiers, and the guard that keeps the fast one fast.

``make test`` runs the fast tier: every test not marked ``full``, with ``--fast-tier-limit=SECONDS``.
``make test-all`` runs both tiers in one session (their shared fixtures built once), the limit held
to the fast tier's tests only. A test belongs in the fast tier when it runs within
the limit; it is marked ``@pytest.mark.full`` when it does not. A handful of fast-tier tests are the
tier's one real run of a part that cannot start within the limit (the deepspeed launcher's kill and
resume, ...): they say so with ``@pytest.mark.fast_budget(SECONDS)``, and the guard holds them to that.

What the guard counts against a test: its call and the fixtures of its own (function scope). A shared
fixture (module or session scope: the tiny dataset's Beam pipeline, the MLflow server) is paid once by
whichever test needs it first, so it is not that test's cost; the summary lists the costliest of them.
The fast tier's whole time is printed at the end beside its target (docs/benchmarks.md, "The test
suite's time").

The whole suite has a budget too (``--suite-budget``, ``--suite-limit``; ``make test-all`` passes both). The summary
prints the whole run's time against the budget and names the slowest full-tier tests once it is over, so that growth is
seen long before CI's own limit; above the limit the session fails, even with every test passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

# The fast tier's target on a clean 2-core machine (`make test`, .venv built): the issue that made the tiers.
FAST_TIER_TARGET_S = 8 * 60

OWN_FIXTURES_S = pytest.StashKey[float]()
FUNCTION_SCOPE = "function"


@dataclass
class Session:
    """What the guard measured in this session."""

    limit: float | None
    started: float
    shared: dict[str, float] = field(default_factory=dict)  # shared fixture -> seconds of its setup
    tests: dict[str, float] = field(default_factory=dict)  # fast-tier test -> seconds counted against it
    full_tests: dict[str, float] = field(default_factory=dict)  # full-tier test -> its seconds, the same way
    over: list[str] = field(default_factory=list)  # tests the guard failed
    budget: float | None = None  # the whole run's budget: over it the summary warns
    hard_limit: float | None = None  # the whole run's limit: over it the session fails
    wall: float | None = None  # the whole run's seconds, read once when the session finishes


SESSION = pytest.StashKey[Session]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast-tier-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail a test that takes longer than SECONDS (its call and its own fixtures): the fast tier's guard",
    )
    parser.addoption(
        "--suite-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="print the whole run's time against SECONDS, and its slowest full-tier tests when over",
    )
    parser.addoption(
        "--suite-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail the session when the whole run takes longer than SECONDS",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[SESSION] = Session(
        limit=config.getoption("fast_tier_limit"),
        started=time.monotonic(),
        budget=config.getoption("suite_budget"),
        hard_limit=config.getoption("suite_limit"),
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    # Dependencies are set up before this hook is called for a fixture, so the times do not nest.
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if fixturedef.scope == FUNCTION_SCOPE:
        item = request.node
        item.stash[OWN_FIXTURES_S] = item.stash.get(OWN_FIXTURES_S, 0.0) + seconds
    else:
        session = request.config.stash[SESSION]
        session.shared[f"{fixturedef.argname} ({fixturedef.scope})"] = seconds


def allowed_seconds(item: pytest.Item, limit: float) -> float:
    budget = item.get_closest_marker("fast_budget")
    return float(budget.args[0]) if budget else limit


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call":
        return
    session = item.config.stash[SESSION]
    seconds = report.duration + item.stash.get(OWN_FIXTURES_S, 0.0)
    if item.get_closest_marker("full"):  # `make test-all` runs both tiers in one session: the full tier unguarded
        session.full_tests[item.nodeid] = seconds
        return
    session.tests[item.nodeid] = seconds
    if session.limit is None or not report.passed:
        return
    allowed = allowed_seconds(item, session.limit)
    if seconds > allowed:
        session.over.append(item.nodeid)
        report.outcome = "failed"
        kind = "its fast_budget" if item.get_closest_marker("fast_budget") else "the fast tier's limit"
        report.longrepr = (
            f"{item.nodeid} passed but took {seconds:.1f} s (call and own fixtures), over {kind} of {allowed:g} s.\n"
            "Mark it @pytest.mark.full to run it in the full tier (make test-all), or make it faster; "
            "tests/tiers.py says which tests belong where."
        )


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Before the terminal reporter's own sessionfinish, which prints the summary below: the exit status set here
    # is the one pytest returns.
    tiers = session.config.stash[SESSION]
    tiers.wall = time.monotonic() - tiers.started
    if tiers.hard_limit is not None and tiers.wall > tiers.hard_limit and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash[SESSION]
    if session.limit is None and session.budget is None:
        return
    wall = session.wall if session.wall is not None else time.monotonic() - session.started
    write = terminalreporter.write_line
    terminalreporter.section("test tiers")
    if session.limit is not None:
        summarise_fast_tier(write, session, wall)
    if session.budget is not None or session.hard_limit is not None:
        summarise_whole_run(write, session, wall)


def summarise_fast_tier(write: Callable[[str], None], session: Session, wall: float) -> None:
    fast = f"fast tier: {len(session.tests)} tests"
    if not session.full_tests:
        write(f"{fast} in {wall:.0f} s (target {FAST_TIER_TARGET_S} s on 2 cores)")
    else:  # both tiers in one session (make test-all): each tier's own time, then the whole
        write(f"{fast}, {sum(session.tests.values()):.0f} s of their own (calls and own fixtures)")
        write(f"full tier: {len(session.full_tests)} tests, {sum(session.full_tests.values()):.0f} s of their own")
        write(f"both tiers, with shared fixtures and collection: {wall:.0f} s")
    write(f"fast tier's per-test limit {session.limit:g} s (call and own fixtures); over it: {len(session.over)}")
    for name, seconds in sorted(session.shared.items(), key=lambda kv: -kv[1])[:5]:
        write(f"  shared fixture {name}: {seconds:.1f} s")
    if not session.full_tests and wall > FAST_TIER_TARGET_S:
        write(f"the fast tier took longer than its target of {FAST_TIER_TARGET_S} s: move its slowest tests to full")


def summarise_whole_run(write: Callable[[str], None], session: Session, wall: float) -> None:
    """The whole run against its budget and limit; over the budget, where the time went."""
    budget = f"budget {session.budget:g} s" if session.budget is not None else "no budget"
    limit = f", fails above {session.hard_limit:g} s" if session.hard_limit is not None else ""
    write(f"whole run: {wall:.0f} s ({budget}{limit})")
    if session.budget is not None and wall > session.budget:
        write(f"over the budget by {wall - session.budget:.0f} s; the slowest full-tier tests:")
        for name, seconds in sorted(session.full_tests.items(), key=lambda kv: -kv[1])[:5]:
            write(f"  {seconds:.0f} s {name}")
    if session.hard_limit is not None and wall > session.hard_limit:
        write(f"FAILED: the whole run took {wall:.0f} s, over its limit of {session.hard_limit:g} s")
