// The CUDA side of a pipeline rank: a compute stream (torch's current stream, where stages run) and one copy
// stream per lane (one channel's transfers), ordered by events only. A transfer between stages leaves the
// device through pinned host memory, which the process group's CPU transport (gloo) sends:
//
//   send:    mark(compute) -> stage(lane, after = that mark, device -> host) -> wait on the lane's thread -> send
//   receive: receive into pinned memory -> stage(lane, host -> device) -> order(compute, that ticket)
//
// so compute never waits on the host for a transfer, and a transfer's copies wait only for the compute that
// produced their data. Copy streams have the device's highest priority: a copy's blocks are scheduled ahead of
// queued compute, which keeps the next stage fed. Events come from a pool and are named by small integer
// tickets, so that Python (sbp_torch/_cuda_streams.py) holds plain ints.
//
// Plain CUDA runtime, no torch headers: CI compiles it with `nvcc -c` on a machine without a GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace sbp_streams {

// One contiguous piece of a staged copy.
struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};

class StreamScheduler {
 public:
  explicit StreamScheduler(int device);
  ~StreamScheduler();
  StreamScheduler(const StreamScheduler&) = delete;
  StreamScheduler& operator=(const StreamScheduler&) = delete;

  // A new copy stream (highest priority, non-blocking w.r.t. the legacy default stream); returns its lane index.
  int add_lane();
  // The lane's copy stream: device memory that a lane writes is allocated on it (see sbp_torch/_cuda_streams.py).
  cudaStream_t lane_stream(int lane) const;

  // A ticket for "everything queued on `stream` so far".
  int mark(cudaStream_t stream);
  // On `lane`: wait (on the device) for ticket `after` (-1: nothing), queue every copy, and return a ticket for
  // their end. `to_device` picks the direction (host to device, else device to host).
  int stage(int lane, int after, const std::vector<Copy>& copies, bool to_device);
  // Make `stream` wait, on the device, for `ticket`; the host goes on at once.
  void order(cudaStream_t stream, int ticket);
  // Whether the work behind `ticket` has finished (never blocks).
  bool done(int ticket);
  // Block the calling host thread until `ticket` has finished (a lane's thread, before it hands host memory on).
  void wait(int ticket);
  // Return `ticket` to the pool (after its last order/done/wait).
  void release(int ticket);
  // Tickets handed out and not yet released (a leak check for tests).
  int outstanding();

 private:
  int acquire();
  cudaEvent_t event(int ticket);

  int device_;
  std::vector<cudaStream_t> lanes_;
  std::vector<cudaEvent_t> events_;
  std::vector<bool> in_use_;
  std::vector<int> free_;
  mutable std::mutex mutex_;  // lanes run on their own threads
};

}  // namespace sbp_streams
