// A whole decode step of the Llama-family decoder (engine/model/llama.py) in one C++ call against ATen.
//
// The same ATen ops, in the same order and with the same dtypes, as the Python path of a batch of decodes
// (LlamaForCausalLM.forward -> DecoderLayer.forward -> TorchAttentionBackend, linear.py, rotary.py), so the
// logits are bitwise the Python path's; what goes is the Python interpreter and the Python-side argument
// parsing of the ~60-75 ops per layer. Built with quant_gemv.cpp by engine/model/extension.py; its int4 / int8
// linears take quant_gemv's VNNI kernels where the layer has blocks for them (linear.py's dispatch).
#include <torch/extension.h>

#include <optional>

#include "quant_gemv.h"
#include <vector>

using at::Tensor;

namespace {

enum class Kind : int64_t { Dense = 0, Int8 = 1, Int4 = 2 };

// linear.py: DenseLinear, Int8WeightOnlyLinear, Int4WeightOnlyLinear.
struct Linear {
  Kind kind;
  Tensor weight;  // dense weight (N, K) / int8 qweight (N, K) / int4 packed (N, K / 2)
  Tensor scales;  // int8 scales (N,) / int4 scales_and_zeros (K / group, N, 2); undefined when dense
  std::optional<Tensor> bias;
  int64_t group, out_features, in_features;
  Tensor vnni_blocks;  // quant_gemv.h's blocks of the weight; undefined when the layer has none

  Tensor operator()(const Tensor& x) const {
    if (kind == Kind::Dense) return at::linear(x, weight, bias);
    Tensor flat = x.reshape({-1, in_features});
    Tensor out;
    if (vnni_blocks.defined() && flat.size(0) <= (kind == Kind::Int8 ? kvfleet::kInt8MaxRows
                                                                       : kvfleet::kInt4MaxRows)) {
      out = kind == Kind::Int8 ? kvfleet::int8_gemv(flat, vnni_blocks, scales)
                               : kvfleet::int4_gemv(flat, vnni_blocks, out_features, group);
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
};

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return weight * at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps).to(x.scalar_type());
}

Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  int64_t half = x.size(-1) / 2;
  Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

struct Layer {
  Tensor input_norm, post_norm;
  std::optional<Tensor> q_norm, k_norm;
  Linear qkv, o_proj, gate_up, down;
};

class FusedDecoder {
 public:
  FusedDecoder(Tensor embed, Tensor final_norm, Tensor inv_freq, double eps, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double scale)
      : embed_(std::move(embed)),
        final_norm_(std::move(final_norm)),
        inv_freq_(std::move(inv_freq)),
        eps_(eps),
        heads_(num_heads),
        kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        scale_(scale) {}

  // linears: (kind, weight, scales or None, bias or None, group, out_features, in_features, vnni_blocks or
  // None) x 4 in the order qkv, o_proj, gate_up, down
  void add_layer(Tensor input_norm, Tensor post_norm, std::optional<Tensor> q_norm,
                 std::optional<Tensor> k_norm, std::vector<std::vector<py::object>> linears) {
    TORCH_CHECK(linears.size() == 4, "a layer needs 4 linears");
    std::vector<Linear> lin;
    for (auto& l : linears) lin.push_back(to_linear(l));
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm),
                            std::move(k_norm), lin[0], lin[1], lin[2], lin[3]});
  }

  void set_lm_head(std::vector<py::object> linear) { lm_head_ = to_linear(linear); }

  // One decode step of Bd sequences, one new token each. mode 0: gather each layer's K/V from the pool
  // through `slots` (Bd * Smax); 1: refill the staged buffers `stage_k/v[layer]` (Bd, capacity, kv, D)
  // from `slots` (Bd * capacity), then read their first Smax rows; 2: append the new token's K/V to the
  // staged buffers at (`rows`, `pos`). `kv_buffer`: the pool's (2, layers, slots, kv, D). Float32 logits.
  Tensor step(const Tensor& input_ids, const Tensor& positions, const Tensor& out_cache_loc,
              const Tensor& kv_buffer, int64_t mode, const Tensor& slots, int64_t smax,
              const std::optional<Tensor>& mask, const std::vector<Tensor>& stage_k,
              const std::vector<Tensor>& stage_v, const Tensor& rows, const Tensor& pos) {
    py::gil_scoped_release no_gil;
    at::InferenceMode guard;
    const int64_t tokens = input_ids.size(0), bd = tokens;
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t group = heads_ / kv_heads_;
    auto dtype = embed_.scalar_type();
    Tensor x = at::embedding(embed_, input_ids);
    // rotary.cos_sin
    Tensor angles = positions.to(at::kFloat).unsqueeze(1) * inv_freq_.unsqueeze(0);
    Tensor emb = at::cat({angles, angles}, -1).unsqueeze(1);
    Tensor cos = emb.cos().to(dtype), sin = emb.sin().to(dtype);
    Tensor k_pool = kv_buffer.select(0, 0), v_pool = kv_buffer.select(0, 1);
    Tensor gathered_k, gathered_v;
    if (mode == 0) {
      std::vector<int64_t> shape = {slots.size(0), kv_heads_, head_dim_};
      gathered_k = at::empty(shape, kv_buffer.options());
      gathered_v = at::empty_like(gathered_k);
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      Tensor qkv = L.qkv(rms_norm(x, L.input_norm, eps_));
      auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
      Tensor q = parts[0].view({tokens, heads_, head_dim_});
      Tensor k = parts[1].view({tokens, kv_heads_, head_dim_});
      Tensor v = parts[2].view({tokens, kv_heads_, head_dim_});
      if (L.q_norm) {
        q = rms_norm(q, *L.q_norm, eps_);
        k = rms_norm(k, *L.k_norm, eps_);
      }
      q = rotary(q, cos, sin);
      k = rotary(k, cos, sin);
      // DeviceKVPool.set_kv, then TorchAttentionBackend's decode-only path
      Tensor k_buf = k_pool.select(0, i), v_buf = v_pool.select(0, i);
      k_buf.index_put_({out_cache_loc}, k.to(kv_buffer.scalar_type()));
      v_buf.index_put_({out_cache_loc}, v.to(kv_buffer.scalar_type()));
      Tensor keys, values;
      if (mode == 0) {
        at::index_select_out(gathered_k, k_buf, 0, slots);
        at::index_select_out(gathered_v, v_buf, 0, slots);
        keys = gathered_k.view({bd, smax, kv_heads_, head_dim_});
        values = gathered_v.view(keys.sizes());
      } else {
        const Tensor &sk = stage_k[i], &sv = stage_v[i];
        if (mode == 1) {
          const int64_t capacity = sk.size(1);
          Tensor flat_k = sk.view({bd * capacity, kv_heads_, head_dim_});
          Tensor flat_v = sv.view({bd * capacity, kv_heads_, head_dim_});
          at::index_select_out(flat_k, k_buf, 0, slots);
          at::index_select_out(flat_v, v_buf, 0, slots);
        } else {
          sk.index_put_({rows, pos}, k.to(sk.scalar_type()));
          sv.index_put_({rows, pos}, v.to(sv.scalar_type()));
        }
        keys = sk.slice(1, 0, smax);
        values = sv.slice(1, 0, smax);
      }
      keys = keys.to(q.scalar_type()).transpose(1, 2);
      values = values.to(q.scalar_type()).transpose(1, 2);
      Tensor queries = q.reshape({bd, kv_heads_, group, head_dim_});
      Tensor attn = at::scaled_dot_product_attention(queries, keys, values, mask, 0.0, false, scale_);
      attn = attn.reshape({bd, heads_, head_dim_});
      x = x + L.o_proj(attn.reshape({tokens, q_size}));
      Tensor gate_up = L.gate_up(rms_norm(x, L.post_norm, eps_));
      auto gu = gate_up.chunk(2, -1);
      x = x + L.down(at::silu(gu[0]) * gu[1]);
    }
    return (*lm_head_)(rms_norm(x, final_norm_, eps_)).to(at::kFloat);
  }

 private:
  static Linear to_linear(const std::vector<py::object>& l) {
    TORCH_CHECK(l.size() == 8, "a linear is (kind, weight, scales, bias, group, out, in, vnni_blocks)");
    auto opt = [](const py::object& o) -> std::optional<Tensor> {
      if (o.is_none()) return std::nullopt;
      return o.cast<Tensor>();
    };
    auto kind = static_cast<Kind>(l[0].cast<int64_t>());
    TORCH_CHECK(kind == Kind::Dense || kind == Kind::Int8 || kind == Kind::Int4, "unknown linear kind");
    return Linear{kind, l[1].cast<Tensor>(), opt(l[2]).value_or(Tensor()), opt(l[3]),
                  l[4].cast<int64_t>(), l[5].cast<int64_t>(), l[6].cast<int64_t>(), opt(l[7]).value_or(Tensor())};
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
  m.def("int4_pack", &kvfleet::int4_pack);
  m.def("int4_gemv", &kvfleet::int4_gemv, py::call_guard<py::gil_scoped_release>());
  m.def("int8_pack", &kvfleet::int8_pack);
  m.def("int8_gemv", &kvfleet::int8_gemv, py::call_guard<py::gil_scoped_release>());
  m.attr("INT4_MAX_ROWS") = kvfleet::kInt4MaxRows;
  m.attr("INT8_MAX_ROWS") = kvfleet::kInt8MaxRows;
}
