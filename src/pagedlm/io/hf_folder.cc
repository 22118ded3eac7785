#include "pagedlm/io/hf_folder.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/core/json.h"
#include "pagedlm/io/safetensors.h"

namespace pagedlm {

namespace fs = std::filesystem;

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  PAGEDLM_CHECK(in.good(), "cannot read ", path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    return parse_json(text);
  } catch (const nlohmann::json::exception& e) {
    fail(path, " is not valid JSON (", e.what(), ")");
  } catch (const Error& e) {
    fail(path, ": ", e.what());
  }
}

bool has_gguf_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string_view(magic, 4) == "GGUF";
}

namespace {

// One safetensors file to open and the tensors to take from it (all of them when unsharded).
struct Shard {
  std::string file;
  std::vector<std::string> names;
  bool take_all = false;
};

std::vector<Shard> list_shards(const fs::path& dir) {
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (!fs::exists(index_path)) {
    PAGEDLM_CHECK(fs::is_regular_file(dir / "model.safetensors"), dir.string(),
                  " holds neither model.safetensors nor model.safetensors.index.json");
    return {Shard{"model.safetensors", {}, true}};
  }
  const nlohmann::json index = read_json_file(index_path.string());
  const auto weight_map = index.find("weight_map");
  PAGEDLM_CHECK(index.is_object() && weight_map != index.end() && weight_map->is_object() &&
                    !weight_map->empty(),
                index_path.string(), ": \"weight_map\" is missing, empty or not an object");
  std::vector<Shard> shards;
  for (const auto& [name, file_json] : weight_map->items()) {
    PAGEDLM_CHECK(file_json.is_string(), index_path.string(), ": weight_map entry for ", name,
                  " is not a file name");
    const std::string file = file_json.get<std::string>();
    // Shards live beside the index; a path here could reach files outside the checkpoint.
    PAGEDLM_CHECK(!file.empty() && fs::path(file).filename() == file && file != "..",
                  index_path.string(), ": shard name \"", file, "\" for tensor ", name,
                  " is not a plain file name");
    auto it =
        std::find_if(shards.begin(), shards.end(), [&](const Shard& s) { return s.file == file; });
    if (it == shards.end()) it = shards.insert(shards.end(), Shard{file, {}, false});
    it->names.push_back(name);
  }
  for (const Shard& s : shards) {
    PAGEDLM_CHECK(fs::is_regular_file(dir / s.file), index_path.string(), " lists shard ", s.file,
                  " (for tensor ", s.names.front(), ") which is missing from ", dir.string());
  }
  return shards;
}

}  // namespace

std::map<std::string, Tensor> read_safetensors_folder(const std::string& dir,
                                                      const LoadProgress& progress) {
  const fs::path root(dir);
  std::map<std::string, Tensor> tensors;
  const std::vector<Shard> shards = list_shards(root);
  size_t total_bytes = 0;
  for (const Shard& s : shards) total_bytes += fs::file_size(root / s.file);
  size_t done_bytes = 0;
  for (const Shard& s : shards) {
    const fs::path path = root / s.file;
    const SafetensorsFile file = SafetensorsFile::open(path.string());
    if (s.take_all) {
      tensors.insert(file.tensors().begin(), file.tensors().end());
    }
    for (const std::string& name : s.names) {
      const auto it = file.tensors().find(name);
      PAGEDLM_CHECK(it != file.tensors().end(), "tensor ", name,
                    " is listed in model.safetensors.index.json but missing from shard ",
                    path.string());
      tensors.emplace(name, it->second);
    }
    done_bytes += fs::file_size(path);
    if (progress) progress(done_bytes, total_bytes);
  }

  return tensors;
}

}  // namespace pagedlm
