// Open-loop gRPC sender for genrec's load tests (genrec/loadtest/sender.py builds and runs it).
//
// The Python sender costs about as much CPU per call as a small server call, so past ~2x a
// server's capacity it could neither send on time nor time the answers. This one sends the
// same schedule from C++ (gRPC's generic stub: serialized requests in, serialized replies out),
// so one core offers several thousand calls a second.
//
//   sender TARGET METHOD PAYLOADS SCHEDULE OUT TIMEOUT_MS WARMUP FIRST REPLIES [KEY=VALUE metadata...]
//
// PAYLOADS: requests, each a little-endian uint32 length and its bytes. Warm-up call i sends
//   payload i mod n, scheduled call i payload (FIRST + i) mod n. KEY=VALUE: metadata on every call.
// SCHEDULE: little-endian float64 send times, seconds from the step's start (the first one
//   50 ms after the warm-up), one per call.
// OUT: per call, in schedule order: float64 scheduled send time (s from the start), float64
//   latency from the scheduled time (s), float64 lateness of the send (s), int32 gRPC status
//   code, uint32 reply length, then the reply's bytes when REPLIES is 1 (else length 0).
// Sending sleeps to each scheduled time on one thread; a second thread takes the answers off
// the completion queue and timestamps them. Exit status 0 once every call has its answer.

#include <grpcpp/generic/generic_stub.h>
#include <grpc/support/time.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point origin, Clock::time_point t) {
  return std::chrono::duration<double>(t - origin).count();
}

std::string read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::cerr << "sender: cannot read " << path << "\n";
    std::exit(2);
  }
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<grpc::ByteBuffer> read_payloads(const char* path) {
  const std::string raw = read_file(path);
  std::vector<grpc::ByteBuffer> out;
  size_t at = 0;
  while (at + 4 <= raw.size()) {
    uint32_t n;
    std::memcpy(&n, raw.data() + at, 4);
    at += 4;
    if (at + n > raw.size()) break;
    grpc::Slice slice(raw.data() + at, n);
    out.emplace_back(&slice, 1);
    at += n;
  }
  if (out.empty()) {
    std::cerr << "sender: no payloads in " << path << "\n";
    std::exit(2);
  }
  return out;
}

struct Call {
  grpc::ClientContext context;
  grpc::ByteBuffer reply;
  grpc::Status status;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader;
  Clock::time_point scheduled;
  double late = 0.0;
  double took = 0.0;
  std::string body;  // the reply's bytes (REPLIES = 1)
};

void sleep_until(Clock::time_point t) {
  // steady_clock is CLOCK_MONOTONIC on Linux: an absolute sleep, no drift from repeated deltas
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) != 0) {
  }
}

// a deadline `after` from now, on gRPC's monotonic clock (set_deadline takes system_clock or gpr_timespec)
gpr_timespec deadline_in(std::chrono::microseconds after) {
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_micros(after.count(), GPR_TIMESPAN));
}

bool set_fifo(int priority) {
  sched_param sp{};
  sp.sched_priority = priority;
  return pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp) == 0;
}

void add_metadata(grpc::ClientContext& ctx, const std::vector<std::pair<std::string, std::string>>& md) {
  for (const auto& kv : md) ctx.AddMetadata(kv.first, kv.second);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 10) {
    std::cerr << "usage: sender TARGET METHOD PAYLOADS SCHEDULE OUT TIMEOUT_MS WARMUP FIRST REPLIES [KEY=VALUE...]\n";
    return 2;
  }
  const std::string target = argv[1], method = argv[2];
  const auto payloads = read_payloads(argv[3]);
  const std::string schedule_raw = read_file(argv[4]);
  const char* out_path = argv[5];
  const auto timeout = std::chrono::microseconds(static_cast<int64_t>(std::atof(argv[6]) * 1000));
  const int warmup = std::atoi(argv[7]);
  const size_t first = static_cast<size_t>(std::atoll(argv[8]));
  const bool replies = std::atoi(argv[9]) != 0;
  std::vector<std::pair<std::string, std::string>> metadata;
  for (int i = 10; i < argc; ++i) {
    const char* eq = std::strchr(argv[i], '=');
    if (eq == nullptr) {
      std::cerr << "sender: metadata must be KEY=VALUE: " << argv[i] << "\n";
      return 2;
    }
    metadata.emplace_back(std::string(argv[i], eq - argv[i]), std::string(eq + 1));
  }
  const size_t n = schedule_raw.size() / sizeof(double);
  std::vector<double> offsets(n);
  std::memcpy(offsets.data(), schedule_raw.data(), n * sizeof(double));

  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(deadline_in(std::chrono::seconds(30)))) {
    std::cerr << "sender: no connection to " << target << " in 30 s\n";
    return 3;
  }
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;

  // warm-up: one call at a time, answers ignored (the connection open, the server's first calls paid)
  for (int i = 0; i < warmup; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline_in(std::chrono::seconds(5)));
    add_metadata(ctx, metadata);
    grpc::ByteBuffer reply;
    grpc::Status status;
    auto reader = stub.PrepareUnaryCall(&ctx, method, payloads[i % payloads.size()], &cq);
    reader->StartCall();
    reader->Finish(&reply, &status, nullptr);
    void* tag;
    bool ok;
    cq.Next(&tag, &ok);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));

  std::vector<std::unique_ptr<Call>> calls(n);
  for (auto& c : calls) c = std::make_unique<Call>();
  std::cout << "sending" << std::endl;  // the schedule's clock starts now (its origin 50 ms on)
  const Clock::time_point start = Clock::now() + std::chrono::milliseconds(50);

  // On a CPU shared with other work (gRPC's own threads, the receiver), a woken sender waits out
  // the running thread's time slice: 4-6 ms late at p99 under the default policy. Real-time
  // priority for the sender alone sends within ~0.1 ms (the receiver stays beside gRPC's own
  // threads: above them, it could starve one holding a lock the sender waits for); where it is
  // not permitted, say so.
  if (!set_fifo(1)) std::cerr << "sender: no real-time priority (SCHED_FIFO): sends may run late\n";
  std::thread receiver([&] {
    for (size_t done = 0; done < n; ++done) {
      void* tag;
      bool ok;
      if (!cq.Next(&tag, &ok)) break;
      Call* c = static_cast<Call*>(tag);
      c->took = seconds_since(c->scheduled, Clock::now());
      if (replies && c->status.ok()) {
        std::vector<grpc::Slice> slices;
        if (c->reply.Dump(&slices).ok()) {
          for (const auto& s : slices) c->body.append(reinterpret_cast<const char*>(s.begin()), s.size());
        }
      }
      c->reply.Clear();
      c->reader.reset();
    }
  });

  for (size_t i = 0; i < n; ++i) {
    Call& c = *calls[i];
    c.scheduled = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(offsets[i]));
    if (Clock::now() < c.scheduled) sleep_until(c.scheduled);
    const auto now = Clock::now();
    c.late = seconds_since(c.scheduled, now);
    c.context.set_deadline(deadline_in(timeout));
    add_metadata(c.context, metadata);
    c.reader = stub.PrepareUnaryCall(&c.context, method, payloads[(first + i) % payloads.size()], &cq);
    c.reader->StartCall();
    c.reader->Finish(&c.reply, &c.status, &c);
  }
  receiver.join();
  cq.Shutdown();

  std::FILE* out = std::fopen(out_path, "wb");
  if (out == nullptr) {
    std::cerr << "sender: cannot write " << out_path << "\n";
    return 2;
  }
  for (size_t i = 0; i < n; ++i) {
    const Call& c = *calls[i];
    const double record[3] = {offsets[i], c.took, c.late};
    const int32_t code = static_cast<int32_t>(c.status.error_code());
    const uint32_t len = static_cast<uint32_t>(c.body.size());
    std::fwrite(record, sizeof(double), 3, out);
    std::fwrite(&code, sizeof(code), 1, out);
    std::fwrite(&len, sizeof(len), 1, out);
    if (len) std::fwrite(c.body.data(), 1, len, out);
  }
  std::fclose(out);
  return 0;
}
