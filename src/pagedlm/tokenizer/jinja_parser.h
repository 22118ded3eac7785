// Lexer and parser for the Jinja2 subset of chat templates. The lexer applies the environment
// Hugging Face renders chat templates with: trim_blocks=True, lstrip_blocks=True, loop
// controls, no autoescape, one trailing newline of the source dropped.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/tokenizer/jinja_value.h"

namespace pagedlm::jinja {

// The deepest a template may nest blocks in blocks, or expressions in expressions (counting
// both brackets and operator chains). Templates come from model files or --chat-template, and
// parsing, evaluating and freeing them recurse once per level; real ones nest a few levels.
inline constexpr int kMaxNesting = 256;

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,  // value
    kName,     // name
    kList,     // args: items
    kTuple,    // args: items
    kDict,     // args: key, value, key, value, ...
    kAttr,     // args[0].name
    kItem,     // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]], absent parts are null
    kCall,     // args[0](args[1..], kwargs)
    kFilter,   // args[0] | name(args[1..], kwargs)
    kTest,     // args[0] is [not] name(args[1..])
    kNot,      // not args[0]
    kNeg,      // -args[0]
    kBinary,   // args[0] op args[1], op in + - * / // % ** ~
    kCompare,  // args[0] ops[0] args[1] ops[1] ...: == != < <= > >= in "not in", chained
               // as in Python
    kAnd,
    kOr,
    kCond,  // args[1] if args[0] else args[2] (args[2] may be null)
  };
  Kind kind;
  int line = 0;
  int depth = 1;  // the height of the tree below (a leaf is 1); see kMaxNesting
  Value value;
  std::string name;  // variable, attribute, filter, test or operator
  bool negated = false;
  std::vector<ExprPtr> args;
  std::vector<std::string> ops;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // conditions[i] guards bodies[i]; an extra body is the else branch
    kFor,       // for targets in expr [if condition]: bodies[0], else bodies[1]
    kSet,       // set targets = expr, or set targets[0].attr = expr
    kSetBlock,  // set targets[0] %} bodies[0] {% endset
    kMacro,     // macro name(targets with defaults) bodies[0]
    kBreak,
    kContinue,
  };
  Kind kind;
  int line = 0;
  std::string text;
  std::string attr;  // kSet on a namespace attribute
  ExprPtr expr;
  ExprPtr condition;
  std::vector<ExprPtr> conditions;
  std::vector<std::string> targets;
  std::vector<ExprPtr> defaults;  // kMacro: one per parameter, null when it has none
  std::vector<Body> bodies;
};

// Parses a template; throws pagedlm::Error "chat template syntax error at line N: ..." on
// malformed input.
Body parse_template(const std::string& source);

}  // namespace pagedlm::jinja
