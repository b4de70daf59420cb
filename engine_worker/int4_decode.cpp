// Int4 decode kernel: y[m, n] = sum_k x[m, k] * ((q[n, k] - 8) * scale[n, g] + zero[n, g]), for a
// few bf16 rows x, q in [0, 15], one bf16 (scale, zero) per group of 32 k (g = k / 32).
// Two variants of the block (below): groups of 16 k (kSub = 2 pairs per block: GGUF Q2_K, Q3_K,
// Q6_K sub-blocks) and q of 5 or 6 bits (kHigh = 1 or 2 bit planes beside the nibbles:
// q - 16 or q - 32 in place of q - 8; GGUF Q5_x, Q6_K), each read once.
//
// Per group the sum splits into scale * sum_k (q - 8) x + zero * sum_k x. (q - 8) is exact in
// bf16, so vdpbf16ps forms every product (q - 8) * x exactly and sums them in float32; the group's
// two float32 FMAs then add it in. No weight is rounded to bf16 and no activation to int8.
//
// Weights are repacked once (int4_decode.py: pack) into blocks of 16 outputs x 32 k, 320 bytes:
// 4 x 64 bytes of 16-bit words, each word four nibbles (word i of 64-byte chunk c, nibble s,
// is q[n = i / 2, k = 2 (4 c + s) + i % 2]), then 16 (scale, zero) bf16 pairs. A 16-bit word
// shifted right by 4 s and looked up with vpermw (a 32-entry table of (j % 16) - 8 in bf16, so
// bit 4 of the index is ignored) gives 32 bf16 weights: 16 outputs x 2 consecutive k, the
// layout vdpbf16ps multiplies with a broadcast pair of x.
// With kHigh bit planes, 64 bytes each follow the words: 16 32-bit masks, mask 4 c + s holding
// bit 4 + h of the 32 weights that word shift s of chunk c gives (bit i for word i); they set
// bits 4 and 5 of the lookup index, into a 32- or 64-entry table of j - 16 or j - 32. Then
// kSub runs of 16 (scale, zero) pairs; with two, chunks 0-1 (k 0-15) take the first.
//
// Coded scales (code 1 or 2, a GGUF K-quant's own): in place of a run's 16 bf16 pairs, 16 int8
// scale codes sc (code 1: then 16 int8 min codes m), and before every 8 blocks (256 k, a K-quant
// super-block) a header of the 16 outputs' fp16 d (code 1: then their fp16 dmin). A group's
// scale is d sc and its zero (8 << high) d sc - dmin m (code 2: none), in float32: the scale is
// exact (11 + 8 significant bits), the zero one rounding, and a Q4_K block takes 4.625 bits a
// weight (bf16 pairs: 5), a Q6_K one 6.5625 (the file's own; bf16 pairs: 8).
//
// A row's arithmetic is the same whatever the other rows of the call and whichever thread runs
// its tile: the result of a row depends on that row alone.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

constexpr int kTile = 16;
constexpr int kGroup = 32;
constexpr int kWeightBytes = 256;
constexpr int kPlaneBytes = 64;  // a high-bit plane, or a run of 16 (scale, zero) bf16 pairs
constexpr int kMaxRows = 4;
constexpr int kMaxGroups = 2048;
constexpr int kSuper = 8;  // blocks a coded layout's header serves (256 k)

// A run's scales: 16 bf16 (scale, zero) pairs, or 16 int8 codes (and 16 int8 min codes)
constexpr int run_bytes(int code) { return code == 0 ? kPlaneBytes : code == 1 ? 32 : 16; }
constexpr int block_bytes(int sub, int high, int code = 0) {
    return kWeightBytes + kPlaneBytes * high + sub * run_bytes(code);
}
constexpr int header_bytes(int code) { return code == 0 ? 0 : code == 1 ? 64 : 32; }
// A layout's unit along k: a block (bf16 pairs), or a header and the kSuper blocks it serves
constexpr int unit_blocks(int code) { return code == 0 ? 1 : kSuper; }
constexpr int unit_bytes(int sub, int high, int code) {
    return header_bytes(code) + unit_blocks(code) * block_bytes(sub, high, code);
}

// Entries [32 part, 32 part + 32) of the lookup table of q of 4 + high bits: q - 8 (16 entries,
// twice: bit 4 of the index ignored), q - 16 or q - 32, in bf16 (exact: small integers).
inline __m512i lookup_table(int high, int part) {
    alignas(64) uint16_t table[32];
    for (int j = 0; j < 32; ++j) {
        const int q = 32 * part + j;
        float v = high == 0 ? (float)(q % 16 - 8) : (float)(q - (8 << high));
        uint32_t bits;
        memcpy(&bits, &v, 4);
        table[j] = (uint16_t)(bits >> 16);
    }
    return _mm512_load_si512(table);
}

inline __mmask32 mask_at(const uint8_t* p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    return _cvtu32_mask32(bits);
}

// The 32 bf16 weights of shift s of chunk c of a block: 16 outputs x 2 consecutive k.
template <int kHigh>
inline __m512bh lookup(const uint8_t* block, __m512i words, int c, int s, __m512i table,
                       __m512i table_hi) {
    __m512i index = _mm512_srli_epi16(words, 4 * s);
    if constexpr (kHigh > 0) {
        index = _mm512_and_si512(index, _mm512_set1_epi16(15));  // bits 4, 5 clear: add sets them
        for (int h = 0; h < kHigh; ++h) {
            const __mmask32 bits = mask_at(block + kWeightBytes + kPlaneBytes * h + 4 * (4 * c + s));
            index = _mm512_mask_add_epi16(index, bits, index, _mm512_set1_epi16((int16_t)(16 << h)));
        }
    }
    if constexpr (kHigh == 2) return (__m512bh)_mm512_permutex2var_epi16(table, index, table_hi);
    return (__m512bh)_mm512_permutexvar_epi16(index, table);
}

inline __m512 pair_of(const uint16_t* x) {
    int32_t pair;
    memcpy(&pair, x, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
}

inline void store_row(__m512 acc, void* y, int64_t offset, int f32_out) {
    if (f32_out) {
        _mm512_storeu_ps((float*)y + offset, acc);
    } else {
        __m256bh h = _mm512_cvtneps_pbh(acc);
        _mm256_storeu_si256((__m256i*)((uint16_t*)y + offset), (__m256i)h);
    }
}

// Where a layout keeps block g of a tile (from the tile's first byte) and its scales.
template <int kSub, int kHigh, int kCode>
struct Format {
    static constexpr int kBytes = block_bytes(kSub, kHigh, kCode), kHeader = header_bytes(kCode);
    static constexpr int kSuperBytes = unit_bytes(kSub, kHigh, kCode);
    static const uint8_t* block(const uint8_t* tile, int64_t g) {
        if constexpr (kCode == 0) return tile + g * kBytes;
        return tile + (g / kSuper) * kSuperBytes + kHeader + (g % kSuper) * kBytes;
    }
    static const uint8_t* run(const uint8_t* block, int h) {
        return block + kWeightBytes + kPlaneBytes * kHigh + run_bytes(kCode) * h;
    }
    static const uint8_t* header(const uint8_t* tile, int64_t g) {
        return tile + (g / kSuper) * kSuperBytes;
    }
};

inline __m512 codes_of(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

inline __m512 halves_of(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// The 16 outputs' scales and zeros of run h of block g as float32: bf16 pairs (the pair's 32
// bits shifted up 16 give the scale, their top 16 the zero), or codes times the header's halves.
template <int kSub, int kHigh, int kCode>
struct GroupScales {
    using F = Format<kSub, kHigh, kCode>;
    __m512 scale, zero;
    GroupScales(const uint8_t* tile, int64_t g, const uint8_t* block, int h) {
        const uint8_t* run = F::run(block, h);
        if constexpr (kCode == 0) {
            const __m512i pairs = _mm512_loadu_si512(run);
            scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            zero = _mm512_castsi512_ps(
                _mm512_and_si512(pairs, _mm512_set1_epi32((int32_t)0xFFFF0000u)));
        } else {
            const uint8_t* header = F::header(tile, g);
            scale = _mm512_mul_ps(halves_of(header), codes_of(run));
            if constexpr (kCode == 1) {
                const __m512 least = _mm512_mul_ps(halves_of(header + 32), codes_of(run + 16));
                zero = _mm512_fmsub_ps(_mm512_set1_ps((float)(8 << kHigh)), scale, least);
            }
        }
    }
    // acc + scale * sum_k (q - centre) x + zero * sum_k x, for one group of one row
    __m512 add(__m512 acc, __m512 centered_dot, float row_sum) const {
        acc = _mm512_fmadd_ps(scale, centered_dot, acc);
        if constexpr (kCode == 2) return acc;
        return _mm512_fmadd_ps(zero, _mm512_set1_ps(row_sum), acc);
    }
};

// One tile of 16 outputs for M rows: rows m of x at x + m * ldx, their sums per group of
// 32 / kSub k at sums + m * groups * kSub, outputs at column n0 of row m of y (row stride ldy);
// the tile's blocks from ``tile`` on.
template <int M, int kSub, int kHigh, int kCode>
void tile_rows(const uint8_t* tile, int64_t groups, const uint16_t* x, int64_t ldx,
               const float* sums, void* y, int64_t ldy, int64_t n0, int f32_out) {
    using F = Format<kSub, kHigh, kCode>;
    constexpr int kChunks = 4 / kSub;
    const __m512i table = lookup_table(kHigh, 0), table_hi = lookup_table(kHigh, 1);
    __m512 acc[M];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = F::block(tile, g);
#pragma GCC unroll 2
        for (int h = 0; h < kSub; ++h) {
            __m512 dot[M][4];
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
                for (int s = 0; s < 4; ++s) dot[m][s] = _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int c = h * kChunks; c < (h + 1) * kChunks; ++c) {
                const __m512i words = _mm512_loadu_si512(block + 64 * c);
#pragma GCC unroll 4
                for (int s = 0; s < 4; ++s) {
                    const __m512bh w = lookup<kHigh>(block, words, c, s, table, table_hi);
                    const int64_t k = g * kGroup + 2 * (4 * c + s);
#pragma GCC unroll 4
                    for (int m = 0; m < M; ++m)
                        dot[m][s] =
                            _mm512_dpbf16_ps(dot[m][s], w, (__m512bh)pair_of(x + m * ldx + k));
                }
            }
            const GroupScales<kSub, kHigh, kCode> scales(tile, g, block, h);
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) {
                const __m512 d = _mm512_add_ps(_mm512_add_ps(dot[m][0], dot[m][1]),
                                               _mm512_add_ps(dot[m][2], dot[m][3]));
                acc[m] = scales.add(acc[m], d, sums[(m * groups + g) * kSub + h]);
            }
        }
    }
    for (int m = 0; m < M; ++m) store_row(acc[m], y, m * ldy + n0, f32_out);
}

typedef void (*TileFn)(const uint8_t*, int64_t, const uint16_t*, int64_t, const float*, void*,
                       int64_t, int64_t, int);

template <int kSub, int kHigh, int kCode>
constexpr TileFn kFns[kMaxRows + 1] = {
    nullptr, tile_rows<1, kSub, kHigh, kCode>, tile_rows<2, kSub, kHigh, kCode>,
    tile_rows<3, kSub, kHigh, kCode>, tile_rows<4, kSub, kHigh, kCode>};

// [code][sub - 1][high] of a family of functions Fns<sub, high, code>::at. Coded scales only in the
// layouts a K-quant's blocks come to: with a min Q4_K and Q5_K (groups of 32, q of 4 or 5 bits)
// and Q2_K (groups of 16); without one Q3_K and Q6_K (groups of 16, q of 4 to 6 bits).
template <typename Fn, template <int, int, int> class Fns>
struct ByLayout {
    static constexpr const Fn* at[3][2][3] = {
        {{Fns<1, 0, 0>::at, Fns<1, 1, 0>::at, Fns<1, 2, 0>::at},
         {Fns<2, 0, 0>::at, Fns<2, 1, 0>::at, Fns<2, 2, 0>::at}},
        {{Fns<1, 0, 1>::at, Fns<1, 1, 1>::at, nullptr}, {Fns<2, 0, 1>::at, nullptr, nullptr}},
        {{nullptr, nullptr, nullptr}, {Fns<2, 0, 2>::at, Fns<2, 1, 2>::at, Fns<2, 2, 2>::at}}};
};

template <int kSub, int kHigh, int kCode>
struct TileFns {
    static constexpr const TileFn* at = kFns<kSub, kHigh, kCode>;
};

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

// Float32 sum of each group of ``size`` k of a row, in a fixed order.
void group_sums(const uint16_t* x, int64_t groups, int size, float* sums) {
    for (int64_t g = 0; g < groups; ++g) {
        float total = 0.0f;
        for (int j = 0; j < size; ++j) total += bf16_to_float(x[g * size + j]);
        sums[g] = total;
    }
}

// Tiles [0, tiles) over the calling thread's OpenMP team, or on this thread alone when the work
// is too small to repay waking the others (the result is the same either way).
template <typename Fn>
void over_tiles(int64_t tiles, int64_t groups, int64_t rows, Fn fn) {
    const bool parallel = tiles * groups * rows >= 512;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < tiles; ++t) fn(t);
}

// One weight layout: n outputs, k inputs, blocks of ``sub`` scale runs, ``high`` bit planes and
// scales of ``code``; a tile's blocks (and headers) take tile_bytes.
struct Layout {
    int64_t groups, tiles, tile_bytes, row_sums;
    const TileFn* fns;
    Layout(int64_t n, int64_t k, int sub, int high, int code)
        : groups(k / kGroup), tiles(n / kTile),
          tile_bytes(groups / unit_blocks(code) * unit_bytes(sub, high, code)),
          row_sums(k / kGroup * sub), fns(ByLayout<TileFn, TileFns>::at[code][sub - 1][high]) {}
};

bool takes(int64_t n, int64_t k, int sub, int high, int code) {
    return n % kTile == 0 && k % kGroup == 0 && k / kGroup <= kMaxGroups && sub >= 1 &&
           sub <= 2 && high >= 0 && high <= 2 && code >= 0 && code <= 2 &&
           (code == 0 || k % (kGroup * kSuper) == 0) &&
           ByLayout<TileFn, TileFns>::at[code][sub - 1][high] != nullptr;
}

// Each row's float32 sums per group of 32 / sub k ([m][row_sums]).
std::vector<float> all_group_sums(const Layout& l, const uint16_t* x, int64_t m, int64_t ldx) {
    std::vector<float> sums((size_t)(m * l.row_sums));
    const int size = (int)(kGroup * l.groups / l.row_sums);
    for (int64_t r = 0; r < m; ++r)
        group_sums(x + r * ldx, l.row_sums, size, sums.data() + r * l.row_sums);
    return sums;
}

// Tile t of ``blocks`` for rows [begin, end) of x, 4 at a time: the tile's blocks (k / 32 of
// them, 20 KB at k 2048) come from memory once and from the core's cache for the next 4 rows.
inline void tile_of_rows(const Layout& l, const uint8_t* blocks, int64_t t, const uint16_t* x,
                         int64_t ldx, const float* sums, int64_t begin, int64_t end, void* y,
                         int64_t ldy, int f32_out) {
    const int64_t size = f32_out ? 4 : 2;
    for (int64_t r0 = begin; r0 < end; r0 += kMaxRows) {
        const int rows = (int)(end - r0 < kMaxRows ? end - r0 : kMaxRows);
        l.fns[rows](blocks + t * l.tile_bytes, l.groups, x + r0 * ldx, ldx,
                    sums + r0 * l.row_sums, (uint8_t*)y + r0 * ldy * size, ldy, t * kTile,
                    f32_out);
    }
}

// ---- Prompt rows: the same blocks against int8 activations (AVX-512 VNNI) ----
// A prompt step multiplies many rows by each weight; there the products, not the weight's bytes,
// bound the time, and vpdpbusd forms 64 of them an instruction (u8 x s8 summed into int32) where
// vdpbf16ps forms 32. Each row's group of 32 k is quantized to int8 first: d = max |x| / 127,
// xq = x * (127 / max |x|) rounded to nearest (even); then per group and scale run
//   sum_k (q - 8) x ~ d * (sum_k q xq - 8 sum_k xq)   (integer sums, exact)
// and the zero's term takes the float32 sum of x itself. A chunk's 16 32-bit lanes (output j:
// words 2 j, 2 j + 1) hold 8 nibbles of k = 8 c + (0, 2, 4, 6 | 1, 3, 5, 7); lanes & 0x0F0F0F0F
// are the u8 weights of k (0, 4, 1, 5), (lanes >> 4) & 0x0F0F0F0F those of k (2, 6, 3, 7), so a
// row's int8 group is laid out per chunk in that order. A row's result depends on that row alone.
constexpr int kPromptRows = 8;

// Row x's groups quantized: 32 bytes a group in the chunks' order, d per group, the int8 sums per
// scale run (sub runs a group).
void quantize_row(const uint16_t* x, int64_t groups, int sub, int8_t* q, float* d, int32_t* qsum) {
    static constexpr int kOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    for (int64_t g = 0; g < groups; ++g) {
        float v[kGroup], most = 0.0f;
        for (int j = 0; j < kGroup; ++j) {
            v[j] = bf16_to_float(x[g * kGroup + j]);
            const float a = v[j] < 0 ? -v[j] : v[j];
            most = a > most ? a : most;
        }
        const float inverse = most > 0.0f ? 127.0f / most : 0.0f;
        d[g] = most / 127.0f;
        int32_t sums[2] = {0, 0};
        for (int c = 0; c < 4; ++c)
            for (int j = 0; j < 8; ++j) {
                const int k = 8 * c + kOrder[j];
                const int32_t r = (int32_t)__builtin_nearbyintf(v[k] * inverse);
                q[g * kGroup + 8 * c + j] = (int8_t)r;
                sums[sub == 2 && c >= 2] += r;
            }
        for (int h = 0; h < sub; ++h) qsum[g * sub + h] = sums[h];
    }
}

// Quantized rows in blocks of kPromptRows, group-major within a block, so a tile reads a group
// of its rows at fixed offsets: q [block][group][row][32], d [block][group][row], sums and qsum
// [block][group][sub][row] (rows past m: zero).
struct PromptRows {
    int64_t groups, sub;
    std::vector<int8_t> q;
    std::vector<float> d, sums;
    std::vector<int32_t> qsum;
};

PromptRows quantize_rows(const uint16_t* x, int64_t m, int64_t ldx, int64_t groups, int sub) {
    const int64_t blocks = (m + kPromptRows - 1) / kPromptRows, slots = blocks * kPromptRows;
    PromptRows r{groups, sub, std::vector<int8_t>((size_t)(slots * groups * kGroup)),
                 std::vector<float>((size_t)(slots * groups)),
                 std::vector<float>((size_t)(slots * groups * sub)),
                 std::vector<int32_t>((size_t)(slots * groups * sub))};
#pragma omp parallel for schedule(static) if (m * groups >= 256)
    for (int64_t i = 0; i < m; ++i) {
        std::vector<int8_t> q((size_t)(groups * kGroup));
        std::vector<float> d((size_t)groups), sums((size_t)(groups * sub));
        std::vector<int32_t> qsum((size_t)(groups * sub));
        quantize_row(x + i * ldx, groups, sub, q.data(), d.data(), qsum.data());
        group_sums(x + i * ldx, groups * sub, kGroup / sub, sums.data());
        const int64_t b = i / kPromptRows, row = i % kPromptRows;
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t at = (b * groups + g) * kPromptRows + row;
            memcpy(r.q.data() + at * kGroup, q.data() + g * kGroup, kGroup);
            r.d[at] = d[g];
            for (int64_t h = 0; h < sub; ++h) {
                const int64_t run = ((b * groups + g) * sub + h) * kPromptRows + row;
                r.sums[run] = sums[g * sub + h];
                r.qsum[run] = qsum[g * sub + h];
            }
        }
    }
    return r;
}

inline __m512i quad_of(const int8_t* p) {
    int32_t quad;
    memcpy(&quad, p, 4);
    return _mm512_set1_epi32(quad);
}

// Bit 4 + h of a chunk's 32 lanes' bytes (kHigh planes): the masks of shifts s and s + 2 (32
// bits each: bit 2 r + p for output r, k = 8 c + 2 s + p) spread to the bytes that hold those k:
// shift s's to bytes 4 r and 4 r + 2 (k 2 s, 2 s + 1), shift s + 2's to 4 r + 1 and 4 r + 3.
inline __mmask64 high_bytes(const uint8_t* block, int h, int c, int s) {
    const uint8_t* masks = block + kWeightBytes + kPlaneBytes * h + 4 * (4 * c);
    uint32_t first, second;
    memcpy(&first, masks + 4 * s, 4);
    memcpy(&second, masks + 4 * (s + 2), 4);
    return _cvtu64_mask64(_pdep_u64(first, 0x5555555555555555ull) |
                          _pdep_u64(second, 0xAAAAAAAAAAAAAAAAull));
}

// One tile of 16 outputs for M (<= kPromptRows) prompt rows of row block ``b`` (rows
// kPromptRows b ...), outputs at column n0; q of 4 + kHigh bits (the planes' bits added to the
// nibbles' bytes, centred on 8 << kHigh). Each row's sums run in its own registers, chunk by
// chunk across the rows, so the vpdpbusd chains do not wait on each other.
template <int M, int kSub, int kHigh, int kCode>
void prompt_tile(const uint8_t* tile, int64_t groups, const PromptRows& r, int64_t b, void* y,
                 int64_t ldy, int64_t n0, int f32_out) {
    using F = Format<kSub, kHigh, kCode>;
    constexpr int kChunks = 4 / kSub, kCentre = 8 << kHigh;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = F::block(tile, g);
        const int64_t at = (b * groups + g) * kPromptRows;
        const int8_t* xq = r.q.data() + at * kGroup;
        const float* d = r.d.data() + at;
#pragma GCC unroll 2
        for (int h = 0; h < kSub; ++h) {
            const int64_t run = ((b * groups + g) * kSub + h) * kPromptRows;
            const int32_t* qsum = r.qsum.data() + run;
            const float* sums = r.sums.data() + run;
            __m512i dot[M];
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) dot[m] = _mm512_set1_epi32(-kCentre * qsum[m]);
#pragma GCC unroll 4
            for (int c = h * kChunks; c < (h + 1) * kChunks; ++c) {
                const __m512i words = _mm512_loadu_si512(block + 64 * c);
                __m512i lo = _mm512_and_si512(words, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(words, 4), low);
#pragma GCC unroll 2
                for (int p = 0; p < kHigh; ++p) {
                    const __m512i bit = _mm512_set1_epi8((char)(16 << p));
                    lo = _mm512_mask_add_epi8(lo, high_bytes(block, p, c, 0), lo, bit);
                    hi = _mm512_mask_add_epi8(hi, high_bytes(block, p, c, 1), hi, bit);
                }
#pragma GCC unroll 8
                for (int m = 0; m < M; ++m) {
                    dot[m] = _mm512_dpbusd_epi32(dot[m], lo, quad_of(xq + m * kGroup + 8 * c));
                    dot[m] = _mm512_dpbusd_epi32(dot[m], hi, quad_of(xq + m * kGroup + 8 * c + 4));
                }
            }
            const GroupScales<kSub, kHigh, kCode> scales(tile, g, block, h);
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) {
                const __m512 centered =
                    _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(d[m]));
                acc[m] = scales.add(acc[m], centered, sums[m]);
            }
        }
    }
    for (int m = 0; m < M; ++m) store_row(acc[m], y, (b * kPromptRows + m) * ldy + n0, f32_out);
}

typedef void (*PromptFn)(const uint8_t*, int64_t, const PromptRows&, int64_t, void*, int64_t,
                         int64_t, int);

template <int kSub, int kHigh, int kCode>
struct PromptFns {
    static constexpr PromptFn at[kPromptRows + 1] = {
        nullptr,
        prompt_tile<1, kSub, kHigh, kCode>,
        prompt_tile<2, kSub, kHigh, kCode>,
        prompt_tile<3, kSub, kHigh, kCode>,
        prompt_tile<4, kSub, kHigh, kCode>,
        prompt_tile<5, kSub, kHigh, kCode>,
        prompt_tile<6, kSub, kHigh, kCode>,
        prompt_tile<7, kSub, kHigh, kCode>,
        prompt_tile<8, kSub, kHigh, kCode>};
};

}  // namespace

extern "C" {

// x: m rows of k bf16 (row stride ldx); y: m rows of n outputs, bf16 or float32 (f32_out),
// row stride ldy; blocks: the packed weights, n / 16 tiles of k / 32 blocks of
// block_bytes(sub, high, code) bytes (with code 1 or 2 a header before every 8 of them:
// header_bytes(code)); sub (scale, zero) runs per block: groups of 32 / sub k; q of 4 + high
// bits. The tiles are split over the calling thread's OpenMP team (torch's, when this library
// and torch share one libgomp); each takes every row (tile_of_rows), so a call reads its weights
// from memory once whatever its row count. Returns 0, or -1 for shapes it does not take.
int int4_decode(const uint8_t* blocks, int64_t n, int64_t k, const uint16_t* x, int64_t m,
                int64_t ldx, void* y, int64_t ldy, int f32_out, int sub, int high, int code) {
    if (!takes(n, k, sub, high, code)) return -1;
    const Layout l(n, k, sub, high, code);
    const std::vector<float> sums = all_group_sums(l, x, m, ldx);
    over_tiles(l.tiles, l.groups, m, [&](int64_t t) {
        tile_of_rows(l, blocks, t, x, ldx, sums.data(), 0, m, y, ldy, f32_out);
    });
    return 0;
}

// Several weights of one layout, each over its own rows (a mixture's chosen experts over the rows
// that chose them): rows [starts[e], starts[e + 1]) of x against blocks[e], e < count, into the
// same rows of y. One loop over every weight's tiles, handed out a few at a time to the team's
// threads as each is free (a thread the machine holds back does not hold the call up); a row's
// arithmetic is int4_decode's for its weight.
int int4_decode_grouped(const uint8_t* const* blocks, int64_t count, const int64_t* starts,
                        int64_t n, int64_t k, const uint16_t* x, int64_t ldx, void* y,
                        int64_t ldy, int f32_out, int sub, int high, int code) {
    if (!takes(n, k, sub, high, code)) return -1;
    const Layout l(n, k, sub, high, code);
    const int64_t m = starts[count], items = count * l.tiles;
    const std::vector<float> sums = all_group_sums(l, x, m, ldx);
#pragma omp parallel for schedule(dynamic, 8) if (items * l.groups >= 512)
    for (int64_t i = 0; i < items; ++i) {
        const int64_t e = i / l.tiles;
        tile_of_rows(l, blocks[e], i % l.tiles, x, ldx, sums.data(), starts[e], starts[e + 1], y,
                     ldy, f32_out);
    }
    return 0;
}

// int4_prompt over several weights of one layout, each over its own rows (a mixture's chosen
// experts over their prompt rows): rows [starts[e], starts[e + 1]) of x against blocks[e]; each
// expert's rows quantized apart (a row's result is int4_prompt's for its weight).
int int4_prompt_grouped(const uint8_t* const* blocks, int64_t count, const int64_t* starts,
                        int64_t n, int64_t k, const uint16_t* x, int64_t ldx, void* y,
                        int64_t ldy, int f32_out, int sub, int high, int code) {
    if (!takes(n, k, sub, high, code)) return -1;
    const Layout l(n, k, sub, high, code);
    std::vector<PromptRows> rows;
    for (int64_t e = 0; e < count; ++e)
        rows.push_back(quantize_rows(x + starts[e] * ldx, starts[e + 1] - starts[e], ldx,
                                     l.groups, sub));
    const PromptFn* fns = ByLayout<PromptFn, PromptFns>::at[code][sub - 1][high];
    const int64_t items = count * l.tiles;
    const int size = f32_out ? 4 : 2;
#pragma omp parallel for schedule(dynamic, 4) if (items * l.groups * starts[count] >= 512)
    for (int64_t i = 0; i < items; ++i) {
        const int64_t e = i / l.tiles, t = i % l.tiles, m = starts[e + 1] - starts[e];
        void* out = (uint8_t*)y + starts[e] * ldy * size;
        for (int64_t r0 = 0; r0 < m; r0 += kPromptRows) {
            const int rows_now = (int)(m - r0 < kPromptRows ? m - r0 : kPromptRows);
            fns[rows_now](blocks[e] + t * l.tile_bytes, l.groups, rows[e], r0 / kPromptRows, out,
                          ldy, t * kTile, f32_out);
        }
    }
    return 0;
}

// Prompt rows (int8 activations, VNNI; see prompt_tile) against blocks of q of 4 + high bits:
// as int4_decode, for many rows (int4_prompt_grouped with one weight). Returns 0, or -1 for
// shapes or blocks it does not take.
int int4_prompt(const uint8_t* blocks, int64_t n, int64_t k, const uint16_t* x, int64_t m,
                int64_t ldx, void* y, int64_t ldy, int f32_out, int sub, int high, int code) {
    const int64_t starts[2] = {0, m};
    return int4_prompt_grouped(&blocks, 1, starts, n, k, x, ldx, y, ldy, f32_out, sub, high,
                               code);
}

int int4_decode_threads(void) { return omp_get_max_threads(); }

}  // extern "C"
