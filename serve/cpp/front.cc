// genrec's native front end (serve/proxy.py builds and starts it; serve.connections.front_end = "native").
//
// A gRPC proxy in front of the Python server that sheds load in C++: it passes at most
// MAX_IN_FLIGHT Recommender calls to the server at once, and while another caller is active, at
// most MAX_SHARE of them to one heavy caller (a caller: its METADATA_KEY value, else its peer's
// host; heavy: it sent more than MAX_SHARE of the recent calls; work-conserving as
// serve.admission.Shares: a caller alone may use every place, and a caller within its share, or
// a light one, is let in past the cap, see Shares::place). A call past either is answered
// RESOURCE_EXHAUSTED here, in microseconds, without the server seeing it; a call past the cap
// alone may first wait a few milliseconds for a place while the front end is not overloaded
// (Front::waiting).
// Every other method (health, reflection) is passed on uncapped. The caller's name is forwarded
// as METADATA_KEY, and whether it is heavy or light beside others as genrec-contention: the
// server queues callers apart and holds each call to that judgement instead of taking shares a
// second time from the calls let through (a flood held to its share here looked no heavier
// there than a quiet caller's burst). The call's deadline and a client's cancellation are passed
// on too.
//
//   front LISTEN UPSTREAM MAX_IN_FLIGHT MAX_SHARE ACTIVE_S METADATA_KEY MAX_MESSAGE_BYTES MAX_WAIT_MS LINK NICE
// LISTEN: host:port (port 0: any; "listening PORT" on stdout once it listens). UPSTREAM: the
// server's gRPC address, for every call but the Recommender's: unix:PATH (its own socket, which
// nobody else can reach), or host:port. LINK: the path of the server's Unix socket for the
// Recommender calls passed on, a frame each way per call (serve/link.py: a second gRPC call cost
// the Python server about as much CPU as the rest of its work on the call). NICE: the front
// end's own CPU priority, below the server's (0-19), set before any thread starts: on a core it
// shares with the server and the engine, its refusals under overload yield to their work.
// MAX_SHARE 0: no per-caller cap. MAX_WAIT_MS: the longest a call past the cap waits for a place
// (0: refused at once). SIGTERM / SIGQUIT / SIGINT: stop taking calls, let those passed on
// finish (up to 10 s), exit 0.
//
// One thread drives one completion queue; each call is a small state machine (Call below):
// accepted -> (waiting ->) refused, or read -> upstream call (or link frame) -> reply written; the done notice arrives
// independently, and the call is freed once its last write, that notice and (if it waited) its
// alarm's notice are in.

#include <grpc/support/time.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <grpcpp/alarm.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <list>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
const std::string kCapped = "/genrec.v1.Recommender/";
const std::string kContention = "genrec-contention";  // serve.admission.CONTENTION_KEY: set here, never a client's
std::atomic<bool> g_stop{false};
std::atomic<int> g_exit{0};  // the exit status: 4 once the server's link is gone

void on_signal(int) { g_stop = true; }

// Places for calls at once: everyone's (cap) and, while another caller is active, one caller's.
class Shares {
 public:
  Shares(int cap, double share, double active_s)
      : cap_(cap),
        share_(share),
        active_s_(active_s),
        share_limit_(share > 0 ? std::max(1, static_cast<int>(std::ceil(cap * share))) : cap) {}


  // How a caller's call is judged when it arrives: heavy (more than its share of the recent
  // calls sent, or of the places held), and whether another caller is active. The call counts
  // towards the caller's rate here, once.
  struct Judgement {
    bool heavy = false, others = false;
  };

  Judgement judge(const std::string& caller) {
    const auto now = Clock::now();
    Held& mine = held_[caller];
    const bool sends = count(mine.rate, mine.rate_at, now) > share_ * count(total_rate_, total_at_, now);
    const bool holds = average(mine.occupancy, mine.occupancy_at, mine.calls, now) >
                       share_ * average(total_occupancy_, total_occupancy_at_, total_, now);
    seen(caller, now);
    return {sends || holds, share_ > 0 && others_active(caller, mine, now)};
  }

  // "" when the caller may have one more call at once (its place taken), else why not; ``at_cap``
  // says the call was refused by the count of places alone (it may wait for one), not by its
  // caller's share. A caller within its share is let in past the cap (up to twice it): a caller
  // that had the server to itself may hold every place, and a newcomer must not wait for them;
  // the other's calls past its share are refused from then on, so the total is back under the
  // cap within a call's time.
  //
  // The share binds a heavy caller only: one that sent more than MAX_SHARE of the calls of the
  // last ~ACTIVE_S seconds, or held more than MAX_SHARE of the calls passed on over that time (a
  // flood is heavy by what it sends, a caller of few long calls by what it holds). A light caller
  // (a quarter of capacity beside a flood) may burst past its places while the total is under
  // the cap plus one share: its bursts are what a fixed count of places refused (18.6% of a
  // Poisson caller's calls, benchmarks/notes/2026-12-06-two-callers.md).
  //
  // ``contention`` (a call let in): "heavy" or "light" while another caller is active, "" when
  // the caller is alone or shares are off; forwarded to the server (CONTENTION_KEY), whose batcher
  // holds the call to it: the server sees only the calls let through here, not who is flooding.
  std::string place(const std::string& caller, const Judgement& j, bool& at_cap, std::string& contention) {
    Held& mine = held_[caller];
    const bool within_share = share_ > 0 && mine.calls < share_limit_;
    at_cap = false;
    if (!within_share && j.heavy && j.others) {
      return "overloaded: caller '" + caller + "' has " + std::to_string(mine.calls) +
             " calls at once, its share of the server's front end while others call; retry with backoff";
    }
    const int bound = within_share ? 2 * cap_ : (share_ > 0 && !j.heavy) ? cap_ + share_limit_ : cap_;
    if (total_ >= bound) {
      at_cap = true;
      return "overloaded: the server's front end has its " + std::to_string(cap_) +
             " calls at once; retry with backoff or another replica";
    }
    const auto now = Clock::now();
    hold(mine, +1, now);
    mine.last = now;
    contention = !j.others ? "" : j.heavy ? "heavy" : "light";
    return "";
  }

  int cap() const { return cap_; }

  void release(const std::string& caller) {
    auto it = held_.find(caller);
    if (it == held_.end()) return;
    const auto now = Clock::now();
    if (it->second.calls > 0) hold(it->second, -1, now);
    it->second.last = now;
    // callers come and go; checked once per ACTIVE_S, so thousands of recent callers do not
    // make every call scan the table
    if (held_.size() > 4096 && std::chrono::duration<double>(now - pruned_at_).count() > active_s_) {
      pruned_at_ = now;
      forget_idle();
    }
  }

 private:
  struct Held {
    int calls = 0;
    Clock::time_point last{};
    double rate = 0;  // calls counted with weight exp(-age / ACTIVE_S)
    Clock::time_point rate_at{};
    double occupancy = 0;  // calls held, averaged over time with the same weight
    Clock::time_point occupancy_at{};
  };

  double decay(Clock::time_point at, Clock::time_point now) const {
    return std::exp(-std::chrono::duration<double>(now - at).count() / std::max(active_s_, 1e-3));
  }

  // Decays ``weight`` (calls, exp(-age / ACTIVE_S)) to ``now`` and counts one more call.
  double count(double& weight, Clock::time_point& at, Clock::time_point now) const {
    weight = weight * decay(at, now) + 1.0;
    at = now;
    return weight;
  }

  // A time average of calls held (``held`` since ``at``), brought to ``now`` (not stored).
  double average(double value, Clock::time_point at, int held, Clock::time_point now) const {
    const double d = decay(at, now);
    return value * d + held * (1.0 - d);
  }

  // One call more (+1) or fewer (-1) for ``h`` from ``now`` on, its and the total's averages
  // brought up to date first.
  void hold(Held& h, int delta, Clock::time_point now) {
    h.occupancy = average(h.occupancy, h.occupancy_at, h.calls, now);
    h.occupancy_at = now;
    total_occupancy_ = average(total_occupancy_, total_occupancy_at_, total_, now);
    total_occupancy_at_ = now;
    holders_ += (h.calls == 0 && delta > 0) - (h.calls > 0 && h.calls + delta == 0);
    h.calls += delta;
    total_ += delta;
  }

  // Whether another caller holds calls or sent one within ACTIVE_S: the count of callers holding
  // calls and the two most recent senders (as serve.admission.Shares), not a scan of every
  // caller, which runs on each call.
  bool others_active(const std::string& caller, const Held& mine, Clock::time_point now) const {
    if (holders_ > (mine.calls > 0 ? 1 : 0)) return true;
    for (int i = 0; i < 2; ++i) {
      if (!recent_[i].empty() && recent_[i] != caller &&
          std::chrono::duration<double>(now - recent_at_[i]).count() < active_s_) {
        return true;
      }
    }
    return false;
  }

  void seen(const std::string& caller, Clock::time_point now) {
    if (recent_[0] != caller) {
      recent_[1] = std::move(recent_[0]);
      recent_at_[1] = recent_at_[0];
      recent_[0] = caller;
    }
    recent_at_[0] = now;
  }

  void forget_idle() {
    const auto now = Clock::now();
    for (auto it = held_.begin(); it != held_.end();) {
      const bool idle = it->second.calls == 0 && std::chrono::duration<double>(now - it->second.last).count() > active_s_;
      it = idle ? held_.erase(it) : std::next(it);
    }
  }

  int cap_;
  double share_, active_s_;
  int share_limit_;  // one caller's places while others call (the cap where shares are off)
  double total_rate_ = 0;  // every caller's calls, weighted as Held::rate
  Clock::time_point total_at_{};
  double total_occupancy_ = 0;  // every caller's calls held, averaged as Held::occupancy
  Clock::time_point total_occupancy_at_{};
  Clock::time_point pruned_at_{};
  int total_ = 0;
  int holders_ = 0;  // callers holding calls
  std::string recent_[2];  // the two most recent senders, the newest first, and when they sent
  Clock::time_point recent_at_[2]{};
  std::unordered_map<std::string, Held> held_;
};

struct Call;

// The server's link for Recommender calls (serve/link.py): one Unix socket, a frame per call out
// and one back, read by a thread of its own. A reply is handed to its call through the call's
// notice alarm, so every call's state changes on the completion queue's thread alone. ``mu`` is
// held by that thread for each event it handles and by the reader for each reply: the table of
// calls awaiting replies is theirs to share, and once ``closing`` is set (with the queue's
// shutdown, under ``mu``) neither starts another operation on the queue, which gRPC would abort
// on. A link that fails (the server closed it, or a frame could not be sent) fails its calls
// UNAVAILABLE and stops the front end with status 4: the server's watchdog then stops the server,
// and its supervisor restarts both, instead of a live front end failing every call.
struct Link {
  int fd = -1;
  std::mutex mu;
  std::unordered_map<uint64_t, Call*> pending;
  uint64_t next_id = 1;
  bool dead = false;     // the link failed: calls fail UNAVAILABLE, and the front end stops
  bool closing = false;  // the completion queue is shutting down: no more operations on it

  bool connect_to(const std::string& path) {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (fd < 0 || path.size() >= sizeof addr.sun_path) return false;
    std::memcpy(addr.sun_path, path.data(), path.size());
    return ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }

  bool send_all(const std::string& frame) {  // (under mu: frames are not interleaved)
    size_t at = 0;
    while (at < frame.size()) {
      const ssize_t n = ::send(fd, frame.data() + at, frame.size() - at, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      at += static_cast<size_t>(n);
    }
    return true;
  }

  bool read_all(char* out, size_t size) {
    size_t at = 0;
    while (at < size) {
      const ssize_t n = ::recv(fd, out + at, size - at, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      at += static_cast<size_t>(n);
    }
    return true;
  }

  void read_loop();
  void cancel(uint64_t id);  // (under mu)

  // The link failed (under mu): later calls fail at once, the reader ends, the front end stops.
  void fail(const char* why) {
    if (dead) return;
    dead = true;
    ::shutdown(fd, SHUT_RDWR);
    if (!closing) {
      std::cerr << "front: the server's link failed (" << why << "): stopping" << std::endl;
      g_exit = 4;
      g_stop = true;
    }
  }
};

template <typename T>
void put(std::string& out, T value) {  // little-endian, as serve/link.py reads it (x86, arm64)
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

struct Front {
  grpc::AsyncGenericService service;
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  // several connections to the server, taken in turn: calls multiplexed on one connection
  // reached the Python server in bursts (its time per call at low load 2-3x that of direct calls)
  std::vector<std::unique_ptr<grpc::GenericStub>> upstreams;
  size_t next_upstream = 0;
  grpc::GenericStub& upstream() { return *upstreams[next_upstream++ % upstreams.size()]; }
  std::unique_ptr<Shares> shares;
  Link link;
  std::string key;
  // Calls past the cap wait here for a place, oldest first, up to MAX_WAIT_MS each (and as many
  // as the cap): a burst of a healthy load is served a few milliseconds late instead of refused.
  // Under overload they do not: once a call could not wait (the line full, or a call waited its
  // time out), every call past the cap is refused at once, and waiting resumes only after kCalm
  // without a call refused at the cap, so that answered calls do not queue here behind a flood.
  // A light caller beside others may wait even then: a place that frees goes to the oldest call
  // in line that fits, and a flood's calls beside it are refused by its share, not lined up.
  std::list<Call*> waiting;
  std::chrono::microseconds max_wait{0};
  Clock::time_point strained_at{};  // when a call past the cap last could not wait
  static constexpr std::chrono::milliseconds kCalm{250};
  bool may_wait(bool light, Clock::time_point now) const {  // (a call past the cap)
    return max_wait.count() > 0 && static_cast<int>(waiting.size()) < shares->cap() &&
           (light || now - strained_at > kCalm);
  }
  void accept_one();
  void admit_waiting();
};

enum class Event { kAccepted, kRead, kUpstream, kWritten, kDone, kWaited };

struct Tag {
  Call* call;
  Event event;
};

// A caller's name within 64 characters: a longer one is its head, "~" and 16 hex digits of its
// 64-bit FNV-1a hash, so two names sharing a long prefix stay two callers (serve.admission's
// bounded_name, with another digest: the server sees the name forwarded from here).
std::string bounded_name(const char* data, size_t size) {
  constexpr size_t kMax = 64, kHead = kMax - 17;
  if (size <= kMax) return std::string(data, size);
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < size; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0x100000001b3ULL;
  char digest[17];
  std::snprintf(digest, sizeof digest, "%016llx", static_cast<unsigned long long>(h));
  return std::string(data, kHead) + "~" + digest;
}

std::string caller_of(const grpc::GenericServerContext& ctx, const std::string& key) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(key);
  if (it != md.end()) return bounded_name(it->second.data(), it->second.size());
  std::string peer = ctx.peer();  // "ipv4:10.0.0.7:5123", "ipv6:[::1]:5123": the host, as the server names it
  const auto colon = peer.rfind(':');
  if (std::count(peer.begin(), peer.end(), ':') >= 2 && colon != std::string::npos) peer.resize(colon);
  return bounded_name(peer.data(), peer.size());
}

bool forwarded(const std::string& name) {
  return !(name.empty() || name[0] == ':' || name.rfind("grpc-", 0) == 0 || name == "te" ||
           name == "content-type" || name == "user-agent" || name == "host" || name == kContention);
}

struct Call {
  Front* front;
  grpc::GenericServerContext ctx;
  grpc::GenericServerAsyncReaderWriter stream{&ctx};
  grpc::ByteBuffer request, reply;
  grpc::ClientContext up;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader;
  grpc::Status status;
  std::string caller, contention;
  Shares::Judgement judged;
  std::unique_ptr<grpc::Alarm> alarm;  // a waiting call's time limit (made when it first waits)
  std::unique_ptr<grpc::Alarm> notice;  // the link's reply, handed to this thread (Link::read_loop)
  uint64_t link_id = 0;  // while its call is out on the link
  std::list<Call*>::iterator in_line;
  bool holds = false, upstream_busy = false, written = false, done = false, waits = false, alarm_set = false;
  Tag accepted{this, Event::kAccepted}, read{this, Event::kRead}, answered{this, Event::kUpstream},
      wrote{this, Event::kWritten}, finished{this, Event::kDone}, waited{this, Event::kWaited};

  explicit Call(Front* f) : front(f) {}

  // returns false once the call may be freed
  bool on(Event event, bool ok) {
    switch (event) {
      case Event::kAccepted:
        if (!ok) return false;  // shutting down: never started, no done notice will come
        front->accept_one();
        on_accepted();
        return true;
      case Event::kRead:
        if (!ok) {
          release();
          stream.Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call ended before its request arrived"), &wrote);
          return true;
        }
        forward();
        return true;
      case Event::kUpstream:
        upstream_busy = false;
        link_id = 0;
        release();
        if (status.ok()) {
          stream.WriteAndFinish(reply, grpc::WriteOptions(), grpc::Status::OK, &wrote);
        } else {
          stream.Finish(status, &wrote);
        }
        return true;
      case Event::kWritten:
        written = true;
        return !done || alarm_set;
      case Event::kDone:
        done = true;
        if (waits) {  // the client went away while its call waited for a place
          leave_line();
          stream.Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call ended while it waited for a place"), &wrote);
          return true;
        }
        if (ctx.IsCancelled() && upstream_busy) {  // the client went away: so does the server's call
          if (link_id) {
            front->link.cancel(link_id);
            if (!upstream_busy) return true;  // (answered CANCELLED here: its write is out)
          } else {
            up.TryCancel();
          }
        }
        return !written || upstream_busy || alarm_set;
      case Event::kWaited:
        alarm_set = false;
        if (waits) {  // waited its time without a place: refused, and the front end is strained
          front->strained_at = Clock::now();
          char ms[32];
          std::snprintf(ms, sizeof ms, "%g", front->max_wait.count() / 1000.0);
          refused(std::string("overloaded: no place at the server's front end within ") + ms +
                  " ms; retry with backoff or another replica");
          return true;
        }
        return !(written && done);
    }
    return true;
  }

  void on_accepted() {
    caller = caller_of(ctx, front->key);
    if (ctx.method().rfind(kCapped, 0) == 0) {
      judged = front->shares->judge(caller);
      bool at_cap = false;
      const std::string why = front->shares->place(caller, judged, at_cap, contention);
      if (!why.empty()) {
        const auto now = Clock::now();
        if (at_cap && front->may_wait(judged.others && !judged.heavy, now)) {
          wait_in_line();
          return;
        }
        if (at_cap) front->strained_at = now;  // (also while strained: waiting resumes after a calm kCalm)
        refused(why);
        return;
      }
      holds = true;
    }
    stream.Read(&request, &read);
  }

  // Waits for a place (Front::admit_waiting) up to MAX_WAIT_MS. A deadline that passes first
  // ends the call through its done notice (cancelled, not counted as overload).
  void wait_in_line() {
    waits = true;
    in_line = front->waiting.insert(front->waiting.end(), this);
    if (!alarm) alarm = std::make_unique<grpc::Alarm>();
    alarm_set = true;
    alarm->Set(front->cq.get(),
               gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_micros(front->max_wait.count(), GPR_TIMESPAN)),
               &waited);
  }

  void leave_line() {
    if (!waits) return;
    front->waiting.erase(in_line);
    waits = false;
    if (alarm_set) alarm->Cancel();  // (its tag still comes, ok = false, or true if it had fired)
  }

  // A place was found for this waiting call (its place taken): on with it.
  void admitted() {
    leave_line();
    holds = true;
    stream.Read(&request, &read);
  }

  // Refused (RESOURCE_EXHAUSTED ``why``): on arrival, or from the line (its time out, or its
  // caller's share binding now).
  void refused(const std::string& why) {
    leave_line();
    stream.Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, why), &wrote);
  }

  void forward() {
    if (ctx.method().rfind(kCapped, 0) == 0) {
      forward_link();
      return;
    }
    up.set_deadline(ctx.raw_deadline());
    for (const auto& [k, v] : client_metadata()) up.AddMetadata(k, v);
    reader = front->upstream().PrepareUnaryCall(&up, ctx.method(), request, front->cq.get());
    upstream_busy = true;
    reader->StartCall();
    reader->Finish(&reply, &status, &answered);
  }

  // A Recommender call to the server as one frame on the link (serve/link.py for the layout):
  // its deadline, method, metadata (the caller's name and contention as the front end judged
  // them) and request.
  void forward_link() {
    std::string f;
    f.reserve(256 + request.Length());
    put<uint32_t>(f, 0);  // (its size, below)
    put<uint8_t>(f, 1);
    const size_t id_at = f.size();
    put<uint64_t>(f, 0);
    // The deadline as an instant of CLOCK_MONOTONIC, which the server reads too (Python's
    // time.monotonic): a frame that waits unread spends its call's time. (gRPC's monotonic clock
    // counts from its own start, so the instant is built from the time left.)
    const gpr_timespec deadline = gpr_convert_clock_type(ctx.raw_deadline(), GPR_CLOCK_MONOTONIC);
    int64_t deadline_us = -1;  // (none)
    if (deadline.tv_sec != INT64_MAX) {
      const gpr_timespec left = gpr_time_sub(deadline, gpr_now(GPR_CLOCK_MONOTONIC));
      timespec now{};
      clock_gettime(CLOCK_MONOTONIC, &now);
      deadline_us = static_cast<int64_t>(now.tv_sec) * 1000000 + now.tv_nsec / 1000 +
                    std::max<int64_t>(0, static_cast<int64_t>(left.tv_sec) * 1000000 + left.tv_nsec / 1000);
    }
    put<int64_t>(f, deadline_us);
    put<uint16_t>(f, static_cast<uint16_t>(ctx.method().size()));
    f += ctx.method();
    auto md = client_metadata();
    md.emplace_back(front->key, caller);
    if (!contention.empty()) md.emplace_back(kContention, contention);
    put<uint16_t>(f, static_cast<uint16_t>(md.size()));
    for (const auto& [k, v] : md) {
      put<uint16_t>(f, static_cast<uint16_t>(k.size()));
      f += k;
      put<uint32_t>(f, static_cast<uint32_t>(v.size()));
      f += v;
    }
    std::vector<grpc::Slice> slices;
    request.Dump(&slices).IgnoreError();
    for (const auto& sl : slices) f.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    const uint32_t size = static_cast<uint32_t>(f.size() - 4);
    std::memcpy(f.data(), &size, 4);
    upstream_busy = true;
    Link& link = front->link;  // (its mu is held: Front's event loop)
    const uint64_t id = link.next_id++;
    std::memcpy(f.data() + id_at, &id, 8);
    if (!link.dead && link.send_all(f)) {
      link_id = id;
      link.pending.emplace(id, this);
      return;
    }
    link.fail("a call could not be sent");
    status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server's link from the front end is down");
    notify();
  }

  // The client's metadata that travels on to the server (not gRPC's own, nor the caller's name
  // or contention, which are the front end's to say).
  std::vector<std::pair<std::string, std::string>> client_metadata() const {
    std::vector<std::pair<std::string, std::string>> md;
    for (const auto& [k, v] : ctx.client_metadata()) {
      std::string name(k.data(), k.size());
      if (forwarded(name) && name != front->key) md.emplace_back(std::move(name), std::string(v.data(), v.size()));
    }
    return md;
  }

  // Hands the upstream outcome (``status``, ``reply``) to the completion queue's thread.
  void notify() {
    if (!notice) notice = std::make_unique<grpc::Alarm>();
    notice->Set(front->cq.get(), gpr_now(GPR_CLOCK_MONOTONIC), &answered);
  }

  void release() {
    if (!holds) return;
    holds = false;
    front->shares->release(caller);
    front->admit_waiting();
  }
};

// A place freed: the waiting calls, oldest first, take places while there are some. A call
// still past its bound stays in line without holding up those behind it whose bound is higher
// (a light caller's or one within its share); the line is at most the cap long.
void Front::admit_waiting() {
  for (auto it = waiting.begin(); it != waiting.end();) {
    Call* c = *it++;  // (admitted / refused take it out of the line; ``it`` is already past it)
    bool at_cap = false;
    const std::string why = shares->place(c->caller, c->judged, at_cap, c->contention);
    if (why.empty()) {
      c->admitted();
    } else if (!at_cap) {
      c->refused(why);
    }
  }
}

// Replies from the server, each handed to its call (Call::notify); once the link is closed, every
// call still out fails UNAVAILABLE and later ones at once.
void Link::read_loop() {
  std::string body;
  for (;;) {
    uint32_t size = 0;
    if (!read_all(reinterpret_cast<char*>(&size), 4) || size < 13) break;
    body.resize(size);
    if (!read_all(body.data(), size)) break;
    uint64_t id;
    uint8_t code;
    uint32_t msg_size;
    std::memcpy(&id, body.data(), 8);
    std::memcpy(&code, body.data() + 8, 1);
    std::memcpy(&msg_size, body.data() + 9, 4);
    if (13 + static_cast<size_t>(msg_size) > size) break;  // (a frame that does not parse: the link fails)
    std::lock_guard<std::mutex> lock(mu);
    auto it = pending.find(id);
    if (it == pending.end()) continue;  // (cancelled here first: already answered)
    Call* c = it->second;
    pending.erase(it);
    if (code == 0) {
      grpc::Slice slice(body.data() + 13 + msg_size, size - 13 - msg_size);
      c->reply = grpc::ByteBuffer(&slice, 1);
      c->status = grpc::Status::OK;
    } else {
      c->status = grpc::Status(static_cast<grpc::StatusCode>(code), body.substr(13, msg_size));
    }
    if (!closing) c->notify();
  }
  std::lock_guard<std::mutex> lock(mu);
  fail("closed by the server, or a reply that did not parse");
  for (auto& [id, c] : pending) {
    c->status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server closed its link from the front end");
    if (!closing) c->notify();
  }
  pending.clear();
}

// The call ``id`` is over at the front end (its client went away, or its deadline passed): the
// server is told to stop its work, and the call is answered CANCELLED here at once, not when
// the server's reply comes (which is then dropped).
void Link::cancel(uint64_t id) {
  auto it = pending.find(id);
  if (it == pending.end()) return;  // (its reply is in: its notice is on the way)
  Call* c = it->second;
  pending.erase(it);
  std::string f;
  put<uint32_t>(f, 9);
  put<uint8_t>(f, 2);
  put<uint64_t>(f, id);
  if (!dead && !send_all(f)) fail("a cancel could not be sent");
  c->status = grpc::Status(grpc::StatusCode::CANCELLED, "the call ended before the server answered");
  c->on(Event::kUpstream, true);
}

void Front::accept_one() {
  Call* call = new Call(this);
  call->ctx.AsyncNotifyWhenDone(&call->finished);
  service.RequestCall(&call->ctx, &call->stream, cq.get(), cq.get(), &call->accepted);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 11) {
    std::cerr << "usage: front LISTEN UPSTREAM MAX_IN_FLIGHT MAX_SHARE ACTIVE_S METADATA_KEY MAX_MESSAGE_BYTES MAX_WAIT_MS "
                 "LINK NICE\n";
    return 2;
  }
  const int nice = std::atoi(argv[10]);
  if (nice < 0 || nice > 19) {
    std::cerr << "front: 0 <= NICE <= 19\n";
    return 2;
  }
  // NICE below its parent's (the server's) priority, before any thread: threads take their
  // creator's, and on Linux this sets the calling thread's alone
  errno = 0;
  const int base = getpriority(PRIO_PROCESS, static_cast<id_t>(getppid()));
  const int lowered = std::min(19, (errno == 0 ? base : 0) + nice);
  if (nice > 0 && setpriority(PRIO_PROCESS, 0, lowered) != 0) {
    std::cerr << "front: cannot lower its priority to nice " << lowered << ": " << std::strerror(errno) << "\n";
  }
  const std::string listen = argv[1], target = argv[2];
  const int cap = std::atoi(argv[3]);
  const double share = std::atof(argv[4]), active_s = std::atof(argv[5]);
  const int max_bytes = std::atoi(argv[7]);
  const double max_wait_ms = std::atof(argv[8]);
  if (cap < 1 || share < 0 || share > 1 || max_bytes < 1 || !std::isfinite(max_wait_ms) || max_wait_ms < 0 ||
      max_wait_ms > 1000) {
    std::cerr << "front: MAX_IN_FLIGHT >= 1, 0 <= MAX_SHARE <= 1, MAX_MESSAGE_BYTES >= 1, 0 <= MAX_WAIT_MS <= 1000\n";
    return 2;
  }
  Front front;
  front.key = argv[6];
  front.shares = std::make_unique<Shares>(cap, share, active_s);
  front.max_wait = std::chrono::microseconds(static_cast<int64_t>(max_wait_ms * 1000));
  if (!front.link.connect_to(argv[9])) {
    std::cerr << "front: cannot reach the server's link at " << argv[9] << "\n";
    return 3;
  }
  // the reader ends with the process (main ends in _Exit); its notices stop once the queue closes
  std::thread([&front] { front.link.read_loop(); }).detach();
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);  // (a refused or failed call is the caller's to retry; no send buffering)
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(max_bytes);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // (each channel its own connection)
  for (int i = 0; i < 8; ++i) {
    front.upstreams.push_back(std::make_unique<grpc::GenericStub>(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args)));
  }

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterAsyncGenericService(&front.service);
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(-1);
  front.cq = builder.AddCompletionQueue();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "front: cannot listen on " << listen << "\n";
    return 3;
  }
  for (int i = 0; i < 64; ++i) front.accept_one();  // calls accepted while others are handled
  std::signal(SIGTERM, on_signal);
  std::signal(SIGQUIT, on_signal);
  std::signal(SIGINT, on_signal);
  std::cout << "listening " << port << std::endl;

  std::thread stopper;
  for (;;) {
    if (g_stop && !stopper.joinable()) {  // graceful: no new calls, those passed on finish (10 s at most)
      stopper = std::thread([&] {
        server->Shutdown(gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(10, GPR_TIMESPAN)));
        std::lock_guard<std::mutex> lock(front.link.mu);  // (no operation starts past this)
        front.link.closing = true;
        front.cq->Shutdown();
      });
    }
    void* raw;
    bool ok;
    const auto got = front.cq->AsyncNext(&raw, &ok, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                                                  gpr_time_from_millis(100, GPR_TIMESPAN)));
    if (got == grpc::CompletionQueue::SHUTDOWN) break;
    if (got == grpc::CompletionQueue::TIMEOUT) continue;
    Tag* tag = static_cast<Tag*>(raw);
    std::lock_guard<std::mutex> lock(front.link.mu);
    if (front.link.closing) continue;  // (the queue drains; its calls end with the process)
    if (!tag->call->on(tag->event, ok)) delete tag->call;
  }
  if (stopper.joinable()) stopper.join();
  // every operation is done (the queue said so); the link's reader may still be blocked on the
  // socket: ended with the process, not by destroying what it uses
  std::cout.flush();
  std::_Exit(g_exit.load());
}
