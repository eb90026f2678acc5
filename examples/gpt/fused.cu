// The raw kernels of fused.py: layernorm forward and backward, column sums (a bias's gradient), the loss's
// softmax with cross-entropy, and the sum of squares behind the gradients' global norm.
//
// Each is a template over the element type T (float, double, __half, __nv_bfloat16) and the accumulator A
// (double for double, float otherwise), as model.accumulator picks it: elements are widened to A on load,
// every sum and product runs in A, and a result in T is rounded once, to nearest, on store. Sums are
// deterministic: fixed trees of shuffles, and partial sums that the caller adds in a fixed order (no atomics).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void store(float *p, float v) { *p = v; }
__device__ __forceinline__ void store(double *p, double v) { *p = v; }
__device__ __forceinline__ void store(__half *p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }

__device__ __forceinline__ float minus_infinity(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double minus_infinity(double) { return __longlong_as_double(0xfff0000000000000ULL); }

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// ------------------------------------------------------------------------------------------ layernorm
// One warp per row of C: the mean, then the variance about it (a second pass over the row, from L1: the
// one-pass E[x^2] - mean^2 cancels badly when |mean| >> std), then out = (x - mean) * rstd * g + b. mean and
// rstd go to the backward, which rebuilds xhat from x rather than keeping a float32 copy of it.
template <typename T, typename A>
__global__ void layernorm_forward(const T *x, const A *g, const A *b, T *out, A *mean, A *rstd, long long rows,
                                  int C, A eps) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T *xr = x + row * C;
    A sum = 0;
    for (int c = lane; c < C; c += 32) sum += widen(xr[c]);
    const A m = warp_sum(sum) / C;
    A squares = 0;
    for (int c = lane; c < C; c += 32) {
        const A d = widen(xr[c]) - m;
        squares += d * d;
    }
    const A r = A(1) / sqrt(warp_sum(squares) / C + eps);
    T *o = out + row * C;
    for (int c = lane; c < C; c += 32) store(o + c, (widen(xr[c]) - m) * r * g[c] + b[c]);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) with dxhat = dout * g, one warp per row, plus
// the residual stream's gradient where one is given (the block's skip connection: one rounding, not two).
template <typename T, typename A>
__global__ void layernorm_backward_dx(const T *dout, const T *x, const A *mean, const A *rstd, const A *g,
                                      const T *dresidual, T *dx, long long rows, int C) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T *d = dout + row * C;
    const T *xr = x + row * C;
    const A m = mean[row], r = rstd[row];
    A sum_dxhat = 0, sum_dxhat_xhat = 0;
    for (int c = lane; c < C; c += 32) {
        const A dxhat = widen(d[c]) * g[c];
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * ((widen(xr[c]) - m) * r);
    }
    const A mean_dxhat = warp_sum(sum_dxhat) / C;
    const A mean_dxhat_xhat = warp_sum(sum_dxhat_xhat) / C;
    for (int c = lane; c < C; c += 32) {
        const A dxhat = widen(d[c]) * g[c];
        const A xhat = (widen(xr[c]) - m) * r;
        A v = r * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
        if (dresidual != nullptr) v += widen(dresidual[row * C + c]);
        store(dx + row * C + c, v);
    }
}

// Column sums over a chunk of rows: a block of 32 x COLUMN_ROWS threads owns 32 columns of chunk rows (a
// warp reads 32 neighbouring elements of a row); its rows' partial sums meet in shared memory in a fixed
// order, and the chunk's sum goes to part[blockIdx.y][column] for the caller to add over chunks.
constexpr int COLUMN_ROWS = 8;

template <typename A> __device__ __forceinline__ A block_column_sum(A v, A (*shared)[32]) {
    shared[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    A total = shared[0][threadIdx.x];
    for (int i = 1; i < COLUMN_ROWS; ++i) total += shared[i][threadIdx.x];
    return total;
}

// layernorm's weight gradients: dg = sum over rows of dout * xhat, db = sum of dout.
template <typename T, typename A>
__global__ void layernorm_param_grads(const T *dout, const T *x, const A *mean, const A *rstd, A *dg_part,
                                      A *db_part, long long rows, int C, long long chunk) {
    __shared__ A shared_dg[COLUMN_ROWS][32], shared_db[COLUMN_ROWS][32];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const long long first = blockIdx.y * chunk;
    const long long last = min(first + chunk, rows);
    A dg = 0, db = 0;
    if (c < C) {
        for (long long row = first + threadIdx.y; row < last; row += COLUMN_ROWS) {
            const A d = widen(dout[row * C + c]);
            dg += d * ((widen(x[row * C + c]) - mean[row]) * rstd[row]);
            db += d;
        }
    }
    dg = block_column_sum(dg, shared_dg);
    db = block_column_sum(db, shared_db);
    if (threadIdx.y == 0 && c < C) {
        dg_part[blockIdx.y * C + c] = dg;
        db_part[blockIdx.y * C + c] = db;
    }
}

// A linear layer's bias gradient: the sum over rows of dout (rows, C), without a float32 copy of dout.
template <typename T, typename A>
__global__ void column_sums(const T *a, A *part, long long rows, int C, long long chunk) {
    __shared__ A shared[COLUMN_ROWS][32];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const long long first = blockIdx.y * chunk;
    const long long last = min(first + chunk, rows);
    A sum = 0;
    if (c < C) {
        for (long long row = first + threadIdx.y; row < last; row += COLUMN_ROWS) sum += widen(a[row * C + c]);
    }
    sum = block_column_sum(sum, shared);
    if (threadIdx.y == 0 && c < C) part[blockIdx.y * C + c] = sum;
}

// ------------------------------------------------------------------------------------------ the loss
// (running max, sum of exp(l - max)) pairs, merged: the online softmax's two statistics.
template <typename A> struct MaxSum {
    A max, sum;
};

template <typename A> __device__ __forceinline__ MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
    if (a.sum == A(0)) return b;  // (a thread that saw no element: its max is -inf, and -inf - -inf is NaN)
    if (b.sum == A(0)) return a;
    const A top = a.max > b.max ? a.max : b.max;
    return {top, a.sum * exp(a.max - top) + b.sum * exp(b.max - top)};
}

template <typename A> __device__ MaxSum<A> block_max_sum(MaxSum<A> v) {
    __shared__ A shared_max[32], shared_sum[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        const MaxSum<A> other = {__shfl_xor_sync(0xffffffffu, v.max, offset),
                                 __shfl_xor_sync(0xffffffffu, v.sum, offset)};
        v = merge(v, other);
    }
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (threadIdx.x % 32 == 0) {
        shared_max[warp] = v.max;
        shared_sum[warp] = v.sum;
    }
    __syncthreads();
    MaxSum<A> total = {shared_max[0], shared_sum[0]};
    for (int i = 1; i < warps; ++i) total = merge(total, MaxSum<A>{shared_max[i], shared_sum[i]});
    return total;
}

// One block per row of V logits, in place: the row becomes softmax(l), and losses[row] = -log softmax(l)[target]
// = log(sum exp(l - max)) - (l[target] - max). Every thread reads l[target] before the block's reduction,
// whose barrier comes before any thread overwrites the row.
template <typename A> __global__ void softmax_cross_entropy(A *logits, const int *targets, A *losses, int V) {
    A *l = logits + (long long)blockIdx.x * V;
    const A target_logit = l[targets[blockIdx.x]];
    MaxSum<A> mine = {minus_infinity(A(0)), A(0)};
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const A v = l[j];
        if (v > mine.max) {  // a new maximum rescales the sum so far (one exp per element either way)
            mine.sum = mine.sum * exp(mine.max - v) + A(1);
            mine.max = v;
        } else {
            mine.sum += exp(v - mine.max);
        }
    }
    const MaxSum<A> row = block_max_sum(mine);
    for (int j = threadIdx.x; j < V; j += blockDim.x) l[j] = exp(l[j] - row.max) / row.sum;
    if (threadIdx.x == 0) losses[blockIdx.x] = log(row.sum) - (target_logit - row.max);
}

// ------------------------------------------------------------------------------------------ the optimizer
// Partial sums of x^2, one per block over a grid-stride share of x (the caller adds the partials).
template <typename T, typename A> __global__ void sum_squares(const T *x, long long n, A *part) {
    __shared__ A shared[32];
    A sum = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const A v = widen(x[i]);
        sum += v * v;
    }
    sum = warp_sum(sum);
    if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        A total = 0;
        for (int i = 0; i < blockDim.x / 32; ++i) total += shared[i];
        part[blockIdx.x] = total;
    }
}
