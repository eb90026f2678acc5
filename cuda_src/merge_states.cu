// merge_states.cu — the running results of ring attention, updated in place by one block of a step.
//
// merge_states: the attention of a run of query rows over the keys seen so far (out_acc, lse_acc, in the
// accumulator type A) merged with their attention over a new, disjoint set of keys (out_b in T, lse_b in A)
// by log-sum-exp, by the rules of lse_merge.cuh: a part whose lse is -inf is never read (so a row seen by one
// part comes back bit for bit, and the first merge into out_acc = anything, lse_acc = -inf is a copy); an lse
// of +inf or NaN makes the row NaN.
// accumulate_rows: acc += x, the float sums of the gradients (dq on its rank; dk, dv travelling).
//
// Layout: out_acc and acc (lead, n_acc, width) contiguous, of which rows row0 .. row0 + n of every lead
// entry are updated; lse_acc (lead, n_acc); out_b and x (lead, n, width) contiguous; lse_b (lead, n).
// Saves nothing: both kernels read and write the arrays they are given, once.
#include "common.cuh"
#include "mma.cuh"
#include "lse_merge.cuh"

constexpr int STATES_THREADS = 256;
constexpr int STATES_ROWS_PER_CTA = STATES_THREADS / 32;

// One warp per row: the lanes stride over the row's columns, and lane 0 writes the row's new lse once the
// whole warp has read the old one.
template <typename T>
__global__ void __launch_bounds__(STATES_THREADS) merge_states(acc_t<T>* out_acc, acc_t<T>* lse_acc, const T* out_b,
                                                            const acc_t<T>* lse_b, long long rows, int n, int n_acc,
                                                            int row0, int width) {
  using A = acc_t<T>;
  const long long row = static_cast<long long>(blockIdx.x) * STATES_ROWS_PER_CTA + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const long long acc_row = (row / n) * n_acc + row0 + row % n;
  const A la = lse_acc[acc_row], lb = lse_b[row];
  const A ninf = static_cast<A>(neg_inf());
  const A top = (la != la || lb != lb) ? la + lb : (la > lb ? la : lb);  // NaN propagates
  const A shift = merge_base(top);
  const A wa = merge_weight(la, shift), wb = merge_weight(lb, shift);
  const A total = wa + wb;
  const bool seen = total != A(0);  // true for a NaN total: it propagates
  const A inv = seen ? A(1) / total : A(0);
  A* dst = out_acc + acc_row * width;
  const T* src = out_b + row * width;
  for (int c = lane; c < width; c += 32) {
    A sum = A(0);
    if (la != ninf) sum += wa * dst[c];
    if (lb != ninf) sum += wb * Elem<T>::to_acc(src[c]);
    dst[c] = seen ? sum * inv : A(0);
  }
  __syncwarp();
  if (lane == 0) lse_acc[acc_row] = merged_lse(shift, total);
}

template <typename T>
__global__ void __launch_bounds__(STATES_THREADS) accumulate_rows(acc_t<T>* acc, const T* x, long long elements, int n,
                                                               int n_acc, int row0, int width) {
  const long long per_lead = static_cast<long long>(n) * width;
  for (long long e = static_cast<long long>(blockIdx.x) * STATES_THREADS + threadIdx.x; e < elements;
       e += static_cast<long long>(gridDim.x) * STATES_THREADS) {
    const long long lead = e / per_lead, rest = e % per_lead;
    acc[(lead * n_acc + row0) * width + rest] += Elem<T>::to_acc(x[e]);
  }
}
