// Int4 decode kernel: y[m, n] = sum_k x[m, k] * ((q[n, k] - 8) * scale[n, g] + zero[n, g]), for a
// few bf16 rows x, q in [0, 15], one bf16 (scale, zero) per group of 32 k (g = k / 32).
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
//
// A row's arithmetic is the same whatever the other rows of the call and whichever thread runs
// its tile: the result of a row depends on that row alone.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int kTile = 16;
constexpr int kGroup = 32;
constexpr int kWeightBytes = 256;
constexpr int kBlockBytes = 320;
constexpr int kMaxRows = 4;
constexpr int kMaxGroups = 2048;

inline __m512i nibble_table() {
    alignas(64) uint16_t table[32];
    for (int j = 0; j < 32; ++j) {
        float v = (float)(j % 16 - 8);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        table[j] = (uint16_t)(bits >> 16);  // exact: small integers
    }
    return _mm512_load_si512(table);
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

// A block's 16 (scale, zero) bf16 pairs as float32: the pair's 32 bits shifted up 16 give the
// scale, their top 16 the zero.
struct GroupScales {
    __m512 scale, zero;
    explicit GroupScales(const uint8_t* block) {
        const __m512i pairs = _mm512_loadu_si512(block + kWeightBytes);
        scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int32_t)0xFFFF0000u)));
    }
    // acc + scale * sum_k (q - 8) x + zero * sum_k x, for one group of one row
    __m512 add(__m512 acc, __m512 centered_dot, float row_sum) const {
        acc = _mm512_fmadd_ps(scale, centered_dot, acc);
        return _mm512_fmadd_ps(zero, _mm512_set1_ps(row_sum), acc);
    }
};

// One tile of 16 outputs for M rows: rows m of x at x + m * ldx, their group sums at
// sums + m * groups, outputs at column n0 of row m of y (row stride ldy).
template <int M>
void tile_rows(const uint8_t* blocks, int64_t groups, const uint16_t* x, int64_t ldx,
               const float* sums, void* y, int64_t ldy, int64_t n0, int f32_out) {
    const __m512i table = nibble_table();
    __m512 acc[M];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = blocks + g * kBlockBytes;
        __m512 dot[M][4];
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) dot[m][s] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m512i words = _mm512_loadu_si512(block + 64 * c);
#pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) {
                const __m512i shifted = _mm512_srli_epi16(words, 4 * s);
                const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(shifted, table);
                const int64_t k = g * kGroup + 2 * (4 * c + s);
#pragma GCC unroll 4
                for (int m = 0; m < M; ++m)
                    dot[m][s] = _mm512_dpbf16_ps(dot[m][s], w, (__m512bh)pair_of(x + m * ldx + k));
            }
        }
        const GroupScales scales(block);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
            const __m512 d = _mm512_add_ps(_mm512_add_ps(dot[m][0], dot[m][1]),
                                           _mm512_add_ps(dot[m][2], dot[m][3]));
            acc[m] = scales.add(acc[m], d, sums[m * groups + g]);
        }
    }
    for (int m = 0; m < M; ++m) store_row(acc[m], y, m * ldy + n0, f32_out);
}

typedef void (*TileFn)(const uint8_t*, int64_t, const uint16_t*, int64_t, const float*, void*,
                       int64_t, int64_t, int);

const TileFn kTileFns[kMaxRows + 1] = {nullptr, tile_rows<1>, tile_rows<2>, tile_rows<3>,
                                       tile_rows<4>};

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

// Float32 sum of each group of 32 of a row, in a fixed order.
void group_sums(const uint16_t* x, int64_t groups, float* sums) {
    for (int64_t g = 0; g < groups; ++g) {
        float total = 0.0f;
        for (int j = 0; j < kGroup; ++j) total += bf16_to_float(x[g * kGroup + j]);
        sums[g] = total;
    }
}

// Tiles [0, tiles) over the calling thread's OpenMP team, or on this thread alone when the work
// is too small to repay waking the others (the result is the same either way).
template <typename Fn>
void over_tiles(int64_t tiles, int64_t groups, int rows, Fn fn) {
    const bool parallel = tiles * groups * rows >= 512;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t t = 0; t < tiles; ++t) fn(t);
}

}  // namespace

extern "C" {

// x: m rows of k bf16 (row stride ldx); y: m rows of n outputs, bf16 or float32 (f32_out),
// row stride ldy; blocks: the packed weights, [n / 16][k / 32][320] bytes. Rows go 4 at a time;
// the tiles of each 4 are split over the calling thread's OpenMP team (torch's, when this
// library and torch share one libgomp). Returns 0, or -1 for shapes it does not take.
int int4_decode(const uint8_t* blocks, int64_t n, int64_t k, const uint16_t* x, int64_t m,
                int64_t ldx, void* y, int64_t ldy, int f32_out) {
    const int64_t groups = k / kGroup, tiles = n / kTile;
    if (n % kTile || k % kGroup || groups > kMaxGroups) return -1;
    float sums[kMaxRows * kMaxGroups];
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int rows = (int)(m - r0 < kMaxRows ? m - r0 : kMaxRows);
        for (int r = 0; r < rows; ++r) group_sums(x + (r0 + r) * ldx, groups, sums + r * groups);
        const TileFn fn = kTileFns[rows];
        void* y_rows = f32_out ? (void*)((float*)y + r0 * ldy) : (void*)((uint16_t*)y + r0 * ldy);
        over_tiles(tiles, groups, rows, [&](int64_t t) {
            fn(blocks + t * groups * kBlockBytes, groups, x + r0 * ldx, ldx, sums, y_rows, ldy,
               t * kTile, f32_out);
        });
    }
    return 0;
}

int int4_decode_threads(void) { return omp_get_max_threads(); }

}  // extern "C"
