// A whole decode step of the Llama-family decoder (engine/model/llama.py) in one C++ call.
//
// The Python path of a batch of decodes (LlamaForCausalLM.forward -> DecoderLayer.forward ->
// TorchAttentionBackend, linear.py, rotary.py) runs 60-75 ATen ops per layer, each a few microseconds of
// dispatch and allocation around a few hundred floats of work. Here the matmuls stay the linear layers' own
// kernels (linear.py's dispatch: dense, quant_gemv's VNNI int8 / int4 kernels, torch's int8 / int4 kernels),
// and everything between them runs as plain float32 loops over the rows: RMSNorm, RoPE, the K/V write into
// the pool and the staged buffers, GQA decode attention over the staged or gathered K/V (one vectorized
// exp per layer), residual adds. Activations stay float32 between the matmuls, where the bfloat16 Python
// path rounds them to bfloat16 after every op, so the logits agree with the Python path's to float32
// rounding in float32 and are closer to float32's in bfloat16 (tests/model/test_fused_decode.py). The loops
// are glue.cpp's; built with it and quant_gemv.cpp into one module by engine/model/extension.py.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "glue.h"
#include "page_copy.h"
#include "quant_gemv.h"

using at::Tensor;
using namespace kvfleet;

namespace {

enum class Kind : int64_t { Dense = 0, Int8 = 1, Int4 = 2 };

// linear.py: DenseLinear, Int8WeightOnlyLinear, Int4WeightOnlyLinear, read from the Python layer's attributes;
// the call dispatches by rows as linear.py's _WeightOnlyLinear.__call__ does.
struct Linear {
  Kind kind;
  Tensor weight;  // dense weight (N, K) / int8 qweight (N, K) / int4 packed (N, K / 2)
  Tensor scales;  // int8 scales (N,) / int4 scales_and_zeros (K / group, N, 2); undefined when dense
  std::optional<Tensor> bias;
  int64_t group = 0, out_features = 0, in_features = 0;
  Tensor vnni_blocks;  // quant_gemv's blocks (up to vnni_max_rows rows), undefined when not taken
  int64_t vnni_max_rows = 0;
  Tensor dense_weight;  // bfloat16 weight (from dense_min_rows rows on), undefined when not taken
  Tensor dense_scales;  // float32 output scales of dense_weight (int8), undefined when none
  int64_t dense_min_rows = 0;

  // x (..., in_features) -> (..., out_features) in x's dtype
  Tensor operator()(const Tensor& x) const {
    if (kind == Kind::Dense) return at::linear(x.to(weight.scalar_type()), weight, bias).to(x.scalar_type());
    Tensor flat = x.reshape({-1, in_features});
    const int64_t rows = flat.size(0);
    Tensor out;
    if (vnni_blocks.defined() && rows <= vnni_max_rows) {
      out = kind == Kind::Int8 ? kvfleet::int8_gemv(flat, vnni_blocks, scales)
                               : kvfleet::int4_gemv(flat, vnni_blocks, out_features, group);
    } else if (dense_weight.defined() && rows >= dense_min_rows) {
      out = at::linear(flat.to(at::kBFloat16), dense_weight);
      if (dense_scales.defined()) out = out.to(at::kFloat) * dense_scales;
    } else {
      flat = flat.to(at::kBFloat16);
      out = kind == Kind::Int8 ? at::_weight_int8pack_mm(flat, weight, scales)
                               : at::_weight_int4pack_mm_for_cpu(flat, weight, group, scales);
    }
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features;
    out = out.to(x.scalar_type()).view(shape);
    return bias ? out + *bias : out;
  }

  // kind 0 dense, 1 int8, 2 int4; `layer` the linear.py object
  static Linear from(int64_t kind, const py::object& layer) {
    auto tensor = [&](const char* name) -> Tensor {
      py::object o = layer.attr(name);
      return o.is_none() ? Tensor() : o.cast<Tensor>();
    };
    Linear l;
    l.kind = static_cast<Kind>(kind);
    TORCH_CHECK(kind >= 0 && kind <= 2, "unknown linear kind ", kind);
    Tensor bias = tensor("bias");
    if (bias.defined()) l.bias = bias;
    if (l.kind == Kind::Dense) {
      l.weight = tensor("weight");
      return l;
    }
    l.weight = tensor(l.kind == Kind::Int8 ? "qweight" : "packed");
    l.scales = tensor(l.kind == Kind::Int8 ? "scales" : "scales_and_zeros");
    l.group = l.kind == Kind::Int4 ? layer.attr("group_size").cast<int64_t>() : 0;
    l.out_features = layer.attr("out_features").cast<int64_t>();
    l.in_features = layer.attr("in_features").cast<int64_t>();
    l.vnni_blocks = tensor("vnni_blocks");
    l.vnni_max_rows = layer.attr("vnni_max_rows").cast<int64_t>();
    l.dense_weight = tensor("dense_weight");
    l.dense_scales = tensor("dense_scales");
    l.dense_min_rows = layer.attr("DENSE_MIN_ROWS").cast<int64_t>();
    return l;
  }
};

struct Layer {
  Tensor input_norm, post_norm;          // float32 copies
  std::optional<Tensor> q_norm, k_norm;  // float32 copies (Qwen3)
  Linear qkv, o_proj, gate_up, down;
};

class FusedDecoder {
 public:
  FusedDecoder(Tensor embed, Tensor final_norm, Tensor inv_freq, double eps, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double scale)
      : embed_(std::move(embed)),
        final_norm_(final_norm.to(at::kFloat).contiguous()),
        inv_freq_(std::move(inv_freq)),
        eps_(eps),
        heads_(num_heads),
        kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        scale_(scale) {}

  // linears: (kind, linear.py layer) x 4 in the order qkv, o_proj, gate_up, down
  void add_layer(const Tensor& input_norm, const Tensor& post_norm, const std::optional<Tensor>& q_norm,
                 const std::optional<Tensor>& k_norm, std::vector<std::pair<int64_t, py::object>> linears) {
    TORCH_CHECK(linears.size() == 4, "a layer needs 4 linears");
    std::vector<Linear> lin;
    for (auto& [kind, layer] : linears) lin.push_back(Linear::from(kind, layer));
    auto f32 = [](const Tensor& t) { return t.to(at::kFloat).contiguous(); };
    std::optional<Tensor> qn, kn;
    if (q_norm) qn = f32(*q_norm);
    if (k_norm) kn = f32(*k_norm);
    layers_.push_back(Layer{f32(input_norm), f32(post_norm), qn, kn, lin[0], lin[1], lin[2], lin[3]});
  }

  void set_lm_head(int64_t kind, const py::object& layer) { lm_head_ = Linear::from(kind, layer); }

  // One decode step of Bd sequences, one new token each. mode 0: gather each layer's K/V from the pool
  // through `slots` (Bd * Smax); 1: refill the staged buffers `stage_k/v[layer]` (Bd, capacity, kv, D)
  // from `slots` (Bd * capacity), then read their first Smax rows; 2: append the new token's K/V to the
  // staged buffers at (`rows`, `pos`). `kv_buffer`: the pool's (2, layers, slots, kv, row_dim), float32 or
  // bfloat16 (kv_format 0, row_dim = D), or uint8 rows of a quantized format (glue.h KVQuant: fp8 / int8,
  // read and written in that format). `mask` (Bd, 1, 1, Smax): the keys each row attends to (a prefix of
  // its row; None: all Smax). Activations stay float32 from the embedding to the logits (float32 logits).
  Tensor step(const Tensor& input_ids, const Tensor& positions, const Tensor& out_cache_loc,
              const Tensor& kv_buffer, int64_t mode, const Tensor& slots, int64_t smax,
              const std::optional<Tensor>& mask, const std::vector<Tensor>& stage_k,
              const std::vector<Tensor>& stage_v, const Tensor& rows, const Tensor& pos, int64_t kv_format) {
    TORCH_CHECK(kv_buffer.is_contiguous(), "the KV pool must be contiguous");
    for (size_t i = 0; mode != 0 && i < stage_k.size(); ++i)
      TORCH_CHECK(stage_k[i].is_contiguous() && stage_v[i].is_contiguous(), "staged K/V must be contiguous");
    if (kv_format != 0) {
      TORCH_CHECK(kv_buffer.scalar_type() == at::kByte && kv_format >= kFp8E4M3 && kv_format <= kInt8 &&
                      kv_buffer.size(-1) == quant_row_dim(kv_format, head_dim_),
                  "a quantized KV pool needs uint8 rows of its format, got format ", kv_format);
      return step_as<uint8_t>(input_ids, positions, out_cache_loc, kv_buffer, mode, slots, smax, mask, stage_k,
                              stage_v, rows, pos, kv_format);
    }
    if (kv_buffer.scalar_type() == at::kBFloat16)
      return step_as<c10::BFloat16>(input_ids, positions, out_cache_loc, kv_buffer, mode, slots, smax, mask,
                                    stage_k, stage_v, rows, pos, 0);
    TORCH_CHECK(kv_buffer.scalar_type() == at::kFloat, "the fused step takes a float32 or bfloat16 KV pool");
    return step_as<float>(input_ids, positions, out_cache_loc, kv_buffer, mode, slots, smax, mask, stage_k,
                          stage_v, rows, pos, 0);
  }

 private:
  template <typename T>
  Tensor step_as(const Tensor& input_ids, const Tensor& positions, const Tensor& out_cache_loc,
                 const Tensor& kv_buffer, int64_t mode, const Tensor& slots, int64_t smax,
                 const std::optional<Tensor>& mask, const std::vector<Tensor>& stage_k,
                 const std::vector<Tensor>& stage_v, const Tensor& rows, const Tensor& pos, int64_t kv_format) {
    py::gil_scoped_release no_gil;
    at::InferenceMode guard;
    const int64_t bd = input_ids.size(0), hidden = embed_.size(1);
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_, group = heads_ / kv_heads_;
    // a token's K (or V) in the pool: kv_heads rows of row_dim elements of T (quantized: bytes)
    const int64_t row_dim = kv_buffer.size(-1), kv_row = kv_heads_ * row_dim;
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const float eps = static_cast<float>(eps_);
    Tensor x = at::embedding(embed_, input_ids).to(at::kFloat).contiguous();  // (Bd, hidden), residual
    Tensor angles = positions.to(at::kFloat).unsqueeze(1) * inv_freq_.unsqueeze(0);
    Tensor emb = at::cat({angles, angles}, -1);
    Tensor cos = emb.cos().contiguous(), sin = emb.sin().contiguous();  // (Bd, D)
    std::vector<int64_t> lens(bd, smax);
    if (mask) {
      Tensor l = mask->reshape({bd, smax}).sum(-1).to(at::kLong);
      for (int64_t b = 0; b < bd; ++b) lens[b] = l[b].item<int64_t>();
    }
    const int64_t* loc = out_cache_loc.data_ptr<int64_t>();
    const int64_t* row_at = mode == 2 ? rows.data_ptr<int64_t>() : nullptr;
    const int64_t* pos_at = mode == 2 ? pos.data_ptr<int64_t>() : nullptr;
    Tensor h = at::empty({bd, hidden}, f32), attn = at::empty({bd, q_size}, f32);
    Tensor scores = at::empty({bd, heads_, smax}, f32);
    Tensor k_pool = kv_buffer.select(0, 0), v_pool = kv_buffer.select(0, 1);
    Tensor gathered_k, gathered_v;
    if (mode == 0) {
      gathered_k = at::empty({slots.size(0), kv_heads_, row_dim}, kv_buffer.options());
      gathered_v = at::empty_like(gathered_k);
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      rms_norm(x.data_ptr<float>(), L.input_norm.data_ptr<float>(), h.data_ptr<float>(), bd, hidden, eps);
      Tensor qkv = L.qkv(h).contiguous();  // (Bd, q + k + v) float32
      float* qkv_p = qkv.data_ptr<float>();
      const int64_t stride = qkv.size(1);
      Tensor k_buf = k_pool.select(0, i), v_buf = v_pool.select(0, i);  // (slots, kv, D)
      T* k_pool_p = k_buf.data_ptr<T>();
      T* v_pool_p = v_buf.data_ptr<T>();
      for (int64_t b = 0; b < bd; ++b) {
        float *q = qkv_p + b * stride, *k = q + q_size, *v = k + kv_size;
        if (L.q_norm) {
          rms_norm(q, L.q_norm->data_ptr<float>(), q, heads_, head_dim_, eps);
          rms_norm(k, L.k_norm->data_ptr<float>(), k, kv_heads_, head_dim_, eps);
        }
        rotary(q, cos.data_ptr<float>() + b * head_dim_, sin.data_ptr<float>() + b * head_dim_, heads_, head_dim_);
        rotary(k, cos.data_ptr<float>() + b * head_dim_, sin.data_ptr<float>() + b * head_dim_, kv_heads_,
               head_dim_);
        // DeviceKVPool.set_kv, then the staged buffers' append (mode 2)
        store_kv(k_pool_p + loc[b] * kv_row, k, kv_format);
        store_kv(v_pool_p + loc[b] * kv_row, v, kv_format);
        if (mode == 2) {
          const int64_t capacity = stage_k[i].size(1), at_row = row_at[b] * capacity + pos_at[b];
          store_kv(stage_k[i].data_ptr<T>() + at_row * kv_row, k, kv_format);
          store_kv(stage_v[i].data_ptr<T>() + at_row * kv_row, v, kv_format);
        }
      }
      // each row's keys: `row_len` rows apart, from the gathered or the staged buffers
      const T *keys, *values;
      int64_t row_len;
      if (mode == 0) {
        at::index_select_out(gathered_k, k_buf, 0, slots);
        at::index_select_out(gathered_v, v_buf, 0, slots);
        keys = gathered_k.data_ptr<T>();
        values = gathered_v.data_ptr<T>();
        row_len = smax;
      } else {
        const Tensor &sk = stage_k[i], &sv = stage_v[i];
        row_len = sk.size(1);
        if (mode == 1) {
          Tensor flat_k = sk.view({bd * row_len, kv_heads_, row_dim});
          Tensor flat_v = sv.view({bd * row_len, kv_heads_, row_dim});
          at::index_select_out(flat_k, k_buf, 0, slots);
          at::index_select_out(flat_v, v_buf, 0, slots);
        }
        keys = sk.data_ptr<T>();
        values = sv.data_ptr<T>();
      }
      float* sc = scores.data_ptr<float>();
      const float scale = static_cast<float>(scale_);
      for (int64_t b = 0; b < bd; ++b) {
        const T* kb = keys + b * row_len * kv_row;
        float* sb = sc + b * heads_ * smax;
        if constexpr (std::is_same_v<T, uint8_t>)
          attention_scores_quant(qkv_p + b * stride, kb, lens[b], kv_heads_, group, head_dim_, kv_format, scale,
                                 sb, smax);
        else
          attention_scores(qkv_p + b * stride, kb, lens[b], kv_heads_, group, head_dim_, scale, sb, smax);
      }
      softmax_rows(sc, lens, bd * heads_, heads_, smax);
      for (int64_t b = 0; b < bd; ++b) {
        const T* vb = values + b * row_len * kv_row;
        float *pb = sc + b * heads_ * smax, *ob = attn.data_ptr<float>() + b * q_size;
        if constexpr (std::is_same_v<T, uint8_t>)
          attention_values_quant(pb, vb, lens[b], kv_heads_, group, head_dim_, kv_format, ob, smax);
        else
          attention_values(pb, vb, lens[b], kv_heads_, group, head_dim_, ob, smax);
      }
      Tensor o = L.o_proj(attn).contiguous();
      add_into(x.data_ptr<float>(), o.data_ptr<float>(), bd * hidden);
      rms_norm(x.data_ptr<float>(), L.post_norm.data_ptr<float>(), h.data_ptr<float>(), bd, hidden, eps);
      Tensor gate_up = L.gate_up(h);
      auto gu = gate_up.chunk(2, -1);
      Tensor down = L.down(at::silu(gu[0]).mul_(gu[1])).contiguous();
      add_into(x.data_ptr<float>(), down.data_ptr<float>(), bd * hidden);
    }
    rms_norm(x.data_ptr<float>(), final_norm_.data_ptr<float>(), h.data_ptr<float>(), bd, hidden, eps);
    return (*lm_head_)(h).to(at::kFloat);
  }

  // one token's K or V (kv_heads x head_dim floats) into the pool / staged row at dst, in its format
  template <typename T>
  void store_kv(T* dst, const float* src, int64_t kv_format) const {
    if constexpr (std::is_same_v<T, uint8_t>)
      store_quant_rows(dst, src, kv_heads_, head_dim_, kv_format);
    else
      store_row(dst, src, kv_heads_ * head_dim_);
  }

  // softmax over the first lens[row / heads] entries of each of `n` rows of `smax` (in place; the rest 0)
  static void softmax_rows(float* sc, const std::vector<int64_t>& lens, int64_t n, int64_t heads, int64_t smax) {
    for (int64_t r = 0; r < n; ++r) {
      float* row = sc + r * smax;
      const int64_t len = lens[r / heads];
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < len; ++s) mx = std::max(mx, row[s]);
#pragma omp simd
      for (int64_t s = 0; s < len; ++s) row[s] -= mx;
      std::fill(row + len, row + smax, -std::numeric_limits<float>::infinity());
    }
    Tensor all = at::from_blob(sc, {n * smax}, at::TensorOptions().dtype(at::kFloat));
    all.exp_();  // one vectorized exp for every row (exp(-inf) = 0 past each length)
    for (int64_t r = 0; r < n; ++r) {
      float* row = sc + r * smax;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t s = 0; s < smax; ++s) sum += row[s];
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t s = 0; s < smax; ++s) row[s] *= inv;
    }
  }

  Tensor embed_, final_norm_, inv_freq_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
  std::vector<Layer> layers_;
  std::optional<Linear> lm_head_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<Tensor, Tensor, Tensor, double, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &FusedDecoder::add_layer)
      .def("set_lm_head", &FusedDecoder::set_lm_head)
      .def("step", &FusedDecoder::step);
  m.def("gemv_supported", &kvfleet::gemv_supported);
  m.def("bf16_matmul_supported", &kvfleet::bf16_matmul_supported);
  m.def("int4_pack", &kvfleet::int4_pack);
  m.def("int4_gemv", &kvfleet::int4_gemv, py::call_guard<py::gil_scoped_release>());
  m.def("int8_pack", &kvfleet::int8_pack);
  m.def("int8_gemv", &kvfleet::int8_gemv, py::call_guard<py::gil_scoped_release>());
  m.def("copy_pages", &kvfleet::copy_pages, py::call_guard<py::gil_scoped_release>());
  m.attr("INT4_MAX_ROWS") = kvfleet::kInt4MaxRows;
  m.attr("INT8_MAX_ROWS") = kvfleet::kInt8MaxRows;
}
