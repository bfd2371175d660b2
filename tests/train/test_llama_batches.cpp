// SPDX-License-Identifier: Apache-2.0
// fsdp-train's Llama on padded and packed batches, as Hugging Face's LlamaForCausalLM takes them:
// a left-padded row with its attention mask and the positions transformers gives it
// (attention_mask.cumsum(-1) - 1, padding set to 1, as generate's prepare_inputs_for_generation
// does), a right-padded row, and a packed row (two sequences, each from position 0, as
// DataCollatorWithFlattening gives them, kept apart as flash attention keeps them) give at each
// real token the logits of that sequence run alone. tests/train/test_train.py checks the
// unpadded computation against tests/train/llama.py; these follow from it.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include "fsdp-train/model.hpp"

namespace {

fsdp_train::ModelShape shape() {
  fsdp_train::ModelShape s;
  s.n_layer = 2;
  s.n_head = 4;
  s.n_kv_head = 2;
  s.n_embd = 32;
  s.vocab_size = 64;
  s.block_size = 16;
  return s;
}

torch::Tensor alone(torch::nn::Module& m, const torch::Tensor& ids) {
  return fsdp_train::llama_forward(m, ids.unsqueeze(0), {}, {}).squeeze(0);
}

bool close(const torch::Tensor& a, const torch::Tensor& b) { return a.sizes() == b.sizes() && a.allclose(b, 1e-5, 1e-5); }

}  // namespace

TEST_CASE("fsdp-train llama: padded and packed rows give each sequence's own logits", "[train]") {
  torch::manual_seed(3);
  auto m = fsdp_train::make_llama(shape());
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.normal_(0.0, 0.3);  // far from uniform attention
  const torch::Tensor a = torch::randint(64, {10}), b = torch::randint(64, {6}), c = torch::randint(64, {4});
  const auto longs = torch::TensorOptions().dtype(torch::kLong);

  SECTION("left and right padding with an attention mask") {
    // Row 0: b after 4 pad tokens; row 1: c followed by 6 pad tokens.
    const torch::Tensor ids = torch::stack({torch::cat({torch::zeros({4}, longs), b}), torch::cat({c, torch::zeros({6}, longs)})});
    const torch::Tensor mask = torch::stack({torch::cat({torch::zeros({4}, longs), torch::ones({6}, longs)}),
                                             torch::cat({torch::ones({4}, longs), torch::zeros({6}, longs)})});
    const torch::Tensor positions = (mask.cumsum(-1) - 1).masked_fill(mask.eq(0), 1);
    const torch::Tensor logits = fsdp_train::llama_forward(*m, ids, positions, mask);
    CHECK(close(logits[0].narrow(0, 4, 6), alone(*m, b)));
    CHECK(close(logits[1].narrow(0, 0, 4), alone(*m, c)));
    CHECK(torch::isfinite(logits).all().item<bool>());  // padding queries see no key: uniform, not NaN
    // With positions that never restart at 0 (one sequence), the mask alone keeps the padding out.
    const torch::Tensor one_sequence = torch::arange(1, 11, longs).expand({2, 10});
    CHECK_FALSE(close(fsdp_train::llama_forward(*m, ids, one_sequence, {}), fsdp_train::llama_forward(*m, ids, one_sequence, mask)));
  }

  SECTION("a packed row of two sequences, each from position 0") {
    const torch::Tensor ids = torch::cat({a, b}).unsqueeze(0);
    const torch::Tensor positions = torch::cat({torch::arange(10, longs), torch::arange(6, longs)}).unsqueeze(0);
    const torch::Tensor logits = fsdp_train::llama_forward(*m, ids, positions, {})[0];
    CHECK(close(logits.narrow(0, 0, 10), alone(*m, a)));
    CHECK(close(logits.narrow(0, 10, 6), alone(*m, b)));
    // Without the restart, b attends to a.
    CHECK_FALSE(close(fsdp_train::llama_forward(*m, ids, {}, {})[0].narrow(0, 10, 6), alone(*m, b)));
  }

  SECTION("no positions and no mask: positions 0 … T-1, every token") {
    const torch::Tensor ids = torch::stack({a, torch::cat({b, c})});
    const torch::Tensor logits = fsdp_train::llama_forward(*m, ids, {}, {});
    CHECK(close(logits[0], alone(*m, a)));
    CHECK(close(logits, fsdp_train::llama_forward(*m, ids, torch::arange(10, longs).expand({2, 10}), torch::ones({2, 10}, longs))));
  }
}
