"""When placements change, and what each change moves.

Holds the predictors of the next loads (`predictors`), the rebalance plan (`plan`: segments of
steps, each on a placement solved on a schedule), when each rank switches to a new placement
(`switch`), what a rebalance moves (`migration`: each slot's transfer by kind), and a draft's
(MTP) placement beside its target's (`draft_fault`: SGLang #16044's fault, the EP sizes both
admit). Takes in the routed loads `[S, L, E]` and a schedule's settings; gives out `Segment`s.
Imports `base`, `placement`, `cost` (a move's bytes in the whole model), `solvers` and `traces`
(a drafted run's two traces).
"""
