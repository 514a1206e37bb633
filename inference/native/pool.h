// The native kernels' own threads (pool.cpp): a job's chunks go to whichever thread is free, the caller's first.
// A helper that is asleep, late or descheduled takes no chunk and is never waited for; only a chunk a helper has
// started is. So a core that another process takes for a moment delays one chunk, not the job (an OpenMP region
// waits at its barrier for every thread it counted on).
#pragma once

#include <cstdint>

namespace kvs {

using ChunkFn = void (*)(void* ctx, int64_t chunk);

// Runs fn(ctx, c) once for every c in [0, chunks), on the calling thread and the pool's helpers; returns when all
// have run. Serial on the caller when the pool has one thread, when another caller holds the pool, or when called
// from a chunk. fn must not throw.
void run_chunks(int64_t chunks, ChunkFn fn, void* ctx);

// Wakes sleeping helpers ahead of a burst of jobs (a step about to run): they spin a while for the first one
// instead of being woken by it.
void wake();

// How many threads a job may use (the caller and threads() - 1 helpers); kvserve_paged::set_native_threads.
int threads();

template <typename F>
void parallel_chunks(int64_t chunks, F&& f) {
  run_chunks(chunks, [](void* ctx, int64_t c) { (*static_cast<F*>(ctx))(c); }, &f);
}

// [begin, end) of chunk c when n items are cut into `chunks` nearly equal runs
inline void chunk_range(int64_t n, int64_t chunks, int64_t c, int64_t* begin, int64_t* end) {
  *begin = n * c / chunks;
  *end = n * (c + 1) / chunks;
}

}  // namespace kvs
