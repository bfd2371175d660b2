// SPDX-License-Identifier: Apache-2.0
#include "fsdp-ckpt-merge/hf_config.hpp"

#include <nlohmann/json.hpp>

#include "ckpt/error.hpp"
#include "ckpt/pickle.hpp"

namespace fsdp_tools {
namespace pk = ckpt::pickle;

namespace {

/// The value fsdp-train saved as config[key]: in meta.pt's tree (a sharded checkpoint), or the
/// object "config.<key>" (a full file's leaf); null where there is none.
const pk::Value* config_value(const ckpt::Checkpoint& input, const std::string& key) {
  for (const auto& [tree, root] : input.meta_trees) {
    if (tree == "meta.pt") return pk::dict_value(pk::dict_value(root.get(), "config").get(), key).get();
  }
  const std::string name = "config." + key;
  for (const ckpt::ObjectEntry& o : input.objects) {
    if (o.name == name) return o.value.get();
  }
  return nullptr;
}

}  // namespace

std::string llama_hf_config(const ckpt::Checkpoint& input, std::optional<ckpt::DType> dtype) {
  const std::string where = input.root.string();
  auto refuse = [&](const std::string& why) {
    return ckpt::Error(ckpt::ErrorKind::kInvalidArgument, where, std::nullopt,
                       "--hf-config needs the training configuration of an fsdp-train --model llama run (meta.pt's 'config'): " + why);
  };
  const pk::Value* model = config_value(input, "model");
  if (!model || !model->str()) throw refuse("there is none");
  if (*model->str() != "llama") throw refuse("this one is of a '" + *model->str() + "' model");
  auto integer = [&](const char* key) {
    const pk::Value* v = config_value(input, key);
    if (!v || !v->int64()) throw refuse(std::string("it has no int '") + key + "'");
    return *v->int64();
  };
  auto number = [&](const char* key) {
    const auto v = pk::number_value(config_value(input, key));
    if (!v) throw refuse(std::string("it has no number '") + key + "'");
    return *v;
  };
  const pk::Value* tied = config_value(input, "tie_weights");
  if (!tied || !tied->is<bool>()) throw refuse("it has no bool 'tie_weights'");
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = integer("n_embd");
  j["intermediate_size"] = integer("ffn_hidden");
  j["num_hidden_layers"] = integer("n_layer");
  j["num_attention_heads"] = integer("n_head");
  j["num_key_value_heads"] = integer("n_kv_head");
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = integer("block_size");
  j["rms_norm_eps"] = number("norm_eps");
  j["rope_theta"] = number("rope_theta");
  j["vocab_size"] = integer("vocab_size");
  j["tie_word_embeddings"] = *tied->get_if<bool>();
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["torch_dtype"] = std::string(ckpt::name(dtype.value_or(ckpt::DType::kFloat32)));
  return j.dump(2) + "\n";
}

}  // namespace fsdp_tools
