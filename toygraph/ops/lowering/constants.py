"""The numbers the lowerings and the kernels must agree on, defined here once.

The launches (grids, tiles, block sizes) are computed from these in Python, and
:func:`constant_defines` emits them as ``#define``s at the top of every kernel module
(sources.module_source), so the ``.cu`` files use the macros and never restate a number.
A test checks that every macro is emitted and that no kernel source defines one itself.
"""
from __future__ import annotations

# --- every kernel (include/common.cuh) --------------------------------------------------------
MAXD = 8          # dims of a Strided walk (struct Strided in common.cuh)
THREADS = 256     # threads per block of the elementwise, row-wise and reduction kernels

# --- f32 and block-format matmuls (ops/gemm/matmul.cu, ops/gemm/qmatmul.cu) -----------------------------
MM_BM = 64        # output tile rows
MM_BN = 64        # output tile columns
MM_BK = 16        # k slice staged in shared memory
MM_THREADS = 256  # 16 x 16 threads, each 4 x 4 outputs of the 64 x 64 tile

# --- tensor-core matmuls (ops/include/tc_layout.cuh, ops/gemm/tc_matmul.cu) --------------------------------
TC_BM = 128       # output tile rows (== TC_BN: ops/gemm/ TC_TILE)
TC_BN = 128
TC_THREADS = 256  # 8 warps, 2 x 4
TC_WM = 64        # one warp's sub-tile
TC_WN = 32
TC_MI = TC_WM // 16   # mma tiles of 16 x 8 per warp sub-tile
TC_NI = TC_WN // 8
TC_BF16_BK = 32   # bf16: 32-deep k slices, rows padded by 8 halves (bank-conflict free)
TC_BF16_LD = 40
TC_TF32_BK = 16   # tf32: 16-deep k slices, rows padded by 4 words
TC_TF32_LD = 20

# --- fused attention (ops/flash_attention/flash_attention.cu) -------------------------------------------
#: head_dim bound -> (BT, TPR): BT x BT query/key tiles, TPR threads per tile row. A head_dim
#: runs on the smallest bound >= it; flash_attention.cu instantiates each bound's kernels with
#: ``TG_ATTN_BT_<HD>``, ``TG_ATTN_TPR_<HD>`` and ``__launch_bounds__(TG_ATTN_THREADS_<HD>)``.
ATTN_TILES = {32: (32, 4), 64: (32, 4), 128: (16, 8)}
ATTN_HEAD_DIMS = tuple(sorted(ATTN_TILES))

# --- tensor-core attention (ops/flash_attention/tc_attention.cu) ---------------------------------------------
TCA_THREADS = 128  # 4 warps, 16 tile rows each
TCA_BQ = 64        # rows a block owns: queries (forward, dq) or keys (dk/dv)
TCA_PAD = 8        # shared rows of HD + 8 bf16: ldmatrix's 8 row reads hit distinct banks
#: head_dim bound -> rows of the tiles streamed through shared memory, double-buffered with
#: cp.async (keys in the forward and dq, queries in dk/dv): two stages of two tiles plus
#: the block's own rows staged once fit 48 KB of static shared memory at every bound.
TCA_TILES = {64: 64, 128: 32, 256: 16}
TCA_HEAD_DIMS = tuple(sorted(TCA_TILES))


def tca_smem_halves(hd_bound: int) -> int:
    """bf16 elements of a tensor-core attention block's shared buffer: the larger of the
    block's own 64 rows and two stages of two streamed tiles."""
    return max(TCA_BQ, 4 * TCA_TILES[hd_bound]) * (hd_bound + TCA_PAD)


# --- multi-tensor kernels (ops/update/update.cu: AdamW and the gradient norm over many tensors) -------
#: Tensors one launch takes: their TgTensorList (4 pointers, a size, a scale and a first
#: block each) rides in the kernel's parameters, which must stay under 4 KB on sm_80.
LIST_TENSORS = 64

# --- the gated delta rule (ops/deltanet/deltanet.cu) ----------------------------------------------------
DELTA_MAX_DK = 256   # key head size bound of the step-wise kernel: a state column per thread
DELTA_CHUNK = 64     # chunk bound of the chunked kernels (their per-step shared arrays)

#: The macros emitted into the kernel source, name -> value, in the order they are emitted.
DEFINES: dict[str, int] = {
    "TG_MAXD": MAXD, "TG_THREADS": THREADS,
    "MM_BM": MM_BM, "MM_BN": MM_BN, "MM_BK": MM_BK, "MM_THREADS": MM_THREADS,
    "TC_BM": TC_BM, "TC_BN": TC_BN, "TC_THREADS": TC_THREADS, "TC_WM": TC_WM, "TC_WN": TC_WN,
    "TC_MI": TC_MI, "TC_NI": TC_NI, "TC_BF16_BK": TC_BF16_BK, "TC_BF16_LD": TC_BF16_LD,
    "TC_TF32_BK": TC_TF32_BK, "TC_TF32_LD": TC_TF32_LD, "TG_DELTA_MAX_DK": DELTA_MAX_DK,
    "TG_LIST_TENSORS": LIST_TENSORS, "TG_DELTA_CHUNK": DELTA_CHUNK,
}
DEFINES.update({"TG_TCA_THREADS": TCA_THREADS, "TG_TCA_BQ": TCA_BQ, "TG_TCA_PAD": TCA_PAD})
for _hd, _rows in TCA_TILES.items():
    DEFINES.update({f"TG_TCA_TILE_{_hd}": _rows, f"TG_TCA_SMEM_{_hd}": tca_smem_halves(_hd)})
for _hd, (_bt, _tpr) in ATTN_TILES.items():
    DEFINES.update({f"TG_ATTN_BT_{_hd}": _bt, f"TG_ATTN_TPR_{_hd}": _tpr,
                    f"TG_ATTN_THREADS_{_hd}": _bt * _tpr})


def constant_defines() -> str:
    """:data:`DEFINES` as C macros, one per line."""
    lines = ["// generated from toygraph.ops.lowering.constants"]
    lines += [f"#define {name} {value}" for name, value in DEFINES.items()]
    return "\n".join(lines) + "\n"
