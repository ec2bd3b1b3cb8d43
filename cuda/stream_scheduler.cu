// See stream_scheduler.h: copy streams per lane, pooled events as tickets, device-side ordering.
#include "stream_scheduler.h"

#include <stdexcept>
#include <string>

namespace sbp_streams {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("sbp_torch stream scheduler: ") + what + ": " +
                                                   cudaGetErrorString(err));
}

// Sets the scheduler's device for the calling thread while in scope (lanes are other threads).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace

StreamScheduler::StreamScheduler(int device) : device_(device) {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (device < 0 || device >= count)
    throw std::invalid_argument("sbp_torch stream scheduler: no CUDA device " + std::to_string(device) + " (" +
                                std::to_string(count) + " visible)");
}

StreamScheduler::~StreamScheduler() {
  DeviceGuard guard(device_);
  for (cudaStream_t s : lanes_) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

int StreamScheduler::add_lane() {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard(device_);
  int least = 0, greatest = 0;  // numerically lower is higher priority
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest), "cudaStreamCreateWithPriority");
  lanes_.push_back(stream);
  return static_cast<int>(lanes_.size()) - 1;
}

cudaStream_t StreamScheduler::lane_stream(int lane) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (lane < 0 || lane >= static_cast<int>(lanes_.size()))
    throw std::out_of_range("sbp_torch stream scheduler: no lane " + std::to_string(lane));
  return lanes_[lane];
}

int StreamScheduler::acquire() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.empty()) {
    DeviceGuard guard(device_);
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    events_.push_back(e);
    in_use_.push_back(false);
    free_.push_back(static_cast<int>(events_.size()) - 1);
  }
  int ticket = free_.back();
  free_.pop_back();
  in_use_[ticket] = true;
  return ticket;
}

cudaEvent_t StreamScheduler::event(int ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ticket < 0 || ticket >= static_cast<int>(events_.size()) || !in_use_[ticket])
    throw std::invalid_argument("sbp_torch stream scheduler: ticket " + std::to_string(ticket) + " is not held");
  return events_[ticket];
}

int StreamScheduler::mark(cudaStream_t stream) {
  int ticket = acquire();
  DeviceGuard guard(device_);
  check(cudaEventRecord(event(ticket), stream), "cudaEventRecord");
  return ticket;
}

int StreamScheduler::stage(int lane, int after, const std::vector<Copy>& copies, bool to_device) {
  cudaStream_t stream = lane_stream(lane);
  DeviceGuard guard(device_);
  if (after >= 0) check(cudaStreamWaitEvent(stream, event(after), 0), "cudaStreamWaitEvent");
  const cudaMemcpyKind kind = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  for (const Copy& c : copies) {
    if (c.bytes) check(cudaMemcpyAsync(c.dst, c.src, c.bytes, kind, stream), "cudaMemcpyAsync");
  }
  int ticket = acquire();
  check(cudaEventRecord(event(ticket), stream), "cudaEventRecord");
  return ticket;
}

void StreamScheduler::order(cudaStream_t stream, int ticket) {
  DeviceGuard guard(device_);
  check(cudaStreamWaitEvent(stream, event(ticket), 0), "cudaStreamWaitEvent");
}

bool StreamScheduler::done(int ticket) {
  cudaError_t err = cudaEventQuery(event(ticket));
  if (err == cudaErrorNotReady) return false;
  check(err, "cudaEventQuery");
  return true;
}

void StreamScheduler::wait(int ticket) { check(cudaEventSynchronize(event(ticket)), "cudaEventSynchronize"); }

void StreamScheduler::release(int ticket) {
  event(ticket);  // refuses a ticket that is not held
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_[ticket] = false;
  free_.push_back(ticket);
}

int StreamScheduler::outstanding() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(events_.size() - free_.size());
}

}  // namespace sbp_streams
