// Which lane holds which element of a 16 x 16 cooperative matrix (VK_KHR_cooperative_matrix leaves it to the
// device): one subgroup loads the matrix whose element (r, c) is r * 16 + c as an A operand (16-bit) and as a
// float32 accumulator, and writes, per lane and element index, the value it holds. The host reads the layout
// from that (engine/kernels/coopmat_layout.py): which rows each lane holds, which lanes share a row, and whether
// the two layouts agree, so that a kernel can run a softmax on its accumulators and turn them into A operands
// without a round trip through shared memory.
//! target vulkan1.3
//! variant f16 -DT_F16
//! variant bf16 -DT_BF16
//! postprocess bf16 ../../tools/spirv_bf16.py
#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require

layout(local_size_x_id = 0) in;  // one subgroup
layout(binding = 0) readonly buffer Halves { uint halves[]; };  // the matrix as 16-bit patterns of the type
layout(binding = 1) readonly buffer Floats { float floats[]; };  // the matrix as float32
// [0]: A elements per lane, [1]: accumulator elements per lane; from 64: A element i of lane l at 64 + 64 l + i;
// from 64 + 64 * 64: the accumulator's likewise.
layout(binding = 2) writeonly buffer Result { float result[]; };

const uint ACC_AT = 64 + 64 * 64;

void main() {
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a;
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc;
    coopMatLoad(a, halves, 0, 8, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(acc, floats, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
    const uint lane = gl_SubgroupInvocationID;
    if (lane == 0u) {
        result[0] = float(a.length());
        result[1] = float(acc.length());
    }
    for (int i = 0; i < a.length() && i < 64; ++i) result[64 + 64 * lane + i] = float(a[i]);
    for (int i = 0; i < acc.length() && i < 64; ++i) result[ACC_AT + 64 * lane + i] = acc[i];
}
