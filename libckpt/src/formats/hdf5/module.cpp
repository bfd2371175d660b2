// SPDX-License-Identifier: Apache-2.0
// The HDF5 reader and writer behind ckpt/formats/hdf5.hpp, built as the module libckpt_hdf5.so, which
// libckpt loads the first time HDF5 is needed (see hdf5.cpp). libhdf5 pulls some forty libraries
// (curl, TLS, Kerberos, LDAP) into a process: loading them only for HDF5 keeps every tool's
// start-up at a few milliseconds and a few MiB. The module's other references (ckpt::Error, the
// dtype tables) are resolved from the executable that loads it, which exports them.
#include <hdf5.h>

#include <cstring>
#include <exception>
#include <map>
#include <mutex>

#include "ckpt/error.hpp"
#include "ckpt/formats/hdf5.hpp"
#include "formats/hdf5/api.hpp"

namespace ckpt {
namespace {

// libhdf5 is not thread-safe in Debian's serial build: one call at a time.
std::mutex& hdf5_mutex() {
  static std::mutex m;
  return m;
}

// Closes an hid_t with its close function when it goes out of scope.
class Handle {
 public:
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() {
    if (id_ >= 0) close_(id_);
  }
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle& operator=(Handle&&) = delete;
  operator hid_t() const noexcept { return id_; }
  bool ok() const noexcept { return id_ >= 0; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

[[noreturn]] void fail(ErrorKind kind, const std::filesystem::path& file, const std::string& what) {
  throw Error(kind, file.string(), std::nullopt, what);
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '%') out += "%25";
    else if (c == '/') out += "%2F";
    else out += c;
  }
  return out.empty() || out == "." ? out + "%2E" : out;
}

std::string unescape(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const std::string_view code = std::string_view(s).substr(i, 3);
    if (code == "%25" || code == "%2F" || code == "%2E") {
      if (code != "%2E") out += code == "%25" ? '%' : '/';  // %2E only marks an empty or "." name
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// The file type of a dtype (the caller closes it).
hid_t file_type(DType d) {
  switch (d) {
    case DType::kBool:
    case DType::kUInt8: return H5Tcopy(H5T_STD_U8LE);
    case DType::kInt8: return H5Tcopy(H5T_STD_I8LE);
    case DType::kInt16: return H5Tcopy(H5T_STD_I16LE);
    case DType::kInt32: return H5Tcopy(H5T_STD_I32LE);
    case DType::kInt64: return H5Tcopy(H5T_STD_I64LE);
    case DType::kUInt16:
    case DType::kBFloat16: return H5Tcopy(H5T_STD_U16LE);
    case DType::kUInt32: return H5Tcopy(H5T_STD_U32LE);
    case DType::kUInt64: return H5Tcopy(H5T_STD_U64LE);
    case DType::kFloat32: return H5Tcopy(H5T_IEEE_F32LE);
    case DType::kFloat64: return H5Tcopy(H5T_IEEE_F64LE);
    case DType::kFloat16: {
      // IEEE half: sign bit 15, exponent bits 10-14 (bias 15), mantissa bits 0-9.
      hid_t t = H5Tcopy(H5T_IEEE_F32LE);
      H5Tset_fields(t, 15, 10, 5, 0, 10);
      H5Tset_size(t, 2);
      H5Tset_ebias(t, 15);
      return t;
    }
    default: return -1;
  }
}

void string_attribute(hid_t obj, const std::string& name, const std::string& value) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type, std::max<std::size_t>(value.size(), 1));
  H5Tset_strpad(type, H5T_STR_NULLPAD);
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.ok() || H5Awrite(attr, type, value.empty() ? "" : value.data()) < 0) {
    throw Error(ErrorKind::kIo, name, std::nullopt, "cannot write HDF5 attribute");
  }
}

std::optional<std::string> read_string_attribute(hid_t obj, const char* name) {
  if (H5Aexists(obj, name) <= 0) return std::nullopt;
  Handle attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(attr), H5Tclose);
  if (H5Tget_class(type) != H5T_STRING || H5Tis_variable_str(type) > 0) return std::nullopt;
  std::string s(H5Tget_size(type) + 1, '\0');
  Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mem, s.size());  // room for the terminator the conversion writes
  if (H5Aread(attr, mem, s.data()) < 0) return std::nullopt;
  s.resize(std::strlen(s.c_str()));
  return s;
}

std::optional<DType> dtype_of(hid_t type) {
  const H5T_class_t cls = H5Tget_class(type);
  const std::size_t size = H5Tget_size(type);
  if (H5Tget_order(type) == H5T_ORDER_BE) return std::nullopt;
  if (cls == H5T_INTEGER) {
    const bool sign = H5Tget_sign(type) == H5T_SGN_2;
    switch (size) {
      case 1: return sign ? DType::kInt8 : DType::kUInt8;
      case 2: return sign ? DType::kInt16 : DType::kUInt16;
      case 4: return sign ? DType::kInt32 : DType::kUInt32;
      case 8: return sign ? DType::kInt64 : DType::kUInt64;
      default: return std::nullopt;
    }
  }
  if (cls == H5T_FLOAT) {
    if (size == 2) return DType::kFloat16;
    if (size == 4) return DType::kFloat32;
    if (size == 8) return DType::kFloat64;
  }
  return std::nullopt;
}

struct Visit {
  const std::filesystem::path* file;
  Checkpoint* c;
  std::exception_ptr error;  // an exception must not unwind through libhdf5's C frames
};

void read_dataset(Visit& v, hid_t root, const char* name, const H5O_info_t* info);

herr_t visit_object(hid_t root, const char* name, const H5O_info_t* info, void* data) {
  auto& v = *static_cast<Visit*>(data);
  try {
    read_dataset(v, root, name, info);
    return 0;
  } catch (...) {
    v.error = std::current_exception();
    return -1;
  }
}

void read_dataset(Visit& v, hid_t root, const char* name, const H5O_info_t* info) {
  if (info->type != H5O_TYPE_DATASET) return;
  Handle ds(H5Dopen2(root, name, H5P_DEFAULT), H5Dclose);
  if (!ds.ok()) fail(ErrorKind::kFormat, *v.file, std::string("cannot open dataset ") + name);
  Handle dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (H5Pget_layout(dcpl) != H5D_CONTIGUOUS || H5Pget_nfilters(dcpl) > 0) {
    fail(ErrorKind::kUnsupported, *v.file, std::string("dataset ") + name + " is chunked, compact or filtered; only contiguous, unfiltered datasets are read");
  }
  Handle type(H5Dget_type(ds), H5Tclose);
  std::optional<DType> dt = dtype_of(type);
  if (auto attr = read_string_attribute(ds, "dtype")) {
    const std::optional<DType> named = dtype_from_torch_name(*attr);
    if (!named || (dt && element_size(*named) != element_size(*dt))) {
      fail(ErrorKind::kFormat, *v.file, std::string("dataset ") + name + " has dtype attribute '" + *attr + "', which does not fit its HDF5 type");
    }
    dt = named;
  }
  if (!dt) fail(ErrorKind::kUnsupported, *v.file, std::string("dataset ") + name + " has an HDF5 type with no torch dtype");
  Handle space(H5Dget_space(ds), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) fail(ErrorKind::kFormat, *v.file, std::string("dataset ") + name + " has no simple dataspace");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  TensorEntry t;
  std::string joined;
  std::string part;
  for (const char* p = name;; ++p) {
    if (*p == '/' || *p == '\0') {
      if (!joined.empty()) joined += '.';  // appended piecewise: GCC 12 -O3 warns (-Wrestrict) on "." + string&&
      joined += unescape(part);
      part.clear();
      if (*p == '\0') break;
    } else {
      part += *p;
    }
  }
  t.name = joined;
  t.position = v.c->tensors.size();
  t.dtype = *dt;
  for (hsize_t d : dims) t.shape.push_back(static_cast<std::int64_t>(d));
  Chunk ch{std::vector<std::int64_t>(t.shape.size(), 0), t.shape, std::nullopt};
  const haddr_t at = H5Dget_offset(ds);
  const std::uint64_t bytes = t.nbytes();
  if (bytes > 0) {
    if (at == HADDR_UNDEF) fail(ErrorKind::kFormat, *v.file, std::string("dataset ") + name + " has no data allocated");
    ch.location.emplace();
    ch.location->offset = static_cast<std::uint64_t>(at);
    ch.location->length = bytes;
  } else {
    ch.location.emplace();
  }
  t.chunks.push_back(std::move(ch));
  v.c->tensors.push_back(std::move(t));
}


std::vector<std::uint64_t> create_hdf5(const std::filesystem::path& file, const std::vector<Hdf5Dataset>& datasets,
                                              const std::vector<std::pair<std::string, std::string>>& attributes) {
  std::lock_guard lock(hdf5_mutex());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  for (const Hdf5Dataset& d : datasets) {
    Handle probe(file_type(d.dtype), H5Tclose);
    if (!probe.ok()) fail(ErrorKind::kUnsupported, file, "HDF5 output has no type for dtype " + std::string(name(d.dtype)));
  }
  Handle f(H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  if (!f.ok()) fail(ErrorKind::kIo, file, "libhdf5 cannot create the file");
  for (const auto& [k, v] : attributes) string_attribute(f, k, v);
  std::map<std::string, hid_t> groups;  // by escaped path
  std::vector<Handle> open_groups;
  open_groups.reserve(datasets.size() * 4 + 1);
  auto group = [&](const std::vector<std::string>& path, std::size_t depth) -> hid_t {
    hid_t parent = f;
    std::string key;
    for (std::size_t i = 0; i < depth; ++i) {
      key += '/';
      key += escape(path[i]);
      if (auto it = groups.find(key); it != groups.end()) {
        parent = it->second;
        continue;
      }
      hid_t g = H5Gcreate2(parent, escape(path[i]).c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      if (g < 0) fail(ErrorKind::kInvalidArgument, file, "cannot create HDF5 group " + key + " (a dataset of that name exists?)");
      open_groups.emplace_back(g, H5Gclose);
      groups.emplace(key, g);
      parent = g;
    }
    return parent;
  };
  std::vector<std::uint64_t> offsets;
  for (const Hdf5Dataset& d : datasets) {
    if (d.path.empty()) internal_error("create_hdf5_layout: a dataset without a name");
    hid_t parent = group(d.path, d.path.size() - 1);
    std::vector<hsize_t> dims(d.shape.begin(), d.shape.end());
    Handle space(d.shape.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
    Handle type(file_type(d.dtype), H5Tclose);
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    H5Pset_layout(dcpl, H5D_CONTIGUOUS);
    H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY);
    H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER);
    const std::string leaf = escape(d.path.back());
    Handle ds(H5Dcreate2(parent, leaf.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), H5Dclose);
    if (!ds.ok()) fail(ErrorKind::kInvalidArgument, file, "cannot create HDF5 dataset '" + leaf + "' (two entries at one path?)");
    string_attribute(ds, "dtype", std::string(name(d.dtype)));
    {
      const hsize_t n = d.shape.size();  // 0 for a 0-d tensor: an empty int64 array
      const std::int64_t none = 0;
      Handle s(H5Screate_simple(1, &n, nullptr), H5Sclose);
      Handle a(H5Acreate2(ds, "shape", H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
      if (!a.ok() || H5Awrite(a, H5T_NATIVE_INT64, n ? d.shape.data() : &none) < 0) fail(ErrorKind::kIo, file, "cannot write the shape attribute");
    }
    const haddr_t at = H5Dget_offset(ds);
    offsets.push_back(at == HADDR_UNDEF ? 0 : static_cast<std::uint64_t>(at));
  }
  open_groups.clear();
  if (H5Fflush(f, H5F_SCOPE_GLOBAL) < 0) fail(ErrorKind::kIo, file, "libhdf5 cannot flush the file");
  return offsets;
}

Checkpoint read_hdf5(const std::filesystem::path& file) {
  std::lock_guard lock(hdf5_mutex());
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  Handle f(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!f.ok()) fail(ErrorKind::kFormat, file, "libhdf5 cannot open it as an HDF5 file");
  Checkpoint c;
  c.format = Format::kHdf5;
  c.writer = "hdf5";
  c.root = file;
  std::error_code ec;
  c.files.push_back({file.filename().string(), file, std::filesystem::file_size(file, ec)});
  if (auto w = read_string_attribute(f, "writer")) c.writer = *w;
  Visit v{&file, &c, nullptr};
  const herr_t walked = H5Ovisit(f, H5_INDEX_NAME, H5_ITER_NATIVE, visit_object, &v);
  if (v.error) std::rethrow_exception(v.error);
  if (walked < 0) fail(ErrorKind::kFormat, file, "libhdf5 cannot walk its objects");
  for (const char* key : {"source", "source_format"}) {
    if (auto s = read_string_attribute(f, key)) c.metadata.emplace_back(key, *s);
  }
  return c;
}

const detail::Hdf5Api kApi{detail::kHdf5ApiVersion, &create_hdf5, &read_hdf5};

}  // namespace
}  // namespace ckpt

extern "C" __attribute__((visibility("default"))) const ckpt::detail::Hdf5Api* ckpt_hdf5_api() { return &ckpt::kApi; }
