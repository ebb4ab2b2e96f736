// Prefill and batched products of GGML x8 weights on Intel AMX (Sapphire Rapids and later): the
// integer dot products of 16 tokens with 16 rows in one tile instruction, the float work as the
// 512-bit kernels do it (ggml_x8.h's Z16), so every (token, row) value has their bits.
//
// Why. A 512-bit dpbusd advances 16 rows by 4 values for one token (64 multiply-adds); the 2-core
// Sapphire Rapids VM this project measures on issues about one a cycle, so a prefill chunk's
// products run at ~60 multiply-adds a cycle a core whatever else is done. `tdpbsud` multiplies a
// 16 x 32 tile of int8 activations (16 tokens) with a 32 x 16 tile of uint8 weights (16 rows) in
// one instruction: 8192 multiply-adds. What is left per instruction is the float work: each
// sub-block's sums scaled into the tokens' running sums, 16 rows at a time.
//
// Layout. Two x8 groups' chunk c of sub-block j, decoded to one value per byte as the Z16 kernel
// decodes it (16 rows x 4 values, 64 bytes), is row c of the weight tile ("B", K/4 rows of 16
// rows x 4 bytes: AMX's own layout for the second operand); the tokens' quantized activations
// (one token per tile row, `stride` bytes apart) are the first operand as they lie in memory.
// The result tile holds each token's exact int32 dot product with each of the 16 rows: the same
// integer the Z16 kernel's dpbusd chain sums for that sub-block.
//
// Use. The process must be granted the tile data state by Linux once (`amx_ready`, which also
// checks the CPU and lets JLLAMA_AMX=0 turn it off); each thread loads the tile configuration
// before its tile instructions (`AmxTiles`) and releases it after.

#pragma once

#include "ggml_x8.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && JLLAMA_Q_Z16 && defined(__linux__)
#define JLLAMA_Q_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

namespace ggml {

// Whether this process may use AMX: the CPU has AMX-TILE and AMX-INT8, Linux granted the tile
// data state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once), and JLLAMA_AMX is not "0".
inline bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("JLLAMA_AMX");
    if (env != nullptr && env[0] == '0') return false;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    if (!tile || !int8) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ready;
}

// Tiles: 0 and 1 the int32 results of two sub-blocks' products (16 tokens x 16 rows), 2 and 3
// their activations (16 tokens x k bytes), 4 and 5 their weights (k / 4 rows of 64 bytes). Loaded for a thread's run of
// tile instructions and released when it ends, so that a thread that is not using AMX does not
// carry its 8 KB of state through context switches.
class AmxTiles {
 public:
  explicit AmxTiles(int k) {
    struct alignas(64) Config {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 2; ++t) {
      config.colsb[t] = 64, config.rows[t] = 16;
      config.colsb[2 + t] = static_cast<uint16_t>(k), config.rows[2 + t] = 16;
    }
    for (int t = 4; t < 6; ++t) config.colsb[t] = 64, config.rows[t] = static_cast<uint8_t>(k / 4);
    _tile_loadconfig(&config);
  }
  ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

// Scratch for `amx_pair`: the decoded weight tiles of a super-block, the results of two tile
// products, the tokens' running sums.
struct AmxScratch {
  alignas(64) uint8_t b[16][16 * 64];  // a tile per sub-block (Q6_K: 16 of 16 values)
  alignas(64) int32_t c[2][16 * 16];
  std::vector<float> acc;
};

// One step of a 16-token block's pass over a super-block: the products of sub-block `j` (its
// weight tile in `b`, the tokens' k activation bytes from `at`) go into result tile C while the
// previous sub-block's results (tile 1 - C, issued the step before) are stored and scaled into
// `part`: the tile unit works on step j while the vector units finish step j - 1.
// (GCC's tile intrinsics paste their tile numbers into the instruction's text, so each tile is
// named by a literal.)
template <int C>
inline void amx_issue(const int8_t* q, int64_t stride, int64_t at, const uint8_t* b) {
  if constexpr (C == 0) {
    _tile_loadd(2, q + at, stride);
    _tile_loadd(4, b, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
  } else {
    _tile_loadd(3, q + at, stride);
    _tile_loadd(5, b, 64);
    _tile_zero(1);
    _tile_dpbsud(1, 3, 5);
  }
}

template <int C>
inline void amx_store(int32_t* c) {
  if constexpr (C == 0) _tile_stored(0, c, 64);
  else _tile_stored(1, c, 64);
}

inline void amx_scale(const int32_t* c, __m512 scale, __m512* part) {
  for (int t = 0; t < 16; ++t)
    part[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * t)), scale, part[t]);
}

// Sub-blocks 0 .. S - 1 of a super-block for 16 tokens (q: the first token's activations),
// scale[j] the rows' float scale of sub-block j, at[j] its activations' offset: part[t] =
// sum_j float(dot_j) * scale[j] in j order, as the Z16 kernel sums it. Three steps in flight:
// sub-block j + 1's product is issued, j's results stored, j - 1's (stored a step before, so
// the loads do not wait for the tile store) scaled.
template <int S>
inline void amx_block(const int8_t* q, int64_t stride, const int64_t* at, AmxScratch& s,
                      const __m512* scale, __m512* part) {
  for (int t = 0; t < 16; ++t) part[t] = _mm512_setzero_ps();
  amx_issue<0>(q, stride, at[0], s.b[0]);
  amx_issue<1>(q, stride, at[1], s.b[1]);
  amx_store<0>(s.c[0]);
  for (int j = 1; j + 1 < S; j += 2) {
    // tile 0 is free (stored): j + 1 into it; j's results out of tile 1; j - 1's scaled.
    amx_issue<0>(q, stride, at[j + 1], s.b[j + 1]);
    amx_store<1>(s.c[1]);
    amx_scale(s.c[0], scale[j - 1], part);
    if (j + 2 < S) amx_issue<1>(q, stride, at[j + 2], s.b[j + 2]);
    amx_store<0>(s.c[0]);  // j + 1's
    amx_scale(s.c[1], scale[j], part);
  }
  // S even: the last (S - 1) is in tile 1, S - 2's already stored in c[0].
  amx_store<1>(s.c[1]);
  amx_scale(s.c[0], scale[S - 2], part);
  amx_scale(s.c[1], scale[S - 1], part);
}

// A super-block's pass over the 16-token blocks of x (their q `stride` bytes apart): for each,
// the products of its S sub-blocks (`amx_block`, whose weight tiles are in s.b, at and scale
// as there), then each token's running sums s.acc[t] = step(s.acc[t], part[t], x[t]).
template <int S, typename Step>
inline void amx_blocks(const Activations* x, int64_t stride, int64_t blocks, const int64_t* at,
                       const __m512* scale, AmxScratch& s, Step step) {
  __m512 part[16];
  for (int64_t i = 0; i < blocks; ++i) {
    amx_block<S>(x[16 * i].q, stride, at, s, scale, part);
    for (int t = 0; t < 16; ++t) {
      float* a = s.acc.data() + 16 * (16 * i + t);
      _mm512_storeu_ps(a, step(_mm512_loadu_ps(a), part[t], x[16 * i + t]));
    }
  }
}

// Rows r .. r + 15 (groups at w and w + pair) times tokens 0 .. 16 * blocks - 1 of x (their q
// `stride` bytes apart): y[t * ldy + 0 .. 15] = what x16_dot_n gives for token t, bit for bit.
// Q4_K, Q5_K and Q6_K (`amx_k`).
template <int32_t T>
inline void amx_pair(const uint8_t* w, int64_t pair, const Activations* x, int64_t stride,
                     int64_t blocks, float* y, int64_t ldy, AmxScratch& s) {
  using V = Z16;
  using F = __m512;
  using I = __m512i;
  const int64_t tokens = 16 * blocks, n = x[0].n;
  s.acc.assign(16 * tokens, 0.0f);
  const I low4 = V::set8(0x0F);
  if constexpr (T == Q4_K || T == Q5_K) {
    constexpr bool five = T == Q5_K;
    constexpr int64_t qs_at = five ? 384 : 128, tile = five ? 1408 : 1152;
    for (int64_t sb = 0; sb < n / 256; ++sb, w += tile) {
      uint64_t sc[8][2], mn[8][2];
      scales_mins<V>(w, pair, sc, mn);
      const F d = V::halves(w, pair, 0), dmin = V::halves(w, pair, 16);
      F dsc[8];
      int64_t at[8];
      for (int j = 0; j < 8; ++j) {
        const int g = j / 2, half = j % 2;
        for (int c = 0; c < 8; ++c) {
          const I qv = V::load(w, pair, qs_at + 256 * g + 32 * c);
          I v = V::and_(half ? V::srl4(qv) : qv, low4);
          if (five) v = V::or_(v, V::bit_to_0x10(V::load(w, pair, 128 + 32 * c), j));
          _mm512_store_si512(s.b[j] + 64 * c, v);
        }
        dsc[j] = V::mul(d, V::template bytes<false>(sc[j]));
        at[j] = 256 * sb + 32 * j;
      }
      I mins[4];
      for (int k = 0; k < 4; ++k) mins[k] = V::template pairs<false>(mn[2 * k], mn[2 * k + 1]);
      amx_blocks<8>(x, stride, blocks, at, dsc, s, [&](F a, F part, const Activations& xt) {
        return k4_step<V>(a, part, dmin, mins, xt, sb);
      });
    }
  } else if constexpr (T == Q6_K) {
    const I three = V::set8(3);
    for (int64_t sb = 0; sb < n / 256; ++sb, w += 1680) {
      uint64_t scales[16][2];
      for (int k = 0; k < 16; ++k) row_bytes<V>(w, pair, 16 + 8 * k, scales[k]);
      F sc[16];
      int64_t at[16];
      int step = 0;  // the Z16 kernel's order of the 16-value groups: nh, h, v
      for (int nh = 0; nh < 2; ++nh)
        for (int h = 0; h < 2; ++h)
          for (int v = 0; v < 4; ++v, ++step) {
            for (int c = 4 * h; c < 4 * h + 4; ++c) {
              const I qv = V::load(w, pair, 144 + 512 * nh + 32 * (c + 8 * (v % 2)));
              const I H = V::load(w, pair, 1168 + 256 * nh + 32 * c);
              const I lo = V::and_(v < 2 ? qv : V::srl4(qv), low4);
              const I hi = V::and_(V::srl16(H, 2 * v), three);
              _mm512_store_si512(s.b[step] + 64 * (c - 4 * h), V::or_(lo, V::sll4(hi)));
            }
            sc[step] = V::template bytes<true>(scales[8 * nh + 2 * v + h]);
            at[step] = 256 * sb + 128 * nh + 32 * v + 16 * h;
          }
      I sc16[8];
      for (int k = 0; k < 8; ++k) sc16[k] = V::template pairs<true>(scales[2 * k], scales[2 * k + 1]);
      const F d = V::halves(w, pair, 0);
      amx_blocks<16>(x, stride, blocks, at, sc, s, [&](F a, F part, const Activations& xt) {
        return k6_step<V>(a, part, d, sc16, xt, sb);
      });
    }
  }
  const float* acc = s.acc.data();
  for (int64_t t = 0; t < tokens; ++t) _mm512_storeu_ps(y + t * ldy, _mm512_loadu_ps(acc + 16 * t));
}

// The sub-block's bytes a weight tile holds for type T (the activations' k per instruction):
// 32, or 16 for Q6_K (a scale per 16 values); 0 for types without an AMX path here.
constexpr int amx_k(int32_t type) {
  return type == Q4_K || type == Q5_K ? 32 : type == Q6_K ? 16 : 0;
}

}  // namespace ggml

#endif
