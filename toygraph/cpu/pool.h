// One pool of threads for every kernel of the engine: the caller and n - 1 workers take
// the tasks 0..n_tasks-1 of a job in turn (an atomic counter), each calling
// job(task, thread) with its own thread index (0 is the caller). Which thread runs a task
// never changes what it computes: a task writes its own part of the output, in its own
// fixed order.
//
// The caller waits for the job's tasks, not for the workers: on a machine shared with
// other processes a worker may not be scheduled for milliseconds, and then the caller and
// the workers that are running take its share. A worker joins a job only while it is
// open (``active`` counts the workers inside one; the caller closes the job once every task
// is done and waits only for workers caught between joining and finding no task left).
//
// Workers that find no job spin a little (a job follows a job within microseconds in the
// engine's loops and in generation), then sleep on a condition variable, so an idle pool
// costs nothing while numpy or BLAS runs. After fork() the child has no workers: the pool
// notices (pthread_atfork) and runs jobs on the caller alone until threads are set again.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax() { asm volatile("yield"); }
#else
static inline void cpu_relax() {}
#endif

typedef void (*JobFn)(void* ctx, int64_t task, int thread);

struct Pool {
    std::vector<pthread_t> workers;
    std::mutex m;
    std::condition_variable wake, finished;
    std::atomic<uint64_t> generation{0};   // bumped for every job
    std::atomic<bool> open{false};         // the current job may still be joined
    std::atomic<int> active{0};            // workers inside the current job
    std::atomic<int64_t> next{0}, done{0}; // tasks taken, tasks finished
    int64_t n_tasks = 0;
    JobFn fn = nullptr;
    void* ctx = nullptr;
    bool stopping = false;
    bool caller_sleeps = false;            // under m: the caller waits on ``finished``
};

// Never destroyed: at exit the workers may still wait on its condition variable (glibc's
// pthread_cond_destroy would wait for them), and the process's end stops them anyway.
static Pool& g_pool = *new Pool;
// How long a waiting thread spins before it sleeps. Generation's one-token step calls the
// engine every few tens of microseconds, and waking a sleeping worker costs about as much
// as a product with a small matrix: spinning through the gaps took SmolLM2 from 36 to
// 44-48 tokens/s on 2 cores. A spinning worker only costs where another pool wants the
// core, and BLAS runs on one thread while the engine carries the base
// (threads.blas_beside_engine).
static const auto kSpin = std::chrono::microseconds(400);

// Spin until done() or kSpin has passed; whether done() held.
template <class P>
static bool spin_until(P done) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0;; i++) {
        if (done()) return true;
        cpu_relax();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return done();
    }
}

static void pool_take_tasks(int thread) {
    for (;;) {
        const int64_t t = g_pool.next.fetch_add(1);
        if (t >= g_pool.n_tasks) return;
        g_pool.fn(g_pool.ctx, t, thread);
        if (g_pool.done.fetch_add(1) + 1 == g_pool.n_tasks) {
            std::lock_guard<std::mutex> lk(g_pool.m);
            if (g_pool.caller_sleeps) g_pool.finished.notify_one();
        }
    }
}

// The generation a worker starts from is the one at its creation, not at its first
// instruction: a job issued in between is one it may join.
struct WorkerArg { int thread; uint64_t generation; };

static void* pool_worker(void* p) {
    const int thread = ((WorkerArg*)p)->thread;
    uint64_t seen = ((WorkerArg*)p)->generation;
    delete (WorkerArg*)p;
    for (;;) {
        if (!spin_until([&] { return g_pool.generation.load() != seen; })) {
            std::unique_lock<std::mutex> lk(g_pool.m);
            g_pool.wake.wait(lk, [&] { return g_pool.stopping || g_pool.generation.load() != seen; });
        }
        if (g_pool.stopping) return nullptr;
        seen = g_pool.generation.load();
        g_pool.active.fetch_add(1);              // join, then look: the caller closes, then
        if (g_pool.open.load()) pool_take_tasks(thread);   // looks (both sequentially consistent)
        g_pool.active.fetch_sub(1);
    }
}

static void pool_stop() {
    {
        std::lock_guard<std::mutex> lk(g_pool.m);
        g_pool.stopping = true;
    }
    g_pool.wake.notify_all();
    for (pthread_t t : g_pool.workers) pthread_join(t, nullptr);
    g_pool.workers.clear();
    g_pool.stopping = false;
}

static void pool_after_fork_in_child() {
    // The workers did not survive the fork; their pthread_t are meaningless here.
    g_pool.workers.clear();
    g_pool.active.store(0);
    g_pool.open.store(false);
}

static int pool_threads() { return (int)g_pool.workers.size() + 1; }

// The most threads the pool starts (engine.py's MAX_THREADS): a bound against a count gone
// wrong, far past any machine's cores.
static const int64_t kMaxThreads = 256;

// Start n - 1 workers (n in 1..kMaxThreads, else the nearer end); returns the threads the
// pool now has.
static int pool_set_threads(int64_t n) {
    static bool registered = false;
    if (!registered) {
        pthread_atfork(nullptr, nullptr, pool_after_fork_in_child);
        registered = true;
    }
    if (n < 1) n = 1;
    if (n > kMaxThreads) n = kMaxThreads;
    if (n == pool_threads()) return (int)n;
    pool_stop();
    for (int i = 1; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, nullptr, pool_worker, new WorkerArg{i, g_pool.generation.load()}) != 0) break;
        g_pool.workers.push_back(t);
    }
    return pool_threads();
}

// Run tasks 0..n_tasks-1 of fn on the pool and return when all are done.
static void pool_run(int64_t n_tasks, JobFn fn, void* ctx) {
    if (g_pool.workers.empty() || n_tasks <= 1) {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    g_pool.fn = fn;
    g_pool.ctx = ctx;
    g_pool.n_tasks = n_tasks;
    g_pool.next.store(0);
    g_pool.done.store(0);
    g_pool.open.store(true);
    {
        std::lock_guard<std::mutex> lk(g_pool.m);
        g_pool.generation.fetch_add(1);
    }
    g_pool.wake.notify_all();
    pool_take_tasks(0);
    if (!spin_until([] { return g_pool.done.load() == g_pool.n_tasks; })) {
        std::unique_lock<std::mutex> lk(g_pool.m);
        g_pool.caller_sleeps = true;
        g_pool.finished.wait(lk, [] { return g_pool.done.load() == g_pool.n_tasks; });
        g_pool.caller_sleeps = false;
    }
    g_pool.open.store(false);
    // A worker that joined as the job ended finds no task and leaves within instructions,
    // unless it was descheduled in between: then let it run.
    while (g_pool.active.load() != 0) sched_yield();
}

// A job over a lambda: pool_for(n, [&](int64_t task, int thread) { ... }).
template <class F>
static void pool_trampoline(void* ctx, int64_t task, int thread) { (*(F*)ctx)(task, thread); }
template <class F>
static void pool_for(int64_t n_tasks, F&& f) {
    typedef typename std::remove_reference<F>::type G;
    pool_run(n_tasks, pool_trampoline<G>, (void*)&f);
}
