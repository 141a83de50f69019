// moedoctor's native recording kernel: the C++ twin of PythonKernels._kernel / _record
// (moedoctor/recorder/kernels.py). Every key it writes is a macro of moedoctor_schema.h, which
// moedoctor.trace.schema.cpp_header() generates at each build. Built at run time by moedoctor/recorder/native/__init__.py.
//
// One boxed kernel per collective op, registered at BackendSelect through a torch::Library of kind
// IMPL per namespace. It writes the same `c` line as the Python recorder with one write(2) BEFORE
// redispatching, and keeps c10d Works for the progress thread's poll(). A stack the thread's call-site
// cache knows is recorded without the GIL (attribute_without_gil); the GIL is taken for a stack walked
// in full and for the cold paths (a new code object, site, group, FSDP unit, thread, the cap record,
// errors), which call back into Python through the helper object given to configure().
//
// Lock order: the GIL, then state_mu (taken with the GIL released while waiting; without the GIL, a
// kernel takes state_mu alone and never asks for the GIL while holding it); pending_mu is never held
// together with the GIL.
//
// APIs used (present in torch >= 2.6): CppFunction::makeFromBoxedFunctor, torch::Library(IMPL,
// ns, key), OperatorHandle::redispatchBoxed, DispatchKeySet(FULL_AFTER, key),
// IValue::toCustomClass<c10d::ProcessGroup/Work/ReduceOp>, ProcessGroup::getGroupName,
// torch::autograd::get_current_graph_task_id (graph_task.h). CPython >= 3.9 frame API.

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <Python.h>

#include "moedoctor_schema.h"  // generated from moedoctor/trace/schema.py at each build
#include <frameobject.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace moedoctor_native {

// Frame flags, as in moedoctor/recorder/callsite.py (sent by configure()).
static int F_INTERNAL = 1, F_MODULE_CALL = 2, F_FSDP_GROUP = 4, F_CKPT_SAVE = 8, F_CKPT_LOAD = 16;
static size_t MAX_SHAPES = 64, MAX_STACK = 8, MAX_WALK = 96, MAX_PENDING = 4096;

struct Spec {
  std::string op, qualified;
  bool c10d = false;
  int inputs = -1, outputs = -1, group = -1, reduce_op = -1, async_op = -1, peer = -1;
  int root = -1, in_splits = -1, out_splits = -1;
  size_t nargs = 0;
};

struct GroupState {
  int id = 0;
  std::vector<int64_t> ranks;
  int64_t seq = 0;        // collectives recorded
  int64_t p2p_count = 0;  // p2p ops recorded
  std::map<int64_t, int64_t> pseq;  // peer (global rank, or INT64_MIN for None) -> count
};

struct SiteKeyHash {
  size_t operator()(const std::vector<std::pair<PyObject*, int>>& key) const {
    size_t h = 1469598103934665603ull;
    for (auto& [code, line] : key) {
      h ^= reinterpret_cast<uintptr_t>(code) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
      h ^= static_cast<size_t>(line) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return h;
  }
};
using SiteKey = std::vector<std::pair<PyObject*, int>>;

struct CodeOffsetHash {
  size_t operator()(const std::pair<PyObject*, int>& key) const {
    return std::hash<uintptr_t>()(reinterpret_cast<uintptr_t>(key.first)) * 31u + static_cast<size_t>(key.second);
  }
};

struct PendingWork {
  int64_t event;
  int group;
  // null: the op returned no Work (monitored_barrier_, NCCL without async_op), or its completion comes
  // from its future instead (by_future)
  c10::intrusive_ptr<c10d::Work> work;
  bool by_future = false;  // the Work's CPU future reports completion (future_done), no Work is held
};

// -- state --------------------------------------------------------------------------------------

// All state lives on the heap and is never freed: at exit, a daemon thread may still be inside a
// kernel while the static destructors run, and the libraries must not deregister after the
// dispatcher is gone.
struct State {
  std::vector<Spec> specs;
  std::vector<std::unique_ptr<torch::Library>> libraries;
  PyObject* helper = nullptr;  // moedoctor.recorder.native._Helper

  // Read and written with the GIL held.
  std::unordered_map<PyObject*, int> code_flags;  // code object (kept alive) -> flags
  // FSDP param group -> (a weak reference to it, its unit as JSON): never keeps a model alive.
  std::unordered_map<PyObject*, std::pair<PyObject*, const std::string*>> fsdp_fqns;
  std::unordered_map<std::string, std::string> json_strings;  // str -> json.dumps(str); never erased
  std::unordered_map<std::pair<PyObject*, int>, int, CodeOffsetHash> lines;  // (code, offset) -> line
  std::vector<std::string> dtype_names;  // ScalarType -> "float32"
  std::vector<std::string> reduce_names;  // RedOpType -> "sum"
  // Set from Python, read by the kernels with or without the GIL.
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> optimizer_depth{0};
  std::atomic<const std::string*> checkpoint_phase{nullptr};  // interned; null when not inside a checkpoint save/load

  // Guarded by state_mu.
  std::mutex state_mu;
  std::atomic<int> fd{-1};
  int64_t max_events = 2000000;
  int64_t next_event = 0, written = 0, dropped = 0;
  std::unordered_map<std::string, GroupState> groups;
  std::vector<std::string> group_names;  // by id
  std::unordered_map<SiteKey, int, SiteKeyHash> sites;
  int next_site = 0;

  // Guarded by pending_mu.
  std::mutex pending_mu;
  std::deque<PendingWork> fresh, pending;
  std::unordered_map<int, int64_t> last_done;
  bool assume_completed = false;  // benchmarks: the fake backend's works never complete
};
static State& S = *new State;

static thread_local bool inside = false;  // a recorded op's own collectives pass straight through
static thread_local const std::string* thread_json = nullptr;  // this thread's name, JSON-encoded; never freed
// -- small helpers ------------------------------------------------------------------------------

// The GIL, taken the way any C++ thread may take it (creating a thread state where there is none).
// Time spent recording, by part, for the benchmarks (benchmarks/fsdp_step_overhead.py --toggle).
// Off unless a benchmark asks (set_clock): eight clock reads and seven shared counters per collective
// are themselves a measurable part of the cost.
static std::atomic<int64_t> kernel_ns{0}, kernel_calls{0}, gil_ns{0}, walk_ns{0}, write_ns{0}, pre_ns{0}, post_ns{0};
static bool clock_on = false;

// A point in time when the clock is on (the epoch otherwise: nothing is read).
static inline std::chrono::steady_clock::time_point clock_now() {
  return clock_on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
}

static inline void clock_add(std::atomic<int64_t>& counter, std::chrono::steady_clock::time_point start) {
  if (clock_on) {
    counter.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                          .count(), std::memory_order_relaxed);
  }
}

struct Gil {
  PyGILState_STATE state;
  Gil() : state(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state); }
};

// Run `work` without the GIL and take it back in the normal flow, never in a destructor. On Python
// < 3.14 a daemon thread (the progress thread) that takes the GIL back while the interpreter is
// finalizing is ended by pthread_exit, whose unwinding must not start inside a destructor: they are
// noexcept, so py::gil_scoped_release's would std::terminate, and a healthy job that had finished
// would abort at exit ("terminate called without an active exception", SIGABRT).
template <class Work>
static void without_gil(Work&& work) {
  std::exception_ptr failed;
  PyThreadState* saved = PyEval_SaveThread();
  try {
    work();
  } catch (...) {
    failed = std::current_exception();
  }
  PyEval_RestoreThread(saved);  // may end this thread (see above): outside any destructor or handler
  if (failed) std::rethrow_exception(failed);
}

// Take state_mu with the GIL held, releasing the GIL while waiting (its holder may need the GIL).
struct StateLock {
  StateLock() {
    if (!S.state_mu.try_lock()) without_gil([] { S.state_mu.lock(); });
  }
  ~StateLock() { S.state_mu.unlock(); }
};

static inline void append_int(std::string& out, int64_t value) {
  char buf[24];
  auto result = std::to_chars(buf, buf + sizeof(buf), value);
  out.append(buf, result.ptr - buf);
}

// The errno of the first failed write (0: none). A failed write (disk full, read-only, quota) stops
// the recording at once (fd -1; the descriptor itself stays open: the Python side owns it), and the
// recorder's progress thread reads the errno (write_error) to say so.
static std::atomic<int> write_errno{0};

static void write_all(int target, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(target, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      int expected = 0;
      write_errno.compare_exchange_strong(expected, errno == 0 ? EIO : errno);
      S.fd.store(-1);
      return;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

// -- buffered records ------------------------------------------------------------------------------
// The kernels do not format their records: each collective's raw fields (ids, sequence numbers, the
// tensors' sizes and dtypes, interned pointers for the strings) are copied into a fixed-size slot
// (Entry) of a pending list, and the `c` line is formatted from it later, off the training thread,
// byte for byte as the kernel formatted it before (the same order of keys, the same digits). Records
// that come as bytes (groups, call sites, the cap record, the Python side's evidence) take a slot of
// their own, so the file keeps the order records were made in. The pending slots are formatted and
// written: every FLUSH_EVERY by a writer thread of ours (no GIL), before every record the Python side
// writes itself, when the list is full (then on the recording thread), at close, from os._exit's
// wrapper, and from a handler of the signals a crash ends a process with (SIGABRT: Gloo aborts a rank
// within milliseconds of a size mismatch; SIGSEGV, SIGBUS), which formats into a static buffer (no
// allocation) and then hands the signal to whatever handled it before. SIGTERM (how launchers and
// moedoctor stop a job) is left alone: SIGTERM and SIGKILL may lose the last FLUSH_EVERY of records.
// MOEDOCTOR_DEFER_FORMAT=0 (set_defer): the recording thread formats each record at once, with the
// same formatter, into a bytes slot (the A/B of benchmarks/always_on.py --kernel-clock).
static constexpr size_t INLINE_TENSORS = 4, INLINE_DIMS = 16;

// One side's tensors (inputs or outputs), raw. `text` set: described as text on the recording thread
// (more than INLINE_TENSORS tensors or INLINE_DIMS sizes, or a symbolic size): shapes and dtypes below.
struct RawSide {
  uint32_t count = 0;  // tensors seen
  uint8_t kept = 0;    // tensors described inline
  bool text = false;
  uint8_t ndim[INLINE_TENSORS];
  c10::ScalarType dtype[INLINE_TENSORS];
  int64_t dims[INLINE_DIMS];
  const std::string* device = nullptr;  // the first tensor's, interned (never freed)
  std::string shapes, dtypes;           // only when `text`
};

struct Entry {
  bool is_bytes = false;
  std::string bytes;  // is_bytes: the whole record, as it goes to the file
  // A collective (is_bytes false): everything its `c` line carries.
  const Spec* spec = nullptr;
  int64_t event = 0, group = 0, seq = 0, pseq = 0, site = -1, now_ns = 0, step = 0, peer = 0, root = 0;
  bool p2p = false, is_async = false, has_root = false, root_null = false, counts = false;
  int reduce = -1;                      // a ReduceOp's RedOpType; -1: none, or reduce_text
  const std::string* reduce_text = nullptr;  // a reduce op given as a string (lower-cased, interned)
  bool has_splits = false;
  std::string splits;                   // has_splits: "[[...],[...]]", formatted on the recording thread
  const std::string* thread = nullptr;  // JSON, interned
  const char* phase = nullptr;          // a literal, or an interned checkpoint phase
  const std::string* module = nullptr;  // JSON, interned; null: no unit
  RawSide in, out;
};

// Slots (about 630 bytes each, two lists): at most one 2 ms flush period of records, unless the writer
// is late; beyond, the recording thread writes them.
static constexpr size_t PENDING_CAPACITY = 1024;
static constexpr size_t KEPT_BYTES = 4096;  // a slot's strings keep at most this capacity between uses
static constexpr auto FLUSH_EVERY = std::chrono::milliseconds(2);
// The writer thread's period in microseconds: FLUSH_EVERY unless a benchmark sets it (set_flush_every).
static std::atomic<int64_t> flush_every_us{std::chrono::duration_cast<std::chrono::microseconds>(FLUSH_EVERY).count()};
static constexpr size_t OUT_CAPACITY = 1 << 20;
// Two lists of slots: the kernels fill one (buffer_mu, briefly), a flush swaps it for the other and
// formats that one with only write_mu held (so the kernels go on meanwhile). Slots are reused: their
// strings keep their capacity, so a slot costs no allocation once the lists are warm.
static std::vector<Entry>* filling = new std::vector<Entry>(PENDING_CAPACITY);
static std::vector<Entry>* draining = new std::vector<Entry>(PENDING_CAPACITY);
static std::atomic<size_t> used{0};  // filled slots of *filling
static std::mutex buffer_mu;         // filling, used
static std::mutex write_mu;          // draining, the output buffers, the order of writes
static char* const out_buffer = new char[OUT_CAPACITY];
static char* const signal_buffer = new char[OUT_CAPACITY];  // the signal handler's own
static bool defer_format = true;
static std::once_flag writer_started;
static struct sigaction previous_action[NSIG];
static const int fatal_signals[] = {SIGABRT, SIGSEGV, SIGBUS};

// Formatting into a fixed buffer, written out when full: no allocation (the signal handler uses it).
struct Out {
  char* data;
  size_t size = 0;
  int fd;
  void flush() {
    if (size > 0 && fd >= 0) write_all(fd, data, size);
    size = 0;
  }
  void put(const char* p, size_t n) {
    if (size + n > OUT_CAPACITY) flush();
    if (n > OUT_CAPACITY) {
      if (fd >= 0) write_all(fd, p, n);
      return;
    }
    std::memcpy(data + size, p, n);
    size += n;
  }
  void put(const char* s) { put(s, std::strlen(s)); }
  void put(const std::string& s) { put(s.data(), s.size()); }
  void put(char c) { put(&c, 1); }
  void put_int(int64_t value) {
    char buf[24];
    auto result = std::to_chars(buf, buf + sizeof(buf), value);
    put(buf, static_cast<size_t>(result.ptr - buf));
  }
};

static void format_shapes(Out& out, const RawSide& side) {
  if (side.text) {
    out.put(side.shapes);
    return;
  }
  out.put('[');
  size_t d = 0;
  for (size_t i = 0; i < side.kept; ++i) {
    if (i) out.put(',');
    out.put('[');
    for (size_t j = 0; j < side.ndim[i]; ++j, ++d) {
      if (j) out.put(',');
      out.put_int(side.dims[d]);
    }
    out.put(']');
  }
  out.put(']');
}

// The distinct dtypes of the described tensors, in order.
static void format_dtypes(Out& out, const RawSide& side) {
  if (side.text) {
    out.put(side.dtypes);
    return;
  }
  out.put('[');
  size_t distinct = 0;
  for (size_t i = 0; i < side.kept; ++i) {
    const c10::ScalarType st = side.dtype[i];
    bool known = false;
    for (size_t j = 0; j < i && !known; ++j) known = side.dtype[j] == st;
    if (known) continue;
    if (distinct++) out.put(',');
    out.put('"');
    auto index = static_cast<size_t>(st);
    if (index < S.dtype_names.size() && !S.dtype_names[index].empty()) {
      out.put(S.dtype_names[index]);
    } else {
      out.put(c10::toString(st));
    }
    out.put('"');
  }
  out.put(']');
}

// The `c` line of a collective, exactly as the kernel wrote it when it formatted on the spot.
static void format_collective(Out& out, const Entry& e) {
  const Spec& spec = *e.spec;
  out.put(MDK_COLLECTIVE_KIND MDK_COLLECTIVE_EVENT_ID);
  out.put_int(e.event);
  out.put(MDK_COLLECTIVE_GROUP);
  out.put_int(e.group);
  out.put(MDK_COLLECTIVE_SEQ);
  out.put_int(e.seq);
  if (e.p2p) {
    out.put(MDK_COLLECTIVE_P2P_SEQ);
    out.put_int(e.pseq);
  }
  out.put(MDK_COLLECTIVE_CALL_SITE);
  if (e.site < 0) {
    out.put("null");
  } else {
    out.put_int(e.site);
  }
  out.put(MDK_COLLECTIVE_TIME);  // time.time() as "%.6f"
  const int64_t micros = (e.now_ns + 500) / 1000;
  out.put_int(micros / 1000000);
  char fraction[8] = {'.', '0', '0', '0', '0', '0', '0', 0};
  for (int64_t rest = micros % 1000000, i = 6; i > 0; --i, rest /= 10) fraction[i] = static_cast<char>('0' + rest % 10);
  out.put(fraction, 7);
  out.put(MDK_COLLECTIVE_OP "\"");
  out.put(spec.op);
  out.put("\"" MDK_COLLECTIVE_RAW_OP "\"");
  out.put(spec.qualified);
  out.put("\"" MDK_COLLECTIVE_IN_SHAPES);
  format_shapes(out, e.in);
  out.put(MDK_COLLECTIVE_OUT_SHAPES);
  format_shapes(out, e.out);
  out.put(MDK_COLLECTIVE_DTYPES);
  format_dtypes(out, e.in);
  out.put(e.is_async ? MDK_COLLECTIVE_ASYNC_OP "true" MDK_COLLECTIVE_THREAD : MDK_COLLECTIVE_ASYNC_OP "false" MDK_COLLECTIVE_THREAD);
  out.put(*e.thread);
  out.put(MDK_COLLECTIVE_PHASE "\"");
  out.put(e.phase);
  out.put("\"" MDK_COLLECTIVE_STEP);
  out.put_int(e.step);
  if (e.reduce_text != nullptr || e.reduce >= 0) {
    out.put(MDK_COLLECTIVE_REDUCE_OP "\"");
    if (e.reduce_text != nullptr) {
      out.put(*e.reduce_text);
    } else {
      const auto op = static_cast<size_t>(e.reduce);
      if (op < S.reduce_names.size()) {
        out.put(S.reduce_names[op]);
      } else {
        out.put_int(e.reduce);
      }
    }
    out.put('"');
  }
  if (e.counts) {
    out.put(MDK_COLLECTIVE_COUNTS "[");
    out.put_int(e.in.count);
    out.put(',');
    out.put_int(e.out.count);
    out.put(']');
  }
  if (e.has_splits) {
    out.put(MDK_COLLECTIVE_SPLITS);
    out.put(e.splits);
  }
  if (e.has_root) {
    out.put(MDK_COLLECTIVE_ROOT);
    if (e.root_null) {
      out.put("null");
    } else {
      out.put_int(e.root);
    }
  }
  if (e.module != nullptr) {
    out.put(MDK_COLLECTIVE_MODULE);
    out.put(*e.module);
  }
  if (e.p2p) {
    out.put(MDK_COLLECTIVE_PEER);
    out.put_int(e.peer);
  }
  if (e.in.device != nullptr) {
    out.put(MDK_COLLECTIVE_DEVICE "\"");
    out.put(*e.in.device);
    out.put('"');
  }
  out.put("}\n");
}

static void format_entries(Out& out, const std::vector<Entry>& entries, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (entries[i].is_bytes) {
      out.put(entries[i].bytes);
    } else {
      format_collective(out, entries[i]);
    }
  }
}

// Format and write what is pending; the kernels keep filling the other list meanwhile.
static void flush_buffer() {
  std::lock_guard<std::mutex> order(write_mu);
  size_t n;
  {
    std::lock_guard<std::mutex> guard(buffer_mu);
    n = used.load();
    if (n == 0) return;
    std::swap(filling, draining);
    used.store(0);
  }
  Out out{out_buffer, 0, S.fd.load()};
  if (out.fd >= 0) {
    format_entries(out, *draining, n);
    out.flush();
  }
  for (size_t i = 0; i < n; ++i) {  // a rare large record's memory is not kept by its slot
    Entry& e = (*draining)[i];
    if (e.bytes.capacity() > KEPT_BYTES) std::string().swap(e.bytes);
    if (e.splits.capacity() > KEPT_BYTES) std::string().swap(e.splits);
    if (e.in.shapes.capacity() > KEPT_BYTES) std::string().swap(e.in.shapes);
    if (e.out.shapes.capacity() > KEPT_BYTES) std::string().swap(e.out.shapes);
  }
}

// A slot for the caller to fill, with buffer_mu held (the caller unlocks). A full list is written
// first, on this thread.
static Entry& take_slot(std::unique_lock<std::mutex>& guard) {
  guard = std::unique_lock<std::mutex>(buffer_mu);
  while (used.load() >= PENDING_CAPACITY) {
    guard.unlock();
    flush_buffer();
    guard.lock();
  }
  Entry& e = (*filling)[used.load()];
  return e;
}

static void append_record(const char* data, size_t size) {
  std::unique_lock<std::mutex> guard;
  Entry& e = take_slot(guard);
  e.is_bytes = true;
  e.bytes.assign(data, size);
  used.fetch_add(1);
}

static void on_ending_signal(int sig, siginfo_t* info, void* context) {
  // Format and write what is pending unless another thread is in the middle of it (then it lands
  // anyway, or, if this thread was interrupted while holding a lock, the last records are lost).
  for (int attempt = 0; attempt < 200; ++attempt) {
    if (write_mu.try_lock()) {
      if (buffer_mu.try_lock()) {
        const size_t n = used.load();
        Out out{signal_buffer, 0, S.fd.load()};
        if (n > 0 && out.fd >= 0) {
          format_entries(out, *filling, n);
          out.flush();
        }
        used.store(0);
        buffer_mu.unlock();
        write_mu.unlock();
        break;
      }
      write_mu.unlock();
    }
    usleep(100);
  }
  const struct sigaction& before = previous_action[sig];
  if (before.sa_flags & SA_SIGINFO) {
    if (before.sa_sigaction != nullptr) {
      before.sa_sigaction(sig, info, context);
      return;
    }
  } else if (before.sa_handler == SIG_IGN) {
    return;
  } else if (before.sa_handler != SIG_DFL && before.sa_handler != nullptr) {
    before.sa_handler(sig);
    return;
  }
  sigaction(sig, &before, nullptr);  // the default action: end the process as it would have
  raise(sig);
}

static void start_writer() {
  std::call_once(writer_started, [] {
    std::thread([] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::microseconds(flush_every_us.load(std::memory_order_relaxed)));
        if (used.load(std::memory_order_relaxed) > 0) flush_buffer();
      }
    }).detach();
    for (int sig : fatal_signals) {
      struct sigaction action {};
      action.sa_sigaction = on_ending_signal;
      action.sa_flags = SA_SIGINFO | SA_ONSTACK;
      sigemptyset(&action.sa_mask);
      sigaction(sig, &action, &previous_action[sig]);
    }
  });
}

static std::string py_error_text() {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  std::string text = "python error";
  if (value != nullptr) {
    PyObject* repr = PyObject_Repr(value);
    if (repr != nullptr) {
      const char* s = PyUnicode_AsUTF8(repr);
      if (s != nullptr) text = s;
      Py_DECREF(repr);
    }
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return text;
}

// helper.<name>(*args): a new reference; throws std::runtime_error on a Python error. Cold paths only.
static PyObject* call_helper(const char* name, PyObject* args) {
  PyObject* fn = PyObject_GetAttrString(S.helper, name);
  if (fn == nullptr) throw std::runtime_error(py_error_text());
  PyObject* result = PyObject_CallObject(fn, args);
  Py_DECREF(fn);
  if (result == nullptr) throw std::runtime_error(py_error_text());
  return result;
}

static PyObject* call_helper1(const char* name, PyObject* arg) {
  PyObject* args = PyTuple_Pack(1, arg);
  if (args == nullptr) throw std::runtime_error(py_error_text());
  PyObject* result = nullptr;
  try {
    result = call_helper(name, args);
  } catch (...) {
    Py_DECREF(args);
    throw;
  }
  Py_DECREF(args);
  return result;
}

// Steals the reference: the bytes' content.
static std::string take_bytes(PyObject* obj) {
  char* data;
  Py_ssize_t size;
  if (PyBytes_AsStringAndSize(obj, &data, &size) != 0) {
    Py_DECREF(obj);
    throw std::runtime_error(py_error_text());
  }
  std::string out(data, static_cast<size_t>(size));
  Py_DECREF(obj);
  return out;
}

// Steals the reference: the str's UTF-8 content.
static std::string take_str(PyObject* obj) {
  const char* text = PyUnicode_AsUTF8(obj);
  if (text == nullptr) {
    Py_DECREF(obj);
    throw std::runtime_error(py_error_text());
  }
  std::string out(text);
  Py_DECREF(obj);
  return out;
}

// json.dumps(value), ASCII-escaped as the Python recorder's records.json_str; cached (GIL held).
static const std::string& json_str(PyObject* str) {
  Py_ssize_t size;
  const char* utf8 = PyUnicode_AsUTF8AndSize(str, &size);
  if (utf8 == nullptr) throw std::runtime_error(py_error_text());
  std::string key(utf8, static_cast<size_t>(size));
  auto it = S.json_strings.find(key);
  if (it != S.json_strings.end()) return it->second;
  std::string value = take_str(call_helper1("json_str", str));
  return S.json_strings.emplace(std::move(key), std::move(value)).first->second;
}

// -- reading the op's arguments (no GIL) ---------------------------------------------------------

// Device::str() formats (and allocates) every time; a process's devices are few. Interned for good
// (a pending record points at its device's text until the writer formats it).
static const std::string& device_text(c10::Device device) {
  static thread_local std::vector<std::pair<c10::Device, const std::string*>> seen;  // this thread's
  for (const auto& entry : seen) {
    if (entry.first == device) return *entry.second;
  }
  static std::mutex known_mu;
  static auto& known = *new std::deque<std::pair<c10::Device, std::string>>;
  std::lock_guard<std::mutex> guard(known_mu);
  const std::string* text = nullptr;
  for (const auto& entry : known) {
    if (entry.first == device) text = &entry.second;
  }
  if (text == nullptr) {
    known.emplace_back(device, device.str());
    text = &known.back().second;
  }
  seen.emplace_back(device, text);
  return *text;
}

// One side's tensors into its slot: their sizes and dtypes as numbers, inline; as text (formatted
// here, as before) where they do not fit the slot or a size is symbolic.
static void describe_tensors(const c10::IValue& value, RawSide& side) {
  const size_t limit = MAX_SHAPES;
  const at::Tensor* tensors[256];
  size_t kept = 0;
  side.count = 0;
  side.kept = 0;
  side.text = false;
  side.device = nullptr;
  auto add = [&](const c10::IValue& item) {
    if (item.isTensor()) {
      ++side.count;
      if (kept < limit && kept < 256) tensors[kept++] = &item.toTensor();
    }
  };
  if (value.isTensor()) {
    add(value);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (item.isTensor()) {
        add(item);
      } else if (item.isList()) {
        for (const c10::IValue& inner : item.toListRef()) add(inner);
      }
    }
  }
  if (kept == 0) return;
  side.device = &device_text(tensors[0]->device());
  if (kept <= INLINE_TENSORS) {
    size_t d = 0;
    bool fits = true;
    for (size_t i = 0; i < kept && fits; ++i) {
      auto sizes = tensors[i]->sym_sizes();
      if (d + sizes.size() > INLINE_DIMS) {
        fits = false;
        break;
      }
      for (size_t j = 0; j < sizes.size(); ++j) {
        auto concrete = sizes[j].maybe_as_int();
        if (!concrete) {
          fits = false;
          break;
        }
        side.dims[d++] = *concrete;
      }
      side.ndim[i] = static_cast<uint8_t>(sizes.size());
      side.dtype[i] = tensors[i]->scalar_type();
    }
    if (fits) {
      side.kept = static_cast<uint8_t>(kept);
      return;
    }
  }
  side.text = true;
  std::string& shapes = side.shapes;
  shapes.clear();
  shapes += '[';
  for (size_t i = 0; i < kept; ++i) {
    if (i) shapes += ',';
    shapes += '[';
    auto sizes = tensors[i]->sym_sizes();
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (d) shapes += ',';
      if (auto concrete = sizes[d].maybe_as_int()) {
        append_int(shapes, *concrete);
      } else {
        std::ostringstream text;  // a symbolic size: written as Python's str() would
        text << sizes[d];
        shapes += text.str();
      }
    }
    shapes += ']';
  }
  shapes += ']';
  // The distinct dtypes of the described tensors, in order.
  std::string& dtypes = side.dtypes;
  dtypes.clear();
  dtypes += '[';
  c10::ScalarType seen[256];
  size_t distinct = 0;
  for (size_t i = 0; i < kept; ++i) {
    c10::ScalarType st = tensors[i]->scalar_type();
    bool known = false;
    for (size_t j = 0; j < distinct && !known; ++j) known = seen[j] == st;
    if (known) continue;
    if (distinct) dtypes += ',';
    seen[distinct++] = st;
    dtypes += '"';
    auto index = static_cast<size_t>(st);
    if (index < S.dtype_names.size() && !S.dtype_names[index].empty()) {
      dtypes += S.dtype_names[index];
    } else {
      dtypes += c10::toString(st);
    }
    dtypes += '"';
  }
  dtypes += ']';
}

// An int[] / SymInt[] argument as a JSON list ("[]" for anything else, or a symbolic size).
static void append_int_list(std::string& out, const c10::IValue& value) {
  out += '[';
  if (value.isList()) {
    bool first = true;
    for (const c10::IValue& item : value.toListRef()) {
      if (!first) out += ',';
      first = false;
      if (item.isInt()) {
        append_int(out, item.toInt());
      } else if (item.isSymInt()) {
        auto concrete = item.toSymInt().maybe_as_int();
        append_int(out, concrete ? *concrete : -1);
      } else {
        append_int(out, -1);
      }
    }
  } else if (value.isIntList()) {
    bool first = true;
    for (int64_t v : value.toIntList()) {
      if (!first) out += ',';
      first = false;
      append_int(out, v);
    }
  }
  out += ']';
}

// The object a custom-class argument holds (a ProcessGroup, a ReduceOp, a Work), borrowed: the op's
// schema fixes the argument's class, so toCustomClass's type lookups and its four reference-count
// changes (on objects other threads touch too) are not needed. Valid while the stack holds the value.
// peek_custom_class gives null for anything else, without an exception: a throw and its unwinding cost
// microseconds, and NCCL hands back an empty Work for every collective issued without async_op (this
// path threw once per such collective until the fifth session of issue 14: ~2 us on an H100 host).
template <typename T>
static T* peek_custom_class(const c10::IValue& value) {
  if (!value.isObject()) return nullptr;
  const auto& slots = value.toObjectRef().slots();
  if (slots.size() != 1 || !slots[0].isCapsule()) return nullptr;
  auto* target = static_cast<c10::intrusive_ptr_target*>(const_cast<void*>(slots[0].internalToPointer()));
  return target == nullptr ? nullptr : static_cast<T*>(static_cast<torch::CustomClassHolder*>(target));
}

template <typename T>
static T* borrow_custom_class(const c10::IValue& value) {
  T* target = peek_custom_class<T>(value);
  if (target == nullptr) throw std::runtime_error("not a custom class object, or an empty one");
  return target;
}

static const std::string& group_name_of(const c10::IValue& value) {
  if (value.isString()) return value.toStringRef();
  return borrow_custom_class<c10d::ProcessGroup>(value)->getGroupName();
}

// -- the Python stack (GIL held) -----------------------------------------------------------------

struct Attribution {
  SiteKey site;
  int flags = 0;
  bool has_module = false;
  const std::string* module_json = nullptr;  // interned in json_strings
  // Set from the call-site cache (fast walk only): the cached site, instead of a copy in ``site``,
  // and the cache's memory of its id.
  const SiteKey* cached_site = nullptr;
  int* site_slot = nullptr;
  const SiteKey& user_frames() const { return cached_site != nullptr ? *cached_site : site; }
};

static int flags_of(PyObject* code) {
  auto it = S.code_flags.find(code);
  if (it != S.code_flags.end()) return it->second;
  PyObject* result = call_helper1("flags", code);  // callsite._flags (cold: once per code object)
  int flags = static_cast<int>(PyLong_AsLong(result));
  Py_DECREF(result);
  if (S.code_flags.emplace(code, flags).second) Py_INCREF(code);  // kept alive, as callsite._flags_cache does
  return flags;
}

// The unit of an FSDP param group (``self._module_fqn``), cached per group through a weak reference
// (a param group's unit is set once, when FSDP2 builds it; the cache never keeps a model alive).
static void param_group_unit(PyObject* self, Attribution& attribution) {
  auto known = S.fsdp_fqns.find(self);
  if (known != S.fsdp_fqns.end()) {
    if (PyWeakref_GET_OBJECT(known->second.first) == self) {  // the same object, still alive
      attribution.module_json = known->second.second;
      attribution.has_module = true;
      return;
    }
    Py_DECREF(known->second.first);
    S.fsdp_fqns.erase(known);
  }
  PyObject* fqn = PyObject_GetAttrString(self, "_module_fqn");
  if (fqn == nullptr) {
    PyErr_Clear();
    return;
  }
  try {
    if (PyUnicode_Check(fqn)) {
      attribution.module_json = &json_str(fqn);
      attribution.has_module = true;
      if (S.fsdp_fqns.size() < 65536) {
        PyObject* ref = PyWeakref_NewRef(self, nullptr);
        if (ref == nullptr) {
          PyErr_Clear();
        } else {
          S.fsdp_fqns.emplace(self, std::make_pair(ref, attribution.module_json));
        }
      }
    }
  } catch (...) {
    Py_DECREF(fqn);
    throw;
  }
  Py_DECREF(fqn);
}

// getattr(frame.f_locals.get("self"), "_module_fqn", None) of an FSDP param-group frame.
static void fsdp_module(PyFrameObject* frame, Attribution& attribution) {
  PyObject* self = nullptr;
#if PY_VERSION_HEX >= 0x030C0000
  self = PyFrame_GetVarString(frame, "self");
#else
  PyObject* locals = PyObject_GetAttrString(reinterpret_cast<PyObject*>(frame), "f_locals");
  if (locals != nullptr) {
    self = PyMapping_GetItemString(locals, "self");
    Py_DECREF(locals);
  }
#endif
  if (self == nullptr) {
    PyErr_Clear();
    return;
  }
  try {
    param_group_unit(self, attribution);
  } catch (...) {
    Py_DECREF(self);
    throw;
  }
  Py_DECREF(self);
}

// frame.f_lineno. PyCode_Addr2Line scans the code's line table, so from Python 3.11 (which has
// PyFrame_GetLasti) the answer is cached per code object (kept alive in code_flags) and offset.
static int line_of(PyFrameObject* frame, PyObject* code) {
#if PY_VERSION_HEX >= 0x030B0000
  const std::pair<PyObject*, int> key(code, PyFrame_GetLasti(frame));
  auto it = S.lines.find(key);
  if (it != S.lines.end()) return it->second;
  const int line = PyFrame_GetLineNumber(frame);
  S.lines.emplace(key, line);
  return line;
#else
  (void)code;
  return PyFrame_GetLineNumber(frame);
#endif
}

// -- walking the stack without frame objects (CPython 3.11 and 3.12) ----------------------------
// PyFrame_GetBack makes a frame object for every frame it passes (an allocation, and GC tracking),
// which in FSDP2's deep module stacks was most of the kernel's cost. On 3.11 and 3.12 the walk reads
// the interpreter's own frames instead: the two structs below mirror CPython's
// Include/internal/pycore_frame.h of those versions, read only, with the GIL held, for this thread.
// A check at load time (fast_walk_agrees) compares it with the PyFrame_* walk, frame by frame; on
// any difference, or on another Python version, the PyFrame_* walk is used.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
#define MOEDOCTOR_FAST_WALK 1
struct MirrorFrame {
#if PY_VERSION_HEX < 0x030C0000  // 3.11
  PyObject* f_func;
  PyObject* f_globals;
  PyObject* f_builtins;
  PyObject* f_locals;
  PyCodeObject* f_code;
  PyFrameObject* frame_obj;
  MirrorFrame* previous;
  _Py_CODEUNIT* prev_instr;
  int stacktop;
  bool is_entry;
  char owner;
#else  // 3.12
  PyCodeObject* f_code;
  MirrorFrame* previous;
  PyObject* f_funcobj;
  PyObject* f_globals;
  PyObject* f_builtins;
  PyObject* f_locals;
  PyFrameObject* frame_obj;
  _Py_CODEUNIT* prev_instr;
  int stacktop;
  uint16_t return_offset;
  char owner;
#endif
  PyObject* localsplus[1];
};
static constexpr char OWNED_BY_GENERATOR = 1;
#if PY_VERSION_HEX >= 0x030C0000
static constexpr char OWNED_BY_CSTACK = 3;
#endif
static bool fast_walk = false;  // set by fast_walk_agrees at load

static MirrorFrame* current_frame(PyThreadState* tstate) {
  return reinterpret_cast<MirrorFrame*>(tstate->cframe->current_frame);
}

static _Py_CODEUNIT* first_instr(PyCodeObject* code) {
  return reinterpret_cast<_Py_CODEUNIT*>(code->co_code_adaptive);
}

// _PyFrame_IsIncomplete: a frame still running its prologue, or a C-stack shim (3.12).
static bool incomplete(const MirrorFrame* f) {
#if PY_VERSION_HEX >= 0x030C0000
  if (f->owner == OWNED_BY_CSTACK) return true;
#endif
  return f->owner != OWNED_BY_GENERATOR && f->prev_instr < first_instr(f->f_code) + f->f_code->_co_firsttraceable;
}

static MirrorFrame* complete(MirrorFrame* f) {
  while (f != nullptr && incomplete(f)) f = f->previous;
  return f;
}

// PyFrame_GetLasti's value: the last instruction's offset in bytes, -1 before the first.
static int lasti_of(const MirrorFrame* f) {
  const auto units = static_cast<int>(f->prev_instr - first_instr(f->f_code));
  return units < 0 ? -1 : units * static_cast<int>(sizeof(_Py_CODEUNIT));
}

static int fast_line_of(const MirrorFrame* f) {
  PyObject* code = reinterpret_cast<PyObject*>(f->f_code);
  const int lasti = lasti_of(f);
  const std::pair<PyObject*, int> key(code, lasti);
  auto it = S.lines.find(key);
  if (it != S.lines.end()) return it->second;
  const int line = PyCode_Addr2Line(f->f_code, lasti);
  S.lines.emplace(key, line);
  return line;
}

// Whether a code object's first local is its argument ``self`` (fixed per code object: the call-site
// cache keeps the answer).
static bool self_first(const PyCodeObject* code) {
  return code->co_argcount >= 1 && PyTuple_GET_SIZE(code->co_localsplusnames) >= 1 &&
         PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(code->co_localsplusnames, 0), "self") == 0;
}

// A frame's first local, ``self`` where self_first(its code): a cell's content where an inner function
// captured it; null when unset. Reads the frame only (no GIL needed for this thread's own frames).
static PyObject* frame_self(const MirrorFrame* f) {
  PyObject* self = f->localsplus[0];
  if (self != nullptr && PyCell_Check(self)) self = PyCell_GET(self);
  return self;
}

// The FSDP param group a frame runs a method of: its ``self``.
static void fast_fsdp_module(const MirrorFrame* f, Attribution& attribution) {
  if (!self_first(f->f_code)) return;
  if (PyObject* self = frame_self(f)) param_group_unit(self, attribution);
}

// The full walk: flags and line of every frame (a hash lookup each). Appends to ``raw`` (when given)
// every interpreter frame it passed, incomplete ones included, up to the last one it walked, and to
// ``fsdp_frames`` the index in ``raw`` of every FSDP param-group frame; returns whether it reached
// the bottom of the stack before MAX_WALK frames (``raw`` then holds every frame below ``top``).
struct FrameKey;
static bool walk_fast(MirrorFrame* top, Attribution& attribution, std::vector<FrameKey>* raw,
                      std::vector<uint16_t>* fsdp_frames);

// -- the call-site cache -------------------------------------------------------------------------
// What a walk finds (the user frames and their lines, the union of the frames' flags, which frames
// are FSDP param-group methods) depends on nothing but the interpreter frames it passes: their code
// objects (whose flags are fixed, cached once, the object kept alive), instruction pointers (a line
// per offset) and owners (which, with the code and the instruction, decide whether a frame is
// complete). So a walk is cached under exactly that sequence, every frame from the innermost to the
// last one walked (up to MAX_WALK complete frames), and a repeated stack costs one pass over the
// frames' own fields (no code object read, no per-frame hash lookup), one hash lookup and a
// comparison of the whole sequence, so no hash collision can pass, instead of two hash lookups and a
// code object read per frame. The one input that is not fixed, the ``self`` of an FSDP param-group
// frame, is still read from the frame on every call, frame by frame as the full walk does. Cached
// code objects are alive (code_flags holds them), so an equal pointer is the same code object.
// environment.SITE_CACHE off turns it off (the full walk every time; the records are the same).
struct FrameKey {
  const void* code;
  const void* instr;
  uintptr_t owner;
  bool operator==(const FrameKey& other) const {
    return code == other.code && instr == other.instr && owner == other.owner;
  }
};

static inline FrameKey key_of(const MirrorFrame* f) {
  return FrameKey{f->f_code, f->prev_instr, static_cast<uintptr_t>(static_cast<unsigned char>(f->owner))};
}

struct CachedWalk {
  std::vector<FrameKey> frames;  // every frame the walk passed, innermost first
  bool to_bottom = false;        // the walk ended at the bottom of the stack (no frame after these)
  SiteKey site;
  int flags = 0;
  std::vector<uint16_t> fsdp_frames;  // indices in ``frames`` of the FSDP param-group frames, in walk order
  std::vector<uint8_t> fsdp_self;     // per FSDP frame: self_first(its code)
  int site_id = -1;                   // the site's id once interned (ids are never reassigned)
};

static constexpr size_t SITE_CACHE_CAPACITY = 4096;  // distinct stacks cached per thread; beyond, the full walk
static constexpr size_t UNIT_CAPACITY = 4096;        // FSDP param groups remembered per thread
static constexpr size_t RECENT_SLOTS = 64;           // the call-site cache's direct-mapped table
static constexpr size_t TOP_SLOTS = 64;              // the call-site cache's table by innermost frame
static bool site_cache = false;                      // set by set_site_cache (MOEDOCTOR_SITE_CACHE)
static bool gil_free_hits = true;                    // set by set_gil_free (MOEDOCTOR_GIL_FREE)
static std::atomic<int> walk_generation{0};          // bumped to empty every thread's cache
static std::atomic<int64_t> cache_hits{0}, cache_misses{0}, gil_free_count{0};

// One thread's call-site cache. Only its own thread reads or changes it, so it needs no lock, and a hit
// can be answered without the GIL (below).
struct ThreadWalks {
  std::unordered_map<uint64_t, CachedWalk> cache;
  // The cache's entries by their hash, direct-mapped: most hits are found here without the map's own
  // lookup (a division and a chain of nodes, each a cache miss after a step's work). Emptied with it.
  struct Recent {
    uint64_t h = 0;
    CachedWalk* walk = nullptr;  // an entry of ``cache`` (its nodes never move)
  };
  Recent recent[RECENT_SLOTS];
  // The walks last answered from an innermost frame (its address, code object and instruction), two
  // per slot, the latest first: a repeated stack is found with one comparison pass and no hash.
  struct Way {
    const MirrorFrame* frame = nullptr;
    const void* code = nullptr;
    const void* instr = nullptr;
    CachedWalk* walk = nullptr;  // an entry of ``cache``
  };
  struct Ways {
    Way way[2];
  };
  Ways by_top[TOP_SLOTS];
  int generation = 0;
  // FSDP param group (borrowed pointer) -> a weak reference to it (owned) and its unit's JSON (null:
  // it has none). Valid while the reference still points at the same object, which a frame holds.
  struct Unit {
    PyObject* ref;
    const std::string* json;
  };
  std::unordered_map<PyObject*, Unit> units;
  bool own_tstate = false;  // PyGILState_GetThisThreadState() is the state this thread runs Python in
};
// Per thread, freed when the thread ends (a thread started per checkpoint save must not leave its
// cache behind). Freeing drops no Python reference (the units' weak references are left alone: a thread
// may end while the interpreter finalizes), only the C++ containers.
static thread_local ThreadWalks* thread_walks = nullptr;
struct ThreadWalksOwner {
  bool owns = false;
  ~ThreadWalksOwner() {
    delete thread_walks;
    thread_walks = nullptr;
  }
};
static thread_local ThreadWalksOwner thread_walks_owner;

static ThreadWalks& walks() {
  if (thread_walks == nullptr) {
    thread_walks = new ThreadWalks;
    thread_walks_owner.owns = true;  // its first use registers the destructor for this thread's end
  }
  const int generation = walk_generation.load(std::memory_order_relaxed);
  if (thread_walks->generation != generation) {
    thread_walks->cache.clear();
    std::fill(std::begin(thread_walks->recent), std::end(thread_walks->recent), ThreadWalks::Recent{});
    std::fill(std::begin(thread_walks->by_top), std::end(thread_walks->by_top), ThreadWalks::Ways{});
    thread_walks->generation = generation;
  }
  return *thread_walks;
}

static bool walk_fast(MirrorFrame* top, Attribution& attribution, std::vector<FrameKey>* raw,
                      std::vector<uint16_t>* fsdp_frames) {
  MirrorFrame* f = top;
  size_t walked = 0;
  for (; f != nullptr && walked < MAX_WALK; ++walked) {
    PyObject* code = reinterpret_cast<PyObject*>(f->f_code);
    const int flags = flags_of(code);
    if (!(flags & F_INTERNAL)) {
      if (attribution.site.size() < MAX_STACK) attribution.site.emplace_back(code, fast_line_of(f));
    } else if (flags & F_FSDP_GROUP) {
      if (fsdp_frames != nullptr && raw != nullptr) fsdp_frames->push_back(static_cast<uint16_t>(raw->size()));
      if (!attribution.has_module) fast_fsdp_module(f, attribution);
    }
    attribution.flags |= flags;
    MirrorFrame* next = f->previous;
    if (raw != nullptr) {
      raw->push_back(key_of(f));
      if (walked + 1 < MAX_WALK) {  // the incomplete frames between this one and the next walked
        for (; next != nullptr && incomplete(next); next = next->previous) raw->push_back(key_of(next));
      }
    }
    f = complete(next);
  }
  // At the bottom before MAX_WALK frames: then ``raw`` holds the whole stack (what follows the
  // MAX_WALK-th frame never changes the walk's result).
  return f == nullptr && walked < MAX_WALK;
}

// ``self``'s FSDP unit from this thread's memory of it; false where it is not known (the GIL is
// needed: param_group_unit).
static bool remembered_unit(ThreadWalks& tw, PyObject* self, Attribution& attribution) {
  auto it = tw.units.find(self);
  if (it == tw.units.end() || PyWeakref_GET_OBJECT(it->second.ref) != self) return false;
  if (it->second.json != nullptr) {
    attribution.module_json = it->second.json;
    attribution.has_module = true;
  }
  return true;
}

// param_group_unit, remembered for this thread (GIL held).
static void unit_with_gil(ThreadWalks& tw, PyObject* self, Attribution& attribution) {
  if (remembered_unit(tw, self, attribution)) return;
  param_group_unit(self, attribution);
  auto it = tw.units.find(self);
  if (it == tw.units.end() && tw.units.size() >= UNIT_CAPACITY) return;
  PyObject* ref = PyWeakref_NewRef(self, nullptr);
  if (ref == nullptr) {
    PyErr_Clear();
    return;
  }
  const ThreadWalks::Unit unit{ref, attribution.has_module ? attribution.module_json : nullptr};
  if (it != tw.units.end()) {
    Py_DECREF(it->second.ref);
    it->second = unit;
  } else {
    tw.units.emplace(self, unit);
  }
}

// The frames a cached walk passed, and (where it ran to the bottom) no frame after them: then this
// stack's walk is the cached one. Incomplete frames before the innermost complete one count too:
// complete() skips them, key_of keeps them.
static bool same_stack(const CachedWalk& walk, MirrorFrame* const current) {
  MirrorFrame* f = current;
  size_t same = 0;
  const size_t n = walk.frames.size();
  for (; same < n && f != nullptr && key_of(f) == walk.frames[same]; ++same) f = f->previous;
  return same == n && (!walk.to_bottom || f == nullptr);
}

// A cached walk's answer for this stack: its site and flags, and the unit of the first FSDP param
// group whose unit can be read, as the walk does. False (without the GIL only) where a unit is not
// known yet.
static bool answer(ThreadWalks& tw, CachedWalk& hit, MirrorFrame* const current, Attribution& attribution, bool gil) {
  MirrorFrame* g = current;
  size_t index = 0;
  for (size_t k = 0; k < hit.fsdp_frames.size() && !attribution.has_module; ++k) {
    for (; index < hit.fsdp_frames[k]; ++index) g = g->previous;
    if (!hit.fsdp_self[k]) continue;
    PyObject* self = frame_self(g);
    if (self == nullptr) continue;
    if (gil) {
      unit_with_gil(tw, self, attribution);
    } else if (!remembered_unit(tw, self, attribution)) {
      return false;
    }
  }
  cache_hits.fetch_add(1, std::memory_order_relaxed);
  attribution.cached_site = &hit.site;
  attribution.flags = hit.flags;
  attribution.site_slot = &hit.site_id;
  return true;
}

// The walk from the call-site cache. With the GIL (``gil``), always answers: a stack not cached is
// walked in full and cached. Without it, answers only from the cache (false otherwise: then the
// caller takes the GIL and asks again). Without the GIL it reads only this thread's own frames, which
// cannot change while the thread is inside this kernel (they are other threads' to read, never to
// change: a frame object made for one elsewhere writes only the frame's own frame_obj), its own
// cache, and the FSDP param group's ``self`` that a frame holds; everything that calls into Python or
// touches shared tables (a code object's flags, a line number, a unit not yet known) needs the GIL.
//
// Lookup, cheapest first: the walks last answered from this innermost frame (its address, code and
// instruction: one comparison pass over the stack, no hash); then the hash of the innermost
// MAX_WALK frames in a direct-mapped table, then in the map. Whatever finds a candidate, only
// same_stack() decides that it is this stack's walk.
static bool attribute_cached(MirrorFrame* const current, Attribution& attribution, bool gil) {
  // No Python frame at all (a collective a C++ thread issues with a thread state and no frames:
  // DDP's reducer on an autograd device thread, a builtin run by _thread.start_new_thread): nothing
  // to walk, the empty attribution, with or without the GIL.
  if (current == nullptr) return true;
  ThreadWalks& tw = walks();
  const FrameKey top = key_of(current);
  const uint64_t t = (reinterpret_cast<uintptr_t>(current) >> 3) ^ (reinterpret_cast<uintptr_t>(top.code) >> 4) ^
                     (reinterpret_cast<uintptr_t>(top.instr) >> 1);
  ThreadWalks::Ways& ways = tw.by_top[(t ^ (t >> 17)) % TOP_SLOTS];
  auto remember = [&](CachedWalk* walk) {
    if (ways.way[0].walk == walk && ways.way[0].frame == current) return;
    ways.way[1] = ways.way[0];
    ways.way[0] = ThreadWalks::Way{current, top.code, top.instr, walk};
  };
  for (ThreadWalks::Way& way : ways.way) {
    if (way.walk != nullptr && way.frame == current && way.code == top.code && way.instr == top.instr &&
        same_stack(*way.walk, current)) {
      CachedWalk* walk = way.walk;
      remember(walk);
      return answer(tw, *walk, current, attribution, gil);
    }
  }
  // The hash covers the innermost MAX_WALK frames (a walk passes at least that many, or the whole
  // stack); the comparison, all the frames the cached walk passed.
  uint64_t h = 1469598103934665603ull;
  size_t hashed = 0;
  for (MirrorFrame* f = current; f != nullptr && hashed < MAX_WALK; f = f->previous, ++hashed) {
    const FrameKey key = key_of(f);
    h = (h ^ reinterpret_cast<uintptr_t>(key.code)) * 1099511628211ull;
    h = (h ^ reinterpret_cast<uintptr_t>(key.instr)) * 1099511628211ull;
    h = (h ^ key.owner) * 1099511628211ull;
  }
  ThreadWalks::Recent& recent = tw.recent[(h ^ (h >> 32)) % RECENT_SLOTS];
  CachedWalk* candidate = recent.h == h ? recent.walk : nullptr;
  if (candidate == nullptr) {
    auto it = tw.cache.find(h);
    if (it != tw.cache.end()) {
      candidate = &it->second;
      recent = ThreadWalks::Recent{h, candidate};
    }
  }
  if (candidate != nullptr && same_stack(*candidate, current)) {
    remember(candidate);
    return answer(tw, *candidate, current, attribution, gil);
  }
  if (!gil) return false;
  cache_misses.fetch_add(1, std::memory_order_relaxed);
  CachedWalk fresh;
  // The incomplete frames above the innermost complete one, then the walk.
  MirrorFrame* f = current;
  for (; f != nullptr && incomplete(f); f = f->previous) fresh.frames.push_back(key_of(f));
  fresh.to_bottom = walk_fast(f, attribution, &fresh.frames, &fresh.fsdp_frames);
  // A hash already taken (a collision: another stack's walk) or a full cache: not cached.
  if (candidate != nullptr || tw.cache.size() >= SITE_CACHE_CAPACITY) return true;
  if (fresh.frames.size() < hashed || fresh.frames.size() > 65535) return true;  // never: a walk passes what was hashed
  for (uint16_t index : fresh.fsdp_frames) {
    fresh.fsdp_self.push_back(self_first(static_cast<const PyCodeObject*>(fresh.frames[index].code)));
  }
  fresh.site = attribution.site;
  fresh.flags = attribution.flags;
  CachedWalk& stored = tw.cache.emplace(h, std::move(fresh)).first->second;
  recent = ThreadWalks::Recent{h, &stored};
  remember(&stored);
  attribution.site_slot = &stored.site_id;
  return true;
}

static void attribute_fast(Attribution& attribution) {
  PyThreadState* const tstate = PyThreadState_Get();
  MirrorFrame* const current = current_frame(tstate);
  if (!site_cache) {
    walk_fast(complete(current), attribution, nullptr, nullptr);
    return;
  }
  ThreadWalks& tw = walks();
  tw.own_tstate = PyGILState_GetThisThreadState() == tstate;
  attribute_cached(current, attribution, true);
}

// The walk answered from this thread's call-site cache without taking the GIL; false where it cannot
// be (then the caller takes the GIL and walks with it).
static bool attribute_without_gil(Attribution& attribution) {
  if (!fast_walk || !site_cache || !gil_free_hits || thread_walks == nullptr || !thread_walks->own_tstate) {
    return false;
  }
  PyThreadState* const tstate = PyGILState_GetThisThreadState();
  if (tstate == nullptr || tstate->cframe == nullptr) return false;
  if (!attribute_cached(current_frame(tstate), attribution, false)) return false;
  gil_free_count.fetch_add(1, std::memory_order_relaxed);
  return true;
}
#endif

static void attribute_slow(Attribution& attribution);

// callsite.attribute: one walk up this thread's Python stack.
static void attribute(Attribution& attribution) {
#ifdef MOEDOCTOR_FAST_WALK
  if (fast_walk) {
    attribute_fast(attribution);
    return;
  }
#endif
  attribute_slow(attribution);
}

// The same walk through PyFrame_GetBack (frame objects): every Python version.
static void attribute_slow(Attribution& attribution) {
  PyFrameObject* frame = PyThreadState_GetFrame(PyThreadState_Get());  // new reference, or null
  size_t walked = 0;
  while (frame != nullptr && walked < MAX_WALK) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    int flags;
    try {
      flags = flags_of(reinterpret_cast<PyObject*>(code));
      if (!(flags & F_INTERNAL)) {
        if (attribution.site.size() < MAX_STACK) {
          attribution.site.emplace_back(reinterpret_cast<PyObject*>(code), line_of(frame, reinterpret_cast<PyObject*>(code)));
        }
      } else if ((flags & F_FSDP_GROUP) && !attribution.has_module) {
        fsdp_module(frame, attribution);
      }
    } catch (...) {
      Py_DECREF(code);
      Py_DECREF(frame);
      throw;
    }
    Py_DECREF(code);  // kept alive by code_flags
    attribution.flags |= flags;
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
    ++walked;
  }
  Py_XDECREF(frame);
}

// Whether the fast walk sees, from the caller's frame, the same frames (code objects and lines) as
// the PyFrame_* walk; switches it on when it does. Called from Python at load, GIL held.
static bool fast_walk_agrees() {
#ifdef MOEDOCTOR_FAST_WALK
  std::vector<std::pair<PyObject*, int>> slow, fast;
  PyFrameObject* frame = PyThreadState_GetFrame(PyThreadState_Get());
  while (frame != nullptr && slow.size() < 256) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    slow.emplace_back(reinterpret_cast<PyObject*>(code), PyFrame_GetLineNumber(frame));
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  for (MirrorFrame* f = complete(current_frame(PyThreadState_Get())); f != nullptr && fast.size() < 256;
       f = complete(f->previous)) {
    fast.emplace_back(reinterpret_cast<PyObject*>(f->f_code), PyCode_Addr2Line(f->f_code, lasti_of(f)));
  }
  fast_walk = !slow.empty() && slow == fast;
  return fast_walk;
#else
  return false;
#endif
}

static const char* phase_of(int flags) {
  if (const std::string* phase = S.checkpoint_phase.load(std::memory_order_relaxed)) return phase->c_str();
  if (flags & F_CKPT_LOAD) return "checkpoint_load";
  if (flags & F_CKPT_SAVE) return "checkpoint_save";
  if (S.optimizer_depth.load(std::memory_order_relaxed)) return "optimizer";
  if (torch::autograd::get_current_graph_task_id() != -1) return "backward";
  if (flags & F_MODULE_CALL) return "forward";
  return "other";
}

static const std::string& thread_name() {
  if (thread_json == nullptr) thread_json = new std::string(take_str(call_helper("thread_name", nullptr)));
  return *thread_json;
}

// -- interning (GIL and state_mu held) -----------------------------------------------------------

static GroupState& intern_group(const std::string& name, int target) {
  auto it = S.groups.find(name);
  if (it != S.groups.end()) return it->second;
  PyObject* pyname = PyUnicode_FromStringAndSize(name.data(), static_cast<Py_ssize_t>(name.size()));
  if (pyname == nullptr) throw std::runtime_error(py_error_text());
  PyObject* result;
  try {
    result = call_helper1("group", pyname);  // (record fragment bytes, [global ranks])
  } catch (...) {
    Py_DECREF(pyname);
    throw;
  }
  Py_DECREF(pyname);
  GroupState state;
  state.id = static_cast<int>(S.groups.size());
  std::string fragment;
  bool ok = PyTuple_Check(result) && PyTuple_GET_SIZE(result) == 2;
  if (ok) {
    PyObject* bytes = PyTuple_GET_ITEM(result, 0);
    Py_INCREF(bytes);
    fragment = take_bytes(bytes);
    PyObject* ranks = PyTuple_GET_ITEM(result, 1);
    for (Py_ssize_t i = 0; ok && i < PyList_Size(ranks); ++i) {
      state.ranks.push_back(PyLong_AsLongLong(PyList_GET_ITEM(ranks, i)));
    }
    ok = !PyErr_Occurred() && fragment.size() > 2;
  }
  Py_DECREF(result);
  if (!ok) throw std::runtime_error("bad group record: " + py_error_text());
  std::string record = MDK_GROUP_KIND MDK_GROUP_ID;
  append_int(record, state.id);
  record += ',';
  record.append(fragment, 1, std::string::npos);
  append_record(record.data(), record.size());
  S.group_names.push_back(name);
  return S.groups.emplace(name, std::move(state)).first->second;
}

static int intern_site(const SiteKey& key, int target) {
  auto it = S.sites.find(key);
  if (it != S.sites.end()) return it->second;
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(2 * key.size()));
  if (tuple == nullptr) throw std::runtime_error(py_error_text());
  for (size_t i = 0; i < key.size(); ++i) {
    Py_INCREF(key[i].first);
    PyTuple_SET_ITEM(tuple, 2 * i, key[i].first);
    PyTuple_SET_ITEM(tuple, 2 * i + 1, PyLong_FromLong(key[i].second));
  }
  PyObject* result;
  try {
    result = call_helper1("site", tuple);  // record fragment bytes, from callsite.describe
  } catch (...) {
    Py_DECREF(tuple);
    throw;
  }
  Py_DECREF(tuple);
  std::string fragment = take_bytes(result);
  int id = S.next_site++;
  std::string record = MDK_SITE_KIND MDK_SITE_ID;
  append_int(record, id);
  record += ',';
  record.append(fragment, 1, std::string::npos);
  append_record(record.data(), record.size());
  S.sites.emplace(key, id);
  return id;
}

// -- the kernel ----------------------------------------------------------------------------------

static bool python_usable() {
  if (!Py_IsInitialized()) return false;
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

static void report_error(const Spec& spec, const std::string& message) {
  PyObject* args = Py_BuildValue("(ss)", spec.qualified.c_str(), message.c_str());
  if (args == nullptr) {
    PyErr_Clear();
    return;
  }
  try {
    Py_DECREF(call_helper("error", args));
  } catch (...) {
  }
  Py_DECREF(args);
}

// A tensor that only stands for one while torch.compile traces a graph (fake and functional tensors,
// meta tensors): a collective on it sends nothing and advances no backend counter (as
// recorder/kernels.py's _traced).
static bool traced_tensor(const c10::IValue& value) {
  const c10::IValue* first = nullptr;
  if (value.isTensor()) {
    first = &value;
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (item.isTensor()) {
        first = &item;
        break;
      }
      if (item.isList()) {
        for (const c10::IValue& inner : item.toListRef()) {
          if (inner.isTensor()) {
            first = &inner;
            break;
          }
        }
        if (first) break;
      }
    }
  }
  if (first == nullptr) return false;
  const at::Tensor& t = first->toTensor();
  const auto keys = t.key_set();
  return t.is_meta() || keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize);
}

// Interned lower-case reduce-op names given as strings (functional collectives): never freed.
static const std::string* reduce_text(const std::string& raw) {
  static std::mutex mu;
  static auto& known = *new std::deque<std::string>;
  std::string lower;
  for (char c : raw) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::lock_guard<std::mutex> guard(mu);
  for (const std::string& k : known) {
    if (k == lower) return &k;
  }
  known.push_back(std::move(lower));
  return &known.back();
}

// The recording thread's own slot: filled before the locks, copied into the pending list under
// buffer_mu (strings by assignment, so the list's slots keep their capacity).
static void copy_side(RawSide& to, const RawSide& from) {
  to.count = from.count;
  to.kept = from.kept;
  to.text = from.text;
  to.device = from.device;
  if (from.text) {
    to.shapes = from.shapes;
    to.dtypes = from.dtypes;
  } else {
    std::memcpy(to.ndim, from.ndim, from.kept);
    std::memcpy(to.dtype, from.dtype, from.kept * sizeof(c10::ScalarType));
    size_t dims = 0;
    for (size_t i = 0; i < from.kept; ++i) dims += from.ndim[i];
    std::memcpy(to.dims, from.dims, dims * sizeof(int64_t));
  }
}

static void copy_entry(Entry& to, const Entry& from) {
  to.is_bytes = false;
  to.spec = from.spec;
  to.event = from.event;
  to.group = from.group;
  to.seq = from.seq;
  to.pseq = from.pseq;
  to.site = from.site;
  to.now_ns = from.now_ns;
  to.step = from.step;
  to.peer = from.peer;
  to.root = from.root;
  to.p2p = from.p2p;
  to.is_async = from.is_async;
  to.has_root = from.has_root;
  to.root_null = from.root_null;
  to.counts = from.counts;
  to.reduce = from.reduce;
  to.reduce_text = from.reduce_text;
  to.has_splits = from.has_splits;
  if (from.has_splits) to.splits = from.splits;
  to.thread = from.thread;
  to.phase = from.phase;
  to.module = from.module;
  copy_side(to.in, from.in);
  copy_side(to.out, from.out);
}

// What number() needs of the op's arguments besides the record's own slot.
struct Numbering {
  const std::string& group_name;
  int64_t root_rank;   // INT64_MIN: none
  int64_t group_rank;  // a p2p op's peer in the group
};
static constexpr int64_t NEEDS_PYTHON = -2;

// The record's numbers (event id, group, sequence numbers, site, root and peer as global ranks), and
// the record into the pending list, under state_mu. ``python``: the GIL is held, so a group, site or
// cap record not made yet can be made (Python describes them); without it, NEEDS_PYTHON before
// anything is changed. -1: not recorded (no file, or past the cap).
static int64_t number(const Spec& spec, Entry& e, const Attribution& attribution, const Numbering& args,
                      int& group_id, bool python, std::chrono::steady_clock::time_point walked) {
  std::unique_lock<std::mutex> plain;
  std::optional<StateLock> lock;
  if (python) {
    lock.emplace();
  } else {
    plain = std::unique_lock<std::mutex>(S.state_mu);
  }
  const int target = S.fd.load();
  if (target < 0) return -1;
  const auto known = S.groups.find(args.group_name);
  if (!python) {
    const bool site_known = attribution.user_frames().empty() ||
                            (attribution.site_slot != nullptr && *attribution.site_slot >= 0);
    if (!site_known || known == S.groups.end() || (S.written >= S.max_events && S.dropped == 0)) {
      return NEEDS_PYTHON;
    }
  }
  GroupState& group = known != S.groups.end() ? known->second : intern_group(args.group_name, target);
  group_id = group.id;
  e.group = group.id;
  e.has_root = spec.root >= 0;
  if (e.has_root) {  // the root's global rank, as the Python recorder's _global_rank
    e.root_null = args.root_rank == INT64_MIN;
    e.root = (args.root_rank >= 0 && args.root_rank < static_cast<int64_t>(group.ranks.size()))
        ? group.ranks[static_cast<size_t>(args.root_rank)] : args.root_rank;
  }
  e.site = -1;
  if (!attribution.user_frames().empty()) {
    if (attribution.site_slot != nullptr && *attribution.site_slot >= 0) {
      e.site = *attribution.site_slot;
    } else {
      e.site = intern_site(attribution.user_frames(), target);
      if (attribution.site_slot != nullptr) *attribution.site_slot = static_cast<int>(e.site);
    }
  }
  const int64_t event = S.next_event++;
  e.event = event;
  e.p2p = spec.peer >= 0;
  if (e.p2p) {
    e.peer = (args.group_rank >= 0 && args.group_rank < static_cast<int64_t>(group.ranks.size()))
        ? group.ranks[static_cast<size_t>(args.group_rank)] : args.group_rank;
    e.pseq = ++group.pseq[e.peer];
    ++group.p2p_count;
    e.seq = group.seq;  // the collectives before it; not advanced
  } else {
    e.seq = ++group.seq;
  }
  if (S.written >= S.max_events) {
    if (S.dropped++ == 0) {
      std::string cap = take_bytes(call_helper("cap_record", nullptr));
      append_record(cap.data(), cap.size());
    }
    return -1;
  }
  ++S.written;
  // Still under state_mu: the file keeps the order events were numbered in, across threads.
  clock_add(post_ns, walked);
  const auto mark = clock_now();
  if (defer_format) {
    std::unique_lock<std::mutex> guard;
    copy_entry(take_slot(guard), e);
    used.fetch_add(1);
  } else {  // formatted here, into a bytes slot (MOEDOCTOR_DEFER_FORMAT=0)
    static thread_local char* own = new char[OUT_CAPACITY];
    Out out{own, 0, -1};
    format_collective(out, e);
    append_record(own, out.size);
  }
  clock_add(write_ns, mark);
  return event;
}

// Writes the record; returns its event id (-1 when capped or not recorded) and sets group_id.
static int64_t record(const Spec& spec, torch::jit::Stack* stack, int& group_id) {
  const auto entered = clock_now();
  if (stack->size() < spec.nargs) throw std::runtime_error("short stack");
  const size_t base = stack->size() - spec.nargs;
  auto arg = [&](int index) -> const c10::IValue& { return (*stack)[base + static_cast<size_t>(index)]; };
  if (spec.inputs >= 0 && traced_tensor(arg(spec.inputs))) return -1;

  const std::string& group_name = group_name_of(arg(spec.group));
  static thread_local Entry e;
  e.spec = &spec;
  describe_tensors(spec.inputs >= 0 ? arg(spec.inputs) : c10::IValue(), e.in);
  describe_tensors(spec.outputs >= 0 ? arg(spec.outputs) : c10::IValue(), e.out);
  e.reduce = -1;
  e.reduce_text = nullptr;
  if (spec.reduce_op >= 0) {
    const c10::IValue& value = arg(spec.reduce_op);
    if (value.isString()) {
      e.reduce_text = reduce_text(value.toStringRef());
    } else {
      e.reduce = static_cast<int>(borrow_custom_class<c10d::ReduceOp>(value)->op_);
    }
  }
  e.counts = e.in.count > MAX_SHAPES || e.out.count > MAX_SHAPES;
  e.has_splits = spec.out_splits >= 0;
  if (e.has_splits) {  // as the Python recorder: "sp":[[input splits],[output splits]]
    e.splits.clear();
    e.splits += '[';
    if (spec.in_splits >= 0) {
      append_int_list(e.splits, arg(spec.in_splits));
    } else {
      e.splits += "[]";
    }
    e.splits += ',';
    append_int_list(e.splits, arg(spec.out_splits));
    e.splits += ']';
  }
  const int64_t root_rank = spec.root >= 0 && arg(spec.root).isInt() ? arg(spec.root).toInt() : INT64_MIN;
  e.is_async = !spec.c10d || spec.async_op < 0 || arg(spec.async_op).toBool();
  const int64_t group_rank = spec.peer >= 0 ? arg(spec.peer).toInt() : 0;
  e.now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::system_clock::now().time_since_epoch()).count();

  clock_add(pre_ns, entered);

  // The walk: from this thread's call-site cache without the GIL where it can be, else with it.
  Attribution attribution;
  auto mark = clock_now();
  bool attributed = false;
#ifdef MOEDOCTOR_FAST_WALK
  attributed = thread_json != nullptr && attribute_without_gil(attribution);
#endif
  clock_add(walk_ns, mark);
  std::optional<Gil> gil;
  if (!attributed) {
    mark = clock_now();
    gil.emplace();
    clock_add(gil_ns, mark);
    if (!python_usable()) return -1;
    attribution = Attribution();
    mark = clock_now();
    attribute(attribution);
    clock_add(walk_ns, mark);
  }
  const auto walked = clock_now();
  e.thread = &thread_name();  // set (with the GIL) before any walk without it
  e.phase = phase_of(attribution.flags);
  e.step = S.step.load(std::memory_order_relaxed);
  e.module = attribution.has_module ? attribution.module_json : nullptr;
  const Numbering numbering{group_name, root_rank, group_rank};
  int64_t event = number(spec, e, attribution, numbering, group_id, gil.has_value(), walked);
  if (event == NEEDS_PYTHON) {  // a group, site or cap record not made yet: made with the GIL
    mark = clock_now();
    gil.emplace();
    clock_add(gil_ns, mark);
    if (!python_usable()) return -1;
    event = number(spec, e, attribution, numbering, group_id, true, walked);
  }
  return event < 0 ? -1 : event;
}

static void set_defer(bool value) {
  flush_buffer();
  defer_format = value;
}

static void set_clock(bool value) { clock_on = value; }

// Benchmarks: the writer thread's period (benchmarks/always_on.py --versus flush), at least 0.1 ms.
static void set_flush_every(double ms) {
  flush_every_us.store(std::max<int64_t>(100, static_cast<int64_t>(ms * 1000.0)));
}
static double flush_every() { return flush_every_us.load() / 1000.0; }

static py::tuple kernel_time() {
  return py::make_tuple(kernel_calls.load(), kernel_ns.load(), gil_ns.load(), walk_ns.load(), write_ns.load(),
                        pre_ns.load(), post_ns.load());
}

// Per op (index into S.specs): its returned object was seen to be a Work once, type-checked; its Work
// has no future (getFuture threw once).
static constexpr size_t MAX_CHECKED = 256;
static std::atomic<bool> work_checked[MAX_CHECKED];
static std::atomic<bool> no_future[MAX_CHECKED];

// The events whose Work's CPU future completed since the last poll(): appended by the future's callback,
// on whichever thread completes it (a Gloo worker, or the kernel's own when it is complete already).
// Never freed: a backend's thread may complete a future while the static destructors run.
static std::mutex& future_mu = *new std::mutex;
static std::vector<int64_t>& future_done = *new std::vector<int64_t>;

// Benchmarks (set_work_futures): off, every Work is held and asked isCompleted(), as before futures were
// used (benchmarks/always_on.py --versus futures).
static std::atomic<bool> work_futures{true};
static void set_work_futures(bool on) { work_futures.store(on); }

static void mark_future_done(int64_t event) {
  std::lock_guard<std::mutex> guard(future_mu);
  future_done.push_back(event);
}

struct RecordingKernel final : public c10::OperatorKernel {
  explicit RecordingKernel(size_t index) : index(index) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    const auto after = keyset & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);
    if (inside) {  // a functional collective's own c10d call, or one issued from our cold path
      op.redispatchBoxed(after, stack);
      return;
    }
    const Spec& spec = S.specs[index];
    int64_t event = -1;
    int group_id = -1;
    inside = true;
    if (S.fd.load(std::memory_order_relaxed) >= 0 && python_usable()) {
      const auto started = clock_now();
      try {
        event = record(spec, stack, group_id);
        clock_add(kernel_ns, started);
        if (clock_on) kernel_calls.fetch_add(1, std::memory_order_relaxed);
      } catch (const std::exception& e) {  // the job must never fail because of the recorder
        event = -1;
        if (python_usable()) {
          Gil gil;
          report_error(spec, e.what());
        }
      } catch (...) {
        event = -1;
      }
    }
    try {
      op.redispatchBoxed(after, stack);
    } catch (...) {
      inside = false;
      throw;
    }
    inside = false;
    if (event >= 0 && spec.c10d) keep_track(event, group_id, stack);
  }

  // Queues the collective for the progress thread's poll(). A Work whose future is a CPU one (Gloo,
  // MPI: marked complete when the backend has run the collective) reports its completion through a
  // callback on that future, and no reference to it is kept: the job's own holder destroys it, with
  // its tensors, when it would without the recorder (held here instead, the progress thread was the
  // last holder of most Works, and destroying them was its main cost: ~10 us a Work on the CPU FSDP2
  // loop, on the cores the ranks use). Any other Work (NCCL with async_op: its future completes when
  // the collective is enqueued, not run) is held, and asked isCompleted() by poll().
  void keep_track(int64_t event, int group_id, torch::jit::Stack* stack) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    c10::intrusive_ptr<c10d::Work> work;
    try {
      // isObject, not isCustomClass (a registry lookup by type name).
      c10d::Work* held = nullptr;
      if (!stack->empty() && stack->back().isObject()) {
        if (index < MAX_CHECKED && work_checked[index].load(std::memory_order_relaxed)) {
          held = peek_custom_class<c10d::Work>(stack->back());  // null: an empty Work
        } else {  // the first time per op: toCustomClass checks the object really is a Work
          held = stack->back().toCustomClass<c10d::Work>().get();
          if (index < MAX_CHECKED) work_checked[index].store(true, std::memory_order_relaxed);
        }
      }
      if (held != nullptr) {
        // getFuture throws where a Work has none (Gloo's send/recv): asked once per op.
        if (index < MAX_CHECKED && !no_future[index].load(std::memory_order_relaxed) &&
            work_futures.load(std::memory_order_relaxed)) {
          try {
            future = held->getFuture();
          } catch (...) {
            no_future[index].store(true, std::memory_order_relaxed);
          }
        }
        if (!future || !future->devices().empty()) {
          future.reset();
          work = c10::intrusive_ptr<c10d::Work>::reclaim_copy(held);
        }
      }
    } catch (...) {
    }
    {
      std::lock_guard<std::mutex> guard(S.pending_mu);
      S.fresh.push_back(PendingWork{event, group_id, std::move(work), static_cast<bool>(future)});
    }
    // After the item is queued, so that a poll() that takes the mark always finds it (the callback runs
    // here at once when the collective is complete already).
    if (future) {
      try {
        future->addCallback([event](c10::ivalue::Future&) { mark_future_done(event); }, false);
      } catch (...) {
      }
    }
  }

  size_t index;
};

// -- Python API ----------------------------------------------------------------------------------

static void configure(py::object helper, py::dict constants, std::vector<std::string> dtypes,
                      std::vector<std::string> reductions) {
  if (S.helper == nullptr) {
    S.helper = helper.ptr();
    Py_INCREF(S.helper);  // never released
  }
  F_INTERNAL = constants["INTERNAL"].cast<int>();
  F_MODULE_CALL = constants["MODULE_CALL"].cast<int>();
  F_FSDP_GROUP = constants["FSDP_GROUP"].cast<int>();
  F_CKPT_SAVE = constants["CKPT_SAVE"].cast<int>();
  F_CKPT_LOAD = constants["CKPT_LOAD"].cast<int>();
  MAX_SHAPES = std::min<size_t>(constants["MAX_SHAPES"].cast<size_t>(), 256);
  const size_t max_stack = constants["MAX_STACK"].cast<size_t>(), max_walk = constants["MAX_WALK"].cast<size_t>();
#ifdef MOEDOCTOR_FAST_WALK
  if (max_stack != MAX_STACK || max_walk != MAX_WALK) walk_generation.fetch_add(1);  // walks of other limits
#endif
  MAX_STACK = max_stack;
  MAX_WALK = max_walk;
  MAX_PENDING = constants["MAX_PENDING"].cast<size_t>();
  StateLock lock;
  S.max_events = constants["max_events"].cast<int64_t>();
  // The writer formats pending records with these tables: written first, and replaced only if they
  // differ (they never do within a process).
  if (S.dtype_names != dtypes || S.reduce_names != reductions) {
    flush_buffer();
    S.dtype_names = std::move(dtypes);
    S.reduce_names = std::move(reductions);
  }
}

// entries: (namespace, raw_name, op, inputs, outputs, group, reduce_op, async_op, peer, nargs, root,
// in_splits, out_splits), -1 = none.
static void register_kernels(const std::vector<py::tuple>& entries) {
  if (!S.libraries.empty()) return;
  std::vector<Spec> specs;
  std::vector<std::pair<std::string, std::string>> names;
  for (const py::tuple& e : entries) {
    Spec spec;
    names.emplace_back(e[0].cast<std::string>(), e[1].cast<std::string>());
    spec.op = e[2].cast<std::string>();
    spec.qualified = names.back().first + "::" + names.back().second;
    spec.c10d = names.back().first == "c10d";
    spec.inputs = e[3].cast<int>();
    spec.outputs = e[4].cast<int>();
    spec.group = e[5].cast<int>();
    spec.reduce_op = e[6].cast<int>();
    spec.async_op = e[7].cast<int>();
    spec.peer = e[8].cast<int>();
    spec.nargs = e[9].cast<size_t>();
    spec.root = e[10].cast<int>();
    spec.in_splits = e[11].cast<int>();
    spec.out_splits = e[12].cast<int>();
    specs.push_back(std::move(spec));
  }
  if (S.specs.empty()) {
    S.specs = std::move(specs);  // never changed afterwards: kernels index into it
  } else if (S.specs.size() != specs.size()) {
    throw std::runtime_error("moedoctor native: another op set than at the first registration");
  }
  std::map<std::string, size_t> by_namespace;
  for (size_t i = 0; i < names.size(); ++i) {
    auto found = by_namespace.find(names[i].first);
    if (found == by_namespace.end()) {
      S.libraries.push_back(std::make_unique<torch::Library>(
          torch::Library::IMPL, names[i].first, c10::DispatchKey::BackendSelect, __FILE__, __LINE__));
      found = by_namespace.emplace(names[i].first, S.libraries.size() - 1).first;
    }
    S.libraries[found->second]->impl(
        names[i].second.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<RecordingKernel>(i)));
  }
}

static void unregister_kernels() { S.libraries.clear(); }

static void set_fd(int value) {
  if (value < 0) {
    flush_buffer();  // a recorder that stops writes what it has (a failed write drops it instead)
  }
  S.fd.store(value);
  if (value >= 0) start_writer();
}

// Before the Python side writes a record of its own, and at close: the buffer reaches the file first.
static void flush() { without_gil(flush_buffer); }
// A record the Python side made that may wait like the kernels' own (evidence): into the same
// buffer, so the file keeps the order records were made in, and on to the file with them (the writer
// thread, the signal handlers, close). No write(2) on the caller's thread; one that must reach the
// file at once (an exception record) goes through flush() and the Python side's own write instead.
static void append(py::bytes data) {
  char* bytes = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(data.ptr(), &bytes, &size) != 0) throw py::error_already_set();
  if (S.fd.load() < 0 || size <= 0) return;
  append_record(bytes, static_cast<size_t>(size));
}
static int write_error() { return write_errno.load(); }
static void set_step(int64_t value) { S.step.store(value, std::memory_order_relaxed); }
static void set_optimizer_depth(int64_t value) { S.optimizer_depth.store(value, std::memory_order_relaxed); }
static void set_checkpoint(py::object value) {
  static auto& phases = *new std::deque<std::string>;  // interned: pending records point at them
  if (value.is_none()) {
    S.checkpoint_phase = nullptr;
    return;
  }
  const std::string text = value.cast<std::string>();
  for (const std::string& known : phases) {
    if (known == text) {
      S.checkpoint_phase = &known;
      return;
    }
  }
  phases.push_back(text);
  S.checkpoint_phase = &phases.back();
}
static void set_assume_completed(bool value) {
  std::lock_guard<std::mutex> guard(S.pending_mu);
  S.assume_completed = value;
}

// future_marks: the events whose future completed (sorted), taken from future_done by this poll.
static bool completed(const PendingWork& item, const std::vector<int64_t>& future_marks) {
  if (S.assume_completed) return true;
  if (item.by_future) return std::binary_search(future_marks.begin(), future_marks.end(), item.event);
  if (!item.work) return false;
  try {
    return item.work->isCompleted();
  } catch (...) {  // a work that failed (its rank is going down): never completed
    return false;
  }
}

static std::mutex release_mu;  // held while poll() destroys the Works it released
static bool releasing_stopped = false;  // stop_releasing() ran: the interpreter is about to finalize

// The ids of the tracked collectives seen complete since the last poll (Progress._poll_pending_locked's
// rules: the Work says so, or a later collective of its group has completed); the Works it lets go of
// go into ``released``, for the caller to destroy.
static std::vector<int64_t> poll_completed_without_gil(std::vector<c10::intrusive_ptr<c10d::Work>>& released) {
  std::vector<int64_t> done;
  std::vector<int64_t> future_marks;
  {
    std::lock_guard<std::mutex> guard(S.pending_mu);
    {  // every event marked here is queued already (keep_track adds the callback after queueing)
      std::lock_guard<std::mutex> marks_guard(future_mu);
      future_marks.swap(future_done);
    }
    std::sort(future_marks.begin(), future_marks.end());
    auto release = [&](PendingWork& item) {  // a Work held (none for by_future items): the caller destroys it
      if (item.work) released.push_back(std::move(item.work));
    };
    auto mark = [&](PendingWork& item) {
      done.push_back(item.event);
      auto it = S.last_done.find(item.group);
      if (it == S.last_done.end()) {
        S.last_done.emplace(item.group, item.event);
      } else if (item.event > it->second) {
        it->second = item.event;
      }
      release(item);
    };
    for (size_t n = S.fresh.size(); n > 0; --n) {
      PendingWork item = std::move(S.fresh.front());
      S.fresh.pop_front();
      if (completed(item, future_marks)) {
        mark(item);
      } else {
        S.pending.push_back(std::move(item));
      }
    }
    std::vector<PendingWork> still;
    for (size_t n = S.pending.size(); n > 0; --n) {
      PendingWork item = std::move(S.pending.front());
      S.pending.pop_front();
      if (completed(item, future_marks)) {
        mark(item);
      } else {
        still.push_back(std::move(item));
      }
    }
    for (PendingWork& item : still) {
      auto it = S.last_done.find(item.group);
      if (it != S.last_done.end() && item.event < it->second) {
        done.push_back(item.event);
        release(item);
      } else {
        S.pending.push_back(std::move(item));
      }
    }
    while (S.pending.size() > MAX_PENDING) {  // the oldest: its completion stays unknown
      release(S.pending.front());
      S.pending.pop_front();
    }
  }
  std::sort(done.begin(), done.end());
  return done;
}
static std::vector<int64_t> poll_completed() {
  std::vector<int64_t> done;
  // The released Works are destroyed without the GIL, as torch's own holders destroy theirs: ours is
  // often a Work's last reference, and with it the last one of its tensors, and a tensor whose Python
  // object outlived the job's own reference takes the GIL for a moment to hand it back (destroyed with
  // the GIL held instead, in batches, the training thread waited on the GIL for whole batches: step
  // time +5.6% against +1.7-2.5% for the progress thread working, CPU FSDP2 loop). While the interpreter
  // finalizes, a daemon thread taking the GIL is ended by pthread_exit, and inside a destructor that
  // is std::terminate: so after stop_releasing() (the recorder's last exit handler, before
  // finalization) they are left alive instead, and a destruction under way then is waited for. On the
  // heap: a thread ended in taking the GIL back unwinds past them and never destroys them.
  auto* released = new std::vector<c10::intrusive_ptr<c10d::Work>>;
  without_gil([&] {
    done = poll_completed_without_gil(*released);
    std::lock_guard<std::mutex> guard(release_mu);
    if (!releasing_stopped) delete released;
  });
  return done;  // converted to a list once pybind11 holds the GIL again
}

// Called at interpreter exit (the recorder's atexit handler, before finalization): no Work is destroyed
// by poll() from here on; one being destroyed now is waited for, the GIL released meanwhile.
static void stop_releasing() {
  without_gil([] {
    std::lock_guard<std::mutex> guard(release_mu);
    releasing_stopped = true;
  });
}

// ({group name: (collectives, p2p ops) recorded}, dropped), for the coverage record.
static py::tuple counts() {
  py::dict result;
  int64_t dropped;
  {
    StateLock lock;
    for (auto& [name, group] : S.groups) result[py::str(name)] = py::make_tuple(group.seq, group.p2p_count);
    dropped = S.dropped;
  }
  return py::make_tuple(result, dropped);
}

// Take over the Python recorder's counters (kernels switched from Python to native).
// groups: [(name, id, [ranks], seq, p2p_count, {peer or None: count})]
// sites: [(site key tuple (code, line, ...), id)]
static void import_state(int64_t next_event, int64_t written, int64_t dropped, py::list groups, int site_count,
                         py::list sites) {
  StateLock lock;
  for (py::handle item : sites) {
    auto t = item.cast<py::tuple>();
    auto key_tuple = t[0].cast<py::tuple>();
    SiteKey key;
    for (size_t i = 0; i + 1 < key_tuple.size(); i += 2) {
      PyObject* code = key_tuple[i].ptr();
      key.emplace_back(code, key_tuple[i + 1].cast<int>());
    }
    if (S.sites.emplace(key, t[1].cast<int>()).second) {
      for (auto& [code, line] : key) Py_INCREF(code);  // as the Python recorder's _sites keys do
    }
  }
  S.next_event = std::max(S.next_event, next_event);
  S.written = std::max(S.written, written);
  S.dropped = std::max(S.dropped, dropped);
  S.next_site = std::max(S.next_site, site_count);
  for (py::handle item : groups) {
    auto t = item.cast<py::tuple>();
    auto name = t[0].cast<std::string>();
    GroupState state;
    state.id = t[1].cast<int>();
    state.ranks = t[2].cast<std::vector<int64_t>>();
    state.seq = t[3].cast<int64_t>();
    state.p2p_count = t[4].cast<int64_t>();
    for (auto [peer, count] : t[5].cast<py::dict>()) {
      state.pseq[peer.is_none() ? INT64_MIN : peer.cast<int64_t>()] = count.cast<int64_t>();
    }
    if (S.groups.find(name) == S.groups.end()) S.group_names.push_back(name);
    S.groups[name] = std::move(state);
  }
}

// The native counters, for the Python recorder to take over (kernels switched back to Python):
// (next_event, written, dropped, groups as import_state takes them, [(site key, id)], next site id).
static py::tuple export_state() {
  StateLock lock;
  py::list groups;
  for (auto& name : S.group_names) {
    GroupState& g = S.groups[name];
    py::dict pseq;
    for (auto& [peer, count] : g.pseq) {
      if (peer == INT64_MIN) {
        pseq[py::none()] = count;
      } else {
        pseq[py::int_(peer)] = count;
      }
    }
    groups.append(py::make_tuple(name, g.id, g.ranks, g.seq, g.p2p_count, pseq));
  }
  py::list sites;
  for (auto& [key, id] : S.sites) {
    py::tuple k(2 * key.size());
    for (size_t i = 0; i < key.size(); ++i) {
      k[2 * i] = py::reinterpret_borrow<py::object>(key[i].first);
      k[2 * i + 1] = py::int_(key[i].second);
    }
    sites.append(py::make_tuple(k, id));
  }
  return py::make_tuple(S.next_event, S.written, S.dropped, groups, sites, S.next_site);
}

// The call-site cache on or off (the fast walk only: the frame-object walk is never cached); whether it
// is on now.
static bool set_site_cache(bool value) {
#ifdef MOEDOCTOR_FAST_WALK
  site_cache = value;
  return site_cache;
#else
  (void)value;
  return false;
#endif
}

// (walks answered from the call-site cache, walks made in full while it was on, collectives recorded
// without taking the GIL).
static py::tuple site_cache_counts() {
#ifdef MOEDOCTOR_FAST_WALK
  return py::make_tuple(cache_hits.load(), cache_misses.load(), gil_free_count.load());
#else
  return py::make_tuple(0, 0, 0);
#endif
}

// A call-site cache hit recorded without taking the GIL (on, the default) or with it; whether it is
// on now (never without the fast walk's cache).
static bool set_gil_free(bool value) {
#ifdef MOEDOCTOR_FAST_WALK
  gil_free_hits = value;
  return gil_free_hits && site_cache;
#else
  (void)value;
  return false;
#endif
}

static int scalar_type_of(const at::Tensor& t) { return static_cast<int>(t.scalar_type()); }

}  // namespace moedoctor_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace moedoctor_native;
  m.def("configure", &configure);
  m.def("register_kernels", &register_kernels);
  m.def("unregister_kernels", &unregister_kernels);
  m.def("set_fd", &set_fd);
  m.def("write_error", &write_error);
  m.def("flush", &flush);
  m.def("append", &append);
  m.def("set_step", &set_step);
  m.def("set_optimizer_depth", &set_optimizer_depth);
  m.def("set_checkpoint", &set_checkpoint);
  m.def("set_assume_completed", &set_assume_completed);
  m.def("poll", &poll_completed);
  m.def("stop_releasing", &stop_releasing);
  m.def("counts", &counts);
  m.def("kernel_time", &kernel_time);
  m.def("set_clock", &set_clock);
  m.def("set_flush_every", &set_flush_every);
  m.def("set_work_futures", &set_work_futures);
  m.def("flush_every", &flush_every);
  m.def("set_defer", &set_defer);
  m.def("fast_walk_agrees", &fast_walk_agrees);
  m.def("set_site_cache", &set_site_cache);
  m.def("site_cache_counts", &site_cache_counts);
  m.def("set_gil_free", &set_gil_free);
  m.def("import_state", &import_state);
  m.def("export_state", &export_state);
  m.def("scalar_type_of", &scalar_type_of);
}
