// The raw kernels of fused.py: layernorm forward and backward, the linear layers' bias adds (with the residual, or
// with GELU after them), GELU's backward with the bias gradient (column sums), the heads of attention merged into
// the rows of the residual stream, the loss's softmax with cross-entropy and its gradient, the sum of squares behind
// the gradients' global norm, and AdamW.
//
// Each is a template over the element type T (float, double, __half, __nv_bfloat16) and the accumulator A
// (double for double, float otherwise), as model.accumulator picks it: elements are widened to A on load,
// every sum and product runs in A, and a result in T is rounded once, to nearest, on store. Sums are
// deterministic: fixed trees of shuffles, and partial sums added in a fixed order (no atomics).
// The pointwise kernels take a third parameter N, the elements per load and store (a Pack): 16 bytes' worth, or 1
// where fused.py found an array that 16-byte accesses would not fit (fused._pack says when).

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

// N consecutive elements moved by one load or store: 16 bytes for a pack of 8 bfloat16, 4 float or 2 double (the
// widest access a thread makes), sizeof(T) where N is 1. A pack's address must be a multiple of its size.
template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

template <int N, typename T> __device__ __forceinline__ Pack<T, N> load(const T *p) {
    return *reinterpret_cast<const Pack<T, N> *>(p);
}

template <int N, typename T> __device__ __forceinline__ void store(T *p, const Pack<T, N> &x) {
    *reinterpret_cast<Pack<T, N> *>(p) = x;
}

// The first index and the stride of a grid-stride loop.
__device__ __forceinline__ long long grid_first() { return (long long)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ long long grid_stride() { return (long long)gridDim.x * blockDim.x; }

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

// ------------------------------------------------------------------------------------------ bias, GELU
// GPT-2's GELU, the tanh approximation: GELU(v) = 0.5 v (1 + tanh(u)) with u = sqrt(2 / pi) (v + 0.044715 v^3).
template <typename A> __device__ __forceinline__ A gelu_tanh(A v) {
    return tanh(A(0.7978845608028654) * (v + A(0.044715) * (v * v * v)));
}

template <typename A> __device__ __forceinline__ A gelu(A v) { return A(0.5) * v * (A(1) + gelu_tanh(v)); }

// GELU'(v) = 0.5 (1 + t) + 0.5 v (1 - t^2) du/dv, the tanh t recomputed from v.
template <typename A> __device__ __forceinline__ A gelu_grad(A v) {
    const A t = gelu_tanh(v);
    return A(0.5) * (A(1) + t) + A(0.5) * v * (A(1) - t * t) * A(0.7978845608028654) * (A(1) + A(3 * 0.044715) * v * v);
}

// A pack's column (in packs) in a row of row_packs, kept up to date along a grid-stride loop with one division per
// thread rather than one per pack: the stride moves it by the same amount, modulo row_packs, every iteration.
struct PackColumn {
    int column, step, row_packs;
    __device__ PackColumn(long long first, long long stride, int row_packs)
        : column(first % row_packs), step(stride % row_packs), row_packs(row_packs) {}
    __device__ void advance() {
        column += step;
        if (column >= row_packs) column -= row_packs;
    }
};

// out = y + b, plus residual where given: a linear layer's bias, and the residual stream where the block has one,
// added in A and rounded once (residual + (y + b), the plain code's order). y, residual and out are n elements of
// rows of C, b is (C,); N divides C, so that a pack lies in one row.
template <typename T, typename A, int N>
__global__ void bias_add(const T *y, const A *b, const T *residual, T *out, long long n, int C) {
    PackColumn at(grid_first(), grid_stride(), C / N);
    for (long long k = grid_first(); k < n / N; k += grid_stride(), at.advance()) {
        const Pack<T, N> yk = load<N>(y + k * N);
        Pack<T, N> rk;
        if (residual != nullptr) rk = load<N>(residual + k * N);
        Pack<T, N> o;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            A s = widen(yk.v[j]) + b[at.column * N + j];
            if (residual != nullptr) s = widen(rk.v[j]) + s;
            store(&o.v[j], s);
        }
        store(out + k * N, o);
    }
}

// GELU, after a linear layer's bias where b is given: pre = y + b rounded to T (the MLP's pre-activation, which
// the backward reads; not written where pre is null), act = GELU(pre) from the rounded pre, rounded to T. One pass
// over the product where the plain code makes two. Without b, act = GELU(y) (and pre must be null). Layout as
// bias_add's.
template <typename T, typename A, int N>
__global__ void bias_gelu_forward(const T *y, const A *b, T *pre, T *act, long long n, int C) {
    PackColumn at(grid_first(), grid_stride(), C / N);
    for (long long k = grid_first(); k < n / N; k += grid_stride(), at.advance()) {
        const Pack<T, N> yk = load<N>(y + k * N);
        Pack<T, N> p, a;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            A v = widen(yk.v[j]);
            if (b != nullptr) {
                store(&p.v[j], v + b[at.column * N + j]);
                v = widen(p.v[j]);
            }
            store(&a.v[j], gelu(v));
        }
        if (pre != nullptr) store(pre + k * N, p);
        store(act + k * N, a);
    }
}

// Column sums over a chunk of rows of d (rows, C): a linear layer's bias gradient. d is dout or, where x is given,
// GELU's backward dout * GELU'(x), written to dx (rounded to T) as it is summed: the MLP's GELU and its bias
// gradient in one pass. The sum takes each element as stored (rounded), as the plain code sums the stored d. Where
// part is null, only dx is written (GELU's backward alone).
//
// A block of 32 x COLUMN_ROWS threads owns 32 packs of columns (a warp reads 32 neighbouring packs of a row) over
// chunk rows; its rows' partial sums meet in shared memory in a fixed order, and the chunk's sums go to
// part[blockIdx.y][column] for the caller to add over chunks (COLUMN_ROWS as layernorm's). N divides C.
template <typename T, typename A, int N>
__global__ void column_sums(const T *dout, const T *x, T *dx, A *part, long long rows, int C, long long chunk) {
    __shared__ A shared[COLUMN_ROWS][32 * N];
    const int c = (blockIdx.x * 32 + threadIdx.x) * N;
    const long long first = blockIdx.y * chunk;
    const long long last = min(first + chunk, rows);
    A sum[N];
#pragma unroll
    for (int j = 0; j < N; ++j) sum[j] = 0;
    if (c < C) {
        for (long long row = first + threadIdx.y; row < last; row += COLUMN_ROWS) {
            const long long at = row * C + c;
            Pack<T, N> d = load<N>(dout + at);
            if (x != nullptr) {
                const Pack<T, N> xs = load<N>(x + at);
#pragma unroll
                for (int j = 0; j < N; ++j) store(&d.v[j], widen(d.v[j]) * gelu_grad(widen(xs.v[j])));
                store(dx + at, d);
            }
#pragma unroll
            for (int j = 0; j < N; ++j) sum[j] += widen(d.v[j]);
        }
    }
    if (part == nullptr) return;
#pragma unroll
    for (int j = 0; j < N; ++j) shared[threadIdx.y][threadIdx.x * N + j] = sum[j];
    __syncthreads();
    if (threadIdx.y != 0 || c >= C) return;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        A total = shared[0][threadIdx.x * N + j];
        for (int i = 1; i < COLUMN_ROWS; ++i) total += shared[i][threadIdx.x * N + j];
        part[blockIdx.y * C + c + j] = total;
    }
}

// The caller's half of the column sums: out[j][c] = part[j][0][c] + part[j][1][c] + ..., the chunks' partial sums
// added in order, for count arrays of them side by side (layernorm's dg and db: count 2). part is (count, rows, C),
// out (count, C); one thread per column.
template <typename A> __global__ void column_totals(const A *part, A *out, int rows, int C, int count) {
    const long long i = grid_first();
    if (i >= (long long)count * C) return;
    const long long j = i / C;
    const A *p = part + j * rows * C + (i - j * C);
    A total = 0;
#pragma unroll 8
    for (int row = 0; row < rows; ++row) total += p[(long long)row * C];
    out[i] = total;
}

// ------------------------------------------------------------------------------------------ attention's heads
// out[b, n, h * D + d] = x[b, h, n, d]: attention's output (or a gradient), x (B, H, tokens, D) C-contiguous, with
// each token's heads side by side in its row of out. out's rows lie row_stride elements apart and its sequences
// batch_stride apart, so that a column slice of a wider array (a third of the qkv gradient) takes them where it
// lies. N divides D, row_stride and batch_stride, so that a pack lies in one head's row on both sides.
template <typename T, int N>
__global__ void merge_heads(const T *x, T *out, long long n, int H, int tokens, int D, long long batch_stride,
                            long long row_stride) {
    for (long long k = grid_first(); k < n / N; k += grid_stride()) {
        const long long i = k * N;
        const long long row = i / D;  // (b * H + h) * tokens + token
        const long long bh = row / tokens;
        const long long b = bh / H;
        const long long at = b * batch_stride + (row - bh * tokens) * row_stride + (bh - b * H) * D + (i - row * D);
        store(out + at, load<N>(x + i));
    }
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

// The mean loss's gradient from softmax_cross_entropy's probabilities p (rows, V): d = (p - onehot(target)) / rows,
// computed in A and written in T, the dtype the head's products take (so that no cast of the (rows, V) gradient
// follows); in place where d is p (T = A). One block per row; N divides V.
template <typename T, typename A, int N>
__global__ void cross_entropy_backward(const A *probs, const int *targets, T *d, int V, A rows) {
    const A *p = probs + (long long)blockIdx.x * V;
    T *out = d + (long long)blockIdx.x * V;
    const int target = targets[blockIdx.x];
    for (int c = threadIdx.x * N; c < V; c += blockDim.x * N) {
        const Pack<A, N> pk = load<N>(p + c);
        Pack<T, N> o;
#pragma unroll
        for (int j = 0; j < N; ++j) store(&o.v[j], (pk.v[j] - (c + j == target ? A(1) : A(0))) / rows);
        store(out + c, o);
    }
}

// ------------------------------------------------------------------------------------------ the optimizer
// Partial sums of x^2, one per block over a grid-stride share of x (the caller adds the partials).
template <typename T, typename A> __global__ void sum_squares(const T *x, long long n, A *part) {
    __shared__ A shared[32];
    A sum = 0;
    for (long long i = grid_first(); i < n; i += grid_stride()) {
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

// One AdamW step for one element, with the step's scalars: the clipping scale (min(1, clip / (norm + 1e-6)); 1
// where clip <= 0, no clipping), the learning rate and Adam's bias corrections, read from the device once per
// thread (a captured step reads the values of each replay).
template <typename P> struct AdamW {
    P scale, lr, beta1, beta2, correction1, correction2, eps, weight_decay;
    long long decay_end;

    __device__ AdamW(const P *sumsq, const P *lr_now, const int *t, P beta1, P beta2, P eps, P weight_decay, P clip,
                     long long decay_end)
        : lr(lr_now[0]), beta1(beta1), beta2(beta2), eps(eps), weight_decay(weight_decay), decay_end(decay_end) {
        const P limit = clip / (sqrt(sumsq[0]) + P(1e-6));
        scale = clip > P(0) && limit < P(1) ? limit : P(1);
        correction1 = P(1) - pow(beta1, P(t[0]));
        correction2 = P(1) - pow(beta2, P(t[0]));
    }

    // p, m and v updated from g; weight decay on the first decay_end elements (the matrices).
    __device__ __forceinline__ void update(long long i, P &p, P g, P &m, P &v) const {
        const P gs = g * scale;
        m = beta1 * m + (P(1) - beta1) * gs;
        v = beta2 * v + (P(1) - beta2) * gs * gs;
        if (i < decay_end) p = p * (P(1) - lr * weight_decay);
        p = p - lr * (m / correction1) / (sqrt(v / correction2) + eps);
    }
};

// AdamW in place over the flat buffers p, g, m, v of n elements (float32; float64 in the checks), N at a time and
// the last n % N one at a time. Where copy is given, the updated matrices (the first decay_end elements, which
// the products read) are also written to it rounded to T: the bfloat16 or float16 weights of the next step, with
// no cast of their own. Template arguments as elsewhere: T the element type (the copy's), A the accumulator (the
// parameters'); N packs of A, so that copy's packs are N * sizeof(T) bytes.
template <typename T, typename A, int N>
__global__ void adamw(A *p, const A *g, A *m, A *v, T *copy, const A *sumsq, const A *lr, const int *t, A beta1,
                      A beta2, A eps, A weight_decay, A clip, long long decay_end, long long n) {
    const AdamW<A> step(sumsq, lr, t, beta1, beta2, eps, weight_decay, clip, decay_end);
    for (long long k = grid_first(); k < n / N; k += grid_stride()) {
        const long long i = k * N;
        Pack<A, N> pk = load<N>(p + i), mk = load<N>(m + i), vk = load<N>(v + i);
        const Pack<A, N> gk = load<N>(g + i);
#pragma unroll
        for (int j = 0; j < N; ++j) step.update(i + j, pk.v[j], gk.v[j], mk.v[j], vk.v[j]);
        store(p + i, pk);
        store(m + i, mk);
        store(v + i, vk);
        if (copy == nullptr || i >= decay_end) continue;
        Pack<T, N> ck;
#pragma unroll
        for (int j = 0; j < N; ++j) store(&ck.v[j], pk.v[j]);
        if (i + N <= decay_end) {
            store(copy + i, ck);
        } else {  // the pack where the matrices end; unrolled, as a loop up to decay_end would put ck on the stack
#pragma unroll
            for (int j = 0; j < N; ++j) {
                if (i + j < decay_end) copy[i + j] = ck.v[j];
            }
        }
    }
    for (long long i = n / N * N + grid_first(); i < n; i += grid_stride()) {  // the tail, one element at a time
        A pi = p[i], mi = m[i], vi = v[i];
        step.update(i, pi, g[i], mi, vi);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (copy != nullptr && i < decay_end) store(copy + i, pi);
    }
}
