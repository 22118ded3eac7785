#include "pagedlm/engine/plan_wire.h"

#include <cstring>

#include "pagedlm/core/error.h"

namespace pagedlm {
namespace {

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
void put_vector(std::string& out, const std::vector<T>& v) {
  put(out, static_cast<uint64_t>(v.size()));
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

struct Reader {
  const std::string& bytes;
  size_t at = 0;

  template <typename T>
  T get() {
    PAGEDLM_CHECK(at + sizeof(T) <= bytes.size(), "a step message is cut short");
    T v;
    std::memcpy(&v, bytes.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }

  template <typename T>
  std::vector<T> get_vector() {
    const auto n = get<uint64_t>();
    PAGEDLM_CHECK(n <= (bytes.size() - at) / sizeof(T), "a step message is cut short");
    std::vector<T> v(n);
    std::memcpy(v.data(), bytes.data() + at, n * sizeof(T));
    at += n * sizeof(T);
    return v;
  }
};

}  // namespace

std::string encode_step(const StepPlan& p, bool want_logits) {
  std::string out;
  put(out, p.page_size);
  put(out, p.null_page);
  put(out, static_cast<uint8_t>(want_logits));
  for (const std::vector<int32_t>* v :
       {&p.token_ids, &p.positions, &p.q_indptr, &p.kv_indptr, &p.kv_page_indices,
        &p.kv_last_page_len, &p.slot_mapping, &p.kv_copies, &p.logits_rows, &p.logits_indptr}) {
    put_vector(out, *v);
  }
  put_vector(out, p.request_ids);
  put_vector(out, p.samples);
  return out;
}

WireStep decode_step(const std::string& bytes) {
  Reader r{bytes};
  WireStep s;
  StepPlan& p = s.plan;
  p.page_size = r.get<int32_t>();
  p.null_page = r.get<int32_t>();
  s.want_logits = r.get<uint8_t>() != 0;
  for (std::vector<int32_t>* v :
       {&p.token_ids, &p.positions, &p.q_indptr, &p.kv_indptr, &p.kv_page_indices,
        &p.kv_last_page_len, &p.slot_mapping, &p.kv_copies, &p.logits_rows, &p.logits_indptr}) {
    *v = r.get_vector<int32_t>();
  }
  p.request_ids = r.get_vector<int64_t>();
  p.samples = r.get_vector<uint8_t>();
  PAGEDLM_CHECK(r.at == bytes.size(), "a step message has ", bytes.size() - r.at,
                " bytes too many");
  return s;
}

}  // namespace pagedlm
