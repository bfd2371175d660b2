// SPDX-License-Identifier: Apache-2.0
// A lossless tree of Python pickle values, the restricted unpickler that builds it and the pickler
// that writes it back (docs/formats/pickle.md).
//
// Grammar of what we read (opcode byte, operands little-endian unless noted):
//   pickle   := [PROTO u1] op* STOP          (exactly one STOP, at the end)
//   op       := FRAME u8 | MARK | container ops | scalar ops | GLOBAL "mod\n" "name\n"
//             | STACK_GLOBAL | REDUCE | NEWOBJ | NEWOBJ_EX | BUILD | BINPERSID
//             | BINPUT u1 | LONG_BINPUT u4 | MEMOIZE | BINGET u1 | LONG_BINGET u4
//   scalars  := NONE NEWTRUE NEWFALSE BININT1 u1 BININT2 u2 BININT i4 LONG1 u1+n LONG4 u4+n
//               BINFLOAT f8 (big-endian) BINUNICODE u4+n SHORT_BINUNICODE u1+n BINUNICODE8 u8+n
//               SHORT_BINSTRING u1+n SHORT_BINBYTES u1+n BINBYTES u4+n BINBYTES8 u8+n
//   containers := EMPTY_TUPLE TUPLE1 TUPLE2 TUPLE3 TUPLE EMPTY_LIST APPEND APPENDS EMPTY_DICT
//               SETITEM SETITEMS EMPTY_SET ADDITEMS FROZENSET
// Every other opcode (INST, OBJ, PERSID, STRING, BINSTRING, EXT*, POP, DUP, buffers, protocol-0
// text opcodes) is refused.
//
// Limits we enforce: lengths never exceed the bytes that remain; nesting at most kMaxDepth;
// a GET of an unset memo index, a MARK or stack underflow, bytes after STOP, a missing STOP are
// errors. NOTE [The unpickler never calls anything]: GLOBAL only names a class or function; REDUCE,
// NEWOBJ and BUILD record the call in the tree. Meaning is given afterwards by the one allow-list
// (classify()), so a hostile pickle can be shown, refused or copied, never executed.
//
// Object identity: memo references (BINGET) yield the same shared node, so shared objects stay
// shared and write() re-emits them as GET, as CPython does. Containers cannot be changed once they
// are inside another value, which rules out cycles (we refuse recursive structures).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace ckpt::pickle {

constexpr int kMaxDepth = 1000;

struct Value;
using ValuePtr = std::shared_ptr<Value>;

/// What the one allow-list says a global means (see allowlist.cpp). kOpaque: not understood; it is
/// kept, shown and written back unchanged, and refused where a value must be understood.
enum class GlobalKind : std::uint8_t {
  kOpaque,
  // builtins and the standard library
  kOrderedDict, kCounter, kCodecsEncode, kBuiltinSet, kBuiltinFrozenset, kBuiltinBytes, kBuiltinBytearray,
  kBuiltinComplex, kBuiltinGetattr, kPath,
  // torch
  kTorchSize, kTorchDevice, kGetLayout, kDType, kStorageClass, kUntypedStorage, kTypedStorage, kQScheme,
  kTensorClass, kParameterClass, kLegacyTensorClass,
  kRebuildTensor, kRebuildTensorV2, kRebuildTensorV3, kRebuildParameter, kRebuildParameterWithState,
  kRebuildQTensor, kRebuildFromTypeV2, kRebuildOther,
  // torch.distributed.checkpoint (every module path of docs/formats/dcp.md#class-paths)
  kDcpMetadata, kDcpTensorStorageMetadata, kDcpChunkStorageMetadata, kDcpBytesStorageMetadata,
  kDcpTensorProperties, kDcpMemoryFormat, kDcpStorageMeta, kDcpMetadataIndex, kDcpStorageInfo,
};

std::string_view to_string(GlobalKind kind) noexcept;

/// The allow-list: what `module.name` means. `module` is canonical (`builtins`, not `__builtin__`).
GlobalKind classify(std::string_view module, std::string_view name) noexcept;

/// The deny-list beside it: globals whose call would run code, reach the operating system or load
/// another pickle (os.system, posix.system, subprocess.Popen, builtins.eval, ...). No checkpoint
/// needs one; the unpickler refuses a pickle that names one, in every mode, so that such a file is
/// never shown as sound nor copied into an output.
bool runs_code(std::string_view module, std::string_view name) noexcept;

struct Value;
/// Whether the call `call` (an Object whose callable is builtins.getattr) is the way CPython
/// pickles an enum member by name, getattr(CLASS, 'MEMBER'): data, like any class. Any other
/// getattr reaches attributes (a gadget) and is refused by the readers (NOTE [What runs code]).
bool getattr_is_data(const Value& call) noexcept;
/// The MEMBER that getattr_is_data allows: an identifier that is not private or special. Readers
/// that check getattr without a Value tree apply the same rule.
bool is_enum_member_name(std::string_view name) noexcept;

/// An int of any size: `value` when it fits int64 (then `big` is empty), else `big` holds the
/// minimal two's-complement little-endian bytes (as LONG1/LONG4 carry them).
struct Int {
  std::int64_t value = 0;
  std::vector<std::uint8_t> big;
  bool fits_int64() const noexcept { return big.empty(); }
  friend bool operator==(const Int&, const Int&) = default;
};

struct None {};
struct Str { std::string text; };      ///< UTF-8
struct Bytes { std::string data; };
struct List { std::vector<ValuePtr> items; };
struct Tuple { std::vector<ValuePtr> items; };
struct Set { std::vector<ValuePtr> items; };
struct FrozenSet { std::vector<ValuePtr> items; };
struct Dict { std::vector<std::pair<ValuePtr, ValuePtr>> items; };  ///< insertion order kept

/// A reference to `module.name`, never resolved.
struct Global {
  std::string module;      ///< canonical: `builtins`/`copyreg` for Python 2's `__builtin__`/`copy_reg`
  std::string name;
  GlobalKind kind = GlobalKind::kOpaque;
  ValuePtr module_str;     ///< the str nodes STACK_GLOBAL took them from (protocol 4), for identity
  ValuePtr name_str;
  static void* operator new(std::size_t size);  ///< from the node pool (pickle/node_pool.hpp)
  static void operator delete(void* p, std::size_t size) noexcept;
};

/// How an Object was made.
enum class BuildOp : std::uint8_t { kReduce, kNewObj, kNewObjEx };

/// `callable(*args)` (REDUCE), `cls.__new__(cls, *args, **kwargs)` (NEWOBJ, NEWOBJ_EX), then the
/// items APPEND/SETITEM added to it and the state BUILD gave it, all recorded, nothing run.
struct Object {
  ValuePtr callable;  ///< usually a Global
  BuildOp op = BuildOp::kReduce;
  ValuePtr args;      ///< a Tuple
  ValuePtr kwargs;    ///< NEWOBJ_EX only
  ValuePtr state;     ///< from BUILD, or null
  std::vector<ValuePtr> list_items;
  std::vector<std::pair<ValuePtr, ValuePtr>> dict_items;
  static void* operator new(std::size_t size);  ///< from the node pool (pickle/node_pool.hpp)
  static void operator delete(void* p, std::size_t size) noexcept;
};

/// The result of BINPERSID: `pid` is what the pickle carried (for torch.save a 5-tuple).
struct PersistentId { ValuePtr pid; };

using Payload = std::variant<None, bool, Int, double, Str, Bytes, List, Tuple, Dict, Set, FrozenSet,
                             std::unique_ptr<Global>, std::unique_ptr<Object>, PersistentId>;

/// One node. Build nodes with the make_* functions; read them with the typed accessors.
struct Value {
  Payload payload;
  std::uint64_t offset = 0;  ///< where the opcode that made this node sits in the parsed source
  std::uint16_t depth = 0;   ///< nesting below this node (0 for scalars)
  bool sealed = false;      ///< inside another value: no longer changed by the unpickler

  template <typename T>
  bool is() const noexcept { return std::holds_alternative<T>(payload); }
  template <typename T>
  const T* get_if() const noexcept { return std::get_if<T>(&payload); }
  template <typename T>
  T* get_if() noexcept { return std::get_if<T>(&payload); }

  const Global* global() const noexcept;
  const Object* object() const noexcept;
  /// The str text, or nullptr.
  const std::string* str() const noexcept;
  /// The int value when it is an int that fits int64.
  std::optional<std::int64_t> int64() const noexcept;
  /// Tuple or List items, or nullptr.
  const std::vector<ValuePtr>* sequence() const noexcept;
  /// Key/value pairs of a dict, or of an `OrderedDict()`/`Counter()` object (REDUCE with no args
  /// then SETITEMS); nullptr otherwise.
  const std::vector<std::pair<ValuePtr, ValuePtr>>* dict_items() const noexcept;
  /// For an Object: the kind of its callable when that is a Global; kOpaque otherwise.
  GlobalKind callable_kind() const noexcept;
  /// A short type description for messages: "str", "tuple", "object torch._utils._rebuild_tensor_v2".
  std::string type_name() const;
};

ValuePtr make_none();
ValuePtr make_bool(bool v);
ValuePtr make_int(std::int64_t v);
ValuePtr make_float(double v);
ValuePtr make_str(std::string text);
ValuePtr make_bytes(std::string data);
ValuePtr make_list(std::vector<ValuePtr> items = {});
ValuePtr make_tuple(std::vector<ValuePtr> items = {});
ValuePtr make_dict(std::vector<std::pair<ValuePtr, ValuePtr>> items = {});
/// A global, classified by the allow-list. `module` may be given in its Python 2 spelling.
ValuePtr make_global(std::string module, std::string name);
ValuePtr make_object(ValuePtr callable, BuildOp op, ValuePtr args, ValuePtr state = nullptr);
ValuePtr make_persistent_id(ValuePtr pid);
/// `collections.OrderedDict()` with `items` (REDUCE, then SETITEMS).
ValuePtr make_ordered_dict(std::vector<std::pair<ValuePtr, ValuePtr>> items = {});

/// The value under the str key `key` of `dict` (a dict, or what dict_items() reads as one); null
/// when `dict` is null, not a dict, or has no such key. Null-safe, so look-ups chain.
ValuePtr dict_value(const Value* dict, std::string_view key);
/// A float, or an int as a double; nullopt for null or anything else.
std::optional<double> number_value(const Value* value);

/// A copy of `root` in which each node for which `replace` returns a value is replaced by it.
/// Nodes with no replacement below them are `root`'s own; a node shared in `root` stays shared.
ValuePtr rebuild(const ValuePtr& root, const std::function<ValuePtr(const Value&)>& replace);

/// What the unpickler does with a global the allow-list does not know.
enum class UnknownGlobals { kKeepOpaque, kRefuse };
/// Whether BINPERSID is allowed (torch.save's data.pkl) or refused (DCP's .metadata).
enum class PersistentIds { kAllow, kRefuse };
/// What the unpickler does with a global that would run code (runs_code()): refuse it (every
/// reader does) or keep it opaque like any unknown global (the pickle layer's own round trips,
/// which show that such a pickle is carried and never executed).
enum class CodeGlobals { kRefuse, kKeep };

struct ParseOptions {
  UnknownGlobals unknown_globals = UnknownGlobals::kKeepOpaque;
  PersistentIds persistent_ids = PersistentIds::kAllow;
  CodeGlobals code_globals = CodeGlobals::kRefuse;
  /// Called with each global as it is made (after classification); may throw to refuse it.
  std::function<void(const Value&)> on_global;
  /// Called with each object REDUCE, NEWOBJ or NEWOBJ_EX makes (before any BUILD); may throw.
  std::function<void(const Value&)> on_object;
  /// Called with each key and value SETITEM or SETITEMS adds to a dict (not to an object's items),
  /// before they are stored; returning true takes them: they are not stored and the dict stays
  /// without them. A reader can so consume a huge dict while it is parsed instead of holding its
  /// tree (.metadata's storage_data). May throw.
  std::function<bool(const Value& dict, const ValuePtr& key, const ValuePtr& value)> on_dict_item;
  /// Called with each object BUILD has just given its state, when nothing but the stack holds it
  /// (no later GET refers to it); a value returned replaces it on the stack, null keeps it. A
  /// reader can so turn a finished object into its own record at once: on_dict_item comes only
  /// when SETITEMS runs, and Python's pickler adds dict items 1,000 at a time, so their trees
  /// would otherwise all be held until then. May throw.
  std::function<ValuePtr(const Value& object)> on_built;
  /// Called after every `progress_every` bytes of input with the offset (relative to the bytes
  /// given) before which nothing is read again: the caller may release those bytes.
  std::function<void(std::uint64_t)> on_progress;
  /// Called likewise while the first pass (which finds the memo entries a GET uses) walks the
  /// opcodes, with the offset before which it does not look again; the second pass reads those
  /// bytes again, so a caller may release them only if they come back when read (the pages of a
  /// file mapping do), which keeps a big pickle from being resident whole between the passes.
  std::function<void(std::uint64_t)> on_scanned;
  std::uint64_t progress_every = std::uint64_t{1} << 20;
};

/// Parses one pickle. `source` and `base` name the bytes in errors: offsets are `base` plus the
/// position in `bytes`. The memo keeps only the entries that a GET later in the pickle refers to
/// (a first pass over the opcodes finds them), so a value nothing refers to is freed as soon as
/// nothing holds it, and memory follows the tree, not the pickle's length. Throws ckpt::Error kFormat (malformed), kUnsupported (an opcode we refuse),
/// or kFormat naming the global when UnknownGlobals::kRefuse meets one. Never runs anything.
ValuePtr parse(std::span<const std::byte> bytes, const std::string& source, std::uint64_t base = 0,
               const ParseOptions& options = {});

/// Parses the pickle at the start of `bytes`, which may go on past its STOP (a file of several
/// pickles, as the legacy torch.save format is); `end` gets the position after the STOP. Otherwise
/// as parse().
ValuePtr parse_prefix(std::span<const std::byte> bytes, const std::string& source, std::uint64_t& end, std::uint64_t base = 0,
                      const ParseOptions& options = {});

/// Writes `root` as a pickle of `protocol` (2, 3, 4 or 5) the way CPython's pickler does:
/// memoizing every object it memoizes (BINPUT below protocol 4, MEMOIZE and 64 KiB FRAMEs from 4),
/// GET for a node written before, Python 2 module names under protocol 2. `on_persistent_id` is
/// called for each PersistentId in the order written. Throws kInvalidArgument for a tree the
/// protocol cannot express (NEWOBJ_EX under protocol 2).
std::vector<std::byte> write(const Value& root, int protocol,
                             const std::function<void(const PersistentId&)>& on_persistent_id = {});

/// The items of a dict that write_streamed() makes while it writes it: called with the number of
/// items made so far, returns the next ones (at most 1000, CPython's batch), none after the last.
using DictBatches = std::function<std::vector<std::pair<ValuePtr, ValuePtr>>(std::size_t done)>;

/// write() for trees too big to hold at once (.metadata of a million chunks): each dict of `root`
/// named in `streamed` (an empty placeholder in the tree) is filled batch by batch while it is
/// written, each batch is dropped once written, and the bytes go to `out` as frames complete. A
/// node made for a batch is memoized within that batch only (once freed, its address may come
/// back as another node), so a value two batches share is written once in each: still a pickle
/// any unpickler reads alike. Nodes in `persistent` outlive the write and stay memoized throughout
/// (field names, as CPython's interned strings). The output equals write()'s when nothing is shared
/// between batches except persistent nodes.
void write_streamed(const Value& root, int protocol, const std::unordered_map<const Value*, DictBatches>& streamed,
                    const std::function<void(std::span<const std::byte>)>& out,
                    const std::vector<ValuePtr>& persistent = {},
                    const std::function<void(const PersistentId&)>& on_persistent_id = {});

/// A readable one-line rendering for --meta and messages, Python repr-like: {'a': 1, 'b': [2.5]},
/// objects as `module.name(args)` with `{state}`; at most `max_chars` characters.
std::string repr(const Value& value, std::size_t max_chars = 4096);

}  // namespace ckpt::pickle
