// softcap.cuh — the softcap's tanh of a raw score, in each input type's precision.
#pragma once
#include "common.cuh"
#include "params.cuh"

// The softcap's t = tanh(scale * raw / softcap) of a raw score q . k. With a softcap the kernels keep
// scores in units of t (the logit is softcap * t: the softcap goes into the exponent's scale, as the scale
// does for raw scores), so t is all a score costs. 16-bit inputs take the hardware's tanh.approx.f32 (one
// special-function instruction, as FlashAttention-2 and -3 do): its relative error, documented as at most
// 2^-11 (docs/design/modifiers.md has what it measured), puts at most softcap times that on a logit, below
// the 16-bit rounding of the logits, so out and the gradients keep their 16-bit accuracy and lse carries that
// absolute error (README, score modifiers). The forward, the backward and attention_probs take the same
// t, so P is the same function in all three. float32 takes the accurate libdevice tanhf (float32 accuracy
// is the point of that dtype), float64 libdevice's tanh. (An exact 16-bit tanh takes five instructions, two of
// them special-function ones, and was slower: docs/design/modifiers.md.)
template <typename T, typename A>
struct SoftcapTanh {
  A k;  // scale / softcap
  template <class P>
  __device__ __forceinline__ explicit SoftcapTanh(const P& p) : k(Reals<A>::scale(p) * Reals<A>::softcap_inv(p)) {}
  __device__ __forceinline__ A tanh_of(A raw) const {
    if constexpr (sizeof(T) == 2) {
      float t;
      asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(raw * k));
      return t;
    } else if constexpr (sizeof(T) == 4) {
      return tanhf(raw * k);
    } else {
      return tanh(raw * k);
    }
  }
};
