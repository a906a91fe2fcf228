// A shared-memory barrier for the turnstile's intra-node rendezvous (docs/design.md §6).
//
// Why native: the store rendezvous costs a TCP round trip per rank per meeting (milliseconds at 8
// ranks); ranks on one host can meet through a few cache lines instead. The Python side
// (megatron_rollout/comm/shm_rendezvous.py) creates and names the segment, agrees on it through the
// process group's store, and turns the status codes returned here into the turnstile's errors.
//
// Protocol. Each rank owns one slot: a sequence number (the rounds it has arrived at) and two
// entries (epoch, boundary, tag, payload), used by round parity. Round k: write entry[k & 1], then
// publish seq = k + 1; wait until every slot's seq >= k + 1; read every entry[k & 1]. Two entries
// suffice: a rank can only write round k + 2 after round k + 1 completed, i.e. after every rank
// arrived at k + 1 and so finished reading round k. Waiting spins briefly, then yields, then sleeps
// on a futex that the arrival completing the round bumps and wakes (only then, so sleepers are not
// woken N - 1 times per round). Deadlines use CLOCK_MONOTONIC; while asleep the waiter also checks,
// every poll interval, whether a missing rank's process is gone (dead or a zombie) and then fails
// at once instead of waiting out the timeout.
//
// Deliberately left out: no cross-host path (the store rendezvous covers that), no recovery after a
// timeout (the Python side poisons the rendezvous), no payloads beyond kMaxPayload int64s.

#include <pybind11/pybind11.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace py = pybind11;

namespace {

constexpr uint64_t kMagic = 0x31565344'5252524dULL;  // "MRRRDSV1", layout version 1
constexpr int kMaxPayload = 8;
constexpr int64_t kMaxRanks = 4096;

// Status codes returned with each meeting (mirrored in shm_rendezvous.py).
constexpr int kOk = 0;
constexpr int kMismatch = 1;
constexpr int kTimeout = 2;
constexpr int kBadArgs = 3;  // not exact ints / too long a payload: Python raises the precise error

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory atomics must be lock-free");

struct alignas(64) Header {
  uint64_t magic;
  uint64_t nonce;  // random, posted with the name: proves every rank mapped the same segment
  int64_t nranks;
  int64_t max_payload;
  alignas(64) std::atomic<uint32_t> word;  // futex word, bumped by an arrival that completes a round
  std::atomic<uint32_t> waiters;           // ranks asleep (or about to sleep) on `word`
};

struct Entry {
  int64_t epoch, boundary, tag, n;
  int64_t payload[kMaxPayload];
};

struct alignas(64) Slot {
  std::atomic<uint64_t> seq;  // round k arrived <=> seq >= k + 1
  int64_t pid;
  alignas(64) Entry entry[2];
};

size_t segment_size(int64_t nranks) { return sizeof(Header) + static_cast<size_t>(nranks) * sizeof(Slot); }

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// t0 + timeout, saturating: a timeout past what int64 nanoseconds hold (1e10 s: 1e19 ns) waits
// "forever" instead of overflowing into a deadline in the past (or an undefined conversion).
inline int64_t deadline_after(int64_t t0, double timeout_s) {
  const double ns = timeout_s * 1e9;
  const double room = static_cast<double>(INT64_MAX - t0);
  if (!(ns < room)) return INT64_MAX;  // also inf and NaN
  return ns > 0 ? t0 + static_cast<int64_t>(ns) : t0;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Gone for good: no such process, or a zombie / dead entry in /proc (a killed child stays a zombie
// until its parent reaps it, and kill(pid, 0) still succeeds on a zombie).
bool pid_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may contain spaces or ')'
  return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

class ShmBarrier {
 public:
  ShmBarrier(const std::string& path, bool create, int64_t nranks, int64_t index, uint64_t nonce)
      : nranks_(nranks), index_(index) {
    if (nranks < 1 || nranks > kMaxRanks) throw std::invalid_argument("nranks must be in [1, 4096]");
    if (index < 0 || index >= nranks) throw std::invalid_argument("index must be in [0, nranks)");
    size_ = segment_size(nranks);
    int fd = create ? ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600)
                    : ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error(errno_text(create ? "cannot create" : "cannot open", path));
    if (create && ::ftruncate(fd, static_cast<off_t>(size_)) != 0) {
      std::string msg = errno_text("cannot size", path);
      ::close(fd);
      throw std::runtime_error(msg);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < size_) {
      ::close(fd);
      throw std::runtime_error("segment " + path + " is smaller than " + std::to_string(size_) + " bytes");
    }
    void* base = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    std::string msg = errno_text("cannot map", path);
    ::close(fd);
    if (base == MAP_FAILED) throw std::runtime_error(msg);
    base_ = static_cast<char*>(base);
    header_ = reinterpret_cast<Header*>(base_);
    slots_ = reinterpret_cast<Slot*>(base_ + sizeof(Header));
    if (create) {  // ftruncate zero-fills: every seq starts at 0
      header_->nonce = nonce;
      header_->nranks = nranks;
      header_->max_payload = kMaxPayload;
      std::atomic_thread_fence(std::memory_order_release);
      header_->magic = kMagic;
    } else if (header_->magic != kMagic || header_->nonce != nonce || header_->nranks != nranks ||
               header_->max_payload != kMaxPayload) {
      ::munmap(base_, size_);
      base_ = nullptr;
      throw std::runtime_error("segment " + path + " is not the one announced (magic, nonce or rank count " +
                               "differ): another job's file, or /dev/shm not shared between these ranks");
    }
    slots_[index].pid = static_cast<int64_t>(::getpid());
  }

  ~ShmBarrier() {
    if (base_) ::munmap(base_, size_);
  }

  ShmBarrier(const ShmBarrier&) = delete;
  ShmBarrier& operator=(const ShmBarrier&) = delete;

  void set_wait(double spin_us, double yield_us, double poll_ms, bool check_dead) {
    spin_ns_ = static_cast<int64_t>(spin_us * 1e3);
    yield_ns_ = static_cast<int64_t>(yield_us * 1e3);
    poll_ns_ = static_cast<int64_t>(poll_ms * 1e6);
    if (poll_ns_ < 1000000) poll_ns_ = 1000000;
    check_dead_ = check_dead;
  }

  py::tuple pids() const {
    py::tuple out(nranks_);
    for (int64_t r = 0; r < nranks_; ++r) out[r] = py::int_(slots_[r].pid);
    return out;
  }

  uint64_t rounds() const { return round_; }

  // One meeting. Returns (status, data):
  //   kOk:       list of payload tuples in slot order
  //   kMismatch: list of (epoch, boundary, tag) per slot
  //   kTimeout:  (missing slots, the missing slots whose process is gone, elapsed seconds)
  //   kBadArgs:  None (nothing was published; Python raises the precise error)
  py::tuple meet(py::handle epoch, py::handle boundary, int64_t tag, py::handle payload, double timeout_s) {
    Entry mine;
    if (!read_args(epoch, boundary, payload, &mine)) return py::make_tuple(kBadArgs, py::none());
    mine.tag = tag;
    const uint64_t k = round_++;
    const uint64_t target = k + 1;
    const int b = static_cast<int>(k & 1);
    const int64_t t0 = now_ns();
    const int64_t deadline = deadline_after(t0, timeout_s);
    bool gone = false;
    bool done;
    {
      py::gil_scoped_release release;
      slots_[index_].entry[b] = mine;
      slots_[index_].seq.store(target, std::memory_order_seq_cst);
      done = all_arrived(target);
      if (done) wake();
      else done = wait(target, t0, deadline, &gone);
    }
    if (!done) return timeout_result(target, t0);
    bool same = true;
    for (int64_t r = 0; r < nranks_; ++r) {
      const Entry& e = slots_[r].entry[b];
      same = same && e.epoch == mine.epoch && e.tag == mine.tag;
    }
    if (!same) {
      py::list seen(nranks_);
      for (int64_t r = 0; r < nranks_; ++r) {
        const Entry& e = slots_[r].entry[b];
        seen[r] = py::make_tuple(e.epoch, e.boundary, e.tag);
      }
      return py::make_tuple(kMismatch, seen);
    }
    py::list out(nranks_);
    for (int64_t r = 0; r < nranks_; ++r) {
      const Entry& e = slots_[r].entry[b];
      PyObject* t = PyTuple_New(e.n);
      if (!t) throw py::error_already_set();
      for (int64_t i = 0; i < e.n; ++i) {
        PyObject* v = PyLong_FromLongLong(e.payload[i]);
        if (!v) {
          Py_DECREF(t);
          throw py::error_already_set();
        }
        PyTuple_SET_ITEM(t, i, v);
      }
      out[r] = py::reinterpret_steal<py::object>(t);
    }
    return py::make_tuple(kOk, out);
  }

 private:
  static bool exact_int(py::handle h, int64_t* out) {
    if (!PyLong_CheckExact(h.ptr())) return false;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    *out = v;
    return true;
  }

  static bool read_args(py::handle epoch, py::handle boundary, py::handle payload, Entry* e) {
    if (!exact_int(epoch, &e->epoch) || !exact_int(boundary, &e->boundary)) return false;
    const bool is_tuple = PyTuple_CheckExact(payload.ptr());
    if (!is_tuple && !PyList_CheckExact(payload.ptr())) return false;
    const Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(payload.ptr()) : PyList_GET_SIZE(payload.ptr());
    if (n > kMaxPayload) return false;
    e->n = n;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = is_tuple ? PyTuple_GET_ITEM(payload.ptr(), i) : PyList_GET_ITEM(payload.ptr(), i);
      if (!exact_int(item, &e->payload[i])) return false;
    }
    return true;
  }

  // Slots below scan_from_ have arrived at the current target (arrivals are monotonic).
  bool all_arrived(uint64_t target) {
    if (scan_target_ != target) scan_target_ = target, scan_from_ = 0;
    while (scan_from_ < nranks_ && slots_[scan_from_].seq.load(std::memory_order_seq_cst) >= target) ++scan_from_;
    return scan_from_ == nranks_;
  }

  void wake() {
    header_->word.fetch_add(1, std::memory_order_seq_cst);
    if (header_->waiters.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header_->word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }

  bool any_missing_gone(uint64_t target) const {
    for (int64_t r = 0; r < nranks_; ++r)
      if (slots_[r].seq.load(std::memory_order_acquire) < target && pid_gone(slots_[r].pid)) return true;
    return false;
  }

  bool wait(uint64_t target, int64_t t0, int64_t deadline, bool* gone) {
    for (uint32_t i = 1;; ++i) {  // spin: cheapest when every rank has a core
      if (all_arrived(target)) return true;
      if ((i & 63) == 0 && now_ns() - t0 >= spin_ns_) break;
      cpu_relax();
    }
    while (now_ns() - t0 < spin_ns_ + yield_ns_) {  // yield: lets a late rank sharing our core run
      sched_yield();
      if (all_arrived(target)) return true;
    }
    header_->waiters.fetch_add(1, std::memory_order_seq_cst);
    bool done = false;
    int64_t next_check = now_ns() + poll_ns_;
    for (;;) {
      const uint32_t w = header_->word.load(std::memory_order_seq_cst);
      if (all_arrived(target)) {
        done = true;
        break;
      }
      const int64_t t = now_ns();
      if (t >= deadline) break;
      if (check_dead_ && t >= next_check) {
        if (any_missing_gone(target)) {
          *gone = true;
          break;
        }
        next_check = t + poll_ns_;
      }
      int64_t slice = deadline - t;
      if (slice > poll_ns_) slice = poll_ns_;
      timespec ts{static_cast<time_t>(slice / 1000000000LL), static_cast<long>(slice % 1000000000LL)};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header_->word), FUTEX_WAIT, w, &ts, nullptr, 0);
    }
    header_->waiters.fetch_sub(1, std::memory_order_seq_cst);
    return done;
  }

  py::tuple timeout_result(uint64_t target, int64_t t0) const {
    py::list missing, gone;
    for (int64_t r = 0; r < nranks_; ++r) {
      if (slots_[r].seq.load(std::memory_order_acquire) >= target) continue;
      missing.append(r);
      if (check_dead_ && pid_gone(slots_[r].pid)) gone.append(r);
    }
    return py::make_tuple(kTimeout, py::make_tuple(missing, gone, (now_ns() - t0) / 1e9));
  }

  int64_t nranks_, index_;
  size_t size_ = 0;
  char* base_ = nullptr;
  Header* header_ = nullptr;
  Slot* slots_ = nullptr;
  uint64_t round_ = 0;
  uint64_t scan_target_ = 0;
  int64_t scan_from_ = 0;
  int64_t spin_ns_ = 20000, yield_ns_ = 200000, poll_ns_ = 50000000;
  bool check_dead_ = true;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Shared-memory barrier for megatron_rollout's intra-node turnstile rendezvous";
  m.attr("MAX_PAYLOAD") = kMaxPayload;
  m.attr("OK") = kOk;
  m.attr("MISMATCH") = kMismatch;
  m.attr("TIMEOUT") = kTimeout;
  m.attr("BAD_ARGS") = kBadArgs;
  m.def("segment_size", &segment_size, py::arg("nranks"));
  m.def("pid_gone", &pid_gone, py::arg("pid"));
  py::class_<ShmBarrier>(m, "ShmBarrier")
      .def(py::init<const std::string&, bool, int64_t, int64_t, uint64_t>(), py::arg("path"), py::arg("create"),
           py::arg("nranks"), py::arg("index"), py::arg("nonce"))
      .def("set_wait", &ShmBarrier::set_wait, py::arg("spin_us"), py::arg("yield_us"), py::arg("poll_ms"),
           py::arg("check_dead"))
      .def("pids", &ShmBarrier::pids)
      .def_property_readonly("rounds", &ShmBarrier::rounds)
      .def("meet", &ShmBarrier::meet, py::arg("epoch"), py::arg("boundary"), py::arg("tag"), py::arg("payload"),
           py::arg("timeout_s"));
}
