// pagedlm logits: every position's logits for a list of token-id prompts, computed through the
// real engine path in packed batches. This is how anyone checks accuracy.
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "pagedlm/cli/commands.h"
#include "pagedlm/cli/model_path.h"
#include "pagedlm/io/hf_folder.h"
#include "pagedlm/io/safetensors.h"

namespace pagedlm::cli {

namespace {

std::vector<std::vector<int32_t>> read_prompts(const std::string& path) {
  const nlohmann::json j = read_json_file(path);
  PAGEDLM_CHECK(j.is_array() && !j.empty(), "prompts file ", path,
                " must hold a non-empty JSON list of token-id lists");
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < j.size(); ++i) {
    PAGEDLM_CHECK(j[i].is_array(), "prompt ", i, " in ", path, " is not a list of token ids");
    std::vector<int32_t> ids;
    for (const auto& t : j[i]) {
      PAGEDLM_CHECK(t.is_number_integer() && t.get<int64_t>() >= 0 && t.get<int64_t>() <= INT32_MAX,
                    "prompt ", i, " in ", path, " holds ", t.dump(), ", not a token id");
      ids.push_back(t.get<int32_t>());
    }
    PAGEDLM_CHECK(!ids.empty(), "prompt ", i, " in ", path, " is empty");
    prompts.push_back(std::move(ids));
  }
  return prompts;
}

}  // namespace

void register_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "write every position's logits for token-id prompts");
  struct Args {
    std::string model, input, output;
    EngineFlags flags;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--model", args->model, "HF folder or .gguf file (default: SmolLM2 GGUF)");
  cmd->add_option("--input", args->input, "JSON list of token-id lists")->required();
  cmd->add_option("--output", args->output, "safetensors file to write")->required();
  add_engine_flags(*cmd, args->flags);
  cmd->callback([args] {
    const auto prompts = read_prompts(args->input);
    const EngineOptions options = args->flags.resolve();  // a bad --device fails before the load
    Checkpoint ckpt = load_with_progress(resolve_model_path(args->model));
    if (ran_as_worker_rank(ckpt, options)) return;
    Engine engine(ckpt, options);
    ckpt.release_weights();
    std::vector<Request> requests;
    for (const auto& p : prompts) {
      Request r;
      r.prompt = p;
      r.sampling.max_tokens = 0;
      r.want_prompt_logits = true;
      r.use_prefix_cache = false;  // every position's logits must be computed
      requests.push_back(std::move(r));
    }
    std::map<std::string, Tensor> tensors;
    auto outputs = engine.generate(std::move(requests));
    for (size_t i = 0; i < outputs.size(); ++i) {
      tensors.emplace("logits." + std::to_string(i), std::move(outputs[i].prompt_logits));
    }
    write_safetensors(args->output, tensors);
    std::fprintf(stderr, "wrote %zu logits tensors to %s in %lld steps\n", tensors.size(),
                 args->output.c_str(), static_cast<long long>(engine.num_steps()));
  });
}

}  // namespace pagedlm::cli
