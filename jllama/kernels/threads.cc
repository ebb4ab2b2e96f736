// Splitting a product's rows over threads: `run` (kernels.h).
//
// Each thread (the caller and jllama's helper threads, one fewer than XLA's intra-op
// pool has threads; `Helpers`) owns a contiguous share of the rows, cut into blocks, and takes
// them from the front; a thread whose share is done takes blocks from the back of the others'.
// The caller owns the first share, helpers the others, so a helper idle between two products
// can warm its L2 with its share of the next one (`Helpers::warm`).
// The caller works too and waits only for blocks another thread has already taken, so a
// product never waits for a helper that has not started: two products running side by side
// cannot deadlock, and a product finishes even with no helper at all.

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>

#include "kernels.h"

namespace jllama {
namespace {

// Below this many weights a product runs on the calling thread alone: scheduling a task costs
// a few microseconds, more than such a product takes.
constexpr int64_t kMinParallelWeights = 1 << 16;
// Rows are taken in blocks of about this many weights (32 KiB of f32). Each thread owns one
// contiguous share, as OpenMP's static schedule gives run.c, so its weights stream without a
// restart (more chunks per thread decoded stories15M slower: 800 / 780 / 752 / 631 tok/s for
// 1 / 2 / 4 / 16); the blocks only let a thread that finishes first take the last blocks of
// the other's share. In-process A/B against one share per thread (bench/NOTES.md): stories110M
// +1-4% in the machine's fast minutes, SmolLM2 +1%, stories15M even (blocks of 64 KiB and more
// cost it 2-20%).
constexpr int64_t kBlockWeights = 1 << 13;

// Shared between the caller and the helpers; a helper may start after the product is done,
// so the state lives as long as its last holder.
struct Work {
  // One thread's share of the blocks: [front, end) packed as end << 32 | front, so its owner
  // (from the front) and the others (from the back) take blocks with one compare-exchange.
  // A cache line each: the owners' updates must not contend.
  struct alignas(64) Share {
    std::atomic<uint64_t> range;
  };

  Product product;
  int64_t m = 0, block = 1, shares = 0;
  std::unique_ptr<Share[]> share;
  std::atomic<int64_t> arrived{1};  // which share the next helper to arrive owns
  std::atomic<int64_t> rows_done{0};

  Work(const Product& p, int64_t rows, int64_t threads) : product(p), m(rows) {
    block = block_rows(p.n);
    const int64_t blocks = (m + block - 1) / block;
    shares = std::min(threads, blocks);
    share.reset(new Share[shares]);
    for (int64_t i = 0; i < shares; ++i) {
      const uint64_t front = first_block(blocks, shares, i);
      const uint64_t end = first_block(blocks, shares, i + 1);
      share[i].range.store(end << 32 | front, std::memory_order_relaxed);
    }
  }

  // Share i of `shares` begins at this block (share `shares` "begins" at the end).
  static int64_t first_block(int64_t blocks, int64_t shares, int64_t i) {
    return blocks * i / shares;
  }

  static int64_t block_rows(int64_t n) {
    return std::max<int64_t>(1, kBlockWeights / std::max<int64_t>(1, n));
  }

  // The rows [*begin, *end) of share `id` when m rows of n go to `threads` threads.
  static void share_rows(int64_t m, int64_t n, int64_t threads, int64_t id, int64_t* begin,
                         int64_t* end) {
    const int64_t block = block_rows(n), blocks = (m + block - 1) / block;
    const int64_t shares = std::min(threads, blocks);
    *begin = *end = 0;
    if (id >= shares) return;
    *begin = first_block(blocks, shares, id) * block;
    *end = std::min(m, first_block(blocks, shares, id + 1) * block);
  }

  static int64_t take(std::atomic<uint64_t>& range, bool from_front) {
    uint64_t v = range.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = v & 0xFFFFFFFFu, end = v >> 32;
      if (front >= end) return -1;
      const uint64_t next = from_front ? v + 1 : (end - 1) << 32 | front;
      if (range.compare_exchange_weak(v, next, std::memory_order_relaxed))
        return static_cast<int64_t>(from_front ? front : end - 1);
    }
  }

  int64_t run_block(int64_t b) {
    const int64_t begin = b * block, end = std::min(m, begin + block);
    product.rows(product, begin, end);
    return end - begin;
  }

  // Runs the blocks of share `id` (the caller's is 0; helpers take 1, 2, ... as they arrive,
  // so a helper's share is the one it warmed), then whatever is left of the others'.
  void help(int64_t id) {
    int64_t rows = 0;
    if (id < shares)
      for (int64_t b; (b = take(share[id].range, true)) >= 0;) rows += run_block(b);
    for (int64_t k = 1; k <= shares; ++k)
      for (int64_t b; (b = take(share[(id + k) % shares].range, false)) >= 0;)
        rows += run_block(b);
    // Once per thread, not per block: a first version that updated a shared counter every
    // block (and kept the shares on one cache line) decoded 7% slower.
    if (rows > 0) rows_done.fetch_add(rows, std::memory_order_release);
  }

  bool finished() const { return rows_done.load(std::memory_order_acquire) >= m; }
};

// A lock for a few instructions' worth of shared state: it spins, never sleeps.
class SpinLock {
 public:
  void lock() {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      while (locked_.load(std::memory_order_relaxed)) {
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
      }
    }
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

// jllama's own helper threads for the products, one fewer than XLA's intra-op pool has (the
// caller is the other). Between products they spin on a counter for a few milliseconds, then
// sleep. Why not XLA's pool: its tasks woke a second, idle pool thread about twice a token,
// which spun while the caller and the task's thread worked, so three threads shared two cores
// and the caller lost its core in the middle of its rows (~2 involuntary context switches a
// token, stalls of tens of microseconds; bench/NOTES.md). A decode keeps exactly as many
// threads busy as there are cores, as OpenMP does for run.c.
//
// A helper may take an offered product late or never; `Work::help` lets whoever comes take
// what is left, and a caller only waits for blocks already taken, so a product finishes even
// with no helper at all (e.g. in a child process after fork).
class Helpers {
 public:
  // The helpers for `threads` threads in all, started on first use; leaked on purpose, as
  // threads that live until the process exits.
  static Helpers& get(int64_t threads) {
    static Helpers* helpers = new Helpers(threads - 1);
    return *helpers;
  }

  // Makes `work` the product helpers pick up next, waking any that sleep.
  void offer(const std::shared_ptr<Work>& work) {
    {
      std::lock_guard<SpinLock> lock(mutex_);
      offered_ = work;
    }
    generation_.fetch_add(1);  // sequentially consistent with `sleeping_` below
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
  }

  // Drops the offer of a finished product (so it does not outlive its caller's wait).
  void withdraw(const Work* work) {
    std::lock_guard<SpinLock> lock(mutex_);
    if (offered_.get() == work) offered_.reset();
  }

  // Whether the next product should run on its caller alone: for kSoloProducts products after
  // two products within kStallWindow of each other whose callers waited kStall or more for a
  // helper's last block. A helper that keeps its caller waiting that long has lost its core to
  // another process (a block is ~1 us of work), and sharing work with it then costs more than
  // it gives: with another program busy on one of two cores, stories110M decoded at 64-67
  // tok/s split, 77 with this (XLA's own products 80-86). One stall alone does not count: on
  // a quiet machine they come a few times a second (~1 in 3000 products), and reacting to
  // each cost 4-10% (bench/NOTES.md).
  bool solo() {
    products_.fetch_add(1, std::memory_order_relaxed);
    int64_t left = solo_left_.load(std::memory_order_relaxed);
    while (left > 0 && !solo_left_.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
    }
    return left > 0;
  }

  void waited(std::chrono::steady_clock::duration wait) {
    if (wait < kStall) return;
    const int64_t now = products_.load(std::memory_order_relaxed);
    if (now - last_stall_.exchange(now, std::memory_order_relaxed) <= kStallWindow)
      solo_left_.store(kSoloProducts, std::memory_order_relaxed);
  }

 private:
  explicit Helpers(int64_t count) {
    // A thread that cannot be started leaves fewer helpers: the callers do their rows alone.
    for (int64_t i = 0; i < count; ++i) {
      try {
        std::thread([this] { serve(); }).detach();
      } catch (const std::system_error&) {
        break;
      }
    }
  }

  void serve() {
    uint64_t seen = generation_.load();
    for (;;) {
      auto spin_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kSpinMs);
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() > spin_until) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      std::shared_ptr<Work> work;
      {
        std::lock_guard<SpinLock> lock(mutex_);
        work = offered_;
      }
      if (work) {
        const int64_t id = work->arrived.fetch_add(1, std::memory_order_relaxed);
        work->help(id);
        warm(id, seen);
      }
    }
  }

  // Products come in the same order every token, so the product that followed this one last
  // time comes next: while the caller runs what lies between (attention, norms, XLA's own
  // steps), the helper that will own share `id` of it asks its L2 for that share's first
  // kWarmBytes (a core's L2 holds 1-2 MB), stopping as soon as another
  // product is offered. The arithmetic is untouched; only where the weights come from.
  void warm(int64_t id, uint64_t seen) {
#if defined(__x86_64__) || defined(_M_X64)
    Next next;
    {
      // After the last product recorded, not after the work just done: attention's work
      // between two products has no weights to warm.
      std::lock_guard<SpinLock> lock(mutex_);
      if (last_ == nullptr) return;
      const Next& slot = next_[slot_of(last_)];
      if (slot.after != last_) return;
      next = slot;
    }
    int64_t begin, end;  // in units of work, then in rows
    Work::share_rows(next.m, next.n, next.threads, id, &begin, &end);
    begin *= next.unit, end *= next.unit;
    int64_t left = kWarmBytes;
    for (int k = 0; k < next.n_spans && left > 0; ++k) {
      const Product::Span& span = next.spans[k];
      const int64_t from = std::max(begin, span.first), to = std::min(end, span.first + span.rows);
      if (from >= to) continue;
      const char* p = span.data + (from - span.first) * span.row_bytes;
      const int64_t bytes = std::min<int64_t>((to - from) * span.row_bytes, left);
      for (int64_t b = 0; b < bytes; b += 64) {
        if ((b & 4095) == 0 && generation_.load(std::memory_order_relaxed) != seen) return;
        _mm_prefetch(p + b, _MM_HINT_T1);
      }
      left -= bytes;
    }
#else
    (void)id, (void)seen;
#endif
  }

 public:
  // Notes that `p` (m rows, `threads` threads) followed the previous product run through the
  // helpers, for `warm`.
  void record(const Product& p, int64_t m, int64_t threads) {
    if (p.n_spans == 0) return;
    const char* key = p.spans[0].data;
    std::lock_guard<SpinLock> lock(mutex_);
    if (last_ != nullptr) {
      Next& next = next_[slot_of(last_)];
      next.after = last_;
      std::copy(p.spans, p.spans + p.n_spans, next.spans);
      next.n_spans = p.n_spans;
      next.unit = p.unit, next.m = m, next.n = p.n, next.threads = threads;
    }
    last_ = key;
  }

 private:
  struct Next {
    const char* after = nullptr;  // the first weights of the product this one followed
    Product::Span spans[Product::kMaxSpans] = {};
    int n_spans = 0;
    int64_t unit = 1, m = 0, n = 0, threads = 0;  // m in units
  };
  static size_t slot_of(const char* data) {
    return (reinterpret_cast<uintptr_t>(data) >> 6) % kNextSlots;
  }
  // Half a MiB: stories15M decoded 3% faster (1440 -> 1400 us a token, five alternated pairs
  // on the Intel VM, bench/NOTES.md); 1 MiB no better, stories110M even.
  static constexpr int64_t kWarmBytes = 1 << 19;
  static constexpr size_t kNextSlots = 509;  // a prime: products of many models and layers
  Next next_[kNextSlots];
  const char* last_ = nullptr;

  static constexpr int kSpinMs = 5;
  static constexpr std::chrono::microseconds kStall{1000};
  static constexpr int64_t kSoloProducts = 512;
  static constexpr int64_t kStallWindow = 64;  // products
  std::atomic<int64_t> solo_left_{0};
  std::atomic<int64_t> products_{0};  // products offered so far, for kStallWindow
  std::atomic<int64_t> last_stall_{-kStallWindow - 1};
  // The offer and the order of products, held for a few loads and stores: a spin lock, since a
  // std::mutex that a helper and the caller both took every product put one of them to sleep in
  // the kernel now and then (futex waits; a 288 x 288 product took 8 us where its rows take 5).
  SpinLock mutex_;
  std::mutex sleep_mutex_;  // for helpers that sleep after kSpinMs without work
  std::condition_variable wake_;
  std::shared_ptr<Work> offered_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
};

}  // namespace

void run(int64_t threads, const Product& product, int64_t m) {
  threads = std::max<int64_t>(1, threads);
  if (threads == 1 || m * product.n < kMinParallelWeights || m < 2) {
    product.rows(product, 0, m);
    return;
  }
  Product streaming = product;
  // Products this big stream their weights from memory (a small model's whole set of weights
  // fits in L2 and never gets here).
  streaming.stream = true;
  Helpers& helpers = Helpers::get(threads);
  helpers.record(product, m, threads);
  if (helpers.solo()) {
    streaming.rows(streaming, 0, m);
    return;
  }
  auto work = std::make_shared<Work>(streaming, m, threads);
  helpers.offer(work);
  work->help(0);
  const auto own_rows_done = std::chrono::steady_clock::now();
  // Every block is taken by now; wait for the ones a helper is still running.
  wait_for([&] { return work->finished(); });
  helpers.withdraw(work.get());
  helpers.waited(std::chrono::steady_clock::now() - own_rows_done);
}

}  // namespace jllama
