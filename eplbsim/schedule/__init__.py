"""When placements change, and what each change moves.

Holds the predictors of the next loads (`predictors`), the rebalance plan (`plan`: segments of
steps, each on a placement solved on a schedule), when each rank switches to a new placement
(`switch`) and what a rebalance moves (`migration`: each slot's transfer by kind). Takes in the
routed loads `[S, L, E]` and a schedule's settings; gives out `Segment`s. Imports `base`,
`placement`, `cost` (a move's bytes in the whole model) and `solvers`.
"""
