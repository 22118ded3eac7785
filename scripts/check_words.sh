#!/usr/bin/env bash
# Checks that the tracked tree speaks of the project only: docs, comments and scripts name
# measurements by date, commit and machine ("2-core AMD EPYC, 2026-12-02, 322dfd3"), never by a
# tracker's numbers ("issue 19", "the issue asks") or by the places and arrangements the work was
# done in ("the dev VM", "design notes", work sessions, device loans). Prints each hit as
# file:line: text; exits 1 if any.
set -euo pipefail
cd "$(dirname "$0")/.."

# Extended regular expressions, matched case-insensitively. Each is narrow enough that the
# project's own vocabulary passes: helper functions and threads, a browser's sessionId, CSS
# colours (#666), `<issue_start>` tokens in tokenizer data, "issuing instructions".
patterns=(
  '\bissues? #?[0-9]+'                        # issue 19, issue #19
  "\\bissue's"                                # the issue's bound
  '\bthe (benchmark |original |tracking )?issue\b'  # the issue asked for, the benchmark issue
  '\b(task|ticket|bug|pr|pull request) #?[0-9]+\b'  # task 3, PR #12
  '\(#[0-9]+\)'                               # (#12)
  '\bdev(elopment)? (vm|box|machine)\b'       # the dev VM
  '\bdesign (notes|review)\b'                 # the project's design notes
  '\b(work|coding|agent|chat) sessions?\b'
  '\bhelpers? (agent|session|branch|worktree)s?\b'
  '\b(device|gpu|machine) (calls?|loans?|leases?)\b'
  '\bloan(s|ed)?\b'
)
regex=$(IFS='|'; echo "${patterns[*]}")

# Every tracked text file but this one; testdata holds third-party data (tokenizers, templates),
# so only its own notes are read.
search() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git grep -nIiE "$regex" -- . ':!scripts/check_words.sh' ':!testdata/' || true
    git grep -nIiE "$regex" -- 'testdata/*.md' || true
  else  # an unpacked source tree: the same files by name
    grep -rnIiE "$regex" --exclude=check_words.sh --exclude-dir=testdata --exclude-dir=build \
      --exclude-dir=.git . | sed 's|^\./||' || true
    grep -rnIiE "$regex" --include='*.md' testdata | sed 's|^\./||' || true
  fi
}
status=0
while IFS= read -r hit; do
  echo "$hit"
  status=1
done < <(search)
if [[ $status == 0 ]]; then
  echo "check_words: no tracker numbers, dev machines or work arrangements named"
fi
exit $status
