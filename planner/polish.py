"""Local search on the simulated time, from the ILP's partition.

The stage ILP minimises the closed form (planner/cost_model.py `evaluate`): the busiest rank's time per
micro-batch times (m + bubble), plus the tail. The search reports the schedule simulated from the stage
times (planner/shared_cores.py), which also depends on where the lighter stages sit: partitions the closed
form rates equal, or nearly, can simulate differently. Starting from the ILP's optimum, `polish` moves
stage boundaries by one layer (one boundary; up to SPAN neighbouring ones together, a layer handed on
across stages; with interleaved stages, two apart whose layers go from one rank to another and back, which
keeps each rank's load), keeps the best move that fits memory and shortens the simulated time, and stops when none
does. Moves whose cheap lower bound (`evaluation_lower_bound`) cannot beat the best time found are not
simulated.

Recompute under a move: a rank's memory depends only on how many of its blocks it recomputes (its
stages' activations add up), and a schedule run in a fixed order never gets shorter when an operation gets
longer, so for given boundaries the best plan recomputes on each rank the fewest blocks that fit. With
interleaved stages the rank's count is spread over its stages, and a move may hand one recomputed block
from one of its stages to another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from meshplan.planner.cost_model import Evaluation, StageProblem, evaluate, rank_memory, rank_of_stages

IMPROVE = 1 - 1e-9  # a move must shorten the simulated time by more than rounding
MAX_ROUNDS = 64  # moves kept per polish; each shortens the time, so the loop ends before this in practice
SPAN = 3  # the most neighbouring boundaries one move shifts together


def polish(problem: StageProblem, bounds: list[int], recompute: list[int], ev: Evaluation, time: float,
           simulate: Callable[[Evaluation], float], bound: Callable[[Evaluation], float],
           max_rounds: int = MAX_ROUNDS) -> tuple[list[int], list[int], Evaluation, float, int]:
    """(bounds, recompute, evaluation, simulated time, simulations run) of the best partition reached by
    steepest descent from (bounds, recompute), whose simulated time is `time`. `simulate` gives an
    evaluation's reported time, `bound` a lower bound on it (0 where none is known)."""
    moves = _Moves(problem)
    seen = {(tuple(bounds), tuple(recompute))}
    runs = 0
    for _ in range(max_rounds):
        best = None
        for wide in (False, True):  # the pairs of moves only where no single move helps
            for nb, nr in moves.around(bounds, recompute, wide):
                key = (tuple(nb), tuple(nr))
                if key in seen:
                    continue
                seen.add(key)
                cand = evaluate(problem, nb, nr)
                if not cand.feasible or bound(cand) >= time * IMPROVE:
                    continue
                runs += 1
                t = simulate(cand)
                if t < time * IMPROVE:
                    best, time = (nb, nr, cand), t
            if best is not None:
                break
        if best is None:
            break
        bounds, recompute, ev = best
    return bounds, recompute, ev, time, runs


def fewest_recompute(problem: StageProblem, bounds: list[int], most: bool = False) -> list[int]:
    """Recomputed blocks per stage for these bounds: on each rank the fewest that fit (every block under
    recompute "all", none under "none"); `most`: every block recompute allows (the least memory)."""
    moves = _Moves(problem)
    if most:
        return moves.counts(bounds) if problem.recompute != "none" else [0] * problem.num_stages
    return moves.recompute_for(bounds, [0] * problem.num_stages)


class _Moves:
    """The neighbours of a partition, each with the recompute it needs."""

    def __init__(self, problem: StageProblem):
        self.P = problem
        self.ranks = rank_of_stages(problem)
        self.prefix = [0]  # prefix[i]: blocks among layers [0, i)
        for kind in problem.kinds:
            self.prefix.append(self.prefix[-1] + (kind == "block"))
        self.free = problem.recompute == "free" and problem.rec_saving > 0

    def counts(self, bounds: list[int]) -> list[int]:
        return [self.prefix[b] - self.prefix[a] for a, b in zip(bounds, bounds[1:])]

    def around(self, bounds: list[int], recompute: list[int], wide: bool
               ) -> Iterator[tuple[list[int], list[int]]]:
        """The moves (`wide`: the pairs of moves, else the others)."""
        P, S = self.P, len(bounds) - 1
        if wide:
            if len(self.ranks) < S:  # interleaved: two single moves that hand a layer along and back
                yield from self.pairs(bounds, recompute)
            return
        for i in range(1, S):
            for j in range(i, min(i + SPAN, S)):
                for step in (-1, 1):
                    nb = bounds.copy()
                    for k in range(i, j + 1):
                        nb[k] += step
                    if nb[i] <= nb[i - 1] or nb[j] >= nb[j + 1] or \
                            (P.cuts and not all(P.cuts[nb[k]] for k in range(i, j + 1))):
                        continue
                    yield nb, self.recompute_for(nb, recompute)
        if self.free:  # one recomputed block handed to the rank's next or previous stage
            counts = self.counts(bounds)
            for stages in self.ranks:
                for a, b in [*zip(stages, stages[1:]), *zip(stages[1:], stages)]:
                    if recompute[a] > 0 and recompute[b] < counts[b]:
                        nr = list(recompute)
                        nr[a] -= 1
                        nr[b] += 1
                        yield list(bounds), nr

    def pairs(self, bounds: list[int], recompute: list[int]
              ) -> Iterator[tuple[list[int], list[int]]]:
        """Two boundaries, not neighbours, each moved by a layer, the first handing a layer from one rank to
        another and the second one back: each rank's load stays, the stages' order of work changes."""
        P, S = self.P, len(bounds) - 1
        single = [(i, step) for i in range(1, S) for step in (-1, 1)]
        for x, (i, si) in enumerate(single):
            for j, sj in single[x + 1:]:
                if j <= i + 1 or self.flow(i, si) != self.flow(j, sj)[::-1]:
                    continue
                nb = bounds.copy()
                nb[i] += si
                nb[j] += sj
                if all(nb[k] > nb[k - 1] for k in (i, i + 1, j, j + 1)) and \
                        (not P.cuts or (P.cuts[nb[i]] and P.cuts[nb[j]])):
                    yield nb, self.recompute_for(nb, recompute)

    def flow(self, i: int, step: int) -> tuple[int, int]:
        """(rank that gives a layer, rank that takes it) when boundary i moves by step."""
        giver, taker = (i, i - 1) if step > 0 else (i - 1, i)
        return self.P.rank[giver], self.P.rank[taker]

    def recompute_for(self, bounds: list[int], recompute: list[int]) -> list[int]:
        """The recompute of a move: every block (recompute "all"), none, or each rank's fewest that fit
        (found by bisection on every rank at once), spread over the rank's stages."""
        P = self.P
        counts = self.counts(bounds)
        if P.recompute == "all":
            return counts
        if not self.free:
            return list(recompute)
        caps = [sum(counts[s] for s in stages) for stages in self.ranks]
        start = [min(sum(recompute[s] for s in stages), cap) for stages, cap in zip(self.ranks, caps)]
        searches = [_Least(g, cap) for g, cap in zip(start, caps)]
        limit = P.mem_limit * (1 + 1e-9)
        while True:
            trial = self.spread([q.guess for q in searches], counts)
            for q, mem in zip(searches, rank_memory(P, bounds, trial)):
                q.learn(mem <= limit)
            if any(q.hopeless for q in searches):
                return trial  # some rank does not fit even recomputing all its blocks
            if all(q.done for q in searches):
                return self.spread([q.guess for q in searches], counts)

    def spread(self, totals: list[int], counts: list[int]) -> list[int]:
        """Each rank's recomputed blocks over its stages, as evenly as their blocks allow (earlier stages
        first)."""
        out = [0] * len(counts)
        for stages, total in zip(self.ranks, totals):
            left = total
            open_ = [s for s in stages if counts[s] > 0]
            while left > 0 and open_:
                share, extra = divmod(left, len(open_))
                for k, s in enumerate(open_):
                    take = min(counts[s] - out[s], share + (k < extra))
                    out[s] += take
                    left -= take
                open_ = [s for s in open_ if out[s] < counts[s]]
        return out


class _Least:
    """The fewest blocks a rank must recompute to fit, searched from a guess (the count before the move,
    usually within one of the answer): steps away from the guess that double, then bisection. Memory
    falls as the count grows, so `learn` narrows [lo, hi]: lo the least count not known to overflow, hi
    the least known to fit (None until one does)."""

    def __init__(self, guess: int, cap: int):
        self.guess, self.cap, self.lo, self.hi, self.step = guess, cap, 0, None, 1

    def learn(self, fits: bool) -> None:
        g = self.guess
        if fits:
            self.hi = g
        else:
            self.lo = g + 1
        if self.done or self.hopeless:
            if self.done:
                self.guess = self.hi
            return
        if self.hi is None:  # overflowing so far: step up
            self.guess = min(self.cap, g + self.step)
        elif fits and self.hi - self.lo > 1:  # fitting so far: step down
            self.guess = max(self.lo, g - self.step)
        else:
            self.guess = (self.lo + self.hi) // 2 if self.hi - self.lo > 1 else self.lo
        self.step *= 2

    @property
    def done(self) -> bool:
        return self.hi is not None and self.lo >= self.hi

    @property
    def hopeless(self) -> bool:
        return self.hi is None and self.lo > self.cap
