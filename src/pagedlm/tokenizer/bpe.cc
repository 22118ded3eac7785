#include "pagedlm/tokenizer/bpe.h"

#include <mutex>
#include <queue>

#include "pagedlm/core/error.h"
#include "pagedlm/tokenizer/unicode.h"

namespace pagedlm {

// Pieces repeat a lot in real text (words, indentation), so their ids are memoised. The cache is
// bounded by dropping everything when full, which keeps it simple and its memory predictable.
struct BpeModel::Cache {
  static constexpr size_t kMaxEntries = 1 << 16;
  static constexpr size_t kMaxPieceBytes = 256;
  std::mutex mutex;
  std::unordered_map<std::string, std::vector<int32_t>> entries;
};

BpeModel::BpeModel(std::vector<std::string> tokens,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   BpeOptions options)
    : tokens_(std::move(tokens)), options_(options), cache_(std::make_unique<Cache>()) {
  vocab_.reserve(tokens_.size());
  for (size_t id = 0; id < tokens_.size(); ++id) {
    if (tokens_[id].empty()) continue;
    auto [it, inserted] = vocab_.emplace(tokens_[id], static_cast<int32_t>(id));
    PAGEDLM_CHECK(inserted, "token '", tokens_[id], "' appears twice in the vocabulary (ids ",
                  it->second, " and ", id, ")");
  }
  PAGEDLM_CHECK(options_.unk_id < num_tokens(), "unknown-token id ", options_.unk_id,
                " is outside the vocabulary of ", tokens_.size());
  for (int b = 0; b < 256; ++b) byte_ids_[b] = find(unicode::byte_to_symbol(b));

  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const int32_t left_id = find(left), right_id = find(right);
    const int32_t merged_id = find(left + right);
    PAGEDLM_CHECK(left_id >= 0 && right_id >= 0 && merged_id >= 0, "merge ", rank, " '", left, " ",
                  right, "': ",
                  left_id < 0    ? left
                  : right_id < 0 ? right
                                 : left + right,
                  " is not in the vocabulary");
    // A repeated merge keeps its first (best) rank, as HF does by building its map in order.
    merges_.emplace(pair_key(left_id, right_id), Merge{static_cast<int32_t>(rank), merged_id});
  }
}

BpeModel::BpeModel(BpeModel&&) noexcept = default;
BpeModel& BpeModel::operator=(BpeModel&&) noexcept = default;
BpeModel::~BpeModel() = default;

int32_t BpeModel::find(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  return it == vocab_.end() ? -1 : it->second;
}

void BpeModel::merge_symbols(std::vector<int32_t>* ids) const {
  const int32_t n = static_cast<int32_t>(ids->size());
  if (n < 2) return;
  struct Symbol {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols(n);
  for (int32_t i = 0; i < n; ++i) symbols[i] = {(*ids)[i], i - 1, i + 1 < n ? i + 1 : -1, true};

  // Lowest rank first, leftmost on ties (HF's word.rs merge_all); stale entries are skipped when
  // popped, which gives the same result as rescanning after every merge.
  struct Candidate {
    int32_t rank, pos, merged_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    auto it = merges_.find(pair_key(symbols[pos].id, symbols[next].id));
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.merged_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.merged_id != top.merged_id) continue;
    left.id = top.merged_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  ids->clear();
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids->push_back(symbols[i].id);
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>* ids) const {
  if (piece.empty()) return;
  const bool cacheable = piece.size() <= Cache::kMaxPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    auto it = cache_->entries.find(std::string(piece));
    if (it != cache_->entries.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }

  std::vector<int32_t> symbols;
  const int32_t whole = options_.ignore_merges ? find(unicode::bytes_to_symbols(piece)) : -1;
  if (whole >= 0) {
    symbols.push_back(whole);
  } else {
    symbols.reserve(piece.size());
    bool previous_unknown = false;
    for (char c : piece) {
      const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
      if (id >= 0) {
        symbols.push_back(id);
        previous_unknown = false;
      } else if (options_.unk_id >= 0) {
        if (!(options_.fuse_unk && previous_unknown)) symbols.push_back(options_.unk_id);
        previous_unknown = true;
      }
    }
    merge_symbols(&symbols);
  }

  ids->insert(ids->end(), symbols.begin(), symbols.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    if (cache_->entries.size() >= Cache::kMaxEntries) cache_->entries.clear();
    cache_->entries.emplace(std::string(piece), std::move(symbols));
  }
}

}  // namespace pagedlm
