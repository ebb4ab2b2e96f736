// Placing the weights at load: each matrix copied, or repacked into its x8 layout (ggml_x8.h),
// straight from the memory-mapped file (or read from it with pread) into its place in the one
// buffer the decode kernels stream (`jllama.model.packing`), on several threads. Plain C functions
// called through ctypes (`jllama.kernels.repack`), not XLA handlers: this runs before any
// program does.
//
// Why here and not NumPy: NumPy's fancy-index permutation of every byte (`jllama.model.ggml_repack`,
// kept as the reference the tests compare with) took 11-14 s for Llama-3.2-1B's 0.8 GB, and its
// intermediate arrays doubled the process's memory. A tile here is a few dozen fixed-size moves.
//
// Memory: a source read through the mapping leaves its pages in the process's RSS (file-backed);
// with `release` set they are dropped (madvise MADV_DONTNEED) as each piece is done, so the
// file's pages do not stay resident beside their copy. That is only safe on a read-only shared
// file mapping (its pages are read again from the file if touched later); the caller says which
// sources are.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <system_error>
#include <thread>
#include <vector>

#include "ggml_x8.h"

namespace jllama {
namespace {

// A tile of an x8 layout is built from the 8 rows' blocks by sections, in order (the same
// layouts `ggml::x8_positions` and `jllama.model.ggml_repack.tile_sources` describe byte by byte;
// the tests check all three agree):
//   kPerRow  bytes start .. start + count - 1 of row 0, then of row 1, ... (count 2 or 4)
//   kQh      as kPerRow with count 4, each row's 32 bits transposed (Q5_0 / Q5_1's high bits)
//   kChunks  `count` chunks: chunk c is bytes start + 4c .. start + 4c + 3 of rows 0 .. 7
//   kPlanes  `count` planes: plane p is byte start + p of rows 0 .. 7
enum Kind : int16_t { kPerRow, kQh, kChunks, kPlanes };

struct Section {
  Kind kind;
  int16_t start, count;
};

struct Tiling {
  Section sections[12];
  int n;
};

Tiling tiling(int32_t type) {
  using namespace ggml;
  switch (type) {
    case Q8_0: return {{{kPerRow, 0, 2}, {kChunks, 2, 8}}, 2};
    case Q4_0: return {{{kPerRow, 0, 2}, {kChunks, 2, 4}}, 2};
    case Q4_1: return {{{kPerRow, 0, 2}, {kPerRow, 2, 2}, {kChunks, 4, 4}}, 3};
    case Q5_0: return {{{kPerRow, 0, 2}, {kQh, 2, 4}, {kChunks, 6, 4}}, 3};
    case Q5_1: return {{{kPerRow, 0, 2}, {kPerRow, 2, 2}, {kQh, 4, 4}, {kChunks, 8, 4}}, 4};
    case Q4_K:
      return {{{kPerRow, 0, 2}, {kPerRow, 2, 2}, {kPlanes, 4, 12}, {kChunks, 16, 8},
               {kChunks, 48, 8}, {kChunks, 80, 8}, {kChunks, 112, 8}}, 7};
    case Q5_K:
      return {{{kPerRow, 0, 2}, {kPerRow, 2, 2}, {kPlanes, 4, 12}, {kChunks, 16, 8},
               {kChunks, 48, 8}, {kChunks, 80, 8}, {kChunks, 112, 8}, {kChunks, 144, 8}}, 8};
    case Q6_K:
      return {{{kPerRow, 208, 2}, {kPlanes, 192, 16}, {kChunks, 0, 16}, {kChunks, 64, 16},
               {kChunks, 128, 8}, {kChunks, 160, 8}}, 6};
    default:
      return {{}, 0};
  }
}

// Bit 8i + k of the result is bit 4k + i of `qh` (jllama.model.ggml_repack._transpose_qh).
inline uint32_t transpose_qh(uint32_t qh) {
#if defined(__BMI2__)
  return _pext_u32(qh, 0x11111111u) | _pext_u32(qh, 0x22222222u) << 8 |
         _pext_u32(qh, 0x44444444u) << 16 | _pext_u32(qh, 0x88888888u) << 24;
#else
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 8; ++k) out |= ((qh >> (4 * k + i)) & 1u) << (8 * i + k);
  return out;
#endif
}

// One tile from the 8 rows' blocks row[0 .. 7].
inline void x8_tile(const Tiling& t, const uint8_t* const* row, uint8_t* out) {
  for (int s = 0; s < t.n; ++s) {
    const Section& sec = t.sections[s];
    switch (sec.kind) {
      case kPerRow:
        for (int r = 0; r < 8; ++r, out += sec.count) std::memcpy(out, row[r] + sec.start, sec.count);
        break;
      case kQh:
        for (int r = 0; r < 8; ++r, out += 4) {
          uint32_t qh;
          std::memcpy(&qh, row[r] + sec.start, 4);
          qh = transpose_qh(qh);
          std::memcpy(out, &qh, 4);
        }
        break;
      case kChunks:
        for (int c = 0; c < sec.count; ++c)
          for (int r = 0; r < 8; ++r, out += 4) std::memcpy(out, row[r] + sec.start + 4 * c, 4);
        break;
      case kPlanes:
        for (int p = 0; p < sec.count; ++p)
          for (int r = 0; r < 8; ++r) *out++ = row[r][sec.start + p];
        break;
    }
  }
}

// Rows [0, rows) (a multiple of 8) of `type` from src into its x8 layout at dst.
void x8_rows(int32_t type, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes) {
  const Tiling t = tiling(type);
  const int64_t nb = ggml::layout(type).bytes, blocks = row_bytes / nb;
  for (int64_t g = 0; g < rows; g += 8) {
    const uint8_t* group = src + g * row_bytes;
    uint8_t* out = dst + g * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* row[8];
      for (int r = 0; r < 8; ++r) row[r] = group + r * row_bytes + b * nb;
      x8_tile(t, row, out + b * 8 * nb);
    }
  }
}

}  // namespace
}  // namespace jllama

// One matrix (or part of one) to place, as `jllama.kernels.repack.PIECE` lays it out.
struct JllamaPiece {
  const uint8_t* src;   // the rows as stored (a mapped file or any memory)
  int64_t file_offset;  // where they start in the file `fd`, to pread them instead of src
  uint8_t* dst;         // where they go
  int64_t rows, row_bytes;
  int32_t type;         // a ggml type id to repack into its x8 layout, or -1 to copy as is
  int32_t release;      // 1: src is a read-only shared file mapping; drop its pages once read
  int32_t fd;           // an open file to pread the rows from at file_offset, or -1: use src
  int32_t unused;
};

namespace jllama {
namespace {

// Bytes of source a thread takes at a time: big enough that the per-item costs (a madvise, a
// pread) vanish, small enough that a pread's scratch stays in cache and the two threads share
// the work evenly to the end.
constexpr int64_t kItemBytes = 1 << 20;

struct Item {
  int64_t piece, begin, end;  // rows [begin, end) of the piece
};

const int64_t kPage = sysconf(_SC_PAGESIZE);

// madvise(MADV_DONTNEED) on the whole pages inside [begin, end) (inward) or covering it.
void drop_pages(const uint8_t* begin, const uint8_t* end, bool inward) {
  uintptr_t lo = reinterpret_cast<uintptr_t>(begin), hi = reinterpret_cast<uintptr_t>(end);
  const uintptr_t page = static_cast<uintptr_t>(kPage);
  lo = inward ? (lo + page - 1) / page * page : lo / page * page;
  hi = inward ? hi / page * page : (hi + page - 1) / page * page;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

// Read n bytes at `offset` of fd into out; 0, or the errno (EIO for a short file).
int read_fully(int fd, int64_t offset, uint8_t* out, int64_t n) {
  while (n > 0) {
    const ssize_t got = pread(fd, out, static_cast<size_t>(n), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return got < 0 ? errno : EIO;
    out += got;
    offset += got;
    n -= got;
  }
  return 0;
}

int place_item(const JllamaPiece& p, const Item& item, std::vector<uint8_t>& scratch) {
  const int64_t offset = item.begin * p.row_bytes, n = (item.end - item.begin) * p.row_bytes;
  uint8_t* dst = p.dst + offset;
  const bool x8 = p.type >= 0;
  const uint8_t* src = p.src + offset;
  if (p.fd >= 0) {
    if (!x8) return read_fully(p.fd, p.file_offset + offset, dst, n);
    if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
    if (int e = read_fully(p.fd, p.file_offset + offset, scratch.data(), n)) return e;
    src = scratch.data();
  }
  if (x8)
    x8_rows(p.type, src, dst, item.end - item.begin, p.row_bytes);
  else
    std::memcpy(dst, src, n);
  if (p.release && p.fd < 0) drop_pages(src, src + n, /*inward=*/true);
  return 0;
}

}  // namespace
}  // namespace jllama

// Place `n` pieces on `threads` threads (the caller's among them). A piece with type >= 0 is
// repacked into that type's x8 layout (rows a multiple of 8; row_bytes whole blocks), else
// copied. A piece with fd >= 0 is read from that file with pread instead of through src. A
// piece with release set (and fd -1) has the pages of its source range dropped from the process
// once read (see the top of this file).
// Returns 0; -1 for a piece that does not fit its type (nothing is written then); or the errno
// of a failed read.
extern "C" int jllama_place(const JllamaPiece* pieces, int64_t n, int32_t threads) {
  using namespace jllama;
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i) {
    const JllamaPiece& p = pieces[i];
    if (p.rows < 0 || p.row_bytes < 0) return -1;
    int64_t step = p.row_bytes > 0 ? std::max<int64_t>(1, kItemBytes / p.row_bytes) : p.rows;
    if (p.type >= 0) {
      const int64_t nb = ggml::layout(p.type).bytes;
      if (!ggml::has_x8(p.type) || p.rows % 8 != 0 || p.row_bytes % nb != 0) return -1;
      step = (step + 7) / 8 * 8;
    }
    for (int64_t r = 0; r < p.rows; r += step) items.push_back({i, r, std::min(p.rows, r + step)});
  }
  std::atomic<int64_t> next{0};
  std::atomic<int> error{0};
  auto work = [&] {
    std::vector<uint8_t> scratch;
    for (int64_t k; (k = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      if (error.load(std::memory_order_relaxed)) return;
      if (int e = place_item(pieces[items[k].piece], items[k], scratch)) error.store(e);
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // fewer threads: the ones running do all the work
    }
  }
  work();
  for (std::thread& t : helpers) t.join();
  // The pages each piece shares with its neighbours, which the items left in place.
  for (int64_t i = 0; i < n; ++i) {
    const JllamaPiece& p = pieces[i];
    if (p.release && p.fd < 0)
      drop_pages(p.src, p.src + p.rows * p.row_bytes, /*inward=*/false);
  }
  return error.load();
}
