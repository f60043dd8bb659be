// The replay of a plan: a phase of the graph as an array of nodes, each naming an engine
// kernel and carrying its operands (addresses, sizes, attributes) resolved at realize, run
// in order by one call (engine.cpp's tg_replay) with no Python between them: the CPU's
// counterpart of a captured CUDA graph. Each node's kernel splits its own work over the
// pool; a node starts when the one before it has finished.
//
// The kernels live with their op families (toygraph/ops/<family>/cpu.h, assembled after
// this header by engine.py) and enter themselves in the table below by name when the
// library loads; toygraph/cpu/replay.py asks for each name's index once
// (tg_replay_kernel) and writes it into the nodes.
//
// Every kernel computes what the op's numpy kernel computes, element by element in an
// order that depends on the shapes only, never on the number of threads: a task owns its
// part of the output and sums it in a fixed order, and a reduction over tasks adds their
// partial sums in task order on the calling thread.
#include <string.h>
#include <vector>

// One node of a plan (replay.py's NODE dtype mirrors it, field for field): the kernel's
// index, then its operands. ``p``: addresses (the output first by convention, then the
// sources; a list of more addresses is passed as the address of an array of them);
// ``i``: integer arguments (sizes, strides, flags); ``f``: real arguments, as doubles
// (a kernel rounds one to f32 where numpy would: a Python float meeting an f32 array).
struct ReplayNode {
    int32_t kernel, spare;
    void* p[12];
    int64_t i[16];
    double f[8];
};

// A kernel returns 0, or a nonzero code naming what it could not do (replay.py says which
// node, and which op, failed).
typedef int (*ReplayFn)(const ReplayNode&);

struct ReplayKernel {
    const char* name;
    ReplayFn fn;
};

static std::vector<ReplayKernel>& replay_kernels() {
    static std::vector<ReplayKernel> table;
    return table;
}

struct ReplayRegistration {
    ReplayRegistration(const char* name, ReplayFn fn) { replay_kernels().push_back({name, fn}); }
};

// TG_REPLAY_KERNEL(rms_norm) { ... } defines the kernel named "rms_norm" (replay.py's
// ``Call("rms_norm", ...)``) with its node in ``n``, and enters it in the table.
#define TG_REPLAY_KERNEL(name)                                                \
    static int replay_##name(const ReplayNode& n);                            \
    static ReplayRegistration replay_registration_##name(#name, replay_##name); \
    static int replay_##name(const ReplayNode& n)

// Memory a kernel keeps between calls on the calling thread (grown on demand, so that a
// step does not fault tens of megabytes in again each time), entered here by the kernel's
// family with the function that frees it: engine.cpp's tg_release calls them all when a
// run is over.
static std::vector<void (*)()>& kept_memory() {
    static std::vector<void (*)()> list;
    return list;
}

struct KeptRegistration {
    explicit KeptRegistration(void (*release)()) { kept_memory().push_back(release); }
};

// Work of a few thousand elements or less is not worth waking the pool for.
static const int64_t kReplayGrain = 4096;

// Tasks of about ``grain`` elements each over ``count`` items of ``width`` elements.
static inline int64_t replay_tasks(int64_t count, int64_t width, int64_t grain = kReplayGrain) {
    int64_t per = grain / (width > 0 ? width : 1);
    if (per < 1) per = 1;
    return (count + per - 1) / per;
}

// pool_for over ``count`` items in runs of ``per`` items: f(first, last) per task.
template <class F>
static void replay_for(int64_t count, int64_t width, F&& f) {
    int64_t per = kReplayGrain / (width > 0 ? width : 1);
    if (per < 1) per = 1;
    const int64_t tasks = (count + per - 1) / per;
    pool_for(tasks, [&](int64_t task, int) {
        const int64_t a = task * per, b = a + per < count ? a + per : count;
        f(a, b);
    });
}

// A scratch of floats for the calling thread's part of a kernel (grown on demand; apart
// from gemm.h's, which the products on blocks use inside the same kernels).
static thread_local std::vector<float> t_replay_scratch;

static float* replay_scratch(size_t floats) {
    if (t_replay_scratch.size() < floats) t_replay_scratch.resize(floats);
    return t_replay_scratch.data();
}
