// pdserve's parallel loop: chunks claimed by whichever threads are running, no barrier for the ones that are not.
//
// Why not at::parallel_for (OpenMP): an OpenMP region ends at a barrier that every thread of the team must reach,
// so when a core is busy with something else (the server's event loop, tokenizer threads, another process on a
// shared host) one descheduled team member stalls the whole op for a scheduler time slice. A step runs ~200
// regions; on a loaded 2-core machine a 512-token prefill measured 1-6 s with 2 OpenMP threads against 0.1 s with
// one. Here the range is cut into chunks at fixed offsets, the caller and the pool's workers claim chunks from one
// atomic counter, and the caller waits only for chunks that were claimed: a worker that has not started when the
// caller ran out of chunks simply finds none. Correctness never depends on a worker running at all.
//
// Chunk boundaries depend only on (begin, end, grain, thread count), and every kernel computes each output element
// within one chunk, so results do not depend on which thread ran a chunk.
#pragma once

#include <cstdint>

namespace pdserve {

using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Threads a parallel loop may use (ATen's intra-op setting: torch.set_num_threads).
int64_t num_threads();
// fn(ctx, b, e) over [begin, end) in chunks of at least `grain`; returns when every chunk ran. An exception thrown
// by a chunk is rethrown here (the first one; the other chunks still run).
void parallel_run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* ctx);

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_run(begin, end, grain, [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); },
               &f);
}

}  // namespace pdserve
