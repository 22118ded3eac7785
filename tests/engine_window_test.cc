// A model whose every layer slides gives its pages behind the window back to the pool; that must
// change nothing it computes. The mistral fixture with a window of 24 runs long prompts through
// two engines, one releasing pages and one keeping them all, and both must give the same bits.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "pagedlm/engine/engine.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kWindow = 24;

// The mistral fixture with "sliding_window" set to kWindow, in a folder of its own.
fs::path windowed_mistral() {
  const fs::path source = fs::path(PAGEDLM_TESTDATA) / "fixtures" / "mistral";
  const fs::path dir =
      fs::temp_directory_path() / ("pagedlm_window_mistral_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const char* name : {"model.safetensors", "generation_config.json"}) {
    fs::copy_file(source / name, dir / name, fs::copy_options::overwrite_existing);
  }
  nlohmann::json config = nlohmann::json::parse(std::ifstream(source / "config.json"));
  config["sliding_window"] = kWindow;
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir;
}

struct WindowRun {
  std::vector<RequestOutput> outputs;  // in the order the requests were added
  int32_t peak_pages_used = 0;
  int32_t most_released_entries = 0;  // in one step's page tables
  SchedulerStats final_stats;
};

std::vector<int32_t> random_tokens(std::mt19937& rng, int32_t count) {
  std::vector<int32_t> tokens(count);
  for (int32_t& t : tokens) t = std::uniform_int_distribution<int32_t>(3, 511)(rng);
  return tokens;
}

// Three long prompts, chunked by a budget of 64: A first; B, which begins with A's first 100
// tokens, joins after two steps, when A has released the pages that B finds in the prefix cache;
// C, unrelated, joins with B. Every prompt position's logits and 40 greedy tokens each.
WindowRun run(const Checkpoint& checkpoint, int32_t page_size, int32_t num_pages, bool release) {
  EngineOptions opts;
  opts.page_size = page_size;
  opts.num_pages = num_pages;
  opts.max_num_batched_tokens = 64;
  opts.free_pages_outside_window = release;
  Engine engine(checkpoint, opts);
  EXPECT_EQ(engine.config().window_of_all_layers(), kWindow);

  std::mt19937 rng(29);
  const std::vector<int32_t> a = random_tokens(rng, 200);
  std::vector<int32_t> b(a.begin(), a.begin() + 100);
  const std::vector<int32_t> b_rest = random_tokens(rng, 60);
  b.insert(b.end(), b_rest.begin(), b_rest.end());
  const std::vector<int32_t> c = random_tokens(rng, 180);
  auto request = [](const std::vector<int32_t>& prompt) {
    Request r;
    r.prompt = prompt;
    r.want_prompt_logits = true;
    r.sampling.max_tokens = 40;
    r.sampling.ignore_eos = true;
    return r;
  };

  WindowRun result;
  std::vector<int64_t> ids = {engine.add_request(request(a))};
  std::map<int64_t, RequestOutput> finished;
  for (int32_t step = 0; engine.has_unfinished(); ++step) {
    for (const RequestEvent& e : engine.step()) {
      if (e.finished) finished[e.request_id] = engine.take_output(e.request_id);
    }
    if (step == 1) {
      ids.push_back(engine.add_request(request(b)));
      ids.push_back(engine.add_request(request(c)));
    }
    const SchedulerStats stats = engine.stats();
    EXPECT_EQ(stats.pages_used + stats.pages_free + stats.pages_reserved, stats.pages_total);
    result.peak_pages_used = std::max(result.peak_pages_used, stats.pages_used);
    int32_t released = 0;
    for (const SequenceView& view : engine.sequence_map()) {
      released += static_cast<int32_t>(
          std::count(view.pages.begin(), view.pages.end(), SequenceView::kReleasedPage));
    }
    result.most_released_entries = std::max(result.most_released_entries, released);
  }
  for (const int64_t id : ids) result.outputs.push_back(std::move(finished.at(id)));
  result.final_stats = engine.stats();
  return result;
}

bool same_bits(const Tensor& x, const Tensor& y) {
  return x.shape() == y.shape() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

class EngineWindow : public ::testing::TestWithParam<int32_t> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(windowed_mistral());
    checkpoint_ = new Checkpoint(load_checkpoint(dir_->string()));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
    fs::remove_all(*dir_);
    delete dir_;
    dir_ = nullptr;
  }
  static fs::path* dir_;
  static Checkpoint* checkpoint_;
};

fs::path* EngineWindow::dir_ = nullptr;
Checkpoint* EngineWindow::checkpoint_ = nullptr;

TEST_P(EngineWindow, ReleasingPagesBehindTheWindowChangesNoLogitOrToken) {
  const int32_t page_size = GetParam();
  // Keeping every page, the three sequences (240 + 200 + 220 tokens) fit side by side.
  const WindowRun kept = run(*checkpoint_, page_size, 720 / page_size + 8, /*release=*/false);
  // Releasing, the pool holds the longest sequence and its null page, barely more: the
  // released pages must be reused for the run to finish without waiting on whole sequences.
  const WindowRun released = run(*checkpoint_, page_size, 240 / page_size + 2, /*release=*/true);

  EXPECT_EQ(kept.most_released_entries, 0);
  EXPECT_EQ(kept.final_stats.pages_reserved, 0);
  EXPECT_GT(released.most_released_entries, 0);
  EXPECT_LT(released.peak_pages_used, kept.peak_pages_used);
  EXPECT_EQ(released.final_stats.pages_reserved, 1);
  EXPECT_EQ(released.final_stats.pages_used, 0);
  EXPECT_EQ(released.final_stats.pages_free,
            released.final_stats.pages_total - released.final_stats.pages_reserved);
  // B's first 100 tokens were in the cache when it arrived, A's released pages among them: whole
  // pages shared, the rest of the page holding token 99 copied from A's.
  EXPECT_EQ(kept.outputs[1].num_cached_tokens, 100);
  EXPECT_EQ(released.outputs[1].num_cached_tokens, 100);

  ASSERT_EQ(kept.outputs.size(), released.outputs.size());
  for (size_t i = 0; i < kept.outputs.size(); ++i) {
    EXPECT_EQ(released.outputs[i].tokens, kept.outputs[i].tokens) << "request " << i;
    EXPECT_EQ(released.outputs[i].tokens.size(), 40u) << "request " << i;
    // Rows served by the prefix cache stay zero in both: the same rows must have been computed.
    EXPECT_TRUE(same_bits(released.outputs[i].prompt_logits, kept.outputs[i].prompt_logits))
        << "request " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizes, EngineWindow, ::testing::Values(1, 4, 16));

}  // namespace
}  // namespace pagedlm
