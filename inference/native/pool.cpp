// The native kernels' threads (pool.h): one job at a time, its chunks claimed from one atomic word
// (generation << 32 | next chunk) by the caller and by helpers. A helper spins briefly after a job (a layer's next
// op follows within microseconds), then sleeps on a futex until the next one; the caller never waits for a helper
// to wake, only for chunks already started. After fork() the child has no helpers: its jobs run on the caller.
#include "pool.h"

#include <c10/util/Exception.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <mutex>
#include <new>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#define KVS_PAUSE() _mm_pause()
#else
#define KVS_PAUSE() std::this_thread::yield()
#endif

namespace kvs {
namespace {

constexpr int kMaxThreads = 64;
constexpr auto kSpin = std::chrono::microseconds(200);  // a helper's busy wait after a job before it sleeps
constexpr auto kWokenSpin = std::chrono::milliseconds(2);  // ... and after wake() (a step's jobs are coming)

struct Job {
  std::atomic<uint64_t> state{0};  // generation << 32 | next unclaimed chunk
  std::atomic<ChunkFn> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::atomic<int64_t> total{0};
  std::atomic<int64_t> done{0};  // chunks helpers have finished
};

Job g_job;
std::atomic<uint32_t> g_gen{0};  // the futex word: the generation of the last job posted
std::atomic<int> g_threads{1};
std::atomic<int> g_started{0};
std::atomic<int> g_sleepers{0};
std::atomic<bool> g_busy{false};  // a caller holds the pool
std::mutex g_start_mu;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Claims and runs chunks of job `gen` until none is left; returns how many this thread ran. A successful claim
// means the job is not finished, so its fn / ctx are still the ones read (the next job is posted only after every
// chunk of this one was claimed and done).
int64_t work(uint32_t gen, bool helper) {
  int64_t ran = 0;
  uint64_t s = g_job.state.load(std::memory_order_acquire);
  while ((s >> 32) == gen && static_cast<int64_t>(s & 0xFFFFFFFFu) < g_job.total.load(std::memory_order_relaxed)) {
    if (!g_job.state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    const ChunkFn fn = g_job.fn.load(std::memory_order_relaxed);
    fn(g_job.ctx.load(std::memory_order_relaxed), static_cast<int64_t>(s & 0xFFFFFFFFu));
    ++ran;
    if (helper) g_job.done.fetch_add(1, std::memory_order_release);
    s = g_job.state.load(std::memory_order_acquire);
  }
  return ran;
}

void helper_loop(int index) {
  uint32_t seen = g_gen.load();
  for (;;) {
    uint32_t gen;
    auto spin_until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0; (gen = g_gen.load(std::memory_order_acquire)) == seen; ++i) {
      if (i < 64) {
        KVS_PAUSE();
        continue;
      }
      if (std::chrono::steady_clock::now() < spin_until) {  // a polite spin: a thread waiting for this core runs
        sched_yield();
        continue;
      }
      g_sleepers.fetch_add(1);  // seq_cst with the poster's bump of g_gen: either it sees a sleeper or we see the job
      if (g_gen.load() == seen) futex_wait(&g_gen, seen);
      g_sleepers.fetch_sub(1);
      spin_until = std::chrono::steady_clock::now() + kWokenSpin;
      i = 0;
    }
    seen = gen;
    if (index + 1 < g_threads.load(std::memory_order_relaxed)) work(gen, true);
  }
}

void start_helpers(int wanted) {
  if (g_started.load() >= wanted) return;
  std::lock_guard<std::mutex> lock(g_start_mu);
  for (int i = g_started.load(); i < wanted; ++i) {
    std::thread(helper_loop, i).detach();
    g_started.store(i + 1);
  }
}

void after_fork_in_child() {  // the helpers did not come along
  g_started.store(0);
  g_sleepers.store(0);
  g_busy.store(false);
  new (&g_start_mu) std::mutex();
}

[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, after_fork_in_child);

}  // namespace

int threads() { return g_threads.load(std::memory_order_relaxed); }

void wake() {
  if (threads() > 1 && g_sleepers.load() > 0) futex_wake_all(&g_gen);
}

void run_chunks(int64_t chunks, ChunkFn fn, void* ctx) {
  const int n = threads();
  bool idle = false;
  if (chunks <= 0) return;
  // one job at a time: a second caller, or a chunk's own call (the pool is held), runs its chunks itself
  if (n <= 1 || chunks == 1 || !g_busy.compare_exchange_strong(idle, true)) {
    for (int64_t c = 0; c < chunks; ++c) fn(ctx, c);
    return;
  }
  start_helpers(n - 1);
  const uint32_t gen = g_gen.load() + 1;
  g_job.fn.store(fn, std::memory_order_relaxed);
  g_job.ctx.store(ctx, std::memory_order_relaxed);
  g_job.total.store(chunks, std::memory_order_relaxed);
  g_job.done.store(0, std::memory_order_relaxed);
  g_job.state.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
  g_gen.store(gen);
  if (g_sleepers.load() > 0) futex_wake_all(&g_gen);
  const int64_t own = work(gen, false);
  for (int i = 0; g_job.done.load(std::memory_order_acquire) < chunks - own; ++i) {
    if (i < 256) KVS_PAUSE();
    else sched_yield();  // the helper's chunk may be waiting for this very core
  }
  g_busy.store(false, std::memory_order_release);
}

namespace {

int64_t set_native_threads(int64_t n) {
  TORCH_CHECK(n >= 1 && n <= kMaxThreads, "set_native_threads: 1..", kMaxThreads, " threads, not ", n);
  g_threads.store(static_cast<int>(n));
  return n;
}

int64_t native_threads() { return threads(); }
void pool_wake() { wake(); }

}  // namespace
}  // namespace kvs

TORCH_LIBRARY_FRAGMENT(kvserve_paged, m) {
  m.def("set_native_threads(int n) -> int", &kvs::set_native_threads);
  m.def("native_threads() -> int", &kvs::native_threads);
  m.def("pool_wake() -> ()", &kvs::pool_wake);
}
