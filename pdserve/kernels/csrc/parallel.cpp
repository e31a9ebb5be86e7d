// The chunk-claiming pool behind pdserve::parallel_for (parallel.h).
//
// One job at a time (a second concurrent caller, or a call from inside a chunk, runs its loop inline). The job's
// state is one 64-bit atomic: epoch (high 32 bits, +1 per job) and the next unclaimed chunk (low 32). A thread
// claims chunk i of job e by a CAS from (e, i) to (e, i + 1) with i < nchunks; a successful claim proves the job's
// fields it read after seeing epoch e belong to job e (the next caller first closes e, setting its chunk index to
// kClosed, and only then rewrites the fields and moves the epoch on, so a claim of e that read the next job's
// fields fails its CAS). `done_` counts finished chunks of the current job; the caller returns
// when it reaches nchunks. Workers spin briefly after a job (the next op of a step follows within microseconds),
// then sleep on a futex; the caller wakes sleepers but never waits for a worker that claimed nothing. Waiting for
// a claimed chunk, the caller spins briefly, then sleeps on `done_seq_`, which the last chunk's thread bumps.
#include "parallel.h"

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <torch/extension.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "registry.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PDSERVE_PAUSE() _mm_pause()
#else
#define PDSERVE_PAUSE() ((void)0)
#endif

namespace pdserve {
namespace {

// Chunks per thread: more than one, so that a late worker still finds work to take; few, because every claim moves
// the job's cache line between cores.
const int64_t kChunksPerThread = [] {
  const char* v = std::getenv("PDSERVE_POOL_CHUNKS_PER_THREAD");
  return v != nullptr && std::atoll(v) > 0 ? static_cast<int64_t>(std::atoll(v)) : int64_t{4};
}();

// Microseconds from the environment variable `name` (tuning; read once), else `fallback`.
std::chrono::microseconds env_us(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return std::chrono::microseconds(v != nullptr ? std::atoll(v) : fallback);
}
// A worker spins this long after a job before it sleeps: the next op of a step follows within microseconds, the next
// step after the engine's Python work (about a millisecond).
const std::chrono::microseconds kWorkerSpin = env_us("PDSERVE_POOL_WORKER_SPIN_US", 500);
// The caller waiting for claimed chunks spins at least this long (more for long chunks), then sleeps until they
// are done.
const std::chrono::microseconds kCallerSpin = env_us("PDSERVE_POOL_CALLER_SPIN_US", 50);

thread_local bool t_in_pool = false;
std::atomic<bool> g_workers_paused{false};  // tests: workers claim nothing, the caller runs every chunk

// PDSERVE_PARALLEL=omp runs loops on ATen's OpenMP team instead (comparisons; a way out should the pool misbehave).
bool use_omp() {
  static const bool omp = [] {
    const char* v = std::getenv("PDSERVE_PARALLEL");
    return v != nullptr && std::strcmp(v, "omp") == 0;
  }();
  return omp;
}  // a worker, or a caller inside its own loop: nested loops run inline

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

class Pool {
 public:
  static constexpr uint64_t kClosed = 0xffffffffu;  // chunk index of a finished job: no chunk is left
  void run(int64_t begin, int64_t chunk, int64_t nchunks, int64_t end, ChunkFn fn, const void* ctx,
           int64_t threads) {
    std::unique_lock<std::mutex> lock(call_mu_, std::try_to_lock);
    if (!lock.owns_lock()) {  // another thread's loop is running: this one runs inline rather than queue
      fn(ctx, begin, end);
      return;
    }
    grow(threads - 1);
    // Close the previous job before its fields change: a worker that read the old epoch's state and then this
    // job's nchunks_ would otherwise see an unclaimed chunk, claim it under the old epoch with this job's fields,
    // and count it into this job's done_ (so this call could return while a chunk still ran on its frame). After
    // this no chunk index of the old epoch is below any nchunks_, and a claim read before it fails its exchange.
    for (uint64_t cur = state_.load(); !state_.compare_exchange_weak(cur, cur | kClosed);) {
    }
    fn_.store(fn), ctx_.store(ctx), begin_.store(begin), chunk_.store(chunk), end_.store(end);
    nchunks_.store(nchunks), max_workers_.store(threads - 1);
    done_.store(0);
    error_ = nullptr;
    const uint64_t epoch = (state_.load() >> 32) + 1;
    state_.store(epoch << 32);  // publish: the fields above are visible to whoever sees this epoch
    if (sleepers_.load() > 0) {
      wake_seq_.fetch_add(1);
      futex_wake_all(&wake_seq_);
    }
    t_in_pool = true;
    const auto start = std::chrono::steady_clock::now();
    const int64_t ran = work(epoch);
    const auto mine = std::chrono::steady_clock::now() - start;
    t_in_pool = false;
    // a worker running on another core finishes its last chunk about a chunk's time after the caller: spin that
    // long (twice the caller's own mean chunk, at least kCallerSpin, at most 1 ms), then sleep
    const auto budget = std::clamp<std::chrono::steady_clock::duration>(
        ran > 0 ? 2 * mine / ran : std::chrono::steady_clock::duration(kCallerSpin), kCallerSpin,
        std::chrono::milliseconds(1));
    wait_done(nchunks, budget);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // Claim and run chunks of job `epoch` until none is left (or the job is no longer current); how many it ran.
  int64_t work(uint64_t epoch) {
    int64_t ran = 0;
    uint64_t v = state_.load();
    while ((v >> 32) == epoch) {
      const int64_t n = nchunks_.load(), i = static_cast<int64_t>(v & 0xffffffffu);
      if (i >= n) return ran;
      const ChunkFn fn = fn_.load();
      const void* ctx = ctx_.load();
      const int64_t b = begin_.load() + i * chunk_.load(), e = std::min(end_.load(), b + chunk_.load());
      if (!state_.compare_exchange_weak(v, v + 1)) continue;  // v reloaded: someone else claimed it, or new job
      try {
        fn(ctx, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> g(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      finish_chunk();
      ++ran;
      v = state_.load();
    }
    return ran;
  }

  // The thread that finishes a job's last chunk bumps done_seq_ and wakes a caller asleep on it.
  void finish_chunk() {
    if (done_.fetch_add(1) + 1 != nchunks_.load()) return;
    done_seq_.fetch_add(1);
    if (caller_asleep_.load()) futex_wake_all(&done_seq_);
  }

  // Spin a little, then sleep until the last claimed chunk is done: a worker that shares the caller's core (the
  // scheduler may put it there) gets the core instead of waiting behind a spinning caller.
  void wait_done(int64_t nchunks, std::chrono::steady_clock::duration spin) {
    const uint32_t seq = done_seq_.load();
    if (done_.load() >= nchunks) return;
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0; done_.load() < nchunks; ++spins) {
      PDSERVE_PAUSE();
      if ((spins & 63) != 63 || std::chrono::steady_clock::now() - start < spin) continue;
      caller_asleep_.store(true);
      if (done_.load() < nchunks) futex_wait(&done_seq_, seq);  // returns at once if the last chunk ended
      caller_asleep_.store(false);
    }
  }

  void grow(int64_t want) {
    while (static_cast<int64_t>(workers_.size()) < want) {
      const int64_t id = static_cast<int64_t>(workers_.size());
      workers_.emplace_back([this, id] { worker_main(id); });
      workers_.back().detach();  // the pool lives as long as the process (never destroyed)
    }
  }

  void worker_main(int64_t id) {
    t_in_pool = true;
    uint64_t seen = 0;  // the last epoch this worker took part in
    for (;;) {
      const uint64_t epoch = wait_new_job(seen);
      seen = epoch;
      if (id < max_workers_.load() && !g_workers_paused.load()) work(epoch);
    }
  }

  // Spin, then sleep, until a job newer than `seen` is published; returns its epoch.
  uint64_t wait_new_job(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      const uint64_t epoch = state_.load() >> 32;
      if (epoch != seen) return epoch;
      PDSERVE_PAUSE();
      if ((spins & 255) != 255 || std::chrono::steady_clock::now() - start < kWorkerSpin) continue;
      const uint32_t seq = wake_seq_.load();
      sleepers_.fetch_add(1);
      if ((state_.load() >> 32) == seen) futex_wait(&wake_seq_, seq);  // re-checked after counting as a sleeper
      sleepers_.fetch_sub(1);
    }
  }

  std::mutex call_mu_, error_mu_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0}, begin_{0}, chunk_{1}, end_{0}, nchunks_{0}, max_workers_{0};
  std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<uint32_t> wake_seq_{0}, done_seq_{0};
  std::atomic<bool> caller_asleep_{false};
  std::atomic<int> sleepers_{0};
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: detached workers may still be asleep on it at exit
  return *p;
}

}  // namespace

int64_t num_threads() { return std::max(1, at::get_num_threads()); }

void parallel_run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* ctx) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (use_omp()) {
    at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(ctx, b, e); });
    return;
  }
  const int64_t threads = t_in_pool ? 1 : num_threads();
  const int64_t parts = threads * kChunksPerThread;
  const int64_t chunk = std::max<int64_t>({1, grain, (n + parts - 1) / parts});
  const int64_t nchunks = (n + chunk - 1) / chunk;
  if (threads <= 1 || nchunks <= 1) {
    fn(ctx, begin, end);
    return;
  }
  pool().run(begin, chunk, nchunks, end, fn, ctx, threads);
}

namespace {

// Test hook: the chunks one loop ran, as (begin, end, ran on the calling thread); `throw_at` >= 0: the chunk
// holding that index throws; `wait_for_worker_s` > 0: a chunk on the calling thread waits (at most that long) until
// a worker has run a chunk, so a test can see the workers take part however late they wake.
std::vector<std::tuple<int64_t, int64_t, bool>> parallel_chunks(int64_t begin, int64_t end, int64_t grain,
                                                                int64_t throw_at, double wait_for_worker_s) {
  std::mutex mu;
  std::vector<std::tuple<int64_t, int64_t, bool>> out;
  std::atomic<bool> worker_ran{false};
  const std::thread::id caller = std::this_thread::get_id();
  parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    const bool on_caller = std::this_thread::get_id() == caller;
    {
      std::lock_guard<std::mutex> g(mu);
      out.emplace_back(b, e, on_caller);
    }
    if (!on_caller) {
      worker_ran.store(true);
    } else if (wait_for_worker_s > 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_for_worker_s);
      while (!worker_ran.load() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    TORCH_CHECK(throw_at < b || throw_at >= e, "chunk [", b, ", ", e, ") failed on purpose");
  });
  std::sort(out.begin(), out.end());
  return out;
}

// Tests: `loops` parallel loops back to back, alternating few and many chunks (the pattern of a step's ops), each
// chunk counted in a record that outlives its loop; returns the violations: a chunk run twice or never, or run after
// its loop returned.
int64_t parallel_race_check(int64_t loops) {
  struct Record {
    std::atomic<int> counts[64];
    std::atomic<bool> returned{false};
    std::atomic<int> late{0};
  };
  std::vector<std::unique_ptr<Record>> records;
  for (int64_t l = 0; l < loops; ++l) {
    records.push_back(std::make_unique<Record>());
    Record* r = records.back().get();
    for (auto& c : r->counts) c.store(0);
    const int64_t n = (l % 2 == 0) ? 2 : 64;  // grain 1: n chunks where the thread count allows
    parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        if (r->returned.load()) r->late.fetch_add(1);
        r->counts[i].fetch_add(1);
      }
    });
    r->returned.store(true);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a chunk still running late shows up meanwhile
  int64_t bad = 0;
  for (int64_t l = 0; l < loops; ++l) {
    const int64_t n = (l % 2 == 0) ? 2 : 64;
    bad += records[l]->late.load();
    for (int64_t i = 0; i < n; ++i) bad += records[l]->counts[i].load() != 1;
  }
  return bad;
}

void register_parallel(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("parallel_chunks", &parallel_chunks, py::arg("begin"), py::arg("end"), py::arg("grain"),
        py::arg("throw_at") = -1, py::arg("wait_for_worker_s") = 0.0, py::call_guard<py::gil_scoped_release>(),
        "run one parallel loop; the chunks it ran as (begin, end, on the calling thread), sorted");
  m.def("parallel_race_check", &parallel_race_check, py::arg("loops"), py::call_guard<py::gil_scoped_release>(),
        "tests: violations (chunks run twice, never, or after their loop returned) over `loops` loops back to back");
  m.def("set_parallel_workers_paused", [](bool paused) { g_workers_paused.store(paused); }, py::arg("paused"),
        "tests: the pool's workers claim no chunks (loops must still finish, on the calling thread)");
  m.def("parallel_backend", [] { return use_omp() ? "omp" : "pool"; },
        "what runs the kernels' loops: the chunk-claiming pool, or ATen's OpenMP team (PDSERVE_PARALLEL=omp)");
}

}  // namespace
PDSERVE_REGISTER(register_parallel);
}  // namespace pdserve
