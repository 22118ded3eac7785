// Chat templates render byte for byte what transformers renders (testdata/chat_templates/
// cases.json, made by scripts/make_chat_template_reference.py), and the Jinja interpreter agrees
// with Python Jinja2 on each feature case.
#include "pagedlm/tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "pagedlm/core/error.h"
#include "pagedlm/tokenizer/jinja.h"

namespace pagedlm {
namespace {

using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

const fs::path kDir = fs::path(PAGEDLM_TESTDATA) / "chat_templates";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const ojson& reference() {
  static const ojson doc = ojson::parse(read_text(kDir / "cases.json"));
  return doc;
}

// Renders and returns the output, or "ERROR: <message>" when rendering throws.
template <typename Fn>
std::string outcome(Fn&& render) {
  try {
    return render();
  } catch (const Error& e) {
    return std::string("ERROR: ") + e.what();
  }
}

void check_outcome(const ojson& c, const std::string& got) {
  if (c.contains("expected")) {
    EXPECT_EQ(got, c["expected"].get<std::string>()) << "case: " << c["name"];
  } else {
    std::string want = c["expected_error"].get<std::string>();
    EXPECT_EQ(got.rfind("ERROR: ", 0), 0u) << "case " << c["name"] << " rendered: " << got;
    EXPECT_NE(got.find(want), std::string::npos) << "case " << c["name"] << ": " << got;
  }
}

TEST(ChatTemplateReference, EveryTemplateCaseMatchesTransformers) {
  const ojson& doc = reference();
  std::map<std::string, int> per_template;
  for (const auto& c : doc["cases"]) {
    const ojson& info = doc["templates"][c["template"].get<std::string>()];
    ChatTemplate tmpl(read_text(kDir / info["file"].get<std::string>()),
                      info["bos_token"].get<std::string>(), info["eos_token"].get<std::string>());
    std::string got = outcome([&] {
      return tmpl.render(c["messages"], c["add_generation_prompt"].get<bool>(), c["extra"]);
    });
    check_outcome(c, got);
    ++per_template[c["template"].get<std::string>()];
  }
  for (const char* family : {"smollm2", "qwen2.5", "qwen3", "llama3.1", "mistral-v0.3"}) {
    EXPECT_GE(per_template[family], 8) << family;
  }
}

TEST(ChatTemplateReference, EveryFeatureCaseMatchesJinja2) {
  const ojson& doc = reference();
  ASSERT_GE(doc["features"].size(), 40u);
  for (const auto& c : doc["features"]) {
    std::string got = outcome([&] {
      std::vector<std::pair<std::string, jinja::Value>> context;
      for (const auto& [key, value] : c["context"].items()) {
        context.emplace_back(key, jinja::Value::from_json(value));
      }
      return jinja::Template(c["source"].get<std::string>()).render(context);
    });
    check_outcome(c, got);
  }
}

std::string render(const std::string& source, const ojson& context = ojson::object()) {
  std::vector<std::pair<std::string, jinja::Value>> vars;
  for (const auto& [key, value] : context.items()) {
    vars.emplace_back(key, jinja::Value::from_json(value));
  }
  return jinja::Template(source).render(vars);
}

std::string error_of(const std::string& source, const ojson& context = ojson::object()) {
  try {
    render(source, context);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Jinja, SyntaxErrorsNameTheLine) {
  EXPECT_EQ(error_of("a\nb\n{% frobnicate %}"),
            "chat template syntax error at line 3: unknown tag 'frobnicate'");
  EXPECT_EQ(error_of("x\n{{ 1 + }}"),
            "chat template syntax error at line 2: expected an expression, got '}}'");
  EXPECT_EQ(error_of("{% if x %}\n\nno end"),
            "chat template syntax error at line 3: unexpected end of template, expected one "
            "of: 'elif', 'else', 'endif'");
  EXPECT_EQ(error_of("{{ 'open"),
            "chat template syntax error at line 1: unterminated string "
            "literal");
  EXPECT_EQ(error_of("{% for x in %}{% endfor %}"),
            "chat template syntax error at line 1: expected an expression, got '%}'");
  // A broken template fails when it is loaded, not when the first request renders it.
  EXPECT_THROW(ChatTemplate("{% if %}", "", ""), Error);
}

TEST(Jinja, RuntimeErrorsNameTheLine) {
  EXPECT_EQ(error_of("ok\n\n{{ missing.attr }}"),
            "chat template error at line 3: 'missing' is undefined (reading attribute 'attr')");
  EXPECT_EQ(error_of("{{ 'a' + 1 }}"),
            "chat template error at line 1: unsupported operand type(s) for +: 'str' and 'int'");
  EXPECT_EQ(error_of("{{ x | nosuchfilter }}"),
            "chat template error at line 1: no filter named 'nosuchfilter'");
  EXPECT_EQ(error_of("{% set d = {} %}{% set d.a = 1 %}"),
            "chat template error at line 1: cannot assign attribute on non-namespace object");
  // A chain of + is evaluated in one pass; each + still reports its own line.
  EXPECT_EQ(error_of("{{ 'a'\n + 'b'\n + 1\n + 'c' }}"),
            "chat template error at line 3: unsupported operand type(s) for +: 'str' and 'int'");
}

// A loop reuses its `loop` dict from one iteration to the next only while nothing else holds
// it: one kept past its iteration still reads as it did then, as values here never change once
// made. (Jinja2 differs: its loop object is one object that moves on, and prints "3 b  True x"
// for the first template; no chat template keeps `loop`.)
TEST(Jinja, LoopKeptPastItsIterationKeepsItsValues) {
  EXPECT_EQ(render("{% set ns = namespace(kept=none) %}{% for x in 'abc' %}"
                   "{% if loop.index == 2 %}{% set ns.kept = loop %}{% endif %}{% endfor %}"
                   "{{ ns.kept.index }} {{ ns.kept.previtem }} {{ ns.kept.nextitem }} "
                   "{{ ns.kept.last }} {{ ns.kept.cycle('x', 'y') }}"),
            "2 a c False y");
  // Names set in one iteration are gone in the next, the loop's own names set again.
  EXPECT_EQ(render("{% for m in [{'f': 1}, {'f': 2}] %}[{{ t }}]{% set t = m.f %}"
                   "{% set m = m.f %}{{ m }}{{ loop.index }}{% endfor %}"),
            "[]11[]22");
}

// Data nested past kMaxValueDepth, from a request or made by the template itself, fails with an
// Error instead of recursing off the stack.
TEST(Jinja, DeepValuesAreRefused) {
  ojson deep = ojson::array();
  for (int i = 0; i < 100000; ++i) deep = ojson::array({std::move(deep)});
  EXPECT_THROW(jinja::Value::from_json(deep), Error);
  ojson shallow = ojson::array();  // kMaxValueDepth levels
  for (int i = 1; i < jinja::kMaxValueDepth; ++i) shallow = ojson::array({std::move(shallow)});
  EXPECT_EQ(render("{{ x | length }}", {{"x", shallow}}), "1");
  EXPECT_THROW(jinja::Value::from_json(ojson::array({shallow})), Error);
  // Built by the template in a loop, past the bound: refused as it is made, long before
  // freeing it would recurse off the stack.
  EXPECT_NE(error_of("{% set ns = namespace(a=[]) %}{% for i in range(100000) %}"
                     "{% set ns.a = [ns.a] %}{% endfor %}")
                .find("nests deeper than"),
            std::string::npos);
  // A namespace that holds itself would print forever; lists the template nests in a loop
  // are refused as they are made, whatever is done with them.
  EXPECT_NE(error_of("{% set ns = namespace(x=1) %}{% set ns.x = ns %}{{ ns }}")
                .find("nests deeper than"),
            std::string::npos);
  const std::string deep_lists =
      "{% set ns = namespace(a=[0], b=[1]) %}{% for i in range(300) %}"
      "{% set ns.a = [ns.a] %}{% set ns.b = [ns.b] %}{% endfor %}";
  for (const char* use :
       {"{{ ns.a }}", "{{ ns.a == ns.b }}", "{{ ns.a < ns.b }}", "{{ ns.a | tojson }}"}) {
    EXPECT_NE(error_of(deep_lists + use).find("nests deeper than"), std::string::npos) << use;
  }
}

// A template is outside data too (--chat-template): nesting past kMaxNesting, by recursion
// (brackets, blocks, prefixes) or by a chain the parser builds in a loop, is a syntax error.
TEST(Jinja, DeepTemplatesAreRefused) {
  auto repeat = [](const std::string& s, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) out += s;
    return out;
  };
  const int n = 100000;
  for (const std::string& source :
       {"{{ " + repeat("(", n) + "1" + repeat(")", n) + " }}",
        "{{ " + repeat("[", n) + repeat("]", n) + " }}", "{{ " + repeat("not ", n) + "1 }}",
        "{{ " + repeat("-", n) + "1 }}", "{{ 1" + repeat(" ~ 1", n) + " }}",
        "{{ x" + repeat(".a", n) + " }}", "{{ x" + repeat(" | trim", n) + " }}",
        repeat("{% if 1 %}", n) + repeat("{% endif %}", n)}) {
    EXPECT_NE(error_of(source).find("nested deeper than"), std::string::npos)
        << source.substr(0, 40);
  }
  // Within the bound, the same shapes still render.
  EXPECT_EQ(render("{{ " + repeat("(", 100) + "1" + repeat(")", 100) + " }}"), "1");
  EXPECT_EQ(render(repeat("{% if 1 %}", 100) + "x" + repeat("{% endif %}", 100)), "x");
  EXPECT_EQ(render("{{ 1" + repeat(" + 1", 100) + " }}"), "101");
}

// Found by fuzzing (tests/fuzz/fuzz_jinja.cc): integers past 64 bits and values too large to
// build used to throw std::out_of_range, run into undefined behaviour (signed overflow, a float
// cast past int64, INT64_MIN / -1) or exhaust memory and time. Each is an error now, and values
// within the bounds still match Python's.
TEST(Jinja, IntegerOverflowAndHugeValuesAreErrors) {
  for (const char* source :
       {"{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}",
        "{{ 4294967296 * 4294967296 }}", "{{ 2 ** 63 }}", "{{ 3 ** 1000000000000 }}",
        "{{ (-9223372036854775807 - 1) // -1 }}", "{{ -(-9223372036854775807 - 1) }}",
        "{{ (-9223372036854775807 - 1) | abs }}"}) {
    EXPECT_NE(error_of(source).find("integer overflow in"), std::string::npos) << source;
  }
  EXPECT_NE(error_of("{{ 99999999999999999999 }}")
                .find("integer literal 99999999999999999999 is "
                      "too large"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 1e300 | int }}").find("does not fit a 64-bit integer"), std::string::npos);
  EXPECT_NE(error_of("{{ (1e999 - 1e999) | int }}").find("cannot convert float"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 4 is divisibleby 0 }}").find("modulo by zero"), std::string::npos);
  EXPECT_NE(error_of("{{ range(10000000000) | length }}").find("range() of more than"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'ab' * 100000000000 }}").find("would exceed"), std::string::npos);
  EXPECT_NE(error_of("{{ [1, 2] * 100000000000 }}").find("would exceed"), std::string::npos);
  EXPECT_NE(error_of("{{ 'a' | indent(100000000000) }}").find("would exceed"), std::string::npos);
  EXPECT_NE(error_of("{{ [1] | tojson(indent=100000) }}").find("too large"), std::string::npos);
  // Values grown step by step, each step within the bounds: a string or list doubled in a loop,
  // a list printed whole, output written in a loop.
  for (const char* source :
       {"{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}"
        "{% endfor %}",
        "{% set s = 'x' * 10000000 %}{{ [s, s, s] }}",
        "{% set s = 'x' * 10000000 %}{{ [s, s] | tojson }}",
        "{% set s = 'x' * 10000000 %}{% for i in range(3) %}{{ s }}{% endfor %}"}) {
    const std::string error = error_of(source);
    EXPECT_TRUE(error.find("would pass") != std::string::npos) << source << ": " << error;
  }
  // The values Python's Jinja2 (3.1) renders for the same templates.
  EXPECT_EQ(
      render("{{ 2 ** 62 }} {{ 0 ** 1000000000000 }} {{ (-1) ** 1000000000001 }} "
             "{{ (-9223372036854775807 - 1) // -2 }} {{ 1e999 }} {{ 1e-999 }} "
             "{{ '1e3' | int }} {{ 4 is divisibleby(-1) }} {{ [1, 2, 3][::9223372036854775807] }}"),
      "4611686018427387904 0 -1 4611686018427387904 inf 0.0 1000 True [1]");
  // Floored remainders next to the int64 edges (Python's values).
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }} {{ (-9223372036854775807) % 3 }} "
                   "{{ 9223372036854775807 % -3 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ -7 // 2 }}"),
            "0 2 -2 2 -2 -4");
}

TEST(Jinja, RaiseExceptionCarriesTheTemplatesMessage) {
  EXPECT_EQ(error_of("\n{{ raise_exception('Roles must alternate ' ~ n) }}", {{"n", 2}}),
            "Roles must alternate 2");
}

TEST(ChatTemplate, ToolsAndDocumentsAreNoneUnlessGiven) {
  ChatTemplate tmpl(
      "{{ tools is none }} {{ documents is none }} {{ bos_token }}{{ eos_token }}"
      " {{ messages | length }} {{ add_generation_prompt }} {{ custom }}",
      "<s>", "</s>");
  EXPECT_EQ(tmpl.render(ojson::array(), false), "True True <s></s> 0 False ");
  EXPECT_EQ(tmpl.render(ojson::array({{{"role", "user"}, {"content", "x"}}}), true,
                        {{"tools", ojson::array()}, {"custom", "c"}}),
            "False True <s></s> 1 True c");
}

TEST(ChatTemplate, AcceptsPlainJsonWithSortedKeys) {
  ChatTemplate tmpl("{% for m in messages %}{{ m | tojson }}{% endfor %}", "", "");
  nlohmann::json messages = nlohmann::json::array({{{"role", "user"}, {"content", "x"}}});
  EXPECT_EQ(tmpl.render(messages, false), R"({"content": "x", "role": "user"})");
}

TEST(ChatTemplate, TextPartsAreJoinedAndOtherPartsKept) {
  ChatTemplate tmpl("{% for m in messages %}[{{ m.content }}]{% endfor %}", "", "");
  ojson parts =
      ojson::array({{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}});
  ojson image = ojson::array({{{"type", "image_url"}, {"image_url", "u"}}});
  EXPECT_EQ(tmpl.render(ojson::array({{{"role", "user"}, {"content", parts}},
                                      {{"role", "user"}, {"content", image}}}),
                        false),
            "[a\nb][[{'type': 'image_url', 'image_url': 'u'}]]");
}

TEST(ChatTemplate, KeyOrderOfToolsIsKept) {
  ChatTemplate tmpl("{{ tools[0] | tojson }}", "", "");
  ojson tools = ojson::parse(R"([{"type": "function", "function": {"name": "f", "a": 1}}])");
  EXPECT_EQ(tmpl.render(ojson::array(), false, {{"tools", tools}}),
            R"({"type": "function", "function": {"name": "f", "a": 1}})");
}

class LoadChatTemplate : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pagedlm_chat_template_" +
            std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  fs::path dir_;
};

TEST_F(LoadChatTemplate, FromTokenizerConfigString) {
  write("tokenizer_config.json",
        ojson({{"chat_template", "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"},
               {"bos_token", "<s>"},
               {"eos_token", {{"content", "</s>"}, {"lstrip", false}}}})
            .dump());
  ChatTemplate tmpl = load_chat_template(dir_.string());
  EXPECT_EQ(tmpl.bos_token(), "<s>");
  EXPECT_EQ(tmpl.eos_token(), "</s>");
  EXPECT_EQ(tmpl.render(ojson::array({{{"role", "user"}, {"content", "hi"}}}), false), "<s>hi</s>");
}

TEST_F(LoadChatTemplate, FromNamedListPicksDefault) {
  write("tokenizer_config.json", ojson({{"chat_template",
                                         {{{"name", "tool_use"}, {"template", "T"}},
                                          {{"name", "default"}, {"template", "D"}}}}})
                                     .dump());
  EXPECT_EQ(load_chat_template(dir_.string()).source(), "D");
}

TEST_F(LoadChatTemplate, ChatTemplateJinjaTakesPrecedence) {
  write("tokenizer_config.json", ojson({{"chat_template", "old"}, {"bos_token", "B"}}).dump());
  write("chat_template.jinja", "new {{ bos_token }}\n");
  ChatTemplate tmpl = load_chat_template(dir_.string());
  EXPECT_EQ(tmpl.render(ojson::array(), false), "new B");
}

TEST_F(LoadChatTemplate, MissingTemplateNamesTheFolder) {
  write("tokenizer_config.json", "{}");
  try {
    load_chat_template(dir_.string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir_.string()), std::string::npos) << e.what();
  }
}

// nlohmann reads a number too large for a double as out_of_range, not parse_error: it used to
// escape as a non-pagedlm exception.
TEST_F(LoadChatTemplate, NumberTooLargeIsAnError) {
  write("tokenizer_config.json", R"({"chat_template": "x", "model_max_length": 1e999})");
  try {
    load_chat_template(dir_.string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot parse"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pagedlm
