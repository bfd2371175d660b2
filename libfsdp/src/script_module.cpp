// SPDX-License-Identifier: Apache-2.0
#include "fsdp/script_module.hpp"

#include <torch/script.h>
#include <torch/torch.h>

#include "fsdp/process_group.hpp"

namespace fsdp {
namespace {

// The plain module at `path` ("a.b") under `root`, made on the way.
torch::nn::Module& module_at(torch::nn::Module& root, const std::string& path) {
  torch::nn::Module* m = &root;
  std::size_t begin = 0;
  while (begin < path.size()) {
    const std::size_t dot = path.find('.', begin);
    const std::string name = path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin);
    std::shared_ptr<torch::nn::Module> child;
    for (const auto& c : m->named_children()) {
      if (c.key() == name) child = c.value();
    }
    if (!child) child = m->register_module(name, std::make_shared<torch::nn::Module>(name));
    m = child.get();
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return *m;
}

}  // namespace

ScriptModuleImpl::ScriptModuleImpl(const torch::jit::Module& script) : torch::nn::Module("ScriptModule"), script_(std::make_unique<torch::jit::Module>(script)) {
  script_->to(torch::kCPU);
  script_->train(true);
  if (!script_->find_method("forward")) throw Error("the TorchScript module has no forward method");
  bool any = false;
  for (const auto& p : script_->named_parameters(/*recurse=*/true)) {
    const std::size_t dot = p.name.rfind('.');
    torch::nn::Module& owner = dot == std::string::npos ? *this : module_at(*this, p.name.substr(0, dot));
    // The script's own tensor: a gather's set_data reaches the script, and autograd fills its grad.
    owner.register_parameter(dot == std::string::npos ? p.name : p.name.substr(dot + 1), p.value, p.value.requires_grad());
    any = true;
  }
  if (!any) throw Error("the TorchScript module has no parameters to train");
}

ScriptModuleImpl::~ScriptModuleImpl() = default;

torch::Tensor ScriptModuleImpl::forward(const torch::Tensor& x) {
  const c10::IValue out = script_->forward({x});
  if (!out.isTensor()) throw Error("the TorchScript module's forward returned a " + out.tagKind() + ", expected one tensor (the logits)");
  return out.toTensor();
}

void ScriptModuleImpl::cast_floating(c10::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  for (const auto& p : script_->named_parameters(true)) {
    if (p.value.is_floating_point()) p.value.set_data(p.value.to(dtype));
  }
  for (const auto& b : script_->named_buffers(true)) {
    if (b.value.is_floating_point()) b.value.set_data(b.value.to(dtype));
  }
}

std::size_t ScriptModuleImpl::buffer_count() const {
  std::size_t n = 0;
  for (const auto& b : script_->named_buffers(true)) {
    (void)b;
    ++n;
  }
  return n;
}

void ScriptModuleImpl::train(bool on) {
  torch::nn::Module::train(on);
  script_->train(on);
}

void ScriptModuleImpl::to(torch::Device device, bool non_blocking) { script_->to(device, non_blocking); }

ScriptModule load_script_module(const std::string& path) {
  torch::jit::Module m;
  try {
    m = torch::jit::load(path, torch::kCPU);
  } catch (const c10::Error& e) {
    // TorchScript's own message starts with its first line; the rest is a C++ backtrace.
    std::string what = e.what_without_backtrace();
    if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    throw Error(path + ": not a TorchScript module (torch.jit.save's file): " + what);
  }
  try {
    return ScriptModule(m);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

}  // namespace fsdp
