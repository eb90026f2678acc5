// mods.cuh — which score modifiers a kernel is instantiated for (the host's Variant.mods).
//
// none: the plain and causal kernels. scalars: window (causal travels in it), softcap and ALiBi, whose
// terms come from a few numbers per batch entry, and in the backward the block mask, which skips whole
// tiles and touches no score. all: also the per-element arrays (bias and its gradient, mask) and the
// forward's block mask. Each of those two still checks at run time which of its options are on; leaving
// the arrays out of `scalars` frees the registers their addresses and index math hold, so those kernels
// can take larger tiles. softcap: the scalars' backward passes for a softcap alone, causal or not
// (IS_CAUSAL, as the plain kernels), on dense batches: the window, ALiBi, block mask and packed lengths
// are compile-time constants there, so none of the scalars' per-tile tests and shared-memory lengths
// remain. window: the scalars' forward and backward for a window alone (causal travels in it, as in
// scalars), on dense batches: softcap, ALiBi, block mask and packed lengths are compile-time constants
// likewise. dense_scalars: the scalars' forward on dense batches (the warp-specialized forward, whose
// warpgroups share no barrier after the start, and so cannot keep a packed entry's lengths in shared
// memory as SeqInfo does). docs/design/modifiers.md says what each form gained.
#pragma once

enum class Mods { none, softcap, window, scalars, all, dense_scalars };

// Whether a MODS kernel reads cu_seqlens (packed batches; SeqInfo's MAY_BE_PACKED). Packed batches run the
// scalars' or all's instantiations: only they read cu_seqlens, so that the plain kernels keep nq and nk as
// constants, not registers (their tightest variants have none to spare).
__host__ __device__ constexpr bool may_be_packed(Mods mods) {
  return mods == Mods::scalars || mods == Mods::all;
}
