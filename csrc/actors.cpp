// The actor runtime's core in C++: registers with slot quotas, actor readiness, slot accounting and the loop of
// one rank. Exposed as sbp_torch._actors_core with the same classes and behaviour as sbp_torch/_actors.py (the
// pure-Python version, which documents the model); sbp_torch/_runtime.py picks one. The loop decides and
// waits in C++ and calls into Python only for actor bodies, asynchronous polls and the idle check; while
// idle it waits on a condition variable with the GIL released, so transfer threads run and wake it at once.
//
// Plain pybind11 (the headers torch ships), no torch headers: it builds in seconds wherever a C++ compiler is.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

double seconds_now() {  // the clock of Python's time.perf_counter on Linux (CLOCK_MONOTONIC)
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Register {
  std::string name;
  int slots;
  bool read_when_full;
  std::deque<py::object> entries;  // produced, not yet taken
  int occupied = 0;                // produced, not yet released
  int peak = 0;                    // most slots occupied at once
  bool producer_done = false;

  Register(std::string name_, int slots_, bool read_when_full_)
      : name(std::move(name_)), slots(slots_), read_when_full(read_when_full_) {
    if (slots < 1) throw py::value_error("register " + name + " needs at least one slot, got " + std::to_string(slots));
  }
  bool free() const { return occupied < slots; }
  bool readable() const {
    if (entries.empty()) return false;
    return !read_when_full || occupied == slots || producer_done;
  }
  void produce(py::object value) {
    if (!free()) throw std::runtime_error("register " + name + " overflows its " + std::to_string(slots) + " slots");
    entries.push_back(std::move(value));
    occupied += 1;
    peak = std::max(peak, occupied);
  }
  py::object take() {
    py::object value = std::move(entries.front());
    entries.pop_front();
    return value;
  }
  void release() { occupied -= 1; }
};

using RegisterPtr = std::shared_ptr<Register>;

struct Pending {
  py::object poll;  // () -> None until done, then the output values
};

struct Actor {
  std::string name;
  py::object body;
  int count;
  std::vector<RegisterPtr> inputs, outputs;
  std::string kind;
  int fired = 0;
  bool busy = false;  // an asynchronous firing is under way

  bool ready() const {
    if (busy || fired >= count) return false;
    for (const auto& r : inputs)
      if (!r->readable()) return false;
    for (const auto& r : outputs)
      if (!r->free()) return false;
    return true;
  }
};

using ActorPtr = std::shared_ptr<Actor>;

struct Event {
  std::string actor, kind;
  int index;
  double start, end;
};

struct InFlight {
  ActorPtr actor;
  int index;
  double start;
  py::object poll;
};

class Runtime {
 public:
  Runtime(py::object check, double check_every) : check_(std::move(check)), check_every_(check_every) {}

  // Wake the loop: some Pending may be done. Thread-safe; asynchronous work calls it when it ends.
  void notify() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      woken_ = true;
    }
    wakeup_.notify_one();
  }

  ActorPtr add(ActorPtr actor) {
    actors_.push_back(actor);
    return actor;
  }

  // Fire actors until each has fired its count (see sbp_torch/_actors.py: Runtime.run).
  void run() {
    while (true) {
      poll_pending();
      if (all_done()) return;
      if (ActorPtr actor = first_ready()) {
        fire(actor);
        continue;
      }
      if (pending_.empty()) throw std::runtime_error("actor graph is stuck: nothing ready and nothing in flight: " + unfinished());
      if (!wait_for_notify() && !check_.is_none()) check_();
    }
  }

  std::vector<ActorPtr> actors_;
  std::vector<Event> events_;

 private:
  bool all_done() const {
    for (const auto& a : actors_)
      if (a->fired != a->count) return false;
    return true;
  }

  ActorPtr first_ready() const {
    for (const auto& a : actors_)
      if (a->ready()) return a;
    return nullptr;
  }

  std::string unfinished() const {
    std::string out = "[";
    for (const auto& a : actors_) {
      if (a->fired >= a->count) continue;
      if (out.size() > 1) out += ", ";
      out += "'" + a->name + " (" + std::to_string(a->fired) + "/" + std::to_string(a->count) + ")'";
    }
    return out + "]";
  }

  void fire(const ActorPtr& actor) {
    int index = actor->fired;
    double start = seconds_now();
    py::list inputs;
    for (auto& r : actor->inputs) inputs.append(r->take());
    py::object out = actor->body(index, inputs);
    for (auto& r : actor->inputs) r->release();
    if (py::isinstance<Pending>(out)) {
      actor->busy = true;
      pending_.push_back({actor, index, start, out.cast<Pending&>().poll});
    } else {
      finish(actor, index, start, out);
    }
  }

  void finish(const ActorPtr& actor, int index, double start, const py::object& values) {
    py::tuple seq = py::tuple(values);
    size_t n = std::min(actor->outputs.size(), seq.size());  // as Python's zip
    for (size_t i = 0; i < n; ++i) actor->outputs[i]->produce(seq[i]);
    actor->fired += 1;
    if (actor->fired == actor->count)
      for (auto& r : actor->outputs) r->producer_done = true;
    events_.push_back({actor->name, actor->kind, index, start, seconds_now()});
  }

  void poll_pending() {
    for (size_t i = 0; i < pending_.size();) {
      py::object values = pending_[i].poll();
      if (values.is_none()) {
        ++i;
        continue;
      }
      InFlight done = pending_[i];
      pending_.erase(pending_.begin() + static_cast<long>(i));
      done.actor->busy = false;
      finish(done.actor, done.index, done.start, values);
    }
  }

  // Sleep until notify() or check_every passes; true if notified. The GIL is released meanwhile.
  bool wait_for_notify() {
    py::gil_scoped_release no_gil;
    std::unique_lock<std::mutex> lock(mutex_);
    bool woken = wakeup_.wait_for(lock, std::chrono::duration<double>(check_every_), [this] { return woken_; });
    woken_ = false;
    return woken;
  }

  py::object check_;
  double check_every_;
  std::vector<InFlight> pending_;
  std::mutex mutex_;
  std::condition_variable wakeup_;
  bool woken_ = false;
};

}  // namespace

PYBIND11_MODULE(_actors_core, m) {
  m.doc() = "The actor runtime's core in C++ (see sbp_torch/_actors.py for the model and csrc/actors.cpp).";

  py::class_<Register, RegisterPtr>(m, "Register")
      .def(py::init<std::string, int, bool>(), py::arg("name"), py::arg("slots"), py::kw_only(),
           py::arg("read_when_full") = false)
      .def_readonly("name", &Register::name)
      .def_readonly("slots", &Register::slots)
      .def_readonly("read_when_full", &Register::read_when_full)
      .def_readonly("occupied", &Register::occupied)
      .def_readonly("peak", &Register::peak)
      .def_readonly("producer_done", &Register::producer_done)
      .def("free", &Register::free)
      .def("readable", &Register::readable)
      .def("produce", &Register::produce)
      .def("take", &Register::take)
      .def("release", &Register::release);

  py::class_<Pending>(m, "Pending")
      .def(py::init<py::object>(), py::arg("poll"))
      .def_readonly("poll", &Pending::poll);

  py::class_<Actor, ActorPtr>(m, "Actor")
      .def(py::init([](std::string name, py::object body, int count, std::vector<RegisterPtr> inputs,
                       std::vector<RegisterPtr> outputs, std::string kind) {
             auto a = std::make_shared<Actor>();
             a->name = std::move(name);
             a->body = std::move(body);
             a->count = count;
             a->inputs = std::move(inputs);
             a->outputs = std::move(outputs);
             a->kind = std::move(kind);
             return a;
           }),
           py::arg("name"), py::arg("body"), py::arg("count"), py::arg("inputs") = std::vector<RegisterPtr>{},
           py::arg("outputs") = std::vector<RegisterPtr>{}, py::arg("kind") = "compute")
      .def_readonly("name", &Actor::name)
      .def_readonly("count", &Actor::count)
      .def_readonly("kind", &Actor::kind)
      .def_readonly("fired", &Actor::fired)
      .def_readonly("busy", &Actor::busy)
      .def("ready", &Actor::ready);

  py::class_<Event>(m, "Event")
      .def_readonly("actor", &Event::actor)
      .def_readonly("kind", &Event::kind)
      .def_readonly("index", &Event::index)
      .def_readonly("start", &Event::start)
      .def_readonly("end", &Event::end);

  py::class_<Runtime>(m, "Runtime")
      .def(py::init<py::object, double>(), py::arg("check") = py::none(), py::arg("check_every") = 0.01)
      .def("notify", &Runtime::notify)
      .def("add", &Runtime::add)
      .def("run", &Runtime::run)
      .def_readonly("actors", &Runtime::actors_)
      .def_readonly("events", &Runtime::events_);
}
