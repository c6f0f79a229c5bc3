/* The decoder layers of a quantized CPU target for its sampled rows (decode steps, tree
 * nodes, a prompt's last token), as one native call per forward.
 *
 * Why C++: the loop in verifier/quantized/cpu_forward.py makes about 240 calls per forward (four
 * matmuls and four fused kernels a layer), and driving them from Python cost about as much
 * as everything but the matmuls together (figures: docs/quantization.md). Here the same calls
 * run in the same order on the same data: the matmuls are the plan's own kernels (torch's
 * int4 / int8 through the dispatcher, so torch.profiler sees them, or q4_matmul.c's and
 * q8_matmul.c's, in tercel::q4_matmul / tercel::q8_matmul scopes), the rest the fused C kernels of decode_ops.c, passed in as
 * function pointers. The result is bitwise that of the Python loop, which stays for
 * machines without a C++ compiler (tests compare the two).
 *
 * Tensors cross from Python as their TensorImpl addresses (`Tensor._cdata`); a Model holds
 * references to its weights, so they live as long as it does. Every entry point catches
 * C++ exceptions and returns them as a message: none may cross the C boundary.
 */
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <exception>
#include <limits>
#include <stdexcept>
#include <vector>

typedef uint16_t bf16;
typedef void (*AddRmsNorm)(float *x, const bf16 *y, const float *w, float eps, int64_t rows, int64_t h, bf16 *out);
typedef void (*SiluMul)(const bf16 *gu, int64_t rows, int64_t inter, bf16 *out);
typedef void (*Attention)(const void *heads, const void *rows, const bf16 *qkv, const float *bias, float *q_ws,
                          bf16 *k_cache, bf16 *v_cache, bf16 *out);
typedef void (*PrefetchKv)(const void *heads, const void *rows, const bf16 *k_cache, const bf16 *v_cache);
typedef void (*RmsNormRows)(const float *x, const int64_t *idx, const float *w, float eps, int64_t rows, int64_t h,
                            float *out);
typedef void (*ScanTopk)(const bf16 *scan, int64_t rows, int64_t v, int64_t k, float *out, int64_t *top);
typedef int64_t (*Q4Matmul)(const void *w, int64_t n, int64_t k, const bf16 *x, int64_t m, bf16 *out);
typedef int64_t (*Q8Matmul)(const void *w, int64_t bits, int64_t group, int64_t n, int64_t k, const bf16 *x,
                            int64_t m, bf16 *out);
typedef int64_t (*MixedMatmul)(const void *w, const int64_t *parts, int64_t nparts, int64_t n, int64_t k,
                               const bf16 *x, int64_t m, bf16 *out);
typedef int64_t (*LoraAdd)(const void *table, const int64_t *slots, const bf16 *x, int64_t rows, int64_t k,
                           int64_t ny, bf16 *y);
typedef void (*RescoreInt8)(const float *x, const int64_t *top, const int8_t *q, const float *scale, int64_t rows,
                            int64_t k, int64_t h, int64_t g, float *out, int64_t v);

namespace {

/* Step clocks for bench/step_profile.py, off unless asked: seconds in the matmul calls, in
 * attention (with its KV prefetch) and in the whole call. A profiler's window and overhead
 * blur a 6 ms step; these read the same step the wall clock does. */
bool clock_on = false;
double clock_sum[3];
enum { MATMUL, ATTENTION, CALL };

struct Clock {              /* adds the scope's duration to clock_sum[slot] while clock_on */
    int slot;
    std::chrono::steady_clock::time_point start;
    explicit Clock(int s) : slot(s), start(clock_on ? std::chrono::steady_clock::now() : decltype(start)()) {}
    ~Clock() {
        if (clock_on) clock_sum[slot] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
};

at::Tensor tensor_at(int64_t impl) {            /* a new reference to a Python tensor's TensorImpl */
    return at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::unsafe_reclaim_from_nonowning(
        reinterpret_cast<c10::TensorImpl *>(impl)));
}

const bf16 *bits(const at::Tensor &t) { return static_cast<const bf16 *>(t.data_ptr()); }
bf16 *bits_mut(at::Tensor &t) { return static_cast<bf16 *>(t.data_ptr()); }

struct Linear {
    int64_t kind = 0;       /* 4: torch's int4 (packed, group, scale_zero); 16: q4_matmul.c's (packed);
                               8: int8 per channel (q, scale); 32: q8_matmul.c's (packed, group, bits);
                               64: mixed_matmul.c's (packed, s: its parts' table) */
    at::Tensor w, s;
    int64_t group = 0, n = 0;   /* n: output features (the int4 packings pad to a multiple of 16) */
    int64_t wbits = 0;          /* kind 32: the weights' bits */
    Q4Matmul q4 = nullptr;
    Q8Matmul q8 = nullptr;
    MixedMatmul mixed = nullptr;

    at::Tensor run(const at::Tensor &x) const {      /* x bf16 [M, K] -> bf16 [M, n] */
        Clock clock(MATMUL);
        if (kind == 16) {
            RECORD_FUNCTION("tercel::q4_matmul", std::vector<c10::IValue>());
            at::Tensor y = at::empty({x.size(0), n}, x.options());
            if (q4(w.data_ptr(), n, x.size(1), bits(x), x.size(0), bits_mut(y)))
                throw std::runtime_error("q4_matmul failed (K not a multiple of 32, or out of memory)");
            return y;
        }
        if (kind == 32) {
            RECORD_FUNCTION("tercel::q8_matmul", std::vector<c10::IValue>());
            at::Tensor y = at::empty({x.size(0), n}, x.options());
            if (q8(w.data_ptr(), wbits, group, n, x.size(1), bits(x), x.size(0), bits_mut(y)))
                throw std::runtime_error("q8_matmul failed (K not a multiple of 32, or out of memory)");
            return y;
        }
        if (kind == 64) {
            RECORD_FUNCTION("tercel::mixed_matmul", std::vector<c10::IValue>());
            at::Tensor y = at::empty({x.size(0), n}, x.options());
            if (mixed(w.data_ptr(), s.data_ptr<int64_t>(), s.size(0), n, x.size(1), bits(x), x.size(0), bits_mut(y)))
                throw std::runtime_error("mixed_matmul failed (a bad K or part table, or out of memory)");
            return y;
        }
        at::Tensor y = kind == 4 ? at::_weight_int4pack_mm_for_cpu(x, w, group, s) : at::_weight_int8pack_mm(x, w, s);
        return y.size(1) == n ? y : y.narrow(1, 0, n).contiguous();
    }
};

struct Layer {
    const float *in_norm = nullptr, *post_norm = nullptr, *qkv_bias = nullptr;
    float in_eps = 0, post_eps = 0;
    Linear qkv, o, gate_up, down;
    const void *lora[4] = {nullptr, nullptr, nullptr, nullptr};  /* lora.c's tables of qkv, o, gate_up, down */
};

/* The final norm and the LM head as verifier.quantized.qlinear.RescoredHead computes them: a quantized
 * scan of the whole vocabulary picks each row's k candidates, whose logits the int8 table
 * (q [V, H], scale [V, H / g]) gives exactly. */
struct Head {
    const float *norm = nullptr;
    float eps = 0;
    Linear scan;
    at::Tensor q, scale;
    int64_t g = 0, k = 0, vocab = 0;
    RmsNormRows rms_norm_rows = nullptr;
    ScanTopk scan_topk = nullptr;
    RescoreInt8 rescore = nullptr;
};

struct Model {
    int64_t hidden, heads, head_dim, inter;
    const void *head_table;         /* decode_ops.c's Heads */
    AddRmsNorm add_rms_norm;
    SiluMul silu_mul;
    Attention attention;
    PrefetchKv prefetch_kv;
    Q4Matmul q4_matmul;
    Q8Matmul q8_matmul;
    MixedMatmul mixed_matmul;
    std::vector<Layer> layers;
    Head head;      /* head.rescore is null until tercel_model_set_head */
    LoraAdd lora_add = nullptr;     /* set with the layers' LoRA tables (tercel_model_set_lora) */
};

/* y (the output of layer l's projection j over x) += its rows' LoRA products, where the forward
 * has adapted rows (slots) and an adapter adapts that projection. */
void adapt(const Model &m, const Layer &l, int j, const int64_t *slots, const at::Tensor &x, at::Tensor &y) {
    if (!slots || !l.lora[j]) return;
    if (m.lora_add(l.lora[j], slots, bits(x), x.size(0), x.size(1), y.size(1), bits_mut(y)))
        throw std::runtime_error("lora_add failed (out of memory)");
}

int64_t fail(const std::exception &e, char *err, int64_t cap) {
    if (cap > 0) {
        std::strncpy(err, e.what(), cap - 1);
        err[cap - 1] = 0;
    }
    return 1;
}

}  // namespace

extern "C" {

/* A Linear's weights, as verifier/quantized/cpu_loop.py describes them. */
typedef struct {
    int64_t kind, w, s, group, n, bits;   /* w, s: TensorImpl addresses (s 0 for kinds 16 and 32); bits: kind 32's */
} LinearSpec;

}  // extern "C"

static Linear linear(const Model &m, const LinearSpec &spec) {
    bool packed_only = spec.kind == 16 || spec.kind == 32;
    return Linear{spec.kind, tensor_at(spec.w), packed_only ? at::Tensor() : tensor_at(spec.s), spec.group,
                  spec.n, spec.bits, m.q4_matmul, m.q8_matmul, m.mixed_matmul};
}

extern "C" {

void *tercel_model_new(int64_t num_layers, int64_t hidden, int64_t heads, int64_t head_dim, int64_t inter,
                       const void *head_table, void *add_rms_norm, void *silu_mul, void *attention,
                       void *prefetch_kv, void *q4_matmul, void *q8_matmul, void *mixed_matmul) {
    auto *m = new Model{hidden, heads, head_dim, inter, head_table, reinterpret_cast<AddRmsNorm>(add_rms_norm),
                        reinterpret_cast<SiluMul>(silu_mul), reinterpret_cast<Attention>(attention),
                        reinterpret_cast<PrefetchKv>(prefetch_kv), reinterpret_cast<Q4Matmul>(q4_matmul),
                        reinterpret_cast<Q8Matmul>(q8_matmul), reinterpret_cast<MixedMatmul>(mixed_matmul), {}};
    m->layers.resize(num_layers);
    return m;
}

void tercel_model_free(void *model) { delete static_cast<Model *>(model); }

int64_t tercel_model_set_layer(void *model, int64_t i, const float *in_norm, float in_eps, const float *post_norm,
                               float post_eps, const float *qkv_bias, const LinearSpec *specs, char *err,
                               int64_t cap) {
    try {
        Model &m = *static_cast<Model *>(model);
        Layer &l = m.layers.at(i);
        l.in_norm = in_norm, l.in_eps = in_eps, l.post_norm = post_norm, l.post_eps = post_eps, l.qkv_bias = qkv_bias;
        Linear *lins[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
        for (int j = 0; j < 4; j++) *lins[j] = linear(m, specs[j]);
        return 0;
    } catch (const std::exception &e) {
        return fail(e, err, cap);
    }
}

/* LoRA: lora.c's lora_add, and per layer i the tables of its qkv, o, gate_up and down at
 * tables[4 i .. 4 i + 4) (null: no adapter adapts it). Replaces the tables set before. */
int64_t tercel_model_set_lora(void *model, void *lora_add, const void *const *tables, char *err, int64_t cap) {
    try {
        Model &m = *static_cast<Model *>(model);
        m.lora_add = reinterpret_cast<LoraAdd>(lora_add);
        for (size_t i = 0; i < m.layers.size(); i++)
            for (int j = 0; j < 4; j++) m.layers[i].lora[j] = tables[4 * i + j];
        return 0;
    } catch (const std::exception &e) {
        return fail(e, err, cap);
    }
}

/* The final norm (w, eps) and the head: its scan's weights, the int8 table (TensorImpl
 * addresses) with g weights per scale, k candidates per row, and decode_ops.c's kernels. */
int64_t tercel_model_set_head(void *model, const float *norm, float eps, const LinearSpec *scan, int64_t q,
                              int64_t scale, int64_t g, int64_t k, void *rms_norm_rows, void *scan_topk,
                              void *rescore, char *err, int64_t cap) {
    try {
        Model &m = *static_cast<Model *>(model);
        Head &hd = m.head;
        hd.norm = norm, hd.eps = eps, hd.g = g, hd.k = k, hd.vocab = scan->n;
        hd.scan = linear(m, *scan);
        hd.q = tensor_at(q), hd.scale = tensor_at(scale);
        hd.rms_norm_rows = reinterpret_cast<RmsNormRows>(rms_norm_rows);
        hd.scan_topk = reinterpret_cast<ScanTopk>(scan_topk);
        hd.rescore = reinterpret_cast<RescoreInt8>(rescore);
        return 0;
    } catch (const std::exception &e) {
        return fail(e, err, cap);
    }
}

/* The head over normed rows np [num_logits, H] into lp [num_logits, V] (top: scratch [num_logits, k]):
 * rows with a token list (sparse[r] = s >= 0: tokens start[s] .. start[s + 1]) get exact logits at
 * those tokens and -inf elsewhere; the rest scan the vocabulary and rescore their k best. Row by
 * row: scan_topk and the rescoring are serial and per row, so a row's logits are those of the
 * whole-batch calls. */
static void sparse_head(const Head &hd, const at::Tensor &normed, int64_t hidden, const std::vector<int64_t> &sparse,
                        const int64_t *start, const int64_t *tokens, float *lp, int64_t *topp) {
    const float *np = normed.data_ptr<float>();
    std::vector<int64_t> dense;
    for (int64_t r = 0; r < static_cast<int64_t>(sparse.size()); r++) {
        if (sparse[r] < 0) {
            dense.push_back(r);
            continue;
        }
        int64_t s = sparse[r];
        std::fill(lp + r * hd.vocab, lp + (r + 1) * hd.vocab, -std::numeric_limits<float>::infinity());
        hd.rescore(np + r * hidden, tokens + start[s], hd.q.data_ptr<int8_t>(), hd.scale.data_ptr<float>(), 1,
                   start[s + 1] - start[s], hidden, hd.g, lp + r * hd.vocab, hd.vocab);
    }
    if (dense.empty()) return;
    at::Tensor idx = at::from_blob(dense.data(), {static_cast<int64_t>(dense.size())}, at::kLong);
    at::Tensor scan = hd.scan.run(normed.index_select(0, idx).to(at::kBFloat16));
    for (size_t j = 0; j < dense.size(); j++) {
        int64_t r = dense[j];
        hd.scan_topk(bits(scan) + j * hd.vocab, 1, hd.vocab, hd.k, lp + r * hd.vocab, topp + r * hd.k);
        hd.rescore(np + r * hidden, topp + r * hd.k, hd.q.data_ptr<int8_t>(), hd.scale.data_ptr<float>(), 1, hd.k,
                   hidden, hd.g, lp + r * hd.vocab, hd.vocab);
    }
}

/* Every layer over T rows: x fp32 [T, H] (the embeddings; the residual stream, updated in
 * place, ends after the last layer's residual add, before the final norm). k_cache[i],
 * v_cache[i]: layer i's bf16 caches. taps[j] (fp32 [T, H]) gets x as layer tap_layer[j] sees
 * it, for j < num_taps. With num_logits > 0 (and a head set), logits fp32 [num_logits, V]
 * and top int64 [num_logits, k] get the head's output for rows logit_rows; the num_sparse rows
 * sparse_rows[s] (indices into logit_rows) need logits only at tokens sparse_tokens[sparse_start[s]
 * .. sparse_start[s + 1]) (see sparse_head). lora_slots (null: none): each row's LoRA adapter slot,
 * whose products the projections add (`adapt`). */
int64_t tercel_forward(void *model, const void *rows, int64_t t, int64_t x_impl, void *const *k_cache,
                       void *const *v_cache, int64_t num_taps, const int64_t *tap_layer, const int64_t *tap_impl,
                       int64_t num_logits, const int64_t *logit_rows, int64_t logits_impl, int64_t top_impl,
                       int64_t num_sparse, const int64_t *sparse_rows, const int64_t *sparse_start,
                       const int64_t *sparse_tokens, const int64_t *lora_slots, char *err, int64_t cap) {
    Clock clock(CALL);
    try {
        c10::InferenceMode guard;
        const Model &m = *static_cast<Model *>(model);
        at::Tensor x = tensor_at(x_impl);
        float *xp = x.data_ptr<float>();
        auto bf = at::TensorOptions().dtype(at::kBFloat16);
        at::Tensor h = at::empty({t, m.hidden}, bf);                 /* normed input of each matmul block */
        at::Tensor q = at::empty({t, m.heads, m.head_dim}, at::kFloat);  /* rotated queries */
        at::Tensor o = at::empty({t, m.heads * m.head_dim}, bf);     /* attention output */
        at::Tensor a = at::empty({t, m.inter}, bf);                  /* silu(gate) * up */
        at::Tensor y;                                                /* the previous MLP output */
        int64_t tap = 0;
        for (size_t i = 0; i < m.layers.size(); i++) {
            const Layer &l = m.layers[i];
            m.add_rms_norm(xp, y.defined() ? bits(y) : nullptr, l.in_norm, l.in_eps, t, m.hidden, bits_mut(h));
            for (; tap < num_taps && tap_layer[tap] == static_cast<int64_t>(i); tap++)
                std::memcpy(tensor_at(tap_impl[tap]).data_ptr(), xp, sizeof(float) * t * m.hidden);
            {
                RECORD_FUNCTION("tercel::prefetch_kv", std::vector<c10::IValue>());
                Clock clock(ATTENTION);
                m.prefetch_kv(m.head_table, rows, static_cast<bf16 *>(k_cache[i]), static_cast<bf16 *>(v_cache[i]));
            }
            at::Tensor qkv = l.qkv.run(h);
            adapt(m, l, 0, lora_slots, h, qkv);
            {
                RECORD_FUNCTION("tercel::attention", std::vector<c10::IValue>());   /* torch.profiler sees it */
                Clock clock(ATTENTION);
                m.attention(m.head_table, rows, bits(qkv), l.qkv_bias, q.data_ptr<float>(),
                            static_cast<bf16 *>(k_cache[i]), static_cast<bf16 *>(v_cache[i]), bits_mut(o));
            }
            at::Tensor oy = l.o.run(o);
            adapt(m, l, 1, lora_slots, o, oy);
            m.add_rms_norm(xp, bits(oy), l.post_norm, l.post_eps, t, m.hidden, bits_mut(h));
            at::Tensor gu = l.gate_up.run(h);
            adapt(m, l, 2, lora_slots, h, gu);
            m.silu_mul(bits(gu), t, m.inter, bits_mut(a));
            y = l.down.run(a);
            adapt(m, l, 3, lora_slots, a, y);
        }
        m.add_rms_norm(xp, y.defined() ? bits(y) : nullptr, nullptr, 0.0f, t, m.hidden, nullptr);
        if (num_logits > 0) {           /* RescoredHead.forward over the final norm of these rows */
            const Head &hd = m.head;
            if (!hd.rescore) throw std::runtime_error("logits asked of a model without its head set");
            at::Tensor normed = at::empty({num_logits, m.hidden}, at::kFloat), top = tensor_at(top_impl);
            float *np = normed.data_ptr<float>(), *lp = tensor_at(logits_impl).data_ptr<float>();
            hd.rms_norm_rows(xp, logit_rows, hd.norm, hd.eps, num_logits, m.hidden, np);
            if (num_sparse > 0) {
                std::vector<int64_t> sparse(num_logits, -1);
                for (int64_t s = 0; s < num_sparse; s++) sparse.at(sparse_rows[s]) = s;
                sparse_head(hd, normed, m.hidden, sparse, sparse_start, sparse_tokens, lp, top.data_ptr<int64_t>());
            } else {                    /* every row scans: one call each, all rows at once */
                at::Tensor scan = hd.scan.run(normed.to(at::kBFloat16));
                hd.scan_topk(bits(scan), num_logits, hd.vocab, hd.k, lp, top.data_ptr<int64_t>());
                hd.rescore(np, top.data_ptr<int64_t>(), hd.q.data_ptr<int8_t>(), hd.scale.data_ptr<float>(),
                           num_logits, hd.k, m.hidden, hd.g, lp, hd.vocab);
            }
        }
        return 0;
    } catch (const std::exception &e) {
        return fail(e, err, cap);
    }
}

/* The step clocks (see Clock): out[0..3) gets their sums, which then restart from zero; `on`
 * turns them on or off. */
void tercel_clock(int64_t on, double *out) {
    for (int i = 0; i < 3; i++) out[i] = clock_sum[i], clock_sum[i] = 0;
    clock_on = on != 0;
}

}  // extern "C"
