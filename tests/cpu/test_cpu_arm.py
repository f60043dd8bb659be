"""The CPU engine on ARM (issue 49 item 4): engine.py's source built by Debian's aarch64
cross compiler and run under qemu-user (tests/support/arm.py), for ARMv8.2 with the
dot-product extension (the 8-bit kernels' sdot) and for plain ARMv8 (smull and pairwise
adds). The decoders give blocks.py's values bit for bit; the 8-bit kernels' results are the
x86 kernels' bit for bit (the integer sums are exact and the f32 steps the same operations in
the same order) and within the rounding bound of test_cpu_gemm; the f32 kernels within the
f32 chain bound; a deliberately broken NEON kernel fails."""
import numpy as np
import pytest

from support import arm
from test_cpu_gemm import Q8_FORMATS, SHAPES, inputs, weight, within_bound, within_q8_bound
from toygraph.cpu import engine
from toygraph.gguf import blocks

pytestmark = pytest.mark.skipif(arm.missing() is not None, reason=str(arm.missing()))


@pytest.fixture(scope="module")
def arms():
    return {target: arm.Arm(target) for target in arm.TARGETS}


def test_both_arm_builds_take_neon_and_the_8bit_kernels(arms):
    for target, built in arms.items():
        assert built.info() == ("neon", True), target


@pytest.mark.parametrize("fmt", engine.FORMATS)
def test_the_decoders_give_blocks_py_values_bit_for_bit_on_arm(arms, fmt):
    qk, _ = blocks.BLOCK[fmt]
    raw = weight(fmt, 8, SHAPES[qk])
    want = blocks.dequantize(raw, fmt, (8, SHAPES[qk])).reshape(-1)
    for target, built in arms.items():
        got = built.decode(raw, fmt)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=target)


def _q8_cases():
    N, K = 67, 512
    return [(weight(fmt, N, K), fmt, (N, K), inputs(M, K, seed=M), True, 3)
            for fmt in Q8_FORMATS for M in (1, 2, 3, 4)]


def test_8bit_kernels_on_arm_are_the_x86_kernels_bit_for_bit_and_within_the_bound(arms):
    cases = _q8_cases()
    got = {target: built.matmuls(cases) for target, built in arms.items()}
    x86 = engine.library()
    for i, (raw, fmt, shape, x, _, _) in enumerate(cases):
        sdot, neon = got["sdot"][i], got["neon"][i]
        np.testing.assert_array_equal(sdot.view(np.uint32), neon.view(np.uint32), err_msg=fmt)
        ok, worst = within_q8_bound(sdot, x, raw, fmt, shape)
        assert ok and 0.005 < worst < 0.5, (fmt, x.shape[0], worst)
        if x86 is not None and x86.tg_dot_q8():   # this machine's own 8-bit kernels
            mine = engine.matmul_nt(x, raw, fmt, shape, np.empty((x.shape[0], shape[0]), np.float32),
                                    kernel=3)
            np.testing.assert_array_equal(sdot.view(np.uint32), mine.view(np.uint32), err_msg=fmt)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0", "iq4_nl", "q2_k", "f16", "mxfp4"])
def test_f32_kernels_on_arm_are_within_the_f32_bound(arms, fmt):
    """The panels (x W^T at 20 rows, g W) and the f32 dot kernels (2 rows) on a weight in
    its blocks, against the f64 product of the decoded weight."""
    qk, _ = blocks.BLOCK[fmt]
    N, K = 45, SHAPES[qk]
    raw = weight(fmt, N, K)
    w = blocks.dequantize(raw, fmt, (N, K))
    x, g, few = inputs(20, K), inputs(7, N, seed=3), inputs(2, K, seed=4)
    cases = [(raw, fmt, (N, K), x, True, 1), (raw, fmt, (N, K), g, False, 0),
             (raw, fmt, (N, K), few, True, 2)]
    for target, built in arms.items():
        y, dx, dot = built.matmuls(cases)
        assert within_bound(y, x, w.T)[0], target
        assert within_bound(dx, g, w)[0], target
        assert within_bound(dot, few, w.T, extra=2)[0], target


def test_a_broken_neon_kernel_fails_the_bound():
    """The upper 16 activations of each 32 read as the lower 16 again."""
    good = "dot16(vreinterpretq_s8_u8(w.hi), vld1q_s8(xq + 16))"
    source = engine.source()
    assert good in source
    broken = arm.Arm("sdot", source.replace(good, "dot16(vreinterpretq_s8_u8(w.hi), vld1q_s8(xq))"))
    raw, fmt, shape, x, _, _ = _q8_cases()[0]
    (y,) = broken.matmuls([(raw, fmt, shape, x, True, 3)])
    ok, worst = within_q8_bound(y, x, raw, fmt, shape)
    assert not ok and worst > 10, worst
