// SPDX-License-Identifier: Apache-2.0
// The direct .metadata reader. NOTE [The direct .metadata reader]:
//
// The tree reader (metadata_tree.cpp) runs the restricted unpickler, which makes a node for every value,
// and reads the index from the nodes. For the .metadata of a large checkpoint that is millions of
// nodes, each allocated, reference-counted and freed: most of the time `inspect` takes. This
// reader runs the same pickle opcodes over small tokens instead: scalars held in the token,
// strings as views of the file, containers as runs of tokens in one arena whose tail is given back
// as soon as nothing on the stack or in the memo needs it. DCP's classes are read as BUILD
// finishes them (a ChunkStorageMetadata into its boxes, a TensorStorageMetadata into its entry)
// and the two big dicts are handed to the same DcpIndexBuilder the tree reader uses, batch by
// batch. Only the memo entries a GET uses are kept (the first pass, pickle/memo_scan.hpp, which
// for a .metadata up to 16 MiB runs beside the reader: NOTE [The first pass beside the reader]).
//
// It reads only what a well-formed .metadata holds, the shapes torch 1.13 to 2.flag write. Anything
// else (an error of any kind, an opcode or class it does not model, a list or dict a GET shares,
// a Metadata subclass) makes it decline, and the tree reader reads the file from the start: so
// every error is the tree reader's, with its offsets and wording, every hostile pickle is refused
// by the unpickler's one allow-list, and the direct reader never needs to be right about a bad
// file, only to decline it. What it accepts it must read exactly as the tree reader does: tests
// and the .metadata fuzz target compare the two indexes (detail::index_difference).
#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <span>
#include <thread>

#include "ckpt/error.hpp"
#include "formats/dcp/index_builder.hpp"
#include "formats/dcp/metadata.hpp"
#include "pickle/memo_scan.hpp"
#include "pickle/opcodes.hpp"

namespace ckpt::detail {
namespace {

namespace op = pickle::op;
using pickle::GlobalKind;

/// Thrown inside the reader when it declines; caught at its entry point.
struct Decline {};
[[noreturn]] void decline() { throw Decline{}; }
/// Thrown when a guess about the memo was wrong (NOTE [The first pass beside the reader]): the
/// reading starts again, with the first pass's answer from the start.
struct Reguess {};
[[noreturn]] void reguess() { throw Reguess{}; }

enum class Tag : std::uint8_t {
  kNone, kBool, kInt, kFloat,
  kStr,  // at = where its bytes are, count = how many; flag = 1 once the memo holds it (a GET may share it), aux = its slot
  kBytes, kGlobal,
  kTuple, kList, kDict,  // at = first token in the arena, count = tokens (a dict's are key, value, ...);
                         // a dict's aux = its number, flag = what its pairs went to (kKept, kEntries, ...)
  kObject,  // made by NEWOBJ, not (or, BytesStorageMetadata, already) built: kind its class, at its global
  kOther,   // a value whose content nothing reads (a layout, a memory format, a path, StorageMeta)
  kSize,    // torch.Size: at = its ints in the arena, count = how many
  kProps,   // TensorProperties: at = DType, aux = requires_grad
  kChunk,   // ChunkStorageMetadata: at = offsets, aux = sizes (ints in the arena), count = rank
  kTensor,  // TensorStorageMetadata: at = its entry in tensors_
  kIndex,   // MetadataIndex: at, count = fqn's bytes; aux = offsets in the arena, flag = rank or kNoOffsets
  kInfo,    // _StorageInfo: count = its file's index; at = offset; aux = length; flag = transforms + 1
  kRoot,    // the Metadata object, read
  kUnset,   // a memo slot no PUT has set yet
};

// A token: what the reader keeps of a value. What `at`, `count`, `aux` and `flag` hold depends on
// the tag (Tag says, for each).
struct Tok {
  Tag tag = Tag::kNone;
  GlobalKind kind = GlobalKind::kOpaque;
  std::uint16_t depth = 0;  ///< nesting below it, as the tree reader counts it
  std::uint32_t count = 0;  ///< how many: bytes, tokens, ints (a chunk's rank; a storage's file)
  std::uint32_t flag = 0;   ///< a str: memoized; a dict: where its pairs went; an index: its rank; a storage: transforms + 1
  std::uint32_t end = 0;    ///< the arena tokens below this index it needs (0: none)
  std::uint64_t at = 0;     ///< where: bytes in the input, the first token or int in the arena; or an int's value
  std::uint64_t aux = 0;    ///< a second value: a str's memo slot, a dict's number, a chunk's sizes, a length
};
static_assert(sizeof(Tok) == 32);
constexpr std::uint32_t kNoOffsets = ~std::uint32_t{0};
constexpr std::size_t kMaxArena = std::size_t{1} << 31;
constexpr std::uint16_t kMaxDepth = 900;  // below the unpickler's pickle::kMaxDepth: it would accept

// The stack: its tokens and, per slot, the arena that slot and every slot below it need
// (collect() keeps that much). Grown by hand: a push is one compare and two stores.
class TokStack {
 public:
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  Tok& back() noexcept { return toks_[size_ - 1]; }
  Tok& operator[](std::size_t i) noexcept { return toks_[i]; }
  const Tok& operator[](std::size_t i) const noexcept { return toks_[i]; }
  const Tok* begin() const noexcept { return toks_.data(); }
  const Tok* end() const noexcept { return toks_.data() + size_; }
  std::uint32_t live() const noexcept { return size_ ? live_[size_ - 1] : 0; }
  [[gnu::always_inline]] Tok& emplace(Tag tag) {
    grow();
    Tok& t = toks_[size_];
    t = Tok{};
    t.tag = tag;
    live_[size_] = live();
    ++size_;
    return t;
  }
  [[gnu::always_inline]] void push(const Tok& t) {
    grow();
    live_[size_] = std::max(live(), t.end);
    toks_[size_++] = t;
  }
  Tok pop() noexcept { return toks_[--size_]; }  // callers check size() first
  void shrink(std::size_t size) noexcept { size_ = size; }
  void retop() noexcept { live_[size_ - 1] = std::max(size_ >= 2 ? live_[size_ - 2] : 0, toks_[size_ - 1].end); }

 private:
  void grow() {
    if (size_ == capacity_) [[unlikely]] grow_slow();
  }
  [[gnu::noinline]] void grow_slow() {
    capacity_ = 2 * capacity_ + 64;
    toks_.resize(capacity_);
    live_.resize(capacity_);
  }
  std::vector<Tok> toks_;
  std::vector<std::uint32_t> live_;
  std::size_t size_ = 0, capacity_ = 0;
};

// The arena: runs of tokens, appended at the end and given back from the end.
class TokArena {
 public:
  std::size_t size() const noexcept { return size_; }
  const Tok& operator[](std::size_t i) const noexcept { return toks_[i]; }
  void truncate(std::size_t size) noexcept { size_ = std::min(size_, size); }
  void append(const Tok* first, const Tok* last) {
    const auto n = static_cast<std::size_t>(last - first);
    reserve(n);
    Tok* to = toks_.data() + size_;
    if (n <= 8) {  // most runs: a plain loop, where a string copy's start-up would cost more
      for (std::size_t k = 0; k < n; ++k) to[k] = first[k];
    } else {
      std::copy(first, last, to);
    }
    size_ += n;
  }
  /// Appends n int tokens.
  void append_ints(const std::int64_t* v, std::size_t n) {
    reserve(n);
    for (std::size_t k = 0; k < n; ++k) {
      Tok& t = toks_[size_ + k];
      t = Tok{};
      t.tag = Tag::kInt;
      t.at = static_cast<std::uint64_t>(v[k]);
    }
    size_ += n;
  }
  /// Appends a copy of its own tokens [from, from + n).
  void append_own(std::size_t from, std::size_t n) {
    reserve(n);
    std::copy(toks_.data() + from, toks_.data() + from + n, toks_.data() + size_);
    size_ += n;
  }

 private:
  void reserve(std::size_t n) {
    if (toks_.size() - size_ < n) toks_.resize(std::max(2 * toks_.size(), size_ + n) + 64);
  }
  std::vector<Tok> toks_;
  std::size_t size_ = 0;
};

// NOTE [The builder beside the reader]: placing storage_data's items in the index (finding each
// item's tensor by name and its chunk by offsets) is a fifth of the reading's time, and needs
// nothing back: the reader hands the builder its pairs a batch (one SETITEMS) at a time. When the
// first pass runs beside the reader, the same thread then takes the batches, in order, while the
// reader reads on (for a larger .metadata, whose first pass runs first, a thread of its own takes
// them); else the reader runs each batch itself as it hands it over. The builder's other
// calls stay the reader's: file_index() and layout() (their answers go into the batches), and
// root()'s finish() and set_writer(), after drain() has seen every batch taken. A batch the
// builder refuses stops it; the reader gets the builder's own exception at its next hand-over or
// at drain(), as it would have from the call. Until the reader is done with the feed (drain(), or
// close() when it stops early) the builder's Checkpoint members are the builder thread's: the
// reader touches only Checkpoint::files (file_index()) until drain(). At most kQueued batches
// wait, so that a builder behind the reader (its thread is on the first pass at first) holds a
// few batches, not all of storage_data. The TensorEntries stay the reader's to make: made on the
// builder's thread, their memory would come from a second malloc arena and raise the peak RSS.
class BuilderFeed {
 public:
  struct Entry {
    TensorEntry t;  ///< t.name is the FQN
    bool bytes = false;  ///< a BytesStorageMetadata: only t.name counts
  };
  struct Storage {
    std::string_view fqn;  ///< in the .metadata bytes
    bool tensor = false;
    Dims offsets;
    ChunkLocation loc;
  };
  struct Batch {
    std::vector<Entry> entries;
    std::vector<Storage> storage;
  };

  explicit BuilderFeed(bool beside) : beside_(beside) {}

  /// The builder the batches go to; before the first hand_over().
  void attach(DcpIndexBuilder& b) { builder_ = &b; }
  /// An empty batch to fill (one taken before, when there is one: its vectors keep their room).
  Batch take() {
    std::lock_guard lock(m_);
    if (spare_.empty()) return {};
    Batch b = std::move(spare_.back());
    spare_.pop_back();
    return b;
  }
  void hand_over(Batch b) {
    ++batches_;
    if (!beside_) {
      run(b);
      return give_back(std::move(b));
    }
    std::unique_lock lock(m_);
    room_.wait(lock, [&] { return queue_.size() < kQueued || failed_; });
    if (failed_) std::rethrow_exception(failed_);
    queue_.push_back(std::move(b));
    work_.notify_one();
  }
  /// Waits until the builder has taken every batch; throws what it threw.
  void drain() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return (queue_.empty() && !busy_) || failed_; });
    if (failed_) std::rethrow_exception(failed_);
  }
  /// Stops the builder (batches not taken are dropped) and waits until it is not running one.
  void close() {
    std::unique_lock lock(m_);
    closed_ = true;
    queue_.clear();
    work_.notify_one();
    idle_.wait(lock, [&] { return !busy_; });
  }
  /// The other thread: runs the batches until close().
  void serve() {
    std::unique_lock lock(m_);
    while (true) {
      work_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (closed_) return;
      Batch b = std::move(queue_.front());
      queue_.pop_front();
      room_.notify_one();
      busy_ = true;
      lock.unlock();
      std::exception_ptr failed;
      try {
        run(b);
      } catch (...) {
        failed = std::current_exception();
      }
      clear(b);
      lock.lock();
      ++beside_batches_;
      spare_.push_back(std::move(b));
      busy_ = false;
      if (failed) {
        failed_ = failed;
        queue_.clear();
        room_.notify_one();
      }
      idle_.notify_all();
    }
  }
  std::uint64_t batches() const { return batches_; }
  std::uint64_t batches_beside() {
    std::lock_guard lock(m_);
    return beside_batches_;
  }

 private:
  void run(Batch& b) {
    for (Entry& e : b.entries) {
      if (e.bytes) {
        builder_->add_bytes(e.t.name, 0);
      } else {
        builder_->add_tensor(std::move(e.t), 0);
      }
    }
    for (Storage& s : b.storage) builder_->add_storage(s.fqn, s.tensor, std::move(s.offsets), std::move(s.loc), 0);
  }
  static void clear(Batch& b) {
    b.entries.clear();
    b.storage.clear();
  }
  void give_back(Batch b) {
    clear(b);
    std::lock_guard lock(m_);
    spare_.push_back(std::move(b));
  }

  static constexpr std::size_t kQueued = 8;
  const bool beside_;
  DcpIndexBuilder* builder_ = nullptr;
  std::uint64_t batches_ = 0;  ///< the reader's
  std::mutex m_;
  std::condition_variable work_, room_, idle_;
  std::deque<Batch> queue_;
  std::vector<Batch> spare_;
  bool busy_ = false, closed_ = false;
  std::exception_ptr failed_;
  std::uint64_t beside_batches_ = 0;
};

class DirectReader {
 public:
  DirectReader(std::span<const std::byte> bytes, const std::string& source, Checkpoint& c,
               const std::function<void(std::uint64_t)>& release, BuilderFeed& feed)
      : p0_(reinterpret_cast<const std::uint8_t*>(bytes.data())), n_(bytes.size()), release_(release), c_(c), b_(source, c), feed_(feed) {
    feed_.attach(b_);
  }
  DirectReader(const DirectReader&) = delete;
  DirectReader& operator=(const DirectReader&) = delete;
  ~DirectReader() { feed_.close(); }  // the builder is b_: it stops before b_ goes

  const DirectReadStats& stats() {
    stats_.guessed = guessed_ + (guess_ ? memo_.size() : 0);
    stats_.guessed_below = guess_ ? memo_count_ : guess_limit_;
    stats_.batches = feed_.batches();
    stats_.batches_beside = feed_.batches_beside();
    return stats_;
  }

  void run(const pickle::IndexSet& referenced) {
    settle(referenced);
    run();
  }
  // NOTE [The first pass beside the reader]: the first pass (pickle::referenced_memo) tells
  // which memo indices a GET will want, so that only those are kept; it takes a quarter of the
  // reading's time. It can run on another thread while the reader starts without it, guessing:
  // every value a GET may share that needs nothing in the arena is kept (strs, globals, numbers,
  // None, the small objects of a TensorProperties or a memory format: what CPython's pickler GETs
  // in a .metadata), and nothing else. Once the first pass is done (`settled`, looked at every
  // kReleaseEvery bytes, or at `settle_at` in tests), the reader checks the guess (every index a
  // GET wants below the MEMOIZE count then must have been kept) and goes on with the exact answer
  // for the indices after. A GET of a value not kept, a PUT, or more kept than kGuessLimit before
  // that, and the guess was wrong: read_dcp_metadata_direct reads again with the answer from the
  // start. memo_slot() numbers the guessed tokens first, then the exact ones, in one memo_.
  static constexpr std::size_t kGuessLimit = std::size_t{1} << 19;  // tokens: 16 MiB
  void run_beside(const std::atomic<bool>& settled, const pickle::IndexSet& referenced, std::uint64_t settle_at) {
    settled_ = &settled;
    first_pass_ = &referenced;
    settle_at_ = settle_at;
    guess_ = true;
    guess_limit_ = ~std::uint64_t{0};
    guess_rank_.assign(1, 0);
    // Room for what guessing may keep, made once: pages are touched only as tokens are kept, and
    // no doubling copies the memo (or faults in its copies) as it grows.
    memo_.reserve(std::min<std::size_t>(kGuessLimit, n_ / 16 + 64));
    run();
  }

 private:
  // The first pass is done: checks the guess, and reads on with its answer.
  void settle(const pickle::IndexSet& referenced) {
    if (referenced.has_sparse()) decline();
    const auto& words = referenced.dense_words();
    if (guess_) {
      for (std::size_t w = 0; w < words.size() && (w << 6) < memo_count_; ++w) {
        const std::uint64_t below = memo_count_ - (w << 6) >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << (memo_count_ - (w << 6))) - 1;
        const std::uint64_t kept = w < kept_words_.size() ? kept_words_[w] : 0;
        if (words[w] & below & ~kept) reguess();  // a GET will want what was not kept
      }
      guess_ = false;
      guess_limit_ = memo_count_;
      guessed_ = memo_.size();
      cached_gets_ = {};
    }
    rank_.assign(words.size() + 1, 0);
    for (std::size_t w = 0; w < words.size(); ++w) rank_[w + 1] = rank_[w] + static_cast<std::uint32_t>(ones(words[w]));
    words_ = &words;
    memo_.resize(guessed_ + rank_.back(), Tok{Tag::kUnset});
    settled_ = nullptr;
  }
  bool settling(std::size_t i) const {
    return settled_ && (settle_at_ ? i >= settle_at_ : settled_->load(std::memory_order_acquire));
  }

  void run() {
    if (n_ == 0) decline();
    std::size_t i = 0;
    while (true) {
      if (settling(i)) settle(*first_pass_);
      // The pages behind are given back every kReleaseEvery bytes (read_dcp_metadata's release).
      std::size_t limit = std::min(n_, i + kReleaseEvery);
      if (settled_ && settle_at_ > i) limit = std::min<std::size_t>(limit, settle_at_);
      for (; i < limit;) {
        const std::uint8_t code = p0_[i++];
        if (code == op::kStop) [[unlikely]] {
          if (i != n_ || stack_.empty() || stack_.back().tag != Tag::kRoot) decline();
          return;
        }
        i = step(code, i);
      }
      if (i >= n_) decline();  // no STOP
      if (release_) release_(i);
    }
  }

  static constexpr std::size_t kReleaseEvery = std::size_t{1} << 20;

  // --- operands ---
  void need(std::size_t i, std::uint64_t bytes) const {
    if (bytes > n_ - i) decline();
  }
  std::string_view view(const Tok& s) const { return {reinterpret_cast<const char*>(p0_ + s.at), s.count}; }
  void push_str(std::size_t at, std::uint64_t len) {
    if (len > 0xffffffffu) decline();
    std::string_view s(reinterpret_cast<const char*>(p0_ + at), len);
    if (!pickle::valid_utf8(s)) decline();
    Tok& t = emplace(Tag::kStr);
    t.at = at;
    t.count = static_cast<std::uint32_t>(len);
  }

  // --- the stack ---
  // A new token on the stack, made in place (a token built elsewhere and copied in is read back
  // with other widths than it was written with, which stalls), needing no arena.
  [[gnu::always_inline]] Tok& emplace(Tag tag) {
    return stack_.emplace(tag);
  }
  [[gnu::always_inline]] void push(const Tok& t) {
    stack_.push(t);
  }
  std::size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  [[gnu::always_inline]] Tok pop() {
    if (stack_.size() <= fence()) decline();
    return stack_.pop();
  }
  [[gnu::always_inline]] Tok& top() {
    if (stack_.size() <= fence()) decline();
    return stack_.back();
  }
  void retop() {  // after the top token changed
    stack_.retop();
  }
  std::size_t pop_mark() {  // the stack index of the first item above the mark
    if (marks_.empty()) decline();
    const std::size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  // Gives back the arena's tail that nothing on the stack or in the memo needs.
  void collect() {
    const std::uint32_t keep = std::max(stack_.live(), pinned_);
    arena_.truncate(keep);
  }

  std::uint32_t arena_end() const {
    if (arena_.size() >= kMaxArena) decline();
    return static_cast<std::uint32_t>(arena_.size());
  }

  // Pops the stack down to `size`.
  void shrink(std::size_t size) {
    stack_.shrink(size);
  }
  // The depth a container of stack items [from, end) has.
  std::uint16_t deepest(std::size_t from) const {
    int d = 0;
    for (std::size_t k = from; k < stack_.size(); ++k) d = std::max<int>(d, stack_[k].depth + 1);
    if (d > kMaxDepth) decline();
    return static_cast<std::uint16_t>(d);
  }

  // --- containers ---
  static std::uint16_t deeper(std::uint16_t depth, const Tok& child) {
    const int d = std::max<int>(depth, child.depth + 1);
    if (d > kMaxDepth) decline();
    return static_cast<std::uint16_t>(d);
  }
  // A tuple of stack items [from, end of stack), which are popped.
  Tok make_tuple(std::size_t from) {
    Tok t;
    t.tag = Tag::kTuple;
    t.at = arena_.size();
    t.count = static_cast<std::uint32_t>(stack_.size() - from);
    t.depth = deepest(from);
    arena_.append(stack_.begin() + from, stack_.end());
    shrink(from);
    t.end = t.count ? arena_end() : 0;
    return t;
  }
  // Adds stack items [from, end of stack) to the list or dict below them, whose run moves to the
  // arena's end when it is not there already.
  void extend(std::size_t from) {
    const std::size_t added = stack_.size() - from;
    if (from == 0 || from <= fence()) decline();
    Tok& target = stack_[from - 1];
    if (added == 0) {
      shrink(from);
      return;
    }
    if (target.count != 0 && target.at + target.count != arena_.size()) {
      // The old run is left behind until the tail is given back: bounded, so that a pickle of
      // many small batches cannot make this quadratic (the tree reader then reads it).
      relocated_ += target.count;
      if (relocated_ > n_ / 8 + kBatch) decline();
      const std::size_t old = target.at;
      target.at = arena_.size();
      arena_.append_own(old, target.count);
    } else if (target.count == 0) {
      target.at = arena_.size();
    }
    target.depth = std::max(target.depth, deepest(from));
    arena_.append(stack_.begin() + from, stack_.end());
    target.count += static_cast<std::uint32_t>(added);
    target.end = arena_end();
    shrink(from);
    retop();
  }

  // --- the memo ---
  // A referenced index's place in memo_ (the referenced indices below it), or kNoSlot when no
  // GET wants that index.
  static constexpr std::size_t kNoSlot = ~std::size_t{0};
  [[gnu::always_inline]] std::size_t memo_slot(std::uint64_t index) const {
    if (index < guess_limit_) [[unlikely]] return slot_in(kept_words_, guess_rank_, index);  // guessed
    const std::size_t slot = slot_in(*words_, rank_, index);
    return slot == kNoSlot ? kNoSlot : guessed_ + slot;
  }
  static std::size_t slot_in(const std::vector<std::uint64_t>& words, const std::vector<std::uint32_t>& rank, std::uint64_t index) {
    const std::size_t w = static_cast<std::size_t>(index >> 6);
    if (w >= words.size()) return kNoSlot;
    const std::uint64_t word = words[w];
    const std::uint64_t bit = std::uint64_t{1} << (index & 63);
    if (!(word & bit)) return kNoSlot;
    return rank[w] + ones(word & (bit - 1));
  }
  // std::popcount is a library call on baseline x86-64 (no POPCNT instruction assumed).
  static std::size_t ones(std::uint64_t v) {
    v -= (v >> 1) & 0x5555555555555555u;
    v = (v & 0x3333333333333333u) + ((v >> 2) & 0x3333333333333333u);
    v = (v + (v >> 4)) & 0x0f0f0f0f0f0f0f0fu;
    return static_cast<std::size_t>((v * 0x0101010101010101u) >> 56);
  }
  [[gnu::always_inline]] void memo_put(std::uint64_t index) {
    if (stack_.size() <= fence()) decline();
    if (puts_) {
      if (set_.insert(index)) ++memo_count_;
    } else {
      ++memo_count_;  // MEMOIZE only so far: index == memo_count_, new
    }
    if (guess_) return guess_keep();
    if (const std::size_t slot = memo_slot(index); slot != kNoSlot) keep(slot);
  }
  // What a GET may share: values nothing changes after they are made.
  static bool shareable(Tag tag) {
    switch (tag) {
      case Tag::kNone: case Tag::kBool: case Tag::kInt: case Tag::kFloat: case Tag::kStr: case Tag::kBytes:
      case Tag::kGlobal: case Tag::kTuple: case Tag::kOther: case Tag::kSize: case Tag::kProps:
        return true;
      default: return false;
    }
  }
  // Guessing: what keep() would keep, when it needs no arena (index == memo_count_ - 1).
  [[gnu::noinline]] void guess_keep() {
    if (puts_) reguess();  // PUTs number the memo out of order
    Tok& t = stack_.back();
    if (!shareable(t.tag) || t.end != 0) return;  // not kept: a GET of it is a wrong guess
    const std::size_t slot = guess_slot(memo_count_ - 1);
    if (t.tag == Tag::kStr && t.flag == 0) {
      t.flag = 1;
      t.aux = slot;
    }
    memo_.push_back(t);
  }
  // Guessing: marks `index` (above every index kept so far) kept; its slot.
  std::size_t guess_slot(std::uint64_t index) {
    if (memo_.size() >= kGuessLimit) reguess();
    const std::size_t w = static_cast<std::size_t>(index >> 6);
    if (w >= kept_words_.size()) {
      kept_words_.resize(w + 1, 0);
      guess_rank_.resize(w + 1, static_cast<std::uint32_t>(memo_.size()));  // every kept index is in a word below
    }
    kept_words_[w] |= std::uint64_t{1} << (index & 63);
    return memo_.size();
  }
  [[gnu::noinline]] void keep(std::size_t slot) {
    // A PUT to an index a GET wants, again: a str's slot would name two strs (tree() shares strs
    // by slot). No pickler does it; the tree reader reads it.
    if (memo_[slot].tag != Tag::kUnset) decline();
    Tok& t = stack_.back();
    if (!shareable(t.tag)) decline();
    if (t.tag == Tag::kStr && t.flag == 0) {  // may be shared: tree() makes one node of it, by b
      t.flag = 1;
      t.aux = slot;
    }
    memo_[slot] = t;
    pinned_ = std::max(pinned_, t.end);
  }
  void first_put() {
    if (guess_) reguess();
    if (puts_) return;
    for (std::uint64_t k = 0; k < memo_count_; ++k) set_.insert(k);
    puts_ = true;
  }
  // A GET whose operands end at `next`: where the next opcode is.
  [[gnu::always_inline]] std::size_t memo_get(std::uint64_t index, std::size_t next) {
    const std::size_t slot = memo_slot(index);
    if (slot == kNoSlot && (guess_ || index < guess_limit_)) reguess();  // not kept, guessing
    if (slot == kNoSlot || memo_[slot].tag == Tag::kUnset) decline();
    const Tok t = memo_[slot];  // a copy: a glance may add to memo_
    if (t.tag == Tag::kGlobal && t.kind == GlobalKind::kDcpChunkStorageMetadata) [[unlikely]] {
      if (const std::size_t end = chunk_at(next)) return end;
    } else if (t.tag == Tag::kGlobal && (t.kind == GlobalKind::kDcpMetadataIndex || t.kind == GlobalKind::kDcpStorageInfo)) [[unlikely]] {
      if (const std::size_t end = object_at(next, t)) return end;
    }
    push(t);
    return next;
  }

  // --- globals and objects ---
  Tok global(std::string module, std::string name) {
    if (module.empty() || name.empty()) decline();
    pickle::ValuePtr g = pickle::make_global(std::move(module), std::move(name));
    const pickle::Global* gp = g->global();
    if (gp->kind == GlobalKind::kOpaque || pickle::runs_code(gp->module, gp->name)) decline();
    Tok t;
    t.tag = Tag::kGlobal;
    t.kind = gp->kind;
    t.at = globals_.size();
    globals_.push_back(std::move(g));
    return t;
  }
  const pickle::Global& global_of(const Tok& t) const { return *globals_[t.at]->global(); }
  const Tok& item(const Tok& seq, std::size_t k) const { return arena_[seq.at + k]; }

  void reduce() {
    Tok args = pop();
    Tok callable = pop();
    if (args.tag != Tag::kTuple || callable.tag != Tag::kGlobal) decline();
    Tok r;
    r.depth = deeper(deeper(0, callable), args);
    switch (callable.kind) {
      case GlobalKind::kTorchSize: {
        if (args.count != 1) decline();
        const Tok& seq = item(args, 0);
        if (seq.tag != Tag::kTuple && seq.tag != Tag::kList) decline();
        for (std::size_t k = 0; k < seq.count; ++k) {
          if (item(seq, k).tag != Tag::kInt) decline();
        }
        r.tag = Tag::kSize;
        r.at = seq.at;
        r.count = seq.count;
        r.end = seq.count ? static_cast<std::uint32_t>(seq.at + seq.count) : 0;
        break;
      }
      case GlobalKind::kBuiltinGetattr: {
        const bool member = args.count == 2 && item(args, 0).tag == Tag::kGlobal && item(args, 0).kind == GlobalKind::kDcpMemoryFormat &&
                            item(args, 1).tag == Tag::kStr && pickle::is_enum_member_name(view(item(args, 1)));
        if (!member) decline();
        r.tag = Tag::kOther;
        break;
      }
      case GlobalKind::kGetLayout:
      case GlobalKind::kDcpMemoryFormat:
      case GlobalKind::kPath:  // StorageMeta.checkpoint_id, as torch 2.4+ writes it
        r.tag = Tag::kOther;
        break;
      default: decline();
    }
    push(r);
    collect();
  }

  void newobj() {
    Tok args = pop();
    Tok cls = pop();
    if (args.tag != Tag::kTuple || args.count != 0 || cls.tag != Tag::kGlobal) decline();
    switch (cls.kind) {
      case GlobalKind::kDcpMetadata: case GlobalKind::kDcpTensorStorageMetadata: case GlobalKind::kDcpChunkStorageMetadata:
      case GlobalKind::kDcpBytesStorageMetadata: case GlobalKind::kDcpTensorProperties: case GlobalKind::kDcpStorageMeta:
      case GlobalKind::kDcpMetadataIndex: case GlobalKind::kDcpStorageInfo:
        break;
      default: decline();
    }
    Tok o;
    o.tag = Tag::kObject;
    o.kind = cls.kind;
    o.at = cls.at;
    o.depth = deeper(deeper(0, cls), args);
    push(o);
  }

  // The fields BUILD gave an object: a dict with str keys, where the first of a name counts, as in
  // the tree reader. Field names are nearly always one memoized str that every object GETs: a key
  // at the offset where `name` matched last time is `name` without comparing bytes.
  struct Name {
    std::string_view text;
    std::uint64_t at = 0;  ///< where a str with this text was last found (0: not yet)
  };
  // Whether `key` is the str `name` (a glance asks too).
  bool named(const Tok& key, Name& name) const {
    if (key.tag != Tag::kStr) return false;
    if ((key.at == name.at && name.at != 0) || view(key) == name.text) {
      name.at = key.at;
      return true;
    }
    return false;
  }
  // A dict's pairs (key, value, ...): its run in the arena, or the values a glance read.
  struct Pairs {
    const Tok* p;
    std::size_t n;
  };
  Pairs pairs(const Tok& dict) const { return {dict.count ? &item(dict, 0) : nullptr, dict.count}; }
  const Tok* field(Pairs dict, Name& name) const {
    for (std::size_t k = 0; k < dict.n; k += 2) {
      if (named(dict.p[k], name)) return &dict.p[k + 1];
    }
    return nullptr;
  }
  const Tok* field(const Tok& dict, Name& name) const { return field(pairs(dict), name); }
  const Tok& need_field(Pairs dict, Name& name) const {
    const Tok* f = field(dict, name);
    if (!f) decline();
    return *f;
  }
  const Tok& need_field(const Tok& dict, Name& name) const { return need_field(pairs(dict), name); }
  static bool seq(const Tok& t) { return t.tag == Tag::kTuple || t.tag == Tag::kList; }
  static void check_keys(Pairs dict) {
    for (std::size_t k = 0; k < dict.n; k += 2) {
      if (dict.p[k].tag != Tag::kStr) decline();
    }
  }
  void check_fields(const Tok& state) const {
    if (state.tag != Tag::kDict) decline();
    check_keys(pairs(state));
  }
  // A torch.Size or a plain sequence of non-negative ints: where its ints are, and how many.
  std::pair<std::uint64_t, std::uint32_t> dims(const Tok& t) const {
    if (t.tag != Tag::kSize && !seq(t)) decline();
    for (std::size_t k = 0; k < t.count; ++k) {
      const Tok& v = item(t, k);
      if (v.tag != Tag::kInt || static_cast<std::int64_t>(v.at) < 0) decline();
    }
    return {t.at, t.count};
  }
  Dims dims_value(std::uint64_t at, std::uint32_t n) const {
    Dims d;
    for (std::uint32_t k = 0; k < n; ++k) d.push_back(static_cast<std::int64_t>(arena_[at + k].at));
    return d;
  }
  std::int64_t nonneg(const Tok& t) const {
    if (t.tag != Tag::kInt || static_cast<std::int64_t>(t.at) < 0) decline();
    return static_cast<std::int64_t>(t.at);
  }

  // storage_data's two classes, from their state's pairs (build() gives a dict's run in the arena;
  // object_at() the values it read, NOTE [An object at a glance]); depth is the caller's.
  Tok metadata_index(Pairs state) const {
    const Tok& fqn = need_field(state, names_.fqn);
    if (fqn.tag != Tag::kStr) decline();
    Tok r;
    r.tag = Tag::kIndex;
    r.at = fqn.at;
    r.count = fqn.count;
    r.flag = kNoOffsets;
    if (const Tok* off = field(state, names_.offset); off && off->tag != Tag::kNone) {
      const auto [at, rank] = dims(*off);
      r.aux = at;
      r.flag = rank;
      r.end = rank ? static_cast<std::uint32_t>(at + rank) : 0;
    }
    return r;
  }
  Tok storage_info(Pairs state) {
    const Tok& path = need_field(state, names_.relative_path);
    if (path.tag != Tag::kStr) decline();
    const auto off = static_cast<std::uint64_t>(nonneg(need_field(state, names_.offset)));
    const auto len = static_cast<std::uint64_t>(nonneg(need_field(state, names_.length)));
    if (off + len < off) decline();
    Tok r;
    r.tag = Tag::kInfo;
    // Its file is looked up now: _StorageInfo objects are built in the order of their pairs,
    // so files are numbered as the tree reader numbers them (root() checks they were all taken).
    r.count = b_.file_index(view(path), 0);
    r.at = off;
    r.aux = len;
    ++infos_;
    if (const Tok* td = field(state, names_.transform_descriptors); td && td->tag != Tag::kNone) {
      if (!seq(*td)) decline();
      std::vector<std::string> list;
      for (std::size_t k = 0; k < td->count; ++k) {
        if (item(*td, k).tag != Tag::kStr) decline();
        list.emplace_back(view(item(*td, k)));
      }
      if (!list.empty()) {
        if (transforms_.empty() || transforms_.back() != list) transforms_.push_back(std::move(list));
        r.flag = static_cast<std::uint32_t>(transforms_.size());
      }
    }
    return r;
  }

  void build() {
    Tok state = pop();
    Tok& o = top();
    if (o.tag != Tag::kObject || o.aux != 0) decline();
    const std::uint16_t depth = deeper(o.depth, state);
    Tok r;
    r.depth = depth;
    switch (o.kind) {
      case GlobalKind::kDcpChunkStorageMetadata: {
        check_fields(state);
        const auto [off, rank] = dims(need_field(state, names_.offsets));
        const auto [sz, rank2] = dims(need_field(state, names_.sizes));
        if (rank != rank2) decline();
        ++stats_.chunks_by_opcode;
        r.tag = Tag::kChunk;
        r.at = off;
        r.aux = sz;
        r.count = rank;
        r.end = rank ? static_cast<std::uint32_t>(std::max(off, sz) + rank) : 0;
        break;
      }
      case GlobalKind::kDcpTensorStorageMetadata: {
        check_fields(state);
        const Tok& props = need_field(state, names_.properties);
        if (props.tag != Tag::kProps) decline();
        const auto [shape_at, rank] = dims(need_field(state, names_.size));
        const Tok& chunks = need_field(state, names_.chunks);
        if (!seq(chunks)) decline();
        TensorEntry t;
        t.dtype = static_cast<DType>(props.at);
        t.requires_grad = props.aux != 0;
        t.shape = dims_value(shape_at, rank);
        t.chunks.reserve(chunks.count);
        for (std::size_t k = 0; k < chunks.count; ++k) {
          const Tok& ch = item(chunks, k);
          if (ch.tag != Tag::kChunk) decline();
          Chunk chunk;
          chunk.offsets = dims_value(ch.at, ch.count);
          chunk.sizes = dims_value(ch.aux, ch.count);
          if (!chunk_problem(std::string(), t.shape, chunk).empty()) decline();
          t.chunks.push_back(std::move(chunk));
        }
        r.tag = Tag::kTensor;
        r.at = tensors_.size();
        tensors_.push_back(std::move(t));
        ++tensors_live_;
        break;
      }
      case GlobalKind::kDcpTensorProperties: {
        const Tok* dtype = nullptr;
        const Tok* rg = nullptr;
        if (seq(state) && state.count >= 3) {  // __getstate__: (dtype, layout, requires_grad, ...)
          dtype = &item(state, 0);
          rg = &item(state, 2);
        } else {
          check_fields(state);
          dtype = &need_field(state, names_.dtype);
          rg = field(state, names_.requires_grad);
        }
        if (dtype->tag != Tag::kGlobal || dtype->kind != GlobalKind::kDType) decline();
        const auto d = dtype_from_torch_name(global_of(*dtype).name);
        if (!d) decline();
        r.tag = Tag::kProps;
        r.at = static_cast<std::uint64_t>(*d);
        r.aux = rg && rg->tag == Tag::kBool ? rg->at : 0;
        break;
      }
      case GlobalKind::kDcpMetadataIndex:
        check_fields(state);
        r = metadata_index(pairs(state));
        r.depth = depth;
        break;
      case GlobalKind::kDcpStorageInfo:
        check_fields(state);
        r = storage_info(pairs(state));
        r.depth = depth;
        break;
      case GlobalKind::kDcpBytesStorageMetadata:
        // Its state is not read (it has no fields); it stays an object, now built.
        o.aux = 1;
        o.depth = depth;
        retop();
        return collect();
      case GlobalKind::kDcpStorageMeta:
        r.tag = Tag::kOther;
        break;
      case GlobalKind::kDcpMetadata:
        r = root(o, state);
        r.depth = depth;
        break;
      default: decline();
    }
    o = r;
    retop();
    collect();
  }

  // --- a chunk at a glance ---
  // NOTE [A chunk at a glance]: nearly every opcode of a large .metadata belongs to a
  // ChunkStorageMetadata, and CPython's pickler writes each one the same way:
  //   GET cls  EMPTY_TUPLE NEWOBJ MEMOIZE  EMPTY_DICT MEMOIZE MARK
  //     GET 'offsets'  GET torch.Size  ints TUPLEk MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE
  //     GET 'sizes'    GET torch.Size  ints TUPLEk MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE
  //   SETITEMS BUILD
  // with 1 to 3 ints (BININT1, BININT2 or a non-negative BININT) each. When the bytes after the
  // class's GET are exactly that, and no GET wants any of the eight memo indices it makes, the
  // chunk is read in one go and left as the opcodes would leave it: the same token on the stack,
  // the same ints in the arena, the same memo count and dict number. Anything else (another
  // protocol's PUTs, a FRAME in between, 4-d and 0-d chunks, a shared value) is run opcode by
  // opcode. tests/unit/ckpt/test_formats_dcp.cpp counts both and compares the indexes.
  const Tok* got(std::size_t& i) const {  // the memo token a GET at i gives (i moves past it), or null
    std::uint64_t index = 0;
    if (i + 2 <= n_ && p0_[i] == op::kBinGet) {
      index = p0_[i + 1];
      i += 2;
    } else if (i + 5 <= n_ && p0_[i] == op::kLongBinGet) {
      index = operand<4>(i + 1);
      i += 5;
    } else {
      return nullptr;
    }
    // A glance GETs the same few indices (a class, field names, torch.Size) again and again: their
    // slots are remembered, 16 ways by the index's low bits (a slot depends only on the index).
    CachedGet& way = cached_gets_[index & 15];
    if (way.index != index) way = CachedGet{index, memo_slot(index)};
    return way.slot == kNoSlot || memo_[way.slot].tag == Tag::kUnset ? nullptr : &memo_[way.slot];
  }
  struct CachedGet {
    std::uint64_t index = ~std::uint64_t{0};
    std::size_t slot = kNoSlot;
  };
  mutable std::array<CachedGet, 16> cached_gets_{};
  template <std::size_t N>
  bool run_at(std::size_t i, const std::uint8_t (&run)[N]) const {
    return pickle::run_at(p0_, i, n_, run);
  }
  // Whether a GET wants any memo index in [first, first + count), count <= 64.
  // (Guessing, words_ is empty: nothing a glance makes is kept, and a GET of it is a wrong guess.)
  bool referenced(std::uint64_t first, std::uint64_t count) const {
    for (std::uint64_t w = first >> 6; w <= (first + count - 1) >> 6 && w < words_->size(); ++w) {
      const std::uint64_t lo = std::max(first, w << 6) - (w << 6);
      const std::uint64_t hi = std::min(first + count, (w + 1) << 6) - (w << 6);  // 1..64
      const std::uint64_t bits = (hi == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << hi) - 1) & ~((std::uint64_t{1} << lo) - 1);
      if ((*words_)[w] & bits) return true;
    }
    return false;
  }
  // The opcodes around an object's flat state, and after a Size's ints (pickle/memo_scan.hpp).
  static constexpr const auto& kHead = pickle::kObjectHead;
  static constexpr const auto& kEnd = pickle::kObjectEnd;
  // A torch.Size after its GET at i, as CPython writes one: 1 to 3 non-negative ints (BININT1,
  // BININT2, BININT), TUPLEk MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE. Its ints go to v; returns
  // how many (i moves past it), or 0 for anything else.
  std::uint32_t size_at(std::size_t& i, std::int64_t (&v)[3]) const {
    static constexpr const auto& kTail = pickle::kSizeTail;
    static constexpr std::uint8_t kTupleOf[] = {0, op::kTuple1, op::kTuple2, op::kTuple3};
    std::size_t at = i;
    std::uint32_t k = 0;
    for (; k < 3 && n_ - at >= 5; ++k) {  // the shortest tail after an int is 5 bytes
      const std::uint8_t code = p0_[at];
      if (code == op::kBinInt1) {
        v[k] = p0_[at + 1];
        at += 2;
      } else if (code == op::kBinInt2) {
        v[k] = static_cast<std::int64_t>(operand<2>(at + 1));
        at += 3;
      } else if (code == op::kBinInt) {
        v[k] = static_cast<std::int32_t>(operand<4>(at + 1));
        if (v[k] < 0) return 0;
        at += 5;
      } else {
        break;
      }
    }
    if (k == 0 || at >= n_ || p0_[at] != kTupleOf[k] || !run_at(at + 1, kTail)) return 0;
    i = at + 1 + sizeof kTail;
    return k;
  }
  std::size_t chunk_at(std::size_t i) {
    if (puts_ || !run_at(i, kHead)) return 0;
    i += sizeof kHead;
    std::int64_t v[2][3];
    std::uint32_t rank[2] = {0, 0};
    for (std::uint32_t f = 0; f < 2; ++f) {
      const Tok* key = got(i);
      if (!key || !named(*key, f == 0 ? names_.offsets : names_.sizes)) return 0;
      const Tok* size = got(i);
      if (!size || size->tag != Tag::kGlobal || size->kind != GlobalKind::kTorchSize) return 0;
      rank[f] = size_at(i, v[f]);
      if (rank[f] == 0) return 0;
    }
    if (rank[0] != rank[1] || !run_at(i, kEnd) || referenced(memo_count_, 8)) return 0;
    i += sizeof kEnd;
    memo_count_ += 8;
    ++dicts_;
    const std::uint32_t k = rank[0];
    const std::uint32_t a0 = arena_end();
    arena_.append_ints(v[0], k);
    arena_.append_ints(v[1], k);
    Tok& r = emplace(Tag::kChunk);
    r.depth = 5;  // the object (1) built with a dict (4) of str keys and Sizes (3): as build() counts it
    r.at = a0;
    r.aux = a0 + k;
    r.count = k;
    r.end = arena_end();
    retop();
    ++stats_.chunks_at_a_glance;
    return i;
  }

  // NOTE [An object at a glance]: storage_data's pairs, a MetadataIndex and a _StorageInfo, are
  // the rest of a large .metadata. Each is an object built from a flat dict of simple values:
  //   GET cls  EMPTY_TUPLE NEWOBJ MEMOIZE  EMPTY_DICT MEMOIZE MARK  (key value)...  SETITEMS BUILD
  // where each key or value is a GET, a str (SHORT_BINUNICODE, then MEMOIZE or not), an int
  // (BININT1, BININT2, BININT, LONG1), None, or at most one torch.Size of 1 to 3 ints as
  // chunk_at reads it. When the bytes are that, the values are read into a small array without
  // dispatching opcode by opcode, the memo gets what the MEMOIZEs would have given it (a str a
  // GET wants is kept; any other value a GET wants sends the object back to the opcodes), the
  // Size's ints and then the dict's run go to the arena where the opcodes would put them, and
  // build() reads the object from there as it reads any other.
  std::size_t object_at(std::size_t i, const Tok cls) {
    static constexpr std::size_t kMaxValues = 8;
    if (puts_ || !run_at(i, kHead) || referenced(memo_count_, 2)) return 0;
    i += sizeof kHead;
    std::uint64_t memo = memo_count_ + 2;  // the index the next MEMOIZE gives
    union Values {  // not zeroed first: each value is made whole where it is read
      Values() {}
      Tok at[kMaxValues];
    } storage;
    Tok* const values = storage.at;
    std::size_t n = 0;
    struct Kept {
      std::uint64_t index;
      std::size_t value;
    } kept[kMaxValues];  // strs a GET wants (every memoized one, guessing)
    std::size_t n_kept = 0;
    std::int64_t ints[3];
    std::uint32_t rank = 0;
    std::size_t size_value = kMaxValues;  // which value is the Size, if one is
    while (true) {
      if (i >= n_) return 0;
      const std::uint8_t code = p0_[i];
      if (code == op::kSetItems) break;
      if (n == kMaxValues) return 0;
      Tok& t = values[n];
      t = Tok{};
      switch (code) {
        case op::kBinGet:
        case op::kLongBinGet: {
          const Tok* g = got(i);
          if (!g) return 0;
          if (g->tag != Tag::kGlobal || g->kind != GlobalKind::kTorchSize) {
            t = *g;
            break;
          }
          if (size_value != kMaxValues) return 0;
          rank = size_at(i, ints);
          if (rank == 0 || referenced(memo, 3)) return 0;
          memo += 3;
          size_value = n;
          t.tag = Tag::kSize;
          t.count = rank;
          t.depth = 3;  // as reduce() counts a Size of a tuple of ints
          break;
        }
        case op::kShortBinUnicode: {
          if (n_ - i < 2) return 0;
          const std::size_t len = p0_[i + 1];
          if (len > n_ - i - 2 || !pickle::valid_utf8({reinterpret_cast<const char*>(p0_ + i + 2), len})) return 0;
          t.tag = Tag::kStr;
          t.at = i + 2;
          t.count = static_cast<std::uint32_t>(len);
          i += 2 + len;
          if (i < n_ && p0_[i] == op::kMemoize) {
            ++i;
            if (guess_ || memo_slot(memo) != kNoSlot) kept[n_kept++] = {memo, n};
            ++memo;
          }
          break;
        }
        case op::kBinInt1:
          if (n_ - i < 2) return 0;
          t.tag = Tag::kInt;
          t.at = p0_[i + 1];
          i += 2;
          break;
        case op::kBinInt2:
          if (n_ - i < 3) return 0;
          t.tag = Tag::kInt;
          t.at = operand<2>(i + 1);
          i += 3;
          break;
        case op::kBinInt:
          if (n_ - i < 5) return 0;
          t.tag = Tag::kInt;
          t.at = static_cast<std::uint64_t>(static_cast<std::int64_t>(static_cast<std::int32_t>(operand<4>(i + 1))));
          i += 5;
          break;
        case op::kLong1: {
          if (n_ - i < 2 || p0_[i + 1] > n_ - i - 2) return 0;
          const pickle::Int v = pickle::decode_long(std::span(reinterpret_cast<const std::byte*>(p0_ + i + 2), p0_[i + 1]));
          if (!v.fits_int64()) return 0;
          t.tag = Tag::kInt;
          t.at = static_cast<std::uint64_t>(v.value);
          i += 2 + p0_[i + 1];
          break;
        }
        case op::kNone:
          t.tag = Tag::kNone;
          ++i;
          break;
        default:
          return 0;
      }
      ++n;
    }
    if (n == 0 || n % 2 != 0 || !run_at(i, kEnd)) return 0;
    i += sizeof kEnd;
    // What the opcodes would have left: the memo and its count, the dict's number, the object
    // on the stack, the Size's ints in the arena and the dict's items after them.
    for (std::size_t k = 0; k < n_kept; ++k) {  // as keep() and guess_keep() mark and keep a str
      Tok& t = values[kept[k].value];
      t.flag = 1;
      if (guess_) {
        t.aux = guess_slot(kept[k].index);
        memo_.push_back(t);
      } else {
        t.aux = memo_slot(kept[k].index);
        memo_[t.aux] = t;
      }
    }
    memo_count_ = memo;
    if (size_value != kMaxValues) {
      Tok& size = values[size_value];
      size.at = arena_end();
      arena_.append_ints(ints, rank);
      size.end = arena_end();
    }
    // build() without the object and its dict on the stack, or the dict's run in the arena:
    // the same checks, the same token, and the same dict number taken.
    Tok state;
    state.tag = Tag::kDict;
    for (std::size_t k = 0; k < n; ++k) state.depth = std::max(state.depth, deeper(0, values[k]));
    ++dicts_;
    const Pairs pairs{values, n};
    check_keys(pairs);
    Tok r = cls.kind == GlobalKind::kDcpMetadataIndex ? metadata_index(pairs) : storage_info(pairs);
    r.depth = deeper(1, state);  // the object's: newobj() counts 1 for a class with an empty tuple
    push(r);
    collect();
    ++stats_.objects_at_a_glance;
    return i;
  }

  // --- the two big dicts ---
  // SETITEM(S): pairs of state_dict_metadata (str, TensorStorageMetadata or BytesStorageMetadata)
  // and of storage_data (MetadataIndex, _StorageInfo) go to the builder, in order; other pairs are
  // kept in their dict. A dict gets one kind or the other, never both, never kept pairs besides.
  void set_items(std::size_t from) {
    if ((stack_.size() - from) % 2 != 0 || from == 0 || from <= fence()) decline();
    Tok& d = stack_[from - 1];
    if (d.tag != Tag::kDict) decline();
    if (from == stack_.size()) return extend(from);
    const Tok& k0 = stack_[from];
    const bool entries = k0.tag == Tag::kStr && (stack_[from + 1].tag == Tag::kTensor || stack_[from + 1].tag == Tag::kObject);
    const bool storage = k0.tag == Tag::kIndex;
    if (!entries && !storage) {
      if (d.flag == kPaths) return take_paths(from);
      if (d.flag != kKept) decline();
      extend(from);
      // A big dict of key paths (planner_data: one per entry) is made into its trees as it comes,
      // instead of being moved to the arena's end whole at each batch.
      if (d.count >= 2 * kBatch && path_like(d.at, d.count)) {
        if (paths_dict_ != 0) decline();
        paths_dict_ = d.aux;
        d.flag = kPaths;
        for (std::size_t k = 0; k < d.count; k += 2) set_path(paths_, item(d, k), item(d, k + 1));
        d.count = 0;
        d.end = 0;
        retop();
        collect();
      }
      return;
    }
    if (d.count != 0) decline();
    std::uint64_t& owner = entries ? sdm_dict_ : storage_dict_;
    const std::uint32_t use = entries ? kEntries : kStorage;
    if (d.flag == kKept) d.flag = use;
    if (d.flag != use) decline();
    if (owner == 0) owner = d.aux;
    if (owner != d.aux) decline();
    // To the builder, a batch at a time (NOTE [The builder beside the reader]).
    BuilderFeed::Batch batch = feed_.take();
    for (std::size_t k = from; k < stack_.size(); k += 2) {
      const Tok& key = stack_[k];
      const Tok& value = stack_[k + 1];
      if (entries) {
        if (key.tag != Tag::kStr) decline();
        if (value.tag == Tag::kTensor) {
          BuilderFeed::Entry& e = batch.entries.emplace_back(BuilderFeed::Entry{std::move(tensors_[value.at])});
          e.t.name = view(key);
          --tensors_live_;
        } else if (value.tag == Tag::kObject && value.kind == GlobalKind::kDcpBytesStorageMetadata) {
          BuilderFeed::Entry& e = batch.entries.emplace_back();
          e.t.name = view(key);
          e.bytes = true;
        } else {
          decline();
        }
      } else {
        if (key.tag != Tag::kIndex || value.tag != Tag::kInfo) decline();
        BuilderFeed::Storage& st = batch.storage.emplace_back();
        st.fqn = view(key);
        st.tensor = key.flag != kNoOffsets;
        if (st.tensor) st.offsets = dims_value(key.aux, key.flag);
        st.loc.encoding = ChunkEncoding::kItem;
        st.loc.file = value.count;
        st.loc.offset = value.at;
        st.loc.length = value.aux;
        --infos_;
        if (value.flag) st.loc.layout = b_.layout(transforms_[value.flag - 1]);
      }
    }
    feed_.hand_over(std::move(batch));
    shrink(from);
    if (tensors_live_ == 0) tensors_.clear();
    collect();
  }

  // What a dict's pairs went to (Tok::x of a kDict).
  static constexpr std::uint32_t kKept = 0;     ///< its own run in the arena
  static constexpr std::uint32_t kEntries = 1;  ///< the builder, as state_dict_metadata
  static constexpr std::uint32_t kStorage = 2;  ///< the builder, as storage_data
  static constexpr std::uint32_t kPaths = 3;    ///< paths_, as planner_data
  static constexpr std::size_t kBatch = 1000;     ///< CPython's pickler adds items 1,000 at a time
  // A planner_data pair: a str key and a path of strs and ints.
  bool path_pair(const Tok& key, const Tok& value) const {
    if (key.tag != Tag::kStr || !seq(value)) return false;
    for (std::size_t j = 0; j < value.count; ++j) {
      const Tag t = item(value, j).tag;
      if (t != Tag::kStr && t != Tag::kInt) return false;
    }
    return true;
  }
  bool path_like(std::uint64_t at, std::size_t n) const {
    for (std::size_t k = 0; k < n; k += 2) {
      if (!path_pair(arena_[at + k], arena_[at + k + 1])) return false;
    }
    return true;
  }
  void take_paths(std::size_t from) {
    for (std::size_t k = from; k < stack_.size(); k += 2) {
      if (!path_pair(stack_[k], stack_[k + 1])) decline();
      set_path(paths_, stack_[k], stack_[k + 1]);
    }
    shrink(from);
    collect();
  }

  // --- Metadata ---
  Tok root(const Tok& o, const Tok& state) {
    if (root_done_) decline();
    root_done_ = true;
    feed_.drain();  // the builder's Checkpoint members are the reader's again
    check_fields(state);
    static constexpr std::string_view kKnown[] = {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"};
    for (std::size_t k = 0; k < state.count; k += 2) {
      const std::string_view name = view(item(state, k));
      if (std::find(std::begin(kKnown), std::end(kKnown), name) == std::end(kKnown)) {
        c_.notes.push_back("Metadata has extra attribute '" + std::string(name) + "'");
      }
    }
    const Tok* version = field(state, names_.version);
    const std::string version_text = version && version->tag == Tag::kStr ? std::string(view(*version)) : std::string();
    b_.set_writer(global_of(o).module, field(state, names_.storage_meta) != nullptr, version && version->tag == Tag::kStr ? &version_text : nullptr);
    const Tok& sdm = need_field(state, names_.state_dict_metadata);
    const Tok& sd = need_field(state, names_.storage_data);
    // Both read whole, each from the dict its pairs came from (an empty dict gave none).
    // A dict whose pairs went elsewhere (paths_, the other builder call) is not whole.
    auto whole = [](const Tok& d, std::uint64_t owner, std::uint32_t kind) {
      return d.tag == Tag::kDict && d.count == 0 && ((owner == 0 && d.flag == kKept) || (owner == d.aux && d.flag == kind));
    };
    if (!whole(sdm, sdm_dict_, kEntries) || !whole(sd, storage_dict_, kStorage)) decline();
    if (infos_ != 0) decline();  // a _StorageInfo outside storage_data numbered a file
    b_.finish();
    if (const Tok* pd = field(state, names_.planner_data); pd && pd->tag != Tag::kNone) {
      if (pd->tag != Tag::kDict) decline();
      if (pd->flag == kPaths) {
        if (pd->aux != paths_dict_) decline();
        c_.planner_data = std::move(paths_);  // the last pair of a key counts, as in the tree reader
      }
      for (std::size_t k = 0; k < pd->count; k += 2) {
        const Tok& key = item(*pd, k);
        if (key.tag == Tag::kStr) set_path(c_.planner_data, key, item(*pd, k + 1));
      }
    }
    Tok r;
    r.tag = Tag::kRoot;
    return r;
  }
  // A planner_data pair into `paths`: compact straight from its tokens when its keys spell the FQN
  // (every path flatten_state_dict makes), without making the tree KeyPaths would drop; else
  // as its tree.
  void set_path(KeyPaths& paths, const Tok& key, const Tok& value) {
    const std::string_view fqn = view(key);
    if (value.tag == Tag::kTuple && value.count >= 1 && value.count <= 16) {
      KeyPaths::Key keys[16];
      char numbers[16][24];  // the int keys' texts
      bool ok = true;
      for (std::size_t j = 0; ok && j < value.count; ++j) {
        const Tok& k = item(value, j);
        if (k.tag == Tag::kStr) {
          keys[j] = {view(k), false};
        } else if (k.tag == Tag::kInt) {
          const auto r = std::to_chars(numbers[j], numbers[j] + sizeof numbers[j], static_cast<std::int64_t>(k.at));
          keys[j] = {std::string_view(numbers[j], static_cast<std::size_t>(r.ptr - numbers[j])), true};
        } else {
          ok = false;
        }
      }
      if (ok && paths.set_spelled(fqn, std::span<const KeyPaths::Key>(keys, value.count))) return;
    }
    paths.set(fqn, tree(value, 0));
  }
  // A planner_data value as the unpickler's tree: strs, ints and the tuples and lists of them.
  // A str or tuple a GET shared is one node, as in the tree reader.
  pickle::ValuePtr tree(const Tok& t, int depth) {
    if (depth > 64) decline();
    switch (t.tag) {
      case Tag::kNone: return pickle::make_none();
      case Tag::kBool: return pickle::make_bool(t.at != 0);
      case Tag::kInt: return pickle::make_int(static_cast<std::int64_t>(t.at));
      case Tag::kStr: {
        if (t.flag == 0) return pickle::make_str(std::string(view(t)));
        if (t.aux >= shared_strs_.size()) shared_strs_.resize(memo_.size());  // memo_ grows while guessing
        pickle::ValuePtr& v = shared_strs_[t.aux];
        if (!v) v = pickle::make_str(std::string(view(t)));
        return v;
      }
      case Tag::kTuple:
      case Tag::kList: {
        pickle::ValuePtr* cached = nullptr;
        // Only a GET shares a tuple, and the memo pins what it holds: its place is its own for good.
        if (t.tag == Tag::kTuple && t.count != 0 && t.end <= pinned_) {
          cached = &shared_tuples_[t.at];
          if (*cached) return *cached;
        }
        std::vector<pickle::ValuePtr> items;
        items.reserve(t.count);
        for (std::size_t k = 0; k < t.count; ++k) items.push_back(tree(item(t, k), depth + 1));
        pickle::ValuePtr v = t.tag == Tag::kTuple ? pickle::make_tuple(std::move(items)) : pickle::make_list(std::move(items));
        if (cached) *cached = v;
        return v;
      }
      default: decline();
    }
  }

  // What step() does with each opcode byte, as a dense number: a switch on it is one jump table
  // (a switch on the opcode bytes themselves compiled to a chain of compares).
  enum Action : std::uint8_t {
    kRefuse, kStopOp, kProtoOp, kFrameOp, kMarkOp, kEmptyTupleOp, kTuple1Op, kTuple2Op, kTuple3Op, kTupleOp, kEmptyListOp,
    kEmptyDictOp, kAppendOp, kAppendsOp, kSetItemOp, kSetItemsOp, kNoneOp, kTrueOp, kFalseOp, kInt1Op, kInt2Op, kInt4Op,
    kLong1Op, kLong4Op, kFloatOp, kStr1Op, kStr4Op, kStr8Op, kBytes1Op, kBytes4Op, kBytes8Op, kGlobalOp, kStackGlobalOp,
    kReduceOp, kNewObjOp, kBuildOp, kPut1Op, kPut4Op, kMemoizeOp, kGet1Op, kGet4Op,
  };
  static constexpr std::array<std::uint8_t, 256> kActionOf = [] {
    std::array<std::uint8_t, 256> t{};  // kRefuse: every other opcode is the tree reader's to accept or refuse
    t[op::kStop] = kStopOp, t[op::kProto] = kProtoOp, t[op::kFrame] = kFrameOp, t[op::kMark] = kMarkOp;
    t[op::kEmptyTuple] = kEmptyTupleOp, t[op::kTuple1] = kTuple1Op, t[op::kTuple2] = kTuple2Op, t[op::kTuple3] = kTuple3Op;
    t[op::kTuple] = kTupleOp, t[op::kEmptyList] = kEmptyListOp, t[op::kEmptyDict] = kEmptyDictOp, t[op::kAppend] = kAppendOp;
    t[op::kAppends] = kAppendsOp, t[op::kSetItem] = kSetItemOp, t[op::kSetItems] = kSetItemsOp, t[op::kNone] = kNoneOp;
    t[op::kNewTrue] = kTrueOp, t[op::kNewFalse] = kFalseOp, t[op::kBinInt1] = kInt1Op, t[op::kBinInt2] = kInt2Op;
    t[op::kBinInt] = kInt4Op, t[op::kLong1] = kLong1Op, t[op::kLong4] = kLong4Op, t[op::kBinFloat] = kFloatOp;
    t[op::kShortBinUnicode] = kStr1Op, t[op::kShortBinString] = kStr1Op, t[op::kBinUnicode] = kStr4Op, t[op::kBinUnicode8] = kStr8Op;
    t[op::kShortBinBytes] = kBytes1Op, t[op::kBinBytes] = kBytes4Op, t[op::kBinBytes8] = kBytes8Op, t[op::kGlobal] = kGlobalOp;
    t[op::kStackGlobal] = kStackGlobalOp, t[op::kReduce] = kReduceOp, t[op::kNewObj] = kNewObjOp, t[op::kBuild] = kBuildOp;
    t[op::kBinPut] = kPut1Op, t[op::kLongBinPut] = kPut4Op, t[op::kMemoize] = kMemoizeOp, t[op::kBinGet] = kGet1Op;
    t[op::kLongBinGet] = kGet4Op;
    return t;
  }();

  template <int kWidth>
  std::uint64_t operand(std::size_t at) const {
    need(at, kWidth);
    std::uint64_t v = 0;
    for (int k = kWidth - 1; k >= 0; --k) v = (v << 8) | p0_[at + static_cast<std::size_t>(k)];
    return v;
  }
  // A str or bytes opcode with a kWidth-byte length: where its bytes end.
  template <int kWidth>
  std::size_t text(std::size_t i, bool str) {
    const std::uint64_t len = operand<kWidth>(i);
    i += kWidth;
    need(i, len);
    if (str) {
      push_str(i, len);  // SHORT_BINSTRING bytes that are not UTF-8 become latin-1 text in the tree reader: declined
    } else {
      emplace(Tag::kBytes).at = i;
    }
    return i + static_cast<std::size_t>(len);
  }
  template <int kWidth>
  std::size_t long_int(std::size_t i) {
    const std::uint64_t len = operand<kWidth>(i);
    i += kWidth;
    if (len > 0x7fffffffu) decline();
    need(i, len);
    const pickle::Int v = pickle::decode_long(std::span(reinterpret_cast<const std::byte*>(p0_ + i), len));
    if (!v.fits_int64()) decline();
    emplace(Tag::kInt).at = static_cast<std::uint64_t>(v.value);
    return i + static_cast<std::size_t>(len);
  }
  std::size_t tuple_of(std::size_t k, std::size_t i) {
    if (stack_.size() < fence() + k) decline();
    push(make_tuple(stack_.size() - k));
    return i;
  }

  // Runs the opcode at i - 1 (its operands from i); returns where the next one is.
  [[gnu::always_inline]] std::size_t step(std::uint8_t code, std::size_t i) {
    switch (kActionOf[code]) {
      case kProtoOp:
        if (operand<1>(i) > 5) decline();
        return i + 1;
      case kFrameOp:
        need(i + 8, operand<8>(i));
        return i + 8;
      case kMarkOp: marks_.push_back(stack_.size()); return i;
      case kEmptyTupleOp: emplace(Tag::kTuple); return i;
      case kTuple1Op: return tuple_of(1, i);
      case kTuple2Op: return tuple_of(2, i);
      case kTuple3Op: return tuple_of(3, i);
      case kTupleOp: {
        const std::size_t from = pop_mark();
        push(make_tuple(from));
        return i;
      }
      case kEmptyListOp: emplace(Tag::kList); return i;
      case kEmptyDictOp: emplace(Tag::kDict).aux = ++dicts_; return i;
      case kAppendOp:
        if (stack_.size() < fence() + 2 || stack_[stack_.size() - 2].tag != Tag::kList) decline();
        extend(stack_.size() - 1);
        collect();
        return i;
      case kAppendsOp: {
        const std::size_t from = pop_mark();
        if (from == 0 || stack_[from - 1].tag != Tag::kList) decline();
        extend(from);
        collect();
        return i;
      }
      case kSetItemOp:
        if (stack_.size() < fence() + 3) decline();
        set_items(stack_.size() - 2);
        return i;
      case kSetItemsOp: set_items(pop_mark()); return i;
      case kNoneOp: emplace(Tag::kNone); return i;
      case kTrueOp: emplace(Tag::kBool).at = 1; return i;
      case kFalseOp: emplace(Tag::kBool).at = 0; return i;
      case kInt1Op: emplace(Tag::kInt).at = operand<1>(i); return i + 1;
      case kInt2Op: emplace(Tag::kInt).at = operand<2>(i); return i + 2;
      case kInt4Op:
        emplace(Tag::kInt).at = static_cast<std::uint64_t>(static_cast<std::int64_t>(static_cast<std::int32_t>(operand<4>(i))));
        return i + 4;
      case kLong1Op: return long_int<1>(i);
      case kLong4Op: return long_int<4>(i);
      case kFloatOp: emplace(Tag::kFloat).at = operand<8>(i); return i + 8;
      case kStr1Op: return text<1>(i, true);
      case kStr4Op: return text<4>(i, true);
      case kStr8Op: return text<8>(i, true);
      case kBytes1Op: return text<1>(i, false);
      case kBytes4Op: return text<4>(i, false);
      case kBytes8Op: return text<8>(i, false);
      case kGlobalOp: {
        std::string lines[2];
        for (auto& line : lines) {
          const auto* nl = static_cast<const std::uint8_t*>(std::memchr(p0_ + i, '\n', n_ - i));
          if (!nl) decline();
          line.assign(reinterpret_cast<const char*>(p0_ + i), static_cast<std::size_t>(nl - (p0_ + i)));
          if (!pickle::valid_utf8(line)) decline();
          i = static_cast<std::size_t>(nl - p0_) + 1;
        }
        push(global(std::move(lines[0]), std::move(lines[1])));
        return i;
      }
      case kStackGlobalOp: {
        const Tok name = pop();
        const Tok module = pop();
        if (module.tag != Tag::kStr || name.tag != Tag::kStr) decline();
        push(global(std::string(view(module)), std::string(view(name))));
        return i;
      }
      case kReduceOp: reduce(); return i;
      case kNewObjOp: newobj(); return i;
      case kBuildOp: build(); return i;
      case kPut1Op:
        first_put();
        memo_put(operand<1>(i));
        return i + 1;
      case kPut4Op:
        first_put();
        memo_put(operand<4>(i));
        return i + 4;
      case kMemoizeOp: memo_put(memo_count_); return i;
      case kGet1Op: return memo_get(operand<1>(i), i + 1);
      case kGet4Op: return memo_get(operand<4>(i), i + 4);
      default: decline();  // kRefuse; STOP is run()'s
    }
  }

  const std::uint8_t* p0_;
  std::size_t n_;
  const std::function<void(std::uint64_t)>& release_;
  Checkpoint& c_;
  DcpIndexBuilder b_;
  BuilderFeed& feed_;
  TokStack stack_;
  std::vector<std::size_t> marks_;
  TokArena arena_;
  std::uint32_t pinned_ = 0;  ///< the arena the memo's tokens need
  const std::vector<std::uint64_t>* words_ = &no_words_;
  std::vector<std::uint32_t> rank_;  ///< per word of the referenced bitmap: referenced indices before it
  std::vector<Tok> memo_;            ///< by memo_slot(): the guessed tokens, then the exact ones
  static inline const std::vector<std::uint64_t> no_words_;
  // NOTE [The first pass beside the reader]
  bool guess_ = false;
  std::uint64_t guess_limit_ = 0;  ///< indices below it were guessed (all of them while guessing)
  std::size_t guessed_ = 0;        ///< tokens kept by guessing, first in memo_
  std::vector<std::uint64_t> kept_words_;  ///< the indices kept by guessing
  std::vector<std::uint32_t> guess_rank_;  ///< as rank_, for kept_words_
  const std::atomic<bool>* settled_ = nullptr;  ///< the first pass is done (while guessing)
  const pickle::IndexSet* first_pass_ = nullptr;
  std::uint64_t settle_at_ = 0;  ///< tests: settle at this offset instead
  bool puts_ = false;                ///< a BINPUT/LONG_BINPUT was met: set_ numbers MEMOIZE
  pickle::IndexSet set_;
  std::uint64_t memo_count_ = 0;
  std::vector<pickle::ValuePtr> globals_;
  std::vector<TensorEntry> tensors_;  ///< built TensorStorageMetadata, until their dict takes them
  std::size_t tensors_live_ = 0;
  std::vector<std::vector<std::string>> transforms_;
  std::uint64_t dicts_ = 0;
  std::uint64_t sdm_dict_ = 0, storage_dict_ = 0;  ///< the dicts (by number) the builder's pairs came from
  std::int64_t infos_ = 0;  ///< _StorageInfo objects built and not yet taken by storage_data
  bool root_done_ = false;
  std::uint64_t relocated_ = 0;  ///< tokens extend() has copied
  DirectReadStats stats_;
  std::uint64_t paths_dict_ = 0;  ///< the dict (by number) whose pairs are in paths_
  KeyPaths paths_;  ///< becomes Checkpoint::planner_data
  std::vector<pickle::ValuePtr> shared_strs_;              ///< tree(): by memo slot (Tok::b)
  std::map<std::uint64_t, pickle::ValuePtr> shared_tuples_;  ///< tree(): by place in the arena
  mutable struct {
    Name chunks{"chunks"};
    Name dtype{"dtype"};
    Name fqn{"fqn"};
    Name length{"length"};
    Name offset{"offset"};
    Name offsets{"offsets"};
    Name planner_data{"planner_data"};
    Name properties{"properties"};
    Name relative_path{"relative_path"};
    Name requires_grad{"requires_grad"};
    Name size{"size"};
    Name sizes{"sizes"};
    Name state_dict_metadata{"state_dict_metadata"};
    Name storage_data{"storage_data"};
    Name storage_meta{"storage_meta"};
    Name transform_descriptors{"transform_descriptors"};
    Name version{"version"};
  } names_;
};

}  // namespace

// The largest .metadata whose first pass runs beside the reader (NOTE [The first pass beside the
// reader]): the pages the first pass reads ahead of the reader stay mapped until the reader has
// read them, and a wrong guess costs a second reading.
constexpr std::size_t kBesideBelow = std::size_t{16} << 20;

namespace {
// Stops the feed's builder and joins the thread that serves it (and ran the first pass, beside).
struct JoinBuilderAtExit {
  std::thread& t;
  BuilderFeed& feed;
  ~JoinBuilderAtExit() {
    feed.close();
    if (t.joinable()) t.join();
  }
};
}  // namespace

bool read_dcp_metadata_direct(std::span<const std::byte> bytes, const std::string& source, Checkpoint& c,
                              const std::function<void(std::uint64_t)>& release, DirectReadStats* stats,
                              const DirectReadOptions& options) {
  Checkpoint out;
  auto fresh = [&] {
    out = Checkpoint{};
    out.root = c.root;
    out.format = c.format;
  };
  fresh();
  using FirstPass = DirectReadOptions::FirstPass;
  const bool beside = options.first_pass == FirstPass::kAt ||
                      (options.first_pass == FirstPass::kAuto && bytes.size() <= kBesideBelow && std::thread::hardware_concurrency() > 1);
  try {
    if (!beside) {
      pickle::ParseOptions scan;
      scan.on_scanned = release;
      const pickle::IndexSet referenced = pickle::referenced_memo(bytes, scan);
      // A larger .metadata: the builder on a thread of its own (NOTE [The builder beside the reader]).
      const bool threaded = options.first_pass == FirstPass::kAuto && std::thread::hardware_concurrency() > 1;
      BuilderFeed feed(threaded);
      std::thread builder;
      if (threaded) builder = std::thread([&] { feed.serve(); });
      JoinBuilderAtExit join{builder, feed};
      DirectReader reader(bytes, source, out, release, feed);
      reader.run(referenced);
      if (stats) *stats = reader.stats();
    } else {
      pickle::IndexSet referenced;
      std::atomic<bool> settled{false};
      std::exception_ptr failed;
      std::thread first;
      const bool threaded = options.first_pass != FirstPass::kAt;
      BuilderFeed feed(threaded);  // NOTE [The builder beside the reader]
      if (!threaded) {
        referenced = pickle::referenced_memo(bytes, pickle::ParseOptions{});
        settled = true;
      } else {
        first = std::thread([&] {
          try {
            referenced = pickle::referenced_memo(bytes, pickle::ParseOptions{});  // no pages given back: the reader reads them next
            settled.store(true, std::memory_order_release);
          } catch (...) {
            failed = std::current_exception();  // the reader guesses to the end, or this is thrown
          }
          feed.serve();
        });
      }
      JoinBuilderAtExit join{first, feed};
      try {
        DirectReader reader(bytes, source, out, release, feed);
        reader.run_beside(settled, referenced, options.settle_at);
        if (stats) *stats = reader.stats();
      } catch (const Reguess&) {
        feed.close();
        if (first.joinable()) first.join();
        if (failed) std::rethrow_exception(failed);
        fresh();
        BuilderFeed again(false);
        DirectReader reader(bytes, source, out, release, again);
        reader.run(referenced);
        if (stats) {
          *stats = reader.stats();
          stats->reguessed = true;
        }
      }
    }
  } catch (const Decline&) {
    return false;
  } catch (const Error&) {  // the builder's: the tree reader says it, with the offset
    return false;
  }
  c = std::move(out);
  return true;
}

}  // namespace ckpt::detail

namespace ckpt::detail {
namespace {

std::string location_difference(const OptionalLocation& a, const OptionalLocation& b) {
  if (a.has_value() != b.has_value()) return a ? "a location against none" : "no location against one";
  if (!a) return {};
  if (a->offset != b->offset || a->length != b->length || a->file != b->file || a->encoding != b->encoding ||
      a->storage_offset() != b->storage_offset()) {
    return "location (file " + std::to_string(a->file) + ", offset " + std::to_string(a->offset) + ", length " +
           std::to_string(a->length) + ") against (file " + std::to_string(b->file) + ", offset " + std::to_string(b->offset) +
           ", length " + std::to_string(b->length) + ")";
  }
  if (a->transforms() != b->transforms() || a->strides() != b->strides()) return "transforms or strides";
  return {};
}

}  // namespace

std::string index_difference(const Checkpoint& a, const Checkpoint& b) {
  if (a.format != b.format) return "format";
  if (a.writer != b.writer) return "writer '" + a.writer + "' against '" + b.writer + "'";
  if (a.world_size != b.world_size) return "world size";
  if (a.root != b.root) return "root";
  if (a.files.size() != b.files.size()) return std::to_string(a.files.size()) + " files against " + std::to_string(b.files.size());
  for (std::size_t i = 0; i < a.files.size(); ++i) {
    if (a.files[i].relative != b.files[i].relative || a.files[i].path != b.files[i].path || a.files[i].size != b.files[i].size) {
      return "file " + std::to_string(i) + ": '" + a.files[i].relative + "' against '" + b.files[i].relative + "'";
    }
  }
  if (a.tensors.size() != b.tensors.size()) return std::to_string(a.tensors.size()) + " tensors against " + std::to_string(b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const TensorEntry& x = a.tensors[i];
    const TensorEntry& y = b.tensors[i];
    const std::string at = "tensor " + std::to_string(i) + " '" + x.name + "': ";
    if (x.name != y.name) return at + "named '" + y.name + "' in the other";
    if (x.position != y.position || x.dtype != y.dtype || x.requires_grad != y.requires_grad || x.shape != y.shape) {
      return at + "position, dtype, requires_grad or shape";
    }
    if (x.chunks.size() != y.chunks.size()) return at + "chunk count";
    for (std::size_t k = 0; k < x.chunks.size(); ++k) {
      if (x.chunks[k].offsets != y.chunks[k].offsets || x.chunks[k].sizes != y.chunks[k].sizes) return at + "chunk " + std::to_string(k) + " box";
      if (auto d = location_difference(x.chunks[k].location, y.chunks[k].location); !d.empty()) {
        return at + "chunk " + std::to_string(k) + " " + d;
      }
    }
  }
  if (a.objects.size() != b.objects.size()) return std::to_string(a.objects.size()) + " objects against " + std::to_string(b.objects.size());
  for (std::size_t i = 0; i < a.objects.size(); ++i) {
    const ObjectEntry& x = a.objects[i];
    const ObjectEntry& y = b.objects[i];
    if (x.name != y.name || x.position != y.position) return "object " + std::to_string(i) + " '" + x.name + "' against '" + y.name + "'";
    if ((x.value == nullptr) != (y.value == nullptr) || (x.value && pickle::repr(*x.value) != pickle::repr(*y.value))) {
      return "object '" + x.name + "' value";
    }
    if (auto d = location_difference(x.item, y.item); !d.empty()) return "object '" + x.name + "' " + d;
  }
  if (a.metadata != b.metadata) return "metadata";
  if (a.unreferenced_storage != b.unreferenced_storage) return "unreferenced storage";
  if (a.notes != b.notes) return "notes";
  if (a.meta_trees.size() != b.meta_trees.size()) return "meta trees";
  if (a.planner_data.size() != b.planner_data.size()) return "planner_data size";
  const auto fa = a.planner_data.fqns(), fb = b.planner_data.fqns();
  for (std::size_t i = 0; i < fa.size(); ++i) {
    if (fa[i] != fb[i] || pickle::repr(*a.planner_data.find(fa[i])) != pickle::repr(*b.planner_data.find(fb[i]))) {
      return "planner_data '" + std::string(fa[i]) + "'";
    }
  }
  return {};
}

}  // namespace ckpt::detail
