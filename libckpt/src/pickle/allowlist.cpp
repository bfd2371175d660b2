// SPDX-License-Identifier: Apache-2.0
// NOTE [The allow-list]
// The only list of globals libckpt understands. A pickle may name any global; the unpickler
// records it and this table says what it means. Globals not listed stay kOpaque: shown by name,
// written back unchanged, refused wherever a value must be understood (a tensor rebuild, a DCP
// class), and never resolved or called. The entries follow docs/formats/torch_save.md#weights-only-globals (what
// torch.load(weights_only=True) accepts) and docs/formats/dcp.md#class-paths (every module path DCP classes have had).
#include <algorithm>
#include <cctype>
#include <array>
#include <string_view>

#include "ckpt/dtype.hpp"
#include "ckpt/pickle.hpp"

namespace ckpt::pickle {
namespace {

struct Entry {
  std::string_view module;
  std::string_view name;
  GlobalKind kind;
};

constexpr std::string_view kDcp113 = "torch.distributed._shard.checkpoint.metadata";
constexpr std::string_view kDcp2 = "torch.distributed.checkpoint.metadata";
constexpr std::string_view kShardedTensorMeta = "torch.distributed._shard.sharded_tensor.metadata";

constexpr std::array kEntries = std::to_array<Entry>({
    {"collections", "OrderedDict", GlobalKind::kOrderedDict},
    {"collections", "Counter", GlobalKind::kCounter},
    {"_codecs", "encode", GlobalKind::kCodecsEncode},
    {"builtins", "set", GlobalKind::kBuiltinSet},
    {"builtins", "frozenset", GlobalKind::kBuiltinFrozenset},
    {"builtins", "bytes", GlobalKind::kBuiltinBytes},
    {"builtins", "bytearray", GlobalKind::kBuiltinBytearray},
    {"builtins", "complex", GlobalKind::kBuiltinComplex},
    {"builtins", "getattr", GlobalKind::kBuiltinGetattr},
    {"torch", "Size", GlobalKind::kTorchSize},
    {"torch", "device", GlobalKind::kTorchDevice},
    {"torch", "Tensor", GlobalKind::kTensorClass},
    {"torch.serialization", "_get_layout", GlobalKind::kGetLayout},
    {"torch.storage", "UntypedStorage", GlobalKind::kUntypedStorage},
    {"torch", "UntypedStorage", GlobalKind::kUntypedStorage},
    {"torch.storage", "TypedStorage", GlobalKind::kTypedStorage},
    {"torch", "TypedStorage", GlobalKind::kTypedStorage},
    {"torch.nn.parameter", "Parameter", GlobalKind::kParameterClass},
    {"torch", "per_tensor_affine", GlobalKind::kQScheme},
    {"torch", "per_tensor_symmetric", GlobalKind::kQScheme},
    {"torch", "per_channel_affine", GlobalKind::kQScheme},
    {"torch", "per_channel_symmetric", GlobalKind::kQScheme},
    {"torch", "per_channel_affine_float_qparams", GlobalKind::kQScheme},
    {"torch._utils", "_rebuild_tensor", GlobalKind::kRebuildTensor},
    {"torch._utils", "_rebuild_tensor_v2", GlobalKind::kRebuildTensorV2},
    {"torch._utils", "_rebuild_tensor_v3", GlobalKind::kRebuildTensorV3},
    {"torch._utils", "_rebuild_parameter", GlobalKind::kRebuildParameter},
    {"torch._utils", "_rebuild_parameter_with_state", GlobalKind::kRebuildParameterWithState},
    {"torch._utils", "_rebuild_qtensor", GlobalKind::kRebuildQTensor},
    {"torch._utils", "_rebuild_sparse_tensor", GlobalKind::kRebuildOther},
    {"torch._utils", "_rebuild_meta_tensor_no_storage", GlobalKind::kRebuildOther},
    {"torch._utils", "_rebuild_wrapper_subclass", GlobalKind::kRebuildOther},
    {"torch._utils", "_rebuild_device_tensor_from_numpy", GlobalKind::kRebuildOther},
    {"torch._utils", "_rebuild_device_tensor_from_cpu_tensor", GlobalKind::kRebuildOther},
    {"torch._tensor", "_rebuild_from_type_v2", GlobalKind::kRebuildFromTypeV2},
    {"pathlib", "PosixPath", GlobalKind::kPath},
    {"pathlib", "WindowsPath", GlobalKind::kPath},
    {"pathlib", "PurePosixPath", GlobalKind::kPath},
    {"pathlib", "PureWindowsPath", GlobalKind::kPath},
    {"pathlib._local", "PosixPath", GlobalKind::kPath},
    {"pathlib._local", "WindowsPath", GlobalKind::kPath},
    {"pathlib._local", "PurePosixPath", GlobalKind::kPath},
    {"pathlib._local", "PureWindowsPath", GlobalKind::kPath},
    // DCP: torch 1.13 (_shard.checkpoint), 2.0 and later (checkpoint), both enum spellings.
    {kDcp113, "Metadata", GlobalKind::kDcpMetadata},
    {kDcp113, "TensorStorageMetadata", GlobalKind::kDcpTensorStorageMetadata},
    {kDcp113, "ChunkStorageMetadata", GlobalKind::kDcpChunkStorageMetadata},
    {kDcp113, "BytesStorageMetadata", GlobalKind::kDcpBytesStorageMetadata},
    {kDcp113, "MetadataIndex", GlobalKind::kDcpMetadataIndex},
    {kDcp2, "Metadata", GlobalKind::kDcpMetadata},
    {kDcp2, "TensorStorageMetadata", GlobalKind::kDcpTensorStorageMetadata},
    {kDcp2, "ChunkStorageMetadata", GlobalKind::kDcpChunkStorageMetadata},
    {kDcp2, "BytesStorageMetadata", GlobalKind::kDcpBytesStorageMetadata},
    {kDcp2, "MetadataIndex", GlobalKind::kDcpMetadataIndex},
    {kDcp2, "StorageMeta", GlobalKind::kDcpStorageMeta},
    {kDcp2, "TensorProperties", GlobalKind::kDcpTensorProperties},
    {kDcp2, "_MEM_FORMAT_ENCODING", GlobalKind::kDcpMemoryFormat},
    {kDcp2, "MEM_FORMAT_ENCODING", GlobalKind::kDcpMemoryFormat},
    {kShardedTensorMeta, "TensorProperties", GlobalKind::kDcpTensorProperties},
    {kShardedTensorMeta, "MEM_FORMAT_ENCODING", GlobalKind::kDcpMemoryFormat},
    {kShardedTensorMeta, "_MEM_FORMAT_ENCODING", GlobalKind::kDcpMemoryFormat},
    {"torch.distributed._shard.checkpoint.filesystem", "_StorageInfo", GlobalKind::kDcpStorageInfo},
    {"torch.distributed.checkpoint.filesystem", "_StorageInfo", GlobalKind::kDcpStorageInfo},
});

// Legacy tensor classes (torch.FloatTensor, torch.cuda.HalfTensor, ...), accepted by weights_only.
constexpr std::array<std::string_view, 11> kLegacyTensorNames{
    "DoubleTensor", "FloatTensor", "HalfTensor", "BFloat16Tensor", "LongTensor", "IntTensor",
    "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor", "ComplexFloatTensor"};

}  // namespace

// NOTE [What runs code]: the one rule for what a pickle may not name, whatever it is read for.
// A global is refused when calling it (or building its class) could run code, reach the
// interpreter, the operating system or the network, or load another pickle: everything in the
// modules below, the builtins that evaluate, import, open or mutate, the operator gadgets that
// reach attributes, and the loaders. Any other class is data: kept as an opaque value (its class
// path and arguments, never constructed), and refused only where a reader needs to understand
// it. docs/formats/pickle.md#hardening says the same for users.
bool runs_code(std::string_view module, std::string_view name) noexcept {
  // Modules whose every callable reaches the operating system, the interpreter or the network.
  static constexpr std::array kModules = std::to_array<std::string_view>(
      {"os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "pty", "importlib", "runpy", "ctypes", "multiprocessing",
       "marshal", "pickle", "_pickle", "shelve", "webbrowser", "code", "codeop", "timeit", "pdb", "platform", "asyncio"});
  for (std::string_view m : kModules) {
    if (module == m || (module.size() > m.size() && module.starts_with(m) && module[m.size()] == '.')) return true;
  }
  // signal's enums (Megatron saves signal.Signals(15)) are data; its functions send and trap signals.
  if (module == "signal") return name != "Signals" && name != "Handlers" && name != "Sigmasks";
  // Builtins that evaluate, import, open or mutate.
  static constexpr std::array kBuiltins = std::to_array<std::string_view>(
      {"eval", "exec", "compile", "__import__", "open", "setattr", "delattr", "globals", "locals", "vars", "input", "breakpoint",
       "exit", "quit", "help", "memoryview"});
  if (module == "builtins") return std::find(kBuiltins.begin(), kBuiltins.end(), name) != kBuiltins.end();
  // The usual gadgets around them, and loaders that would run another file's pickle.
  if (module == "operator") return name == "attrgetter" || name == "methodcaller" || name == "itemgetter";
  if (module == "torch" || module == "torch.serialization" || module == "torch.jit" || module == "torch.hub") {
    return name == "load" || name == "jit" || name == "hub";
  }
  return module == "numpy" && (name == "load" || name == "fromfile");
}

bool getattr_is_data(const Value& call) noexcept {
  const Object* o = call.object();
  const auto* args = o && o->args ? o->args->sequence() : nullptr;
  if (!args || args->size() != 2 || !(*args)[0]->global() || !(*args)[1]->str()) return false;
  return is_enum_member_name(*(*args)[1]->str());
}

bool is_enum_member_name(std::string_view name) noexcept {
  const auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  return !name.empty() && name[0] != '_' && !std::isdigit(static_cast<unsigned char>(name[0])) &&
         std::all_of(name.begin(), name.end(), word);
}

GlobalKind classify(std::string_view module, std::string_view name) noexcept {
  // Never anything from these modules, whatever the table says (as torch.load does).
  if (module == "os" || module == "sys" || module == "posix" || module == "nt" || module.starts_with("os.")) {
    return GlobalKind::kOpaque;
  }
  for (const auto& e : kEntries) {
    if (e.module == module && e.name == name) return e.kind;
  }
  if (module == "torch") {
    // Dtypes pickle under their canonical name only (torch.float is written as torch.float32).
    if (auto d = dtype_from_torch_name(name); d && ckpt::name(*d) == name) return GlobalKind::kDType;
    if (dtype_from_storage_class(name)) return GlobalKind::kStorageClass;
  }
  if (module == "torch" || module == "torch.cuda") {
    for (auto n : kLegacyTensorNames) {
      if (n == name) return GlobalKind::kLegacyTensorClass;
    }
  }
  return GlobalKind::kOpaque;
}

std::string_view to_string(GlobalKind kind) noexcept {
  switch (kind) {
    case GlobalKind::kOpaque: return "opaque";
    case GlobalKind::kOrderedDict: return "OrderedDict";
    case GlobalKind::kCounter: return "Counter";
    case GlobalKind::kCodecsEncode: return "_codecs.encode";
    case GlobalKind::kBuiltinSet: return "set";
    case GlobalKind::kBuiltinFrozenset: return "frozenset";
    case GlobalKind::kBuiltinBytes: return "bytes";
    case GlobalKind::kBuiltinBytearray: return "bytearray";
    case GlobalKind::kBuiltinComplex: return "complex";
    case GlobalKind::kBuiltinGetattr: return "getattr";
    case GlobalKind::kPath: return "path";
    case GlobalKind::kTorchSize: return "torch.Size";
    case GlobalKind::kTorchDevice: return "torch.device";
    case GlobalKind::kGetLayout: return "layout";
    case GlobalKind::kDType: return "dtype";
    case GlobalKind::kStorageClass: return "storage class";
    case GlobalKind::kUntypedStorage: return "UntypedStorage";
    case GlobalKind::kTypedStorage: return "TypedStorage";
    case GlobalKind::kQScheme: return "qscheme";
    case GlobalKind::kTensorClass: return "Tensor";
    case GlobalKind::kParameterClass: return "Parameter";
    case GlobalKind::kLegacyTensorClass: return "legacy tensor class";
    case GlobalKind::kRebuildTensor: return "_rebuild_tensor";
    case GlobalKind::kRebuildTensorV2: return "_rebuild_tensor_v2";
    case GlobalKind::kRebuildTensorV3: return "_rebuild_tensor_v3";
    case GlobalKind::kRebuildParameter: return "_rebuild_parameter";
    case GlobalKind::kRebuildParameterWithState: return "_rebuild_parameter_with_state";
    case GlobalKind::kRebuildQTensor: return "_rebuild_qtensor";
    case GlobalKind::kRebuildFromTypeV2: return "_rebuild_from_type_v2";
    case GlobalKind::kRebuildOther: return "rebuild function";
    case GlobalKind::kDcpMetadata: return "Metadata";
    case GlobalKind::kDcpTensorStorageMetadata: return "TensorStorageMetadata";
    case GlobalKind::kDcpChunkStorageMetadata: return "ChunkStorageMetadata";
    case GlobalKind::kDcpBytesStorageMetadata: return "BytesStorageMetadata";
    case GlobalKind::kDcpTensorProperties: return "TensorProperties";
    case GlobalKind::kDcpMemoryFormat: return "MEM_FORMAT_ENCODING";
    case GlobalKind::kDcpStorageMeta: return "StorageMeta";
    case GlobalKind::kDcpMetadataIndex: return "MetadataIndex";
    case GlobalKind::kDcpStorageInfo: return "_StorageInfo";
  }
  return "?";
}

}  // namespace ckpt::pickle
