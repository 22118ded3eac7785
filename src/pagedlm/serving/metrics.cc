#include "pagedlm/serving/metrics.h"

#include <algorithm>
#include <cstdio>

namespace pagedlm::serving {

namespace {

std::string format_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

void add_metric(std::string* out, const char* type, const std::string& name,
                const std::string& help, double value) {
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  *out += name + " " + format_number(value) + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

void Histogram::render(const std::string& name, const std::string& help, std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    const std::string le = i < bounds_.size() ? format_number(bounds_[i]) : "+Inf";
    *out += name;
    *out += "_bucket{le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  *out += name + "_sum " + format_number(sum_) + "\n";
  *out += name + "_count " + std::to_string(count_) + "\n";
}

std::string render_prometheus(const SchedulerStats& stats, int32_t num_queued,
                              const ServingCounters& counters, const ServingMetrics& metrics) {
  std::string out;
  add_metric(&out, "gauge", "pagedlm_num_requests_running", "Requests in the running batch.",
             stats.num_running);
  add_metric(&out, "gauge", "pagedlm_num_requests_waiting",
             "Requests waiting for admission (engine queue plus server queue).",
             stats.num_waiting + num_queued);
  add_metric(&out, "gauge", "pagedlm_kv_pages_total", "KV cache pages in the pool.",
             stats.pages_total);
  add_metric(&out, "gauge", "pagedlm_kv_pages_used", "KV cache pages held by requests.",
             stats.pages_used);
  add_metric(&out, "gauge", "pagedlm_kv_pages_free", "KV cache pages no request holds.",
             stats.pages_free);
  add_metric(&out, "gauge", "pagedlm_kv_pages_cached",
             "Free KV cache pages still findable by the prefix cache.", stats.pages_cached);
  add_metric(&out, "counter", "pagedlm_prefix_cache_queries_total",
             "Prompt tokens looked up in the prefix cache.", stats.prefix_query_tokens);
  add_metric(&out, "counter", "pagedlm_prefix_cache_hits_total",
             "Prompt tokens served by the prefix cache.", stats.prefix_hit_tokens);
  add_metric(&out, "counter", "pagedlm_prefix_cache_partial_hits_total",
             "Admissions whose prefix-cache hit ended inside a page (its leading tokens copied).",
             stats.prefix_partial_hits);
  add_metric(&out, "counter", "pagedlm_prefix_cache_partial_hit_tokens_total",
             "Prompt tokens served by copying a cached page's leading tokens (part of the hits).",
             stats.prefix_partial_hit_tokens);
  add_metric(&out, "counter", "pagedlm_num_preemptions_total", "Requests preempted.",
             stats.preemptions);
  add_metric(&out, "counter", "pagedlm_prompt_tokens_total", "Prompt tokens of admitted requests.",
             counters.prompt_tokens);
  add_metric(&out, "counter", "pagedlm_generation_tokens_total", "Tokens generated.",
             counters.generation_tokens);
  add_metric(&out, "counter", "pagedlm_grammar_masked_steps_total",
             "Steps that filled token masks for structured output.", counters.masked_steps);
  add_metric(&out, "counter", "pagedlm_grammar_mask_seconds_total",
             "Engine thread's time getting token masks (filling or waiting for them).",
             counters.mask_seconds);
  add_metric(&out, "counter", "pagedlm_grammar_mask_prefetch_seconds_total",
             "Worker time filling token masks ahead of their step.",
             counters.mask_prefetch_seconds);
  add_metric(&out, "counter", "pagedlm_grammar_forward_gpu_seconds_total",
             "Device time of masked steps' forward passes (GPU).",
             counters.masked_forward_gpu_seconds);
  add_metric(&out, "counter", "pagedlm_grammar_sampler_gpu_seconds_total",
             "Device time of masked steps' mask upload, sampler and token download (GPU).",
             counters.masked_sampler_gpu_seconds);
  add_metric(&out, "counter", "pagedlm_grammar_prefetched_masks_total",
             "Token masks filled ahead of their step and used by it.", counters.prefetched_masks);
  add_metric(&out, "counter", "pagedlm_grammar_mask_hidden_steps_total",
             "Masked steps whose masks were done before the GPU forward pass.",
             counters.mask_hidden_steps);
  add_metric(&out, "counter", "pagedlm_engine_steps_total", "Engine steps that produced events.",
             counters.steps);
  add_metric(&out, "counter", "pagedlm_engine_step_schedule_seconds_total",
             "Host time of the steps' scheduling.", counters.step_schedule_seconds);
  add_metric(&out, "counter", "pagedlm_engine_step_prepare_seconds_total",
             "Host time of the steps from their plan until the device is waited for (staging, "
             "launches, token masks; on the CPU the forward pass).",
             counters.step_prepare_seconds);
  add_metric(&out, "counter", "pagedlm_engine_step_wait_seconds_total",
             "Host time of the steps waiting for the device.", counters.step_wait_seconds);
  add_metric(&out, "counter", "pagedlm_engine_step_finish_seconds_total",
             "Host time of the steps after the device (grammar advances, events).",
             counters.step_finish_seconds);
  add_metric(&out, "counter", "pagedlm_engine_step_gpu_seconds_total",
             "Device time of the steps (GPU).", counters.step_gpu_seconds);
  add_metric(&out, "counter", "pagedlm_engine_event_seconds_total",
             "Engine thread's time handing the steps' tokens to their requests.",
             counters.event_seconds);
  add_metric(&out, "counter", "pagedlm_requests_finished_total", "Requests that ran to completion.",
             counters.requests_finished);
  add_metric(&out, "counter", "pagedlm_requests_cancelled_total",
             "Requests cancelled (client gone or stop string matched).",
             counters.requests_cancelled);
  add_metric(&out, "counter", "pagedlm_requests_rejected_total",
             "Requests refused because the waiting queue was full.", counters.requests_rejected);
  metrics.time_to_first_token.render("pagedlm_time_to_first_token_seconds",
                                     "Time from arrival to the first generated token.", &out);
  metrics.inter_token_latency.render("pagedlm_inter_token_latency_seconds",
                                     "Time between consecutive tokens of a request.", &out);
  return out;
}

}  // namespace pagedlm::serving
