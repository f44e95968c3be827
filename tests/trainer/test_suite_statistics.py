"""The suite's statistics: chance levels, the metric on resampled predictions, paired bootstrap intervals."""

import numpy as np
import pytest

from trainer.evaluation import suite_statistics as stats


def test_chance_is_what_a_constant_predictor_scores():
    assert stats.chance(["a", "b", "b", "c"], regression=False) == 0.5
    assert stats.chance([0, 1, 1, 1], regression=False) == 0.75
    assert stats.chance([0.1, 2.0, 3.5], regression=True) == 0.0


def test_scores_are_accuracy_or_pearson_row_by_row():
    rng = np.random.default_rng(1)
    labels = rng.normal(size=50)
    predicted = np.stack([labels + rng.normal(size=50), -labels, np.full(50, 3.0)])
    r = stats.scores(predicted, labels, regression=True)
    assert r[0] == pytest.approx(np.corrcoef(predicted[0], labels)[0, 1])
    assert r[1] == pytest.approx(-1.0) and r[2] == 0.0  # a constant prediction: no correlation, not NaN
    classes = np.array([0, 1, 1, 2])
    assert stats.scores(np.array([[0, 1, 2, 2], [1, 1, 1, 1]]), classes, regression=False).tolist() == [0.75, 0.5]


def task(labels, predicted, regression=False):
    return stats.TaskPredictions(list(labels), [[list(seed) for seed in model] for model in predicted], regression)


def test_identical_models_differ_by_exactly_nothing_and_a_better_one_is_found_better():
    rng = np.random.default_rng(0)
    labels = [str(v) for v in rng.integers(0, 3, 300)]
    good = [[label if rng.random() < 0.8 else "0" for label in labels] for _ in range(2)]  # two seeds
    weak = [[label if rng.random() < 0.5 else "0" for label in labels] for _ in range(2)]
    tasks = [task(labels, [good, good, weak])]
    level = stats.chance(labels, regression=False)
    above = stats.bootstrap_skills(tasks, [level], 500)
    assert above.shape == (500, 3, 1)
    skills = above.mean(axis=2)
    same = stats.interval(skills[:, 0] - skills[:, 1])
    assert same == [0.0, 0.0] and stats.verdict(same, "a", "b") == "no measurable difference"
    better = stats.interval(skills[:, 0] - skills[:, 2])
    assert better[0] > 0 and stats.verdict(better, "a", "b") == "a better"
    assert stats.verdict([-0.3, -0.1], "a", "b") == "b better"
    # the resampling is seeded: the same predictions give the same intervals
    assert np.array_equal(above, stats.bootstrap_skills(tasks, [level], 500))


def test_two_noisy_equal_models_get_an_interval_around_zero():
    """Same accuracy, independent errors: the paired interval holds zero (no false claim)."""
    rng = np.random.default_rng(2)
    labels = rng.normal(size=300)
    first = [list(labels + rng.normal(size=300)) for _ in range(3)]
    second = [list(labels + rng.normal(size=300)) for _ in range(3)]
    above = stats.bootstrap_skills([task(labels, [first, second], regression=True)], [0.0], 1000)
    low, high = stats.interval(above[:, 0, 0] - above[:, 1, 0])
    assert low < 0 < high


def test_the_intervals_cover_a_known_difference_about_95_times_in_100():
    """Coverage on simulated data: 200 test sets of 400 examples, drawn afresh, on which two models are right
    with probabilities 0.75 and 0.70 (a true difference of skill of 0.05). A 95 % interval should hold 0.05 in
    about 95 % of them (200 draws: about +-3 points; a percentile bootstrap runs a little below nominal,
    measured 0.92 here). An 80 % interval in its place covers 0.745, and fails."""
    rng = np.random.default_rng(7)
    n, draws, covered = 400, 200, 0
    for _ in range(draws):
        labels = [str(v) for v in rng.integers(0, 2, n)]
        models = [
            [[label if rng.random() < p else ("1" if label == "0" else "0") for label in labels]] for p in (0.75, 0.7)
        ]
        above = stats.bootstrap_skills([task(labels, models)], [stats.chance(labels, regression=False)], 300)
        low, high = stats.interval(above[:, 0, 0] - above[:, 1, 0])
        covered += low <= 0.05 <= high
    assert 0.9 <= covered / draws <= 0.98, covered / draws


def test_replicated_students_widen_the_interval_by_their_own_variance():
    """Three students per variant (distilled with different seeds), one fine-tuning seed each: grouped, the
    bootstrap draws students too, so students that differ among themselves widen their variant's interval
    (against a variant whose students agree); each model its own group is the plain paired bootstrap, number
    for number."""
    rng = np.random.default_rng(3)
    labels = [str(v) for v in rng.integers(0, 2, 300)]

    def student(right: float) -> list[list[str]]:
        return [[label if rng.random() < right else ("1" if label == "0" else "0") for label in labels]]

    spread = [student(p) for p in (0.62, 0.75, 0.88, 0.70, 0.71, 0.72)]  # variant a varies, variant b hardly
    tasks, level = [task(labels, spread)], [stats.chance(labels, regression=False)]
    assert np.array_equal(
        stats.bootstrap_skills(tasks, level, 200, [[m] for m in range(6)]), stats.bootstrap_skills(tasks, level, 200)
    )
    grouped = stats.bootstrap_skills(tasks, level, 500, [[0, 1, 2], [3, 4, 5]])[:, :, 0]
    low_a, high_a = stats.interval(grouped[:, 0])
    low_b, high_b = stats.interval(grouped[:, 1])
    assert high_a - low_a > 2 * (high_b - low_b)  # a's students differ by 0.13 each: its interval holds that
    own = [stats.score(s[0], labels, regression=False) - level[0] for s in spread]  # each student's skill
    assert abs(grouped[:, 0].mean() - np.mean(own[:3])) < 0.01 and abs(grouped[:, 1].mean() - np.mean(own[3:])) < 0.01


def test_holm_rejects_step_down_and_stops_at_the_first_it_cannot():
    assert stats.holm([0.01, 0.04, 0.03], 0.05) == [True, False, False]  # 0.01 <= 0.05/3; 0.03 > 0.05/2: stop
    assert stats.holm([0.001, 0.02, 0.04], 0.05) == [True, True, True]  # 0.001, 0.02 <= 0.025, 0.04 <= 0.05
    assert stats.holm([0.2], 0.05) == [False] and stats.holm([], 0.05) == []
    assert stats.p_value(np.array([0.1, 0.2, -0.1, 0.3])) == 0.5 and stats.p_value(np.ones(10)) == 0.0
    assert stats.p_value(np.array([0.0, 0.0, 0.1, 0.2])) == 0.5  # ties at zero: half to each side
