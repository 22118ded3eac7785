// Byte-level BPE model: vocabulary and ranked merges in the GPT-2 byte alphabet.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pagedlm {

struct BpeOptions {
  // Llama 3: a piece that is a whole vocabulary entry is taken as is, before any merge.
  bool ignore_merges = false;
  // Id for a byte whose symbol is not in the vocabulary; -1 drops such bytes (HF with
  // unk_token null, which is SmolLM2's case: 21 of the 256 byte symbols are missing).
  int32_t unk_id = -1;
  bool fuse_unk = false;  // consecutive unknowns become one unk id
};

class BpeModel {
 public:
  // tokens[id] is the token spelled in the byte-level alphabet; an empty string is an unused id.
  // Merges are ranked by position (earlier = applied first). Throws pagedlm::Error on duplicate
  // tokens or merges whose parts or result are not in the vocabulary.
  BpeModel(std::vector<std::string> tokens,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options);
  BpeModel(BpeModel&&) noexcept;
  BpeModel& operator=(BpeModel&&) noexcept;
  ~BpeModel();

  // Appends the ids of one pre-tokenized piece given as raw (UTF-8) bytes. Thread-safe.
  void encode_piece(std::string_view piece, std::vector<int32_t>* ids) const;

  int32_t num_tokens() const { return static_cast<int32_t>(tokens_.size()); }
  const std::string& token(int32_t id) const { return tokens_[id]; }
  // -1 when absent.
  int32_t find(std::string_view token) const;
  size_t num_merges() const { return merges_.size(); }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  struct Cache;

  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  void merge_symbols(std::vector<int32_t>* symbols) const;

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  int32_t byte_ids_[256];  // id of each byte's symbol, -1 when not in the vocabulary
  BpeOptions options_;
  std::unique_ptr<Cache> cache_;
};

}  // namespace pagedlm
