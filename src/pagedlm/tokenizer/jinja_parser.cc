#include "pagedlm/tokenizer/jinja_parser.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <set>

#include "pagedlm/core/error.h"

namespace pagedlm::jinja {
namespace {

enum class Tok {
  kText,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok kind;
  int line;
  std::string text;  // text, name, string value or operator
  int64_t int_value = 0;
  double float_value = 0.0;
};

[[noreturn]] void syntax_error(int line, const std::string& message) {
  fail("chat template syntax error at line ", line, ": ", message);
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Jinja normalizes every newline sequence to "\n" and drops one trailing newline
// (keep_trailing_newline=False) before lexing.
std::string normalize_source(const std::string& source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// Decodes a string literal's escapes the way Jinja does (Python's "unicode-escape").
std::string unescape(const std::string& raw, int line) {
  std::u32string out;
  std::u32string in = utf8_decode(raw);
  for (size_t i = 0; i < in.size(); ++i) {
    char32_t c = in[i];
    if (c != U'\\' || i + 1 == in.size()) {
      out += c;
      continue;
    }
    char32_t e = in[++i];
    auto hex = [&](int digits) {
      if (i + digits >= in.size()) {
        syntax_error(line, "truncated escape in string literal");
      }
      char32_t v = 0;
      for (int k = 0; k < digits; ++k) {
        char32_t h = in[++i];
        int d = h >= U'0' && h <= U'9'   ? h - U'0'
                : h >= U'a' && h <= U'f' ? h - U'a' + 10
                : h >= U'A' && h <= U'F' ? h - U'A' + 10
                                         : -1;
        if (d < 0) syntax_error(line, "invalid escape in string literal");
        v = v * 16 + d;
      }
      return v;
    };
    switch (e) {
      case U'\n':
        break;
      case U'\\':
      case U'\'':
      case U'"':
        out += e;
        break;
      case U'n':
        out += U'\n';
        break;
      case U't':
        out += U'\t';
        break;
      case U'r':
        out += U'\r';
        break;
      case U'b':
        out += U'\b';
        break;
      case U'f':
        out += U'\f';
        break;
      case U'v':
        out += U'\v';
        break;
      case U'a':
        out += U'\a';
        break;
      case U'x':
        out += hex(2);
        break;
      case U'u':
        out += hex(4);
        break;
      case U'U':
        out += hex(8);
        break;
      default:
        if (e >= U'0' && e <= U'7') {
          char32_t v = e - U'0';
          for (int k = 0; k < 2 && i + 1 < in.size() && in[i + 1] >= U'0' && in[i + 1] <= U'7';
               ++k) {
            v = v * 8 + (in[++i] - U'0');
          }
          out += v;
        } else {
          out += U'\\';
          out += e;
        }
    }
  }
  return utf8_encode(out);
}

class Lexer {
 public:
  explicit Lexer(const std::string& source) : src_(normalize_source(source)) {}

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t start = find_tag(pos_);
      std::string text = src_.substr(pos_, start - pos_);
      if (start == src_.size()) {
        emit_text(text);
        advance_to(start);
        break;
      }
      char type = src_[start + 1];
      char sign = start + 2 < src_.size() ? src_[start + 2] : '\0';
      strip_before_tag(text, sign, type == '{', line_starting);
      emit_text(text);
      advance_to(start + 2 + (sign == '-' || sign == '+' ? 1 : 0));
      char end_sign = '\0';
      size_t raw_end = type == '%' ? match_block(pos_, "raw", &end_sign) : std::string::npos;
      if (type == '#') {
        size_t end = src_.find("#}", pos_);
        if (end == std::string::npos) syntax_error(line_, "missing end of comment tag");
        end_sign = end > pos_ ? src_[end - 1] : '\0';
        advance_to(end + 2);
        line_starting = finish_tag(end_sign, /*is_block=*/true);
      } else if (raw_end != std::string::npos) {
        advance_to(raw_end);
        // Jinja trims after "raw -%}" but keeps the newline after a plain "raw %}".
        line_starting = lex_raw(finish_tag(end_sign, /*is_block=*/false));
      } else {
        line_starting = lex_tag(type == '{');
      }
    }
    tokens_.push_back({Tok::kEof, line_, ""});
    return std::move(tokens_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return src_.size();
  }

  void advance_to(size_t pos) {
    for (; pos_ < pos; ++pos_) {
      if (src_[pos_] == '\n') ++line_;
    }
  }

  // Whitespace control before a tag: "-" strips all whitespace; otherwise lstrip_blocks takes
  // the indentation of a block or comment tag that starts its line, unless "+".
  static void strip_before_tag(std::string& text, char sign, bool is_var, bool line_starting) {
    if (sign == '-') {
      size_t end = text.size();
      while (end > 0 && is_space(text[end - 1])) --end;
      text.resize(end);
    } else if (sign != '+' && !is_var) {
      size_t line_start = text.rfind('\n');
      line_start = line_start == std::string::npos ? 0 : line_start + 1;
      if ((line_start > 0 || line_starting) && line_start < text.size() &&
          text.find_first_not_of(" \t\f\v\r", line_start) == std::string::npos) {
        text.resize(line_start);
      }
    }
  }

  // Matches "<spaces>word<spaces>[-+]%}" at p (just inside "{%" and its sign); returns the
  // position after "%}" and the sign before it, or npos.
  size_t match_block(size_t p, const char* word, char* end_sign) const {
    while (p < src_.size() && is_space(src_[p])) ++p;
    size_t len = std::char_traits<char>::length(word);
    if (src_.compare(p, len, word) != 0) return std::string::npos;
    p += len;
    if (p < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[p])) || src_[p] == '_')) {
      return std::string::npos;
    }
    while (p < src_.size() && is_space(src_[p])) ++p;
    *end_sign = '\0';
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) *end_sign = src_[p++];
    if (src_.compare(p, 2, "%}") != 0) return std::string::npos;
    return p + 2;
  }

  // The body of {% raw %}...{% endraw %}: text, with the endraw tag's whitespace control.
  // Returns whether the text after it starts a line.
  bool lex_raw(bool line_starting) {
    for (size_t p = pos_;;) {
      size_t tag = src_.find("{%", p);
      if (tag == std::string::npos) syntax_error(line_, "missing '{% endraw %}'");
      char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      char end_sign = '\0';
      size_t end = match_block(tag + 2 + (sign == '-' || sign == '+' ? 1 : 0), "endraw", &end_sign);
      if (end == std::string::npos) {
        p = tag + 2;
        continue;
      }
      std::string text = src_.substr(pos_, tag - pos_);
      strip_before_tag(text, sign, /*is_var=*/false, line_starting);
      emit_text(text);
      advance_to(end);
      return finish_tag(end_sign, /*is_block=*/true);
    }
  }

  void emit_text(const std::string& text) {
    if (!text.empty()) tokens_.push_back({Tok::kText, line_, text});
  }

  // Consumes what follows an end tag: all whitespace after "-", the first newline after a
  // block or comment (trim_blocks) unless "+". Returns whether the next text starts a line.
  bool finish_tag(char end_sign, bool is_block) {
    size_t before = pos_;
    if (end_sign == '-') {
      size_t p = pos_;
      while (p < src_.size() && is_space(src_[p])) ++p;
      advance_to(p);
    } else if (is_block && end_sign != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
      advance_to(pos_ + 1);
    }
    return pos_ > before && src_[pos_ - 1] == '\n';
  }

  bool lex_tag(bool is_var) {
    tokens_.push_back({is_var ? Tok::kVarBegin : Tok::kBlockBegin, line_, ""});
    const char* end = is_var ? "}}" : "%}";
    int depth = 0;  // Jinja only ends a tag where brackets balance: {{ {'a': {}} }}
    while (true) {
      while (pos_ < src_.size() && is_space(src_[pos_])) advance_to(pos_ + 1);
      if (pos_ >= src_.size()) syntax_error(line_, std::string("missing '") + end + "'");
      if (depth == 0) {
        for (char sign : {'-', '+', '\0'}) {
          size_t p = pos_ + (sign ? 1 : 0);
          if ((!sign || src_[pos_] == sign) && src_.compare(p, 2, end) == 0) {
            tokens_.push_back({is_var ? Tok::kVarEnd : Tok::kBlockEnd, line_, ""});
            advance_to(p + 2);
            return finish_tag(sign, !is_var);
          }
        }
      }
      lex_token(depth);
    }
  }

  void lex_token(int& depth) {
    char c = src_[pos_];
    size_t start = pos_;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t p = pos_;
      while (p < src_.size() &&
             (std::isalnum(static_cast<unsigned char>(src_[p])) || src_[p] == '_')) {
        ++p;
      }
      tokens_.push_back({Tok::kName, line_, src_.substr(start, p - start)});
      advance_to(p);
      return;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      lex_number();
      return;
    }
    if (c == '\'' || c == '"') {
      size_t p = pos_ + 1;
      while (p < src_.size() && src_[p] != c) p += src_[p] == '\\' ? 2 : 1;
      if (p >= src_.size()) syntax_error(line_, "unterminated string literal");
      int line = line_;
      tokens_.push_back(
          {Tok::kString, line, unescape(src_.substr(start + 1, p - start - 1), line)});
      advance_to(p + 1);
      return;
    }
    static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                 "/",  "%",  "~",  "<",  ">",  "(",  ")", "[", "]",
                                 "{",  "}",  ",",  ".",  ":",  "|",  "="};
    for (const char* op : kOps) {
      size_t len = std::char_traits<char>::length(op);
      if (src_.compare(pos_, len, op) == 0) {
        if (len == 1 && (c == '(' || c == '[' || c == '{')) ++depth;
        if (len == 1 && (c == ')' || c == ']' || c == '}')) --depth;
        tokens_.push_back({Tok::kOp, line_, op});
        advance_to(pos_ + len);
        return;
      }
    }
    syntax_error(line_, std::string("unexpected character '") + c + "'");
  }

  void lex_number() {
    size_t p = pos_;
    auto digits = [&] {
      while (p < src_.size() &&
             (std::isdigit(static_cast<unsigned char>(src_[p])) || src_[p] == '_')) {
        ++p;
      }
    };
    digits();
    bool is_float = false;
    // "x.0.1" style attribute chains stay integers, as Jinja's (?<!\.) rule does.
    bool after_dot =
        !tokens_.empty() && tokens_.back().kind == Tok::kOp && tokens_.back().text == ".";
    if (!after_dot && p + 1 < src_.size() && src_[p] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[p + 1]))) {
      ++p;
      digits();
      is_float = true;
    }
    if (!after_dot && p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q]))) {
        p = q;
        digits();
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = pos_; i < p; ++i) {
      if (src_[i] != '_') text += src_[i];
    }
    Token t{is_float ? Tok::kFloat : Tok::kInt, line_, text};
    if (is_float) {
      // strtod, not stod: Python reads 1e999 as inf and 1e-999 as 0.0 where stod throws.
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      // Python's integers are unbounded, ours 64-bit.
      if (errno == ERANGE) syntax_error(line_, "integer literal " + text + " is too large");
    }
    tokens_.push_back(t);
    advance_to(p);
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse() {
    std::string end;
    Body body = parse_body({}, &end);
    return body;
  }

 private:
  const Token& cur() const { return tokens_[pos_]; }
  const Token& peek(size_t ahead = 1) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  bool is_op(const char* op) const { return cur().kind == Tok::kOp && cur().text == op; }
  bool is_name(const char* name) const { return cur().kind == Tok::kName && cur().text == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++pos_;
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    ++pos_;
    return true;
  }
  std::string describe(const Token& t) const {
    switch (t.kind) {
      case Tok::kEof:
        return "end of template";
      case Tok::kText:
        return "template text";
      case Tok::kVarBegin:
        return "'{{'";
      case Tok::kVarEnd:
        return "'}}'";
      case Tok::kBlockBegin:
        return "'{%'";
      case Tok::kBlockEnd:
        return "'%}'";
      case Tok::kString:
        return "string literal";
      default:
        return "'" + t.text + "'";
    }
  }
  [[noreturn]] void unexpected(const std::string& wanted) const {
    syntax_error(cur().line, "expected " + wanted + ", got " + describe(cur()));
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) unexpected(std::string("'") + op + "'");
  }
  void expect(Tok kind, const char* what) {
    if (cur().kind != kind) unexpected(what);
    ++pos_;
  }
  std::string expect_name() {
    if (cur().kind != Tok::kName) unexpected("a name");
    return tokens_[pos_++].text;
  }

  // Adds a child (or an absent part, null) to `parent`, keeping parent->depth the height of
  // its tree: chains like a ~ b ~ c ~ ... build left-deep trees in a loop, not by recursion,
  // and evaluating or freeing a tree recurses once per level.
  void attach(Expr* parent, ExprPtr child) {
    if (child) note_child_depth(parent, *child);
    parent->args.push_back(std::move(child));
  }
  void attach_kwarg(Expr* parent, std::string key, ExprPtr child) {
    note_child_depth(parent, *child);
    parent->kwargs.emplace_back(std::move(key), std::move(child));
  }
  void note_child_depth(Expr* parent, const Expr& child) {
    parent->depth = std::max(parent->depth, child.depth + 1);
    if (parent->depth > kMaxNesting) {
      syntax_error(parent->line, cat("expression nested deeper than ", kMaxNesting, " levels"));
    }
  }

  // Counts one level of the parser's own recursion (blocks in blocks, brackets in brackets,
  // "not not ...", "- - ..."), which comes before any tree exists to measure.
  class Nested {
   public:
    explicit Nested(Parser& p) : p_(p) {
      if (p_.nesting_ == kMaxNesting) {
        syntax_error(p_.cur().line, cat("template nested deeper than ", kMaxNesting, " levels"));
      }
      ++p_.nesting_;
    }
    ~Nested() { --p_.nesting_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;

   private:
    Parser& p_;
  };

  ExprPtr node(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // Parses statements until one of `ends` opens a block; stores that keyword in *end and
  // leaves the parser right after it.
  Body parse_body(const std::set<std::string>& ends, std::string* end) {
    const Nested nested(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.kind == Tok::kEof) {
        if (!ends.empty()) {
          syntax_error(t.line, "unexpected end of template, expected one of: " + join(ends));
        }
        return body;
      }
      if (t.kind == Tok::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        ++pos_;
      } else if (t.kind == Tok::kVarBegin) {
        ++pos_;
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->line = t.line;
        s->expr = parse_expression();
        expect(Tok::kVarEnd, "'}}'");
        body.push_back(std::move(s));
      } else if (t.kind == Tok::kBlockBegin) {
        ++pos_;
        if (cur().kind == Tok::kName && ends.count(cur().text)) {
          *end = tokens_[pos_++].text;
          return body;
        }
        StmtPtr s = parse_statement();
        if (s) body.push_back(std::move(s));
      } else {
        unexpected("template text or a tag");
      }
    }
  }

  static std::string join(const std::set<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
    return out;
  }

  StmtPtr parse_statement() {
    int line = cur().line;
    std::string keyword = expect_name();
    auto s = std::make_unique<Stmt>();
    s->line = line;
    std::string end;
    if (keyword == "if") {
      s->kind = Stmt::Kind::kIf;
      s->conditions.push_back(parse_expression());
      expect(Tok::kBlockEnd, "'%}'");
      while (true) {
        s->bodies.push_back(parse_body({"elif", "else", "endif"}, &end));
        if (end == "elif") {
          s->conditions.push_back(parse_expression());
          expect(Tok::kBlockEnd, "'%}'");
        } else if (end == "else") {
          expect(Tok::kBlockEnd, "'%}'");
          s->bodies.push_back(parse_body({"endif"}, &end));
          break;
        } else {
          break;
        }
      }
    } else if (keyword == "for") {
      s->kind = Stmt::Kind::kFor;
      bool paren = skip_op("(");
      do {
        s->targets.push_back(expect_name());
      } while (skip_op(","));
      if (paren) expect_op(")");
      if (!skip_name("in")) unexpected("'in'");
      s->expr = parse_expression(/*with_condition=*/false);
      if (skip_name("if")) s->condition = parse_expression();
      if (is_name("recursive")) syntax_error(cur().line, "recursive loops are not supported");
      expect(Tok::kBlockEnd, "'%}'");
      s->bodies.push_back(parse_body({"else", "endfor"}, &end));
      if (end == "else") {
        expect(Tok::kBlockEnd, "'%}'");
        s->bodies.push_back(parse_body({"endfor"}, &end));
      }
    } else if (keyword == "set") {
      s->targets.push_back(expect_name());
      if (skip_op(".")) {
        s->attr = expect_name();
      } else {
        while (skip_op(",")) s->targets.push_back(expect_name());
      }
      if (skip_op("=")) {
        s->kind = Stmt::Kind::kSet;
        s->expr = parse_expression();
      } else {
        if (!s->attr.empty() || s->targets.size() != 1) unexpected("'='");
        s->kind = Stmt::Kind::kSetBlock;
        expect(Tok::kBlockEnd, "'%}'");
        s->bodies.push_back(parse_body({"endset"}, &end));
      }
    } else if (keyword == "macro") {
      s->kind = Stmt::Kind::kMacro;
      s->text = expect_name();
      expect_op("(");
      while (!skip_op(")")) {
        if (!s->targets.empty()) expect_op(",");
        s->targets.push_back(expect_name());
        s->defaults.push_back(skip_op("=") ? parse_expression() : nullptr);
      }
      expect(Tok::kBlockEnd, "'%}'");
      s->bodies.push_back(parse_body({"endmacro"}, &end));
    } else if (keyword == "break" || keyword == "continue") {
      s->kind = keyword == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
    } else if (keyword == "generation") {
      // transformers' {% generation %} marks assistant text for masks; it renders its body.
      s->kind = Stmt::Kind::kIf;
      auto always = node(Expr::Kind::kLiteral, line);
      always->value = Value::boolean(true);
      s->conditions.push_back(std::move(always));
      expect(Tok::kBlockEnd, "'%}'");
      s->bodies.push_back(parse_body({"endgeneration"}, &end));
    } else {
      syntax_error(line, "unknown tag '" + keyword + "'");
    }
    expect(Tok::kBlockEnd, "'%}'");
    return s;
  }

  ExprPtr parse_expression(bool with_condition = true) {
    const Nested nested(*this);
    ExprPtr e = parse_or();
    while (with_condition && is_name("if")) {
      int line = cur().line;
      ++pos_;
      auto cond = node(Expr::Kind::kCond, line);
      attach(cond.get(), parse_or());
      attach(cond.get(), std::move(e));
      attach(cond.get(), skip_name("else") ? parse_expression() : nullptr);
      e = std::move(cond);
    }
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      auto n = node(Expr::Kind::kOr, cur().line);
      ++pos_;
      attach(n.get(), std::move(e));
      attach(n.get(), parse_and());
      e = std::move(n);
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      auto n = node(Expr::Kind::kAnd, cur().line);
      ++pos_;
      attach(n.get(), std::move(e));
      attach(n.get(), parse_not());
      e = std::move(n);
    }
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      const Nested nested(*this);
      auto n = node(Expr::Kind::kNot, cur().line);
      ++pos_;
      attach(n.get(), parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    const int line = e->line;
    ExprPtr chain;
    while (true) {
      std::string op;
      if (cur().kind == Tok::kOp &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">="))) {
        op = cur().text;
        ++pos_;
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && peek().kind == Tok::kName && peek().text == "in") {
        pos_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!chain) {
        chain = node(Expr::Kind::kCompare, line);
        attach(chain.get(), std::move(e));
      }
      chain->ops.push_back(op);
      attach(chain.get(), parse_math1());
    }
    return chain ? std::move(chain) : std::move(e);
  }

  ExprPtr binary(const std::string& op, ExprPtr lhs, ExprPtr rhs, int line) {
    auto n = node(Expr::Kind::kBinary, line);
    n->name = op;
    attach(n.get(), std::move(lhs));
    attach(n.get(), std::move(rhs));
    return n;
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().text;
      int line = cur().line;
      ++pos_;
      e = binary(op, std::move(e), parse_concat(), line);
    }
    return e;
  }

  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      int line = cur().line;
      ++pos_;
      e = binary("~", std::move(e), parse_math2(), line);
    }
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().text;
      int line = cur().line;
      ++pos_;
      e = binary(op, std::move(e), parse_pow(), line);
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary();
    while (is_op("**")) {
      int line = cur().line;
      ++pos_;
      e = binary("**", std::move(e), parse_unary(), line);
    }
    return e;
  }

  // As Jinja: a sign binds to its operand's postfix chain, filters and tests apply after.
  ExprPtr parse_unary(bool with_filter = true) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Nested nested(*this);
      bool neg = is_op("-");
      int line = cur().line;
      ++pos_;
      ExprPtr operand = parse_unary(false);
      if (neg) {
        e = node(Expr::Kind::kNeg, line);
        attach(e.get(), std::move(operand));
      } else {
        e = std::move(operand);
      }
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    int line = t.line;
    if (t.kind == Tok::kName) {
      ++pos_;
      auto lit = node(Expr::Kind::kLiteral, line);
      if (t.text == "true" || t.text == "True") {
        lit->value = Value::boolean(true);
      } else if (t.text == "false" || t.text == "False") {
        lit->value = Value::boolean(false);
      } else if (t.text == "none" || t.text == "None") {
        lit->value = Value::none();
      } else {
        auto n = node(Expr::Kind::kName, line);
        n->name = t.text;
        return n;
      }
      return lit;
    }
    if (t.kind == Tok::kString) {
      std::string s;
      while (cur().kind == Tok::kString) s += tokens_[pos_++].text;
      auto lit = node(Expr::Kind::kLiteral, line);
      lit->value = Value::string(std::move(s));
      return lit;
    }
    if (t.kind == Tok::kInt || t.kind == Tok::kFloat) {
      ++pos_;
      auto lit = node(Expr::Kind::kLiteral, line);
      lit->value = t.kind == Tok::kInt ? Value::integer(t.int_value) : Value::number(t.float_value);
      return lit;
    }
    if (skip_op("(")) {
      if (skip_op(")")) return node(Expr::Kind::kTuple, line);
      ExprPtr e = parse_expression();
      if (is_op(",")) {
        auto tuple = node(Expr::Kind::kTuple, line);
        attach(tuple.get(), std::move(e));
        while (skip_op(",") && !is_op(")")) attach(tuple.get(), parse_expression());
        e = std::move(tuple);
      }
      expect_op(")");
      return e;
    }
    if (skip_op("[")) {
      auto list = node(Expr::Kind::kList, line);
      while (!skip_op("]")) {
        if (!list->args.empty()) {
          expect_op(",");
          if (skip_op("]")) break;
        }
        attach(list.get(), parse_expression());
      }
      return list;
    }
    if (skip_op("{")) {
      auto dict = node(Expr::Kind::kDict, line);
      while (!skip_op("}")) {
        if (!dict->args.empty()) {
          expect_op(",");
          if (skip_op("}")) break;
        }
        attach(dict.get(), parse_expression());
        expect_op(":");
        attach(dict.get(), parse_expression());
      }
      return dict;
    }
    unexpected("an expression");
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      int line = cur().line;
      if (skip_op(".")) {
        if (cur().kind == Tok::kInt) {
          auto item = node(Expr::Kind::kItem, line);
          auto index = node(Expr::Kind::kLiteral, line);
          index->value = Value::integer(tokens_[pos_++].int_value);
          attach(item.get(), std::move(e));
          attach(item.get(), std::move(index));
          e = std::move(item);
        } else {
          auto attr = node(Expr::Kind::kAttr, line);
          attr->name = expect_name();
          attach(attr.get(), std::move(e));
          e = std::move(attr);
        }
      } else if (skip_op("[")) {
        e = parse_subscript(std::move(e), line);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr target, int line) {
    ExprPtr parts[3];
    bool is_slice = false;
    int part = 0;
    while (!skip_op("]")) {
      if (skip_op(":")) {
        is_slice = true;
        if (++part > 2) unexpected("']'");
      } else {
        if (parts[part]) unexpected("':' or ']'");
        parts[part] = parse_expression();
      }
    }
    auto n = node(is_slice ? Expr::Kind::kSlice : Expr::Kind::kItem, line);
    if (!is_slice && !parts[0]) unexpected("a subscript");
    attach(n.get(), std::move(target));
    for (int i = 0; i < (is_slice ? 3 : 1); ++i) attach(n.get(), std::move(parts[i]));
    return n;
  }

  // Parses "(args, name=value)" into n->args (after what is already there) and n->kwargs.
  void parse_call_args(Expr* n) {
    expect_op("(");
    while (!skip_op(")")) {
      if (cur().kind == Tok::kName && peek().kind == Tok::kOp && peek().text == "=") {
        std::string key = expect_name();
        ++pos_;
        attach_kwarg(n, key, parse_expression());
      } else {
        if (!n->kwargs.empty()) syntax_error(cur().line, "positional argument after keyword");
        attach(n, parse_expression());
      }
      if (!is_op(")")) expect_op(",");
    }
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto call = node(Expr::Kind::kCall, callee->line);
    attach(call.get(), std::move(callee));
    parse_call_args(call.get());
    return call;
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      int line = cur().line;
      if (skip_op("|")) {
        auto f = node(Expr::Kind::kFilter, line);
        f->name = expect_name();
        attach(f.get(), std::move(e));
        if (is_op("(")) parse_call_args(f.get());
        e = std::move(f);
      } else if (skip_name("is")) {
        auto t = node(Expr::Kind::kTest, line);
        t->negated = skip_name("not");
        t->name = expect_name();
        attach(t.get(), std::move(e));
        if (is_op("(")) {
          parse_call_args(t.get());
        } else if ((cur().kind == Tok::kName || cur().kind == Tok::kString ||
                    cur().kind == Tok::kInt || cur().kind == Tok::kFloat || is_op("[") ||
                    is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          attach(t.get(), parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int nesting_ = 0;  // levels of parse_body/parse_expression/... now on the stack
};

}  // namespace

Body parse_template(const std::string& source) { return Parser(Lexer(source).run()).parse(); }

}  // namespace pagedlm::jinja
