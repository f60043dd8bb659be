"""toygraph/cpu/gemm.h through cpu/engine.py: the products on a weight kept in its blocks
(x W^T by the panels or the row-dot kernel, g W by the panels) against the f64 product
of the decoded weight, for every block format, at ragged shapes (partial row blocks,
partial strips of W, partial K panels, partial backward panels); the results do not
depend on the number of threads; a deliberately broken panel index fails the same check.

The bound: each output is one fused multiply-add chain of k terms in f32, so it is within
gamma_k = k u / (1 - k u) (u = 2^-24) of the exact sum, times sum |a_i w_i| (Higham,
Accuracy and Stability of Numerical Algorithms, 3.1). The dot kernels sum shorter chains
but apply a block's scale and offset to the partial sums (a (x . q) + b sum x) rather than
to each weight, so they skip the decoder's own roundings of w = a q + b: two more u per
term, gamma_(k+2)."""
import numpy as np
import pytest

from test_blocks import random_blocks
from toygraph.cpu import engine, threads
from toygraph.errors import GGUFError, ToygraphError
from toygraph.gguf import block_encode, blocks

U = 2.0 ** -24


@pytest.fixture(scope="module", autouse=True)
def lib():
    if engine.library() is None:
        pytest.skip("no host C++ compiler: the numpy path is all there is")
    yield engine.library()
    engine.use_threads(None)


def weight(fmt: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """W [N, K] as fmt bytes: encoded from random values where we encode the format,
    random blocks (every bit pattern, finite scales) otherwise."""
    rng = np.random.default_rng(seed)
    if fmt in block_encode.GGUF_ENCODES:
        return block_encode.quantize((rng.standard_normal((N, K)) * 0.1).astype(np.float32), fmt)
    qk, _ = blocks.BLOCK[fmt]
    return random_blocks(fmt, N * K // qk, rng).reshape(N, -1)


def within_bound(got, a, w, extra: int = 0):
    """got = a @ w (f32 a [M, k], w [k, n]) within the chain bound of the exact product
    (``extra`` roundings more per term)."""
    a64, w64 = a.astype(np.float64), w.astype(np.float64)
    k = a.shape[1] + extra
    bound = k * U / (1 - k * U) * (np.abs(a64) @ np.abs(w64))
    err = np.abs(got.astype(np.float64) - a64 @ w64)
    return bool(np.all(err <= bound)), float((err / np.maximum(bound, 1e-300)).max())


def inputs(M: int, width: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((M, width)).astype(np.float32)


# K: a partial forward panel (not a multiple of KC = 256) where the block allows it.
SHAPES = {32: 288, 256: 512, 1: 101}


@pytest.mark.parametrize("fmt", engine.FORMATS)
@pytest.mark.parametrize("M", [1, 3, 5, 13])
def test_products_on_the_blocks_are_within_the_f32_bound(fmt, M):
    qk, _ = blocks.BLOCK[fmt]
    N, K = 67, SHAPES[qk]          # 67: two whole strips of 32 and a partial one; PN + 3
    raw = weight(fmt, N, K)
    w = blocks.dequantize(raw, fmt, (N, K))
    x, g = inputs(M, K), inputs(M, N, seed=2)
    y = engine.matmul_nt(x, raw, fmt, (N, K), np.full((M, N), np.nan, np.float32), kernel=1)
    assert within_bound(y, x, w.T)[0]
    dx = engine.matmul_nn(g, raw, fmt, (N, K), np.full((M, K), np.nan, np.float32))
    assert within_bound(dx, g, w)[0]
    if M <= engine.DOT_MAX_M:
        dot = engine.matmul_nt(x, raw, fmt, (N, K), np.full((M, N), np.nan, np.float32), kernel=2)
        assert within_bound(dot, x, w.T, extra=2)[0]


def test_rows_lying_apart_and_a_long_backward_sum():
    """x and out as row views of wider arrays (the engine reads and writes rows lda/ldc
    apart), and g W summed over more rows of W than one backward panel holds."""
    N, K, M = 300, 256, 20
    raw = weight("q4_k", N, K)
    w = blocks.dequantize(raw, "q4_k", (N, K))
    wide = inputs(M, K + 40)
    out = np.full((M, N + 7), np.nan, np.float32)
    engine.matmul_nt(wide[:, 3:3 + K], raw, "q4_k", (N, K), out[:, :N])
    assert within_bound(out[:, :N], wide[:, 3:3 + K], w.T)[0]
    assert np.isnan(out[:, N:]).all()
    g = inputs(M, N)
    assert within_bound(engine.matmul_nn(g, raw, "q4_k", (N, K), np.empty((M, K), np.float32)),
                        g, w)[0]


def test_results_do_not_depend_on_the_number_of_threads(monkeypatch):
    monkeypatch.setattr(threads, "allowed_cpus", lambda: 8)   # 3 threads on any machine
    N, K, M = 200, 512, 30
    raw = weight("q6_k", N, K)
    x, g = inputs(M, K), inputs(M, N)
    runs = []
    for n in (1, 2, 3):
        engine.use_threads(n)
        runs.append((engine.matmul_nt(x, raw, "q6_k", (N, K), np.empty((M, N), np.float32)),
                     engine.matmul_nn(g, raw, "q6_k", (N, K), np.empty((M, K), np.float32))))
    engine.use_threads(None)
    for y, dx in runs[1:]:
        np.testing.assert_array_equal(y.view(np.uint32), runs[0][0].view(np.uint32))
        np.testing.assert_array_equal(dx.view(np.uint32), runs[0][1].view(np.uint32))


def _broken(old: str, new: str):
    text = engine.source()
    assert text.count(old) == 1, old
    return engine.load(text.replace(old, new))


@pytest.mark.parametrize("old,new", [
    # the scalar tail (the partial strip, k past the last 8) reading the next column
    ("dst[j] = rows[j * ld + k];", "dst[j] = rows[j * ld + (k + 1) % kk];"),
    # the 8 x 8 transpose (full strips) swapping two columns in its first round
    ("r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);", "r[i + 1], 0, 8, 1, 9, 5, 13, 4, 12);")])
def test_a_broken_forward_panel_index_fails_the_bound(old, new):
    """The forward panel's transposition (the decoded rows into [k][NR]) moving a value to
    the wrong place, in its vector blocks or its scalar tail: the check above catches it."""
    lib = _broken(old, new)
    N, K, M = 40, 288, 7
    raw = weight("q8_0", N, K)
    w = blocks.dequantize(raw, "q8_0", (N, K))
    x = inputs(M, K)
    y = engine.matmul_nt(x, raw, "q8_0", (N, K), np.empty((M, N), np.float32), kernel=1, lib=lib)
    ok, worst = within_bound(y, x, w.T)
    assert not ok and worst > 1e3


@pytest.mark.slow
@pytest.mark.parametrize("old,new,N", [
    # g read where it lies (its rows up to kGInPlace floats apart): one column early
    ("in_place ? p.a + m0 * p.lda + n0 : gp", "in_place ? p.a + m0 * p.lda + (n0 ? n0 - 1 : 0) : gp",
     600),
    # g's columns copied per panel (rows farther apart, a head's): one column early
    ("p.a + m * p.lda + n0, (size_t)nn * 4", "p.a + m * p.lda + (n0 ? n0 - 1 : 0), (size_t)nn * 4",
     16400)])
def test_a_broken_backward_panel_index_fails_the_bound(old, new, N):
    """The backward product reading g's columns one early from the second panel on, where
    it reads g in place and where it copies it."""
    lib = _broken(old, new)
    K, M = 256, 5
    raw = weight("q4_k", N, K)
    w = blocks.dequantize(raw, "q4_k", (N, K))
    g = inputs(M, N)
    dx = engine.matmul_nn(g, raw, "q4_k", (N, K), np.empty((M, K), np.float32), lib=lib)
    assert not within_bound(dx, g, w)[0]


def test_bad_operands_are_one_line_errors():
    raw = weight("q8_0", 4, 64)
    with pytest.raises(GGUFError, match="needs 272 bytes, got 136"):
        engine.matmul_nt(inputs(2, 64), raw[:2], "q8_0", (4, 64), np.empty((2, 4), np.float32))
    with pytest.raises(ToygraphError, match=r"x must be f32 \[rows, 64\]"):
        engine.matmul_nt(inputs(2, 32), raw, "q8_0", (4, 64), np.empty((2, 4), np.float32))
    with pytest.raises(ToygraphError, match="out has 3 rows, g 2"):
        engine.matmul_nn(inputs(2, 4), raw, "q8_0", (4, 64), np.empty((3, 64), np.float32))


@pytest.mark.slow
def test_a_broken_dot_kernel_offset_fails_the_bound():
    """Q4_K's dot kernel taking the next group's sum of x for a sub-block's offset."""
    lib = _broken("(float)mn0 * xs[m * ldxs + 2 * p]", "(float)mn0 * xs[m * ldxs + 2 * p + 1]")
    N, K = 40, 512
    raw = weight("q4_k", N, K)
    w = blocks.dequantize(raw, "q4_k", (N, K))
    x = inputs(2, K)
    y = engine.matmul_nt(x, raw, "q4_k", (N, K), np.empty((2, N), np.float32), kernel=2, lib=lib)
    assert not within_bound(y, x, w.T, extra=2)[0]


# --- the 8-bit dot kernels (x rounded per 32 columns to int8, llama.cpp's way) ------------
Q8_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def within_q8_bound(got, x, raw, fmt, shape):
    """got = x @ W^T within what rounding x per 32 to int8 can do, plus f32's chain bound:
    every weight, its offset included, meets the rounded x8, |x - x8| <= d / 2 per element
    (d = max|x| / 127 over its group of 32), so |error| <= sum |w| d / 2."""
    w = blocks.dequantize(raw, fmt, shape).astype(np.float64)
    x64 = x.astype(np.float64)
    M, K = x.shape
    half_d = np.repeat(np.abs(x64).reshape(M, K // 32, 32).max(axis=2) / 254, 32, axis=1)
    rounding = (half_d * 1.001) @ np.abs(w).T
    chain = (K + 8) * U / (1 - (K + 8) * U) * ((np.abs(x64) * 1.01) @ np.abs(w).T)
    err = np.abs(got.astype(np.float64) - x64 @ w.T)
    return bool(np.all(err <= rounding + chain)), float((err / (rounding + chain)).max())


def needs_q8(lib=None):
    if not (lib or engine.library()).tg_dot_q8():
        pytest.skip("the 8-bit dot kernels are built on x86 with AVX2 and ARM with NEON only")


@pytest.mark.parametrize("fmt", Q8_FORMATS)
@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_8bit_dot_kernels_are_within_the_rounding_bound(fmt, M):
    """Every format with an 8-bit kernel, every row count it takes, a partial task of rows
    (N = 67): within the bound, and the bound is not vacuous (the error is well inside it but
    far above f32's)."""
    needs_q8()
    N, K = 67, 512
    raw = weight(fmt, N, K)
    x = inputs(M, K)
    y = engine.matmul_nt(x, raw, fmt, (N, K), np.full((M, N), np.nan, np.float32), kernel=3)
    ok, worst = within_q8_bound(y, x, raw, fmt, (N, K))
    assert ok and 0.005 < worst < 0.5, worst
    auto = engine.matmul_nt(x, raw, fmt, (N, K), np.full((M, N), np.nan, np.float32))
    np.testing.assert_array_equal(auto.view(np.uint32), y.view(np.uint32))  # kernel 0 picks it


def rows_and_one_row_each(fmt: str, M: int, lib=None, N: int = 67, K: int = 512):
    """The 8-bit kernel's product of M rows, and the M one-row products stacked."""
    raw, x = weight(fmt, N, K), inputs(M, K, seed=5)
    rows = engine.matmul_nt(x, raw, fmt, (N, K), np.full((M, N), np.nan, np.float32), kernel=3,
                            lib=lib)
    one = np.concatenate([engine.matmul_nt(x[m:m + 1], raw, fmt, (N, K), np.empty((1, N), np.float32),
                                           kernel=3, lib=lib) for m in range(M)])
    return rows, one


def _avx512_pairs() -> bool:
    """Whether this machine's build takes dot8.h's AVX-512 row pairs (VNNI, BW, DQ, VL)."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = set(engine._cpu_flags().split())
    return {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= flags


@pytest.mark.parametrize("fmt", Q8_FORMATS)
def test_8bit_dot_kernels_give_each_row_its_one_row_result_bit_for_bit(fmt):
    """A block is decoded once for all M rows (with AVX-512 two rows share each register),
    and every row sees the one-row kernel's operations in its order: M rows give the M
    one-row products bit for bit, and on an AVX-512 machine the AVX2 build (row by row)
    gives this build's bits."""
    needs_q8()
    avx2 = _other_target("-march=x86-64-v3") if _avx512_pairs() else None
    for M in (2, 3, 4):
        rows, one = rows_and_one_row_each(fmt, M)
        np.testing.assert_array_equal(rows.view(np.uint32), one.view(np.uint32), err_msg=str(M))
        if avx2 is not None:
            other, _ = rows_and_one_row_each(fmt, M, lib=avx2)
            np.testing.assert_array_equal(other.view(np.uint32), rows.view(np.uint32),
                                          err_msg=f"avx2 {M}")


def test_a_broken_avx512_row_pair_fails_the_one_row_check():
    """The second row of each AVX-512 pair scaled with the first row's scale."""
    needs_q8()
    if not _avx512_pairs():
        pytest.skip("dot8.h's row pairs are built on x86 with AVX-512 VNNI, BW, DQ and VL")
    lib = _broken("d[g * M + 2 * j + l / 8];", "d[g * M + 2 * j];")
    rows, one = rows_and_one_row_each("q4_k", 2, lib=lib)
    assert not np.array_equal(rows, one)
    good, _ = rows_and_one_row_each("q4_k", 2)
    np.testing.assert_array_equal(one.view(np.uint32), good.view(np.uint32))  # one row: no pairs


def test_8bit_dot_kernels_take_ragged_x_and_refuse_what_they_lack():
    """x and out as row views of wider arrays; a format without an 8-bit kernel (iq4_nl,
    f16) is a one-line error when asked for one, and kernel 0 takes the f32 dot kernels."""
    needs_q8()
    N, K, M = 40, 256, 3
    raw = weight("q5_k", N, K)
    wide = inputs(M, K + 40)
    out = np.full((M, N + 5), np.nan, np.float32)
    engine.matmul_nt(wide[:, 7:7 + K], raw, "q5_k", (N, K), out[:, :N], kernel=3)
    assert within_q8_bound(out[:, :N], np.ascontiguousarray(wide[:, 7:7 + K]), raw, "q5_k", (N, K))[0]
    assert np.isnan(out[:, N:]).all()
    for fmt in ("iq4_nl", "f16"):
        qk, _ = blocks.BLOCK[fmt]
        raw = weight(fmt, N, SHAPES[qk] // 32 * 32)
        shape = (N, SHAPES[qk] // 32 * 32)
        x = inputs(2, shape[1])
        with pytest.raises(ToygraphError, match=f"no 8-bit dot kernel for {fmt}") as e:
            engine.matmul_nt(x, raw, fmt, shape, np.empty((2, N), np.float32), kernel=3)
        assert "\n" not in str(e.value)
        a = engine.matmul_nt(x, raw, fmt, shape, np.empty((2, N), np.float32))
        b = engine.matmul_nt(x, raw, fmt, shape, np.empty((2, N), np.float32), kernel=2)
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_few_rows_path_keeps_addresses_not_values():
    """BlockTensor.matmul_few_rows (generation's step) reuses the last operands' row views and
    addresses: new values in the same x give the new product, another out array is written
    and the old one is left alone, and the answer is always matmul's."""
    from toygraph.cpu.block_tensor import BlockTensor
    N, K = 50, 256
    raw = weight("q4_k", N, K)
    bt = BlockTensor(raw, "q4_k", (N, K))
    x = inputs(3, K).reshape(1, 3, K)
    out, other = np.zeros((1, 3, N), np.float32), np.zeros((1, 3, N), np.float32)
    for step in range(3):
        x[...] = inputs(3, K, seed=10 + step).reshape(1, 3, K)
        target = out if step < 2 else other
        bt.matmul_few_rows(x, target)
        want = engine.matmul_nt(x[0], raw, "q4_k", (N, K), np.empty((3, N), np.float32))
        np.testing.assert_array_equal(target[0].view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(out, other)   # the second out kept step 1's product


def test_a_broken_8bit_group_index_fails_the_bound():
    """Q4_K's 8-bit kernel reading x's groups of the first sub-block of a pair for both."""
    needs_q8()
    lib = _broken("const int64_t gg = g + 2 * p + h;", "const int64_t gg = g + 2 * p;")
    N, K = 40, 512
    raw = weight("q4_k", N, K)
    x = inputs(2, K)
    y = engine.matmul_nt(x, raw, "q4_k", (N, K), np.empty((2, N), np.float32), kernel=3, lib=lib)
    ok, worst = within_q8_bound(y, x, raw, "q4_k", (N, K))
    assert not ok and worst > 10


def _other_target(target: str):
    """The engine built for another x86 target than this machine's (skipped elsewhere)."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets")
    return engine.load(engine.source(), target)


@pytest.mark.parametrize("target,simd", [
    ("-march=x86-64-v3", "avx2"),
    pytest.param("-march=x86-64", "portable", marks=pytest.mark.slow)])
def test_the_other_code_paths_compute_the_same_products(target, simd):
    """The AVX2 tiles (6 x 16) and the scalar fallback, built here whatever this CPU has:
    the forward panels, the backward panels and the dot kernels within the bound."""
    lib = _other_target(target)
    assert lib.tg_simd().decode() == simd
    assert lib.tg_dot_q8() == (simd == "avx2")   # the scalar build keeps x in f32
    for fmt in ("q4_k", "q5_0", "f16"):
        qk, _ = blocks.BLOCK[fmt]
        N, K = 45, SHAPES[qk]
        raw = weight(fmt, N, K)
        w = blocks.dequantize(raw, fmt, (N, K))
        for M in (2, 9):
            x, g = inputs(M, K), inputs(M, N, seed=2)
            y = engine.matmul_nt(x, raw, fmt, (N, K), np.empty((M, N), np.float32), kernel=1, lib=lib)
            assert within_bound(y, x, w.T)[0], (fmt, M)
            dx = engine.matmul_nn(g, raw, fmt, (N, K), np.empty((M, K), np.float32), lib=lib)
            assert within_bound(dx, g, w)[0], (fmt, M)
            if M <= engine.DOT_MAX_M:
                dot = engine.matmul_nt(x, raw, fmt, (N, K), np.empty((M, N), np.float32),
                                       kernel=2, lib=lib)
                assert within_bound(dot, x, w.T, extra=2)[0], (fmt, M)
                if fmt in Q8_FORMATS and simd == "avx2":  # maddubs + madd, no VNNI
                    dot = engine.matmul_nt(x, raw, fmt, (N, K), np.empty((M, N), np.float32),
                                           kernel=3, lib=lib)
                    assert within_q8_bound(dot, x, raw, fmt, (N, K))[0], (fmt, M)
        out = np.empty((N, K), np.float32)
        lib.tg_decode(engine.FORMATS.index(fmt), blocks.as_bytes(raw).ctypes.data,
                      out.ctypes.data, N * K // qk)
        np.testing.assert_array_equal(out.view(np.uint32), w.view(np.uint32))
