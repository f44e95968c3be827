"""The evaluation suite's bag-of-words baseline: what a linear model on word counts reads from a task.

TF-IDF unigrams and bigrams (seen in at least two training texts, sub-linear counts), then a logistic
regression (C = 10) for a classification or a ridge regression (alpha = 1) for a regression; for a pair, both
texts' vectors and their element-wise product. The settings are fixed, chosen once when the tasks were built
(``benchmarks/quality/make_tasks.py`` stores each task's figure with the task): no choice is made on the
examples it is scored on. Needs scikit-learn (``pip install scikit-learn``).
"""

from __future__ import annotations

from typing import Any

from common.config import ConfigError


def predict(train: list[dict[str, Any]], test: list[dict[str, Any]], task: dict[str, Any]) -> list[Any]:
    """Fitted on ``train``'s rows, each of ``test``'s rows' prediction: a label, or a regression value.
    ``task`` names the columns and the kind (``text_column``, ``text_pair_column``, ``label_column``, ``kind``)."""
    try:
        from scipy.sparse import hstack
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression, Ridge
    except ImportError as err:
        raise ConfigError(f"baseline: the bag-of-words baseline needs scikit-learn ({err})") from None
    text, pair, label = task.get("text_column", "text"), task.get("text_pair_column"), task.get("label_column", "label")
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    if task["kind"] == "pair":
        vectorizer.fit([r[text] for r in train] + [r[pair] for r in train])

        def features(rows: list[dict[str, Any]]) -> Any:
            a, b = vectorizer.transform([r[text] for r in rows]), vectorizer.transform([r[pair] for r in rows])
            return hstack([a, b, a.multiply(b)]).tocsr()

        x_train, x_test = features(train), features(test)
    else:
        x_train = vectorizer.fit_transform([r[text] for r in train])
        x_test = vectorizer.transform([r[text] for r in test])
    y_train = [r[label] for r in train]
    if task["kind"] == "regression":
        return [float(v) for v in Ridge(alpha=1.0).fit(x_train, y_train).predict(x_test)]
    return LogisticRegression(C=10.0, max_iter=2000).fit(x_train, y_train).predict(x_test).tolist()
