"""Explicit vector code for the compiled loops (a numba intrinsic in LLVM IR).

numba leaves LLVM's SLP vectorizer off, and its loop vectorizer only takes loops of dozens of
iterations, so the toy MoE's 8-wide rows (`counting.layer_sums`) would run one lane at a time.
`pair_lanes` computes `LANES` output lanes of one pair as vector operations: the same IEEE
float32 and float64 operations, lane by lane and in the same order, as the scalar definition
(separate multiply and add, never fused), so its results are bit-identical to it. It is made
when the first loop that calls it compiles (`compiled.Deferred`): llvmlite and numba are not
imported with eplbsim.
"""

from __future__ import annotations

from typing import Any

from .compiled import Deferred

LANES = 8  # output lanes per call: one 256-bit float32 vector


def _splat(builder: Any, vector: Any, value: Any) -> Any:
    """`value` in every lane of `vector` (llvmlite IR)."""
    from llvmlite import ir

    index = ir.IntType(32)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(index, 0))
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                  ir.Constant(ir.VectorType(index, LANES), [0] * LANES))


def _lanes_at(context: Any, builder: Any, array_type: Any, array: Any, index: Any,
              vector: Any) -> Any:
    """A pointer to `vector` at element `index` of a 1-d C-contiguous array."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), vector.as_pointer())


def _pair_lanes() -> Any:
    """The numba intrinsic `pair_lanes` stands for."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def pair_lanes(typingctx, w, w_at, x, gate, grid, out, out_at, weighted, mult, weigh):
        """Lanes `[i, i + LANES)` of one toy-MoE pair's output, added to two accumulators.

        w: float32 1-d, the pair's expert matrix transposed (`w[w_at + j * D + n] = W[i + n, j]`);
        x: float32 `[D]` the token's hidden vector; gate: float32; grid: float64, a power of two;
        out, weighted: float64 1-d, lanes at `out_at`; mult: float64; weigh: bool.

        acc = w[j = 0] * x[0], then acc += w[j] * x[j] for j = 1 .. D - 1 (float32, in order);
        v = rint(float64(acc * gate) * grid) * (1 / grid); out += v; if weigh: weighted += mult * v.
        """
        sig = types.void(w, w_at, x, gate, grid, out, out_at, weighted, mult, weigh)

        def codegen(context, builder, signature, args):
            w_v, w_at_v, x_v, gate_v, grid_v, out_v, out_at_v, weighted_v, mult_v, weigh_v = args
            w_t, _, x_t, _, _, out_t, _, weighted_t = signature.args[:8]
            f32 = ir.VectorType(ir.FloatType(), LANES)
            f64 = ir.VectorType(ir.DoubleType(), LANES)
            xs = context.make_array(x_t)(context, builder, x_v)
            D = builder.extract_value(xs.shape, 0)

            def term(j):  # w[j] * x[j], [LANES] float32
                row = _lanes_at(context, builder, w_t, w_v, builder.add(w_at_v, builder.mul(j, D)),
                                f32)
                return builder.fmul(builder.load(row, align=4),
                                    _splat(builder, f32, builder.load(builder.gep(xs.data, [j]))))

            acc = cgutils.alloca_once(builder, f32)  # promoted to a register
            builder.store(term(ir.Constant(ir.IntType(64), 0)), acc)
            with cgutils.for_range(builder, builder.sub(D, ir.Constant(ir.IntType(64), 1))) as loop:
                j = builder.add(loop.index, ir.Constant(ir.IntType(64), 1))
                builder.store(builder.fadd(builder.load(acc), term(j)), acc)
            scaled = builder.fpext(builder.fmul(builder.load(acc), _splat(builder, f32, gate_v)),
                                   f64)
            rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f64, [f64]),
                                                  "llvm.rint.v8f64")
            inverse = builder.fdiv(ir.Constant(ir.DoubleType(), 1.0), grid_v)  # exact: a power of 2
            value = builder.fmul(
                builder.call(rint, [builder.fmul(scaled, _splat(builder, f64, grid_v))]),
                _splat(builder, f64, inverse))
            here = _lanes_at(context, builder, out_t, out_v, out_at_v, f64)
            builder.store(builder.fadd(builder.load(here, align=8), value), here, align=8)
            with builder.if_then(weigh_v):
                there = _lanes_at(context, builder, weighted_t, weighted_v, out_at_v, f64)
                builder.store(builder.fadd(builder.load(there, align=8),
                                           builder.fmul(_splat(builder, f64, mult_v), value)),
                              there, align=8)
            return context.get_dummy_value()

        return sig, codegen

    return pair_lanes


pair_lanes = Deferred(_pair_lanes)
