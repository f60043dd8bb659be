"""The host executor's ldmatrix and cp.async (toygraph/ops/include/host_shim.h, used through
toygraph/ops/include/tc_async.cuh) against the PTX ISA's definitions, written out again here
independently of the shim: the 8 x 8 matrix fragments of ldmatrix .x1/.x2/.x4 with and
without .trans, and cp.async's sizes, zero fill, commit groups and wait_group -- including
that a kernel which reads a tile before waiting for it sees poison, not the data."""
import numpy as np
import pytest

from toygraph import ops  # noqa: F401
from toygraph.cuda.host.device import run_kernel
from toygraph.ops.lowering import sources
from toygraph.errors import CudaError


@pytest.fixture(autouse=True)
def host_device(monkeypatch):
    monkeypatch.setenv("TOYGRAPH_CUDA_DEVICE", "host")


_PROBE = r"""
// Sm: 32 stored rows of 8 halves, row x element c = src[8x + c]; lane l points at row
// rowsel[l]; out[4l + i] = register i of lane l.
// (The shared array is the kernel's, not the template's: g++ leaves a template's static
// locals out of the "tg_shared" section the shim poisons and checks addresses against.)
template <int NM, bool TRANS>
__device__ void ldm_probe(unsigned short (*Sm)[8], unsigned* out, const unsigned short* src,
                          const int* rowsel) {
    for (int c = 0; c < 8; ++c) Sm[threadIdx.x][c] = src[8 * threadIdx.x + c];
    __syncthreads();
    unsigned d[4] = {0, 0, 0, 0};
    tg_ldmatrix<NM, TRANS>(d, Sm[rowsel[threadIdx.x]]);
    for (int i = 0; i < 4; ++i) out[4 * threadIdx.x + i] = d[i];
}
#define LDM_ARGS unsigned* out, const unsigned short* src, const int* rowsel
#define LDM_SHARED __shared__ __align__(16) unsigned short Sm[32][8]
extern "C" __global__ void probe_ldm_x1(LDM_ARGS) {
    LDM_SHARED;
    ldm_probe<1, false>(Sm, out, src, rowsel);
}
extern "C" __global__ void probe_ldm_x2(LDM_ARGS) {
    LDM_SHARED;
    ldm_probe<2, false>(Sm, out, src, rowsel);
}
extern "C" __global__ void probe_ldm_x4(LDM_ARGS) {
    LDM_SHARED;
    ldm_probe<4, false>(Sm, out, src, rowsel);
}
extern "C" __global__ void probe_ldm_x1_t(LDM_ARGS) {
    LDM_SHARED;
    ldm_probe<1, true>(Sm, out, src, rowsel);
}
extern "C" __global__ void probe_ldm_x2_t(LDM_ARGS) {
    LDM_SHARED;
    ldm_probe<2, true>(Sm, out, src, rowsel);
}
extern "C" __global__ void probe_ldm_x4_t(LDM_ARGS) {
    LDM_SHARED;
    ldm_probe<4, true>(Sm, out, src, rowsel);
}

// One thread copies src[0..16) (words) into shared memory with cp.async and reads it back:
// words 0-3 one 16-byte .cg copy (group 0), 4-7 a 16-byte .cg copy with src-size 0 (zero
// fill; group 0), 8-9 an 8-byte .ca and 10 a 4-byte .ca (group 1). mode 0: wait_group 0
// before reading; 1: wait_group 1 (group 1 still pending); 2: no wait before the read (then
// wait 0); 3: never wait.
extern "C" __global__ void probe_cp_async(float* out, const float* src, int mode) {
    __shared__ __align__(16) float S[12];
    for (int x = 0; x < 12; ++x) S[x] = -1.0f;
    tg_cp_async16(&S[0], &src[0], 16);
    tg_cp_async16(&S[4], &src[4], 0);
    tg_cp_async_commit();
    tg_cp_async<8>(&S[8], &src[8]);
    tg_cp_async<4>(&S[10], &src[10]);
    tg_cp_async_commit();
    if (mode == 0) tg_cp_async_wait<0>();
    if (mode == 1) tg_cp_async_wait<1>();
    for (int x = 0; x < 12; ++x) out[x] = S[x];
    if (mode == 1 || mode == 2) tg_cp_async_wait<0>();
}

extern "C" __global__ void probe_cp_async_misaligned(float* out, const float* src) {
    __shared__ __align__(16) float S[8];
    tg_cp_async16(&S[1], &src[0], 16);
    tg_cp_async_commit();
    tg_cp_async_wait<0>();
    out[0] = S[1];
}
"""


def _source():
    return sources.module_source(("tc_async.cuh",)) + _PROBE


def _ldmatrix_reference(stored, rowsel, nm, trans):
    """register i of lane l, from the PTX ISA's description of ldmatrix: matrix i's row r is
    the row lane 8i + r points at; without .trans lane l holds row l // 4, columns
    2 (l % 4) and 2 (l % 4) + 1, with .trans the same of the transposed matrix."""
    want = np.zeros((32, 4), np.uint32)
    for i in range(nm):
        m = stored[[rowsel[8 * i + r] for r in range(8)]]   # [8, 8] halves
        if trans:
            m = m.T
        for lane in range(32):
            lo, hi = m[lane // 4, 2 * (lane % 4)], m[lane // 4, 2 * (lane % 4) + 1]
            want[lane, i] = int(lo) | (int(hi) << 16)
    return want


@pytest.mark.parametrize("nm", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_fragments_follow_the_ptx_layout(nm, trans):
    rng = np.random.default_rng(nm + 7 * trans)
    stored = rng.integers(0, 65536, size=(32, 8)).astype(np.uint16)
    rowsel = rng.permutation(32).astype(np.int32)   # lanes point at rows in any order
    out = np.zeros((32, 4), np.uint32)
    run_kernel(f"probe_ldm_x{nm}" + ("_t" if trans else ""), (1, 1, 1), (32, 1, 1),
               [out, stored, rowsel], source=_source())
    want = _ldmatrix_reference(stored, rowsel, nm, trans)
    np.testing.assert_array_equal(out[:, :nm], want[:, :nm])
    assert not out[:, nm:].any()   # registers past .x{nm} are not written


def _cp_async(mode):
    src = np.arange(1, 17, dtype=np.float32)
    out = np.zeros(12, np.float32)
    run_kernel("probe_cp_async", (1, 1, 1), (1, 1, 1), [out, src, np.int32(mode)],
               source=_source())
    return out


def test_cp_async_copies_zero_fills_and_completes_at_wait_group():
    np.testing.assert_array_equal(_cp_async(0), [1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, -1])


def test_cp_async_wait_group_leaves_the_most_recent_groups_pending():
    out = _cp_async(1)
    np.testing.assert_array_equal(out[:8], [1, 2, 3, 4, 0, 0, 0, 0])
    assert np.isnan(out[8:11]).all() and out[11] == -1   # group 1 not waited for: poison


def test_reading_before_the_wait_sees_poison_not_the_data():
    out = _cp_async(2)
    assert np.isnan(out[:11]).all() and out[11] == -1


def test_a_thread_that_never_waits_fails_the_launch():
    with pytest.raises(CudaError, match="4 cp.async copies it never waited for"):
        _cp_async(3)


def test_a_misaligned_cp_async_is_an_error():
    with pytest.raises(CudaError, match="not aligned to 16 bytes"):
        run_kernel("probe_cp_async_misaligned", (1, 1, 1), (1, 1, 1),
                   [np.zeros(1, np.float32), np.zeros(8, np.float32)], source=_source())
