#include "pagedlm/server/openai_api.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/server/structured_output.h"
#include "pagedlm/serving/reasoning.h"

namespace pagedlm::server {

using serving::prompt_opens_reasoning;
using serving::tool_call_format;

using json = nlohmann::ordered_json;

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, param);
}

// The field, or null when it is absent or JSON null (OpenAI treats both as "not given").
const json* field(const json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

bool get_bool(const json& body, const char* key, bool fallback) {
  const json* v = field(body, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) bad(key, cat("'", key, "' must be a boolean"));
  return v->get<bool>();
}

double get_number(const json& body, const char* key, double fallback) {
  const json* v = field(body, key);
  if (v == nullptr) return fallback;
  if (!v->is_number()) bad(key, cat("'", key, "' must be a number"));
  const double d = v->get<double>();
  if (!std::isfinite(d)) bad(key, cat("'", key, "' must be finite"));
  return d;
}

std::optional<int64_t> get_int(const json& body, const char* key) {
  const json* v = field(body, key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number_integer()) bad(key, cat("'", key, "' must be an integer"));
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    bad(key, cat("'", key, "' is too large"));
  }
  return v->get<int64_t>();
}

std::string get_string(const json& body, const char* key) {
  const json* v = field(body, key);
  if (v == nullptr) return {};
  if (!v->is_string()) bad(key, cat("'", key, "' must be a string"));
  return v->get<std::string>();
}

int32_t checked_token(const json& v, const ModelInfo& model, const char* param) {
  if (!v.is_number_integer()) bad(param, cat("'", param, "' token ids must be integers"));
  const int64_t id = v.get<int64_t>();
  if (id < 0 || id >= model.vocab_size) {
    bad(param, cat("token id ", id, " is out of range for a vocabulary of ", model.vocab_size));
  }
  return static_cast<int32_t>(id);
}

std::vector<int32_t> token_list(const json& v, const ModelInfo& model, const char* param) {
  std::vector<int32_t> ids;
  for (const json& t : v) ids.push_back(checked_token(t, model, param));
  return ids;
}

// prompt: a string, a token list, or a list of either.
std::vector<std::vector<int32_t>> parse_prompts(const json& body, const ModelInfo& model) {
  const json* p = field(body, "prompt");
  if (p == nullptr) bad("prompt", "'prompt' is required");
  auto encode = [&](const json& s) {
    return require_tokenizer(model, "prompt").encode(s.get<std::string>());
  };
  std::vector<std::vector<int32_t>> prompts;
  if (p->is_string()) {
    prompts.push_back(encode(*p));
  } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {
    prompts.push_back(token_list(*p, model, "prompt"));
  } else if (p->is_array() && !p->empty()) {
    for (const json& item : *p) {
      if (item.is_string()) {
        prompts.push_back(encode(item));
      } else if (item.is_array()) {
        prompts.push_back(token_list(item, model, "prompt"));
      } else {
        bad("prompt", "'prompt' must be a string, a list of token ids, or a list of either");
      }
    }
  } else if (p->is_array()) {
    bad("prompt", "'prompt' must not be an empty list");
  } else {
    bad("prompt", "'prompt' must be a string, a list of token ids, or a list of either");
  }
  return prompts;
}

// The roles of OpenAI's and vLLM's chat API ("function": OpenAI's older name for a tool's
// answer). A template given another role renders it however it happens to, often as nothing.
bool known_role(const std::string& role) {
  for (const char* known : {"system", "developer", "user", "assistant", "tool", "function"}) {
    if (role == known) return true;
  }
  return false;
}

std::string render_chat(const json& body, const ModelInfo& model) {
  const json* messages = field(body, "messages");
  if (messages == nullptr) bad("messages", "'messages' is required");
  if (!messages->is_array() || messages->empty()) {
    bad("messages", "'messages' must be a non-empty list");
  }
  // Templates render every message with its role's markers, at least one token each, so a list
  // longer than the context cannot fit. Refused before rendering: a 2 MB body of 65k tiny
  // messages would otherwise cost a render and a tokenization of all of them.
  const int64_t context = model.context_tokens();
  if (static_cast<int64_t>(messages->size()) > context) {
    bad("messages", cat("This model's maximum context length is ", context,
                        " tokens. However, 'messages' lists ", messages->size(),
                        " messages, more than that many tokens can hold."));
  }
  for (const json& m : *messages) {
    if (!m.is_object()) bad("messages", "each message must be an object");
    if (!m.contains("role") || !m["role"].is_string()) {
      bad("messages", "each message needs a string 'role'");
    }
    if (!known_role(m["role"].get<std::string>())) {
      // dump(): a NUL or control character in the role shows escaped.
      bad("messages", cat("unknown message role ", m["role"].dump(),
                          ": one of system, developer, user, assistant, tool, function"));
    }
    if (m.contains("content")) {
      const json& c = m["content"];
      if (!c.is_string() && !c.is_array() && !c.is_null()) {
        bad("messages", "a message 'content' must be a string, a list of parts, or null");
      }
    }
  }
  if (model.chat_template == nullptr) {
    throw ApiError(400, "this model has no chat template; use /v1/completions", "messages");
  }
  json extra = json::object();
  if (const json* kwargs = field(body, "chat_template_kwargs")) {
    if (!kwargs->is_object())
      bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    extra = *kwargs;
  }
  if (const json* tools = field(body, "tools")) extra["tools"] = *tools;
  try {
    return model.chat_template->render(*messages, get_bool(body, "add_generation_prompt", true),
                                       extra);
  } catch (const Error& e) {
    bad("messages", e.what());
  }
}

// logit_bias: {"token id": bias in [-100, 100], ...} (OpenAI's form: ids as strings).
std::vector<std::pair<int32_t, float>> parse_logit_bias(const json& bias, const ModelInfo& model) {
  if (!bias.is_object()) bad("logit_bias", "'logit_bias' must be an object of token id -> bias");
  std::vector<std::pair<int32_t, float>> out;
  for (const auto& [key, value] : bias.items()) {
    int64_t id = -1;
    size_t used = 0;
    try {
      id = std::stoll(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != key.size()) {
      bad("logit_bias", cat("'logit_bias' keys must be token ids, got '", key, "'"));
    }
    if (id < 0 || id >= model.vocab_size) {
      bad("logit_bias", cat("logit_bias token id ", id, " is out of range for a vocabulary of ",
                            model.vocab_size));
    }
    if (!value.is_number() || !(std::abs(value.get<double>()) <= 100.0)) {
      bad("logit_bias",
          cat("'logit_bias' values must be numbers in [-100, 100], got ", value.dump()));
    }
    out.emplace_back(static_cast<int32_t>(id), value.get<float>());
  }
  return out;
}

void reject_unsupported(const json& body, bool chat) {
  if (!chat && get_bool(body, "echo", false)) bad("echo", "'echo' is not supported by this server");
  if (!chat && !get_string(body, "suffix").empty()) {
    bad("suffix", "'suffix' is not supported by this server");
  }
}

// The call form to read out of the reply (kNone: none): `tools` given, tool_choice "auto" (the
// default) and a template whose form the server reads. tool_choice "required" and a named
// function are forced calls, which parse_structured_output (server/structured_output.h) reads.
ToolCallFormat wanted_tool_calls(const json& body, const ModelInfo& model) {
  const json* tools = field(body, "tools");
  if (tools != nullptr && !tools->is_array()) bad("tools", "'tools' must be a list");
  if (tools != nullptr && tools->size() > kMaxTools) {
    bad("tools", cat("'tools' may list at most ", kMaxTools, " tools, got ", tools->size()));
  }
  std::string choice = "auto";
  if (const json* c = field(body, "tool_choice")) {
    if (!c->is_string()) return ToolCallFormat::kNone;
    choice = c->get<std::string>();
  }
  if (tools == nullptr || tools->empty() || choice != "auto" || model.chat_template == nullptr) {
    return ToolCallFormat::kNone;
  }
  // Left to the model's choice, tools a template never names are dropped without a word, and
  // the model answers as if it had none. (A forced call is held to the tools' schemas by its
  // grammar, rendered or not.)
  if (model.chat_template->source().find("tools") == std::string::npos) {
    bad("tools",
        "this model's chat template does not render 'tools'; the model would not see them "
        "(tool_choice 'required' or a named function still holds the reply to their schemas)");
  }
  return tool_call_format(model.chat_template->source());
}

}  // namespace

const Tokenizer& require_tokenizer(const ModelInfo& model, const char* param) {
  if (model.tokenizer == nullptr) {
    bad(param,
        "this server has no tokenizer (random weights): give prompts as token ids, "
        "without stop strings or logprobs");
  }
  return *model.tokenizer;
}

ApiError::ApiError(int status, const std::string& message, std::string param, std::string type)
    : std::runtime_error(message),
      status_(status),
      param_(std::move(param)),
      type_(std::move(type)) {}

json error_body(const std::string& message, const std::string& type, const std::string& param,
                int code) {
  return json{{"error",
               {{"message", message},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", code}}}};
}

CompletionRequest parse_completion_request(const json& body, bool chat, const ModelInfo& model) {
  if (!body.is_object()) bad("", "the request body must be a JSON object");
  CompletionRequest r;
  r.chat = chat;
  r.model = get_string(body, "model");
  if (!r.model.empty() && r.model != model.name) {
    // 400 as for any other bad field (OpenAI itself answers 404 model_not_found).
    throw ApiError(400, cat("The model `", r.model, "` does not exist."), "model");
  }
  reject_unsupported(body, chat);

  SamplingParams& s = r.sampling;
  s.temperature = static_cast<float>(get_number(body, "temperature", 1.0));
  if (s.temperature < 0.f)
    bad("temperature", cat("'temperature' must be >= 0, got ", s.temperature));
  s.top_p = static_cast<float>(get_number(body, "top_p", 1.0));
  if (!(s.top_p > 0.f && s.top_p <= 1.f)) {
    bad("top_p", cat("'top_p' must be in (0, 1], got ", s.top_p));
  }
  const int64_t top_k = get_int(body, "top_k").value_or(0);
  if (top_k < -1 || top_k > INT32_MAX)
    bad("top_k", cat("'top_k' must be -1, 0 or positive, got ", top_k));
  s.top_k = top_k < 0 ? 0 : static_cast<int32_t>(top_k);
  s.min_p = static_cast<float>(get_number(body, "min_p", 0.0));
  if (!(s.min_p >= 0.f && s.min_p <= 1.f))
    bad("min_p", cat("'min_p' must be in [0, 1], got ", s.min_p));
  for (auto [key, value] : {std::pair{"presence_penalty", &s.presence_penalty},
                            std::pair{"frequency_penalty", &s.frequency_penalty}}) {
    *value = static_cast<float>(get_number(body, key, 0.0));
    if (!(std::abs(*value) <= 2.f)) bad(key, cat("'", key, "' must be in [-2, 2], got ", *value));
  }
  s.repetition_penalty = static_cast<float>(get_number(body, "repetition_penalty", 1.0));
  if (!(s.repetition_penalty > 0.f && std::isfinite(s.repetition_penalty))) {
    bad("repetition_penalty", cat("'repetition_penalty' must be > 0, got ", s.repetition_penalty));
  }
  if (const json* bias = field(body, "logit_bias")) s.logit_bias = parse_logit_bias(*bias, model);
  if (auto seed = get_int(body, "seed")) s.seed = static_cast<uint64_t>(*seed);
  s.ignore_eos = get_bool(body, "ignore_eos", false);
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) bad("stop_token_ids", "'stop_token_ids' must be a list of token ids");
    s.stop_token_ids = token_list(*ids, model, "stop_token_ids");
  }

  const int64_t n = get_int(body, "n").value_or(1);
  if (n < 1 || n > kMaxChoices) bad("n", cat("'n' must be in [1, ", kMaxChoices, "], got ", n));
  r.n = static_cast<int32_t>(n);
  if (auto best_of = get_int(body, "best_of"); best_of && *best_of != n) {
    bad("best_of", "'best_of' other than n is not supported by this server");
  }

  r.stream = get_bool(body, "stream", false);
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) bad("stream_options", "'stream_options' must be an object");
    if (!r.stream) bad("stream_options", "'stream_options' is only allowed with stream: true");
    r.include_usage = get_bool(*options, "include_usage", false);
  }

  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      r.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array() && stop->size() <= 16) {
      for (const json& s : *stop) {
        if (!s.is_string()) bad("stop", "'stop' entries must be strings");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      bad("stop", "'stop' must be a string or a list of at most 16 strings");
    }
    // An empty stop string would match before the first token: it is a mistake, not a request.
    for (const std::string& s : r.stop) {
      if (s.empty()) bad("stop", "'stop' strings must not be empty");
    }
  }
  // Stop strings match decoded text, and logprobs name tokens by their text.
  if (!r.stop.empty()) require_tokenizer(model, "stop");

  if (chat) {
    if (get_bool(body, "logprobs", false)) {
      const int64_t top = get_int(body, "top_logprobs").value_or(0);
      if (top < 0 || top > kMaxTopLogprobs) {
        bad("top_logprobs", cat("'top_logprobs' must be in [0, ", kMaxTopLogprobs, "]"));
      }
      r.top_logprobs = static_cast<int32_t>(top);
    } else if (get_int(body, "top_logprobs").value_or(0) > 0) {
      bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    }
  } else if (auto top = get_int(body, "logprobs")) {
    if (*top < 0 || *top > kMaxTopLogprobs) {
      bad("logprobs", cat("'logprobs' must be in [0, ", kMaxTopLogprobs, "]"));
    }
    r.top_logprobs = static_cast<int32_t>(*top);
  }
  if (r.top_logprobs >= 0) require_tokenizer(model, "logprobs");

  r.cache_salt = get_string(body, "cache_salt");

  std::optional<int64_t> max_tokens = get_int(body, "max_completion_tokens");
  if (!max_tokens) max_tokens = get_int(body, "max_tokens");
  if (max_tokens && *max_tokens < 1) {
    bad("max_tokens", cat("'max_tokens' must be at least 1, got ", *max_tokens));
  }

  if (chat) {
    r.tool_calls = wanted_tool_calls(body, model);  // checks tools before the template renders
    const Tokenizer& tokenizer = require_tokenizer(model, "messages");
    const std::string prompt = render_chat(body, model);
    r.prompts.push_back(tokenizer.encode(prompt, /*add_special_tokens=*/false));
    r.reasoning = model.parse_reasoning;
    r.reasoning_opened = r.reasoning && prompt_opens_reasoning(prompt);
  } else {
    r.prompts = parse_prompts(body, model);
  }
  {
    const ToolCallFormat template_format = model.chat_template
                                               ? tool_call_format(model.chat_template->source())
                                               : ToolCallFormat::kNone;
    StructuredOutput so = parse_structured_output(body, chat, model.grammar, template_format);
    r.grammar = std::move(so.grammar);
    if (so.forced_tool_calls != ToolCallFormat::kNone) r.tool_calls = so.forced_tool_calls;
  }
  if (static_cast<int64_t>(r.prompts.size()) * r.n > kMaxChoices) {
    bad("n", cat("prompts x n must be at most ", kMaxChoices));
  }
  const int64_t limit = model.context_tokens();
  for (const std::vector<int32_t>& prompt : r.prompts) {
    const int64_t len = static_cast<int64_t>(prompt.size());
    if (len == 0) bad(chat ? "messages" : "prompt", "the prompt is empty");
    if (len >= limit) {
      bad(chat ? "messages" : "prompt", cat("This model's maximum context length is ", limit,
                                            " tokens. However, your prompt has ", len, " tokens."));
    }
    // Compared as max_tokens > limit - len: the sum overflows for max_tokens near INT64_MAX.
    if (max_tokens && *max_tokens > limit - len) {
      // Unsigned, the sum of two int64 values >= 0 fits.
      const uint64_t requested = static_cast<uint64_t>(len) + static_cast<uint64_t>(*max_tokens);
      bad("max_tokens",
          cat("This model's maximum context length is ", limit, " tokens. However, you requested ",
              requested, " tokens (", len, " in the prompt, ", *max_tokens,
              " for the completion). Please reduce the length of the prompt or the completion."));
    }
    // OpenAI's defaults: 16 tokens for completions, the rest of the context for chat.
    r.max_tokens.push_back(static_cast<int32_t>(max_tokens.value_or(chat ? limit - len : 16)));
  }
  return r;
}

std::vector<int32_t> parse_tokenize_request(const json& body, const ModelInfo& model) {
  if (!body.is_object()) bad("", "the request body must be a JSON object");
  if (field(body, "messages") != nullptr) {
    return require_tokenizer(model, "messages")
        .encode(render_chat(body, model), get_bool(body, "add_special_tokens", false));
  }
  if (field(body, "prompt") == nullptr || !body["prompt"].is_string()) {
    bad("prompt", "'prompt' must be a string (or give 'messages')");
  }
  return require_tokenizer(model, "prompt")
      .encode(body["prompt"].get<std::string>(), get_bool(body, "add_special_tokens", true));
}

std::vector<int32_t> parse_detokenize_request(const json& body, const ModelInfo& model) {
  if (!body.is_object()) bad("", "the request body must be a JSON object");
  const json* tokens = field(body, "tokens");
  if (tokens == nullptr || !tokens->is_array())
    bad("tokens", "'tokens' must be a list of token ids");
  require_tokenizer(model, "tokens");  // the caller decodes the ids
  return token_list(*tokens, model, "tokens");
}

}  // namespace pagedlm::server
