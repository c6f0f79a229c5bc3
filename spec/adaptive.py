"""Adaptive speculation: each step, each request verifies the draft nodes that pay for
themselves, and none when none do.

The choice maximises the step's expected tokens per millisecond. Tokens: each decoding
request emits one, plus its draft nodes' chances of being accepted. Milliseconds:
`spec.step_cost.StepCost`, the forward's cost curve measured at load at every row count and
scaled to what steps cost now, plus the drafter's time per drafting request and the
acceptance work per node. A step that also runs a prompt chunk is charged without the
chunk's time (the chunk runs either way), its nodes at what they add on top of it. Nodes
join in order of their chance, across the batch, each request's in its proposal's order (a
proposal cut to its first k nodes is a proposal in its own right: nodes are topological),
and the count with the best ratio wins: the cost curve
has steps (torch's int4 kernel works in blocks of 4 rows), so the best count is not always
where one more node stops paying.

A node's chance: drafters score their nodes (`Proposal.scores`: a path probability, a
match's strength), and the controller learns how often nodes of each score kind, score band
and depth were accepted, across requests. A drafter without scores is judged by rank (a
node's place in the proposal), per request, starting from the drafter-wide figures. Counts
decay (`memory`), so a drifting drafter is followed.

Two decisions per step. Before drafting, whether a request drafts at all: it does while
what its cuts were expected to gain over plain decoding (its `worth`) outweighs what its
drafter's time would have decoded. A new request's worth starts from every request's (its
first proposals say little), and while a request does not draft, its worth returns toward
every request's at the rate its steps are forgotten: what a request's text offers changes
(a RAG answer starts copying its sources after a sentence of its own), and one weak first
proposal must not switch a cheap drafter off until the next probe. After drafting, with the
proposals in hand, how many of each proposal's nodes are verified. Now and then a request probes: it drafts whatever its worth and verifies one node
beyond its cut (nodes judged not to pay are never verified otherwise, and their estimates
would never recover); probes that fail come ever rarer, and one whose extra node was accepted
is followed by another at the next step, which drafts and cuts on what the probe showed and
tries the node after: a drafter that turns good is followed in as many steps as its tree has
nodes, not one node per `probe_every` steps (nor, with its worth judged before the probe, a
request left not drafting until its next probe). Both depend on past steps and on
the proposals, never on this step's target logits, so rejection sampling keeps the output exactly the
target's. A seeded sampled request keeps its whole tree: its draws reproduce only along one
speculation path, and the choice depends on timing.

At T = 0 the accepted path of a proposal cut to k nodes is exactly the full path's nodes
among the first k (a node's children carry distinct tokens), so a verified node says
exactly whether it paid.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterable

from spec.batch_guard import GuardConfig
from spec.step_cost import CostCurve, StepCost


@dataclass(frozen=True)
class AdaptiveConfig:
    enabled: bool = True        # False: every request verifies its drafter's whole tree every step
    probe_every: int = 16       # steps between a request's probes (drafting, a node more) while they pay
    max_probe_every: int = 128  # ... and at most this many while they do not
    memory: float = 0.9         # weight a request's earlier steps keep at each new one
    prior_weight: float = 4.0   # steps' worth of the drafter-wide estimate in a request's own
    first_guess: float = 0.5    # a node's chance before any like it was verified
    score_bands: int = 10       # scores in [0, 1] are learned in this many bands
    smoothing: float = 0.1      # weight of the newest step in the cost averages
    # A forward's cost curve stated instead of timed at load, and kept as stated (step_cost.StatedCost):
    # tests and what-if runs pin the controller's choices to a machine's curve, whatever this host's timings.
    cost_curve: CostCurve | None = None
    # Whether speculation pays end to end at the batch's size, measured in windows (spec/batch_guard.py);
    # off where the cost curve is stated, as the controller's other timing-driven choices are pinned then.
    guard: GuardConfig = GuardConfig()

    def __post_init__(self):
        if not 1 <= self.probe_every <= self.max_probe_every or not 0 < self.memory <= 1 \
                or self.prior_weight <= 0 or not 0 <= self.first_guess <= 1 or self.score_bands < 1 \
                or not 0 < self.smoothing <= 1:
            raise ValueError("AdaptiveConfig: need 1 <= probe_every <= max_probe_every, 0 < memory <= 1, "
                             "prior_weight > 0, 0 <= first_guess <= 1, score_bands >= 1, 0 < smoothing <= 1")
        if not isinstance(self.guard, GuardConfig):
            raise ValueError(f"AdaptiveConfig: guard must be a GuardConfig, got {type(self.guard).__name__}")
        if self.cost_curve is not None and not isinstance(self.cost_curve, CostCurve):
            raise ValueError(f"AdaptiveConfig: cost_curve must be a CostCurve, got {type(self.cost_curve).__name__}")


class RankAcceptance:
    """Decayed counts, per rank (1: a proposal's first draft node), of nodes verified and of
    nodes on the accepted path."""

    def __init__(self, memory: float):
        self.memory = memory
        self.seen: list[float] = []
        self.hits: list[float] = []

    def observe(self, present: int, accepted: Iterable[int]) -> None:
        """One verified proposal of `present` draft nodes; `accepted`: the ranks on its path."""
        self.seen = [x * self.memory for x in self.seen]
        self.hits = [x * self.memory for x in self.hits]
        grow = present - len(self.seen)
        if grow > 0:
            self.seen += [0.0] * grow
            self.hits += [0.0] * grow
        for i in range(present):
            self.seen[i] += 1
        for rank in accepted:
            self.hits[rank - 1] += 1

    def rate(self, rank: int, prior: float, weight: float) -> float:
        """Chance that a node of `rank` is accepted: own counts with `weight` steps of `prior`."""
        i = rank - 1
        seen, hits = (self.seen[i], self.hits[i]) if i < len(self.seen) else (0.0, 0.0)
        return (hits + weight * prior) / (seen + weight)


class ScoreAcceptance:
    """Decayed counts of nodes verified and accepted per (score kind, score band, depth)."""

    def __init__(self, bands: int, memory: float = 0.99):
        self.bands, self.memory = bands, memory
        self.cells: dict[tuple[str, int, int], list[float]] = {}    # key -> [seen, hits]

    def key(self, kind: str, score: float, depth: int) -> tuple[str, int, int]:
        return kind, min(int(score * self.bands), self.bands - 1), depth

    def observe(self, kind: str, score: float, depth: int, accepted: bool) -> None:
        cell = self.cells.setdefault(self.key(kind, score, depth), [0.0, 0.0])
        cell[0] = cell[0] * self.memory + 1
        cell[1] = cell[1] * self.memory + accepted

    def rate(self, kind: str, score: float, depth: int, prior: float) -> float:
        seen, hits = self.cells.get(self.key(kind, score, depth), (0.0, 0.0))
        return (hits + prior) / (seen + 1)


@dataclass
class SpecHistory:
    """What one request's speculation has shown so far (kept on its `Request`)."""
    ranks: RankAcceptance
    interval: int               # steps from one probe to the next (`AdaptiveController._cut`)
    worth: float | None = None  # tokens its cuts were expected to gain over plain decoding (None: none yet)
    steps: int = 0              # steps it decoded in
    next_probe: int = 0         # the step of its next probe
    reach: int = 0              # nodes the last probe verified, until a cut keeps as many (0: none)
    probe_node: int = 0         # the node a probe verified beyond its cut, until its outcome is seen

    @property
    def probing(self) -> bool:
        return self.steps >= self.next_probe


@dataclass(frozen=True)
class Candidate:
    """A request as the controller sees it: its history, and after drafting its proposal's
    draft nodes (their depths and the drafter's scores, if any)."""
    history: SpecHistory
    depths: tuple[int, ...] = ()
    scores: tuple[float, ...] | None = None
    score_kind: str = ""


def best_prefixes(gains: list[list[float]], tokens: float, cost_ms: Callable[[int], float]) -> list[int]:
    """How many leading nodes of each request to verify. gains[r][i]: expected accepted tokens
    from request r's node i + 1; `tokens`: expected tokens without any; cost_ms(nodes): the
    step's milliseconds. Nodes join best gain first (each request's in its own order) and
    the count with the most tokens per millisecond wins."""
    heap = [(-g[0], r) for r, g in enumerate(gains) if g]
    heapq.heapify(heap)
    taken, order = [0] * len(gains), []
    best_rate, best_len = tokens / cost_ms(0), 0
    while heap:
        neg, r = heapq.heappop(heap)
        taken[r] += 1
        tokens -= neg
        order.append(r)
        rate = tokens / cost_ms(len(order))
        if rate > best_rate:
            best_rate, best_len = rate, len(order)
        if taken[r] < len(gains[r]):
            heapq.heappush(heap, (-gains[r][taken[r]], r))
    keep = [0] * len(gains)
    for r in order[:best_len]:
        keep[r] += 1
    return keep


class AdaptiveController:
    """Chooses each step's draft nodes per request (see the module docstring). Without a
    measured cost curve (`cost` None) or with `enabled` False every request drafts and
    verifies its whole tree."""

    def __init__(self, config: AdaptiveConfig = AdaptiveConfig(), cost: StepCost | None = None):
        self.config = config
        self.cost = cost
        self.prior = RankAcceptance(0.99)       # every request's proposals, slowly forgotten
        self.scored = ScoreAcceptance(config.score_bands)
        self.typical: float | None = None       # every request's worth, slowly forgotten
        self.state = True                       # whether the last step verified any draft node
        self.last_budget = 0                    # the most draft nodes a request verified in it

    @property
    def active(self) -> bool:
        return self.config.enabled and self.cost is not None

    def history(self) -> SpecHistory:
        return SpecHistory(RankAcceptance(self.config.memory), self.config.probe_every, worth=self.typical,
                           next_probe=self.config.probe_every)

    def drafts(self, history: SpecHistory, decoding: int, base_rows: int, prompt_rows: int = 0) -> bool:
        """Before drafting: whether this request drafts this step. `decoding`: requests
        emitting a token this step; `base_rows`: the step's rows without draft nodes, of which
        `prompt_rows` are prompt chunks' (see `_step_ms`)."""
        history.steps += 1
        if not self.active or history.worth is None or history.probing:
            return True
        # tokens expected from drafting against those the drafter's time would decode
        plain_rate = max(decoding, 1) / self._step_ms(base_rows, decoding, 0, prompt_rows=prompt_rows)
        if history.worth >= plain_rate * self.cost.drafting_ms():
            return True
        if self.typical is not None:        # not drafting: forgetting why
            history.worth = _blend(history.worth, self.typical, self.config.memory)
        return False

    def nodes_to_draft(self, history: SpecHistory, decoding: int, base_rows: int, most: int,
                       prompt_rows: int = 0) -> int:
        """Before drafting, for a drafter whose time grows with each node (`drafts` said this
        request drafts): the proposal size with the most tokens per millisecond by the
        request's acceptance per rank, each node's drafting included; one more while probing."""
        if not self.active:
            return most
        per_node = self.cost.propose_node_ms()

        def cost_ms(nodes: int) -> float:
            return self._step_ms(base_rows, decoding, nodes, drafted=1, prompt_rows=prompt_rows) + nodes * per_node
        (cut,) = best_prefixes([self._rank_gains(history, most)], max(decoding, 1), cost_ms)
        return min(most, max(1, cut + int(history.probing)))

    def trim(self, cands: list[Candidate], decoding: int, base_rows: int, prompt_rows: int = 0) -> list[int]:
        """After drafting: how many of each proposal's draft nodes to verify. `base_rows`: the
        step's rows without these candidates' draft nodes, `prompt_rows` of them prompt chunks'."""
        keep = self._cut(cands, decoding, base_rows, prompt_rows) if self.active else [len(c.depths) for c in cands]
        self.state = any(keep)
        self.last_budget = max(keep, default=0)
        return keep

    def _cut(self, cands: list[Candidate], decoding: int, base_rows: int, prompt_rows: int) -> list[int]:
        """`best_prefixes`' cut; a probing candidate verifies one node more than its cut (the
        first node judged not to pay: its estimate is refreshed at the cost of one row). Each
        request remembers what its cut was worth: its nodes' expected tokens less what their
        share of the extra time would have decoded plainly."""
        def step_ms(nodes: int) -> float:
            return self._step_ms(base_rows, decoding, nodes, drafted=len(cands), prompt_rows=prompt_rows)
        gains = [self.gains(c) for c in cands]
        cut = best_prefixes(gains, max(decoding, 1), step_ms)
        plain_rate, nodes = max(decoding, 1) / step_ms(0), sum(cut)
        per_node = (step_ms(nodes) - step_ms(0)) / nodes if nodes else 0.0
        keep = []
        for c, g, k in zip(cands, gains, cut):
            worth = sum(g[:k]) - plain_rate * per_node * k
            c.history.worth = _blend(c.history.worth, worth, self.config.memory)
            self.typical = _blend(self.typical, worth, self.prior.memory)
            keep.append(self._probe(c.history, k, len(c.depths)) if c.history.probing else self._settle(c.history, k))
        return keep

    def _probe(self, h: SpecHistory, cut: int, nodes: int) -> int:
        """A probe verifies a node beyond the cut; the next comes twice as far on (at most
        max_probe_every): a probe costs a drafting and a row, half a step on AVX2 machines."""
        c = self.config
        if cut < nodes:
            h.reach, cut = cut + 1, cut + 1
            h.probe_node = cut
            h.interval = min(2 * h.interval, c.max_probe_every)
        h.next_probe = h.steps + h.interval
        return cut

    def _settle(self, h: SpecHistory, cut: int) -> int:
        """A cut that keeps what the last probe reached: the probe found nodes that pay, and
        probes come every probe_every steps again."""
        if h.reach and cut >= h.reach:
            h.interval, h.reach = self.config.probe_every, 0
            h.next_probe = min(h.next_probe, h.steps + h.interval)
        return cut

    def observe(self, cand: Candidate, accepted: Iterable[int]) -> None:
        """A verified proposal (`cand`, as trimmed) and the node indices it accepted."""
        accepted, h = set(accepted), cand.history
        if h.probe_node and h.probe_node in accepted:     # the node beyond the cut paid: look further at once
            h.interval, h.next_probe = self.config.probe_every, h.steps + 1
        h.probe_node = 0
        h.ranks.observe(len(cand.depths), accepted)
        self.prior.observe(len(cand.depths), accepted)
        if cand.scores is not None:
            for node, (score, depth) in enumerate(zip(cand.scores, cand.depths), start=1):
                self.scored.observe(cand.score_kind, score, depth, node in accepted)

    def gains(self, cand: Candidate) -> list[float]:
        """Each draft node's chance of being accepted, in node order."""
        c = self.config
        if cand.scores is not None:
            return [self.scored.rate(cand.score_kind, s, d, c.first_guess) for s, d in zip(cand.scores, cand.depths)]
        return self._rank_gains(cand.history, len(cand.depths))

    def _rank_gains(self, history: SpecHistory, nodes: int) -> list[float]:
        """The chance of nodes of rank 1..nodes, by the request's counts and every request's."""
        c = self.config
        return [history.ranks.rate(i, self.prior.rate(i, c.first_guess, 1.0), c.prior_weight)
                for i in range(1, nodes + 1)]

    def _step_ms(self, base_rows: int, decoding: int, nodes: int, drafted: int = 0, prompt_rows: int = 0) -> float:
        """The step's milliseconds charged to decoding, with `nodes` draft nodes after `drafted`
        requests drafted (the drafter's time is spent by then; its slowdown of the forward is
        not). A prompt chunk's `prompt_rows` run whatever is drafted, so their time is left out
        and the nodes cost what they add on top of them: a chunk's time counted in would make
        plain decoding look slow and any node cheap beside it."""
        cost = self.cost
        forward = cost.forward_ms(base_rows + nodes)
        if prompt_rows:
            forward += cost.forward_ms(max(base_rows - prompt_rows, 1)) - cost.forward_ms(base_rows)
        return forward + drafted * cost.slowdown_ms() + decoding * cost.request_ms() + nodes * cost.node_ms()


def _blend(old: float | None, new: float, memory: float) -> float:
    return new if old is None else memory * old + (1 - memory) * new
