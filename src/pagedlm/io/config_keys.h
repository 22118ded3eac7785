// Typed reads of a JSON object's keys (config.json, generation_config.json), for file readers
// and the model families that interpret them.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "pagedlm/core/error.h"

namespace pagedlm {

// Typed reads of one JSON object's keys. Every message names the key (with `prefix_`, e.g.
// "rope_scaling."), so no nlohmann exception ever reaches the user. A key holding JSON null
// counts as absent, as HF's configs use null for "not set".
class ConfigKeys {
 public:
  ConfigKeys(const nlohmann::json& object, std::string prefix)
      : object_(object), prefix_(std::move(prefix)) {}

  const nlohmann::json* find(const std::string& key) const {
    const auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }

  int64_t get_int(const std::string& key, std::optional<int64_t> fallback = {}) const {
    const nlohmann::json* v = find_or_missing(key, fallback.has_value());
    if (v == nullptr) return *fallback;
    PAGEDLM_CHECK(v->is_number_integer(), "config key \"", prefix_, key,
                  "\" must be an integer, got ", v->dump());
    return v->get<int64_t>();
  }
  int64_t get_positive_int(const std::string& key, std::optional<int64_t> fallback = {}) const {
    const int64_t n = get_int(key, fallback);
    PAGEDLM_CHECK(n > 0, "config key \"", prefix_, key, "\" must be positive, got ", n);
    return n;
  }
  double get_float(const std::string& key, std::optional<double> fallback = {}) const {
    const nlohmann::json* v = find_or_missing(key, fallback.has_value());
    if (v == nullptr) return *fallback;
    PAGEDLM_CHECK(v->is_number(), "config key \"", prefix_, key, "\" must be a number, got ",
                  v->dump());
    return v->get<double>();
  }
  bool get_bool(const std::string& key, bool fallback) const {
    const nlohmann::json* v = find(key);
    if (v == nullptr) return fallback;
    PAGEDLM_CHECK(v->is_boolean(), "config key \"", prefix_, key, "\" must be true or false, got ",
                  v->dump());
    return v->get<bool>();
  }
  std::string get_string(const std::string& key, std::optional<std::string> fallback = {}) const {
    const nlohmann::json* v = find_or_missing(key, fallback.has_value());
    if (v == nullptr) return *fallback;
    PAGEDLM_CHECK(v->is_string(), "config key \"", prefix_, key, "\" must be a string, got ",
                  v->dump());
    return v->get<std::string>();
  }
  // An int, or a list of ints (eos_token_id may be either); absent gives an empty list.
  std::vector<int32_t> get_token_ids(const std::string& key) const {
    std::vector<int32_t> ids;
    const nlohmann::json* v = find(key);
    if (v == nullptr) return ids;
    const auto add = [&](const nlohmann::json& id) {
      PAGEDLM_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                        id.get<int64_t>() <= std::numeric_limits<int32_t>::max(),
                    "config key \"", prefix_, key,
                    "\" must be a token id or a list of token ids, got ", v->dump());
      ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    };
    if (v->is_array()) {
      for (const nlohmann::json& id : *v) add(id);
    } else {
      add(*v);
    }
    return ids;
  }

  // A nested object's keys (prefix "key."), or nothing when the key is absent or null.
  std::optional<ConfigKeys> get_object(const std::string& key) const {
    const nlohmann::json* v = find(key);
    if (v == nullptr) return std::nullopt;
    PAGEDLM_CHECK(v->is_object(), "config key \"", prefix_, key, "\" must be an object, got ",
                  v->dump());
    return ConfigKeys(*v, prefix_ + key + ".");
  }
  // A list of strings (HF's layer_types); absent gives an empty list.
  std::vector<std::string> get_string_list(const std::string& key) const {
    std::vector<std::string> out;
    const nlohmann::json* v = find(key);
    if (v == nullptr) return out;
    PAGEDLM_CHECK(v->is_array(), "config key \"", prefix_, key,
                  "\" must be a list of strings, got ", v->dump());
    for (const nlohmann::json& s : *v) {
      PAGEDLM_CHECK(s.is_string(), "config key \"", prefix_, key,
                    "\" must be a list of strings, got ", v->dump());
      out.push_back(s.get<std::string>());
    }
    return out;
  }

 private:
  const nlohmann::json* find_or_missing(const std::string& key, bool optional) const {
    const nlohmann::json* v = find(key);
    PAGEDLM_CHECK(v != nullptr || optional, "config key \"", prefix_, key, "\" is missing");
    return v;
  }

  const nlohmann::json& object_;
  std::string prefix_;
};

}  // namespace pagedlm
