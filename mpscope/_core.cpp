// mpscope._core: the statistics of _stats_core.h as a plain CPython extension, without PyTorch.
//
// Compiled when mpscope is installed (setup.py; it needs only Python's headers, a few seconds), so a
// CPU run takes its statistics in one read per tensor from its very first recorded step, while the
// PyTorch extension (_kernel.cpp, which adds the hooks' C++ path and reads tensors directly) is
// built in the background for this torch. Its only caller is mpscope/kernel.py (class _Core), which
// passes each tensor as its data pointer, length and format, and the output rows as raw pointers:
// the caller keeps every buffer alive and checks every shape.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_stats_core.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// A sequence of Python ints as int64 values; false (with a Python error set) when it is not one.
bool int64s(PyObject* seq, std::vector<int64_t>& out, const char* what) {
  PyObject* fast = PySequence_Fast(seq, what);
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
  }
  Py_DECREF(fast);
  return true;
}

// stats_into(addresses, numels, kinds, tiny_bits, cast, hist, counts_address, width, extrema_address,
// threads): the stats of n arrays (element i: `numels[i]` elements of format kinds[i] (0 float32,
// 1 float16, 2 bfloat16) at address addresses[i]) into n rows of an int64 count table (row stride
// `width` >= 10 [+ 279 with hist]) and a float64 extrema table (row stride 3), as span_rows says.
// `threads` workers (OpenMP; 1 where this was built without it). The GIL is released meanwhile.
PyObject* stats_into(PyObject*, PyObject* args) {
  PyObject *addresses, *numels, *kinds, *tiny, *cast_seq;
  int hist;
  unsigned long long counts_at, extrema_at;
  long long width, threads;
  if (!PyArg_ParseTuple(args, "OOOOOpKLKL", &addresses, &numels, &kinds, &tiny, &cast_seq, &hist, &counts_at,
                        &width, &extrema_at, &threads))
    return nullptr;
  std::vector<int64_t> at, n, kind, tiny_bits, cast;
  if (!int64s(addresses, at, "addresses: a sequence of ints") || !int64s(numels, n, "numels: a sequence of ints") ||
      !int64s(kinds, kind, "kinds: a sequence of ints") || !int64s(tiny, tiny_bits, "tiny_bits: a sequence of ints") ||
      !int64s(cast_seq, cast, "cast: a sequence of ints"))
    return nullptr;
  const size_t count = at.size();
  if (n.size() != count || kind.size() != count || tiny_bits.size() != count || cast.size() != 6 ||
      width < NCOUNT + (hist ? NHIST : 0) || counts_at == 0 || extrema_at == 0) {
    PyErr_SetString(PyExc_ValueError, "mpscope._core.stats_into: inconsistent arguments");
    return nullptr;
  }
  std::vector<Span> xs(count);
  for (size_t i = 0; i < count; ++i) {
    if (kind[i] < KF32 || kind[i] > KBF16 || n[i] < 0 || (n[i] > 0 && at[i] == 0)) {
      PyErr_SetString(PyExc_ValueError, "mpscope._core.stats_into: bad array");
      return nullptr;
    }
    if (kind[i] == KBF16 && !bf16_thresholds_ok(thresholds_of(tiny_bits[i], cast.data()).data())) {
      PyErr_SetString(PyExc_ValueError, "mpscope._core.stats_into: thresholds that are not bfloat16's");
      return nullptr;
    }
    xs[i] = {reinterpret_cast<const void*>(static_cast<uintptr_t>(at[i])), n[i], static_cast<int>(kind[i])};
  }
#ifdef _OPENMP
  const int workers = static_cast<int>(std::max(1LL, threads));
#else
  const int workers = 1;
#endif
  auto* cp = reinterpret_cast<int64_t*>(static_cast<uintptr_t>(counts_at));
  auto* ep = reinterpret_cast<double*>(static_cast<uintptr_t>(extrema_at));
  Py_BEGIN_ALLOW_THREADS
  span_rows(xs, tiny_bits.data(), cast.data(), hist != 0, cp, width, ep, workers,
            [workers](int64_t b, int64_t e, int64_t, auto&& f) {
#ifdef _OPENMP
#pragma omp parallel num_threads(workers)
              {
                const int64_t w = omp_get_thread_num(), nw = omp_get_num_threads();
                const int64_t lo = b + (e - b) * w / nw, hi = b + (e - b) * (w + 1) / nw;
                if (lo < hi) f(lo, hi, static_cast<int>(w));
              }
#else
              f(b, e, 0);
#endif
            });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"stats_into", stats_into, METH_VARARGS, "mpscope: fused statistics of raw float32/float16/bfloat16 arrays"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "mpscope._core",
                      "mpscope's statistics kernel without PyTorch (see mpscope/kernel.py)", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__core(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && (PyModule_AddIntConstant(m, "NCOUNT", NCOUNT) < 0 || PyModule_AddIntConstant(m, "NHIST", NHIST) < 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
