// The TCP rendezvous of tensor-parallel ranks in separate processes, on loopback: the payload
// reaches every rank; another world size, another model, a rank twice or a rank that never comes
// fails every side with its reason within the timeout; a rank whose process is gone is an error
// on the other side, not a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "pagedlm/engine/plan_wire.h"
#include "pagedlm/engine/rendezvous.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kLong{20000};  // never reached by a passing test

std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Runs `world - 1` clients on threads (rank r with clients[r - 1]'s world size and fingerprint)
// against a server; returns the server's error ("" if none) and each client's.
struct Outcome {
  std::string server;
  std::vector<std::string> clients;
  std::vector<std::string> payloads;
};

Outcome rendezvous(int32_t world, const std::vector<std::pair<int32_t, int32_t>>& rank_and_world,
                   const std::vector<uint64_t>& fingerprints, milliseconds timeout) {
  RendezvousServer server("127.0.0.1", 0, world, 42);
  Outcome out;
  out.clients.resize(rank_and_world.size());
  out.payloads.resize(rank_and_world.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < rank_and_world.size(); ++i) {
    threads.emplace_back([&, i] {
      out.clients[i] = error_of([&] {
        RendezvousClient c("127.0.0.1", server.port(), rank_and_world[i].first,
                           rank_and_world[i].second, fingerprints[i], kLong);
        out.payloads[i] = c.payload();
      });
    });
  }
  out.server = error_of([&] { server.accept_all("nccl-id", timeout); });
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(Rendezvous, EveryRankGetsThePayload) {
  const Outcome o = rendezvous(4, {{3, 4}, {1, 4}, {2, 4}}, {42, 42, 42}, kLong);
  EXPECT_EQ(o.server, "");
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(o.clients[i], "");
    EXPECT_EQ(o.payloads[i], "nccl-id");
  }
}

TEST(Rendezvous, AnotherWorldSizeFailsBothSides) {
  const Outcome o = rendezvous(2, {{1, 4}}, {42}, kLong);
  EXPECT_NE(o.server.find("rank 1 was started with 4 ranks, rank 0 with 2"), std::string::npos)
      << o.server;
  EXPECT_EQ(o.clients[0], o.server);
}

TEST(Rendezvous, AnotherModelFailsBothSides) {
  const Outcome o = rendezvous(2, {{1, 2}}, {7}, kLong);
  EXPECT_NE(o.server.find("rank 1 loaded another model"), std::string::npos) << o.server;
  EXPECT_EQ(o.clients[0], o.server);
}

TEST(Rendezvous, ARankTwiceIsRefused) {
  const Outcome o = rendezvous(3, {{1, 3}, {1, 3}}, {42, 42}, kLong);
  EXPECT_NE(o.server.find("rank 1 joined twice"), std::string::npos) << o.server;
  for (const std::string& e : o.clients) EXPECT_EQ(e, o.server);
}

TEST(Rendezvous, ARankThatNeverComesTimesOutAndTellsTheOthers) {
  const auto begin = std::chrono::steady_clock::now();
  const Outcome o = rendezvous(3, {{2, 3}}, {42}, milliseconds(300));
  EXPECT_NE(o.server.find("rank(s) 1 did not join within 300 ms"), std::string::npos) << o.server;
  EXPECT_EQ(o.clients[0], o.server);
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(10));
}

TEST(Rendezvous, NoRankZeroTimesOut) {
  int port = 0;
  {
    RendezvousServer probe("127.0.0.1", 0, 2, 42);  // a port that is then closed
    port = probe.port();
  }
  const std::string e =
      error_of([&] { RendezvousClient c("127.0.0.1", port, 1, 2, 42, milliseconds(300)); });
  EXPECT_NE(e.find("cannot reach rank 0"), std::string::npos) << e;
}

TEST(Rendezvous, AGoneProcessIsAnErrorOnTheOtherSide) {
  RendezvousServer server("127.0.0.1", 0, 2, 42);
  auto client = std::async(std::launch::async, [&] {
    return std::make_unique<RendezvousClient>("127.0.0.1", server.port(), 1, 2, 42, kLong);
  });
  server.accept_all("id", kLong);
  std::unique_ptr<RendezvousClient> c = client.get();
  server.broadcast("step 1");
  EXPECT_EQ(c->receive(kLong), "step 1");
  EXPECT_NE(error_of([&] { c->receive(milliseconds(100)); }).find("nothing from rank 0 for 100"),
            std::string::npos);
  c.reset();  // rank 1's process ends
  std::string e;
  for (int i = 0; i < 100 && e.empty(); ++i) {  // the first send after a reset may still succeed
    e = error_of([&] { server.broadcast(std::string(1 << 16, 'x')); });
  }
  EXPECT_NE(e.find("rank 1's process is gone"), std::string::npos) << e;
}

TEST(Rendezvous, RankZeroGoneEndsTheWorker) {
  auto server = std::make_unique<RendezvousServer>("127.0.0.1", 0, 2, 42);
  auto client = std::async(std::launch::async, [&, port = server->port()] {
    return std::make_unique<RendezvousClient>("127.0.0.1", port, 1, 2, 42, kLong);
  });
  server->accept_all("id", kLong);
  std::unique_ptr<RendezvousClient> c = client.get();
  server.reset();
  const std::string e = error_of([&] { c->receive(kLong); });
  EXPECT_NE(e.find("rank 0's process is gone"), std::string::npos) << e;
}

// What the ranks agree the KV cache's pages over: every rank's message reaches rank 0 in rank
// order, whatever order they are sent in; a rank gone before it sent is named, and one that
// sends nothing is a timeout naming it.
TEST(Rendezvous, RankZeroGathersOneMessageOfEachRank) {
  RendezvousServer server("127.0.0.1", 0, 3, 42);
  auto joined = [&](int32_t rank) {
    return std::async(std::launch::async, [&, rank] {
      return std::make_unique<RendezvousClient>("127.0.0.1", server.port(), rank, 3, 42, kLong);
    });
  };
  auto one = joined(1), two = joined(2);
  server.accept_all("id", kLong);
  std::unique_ptr<RendezvousClient> c1 = one.get(), c2 = two.get();
  c2->send("fits 7");
  c1->send("fits 9");
  EXPECT_EQ(server.gather(kLong), (std::vector<std::string>{"fits 9", "fits 7"}));
  c1->send("again");
  std::string e = error_of([&] { server.gather(milliseconds(100)); });
  EXPECT_NE(e.find("rank 2: nothing within 100 ms"), std::string::npos) << e;
  c2.reset();  // rank 2's process ends before it sends
  c1->send("again");
  // The timed-out gather above read rank 1's "again"; this one reads the second.
  e = error_of([&] { server.gather(kLong); });
  EXPECT_NE(e.find("rank 2's process is gone"), std::string::npos) << e;
}

TEST(Rendezvous, EndpointsAreHostColonPort) {
  EXPECT_EQ(parse_endpoint("10.0.0.1:29500"), std::make_pair(std::string("10.0.0.1"), 29500));
  EXPECT_NE(error_of([] { parse_endpoint("10.0.0.1"); }).find("is not HOST:PORT"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_endpoint("h:70000"); }).find("no valid port"), std::string::npos);
  EXPECT_NE(error_of([] { parse_endpoint("h:12x"); }).find("no valid port"), std::string::npos);
}

TEST(Rendezvous, TheFingerprintTellsModelsApart) {
  const ModelConfig a =
      load_checkpoint(std::string(PAGEDLM_TESTDATA) + "/fixtures/llama-gqa").config;
  ModelConfig b = a;
  EXPECT_EQ(model_fingerprint(a), model_fingerprint(b));
  b.num_layers += 1;
  EXPECT_NE(model_fingerprint(a), model_fingerprint(b));
}

// What rank 0 sends each step comes out whole on the other side; a cut message is an error.
TEST(PlanWire, AStepRoundTripsAndACutOneIsRefused) {
  StepPlan p;
  p.page_size = 64;
  p.null_page = 7;
  p.token_ids = {5, 6, 7};
  p.positions = {0, 1, 9};
  p.q_indptr = {0, 2, 3};
  p.kv_indptr = {0, 1, 3};
  p.kv_page_indices = {4, 7, 2};
  p.kv_last_page_len = {2, 10};
  p.slot_mapping = {256, 257, 137};
  p.kv_copies = {1, 2, 3};
  p.logits_rows = {1, 2};
  p.logits_indptr = {0, 1, 2};
  p.request_ids = {11, int64_t{1} << 40};
  p.samples = {1, 0};
  const std::string bytes = encode_step(p, true);
  const WireStep s = decode_step(bytes);
  EXPECT_TRUE(s.want_logits);
  EXPECT_EQ(s.plan.page_size, 64);
  EXPECT_EQ(s.plan.null_page, 7);
  EXPECT_EQ(s.plan.token_ids, p.token_ids);
  EXPECT_EQ(s.plan.positions, p.positions);
  EXPECT_EQ(s.plan.q_indptr, p.q_indptr);
  EXPECT_EQ(s.plan.kv_indptr, p.kv_indptr);
  EXPECT_EQ(s.plan.kv_page_indices, p.kv_page_indices);
  EXPECT_EQ(s.plan.kv_last_page_len, p.kv_last_page_len);
  EXPECT_EQ(s.plan.slot_mapping, p.slot_mapping);
  EXPECT_EQ(s.plan.kv_copies, p.kv_copies);
  EXPECT_EQ(s.plan.logits_rows, p.logits_rows);
  EXPECT_EQ(s.plan.logits_indptr, p.logits_indptr);
  EXPECT_EQ(s.plan.request_ids, p.request_ids);
  EXPECT_EQ(s.plan.samples, p.samples);
  EXPECT_FALSE(decode_step(encode_step(p, false)).want_logits);
  EXPECT_NE(error_of([&] { decode_step(bytes.substr(0, bytes.size() - 1)); }).find("cut short"),
            std::string::npos);
  EXPECT_NE(error_of([&] { decode_step(bytes + "x"); }).find("1 bytes too many"),
            std::string::npos);
}

}  // namespace
}  // namespace pagedlm
