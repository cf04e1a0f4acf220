"""k1: naive materialized attention, the "before" picture.

Three kernels, exactly the textbook formula, nothing fused:

    1. scores   S[b, h, i, j] = (q_i . k_j) * scale * log2(e)     (-inf where j > i if causal)
    2. softmax  P[b, h, i, :] = 2^(S - max) / sum 2^(S - max), in place, one warp per row
    3. output   O[b, i, h, c] = sum_j P[b, h, i, j] V[b, j, h, c]

S is an fp32 B x H x N x N buffer in global memory: it is written once, read and written by
the softmax, and read again by the third kernel. That traffic (and its size: 16 GiB at
B*H = 16, N = 16384) is what k2 removes. Kernels 1 and 3 use one thread per output element,
no shared memory, no tensor cores; S is kept in base-2 units so the softmax uses exp2.

Budget: kernel 1: 128 threads per CTA, one (b, h, i) row of 128 keys per CTA; kernel 2: 4
warps per CTA, one row per warp; kernel 3: d threads per CTA, one (b, i, h) output row.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32

from hopper_attn.common.contract import KernelSpec, compile_attention, run_attention
from hopper_attn.common.layouts import ndhb_view

_GRID_LIMIT = 65535   # CUDA's limit on gridDim.y and gridDim.z


def _workspace_bytes(problem) -> int:
    return 4 * problem.batch * problem.heads * problem.seqlen * problem.seqlen


def _limits(problem):
    if problem.batch * problem.heads > _GRID_LIMIT:
        return f"batch * heads must be <= {_GRID_LIMIT} (grid limit), got {problem.batch * problem.heads}"
    return None


def _workspace(problem, device):
    b, h, n = problem.batch, problem.heads, problem.seqlen
    return [torch.empty((b, h, n, n), dtype=torch.float32, device=device)]


SPEC = KernelSpec(
    name="k1",
    summary="naive: S = QK^T in global memory, softmax, PV (three kernels)",
    head_dims=(64, 128),
    max_seqlen=_GRID_LIMIT,
    workspace_bytes=_workspace_bytes,
    extra_limits=_limits,
)


class NaiveAttentionK1:
    keys_per_cta = 128
    rows_per_cta = 4

    def __init__(self, head_dim: int, causal: bool):
        self.head_dim = head_dim
        self.causal = causal

    def describe(self) -> dict:
        return {"kernels": 3, "workspace": "fp32 B x H x N x N"}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mS: cute.Tensor, scale_log2: Float32, stream):
        q, k, v, o = [ndhb_view(t) for t in (mQ, mK, mV, mO)]   # (N, d, H, B)
        n, heads, batch = q.shape[0], q.shape[2], q.shape[3]
        self.scores(q, k, mS, scale_log2).launch(
            grid=[cute.ceil_div(n, self.keys_per_cta), n, heads * batch],
            block=[self.keys_per_cta, 1, 1], stream=stream)
        self.softmax(mS).launch(
            grid=[cute.ceil_div(n * heads * batch, self.rows_per_cta), 1, 1],
            block=[32 * self.rows_per_cta, 1, 1], stream=stream)
        self.output(mS, v, o).launch(
            grid=[n, heads, batch], block=[self.head_dim, 1, 1], stream=stream)

    @cute.kernel
    def scores(self, mQ: cute.Tensor, mK: cute.Tensor, mS: cute.Tensor, scale_log2: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, i, bh = cute.arch.block_idx()
        heads, n = mQ.shape[2], mQ.shape[0]
        b, h = bh // heads, bh % heads
        j = bx * self.keys_per_cta + tidx
        if j < n:
            visible = True
            if cutlass.const_expr(self.causal):
                visible = j <= i
            s = -Float32.inf
            if visible:
                # 16-byte pieces of the query row i and the key row j
                q_row = cute.zipped_divide(mQ[i, None, h, b], (8,))
                k_row = cute.zipped_divide(mK[j, None, h, b], (8,))
                qc = cute.make_rmem_tensor((8,), Float32)
                kc = cute.make_rmem_tensor((8,), Float32)
                dot = Float32(0.0)
                for c in cutlass.range_constexpr(self.head_dim // 8):
                    qc.store(q_row[None, c].load().to(Float32))
                    kc.store(k_row[None, c].load().to(Float32))
                    for e in cutlass.range_constexpr(8):
                        dot += qc[e] * kc[e]
                s = dot * scale_log2
            mS[b, h, i, j] = s

    @cute.kernel
    def softmax(self, mS: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        batch, heads, n = mS.shape[0], mS.shape[1], mS.shape[2]
        row = bx * self.rows_per_cta + tidx // 32
        lane = tidx % 32
        if row < batch * heads * n:
            i = row % n
            h = (row // n) % heads
            b = row // (n * heads)
            s_row = mS[b, h, i, None]
            row_max = -Float32.inf
            for j in cutlass.range(lane, n, 32, unroll=1):
                row_max = cute.arch.fmax(row_max, s_row[j])
            row_max = cute.arch.warp_reduction_max(row_max)
            row_sum = Float32(0.0)
            for j in cutlass.range(lane, n, 32, unroll=1):
                row_sum += cute.math.exp2(s_row[j] - row_max, fastmath=True)
            row_sum = cute.arch.warp_reduction_sum(row_sum)
            inv_sum = 1.0 / row_sum
            for j in cutlass.range(lane, n, 32, unroll=1):
                s_row[j] = cute.math.exp2(s_row[j] - row_max, fastmath=True) * inv_sum

    @cute.kernel
    def output(self, mS: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor):
        c, _, _ = cute.arch.thread_idx()
        i, h, b = cute.arch.block_idx()
        n = mV.shape[0]
        p_row = mS[b, h, i, None]
        last = n
        if cutlass.const_expr(self.causal):
            last = i + 1                      # P is exactly 0 right of the diagonal
        acc = Float32(0.0)
        for j in cutlass.range(last, unroll=1):
            acc += p_row[j] * mV[j, c, h, b].to(Float32)
        mO[i, c, h, b] = acc.to(BFloat16)


def compile_kernel(problem, *, compile_options: str = "", **options):
    """Compile (or fetch from the cache) k1 for `problem`; options: none."""
    return compile_attention(SPEC, NaiveAttentionK1, problem, options, compile_options=compile_options, workspace_fn=_workspace)


def run_kernel(handle, q, k, v, out):
    run_attention(handle, q, k, v, out)
