// The most bytes per second two threads read from memory here: the ceiling of any f32 decode
// that streams its weights once per token (bench/ceiling.py runs it beside llama2.c's run.c).
//
//   stream_read BYTES REPS  ->  one JSON line: the median GB/s of REPS passes over a buffer of
//                               BYTES for each way of reading it, and the best of them.
//
// The ways: plain loads; non-temporal prefetches 1, 2 (what jllama's kernels do), 4 and 8 KiB
// ahead; prefetcht0 4 KiB ahead; and each thread reading its half as two interleaved streams
// with the 2 KiB non-temporal prefetch. Each way reads a buffer on 4 KiB pages and, as
// "..._huge", a second one marked for 2 MiB transparent huge pages (as jllama's packed weights:
// jllama/model/packing.py), where the non-temporal reads ran ~4% faster in slow minutes. Each pass sums the buffer in 64 float lanes (the
// compiler vectorizes them), half of it per OpenMP thread; built -O3 -march=native -fopenmp.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum Hint { kNone, kNta, kT0 };

template <Hint H, int Ahead>
inline void ask(const float* p) {
#if defined(__x86_64__)
  for (int b = 0; H != kNone && b < 256; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + Ahead + b, H == kNta ? _MM_HINT_NTA : _MM_HINT_T0);
#endif
}

template <Hint H, int Ahead>
float sum(const float* p, size_t n) {
  float acc[64] = {0};
  for (size_t i = 0; i < n; i += 64) {
    ask<H, Ahead>(p + i);
    for (int j = 0; j < 64; ++j) acc[j] += p[i + j];
  }
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

// The two halves of [p, p + n) read side by side, 64 floats of each in turn.
float sum_two_streams(const float* p, size_t n) {
  const size_t half = n / 2 / 64 * 64;
  float acc[64] = {0};
  for (size_t i = 0; i < half; i += 64) {
    ask<kNta, 2048>(p + i);
    ask<kNta, 2048>(p + half + i);
    for (int j = 0; j < 64; ++j) acc[j] += p[i + j] + p[half + i + j];
  }
  float s = 0;
  for (size_t i = 2 * half; i < n; ++i) s += p[i];
  for (float a : acc) s += a;
  return s;
}

using Sum = float (*)(const float*, size_t);

double pass_seconds(Sum f, const float* p, size_t n) {
  auto start = std::chrono::steady_clock::now();
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t threads = omp_get_num_threads(), id = omp_get_thread_num();
    const size_t chunk = n / threads / 64 * 64, begin = id * chunk;
    const size_t end = id + 1 == threads ? n : begin + chunk;
    total += f(p + begin, end - begin);
  }
  volatile float sink = total;
  (void)sink;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: stream_read BYTES REPS\n");
    return 2;
  }
  const size_t n = std::strtoull(argv[1], nullptr, 10) / 4 / 64 * 64;
  const int reps = std::atoi(argv[2]);
  if (n == 0 || reps < 1) {
    std::fprintf(stderr, "stream_read: BYTES must be >= 256 and REPS >= 1\n");
    return 2;
  }
  std::vector<float> buffer(n, 1.0f);  // a large malloc: fresh 4 KiB pages
  // The huge-page buffer: n floats from a 2 MiB boundary of an anonymous mapping.
  const size_t huge = 2u << 20;
  float* huge_buffer = nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  void* region = mmap(nullptr, n * 4 + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region != MAP_FAILED) {
    char* start = static_cast<char*>(region) + (-reinterpret_cast<uintptr_t>(region) % huge);
    madvise(start, n * 4, MADV_HUGEPAGE);
    huge_buffer = reinterpret_cast<float*>(start);
    std::fill(huge_buffer, huge_buffer + n, 1.0f);
  }
#endif
  const struct {
    const char* name;
    Sum f;
  } ways[] = {{"plain", sum<kNone, 0>},       {"nta_1k", sum<kNta, 1024>},
              {"nta_2k", sum<kNta, 2048>},    {"nta_4k", sum<kNta, 4096>},
              {"nta_8k", sum<kNta, 8192>},    {"t0_4k", sum<kT0, 4096>},
              {"nta_2k_two_streams", sum_two_streams}};
  const int count = sizeof ways / sizeof ways[0];
  const int buffers = huge_buffer ? 2 : 1;
  const float* data[2] = {buffer.data(), huge_buffer};
  std::vector<std::vector<double>> seconds(count * buffers);
  pass_seconds(ways[0].f, buffer.data(), n);  // fault the pages in
  for (int r = 0; r < reps; ++r)  // the ways alternate within each repetition
    for (int b = 0; b < buffers; ++b)
      for (int w = 0; w < count; ++w)
        seconds[b * count + w].push_back(pass_seconds(ways[w].f, data[b], n));
  double best = 0;
  std::printf("{\"bytes\": %zu", n * 4);
  for (int b = 0; b < buffers; ++b)
    for (int w = 0; w < count; ++w) {
      std::vector<double>& s = seconds[b * count + w];
      std::sort(s.begin(), s.end());
      const double gb_s = n * 4.0 / 1e9 / s[s.size() / 2];
      best = std::max(best, gb_s);
      std::printf(", \"%s%s_gb_s\": %.2f", ways[w].name, b ? "_huge" : "", gb_s);
    }
  std::printf(", \"best_gb_s\": %.2f}\n", best);
  return 0;
}
