// Python glue for cuda/stream_scheduler.{h,cu}: exposed as sbp_torch._streams_cuda with the same methods as
// the Python twin in sbp_torch/_cuda_streams.py, which picks one. Streams and tensors arrive as the torch
// objects and are read through their Python attributes (``cuda_stream``, ``data_ptr()``, ``nbytes``), so no
// torch headers are needed; host waits and copies release the GIL so that the actor loop goes on meanwhile.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "../cuda/stream_scheduler.h"

namespace py = pybind11;
using sbp_streams::Copy;
using sbp_streams::StreamScheduler;

namespace {

cudaStream_t as_stream(const py::object& stream) {
  return reinterpret_cast<cudaStream_t>(stream.attr("cuda_stream").cast<std::uintptr_t>());
}

void* address(const py::handle& tensor) {
  return reinterpret_cast<void*>(tensor.attr("data_ptr")().cast<std::uintptr_t>());
}

// (destination, source) tensor pairs of equal size; the caller keeps both alive until the copies' ticket is done.
std::vector<Copy> as_copies(const py::list& pairs) {
  std::vector<Copy> copies;
  copies.reserve(pairs.size());
  for (const py::handle& pair : pairs) {
    py::tuple dst_src = pair.cast<py::tuple>();
    const size_t bytes = dst_src[0].attr("nbytes").cast<size_t>();
    if (dst_src[1].attr("nbytes").cast<size_t>() != bytes)
      throw py::value_error("sbp_torch stream scheduler: a copy's destination and source differ in size");
    copies.push_back(Copy{address(dst_src[0]), address(dst_src[1]), bytes});
  }
  return copies;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The CUDA stream scheduler of sbp_torch pipelines (cuda/stream_scheduler.h).";
  py::class_<StreamScheduler>(m, "StreamScheduler")
      .def(py::init<int>(), py::arg("device"))
      .def("add_lane", &StreamScheduler::add_lane)
      .def("lane_stream",
           [](const StreamScheduler& s, int lane) { return reinterpret_cast<std::uintptr_t>(s.lane_stream(lane)); })
      .def("mark", [](StreamScheduler& s, const py::object& stream) { return s.mark(as_stream(stream)); })
      .def("stage",
           [](StreamScheduler& s, int lane, int after, const py::list& pairs, bool to_device) {
             std::vector<Copy> copies = as_copies(pairs);
             py::gil_scoped_release unlocked;
             return s.stage(lane, after, copies, to_device);
           },
           py::arg("lane"), py::arg("after"), py::arg("copies"), py::arg("to_device"))
      .def("order",
           [](StreamScheduler& s, const py::object& stream, int ticket) { s.order(as_stream(stream), ticket); })
      .def("done", &StreamScheduler::done)
      .def("wait", &StreamScheduler::wait, py::call_guard<py::gil_scoped_release>())
      .def("release", &StreamScheduler::release)
      .def_property_readonly("outstanding", &StreamScheduler::outstanding);
}
