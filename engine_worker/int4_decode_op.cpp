// splitserve::int4_decode_mm: the int4 decode kernel (int4_decode.cpp) as a torch op, so that the
// scripted decode layers (TorchScript, scripted_layers.py) call it as the eager forward does.
// x [M, K] bf16 rows, blocks the packed weights [N / 16, parts * K / 32, bytes] uint8 (planes side
// by side along K, each applied to x: x is repeated once per plane) -> [M, N] bf16. Blocks of
// groups of 16 k come as [N / 16, parts * K / 32, 2, bytes / 2] (two (scale, zero) runs a block);
// the bytes beyond the nibbles and scales are high-bit planes (int4_decode.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "int4_decode.cpp"

namespace {

at::Tensor int4_decode_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t parts) {
    // torch's thread count on this thread's OpenMP team, as aten's own parallel ops do
    at::internal::lazy_init_num_threads();
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
                "int4_decode_mm: x must be 2-d bf16 on the CPU");
    const int64_t sub = blocks.dim() == 4 ? blocks.size(2) : 1;
    const int64_t bytes = blocks.dim() == 4 ? sub * blocks.size(3) : blocks.size(-1);
    const int64_t high = (bytes - kWeightBytes) / kPlaneBytes - sub;
    TORCH_CHECK((blocks.dim() == 3 || blocks.dim() == 4) && sub >= 1 && sub <= 2 && high >= 0 &&
                    high <= 2 && bytes == block_bytes((int)sub, (int)high) &&
                    blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
                "int4_decode_mm: blocks must be contiguous uint8 [N / 16, K / 32, (sub,) bytes]");
    const at::Tensor rows = parts == 1 ? x.contiguous() : x.repeat({1, parts});
    const int64_t n = blocks.size(0) * kTile, k = blocks.size(1) * kGroup;
    TORCH_CHECK(rows.size(1) == k, "int4_decode_mm: rows of ", k / parts, " expected, got ",
                x.size(1));
    at::Tensor y = at::empty({rows.size(0), n}, x.options());
    const int failed = int4_decode(blocks.data_ptr<uint8_t>(), n, k,
                                   reinterpret_cast<const uint16_t*>(rows.data_ptr()),
                                   rows.size(0), k, y.data_ptr(), n, 0, (int)sub, (int)high);
    TORCH_CHECK(!failed, "int4_decode_mm: shape ", n, " x ", k, " not taken by the kernel");
    return y;
}

}  // namespace

TORCH_LIBRARY(splitserve, m) { m.def("int4_decode_mm(Tensor x, Tensor blocks, int parts) -> Tensor"); }

TORCH_LIBRARY_IMPL(splitserve, CPU, m) { m.impl("int4_decode_mm", int4_decode_mm); }
