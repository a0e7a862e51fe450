"""Measure many benchmarks to the precision their use needs, in interleaved rounds.

An analysis that adds measured times up (a brick estimate, a lower bound) asks each term the
standard error its share of the sum may keep (:func:`budgets`), and measures the whole model
it is compared with to the same precision. :class:`Rounds` holds every term open
(a :class:`~trims.evaluation.measure.Sampler` each), pilots it, then gives every term still
short of its goal the runs its standard error says are missing, a short slice per round, so a
drift in the machine's background load moves all of them alike. A round that follows another
benchmark's runs starts re-warmed (Note [re-warm between rounds] in
:mod:`trims.evaluation.measure`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trims.evaluation.generator import Bencher, Benchmark
    from trims.evaluation.measure import Measurement, Sampler


def whole_key(model: str) -> str:
    """An analysis's key for ``model`` measured whole (its terms are keyed by signature)."""
    return f"model:{model}"


def budgets(counts: Mapping[str, float], estimate_ms: float, target_rel: float) -> dict[str, float]:
    """Per independent term of an estimate, the standard error (ms) its measurement may keep.

    An estimate ``E = sum_k c_k t_k`` over ``u`` independently measured terms ``k`` (a unique
    brick or layer with ``c_k`` occurrences; the empty model with as many as the runs it is
    subtracted for; a conversion with the round trips the bricks made beyond the whole
    model's, a half for each single conversion; signs do not matter) has ``SE(E)^2 = sum_k
    c_k^2 s_k^2``. Asking ``|c_k| s_k <= target_rel * E / sqrt(u)`` of every term gives
    ``SE(E) <= target_rel * E``: the precision a whole-model measurement is asked for. A term
    with share ``p_k = |c_k| t_k / E`` needs ``s_k / t_k <= target_rel / (p_k sqrt(u))``: the
    smaller its share, the looser its precision and the sooner it stops.
    """
    share = target_rel * max(estimate_ms, 0.0) / math.sqrt(max(len(counts), 1))
    return {key: share / abs(c) for key, c in counts.items() if c}


@dataclass
class Term:
    """One benchmark of an analysis, measured by its ``bencher`` (framework and variant)."""

    bench: Benchmark
    bencher: Bencher
    result: Measurement | None = None
    sampler: Sampler | None = None

    def current(self) -> Measurement:
        if self.sampler is not None:
            return self.sampler.measurement()
        assert self.result is not None, "a term is measured or open"
        return self.result

    @property
    def spent(self) -> bool:
        """Whether its closed measurement used up the run or time budget (so opening it again
        would only add a session's cost and stop at once)."""
        s, r = self.bencher.settings, self.result
        return r is not None and (r.reps >= s.max_reps or r.elapsed_s >= s.max_time_s)


#: each round gives every benchmark still short of its precision at most about this much run
#: time (a 200 ms model: one run per round), so rounds stay short and interleaved
ROUND_S = 0.02


def runs_wanted(m: Measurement, goal_ms: float) -> int:
    """Runs a benchmark short of its goal takes this round: the runs its standard error says
    are still missing (it falls as 1/sqrt(n)), at most a round's time slice, at least one."""
    missing = m.reps * ((m.std_error_ms / max(goal_ms, 1e-12)) ** 2 - 1.0)
    per_round = ROUND_S / max(m.trimmed_mean_ms / 1e3, 1e-6)
    return max(1, math.ceil(min(missing, per_round)))


class Rounds:
    """The open terms of an analysis, by key, and the ones that ran out of budget."""

    def __init__(self) -> None:
        self.terms: dict[str, Term] = {}
        self.imprecise: set[str] = set()

    def open(
        self, key: str, bench: Benchmark, bencher: Bencher, sampler: Sampler | None = None
    ) -> None:
        """Make ``key`` a term: from the database, or opened and piloted (``min_reps`` runs).

        ``sampler``: one the caller opened (to learn something from its first run); if the
        database already holds the result, its cost is added to the stored one's.
        """
        if key in self.terms:
            return
        term = Term(bench, bencher, result=bencher.cached(bench))
        if sampler is not None and term.result is not None:
            term.result = replace(term.result, elapsed_s=term.result.elapsed_s + sampler.elapsed_s)
        elif sampler is not None:
            term.sampler = sampler
        elif term.result is None:
            term.sampler = bencher.open(bench)
        if term.sampler is not None:
            term.sampler.run_more(bencher.settings.min_reps)
        self.terms[key] = term

    def run(self, goals: Callable[[], dict[str, float]]) -> None:
        """Measure in rounds, every term short of its goal a slice per round, until none is.

        ``goals`` gives, from the measurements so far, the standard error (ms) asked of each
        term. A closed term short of its goal is opened again (both costs counted), whatever
        it was asked before: a standard error need not fall with every run, so a term that met
        a tight goal once may stand above a looser one later. A term whose run or time budget
        is spent stops where it is and is marked imprecise (MXNet's terms cannot be reopened:
        they are too).
        """
        while True:
            due: list[tuple[Term, float]] = []
            for key, goal in goals().items():
                term = self.terms[key]
                if term.current().std_error_ms <= goal:
                    continue
                if term.sampler is None:
                    if term.spent or term.bencher.framework == "mxnet":
                        self.imprecise.add(key)
                        continue
                    assert term.result is not None
                    term.sampler = term.bencher.open(term.bench)
                    term.sampler.setup_s += term.result.elapsed_s
                    term.sampler.run_more(term.bencher.settings.min_reps)
                if term.sampler.capped:
                    self.imprecise.add(key)
                    continue
                due.append((term, goal))
            if not due:
                return
            for term, goal in due:
                assert term.sampler is not None
                term.sampler.run_more(runs_wanted(term.sampler.measurement(), goal))

    def close(self) -> None:
        """Store every open term's result and free its session."""
        for term in self.terms.values():
            if term.sampler is not None:
                term.result = term.sampler.measurement()
                term.bencher.store(term.bench, term.result)
                term.sampler = None

    def result(self, key: str) -> Measurement:
        result = self.terms[key].result
        assert result is not None, "close() stores every term"
        return result

    def results(self) -> dict[str, Measurement]:
        return {key: self.result(key) for key in self.terms}
