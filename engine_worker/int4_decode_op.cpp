// splitserve::int4_decode_mm: the int4 decode kernel (int4_decode.cpp) as a torch op, so that the
// scripted decode layers (TorchScript, scripted_layers.py) call it as the eager forward does.
// x [M, K] bf16 rows, blocks the packed weights [N / 16, parts * K / 32, bytes] uint8 (planes side
// by side along K, each applied to x: x is repeated once per plane) -> [M, N] bf16. Blocks of
// groups of 16 k come as [N / 16, parts * K / 32, 2, bytes / 2] (two (scale, zero) runs a block);
// the bytes beyond the nibbles and scales are high-bit planes (int4_decode.cpp).
// splitserve::int4_decode_grouped_mm: several such weights of one layout in one call, weight e
// over the next counts[e] rows of x (a mixture's chosen experts, engine_worker/moe.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "int4_decode.cpp"

namespace {

struct BlockLayout {
    int64_t sub, high, code, n, k;
};

// Blocks [N / 16, K / 32, bytes] (groups of 16: [N / 16, K / 32, 2, bytes / 2]) of bf16 pairs, or
// coded ones as [N / 16, K / 256, header + 8 blocks' bytes]: the layout whose bytes they take.
BlockLayout layout_of(const at::Tensor& blocks) {
    TORCH_CHECK((blocks.dim() == 3 || blocks.dim() == 4) && blocks.scalar_type() == at::kByte &&
                    blocks.is_contiguous(),
                "int4_decode_mm: blocks must be contiguous uint8 [N / 16, K / 32, (sub,) bytes]");
    const int64_t bytes = blocks.dim() == 4 ? blocks.size(2) * blocks.size(3) : blocks.size(-1);
    for (int code = 0; code <= 2; ++code)
        for (int sub = 1; sub <= 2; ++sub)
            for (int high = 0; high <= 2; ++high) {
                const int64_t unit = unit_bytes(sub, high, code);
                const int64_t along = kGroup * unit_blocks(code);
                const bool shaped = code == 0 ? (blocks.dim() == 4) == (sub == 2)
                                              : blocks.dim() == 3;
                if (unit == bytes && shaped)
                    return {sub, high, code, blocks.size(0) * kTile, blocks.size(1) * along};
            }
    TORCH_CHECK(false, "int4_decode_mm: blocks of ", bytes, " bytes are no layout of the kernel");
}

// x as the kernel reads it: bf16 rows repeated once per plane
at::Tensor kernel_rows(const at::Tensor& x, int64_t parts, int64_t k) {
    // torch's thread count on this thread's OpenMP team, as aten's own parallel ops do
    at::internal::lazy_init_num_threads();
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
                "int4_decode_mm: x must be 2-d bf16 on the CPU");
    const at::Tensor rows = parts == 1 ? x.contiguous() : x.repeat({1, parts});
    TORCH_CHECK(rows.size(1) == k, "int4_decode_mm: rows of ", k / parts, " expected, got ",
                x.size(1));
    return rows;
}

// A kernel of int4_decode's signature (int4_decode, int4_prompt) on one weight: x [M, K] ->
// [M, N] bf16.
typedef int (*OneWeight)(const uint8_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                         void*, int64_t, int, int, int, int);

at::Tensor one_weight(OneWeight kernel, const char* name, const at::Tensor& x,
                      const at::Tensor& blocks, int64_t parts) {
    const BlockLayout l = layout_of(blocks);
    const at::Tensor rows = kernel_rows(x, parts, l.k);
    at::Tensor y = at::empty({rows.size(0), l.n}, x.options());
    const int failed = kernel(blocks.data_ptr<uint8_t>(), l.n, l.k,
                              reinterpret_cast<const uint16_t*>(rows.data_ptr()), rows.size(0),
                              l.k, y.data_ptr(), l.n, 0, (int)l.sub, (int)l.high, (int)l.code);
    TORCH_CHECK(!failed, name, ": shape ", l.n, " x ", l.k, " not taken by the kernel");
    return y;
}

// A kernel of int4_decode_grouped's signature (int4_decode_grouped, int4_prompt_grouped): weight
// e over the next counts[e] rows of x.
typedef int (*GroupedWeights)(const uint8_t* const*, int64_t, const int64_t*, int64_t, int64_t,
                              const uint16_t*, int64_t, void*, int64_t, int, int, int, int);

at::Tensor grouped_weights(GroupedWeights kernel, const char* name, const at::Tensor& x,
                           at::TensorList blocks, at::IntArrayRef counts, int64_t parts) {
    TORCH_CHECK(!blocks.empty() && blocks.size() == counts.size(), name,
                ": one row count per weight");
    const BlockLayout l = layout_of(blocks[0]);
    std::vector<const uint8_t*> pointers;
    std::vector<int64_t> starts{0};
    for (size_t e = 0; e < blocks.size(); ++e) {
        TORCH_CHECK(blocks[e].sizes() == blocks[0].sizes() && blocks[e].is_contiguous() &&
                        blocks[e].scalar_type() == at::kByte && counts[e] >= 0,
                    name, ": weights of one layout, row counts >= 0");
        pointers.push_back(blocks[e].data_ptr<uint8_t>());
        starts.push_back(starts.back() + counts[e]);
    }
    const at::Tensor rows = kernel_rows(x, parts, l.k);
    TORCH_CHECK(starts.back() == rows.size(0), name, ": counts sum to ", starts.back(),
                ", x has ", rows.size(0), " rows");
    at::Tensor y = at::empty({rows.size(0), l.n}, x.options());
    const int failed = kernel(pointers.data(), (int64_t)pointers.size(), starts.data(), l.n, l.k,
                              reinterpret_cast<const uint16_t*>(rows.data_ptr()), l.k,
                              y.data_ptr(), l.n, 0, (int)l.sub, (int)l.high, (int)l.code);
    TORCH_CHECK(!failed, name, ": shape ", l.n, " x ", l.k, " not taken");
    return y;
}

at::Tensor int4_decode_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t parts) {
    return one_weight(int4_decode, "int4_decode_mm", x, blocks, parts);
}

at::Tensor int4_decode_grouped_mm(const at::Tensor& x, at::TensorList blocks,
                                  at::IntArrayRef counts, int64_t parts) {
    return grouped_weights(int4_decode_grouped, "int4_decode_grouped_mm", x, blocks, counts,
                           parts);
}

// Prompt rows (int8 activations): int4_prompt, int4_prompt_grouped.
at::Tensor int4_prompt_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t parts) {
    return one_weight(int4_prompt, "int4_prompt_mm", x, blocks, parts);
}

at::Tensor int4_prompt_grouped_mm(const at::Tensor& x, at::TensorList blocks,
                                  at::IntArrayRef counts, int64_t parts) {
    return grouped_weights(int4_prompt_grouped, "int4_prompt_grouped_mm", x, blocks, counts,
                           parts);
}

}  // namespace

TORCH_LIBRARY(splitserve, m) {
    m.def("int4_decode_mm(Tensor x, Tensor blocks, int parts) -> Tensor");
    m.def("int4_decode_grouped_mm(Tensor x, Tensor[] blocks, int[] counts, int parts) -> Tensor");
    m.def("int4_prompt_mm(Tensor x, Tensor blocks, int parts) -> Tensor");
    m.def("int4_prompt_grouped_mm(Tensor x, Tensor[] blocks, int[] counts, int parts) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
    m.impl("int4_decode_mm", int4_decode_mm);
    m.impl("int4_decode_grouped_mm", int4_decode_grouped_mm);
    m.impl("int4_prompt_mm", int4_prompt_mm);
    m.impl("int4_prompt_grouped_mm", int4_prompt_grouped_mm);
}
