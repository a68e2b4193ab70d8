// mpscope's fused CPU stats kernel as a PyTorch extension: the statistics of _stats_core.h over
// tensors (on PyTorch's intra-op threads), and the recorder's host work per tensor in C++ (staging
// copies, tensor facts, the hooks' usual path, the step end's parameter batch). Built on first use
// with torch.utils.cpp_extension.load (see mpscope/kernel.py); mpscope falls back to mpscope._core
// (the same statistics, built when mpscope is installed) or to the equivalent torch-op path
// (mpscope/stats.py) when it cannot be built.
#include <torch/extension.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/graph_task.h>
#include <structmember.h>
#include <pybind11/numpy.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include "_stats_core.h"

namespace {

// The stats of `tensors` (CPU float32 / float16 / bfloat16, any layout) by span_rows, on PyTorch's
// intra-op threads: see span_rows for cp, width and ep.
void stats_rows(std::vector<at::Tensor>& tensors, const int64_t* tiny_bits, const int64_t* cast, bool hist,
                int64_t* cp, int64_t width, double* ep) {
  at::NoGradGuard no_grad;  // contiguous() copies below are data, not part of any graph
  std::vector<Span> xs;
  xs.reserve(tensors.size());
  for (auto& t : tensors) {
    // the stats do not depend on the order of the elements: a tensor whose elements fill one block
    // of memory once each (contiguous, or a transpose / permutation / channels-last of one) is read
    // in memory order from its first element, the lowest address (strides are never negative); only
    // tensors with gaps or repeats (slices, expand) are copied first. A tensor with the negative bit
    // (the imaginary part of a conjugate view) holds its values negated in memory: materialized first
    if (t.is_neg()) t = t.resolve_neg();
    if (!t.is_non_overlapping_and_dense()) t = t.contiguous();
    const auto st = t.scalar_type();
    TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
                "mpscope fused_stats: unsupported dtype ", st);
    TORCH_CHECK(t.device().is_cpu(), "mpscope fused_stats: CPU tensors only");
    xs.push_back({t.data_ptr(), t.numel(), st == at::kFloat ? KF32 : st == at::kHalf ? KF16 : KBF16});
  }
  span_rows(xs, tiny_bits, cast, hist, cp, width, ep, at::get_num_threads(),
            [](int64_t b, int64_t e, int64_t grain, auto&& f) {
              at::parallel_for(b, e, grain, [&](int64_t cb, int64_t ce) { f(cb, ce, at::get_thread_num()); });
            });
}

}  // namespace


// tensors: CPU float32 / float16 / bfloat16 tensors (any shape). tiny_bits[i]: bit pattern of
// tensor i's own smallest normal. cast: the six fp16/bf16 threshold bit patterns.
// Returns (counts int64 [n, 10 + (hist ? 279 : 0)], extrema float64 [n, 3] = max, min, absmin_nonzero).
std::vector<at::Tensor> fused_stats(std::vector<at::Tensor> tensors, std::vector<int64_t> tiny_bits,
                                    std::vector<int64_t> cast, bool hist) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(static_cast<int64_t>(tiny_bits.size()) == n && cast.size() == 6, "mpscope fused_stats: bad arguments");
  const int64_t width = NCOUNT + (hist ? NHIST : 0);
  auto counts = at::empty({n, width}, at::kLong);
  auto ext = at::empty({n, 3}, at::kDouble);
  stats_rows(tensors, tiny_bits.data(), cast.data(), hist, counts.data_ptr<int64_t>(), width, ext.data_ptr<double>());
  return {counts, ext};
}

// The same stats written in place into rows row0 .. row0 + n - 1 of preallocated tables: counts
// int64 [rows, 10 + 279] (the histogram columns are left as they are when `hist` is false) and
// extrema float64 [rows, 3], both contiguous CPU tensors. Saves the two allocations per call.
void fused_stats_into(std::vector<at::Tensor> tensors, std::vector<int64_t> tiny_bits, std::vector<int64_t> cast,
                      bool hist, at::Tensor counts, at::Tensor extrema, int64_t row0) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(static_cast<int64_t>(tiny_bits.size()) == n && cast.size() == 6, "mpscope fused_stats_into: bad arguments");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 2 && counts.size(1) == NCOUNT + NHIST &&
              counts.is_contiguous() && counts.device().is_cpu(),
              "mpscope fused_stats_into: counts must be a contiguous CPU int64 [rows, ", NCOUNT + NHIST, "] tensor");
  TORCH_CHECK(extrema.scalar_type() == at::kDouble && extrema.dim() == 2 && extrema.size(1) == 3 &&
              extrema.is_contiguous() && extrema.device().is_cpu(),
              "mpscope fused_stats_into: extrema must be a contiguous CPU float64 [rows, 3] tensor");
  TORCH_CHECK(row0 >= 0 && row0 + n <= counts.size(0) && row0 + n <= extrema.size(0),
              "mpscope fused_stats_into: rows ", row0, "..", row0 + n, " outside the tables");
  stats_rows(tensors, tiny_bits.data(), cast.data(), hist, counts.data_ptr<int64_t>() + row0 * (NCOUNT + NHIST),
             NCOUNT + NHIST, extrema.data_ptr<double>() + row0 * 3);
}

// The non-zero exponent histogram bins of rows of a host count table, for the step's host copy
// (mpscope/recording/step_buffer.py; its NumPy path computes the same): row rows[i] of `counts`
// (int64, C order) holds its bins in columns col0 .. col0 + nbins - 1. Without groups (`group`
// empty) each row is its own entry, in the order of `rows`; else rows[i] adds into entry group[i]
// (0 <= group[i] < ngroups), and entries come in group order. Returns (entry, bin, count) int64
// arrays, one element per non-zero bin, entries in order and bins ascending within each.
// A row's bins are mostly zero (a tensor spans a few dozen binades of 279): blocks of 8 zero bins
// are skipped with one test. Arrays convert to int64 C order only where NumPy casts safely (a float
// table or float rows are refused, not truncated); every bound is checked without int64 overflow.
using I64 = pybind11::array_t<int64_t, pybind11::array::c_style>;

pybind11::tuple hist_nonzero(I64 counts, int64_t col0, int64_t nbins, I64 rows, I64 group, int64_t ngroups) {
  TORCH_CHECK(counts.ndim() == 2 && rows.ndim() == 1 && group.ndim() == 1 && col0 >= 0 && nbins >= 0 &&
              col0 <= counts.shape(1) && nbins <= counts.shape(1) - col0, "mpscope hist_nonzero: bad table or columns");
  const int64_t n = rows.shape(0), width = counts.shape(1), nrows = counts.shape(0);
  const bool grouped = group.shape(0) > 0;
  TORCH_CHECK(!grouped || group.shape(0) == n, "mpscope hist_nonzero: one group per row needed");
  TORCH_CHECK(!grouped || (ngroups >= 0 && ngroups <= std::numeric_limits<int64_t>::max() / std::max<int64_t>(nbins, 1)),
              "mpscope hist_nonzero: bad number of groups");
  const int64_t* table = counts.data();
  const int64_t* r = rows.data();
  const int64_t* g = grouped ? group.data() : nullptr;
  std::vector<int64_t> acc;
  if (grouped) acc.assign(static_cast<size_t>(ngroups * nbins), 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < nrows && (!grouped || (g[i] >= 0 && g[i] < ngroups)),
                "mpscope hist_nonzero: row or group out of range");
    if (grouped) {
      const int64_t* p = table + r[i] * width + col0;
      int64_t* a = acc.data() + g[i] * nbins;
      for (int64_t j = 0; j < nbins; ++j) a[j] += p[j];
    }
  }
  std::vector<int64_t> oe, ob, oc;
  auto emit = [&](int64_t entry, const int64_t* p) {
    int64_t j = 0;
    for (; j + 8 <= nbins; j += 8) {
      if ((p[j] | p[j + 1] | p[j + 2] | p[j + 3] | p[j + 4] | p[j + 5] | p[j + 6] | p[j + 7]) == 0) continue;
      for (int64_t k = j; k < j + 8; ++k)
        if (p[k]) { oe.push_back(entry); ob.push_back(k); oc.push_back(p[k]); }
    }
    for (; j < nbins; ++j)
      if (p[j]) { oe.push_back(entry); ob.push_back(j); oc.push_back(p[j]); }
  };
  if (grouped) for (int64_t k = 0; k < ngroups; ++k) emit(k, acc.data() + k * nbins);
  else for (int64_t i = 0; i < n; ++i) emit(i, table + r[i] * width + col0);
  auto array = [](const std::vector<int64_t>& v) {
    I64 a(static_cast<pybind11::ssize_t>(v.size()));
    if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(int64_t));
    return a;
  };
  return pybind11::make_tuple(array(oe), array(ob), array(oc));
}

// The staging copy of a GPU run's observed tensor (mpscope/recording/step_buffer.py StagedRows.stage):
// `tensor` (float16 / bfloat16 / float32, on the buffer's device: the caller checks it, any layout) into elements
// offset .. offset + numel - 1 of `buffer` (float32, 1-D, contiguous), as one copy_ dispatched from
// C++ (about 2 us less host time per tensor than the same two ops dispatched from Python). The
// statistics ignore element order, so a tensor whose elements fill one block of memory once each
// (a transpose, channels-last) is copied in memory order; others in logical order. Dispatched below
// autograd (AutoDispatchBelowADInplaceOrView): the buffer joins no graph and gets no forward-mode
// tangent, whatever the grad mode, and no version counter is bumped (nothing but mpscope reads it).
void stage_copy(at::Tensor buffer, const at::Tensor& tensor, int64_t offset) {
  const int64_t n = tensor.numel();
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.dim() == 1 && buffer.is_contiguous(),
              "mpscope stage_copy: the buffer must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(offset >= 0 && n <= buffer.numel() - offset, "mpscope stage_copy: elements ", offset, "..",
              offset + n, " outside the buffer of ", buffer.numel());
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  if (tensor.is_non_overlapping_and_dense()) {
    buffer.as_strided(tensor.sizes(), tensor.strides(), buffer.storage_offset() + offset).copy_(tensor);
  } else {
    buffer.narrow(0, offset, n).view(tensor.sizes()).copy_(tensor);
  }
}

// The checks that let a recorded step's end reuse what it worked out the step before
// (mpscope/recording/parameter_batch.py and Observer.selected_parameters in mpscope/recording/observer.py),
// in C++: the same answers as their Python forms, which stay for runs without the kernel, without
// making a Python object per tensor or per module (about 0.3 us per tensor in Python, inside a step).

// Whether each of `tensors` (a list) still looks as its entry of `looks` (a list of the
// (class, dtype, shape, layout, device) tuples that parameter_batch._LOOKS took of them): the same
// class object, dtype, sizes, layout and device. False at the first difference, for anything that
// is not a tensor, for a tensor without plain sizes (nested, symbolic) and for a malformed entry.
bool same_looks(pybind11::list tensors, pybind11::list looks) {
  PyObject* ts = tensors.ptr();
  PyObject* ls = looks.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(ts);
  if (PyList_GET_SIZE(ls) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(ts, i);
    PyObject* look = PyList_GET_ITEM(ls, i);
    if (!PyTuple_Check(look) || PyTuple_GET_SIZE(look) != 5 || !THPVariable_Check(o)) return false;
    if (reinterpret_cast<PyObject*>(Py_TYPE(o)) != PyTuple_GET_ITEM(look, 0)) return false;
    const at::Tensor& t = THPVariable_Unpack(o);
    PyObject* dtype = PyTuple_GET_ITEM(look, 1);
    PyObject* shape = PyTuple_GET_ITEM(look, 2);
    PyObject* layout = PyTuple_GET_ITEM(look, 3);
    PyObject* device = PyTuple_GET_ITEM(look, 4);
    if (!THPDtype_Check(dtype) || reinterpret_cast<THPDtype*>(dtype)->scalar_type != t.scalar_type()) return false;
    if (!THPLayout_Check(layout) || reinterpret_cast<THPLayout*>(layout)->layout != t.layout()) return false;
    if (!THPDevice_Check(device) || reinterpret_cast<THPDevice*>(device)->device != t.device()) return false;
    if (!PyTuple_Check(shape) || t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
    const auto sizes = t.sizes();
    if (static_cast<Py_ssize_t>(sizes.size()) != PyTuple_GET_SIZE(shape)) return false;
    for (size_t j = 0; j < sizes.size(); ++j) {
      PyObject* d = PyTuple_GET_ITEM(shape, static_cast<Py_ssize_t>(j));
      if (!PyLong_CheckExact(d)) return false;
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(d, &overflow);
      if (overflow || v != sizes[j]) return false;
    }
  }
  return true;
}

// parameter_batch.gather in C++ (the same lists, in the same order): per (module, name, parameter)
// triple of `params`, its .grad when `want_grad` and set (form mark `with_grad`, else `no_grad`; an
// efficient zero tensor, which has no data, as the zeros it stands for),
// the parameter when `want_weight`, then the tensors of its optimizer state `state[p]` with at least
// one dimension, in the state dict's order, "step" left out (each marked by its key). Returns
// (tensors, form), or None when `state` is not a dict or a parameter's state is not a plain dict
// (an OrderedDict's order is not its dict's; a subclass may override items): the Python form then
// takes it, with its own errors. A tensor subclass's dim() is called from Python (it may override
// it or answer through __torch_function__); a plain tensor's is read in C++. `.grad`, a key's ==
// and a subclass's dim() may run Python code that changes these containers: each object in use is
// held, `params` is read as a list iterator reads it, and a state dict that changes size while read
// raises as in Python.
pybind11::object gather(pybind11::list params, bool want_grad, bool want_weight, pybind11::object state,
                        pybind11::object with_grad, pybind11::object no_grad) {
  using pybind11::reinterpret_borrow;
  PyObject* st_all = state.ptr();
  if (!PyDict_Check(st_all)) return pybind11::none();
  static PyObject* grad_name = PyUnicode_InternFromString("grad");
  static PyObject* step_name = PyUnicode_InternFromString("step");
  static PyObject* dim_name = PyUnicode_InternFromString("dim");
  pybind11::list tensors, form;
  PyObject* ts = tensors.ptr();
  PyObject* fs = form.ptr();
  PyObject* ps = params.ptr();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ps); ++i) {
    const auto triple = reinterpret_borrow<pybind11::object>(PyList_GET_ITEM(ps, i));  // (held: p lives)
    if (!PyTuple_Check(triple.ptr()) || PyTuple_GET_SIZE(triple.ptr()) != 3) return pybind11::none();
    PyObject* p = PyTuple_GET_ITEM(triple.ptr(), 2);
    if (want_grad) {
      PyObject* g = PyObject_GetAttr(p, grad_name);
      if (g == nullptr) throw pybind11::error_already_set();
      if (g == Py_None) {
        Py_DECREF(g);
        if (PyList_Append(fs, no_grad.ptr()) < 0) throw pybind11::error_already_set();
      } else {
        if (THPVariable_Check(g) && THPVariable_Unpack(g)._is_zerotensor()) {
          // an efficient zero tensor (no data): the zeros it stands for (stats.zeros_of)
          const at::Tensor& z = THPVariable_Unpack(g);
          PyObject* zeros = THPVariable_Wrap(at::zeros(z.sizes(), z.options()));
          Py_DECREF(g);
          if (zeros == nullptr) throw pybind11::error_already_set();
          g = zeros;
        }
        const int a = PyList_Append(fs, with_grad.ptr()), b = PyList_Append(ts, g);
        Py_DECREF(g);
        if (a < 0 || b < 0) throw pybind11::error_already_set();
      }
    } else if (PyList_Append(fs, no_grad.ptr()) < 0) {
      throw pybind11::error_already_set();
    }
    if (want_weight && PyList_Append(ts, p) < 0) throw pybind11::error_already_set();
    if (PyDict_GET_SIZE(st_all) == 0) continue;
    PyObject* found = PyDict_GetItemWithError(st_all, p);  // (borrowed)
    if (found == nullptr) {
      if (PyErr_Occurred()) throw pybind11::error_already_set();
      continue;
    }
    const auto st = reinterpret_borrow<pybind11::object>(found);
    if (!PyDict_CheckExact(st.ptr())) return pybind11::none();
    const Py_ssize_t size = PyDict_GET_SIZE(st.ptr());
    Py_ssize_t pos = 0;
    PyObject *bk, *bv;
    while (PyDict_Next(st.ptr(), &pos, &bk, &bv)) {
      const auto k = reinterpret_borrow<pybind11::object>(bk), v = reinterpret_borrow<pybind11::object>(bv);
      const int is_step = PyObject_RichCompareBool(k.ptr(), step_name, Py_EQ);
      if (is_step < 0) throw pybind11::error_already_set();
      bool take = !is_step && THPVariable_Check(v.ptr());
      if (take && THPVariable_CheckExact(v.ptr())) {
        take = THPVariable_Unpack(v.ptr()).dim() != 0;
      } else if (take) {  // a subclass: its dim() as Python calls it (an override, a __torch_function__)
        PyObject* d = PyObject_CallMethodNoArgs(v.ptr(), dim_name);
        const int truth = d == nullptr ? -1 : PyObject_IsTrue(d);
        Py_XDECREF(d);
        if (truth < 0) throw pybind11::error_already_set();
        take = truth != 0;
      }
      if (PyDict_GET_SIZE(st.ptr()) != size) {
        PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
        throw pybind11::error_already_set();
      }
      if (take && (PyList_Append(ts, v.ptr()) < 0 || PyList_Append(fs, k.ptr()) < 0)) {
        throw pybind11::error_already_set();
      }
    }
  }
  return pybind11::make_tuple(tensors, form);
}

// Whether each module of `mods` (a list) still has the children and parameters recorded in its
// entry of `tree` (a list of the (child names, child ids, parameter names, parameter ids) tuples
// that observer.module_tree took): its `_modules` and `_parameters` dicts hold the same names,
// in the same order, bound to the same objects (by identity: id() of each, as recorded). False at
// the first difference and for a malformed entry or a module whose dict raises; None (the Python
// form then answers) where one of these is not a plain dict: an OrderedDict iterates in its own
// order, not its dict's (move_to_end), and another kind of object answers as its class says.
pybind11::object same_module_tree(pybind11::list mods, pybind11::list tree) {
  PyObject* ms = mods.ptr();
  PyObject* ts = tree.ptr();
  if (PyList_GET_SIZE(ts) != PyList_GET_SIZE(ms)) return pybind11::bool_(false);
  static PyObject* attrs[2] = {PyUnicode_InternFromString("_modules"), PyUnicode_InternFromString("_parameters")};
  // (the sizes read again on each pass: a `_modules` property may run code)
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ms) && i < PyList_GET_SIZE(ts); ++i) {
    PyObject* entry = PyList_GET_ITEM(ts, i);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4) return pybind11::bool_(false);
    for (int k = 0; k < 2; ++k) {
      PyObject* names = PyTuple_GET_ITEM(entry, 2 * k);
      PyObject* ids = PyTuple_GET_ITEM(entry, 2 * k + 1);
      const auto m = pybind11::reinterpret_borrow<pybind11::object>(PyList_GET_ITEM(ms, i));
      PyObject* d = PyObject_GetAttr(m.ptr(), attrs[k]);
      if (d == nullptr) {
        PyErr_Clear();
        return pybind11::bool_(false);
      }
      if (!PyDict_CheckExact(d)) {
        Py_DECREF(d);
        return pybind11::none();
      }
      bool same = PyTuple_Check(names) && PyTuple_Check(ids) &&
                  PyDict_GET_SIZE(d) == PyTuple_GET_SIZE(names) && PyTuple_GET_SIZE(ids) == PyTuple_GET_SIZE(names);
      Py_ssize_t pos = 0, j = 0;
      PyObject *key, *value;
      while (same && PyDict_Next(d, &pos, &key, &value)) {
        PyObject* name = PyTuple_GET_ITEM(names, j);
        if (key != name) {
          Py_INCREF(key);  // (a key's == may run code that changes the dict)
          const int eq = PyObject_RichCompareBool(key, name, Py_EQ);
          Py_DECREF(key);
          if (eq == 1 && PyDict_GET_SIZE(d) != PyTuple_GET_SIZE(names)) {
            same = false;
            break;
          }
          if (eq != 1) {
            PyErr_Clear();
            same = false;
            break;
          }
        }
        PyObject* id = PyTuple_GET_ITEM(ids, j);
        if (!PyLong_CheckExact(id) || PyLong_AsVoidPtr(id) != static_cast<void*>(value)) {
          PyErr_Clear();
          same = false;
        }
        ++j;
      }
      Py_DECREF(d);
      if (!same) return pybind11::bool_(false);
    }
  }
  return pybind11::bool_(PyList_GET_SIZE(ts) == PyList_GET_SIZE(ms));
}

// ---------------------------------------------------------------------------------------------
// The hooks' usual path in one C++ call each (mpscope/recording/observer.py and activations.py hold
// the Python form, which stays the reference and takes every case this path hands back).
// Observer.observe_now's two usual branches: a fresh tensor's stats written by the fused kernel into
// the next host row (a CPU run) or its values staged on its device (StagedRows.stage: a run on an
// accelerator); and ActivationHooks.on_forward for a module returning one plain tensor in a forward
// pass outside any torch.func transform: its activation row and the gradient hook GradHooks.add
// registers. What the recording's hooks share is one object, a HookState
// (mpscope/recording/hook_state.py): this path reads its __slots__ by offset (found once per step by
// hook_state, from the names in kFields) and reads nothing else of the recorder. It reads and
// writes the Python objects those fields hold (dicts, lists, the row tables, GradHooks) as the
// Python form does, in the same order; anything else (a key not made yet, a tensor seen before in
// the step, full tables, the torch-op path) calls the Python form for that part.
// It pays where it avoids the interpreter's frames and generic attribute lookups: plain instance
// attributes are read from the instance's __dict__, references are held without pybind11 objects
// (whose reference counting checks the GIL each time), and the constants are parsed once per step
// into a capsule (hook_state).
namespace hookpath {

struct Ref {  // an owned reference, released at the end of its scope
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& o) noexcept : p(o.p) { o.p = nullptr; }
  Ref& operator=(Ref&& o) noexcept {
    Py_XDECREF(p);
    p = o.p;
    o.p = nullptr;
    return *this;
  }
  ~Ref() { Py_XDECREF(p); }
  PyObject* get() const { return p; }
};
Ref own(PyObject* p) {
  if (p == nullptr) throw pybind11::error_already_set();
  return Ref(p);
}
Ref borrowed(PyObject* p) {
  Py_INCREF(p);
  return Ref(p);
}
Ref py_int(int64_t v) { return own(PyLong_FromLongLong(v)); }

// obj.name for an attribute the object's class sets on its instances (read from its __dict__; a
// name not there, as a method, the generic way)
Ref attr(PyObject* o, PyObject* name) {
  PyObject** dp = _PyObject_GetDictPtr(o);
  if (dp != nullptr && *dp != nullptr) {
    PyObject* v = PyDict_GetItemWithError(*dp, name);
    if (v != nullptr) return borrowed(v);
    if (PyErr_Occurred()) throw pybind11::error_already_set();
  }
  return own(PyObject_GetAttr(o, name));
}
// obj.name = v for such an attribute
void set_attr(PyObject* o, PyObject* name, PyObject* v) {
  PyObject** dp = _PyObject_GetDictPtr(o);
  const int rc = (dp != nullptr && *dp != nullptr) ? PyDict_SetItem(*dp, name, v) : PyObject_SetAttr(o, name, v);
  if (rc < 0) throw pybind11::error_already_set();
}
int64_t as_int(PyObject* v) {
  const long long x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
  return x;
}
void check(int rc) {
  if (rc < 0) throw pybind11::error_already_set();
}

// The HookState fields this path reads (mpscope/recording/hook_state.py; hook_fields() lists them).
enum Field { kPassId, kHookless, kGradTick, kKeyIndex, kSeen, kObs, kRows, kStaged, kHistNow, kObserveNow, kNames,
             kGradHooks, kGradient, kAutocastSeen, kNoteAutocast, kFieldCount };
const char* const kFields[kFieldCount] = {"pass_id", "hookless", "grad_tick", "key_index", "seen", "obs", "rows",
                                          "staged", "hist_now", "observe_now", "names", "grad_hooks", "gradient",
                                          "autocast_seen", "note_autocast"};

// Attribute names of the objects the fields hold: the row tables (RowTables, StagedRows) and
// GradHooks (mpscope/recording/step_buffer.py, grad_hooks.py), and the tensor's own.
struct Names {
  PyObject *n, *capacity, *counts, *extrema, *log, *backward_hooks, *grad_fn, *register_hook_dict, *next_id, *end_id,
      *tags, *entries, *discard, *add, *off, *elements, *buffer, *sizes, *fp16, *device, *copier, *stage_slowly,
      *copy_values, *take, *activation, *output, *float64, *fused_stats_into, *unknown;
};
const Names& names() {
  static const Names n = [] {
    auto i = [](const char* s) { return PyUnicode_InternFromString(s); };
    return Names{i("n"), i("capacity"), i("counts"), i("extrema"), i("log"), i("_backward_hooks"), i("grad_fn"),
                 i("_register_hook_dict"), i("next_id"), i("end_id"), i("tags"), i("entries"), i("discard"), i("add"),
                 i("off"), i("elements"), i("buffer"), i("sizes"), i("fp16"), i("device"), i("copier"),
                 i("stage_slowly"), i("copy_values"), i("take"), i("activation"), i("output"), i("float64"),
                 i("fused_stats_into"), i("?")};
  }();
  return n;
}

// The constants of a recorded step (Observer._hook_constants, parsed once by hook_state): whether
// activations and their gradients are recorded, the fused kernel's tiny and cast bit patterns, the
// mpscope.kernel module's dict and its own fused_stats_into (a replacement found there at a call is
// called instead of the kernel, as the Python form calls whatever is there: a test's failure, the
// benchmarks' stub), this kernel module (that function's argument), functools.partial, OrderedDict,
// the HookState class with its fields' offsets, and PassKind.FORWARD (the kind of a pass whose outputs
// get gradient hooks). The log entries and seen records this path makes are plain tuples whose fields
// are kLogEntryFields and kSeenFields, checked against Python's LOG_ENTRY and SEEN then.
struct State {
  bool take_activation = false, grad_role = false;
  int64_t tiny[3] = {0, 0, 0};  // float16, bfloat16, float32
  std::vector<int64_t> cast;
  PyObject *kernel_dict = nullptr, *own_stats_into = nullptr, *module = nullptr, *partial = nullptr, *odict = nullptr;
  PyTypeObject* state_type = nullptr;
  PyObject* forward_kind = nullptr;
  Py_ssize_t offset[kFieldCount] = {};
  ~State() {
    Py_XDECREF(kernel_dict);
    Py_XDECREF(own_stats_into);
    Py_XDECREF(module);
    Py_XDECREF(partial);
    Py_XDECREF(odict);
    Py_XDECREF(reinterpret_cast<PyObject*>(state_type));
    Py_XDECREF(forward_kind);
  }
};
PyObject* own_stage_copy = nullptr;  // this module's stage_copy function object (set at import)

const State& state_of(PyObject* capsule) {
  void* p = PyCapsule_GetPointer(capsule, "mpscope.hook_state");
  if (p == nullptr) throw pybind11::error_already_set();
  return *static_cast<const State*>(p);
}

// A HookState field (borrowed): the slot at its offset, as the slot's descriptor reads it
PyObject* field(PyObject* hs, const State& s, Field f) {
  PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(hs) + s.offset[f]);
  if (v == nullptr) {
    PyErr_Format(PyExc_AttributeError, "mpscope HookState field '%s' is not set", kFields[f]);
    throw pybind11::error_already_set();
  }
  return v;
}
void check_state(PyObject* hs, const State& s) {
  if (Py_TYPE(hs) != s.state_type) {
    PyErr_SetString(PyExc_TypeError, "mpscope hook path: a HookState expected");
    throw pybind11::error_already_set();
  }
}

// The fields of a log entry (step_buffer.LOG_ENTRY) and of a seen record (observer.SEEN), in order
const char* const kLogEntryFields[] = {"key", "row", "numel", "scaled", "pass_id", "at"};
const char* const kSeenFields[] = {"ref", "src", "key", "pass_id", "tick"};
template <size_t N>
void check_fields(PyObject* names, const char* const (&want)[N], const char* what) {
  bool same = PyTuple_Check(names) && PyTuple_GET_SIZE(names) == static_cast<Py_ssize_t>(N);
  for (size_t i = 0; same && i < N; ++i) {
    PyObject* n = PyTuple_GET_ITEM(names, i);
    same = PyUnicode_Check(n) && PyUnicode_CompareWithASCIIString(n, want[i]) == 0;
  }
  if (!same) throw pybind11::type_error(std::string("mpscope hook_state: the fields of ") + what + " differ from the kernel's");
}

// tensor_facts' answer, as C++ values: kOk, kNone (the stats take no such tensor) or kPython (one
// whose attribute reads could differ from these C++ getters, or that has no plain sizes and
// storage: its Python form, stats.tensor_facts, answers)
struct Facts {
  enum Kind { kNone, kPython, kOk } kind = kNone;
  PyObject* dtype = nullptr;  // (borrowed: an interned name kept for good)
  int64_t numel = 0;
  bool fused_cpu = false;
  Ref ident;  // (id, version, data pointer), or None
};

PyObject* dtype_name(at::ScalarType st) {
  static PyObject* const n[4] = {PyUnicode_InternFromString("float16"), PyUnicode_InternFromString("bfloat16"),
                                 PyUnicode_InternFromString("float32"), PyUnicode_InternFromString("float64")};
  switch (st) {
    case at::kHalf: return n[0];
    case at::kBFloat16: return n[1];
    case at::kFloat: return n[2];
    case at::kDouble: return n[3];
    default: return nullptr;
  }
}

Facts facts_of(PyObject* o) {
  Facts f;
  if (!THPVariable_CheckExact(o)) {  // (Tensor or Parameter, whose attribute reads are these getters)
    f.kind = Facts::kPython;
    return f;
  }
  const at::Tensor& t = THPVariable_Unpack(o);
  f.dtype = dtype_name(t.scalar_type());
  if (f.dtype == nullptr || t.layout() != at::kStrided || t.is_nested() || t.is_meta() || t._is_zerotensor())
    return f;
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || !t.has_storage()) {
    f.kind = Facts::kPython;
    return f;
  }
  f.numel = t.numel();
  if (f.numel == 0) return f;
  if (!t.is_inference()) {
    Ref id = own(PyLong_FromVoidPtr(o)), version = py_int(static_cast<int64_t>(t._version())),
        ptr = own(PyLong_FromVoidPtr(t.data_ptr()));
    f.ident = own(PyTuple_Pack(3, id.get(), version.get(), ptr.get()));
  } else {
    f.ident = borrowed(Py_None);
  }
  f.fused_cpu = t.is_cpu() && t.scalar_type() != at::kDouble;
  f.kind = Facts::kOk;
  return f;
}

Ref facts_tuple(const Facts& f) {
  Ref n = py_int(f.numel);
  return own(PyTuple_Pack(4, f.dtype, n.get(), f.ident.get(), f.fused_cpu ? Py_True : Py_False));
}

// StagedRows.stage(tensor, n) (mpscope/recording/step_buffer.py); its copier called in C++ when it
// is this module's own stage_copy
Ref stage(PyObject* staged, PyObject* tensor, int64_t n) {
  const Names& N = names();
  const int64_t off = as_int(attr(staged, N.off).get());
  const int64_t r = as_int(attr(staged, N.n).get());
  Ref buffer = attr(staged, N.buffer);
  if (off + n > as_int(attr(staged, N.elements).get()) || r == as_int(attr(staged, N.capacity).get()) ||
      buffer.get() == Py_None) {
    Ref nn = py_int(n);
    return own(PyObject_CallMethodObjArgs(staged, N.stage_slowly, tensor, nn.get(), nullptr));
  }
  Ref row = py_int(r);
  set_attr(staged, N.n, py_int(r + 1).get());
  Ref copier = attr(staged, N.copier);
  if (copier.get() == own_stage_copy && THPVariable_Check(buffer.get())) {
    stage_copy(THPVariable_Unpack(buffer.get()), THPVariable_Unpack(tensor), off);
  } else if (copier.get() == Py_None) {
    Ref o = py_int(off), nn = py_int(n);
    own(PyObject_CallMethodObjArgs(staged, N.copy_values, tensor, o.get(), nn.get(), nullptr));
  } else {
    Ref o = py_int(off);
    own(PyObject_CallFunctionObjArgs(copier.get(), buffer.get(), tensor, o.get(), nullptr));
  }
  set_attr(staged, N.off, py_int(off + n).get());
  check(PyList_Append(attr(staged, N.sizes).get(), py_int(n).get()));
  check(PyList_Append(attr(staged, N.fp16).get(),
                      THPVariable_Unpack(tensor).scalar_type() == at::kHalf ? Py_True : Py_False));
  return row;
}

// Observer.observe_now(module, role, name, tensor, facts, scaled, pass_id) for `f` (facts_of's
// answer, kOk); `facts`: the tuple, when the caller has it (else made if the Python form is called)
Ref observe(PyObject* hs, const State& s, PyObject* module, PyObject* role, PyObject* name, PyObject* tensor,
            const Facts& f, PyObject* facts, PyObject* scaled, PyObject* pass_id) {
  const Names& N = names();
  auto python_form = [&]() {
    Ref made;
    if (facts == nullptr) made = facts_tuple(f);
    PyObject* args[] = {module, role, name, tensor, facts != nullptr ? facts : made.get(), scaled, pass_id};
    return own(PyObject_Vectorcall(field(hs, s, kObserveNow), args, 7, nullptr));
  };
  Ref k = own(PyTuple_Pack(4, module, role, name, f.dtype));
  PyObject* key = PyDict_GetItemWithError(field(hs, s, kKeyIndex), k.get());
  if (key == nullptr) {
    if (PyErr_Occurred()) throw pybind11::error_already_set();
    return python_form();  // a key not made yet
  }
  Ref keep_key = borrowed(key);
  PyObject* seen = nullptr;
  if (f.ident.get() != Py_None) {
    seen = field(hs, s, kSeen);
    if (PyDict_GetItemWithError(seen, f.ident.get()) != nullptr) return python_form();  // seen this step
    if (PyErr_Occurred()) throw pybind11::error_already_set();
  }
  PyObject* tables = field(hs, s, kRows);
  Ref row, log;
  if (tables != Py_None && f.fused_cpu) {
    int64_t r = as_int(attr(tables, N.n).get());
    if (r + 1 > as_int(attr(tables, N.capacity).get())) {  // full: take() grows the tables
      Ref one = py_int(1);
      r = as_int(own(PyObject_CallMethodOneArg(tables, N.take, one.get())).get());
    } else {
      set_attr(tables, N.n, py_int(r + 1).get());
    }
    row = py_int(r);
    Ref counts = attr(tables, N.counts), extrema = attr(tables, N.extrema);
    PyObject* hist = field(hs, s, kHistNow);
    PyObject* stats_into = PyDict_GetItemWithError(s.kernel_dict, N.fused_stats_into);
    if (stats_into == nullptr && PyErr_Occurred()) throw pybind11::error_already_set();
    if (stats_into != nullptr && stats_into != s.own_stats_into) {  // replaced: called as the Python form calls it
      Ref one = own(PyList_New(1));
      Py_INCREF(tensor);
      PyList_SET_ITEM(one.get(), 0, tensor);
      own(PyObject_CallFunctionObjArgs(stats_into, s.module, one.get(), hist, counts.get(), extrema.get(),
                                       row.get(), nullptr));
    } else {
      const at::Tensor& t = THPVariable_Unpack(tensor);
      const int64_t tiny = t.scalar_type() == at::kHalf ? s.tiny[0] : t.scalar_type() == at::kBFloat16 ? s.tiny[1] : s.tiny[2];
      fused_stats_into({t}, {tiny}, s.cast, hist == Py_True, THPVariable_Unpack(counts.get()),
                       THPVariable_Unpack(extrema.get()), r);
    }
    log = attr(tables, N.log);
  } else {
    PyObject* staged = field(hs, s, kStaged);
    if (staged == Py_None || f.dtype == N.float64) return python_form();
    Ref device = attr(staged, N.device);
    if (!THPDevice_Check(device.get()) ||
        reinterpret_cast<THPDevice*>(device.get())->device != THPVariable_Unpack(tensor).device())
      return python_form();
    row = stage(staged, tensor, f.numel);
    log = attr(staged, N.log);
  }
  const Py_ssize_t at_obs = PyList_Size(field(hs, s, kObs));
  if (at_obs < 0) throw pybind11::error_already_set();
  Ref numel = py_int(f.numel), at = own(PyLong_FromSsize_t(at_obs));
  Ref entry = own(PyTuple_Pack(6, key, row.get(), numel.get(), scaled, pass_id, at.get()));
  check(PyList_Append(log.get(), entry.get()));
  if (seen != nullptr) {
    Ref ref = own(PyWeakref_NewRef(tensor, nullptr));
    Ref val = own(PyTuple_Pack(5, ref.get(), row.get(), key, pass_id, field(hs, s, kGradTick)));
    check(PyDict_SetItem(seen, f.ident.get(), val.get()));
  }
  return row;
}

// GradHooks.add(t, hook, tag) (mpscope/recording/grad_hooks.py) for a tensor of class Tensor (a
// Parameter goes through register_hook there) with no hooks dict yet and an id left in the block
// taken; anything else is the Python form's
bool add_grad_hook(PyObject* grad_hooks, PyObject* t, PyObject* hook, PyObject* tag, const State& s) {
  const Names& N = names();
  Ref next = attr(grad_hooks, N.next_id);
  const int64_t hid = as_int(next.get());
  PyObject* existing = reinterpret_cast<THPVariable*>(t)->backward_hooks;  // (t._backward_hooks, None as null)
  if (Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(THPVariableClass) || (existing != nullptr && existing != Py_None) ||
      hid == as_int(attr(grad_hooks, N.end_id).get())) {
    Ref added = own(PyObject_CallMethodObjArgs(grad_hooks, N.add, t, hook, tag, nullptr));
    const int truth = PyObject_IsTrue(added.get());
    check(truth);
    return truth == 1;
  }
  Ref hooks = own(PyObject_CallNoArgs(s.odict));
  check(PyObject_SetAttr(t, N.backward_hooks, hooks.get()));
  Ref fn = own(PyObject_GetAttr(t, N.grad_fn));
  if (fn.get() != Py_None) own(PyObject_CallMethodOneArg(fn.get(), N.register_hook_dict, t));
  set_attr(grad_hooks, N.next_id, py_int(hid + 1).get());
  // (an OrderedDict keeps its own order: set through its __setitem__, not the dict underneath)
  check(PyObject_SetItem(hooks.get(), next.get(), hook));
  check(PyDict_SetItem(attr(grad_hooks, N.tags).get(), next.get(), tag));
  Ref pair = own(PyTuple_Pack(2, hooks.get(), next.get()));
  check(PyList_Append(attr(grad_hooks, N.entries).get(), pair.get()));
  return true;
}
}  // namespace hookpath

// The facts the recorder's per-tensor path needs about an observed tensor, read in one call
// (mpscope/stats.py: tensor_facts is the Python form, with the same answers): about ten Tensor
// attribute reads from Python (each a C++ call with its torch-function and warning-handler set-up,
// about 1,000 instructions) become one. For a tensor of class Tensor or Parameter (whose attribute
// reads go to these same C++ getters) with plain sizes and storage; anything else (subclasses,
// tensors without storage or with symbolic sizes) is passed to `fallback`, the Python form. None
// when the stats take no such tensor (stats.recordable_dtype's rules: float16 / bfloat16 / float32 /
// float64, strided, not nested, not meta, not empty) and for an efficient zero tensor (no data: the
// recorder takes the zeros it stands for); else (dtype name, numel, ident, fused on the CPU): ident
// is (id, version counter, data pointer) as Python's id(t), t._version and t.data_ptr() give them,
// None for an inference tensor (it has no version counter).
pybind11::object tensor_facts(pybind11::handle obj, pybind11::handle fallback) {
  const hookpath::Facts f = hookpath::facts_of(obj.ptr());
  if (f.kind == hookpath::Facts::kPython) {
    PyObject* r = PyObject_CallOneArg(fallback.ptr(), obj.ptr());
    if (r == nullptr) throw pybind11::error_already_set();
    return pybind11::reinterpret_steal<pybind11::object>(r);
  }
  if (f.kind == hookpath::Facts::kNone) return pybind11::none();
  hookpath::Ref t = hookpath::facts_tuple(f);
  return pybind11::reinterpret_steal<pybind11::object>(std::exchange(t.p, nullptr));
}

// The HookState fields the hook path reads, in its order (checked against HookState.__slots__).
pybind11::tuple hook_fields() {
  pybind11::tuple t(static_cast<size_t>(hookpath::kFieldCount));
  for (size_t i = 0; i < static_cast<size_t>(hookpath::kFieldCount); ++i) t[i] = pybind11::str(hookpath::kFields[i]);
  return t;
}

// The constants of a recorded step for forward_hook and observe_now, parsed once (see
// hookpath::State): (take activations, take their gradients, (tiny float16, bfloat16, float32,
// cast 0..5), the mpscope.kernel module, its own fused_stats_into, this kernel module,
// functools.partial, OrderedDict, HookState, LOG_ENTRY, SEEN, PassKind.FORWARD) -> a capsule.
// Raises TypeError when HookState lacks a field of kFields as a slot, or LOG_ENTRY / SEEN differ from
// kLogEntryFields / kSeenFields.
pybind11::object hook_state(pybind11::tuple t) {
  TORCH_CHECK(t.size() == 12, "mpscope hook_state: 12 items expected");
  auto st = std::make_unique<hookpath::State>();
  st->take_activation = t[0].cast<bool>();
  st->grad_role = t[1].cast<bool>();
  auto bits = t[2].cast<std::vector<int64_t>>();
  TORCH_CHECK(bits.size() == 9, "mpscope hook_state: 9 bit patterns expected");
  std::copy(bits.begin(), bits.begin() + 3, st->tiny);
  st->cast.assign(bits.begin() + 3, bits.end());
  PyObject* kd = PyModule_GetDict(t[3].ptr());
  if (kd == nullptr) throw pybind11::error_already_set();
  TORCH_CHECK(PyType_Check(t[8].ptr()), "mpscope hook_state: the HookState class expected");
  hookpath::check_fields(t[9].ptr(), hookpath::kLogEntryFields, "a log entry");
  hookpath::check_fields(t[10].ptr(), hookpath::kSeenFields, "a seen record");
  PyObject* refs[7] = {kd, t[4].ptr(), t[5].ptr(), t[6].ptr(), t[7].ptr(), t[8].ptr(), t[11].ptr()};
  for (PyObject* r : refs) Py_INCREF(r);
  st->kernel_dict = refs[0];
  st->own_stats_into = refs[1];
  st->module = refs[2];
  st->partial = refs[3];
  st->odict = refs[4];
  st->state_type = reinterpret_cast<PyTypeObject*>(refs[5]);
  st->forward_kind = refs[6];
  // the slots' offsets, found once per HookState class (a recorded step begins: this runs again)
  static PyTypeObject* offsets_of = nullptr;
  static Py_ssize_t offsets[hookpath::kFieldCount] = {};
  if (offsets_of != st->state_type) {
    for (int i = 0; i < hookpath::kFieldCount; ++i) {
      PyObject* d = PyObject_GetAttrString(refs[5], hookpath::kFields[i]);
      if (d == nullptr) throw pybind11::error_already_set();
      const bool slot = Py_IS_TYPE(d, &PyMemberDescr_Type) &&
                        reinterpret_cast<PyMemberDescrObject*>(d)->d_member->type == T_OBJECT_EX;
      if (slot) offsets[i] = reinterpret_cast<PyMemberDescrObject*>(d)->d_member->offset;
      Py_DECREF(d);
      if (!slot) throw pybind11::type_error(std::string("mpscope hook_state: HookState.") + hookpath::kFields[i] +
                                            " is not a slot");
    }
    Py_INCREF(refs[5]);  // (held, so that no other class takes its address while the offsets are cached)
    Py_XDECREF(reinterpret_cast<PyObject*>(offsets_of));
    offsets_of = st->state_type;
  }
  std::copy(offsets, offsets + hookpath::kFieldCount, st->offset);
  PyObject* cap = PyCapsule_New(st.get(), "mpscope.hook_state", [](PyObject* c) {
    delete static_cast<hookpath::State*>(PyCapsule_GetPointer(c, "mpscope.hook_state"));
  });
  if (cap == nullptr) throw pybind11::error_already_set();
  st.release();
  return pybind11::reinterpret_steal<pybind11::object>(cap);
}

// Observer.observe_now with the kernel, its facts read here (its arguments after the HookState and
// hook_state's capsule, but the facts): the row (an int), or what the Python form returns for the
// cases it takes; None for a tensor whose facts this path does not read (see facts_of): the caller
// then reads them itself.
pybind11::object observe_now(pybind11::handle hs, pybind11::handle state, pybind11::handle module, pybind11::handle role,
                             pybind11::handle name, pybind11::handle tensor, pybind11::handle scaled,
                             pybind11::handle pass_id) {
  const hookpath::State& s = hookpath::state_of(state.ptr());
  hookpath::check_state(hs.ptr(), s);
  const hookpath::Facts f = hookpath::facts_of(tensor.ptr());
  if (f.kind != hookpath::Facts::kOk) return pybind11::none();
  hookpath::Ref r = hookpath::observe(hs.ptr(), s, module.ptr(), role.ptr(), name.ptr(), tensor.ptr(), f, nullptr,
                                      scaled.ptr(), pass_id.ptr());
  return pybind11::reinterpret_steal<pybind11::object>(std::exchange(r.p, nullptr));
}

// ActivationHooks.on_forward(module, output) for one plain output tensor, in a forward pass (not a
// re-run inside backward) outside any torch.func transform (functorch includes its front-mode
// dispatch key while one runs; its wrappers, which have no storage, go to the Python form too),
// whose facts this path reads: True when done; False when nothing was done (then the Python form
// takes it; the autocast note the two share is made once either way).
bool forward_hook(pybind11::handle hs_h, pybind11::handle state, pybind11::handle module, pybind11::handle output) {
  using namespace hookpath;
  PyObject* hs = hs_h.ptr();
  PyObject* out = output.ptr();
  if (!THPVariable_CheckExact(out) || torch::autograd::get_current_graph_task_id() != -1 ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode))
    return false;
  const Facts f = facts_of(out);
  if (f.kind != Facts::kOk) return false;
  const Names& N = names();
  const State& s = state_of(state.ptr());
  check_state(hs, s);
  if (field(hs, s, kAutocastSeen) != Py_True) own(PyObject_CallNoArgs(field(hs, s, kNoteAutocast)));
  Ref pass_id = borrowed(field(hs, s, kPassId));
  Ref id = own(PyLong_FromVoidPtr(module.ptr()));
  PyObject* mname = PyDict_GetItemWithError(field(hs, s, kNames), id.get());
  if (mname == nullptr && PyErr_Occurred()) throw pybind11::error_already_set();
  Ref mn = borrowed(mname != nullptr ? mname : N.unknown);
  if (s.take_activation) observe(hs, s, mn.get(), N.activation, N.output, out, f, nullptr, Py_False, pass_id.get());
  PyObject* p = pass_id.get();
  const bool forward = PyTuple_Check(p) && PyTuple_GET_SIZE(p) > 0 && PyTuple_GET_ITEM(p, 0) == s.forward_kind;
  const bool hook_grads = forward || (p == Py_None && s.grad_role);
  if (hook_grads && THPVariable_Unpack(out).requires_grad()) {
    Ref hook = own(PyObject_CallFunctionObjArgs(s.partial, field(hs, s, kGradient), mn.get(), N.output, p, nullptr));
    Ref tag = own(PyTuple_Pack(2, mn.get(), N.output));
    PyObject* hookless = field(hs, s, kHookless);
    // (a set: discarded as PassLedger.hooked does, once it holds anything)
    if (add_grad_hook(field(hs, s, kGradHooks), out, hook.get(), tag.get(), s) && PySet_Check(hookless) &&
        PySet_GET_SIZE(hookless) != 0) {
      check(PySet_Discard(hookless, p));
    }
  }
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_stats", &fused_stats, "mpscope fused stats (CPU)");
  m.def("fused_stats_into", &fused_stats_into, "mpscope fused stats (CPU) into preallocated rows");
  m.def("hist_nonzero", &hist_nonzero, "mpscope: the non-zero histogram bins of host count table rows");
  m.def("stage_copy", &stage_copy, "mpscope: a tensor's values into a staging buffer (below autograd)");
  m.def("same_looks", &same_looks, "mpscope: whether tensors keep the class, dtype, shape, layout and device recorded");
  m.def("gather", &gather, "mpscope: the tensors of the step end's batch and their form");
  m.def("tensor_facts", &tensor_facts, "mpscope: what the per-tensor path needs to know of an observed tensor");
  hookpath::own_stage_copy = m.attr("stage_copy").ptr();
  Py_INCREF(hookpath::own_stage_copy);
  m.def("hook_state", &hook_state, "mpscope: the constants of the hooks' C++ path for a recorded step");
  m.def("hook_fields", &hook_fields, "mpscope: the HookState fields the hooks' C++ path reads");
  m.def("observe_now", &observe_now, "mpscope: Observer.observe_now's usual branches in C++");
  m.def("forward_hook", &forward_hook, "mpscope: ActivationHooks.on_forward's usual case in C++");
  m.def("same_module_tree", &same_module_tree, "mpscope: whether modules keep the children and parameters recorded");
}
