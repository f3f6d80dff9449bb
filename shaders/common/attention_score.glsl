// The attention score rule (scale, softcap, ALiBi) and visibility (causal, sliding
// window, padding mask), shared by forward and backward so that they agree.
// Include after attention_common.glsl and after declaring the bindings `mask_words`
// (the uint8 mask read as 32-bit words) and `alibi_slopes` (float32), and a push
// block with the fields mask_off, slopes_off, mask_stride, window, scale, softcap.
#ifndef VKFORMERS_ATTENTION_SCORE_GLSL
#define VKFORMERS_ATTENTION_SCORE_GLSL

// tanh that stays finite for large |x| (a naive exp-based tanh gives inf/inf).
float safe_tanh(float x) { return tanh(clamp(x, -15.0, 15.0)); }

// Whether the query at absolute position qpos sees the key at kpos (kpos < kv_len checked by the caller).
bool key_visible(int qpos, uint kpos, uint batch) {
    if (CAUSAL && int(kpos) > qpos) return false;
    if (window > 0u && qpos - int(kpos) >= int(window)) return false;
    if (HAS_MASK) {
        uint byte_index = mask_off + batch * mask_stride + kpos;
        if (((mask_words[byte_index >> 2] >> ((byte_index & 3u) * 8u)) & 0xFFu) == 0u) return false;
    }
    return true;
}

// The attention score from the raw dot product q.k; `cap_slope` receives d(score)/d(scale * q.k)
// (the softcap's tanh derivative; 1 without softcap).
float attention_score(float qk, int qpos, uint kpos, uint head, out float cap_slope) {
    float s = qk * scale;
    cap_slope = 1.0;
    if (HAS_SOFTCAP) {
        float t = safe_tanh(s / softcap);
        s = softcap * t;
        cap_slope = 1.0 - t * t;
    }
    // ALiBi as slope * (key_pos - query_pos): the same softmax as HF BLOOM's slope * key_pos.
    if (HAS_ALIBI) s += alibi_slopes[slopes_off + head] * float(int(kpos) - qpos);
    return s;
}

#endif
