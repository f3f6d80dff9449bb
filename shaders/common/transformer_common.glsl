// Helpers shared by the transformer kernels (embedding, norm, rope, cross_entropy):
// one storage element type chosen by the variant, and workgroup-wide reductions.
#ifndef VKFORMERS_TRANSFORMER_COMMON_GLSL
#define VKFORMERS_TRANSFORMER_COMMON_GLSL

#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#include "common.glsl"

// ELEM_T is the storage type of activations (-DELEM_F32, -DELEM_F16 or -DELEM_BF16);
// math is always float32: load_elem widens, store_elem rounds to nearest even.
#if defined(ELEM_F16)
#define ELEM_T float16_t
float load_elem(ELEM_T v) { return float(v); }
ELEM_T store_elem(float v) { return float16_t(v); }
#elif defined(ELEM_BF16)
#define ELEM_T uint16_t
float load_elem(ELEM_T v) { return bf16_to_f32(v); }
ELEM_T store_elem(float v) { return f32_to_bf16(v); }
#else
#define ELEM_T float
float load_elem(ELEM_T v) { return v; }
ELEM_T store_elem(float v) { return v; }
#endif

// The value after a round trip through the storage type (HF's intermediate casts).
float round_to_elem(float v) { return load_elem(store_elem(v)); }

// Workgroups are laid out as a 2-D grid so more than maxComputeWorkGroupCount.x rows fit
// (launcher: grid(rows, 1, max_x)); one workgroup per row.
uint workgroup_row() { return gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x; }

// Reductions over the whole workgroup; every invocation must call them (they contain
// barriers) and every invocation gets the result. The partials are combined in a
// fixed order, so results are deterministic. 128 slots: 1024 invocations / subgroups of 8.
shared float reduce_partials[128];

float workgroup_sum(float v) {
    v = subgroupAdd(v);
    if (subgroupElect()) reduce_partials[gl_SubgroupID] = v;
    barrier();
    float total = 0.0;
    for (uint i = 0; i < gl_NumSubgroups; ++i) total += reduce_partials[i];
    barrier();  // the slots are reused by the next reduction
    return total;
}

float workgroup_max(float v) {
    v = subgroupMax(v);
    if (subgroupElect()) reduce_partials[gl_SubgroupID] = v;
    barrier();
    float best = reduce_partials[0];
    for (uint i = 1; i < gl_NumSubgroups; ++i) best = max(best, reduce_partials[i]);
    barrier();
    return best;
}

#endif
