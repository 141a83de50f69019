"""What the dispatcher's boxing costs a recording kernel at BackendSelect, per collective (issue 31).

The native recorder registers one *boxed* functor per collective op at ``BackendSelect``. c10d's
``ProcessGroup`` methods (what ``dist.all_gather_single``, ``dist.reduce_scatter_single`` and
``dist.all_reduce`` call) call the op *unboxed*, so the dispatcher boxes every argument into a stack
for the functor (the process group and the reduce op become TorchBind objects), the functor's
``redispatchBoxed`` unboxes them again for the backend's kernel, boxes its result, and the caller
unboxes that. An unboxed kernel with the op's exact C++ signature that redispatches unboxed
(``op.typed<...>().redispatch(ks, ...)``) does none of it. This script measures both pass-through
kernels (recording nothing) against no kernel at all, for the three ops FSDP2 and DDP issue most,
in one process on PyTorch's in-process ``fake`` backend (collectives complete at once):

- ``c++``: a loop in C++ calling the ``ProcessGroup`` method (``_allgather_base``,
  ``_reduce_scatter_base``, ``allreduce``) as torch's Python binding does: the dispatcher alone.
- ``python``: ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` / ``dist.all_reduce``
  from Python, as FSDP2 and DDP call them.
- ``c++ cold`` / ``py cold``: the same, with ``--evict-kib`` of memory written before each call (what a
  training step's other work does to the caches between two collectives: the recorder's stack walk
  costs 0.1-0.4 us in a tight loop and 2.4-4.7 us in the FSDP2 loop), only the calls timed, the
  median call of each round.

Rounds alternate the three registrations (none, boxed, unboxed) in a rotating order, so drift slower
than a round cancels; each figure is the median over rounds of the per-round difference from no
kernel, in microseconds per collective.

  python benchmarks/boxing_cost.py [--iters 20000] [--rounds 15] [--evict-kib 4096]

The kernels are built with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import cpp_extension

SOURCE = r"""
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>

using PG = c10::intrusive_ptr<c10d::ProcessGroup>;
using RO = c10::intrusive_ptr<c10d::ReduceOp>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
static std::atomic<int64_t> boxed_calls{0}, unboxed_calls{0};  // the check that the kernels ran
static const auto AFTER = c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);

struct Boxed final : public c10::OperatorKernel {
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    boxed_calls.fetch_add(1, std::memory_order_relaxed);
    op.redispatchBoxed(ks & AFTER, stack);
  }
};

static std::tuple<at::Tensor, WorkPtr> allgather_base(c10::DispatchKeySet ks, at::Tensor& out, at::Tensor& in,
                                                      const PG& pg, bool async_op, int64_t timeout) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("c10d::_allgather_base_", "")
      .typed<std::tuple<at::Tensor, WorkPtr>(at::Tensor&, at::Tensor&, const PG&, bool, int64_t)>();
  unboxed_calls.fetch_add(1, std::memory_order_relaxed);
  return op.redispatch(ks & AFTER, out, in, pg, async_op, timeout);
}

static std::tuple<at::Tensor, WorkPtr> reduce_scatter_base(c10::DispatchKeySet ks, at::Tensor& out, at::Tensor& in,
                                                           const PG& pg, const RO& reduce, bool async_op,
                                                           int64_t timeout) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("c10d::_reduce_scatter_base_", "")
      .typed<std::tuple<at::Tensor, WorkPtr>(at::Tensor&, at::Tensor&, const PG&, const RO&, bool, int64_t)>();
  unboxed_calls.fetch_add(1, std::memory_order_relaxed);
  return op.redispatch(ks & AFTER, out, in, pg, reduce, async_op, timeout);
}

static std::tuple<std::vector<at::Tensor>, WorkPtr> allreduce(c10::DispatchKeySet ks, at::TensorList tensors,
                                                              const PG& pg, const RO& reduce,
                                                              const std::optional<at::Tensor>& sparse,
                                                              bool async_op, int64_t timeout) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("c10d::allreduce_", "")
      .typed<std::tuple<std::vector<at::Tensor>, WorkPtr>(at::TensorList, const PG&, const RO&,
                                                            const std::optional<at::Tensor>&, bool, int64_t)>();
  unboxed_calls.fetch_add(1, std::memory_order_relaxed);
  return op.redispatch(ks & AFTER, tensors, pg, reduce, sparse, async_op, timeout);
}

static std::unique_ptr<torch::Library> lib;
static const char* NAMES[] = {"_allgather_base_", "_reduce_scatter_base_", "allreduce_"};

static std::unique_ptr<torch::Library> make_library() {
  return std::make_unique<torch::Library>(torch::Library::IMPL, "c10d", c10::DispatchKey::BackendSelect,
                                          __FILE__, __LINE__);
}

static void register_boxed() {
  lib.reset();  // the other registration first
  lib = make_library();
  for (const char* name : NAMES) lib->impl(name, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Boxed>()));
}

static void register_unboxed() {
  lib.reset();  // the other registration first
  lib = make_library();
  lib->impl(NAMES[0], TORCH_FN(allgather_base));
  lib->impl(NAMES[1], TORCH_FN(reduce_scatter_base));
  lib->impl(NAMES[2], TORCH_FN(allreduce));
}

static void unregister() { lib.reset(); }
static std::pair<int64_t, int64_t> calls() { return {boxed_calls.load(), unboxed_calls.load()}; }

// One call of the ProcessGroup method for op `which`, as torch's Python binding makes it.
static void issue(int which, const PG& pg, at::Tensor& small, at::Tensor& big, std::vector<at::Tensor>& list) {
  if (which == 0) {
    pg->_allgather_base(big, small)->wait();
  } else if (which == 1) {
    pg->_reduce_scatter_base(small, big)->wait();
  } else {
    pg->allreduce(list)->wait();
  }
}

// ns per call of the ProcessGroup method for op `which`, `iters` times, from C++.
static double loop(int which, int64_t iters, const std::string& group, at::Tensor small, at::Tensor big) {
  PG pg = c10d::resolve_process_group(group);
  std::vector<at::Tensor> list{small};
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) issue(which, pg, small, big, list);
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / iters;
}

// Reads and writes `bytes` of memory, a cache line at a time: what a training step's other work does
// to the caches between two collectives.
static std::vector<char>& evict_buffer() {
  static auto& buffer = *new std::vector<char>();
  return buffer;
}
static int64_t evict_sink = 0;
static void evict() {
  auto& buffer = evict_buffer();
  for (size_t i = 0; i < buffer.size(); i += 64) evict_sink += ++buffer[i];
}
static void set_evict(int64_t bytes) { evict_buffer().assign(static_cast<size_t>(bytes), 0); }

// As loop(), with the caches evicted before each call and only the calls timed: the median call (a
// call that other processes on the host interrupted does not move it).
static double cold_loop(int which, int64_t iters, const std::string& group, at::Tensor small, at::Tensor big) {
  PG pg = c10d::resolve_process_group(group);
  std::vector<at::Tensor> list{small};
  std::vector<double> times;
  times.reserve(static_cast<size_t>(iters));
  for (int64_t i = 0; i < iters; ++i) {
    evict();
    const auto start = std::chrono::steady_clock::now();
    issue(which, pg, small, big, list);
    times.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_boxed", &register_boxed);
  m.def("register_unboxed", &register_unboxed);
  m.def("unregister", &unregister);
  m.def("calls", &calls);
  m.def("set_evict", &set_evict);
  m.def("evict", &evict);
  m.def("cold_loop", &cold_loop, py::call_guard<py::gil_scoped_release>());
  m.def("loop", &loop, py::call_guard<py::gil_scoped_release>());
}
"""

OPS = ("_allgather_base_", "_reduce_scatter_base_", "allreduce_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--evict-kib", type=int, default=4096, help="memory touched before each cold call")
    args = parser.parse_args()
    for name in OPS:
        print(f"schema: {getattr(torch.ops.c10d, name).default._schema}")
    ext = cpp_extension.load_inline(name="moedoctor_boxing_cost", cpp_sources=[SOURCE], extra_cflags=["-O2"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    group = dist.group.WORLD.group_name
    small, big = torch.ones(8), torch.ones(16)
    # torch 2.13 calls them all_gather_single / reduce_scatter_single; torch 2.11 (the GPU host) has
    # only the older names, which issue the same c10d ops.
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def python(which: int, iters: int) -> float:
        start = time.perf_counter_ns()
        if which == 0:
            for _ in range(iters):
                all_gather_single(big, small)
        elif which == 1:
            for _ in range(iters):
                reduce_scatter_single(small, big)
        else:
            for _ in range(iters):
                dist.all_reduce(small)
        return (time.perf_counter_ns() - start) / iters

    def python_cold(which: int, iters: int) -> float:
        call = (
            (lambda: all_gather_single(big, small)),
            (lambda: reduce_scatter_single(small, big)),
            (lambda: dist.all_reduce(small)),
        )[which]
        clock, evict, times = time.perf_counter_ns, ext.evict, []
        for _ in range(iters):
            evict()
            start = clock()
            call()
            times.append(clock() - start)
        return statistics.median(times)

    ext.set_evict(args.evict_kib * 1024)
    cold = args.iters // 10
    ways = {
        "c++": lambda which: ext.loop(which, args.iters, group, small, big),
        "python": lambda which: python(which, args.iters // 4),
        "c++ cold": lambda which: ext.cold_loop(which, cold, group, small, big),
        "py cold": lambda which: python_cold(which, cold),
    }
    modes = {"none": ext.unregister, "boxed": ext.register_boxed, "unboxed": ext.register_unboxed}
    samples: dict = {(way, op, mode): [] for way in ways for op in OPS for mode in modes}
    order = list(modes)
    for mode in order:  # warm-up, and a check that every registration works
        modes[mode]()
        for which in range(3):
            ext.loop(which, 200, group, small, big)
            python(which, 200)
    for r in range(args.rounds):
        rotated = order[r % 3 :] + order[: r % 3]
        for mode in rotated:
            modes[mode]()
            for which, op in enumerate(OPS):
                for way, run in ways.items():
                    samples[(way, op, mode)].append(run(which))
    ext.unregister()
    boxed_calls, unboxed_calls = ext.calls()
    expected = 3 * (args.rounds * (args.iters + args.iters // 4 + 2 * cold) + 400)
    print(f"kernel calls: boxed {boxed_calls}, unboxed {unboxed_calls} (expected {expected} each)")
    print(
        f"torch={torch.__version__} rounds={args.rounds} iters: c++ {args.iters}, python {args.iters // 4}, "
        f"cold {cold} (each call after {args.evict_kib} KiB of memory touched; the median call)"
    )
    print(f"{'caller':<10}{'op':<24}{'none':>10}{'boxed +':>10}{'unboxed +':>11}{'boxed - unboxed':>17}")
    for way in ways:
        for op in OPS:
            none = samples[(way, op, "none")]
            boxed = [(b - n) / 1e3 for b, n in zip(samples[(way, op, "boxed")], none)]
            unboxed = [(u - n) / 1e3 for u, n in zip(samples[(way, op, "unboxed")], none)]
            saved = [b - u for b, u in zip(boxed, unboxed)]
            print(
                f"{way:<10}{op:<24}{statistics.median(none) / 1e3:>8.2f}us{statistics.median(boxed):>+10.2f}"
                f"{statistics.median(unboxed):>+11.2f}{statistics.median(saved):>+17.2f}"
                f"  (per round {min(saved):+.2f}..{max(saved):+.2f})"
            )


if __name__ == "__main__":
    main()
