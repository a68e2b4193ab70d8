"""The per-tensor facts the recorder's hooks read (``stats.tensor_facts`` and the fused kernel's
``tensor_facts``): both forms give what PyTorch's own attribute reads give, on every kind of tensor
a hook can meet."""

from __future__ import annotations

import warnings

import pytest
import torch

from mpscope import stats


class _Sub(torch.Tensor):
    pass


def _zoo() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # (nested tensors' prototype warning)
        warnings.simplefilter("ignore")
        return _make_zoo()


def _make_zoo() -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        inference = torch.randn(3)
    bumped = torch.randn(3)
    bumped.add_(1)
    return {
        "float32": torch.randn(3, 4), "float16": torch.randn(5).half(), "bfloat16": torch.randn(2, 2).bfloat16(),
        "float64": torch.randn(3).double(), "int64": torch.arange(3), "bool": torch.ones(2, dtype=torch.bool),
        "complex64": torch.randn(2, dtype=torch.cfloat), "float8": torch.zeros(3, dtype=torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4), "0-dim": torch.tensor(2.0), "meta": torch.empty(3, device="meta"),
        "sparse": torch.randn(3, 3).to_sparse(), "sparse_csr": torch.randn(3, 3).to_sparse_csr(),
        "view with gaps": torch.randn(4, 4)[:, 1], "transpose": torch.randn(3, 5).t(),
        "expanded": torch.randn(1, 3).expand(4, 3), "parameter": torch.nn.Parameter(torch.randn(3)),
        "inference": inference, "version bumped": bumped,
        "requires grad": torch.randn(3, requires_grad=True) * 2, "subclass": torch.randn(3).as_subclass(_Sub),
        "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        "jagged": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged),
        "efficient zero tensor": torch._efficientzerotensor(3, 4),
    }


def _oracle(t: torch.Tensor):
    """PyTorch's own answers: which tensors the stats take (float16/bfloat16/float32/float64,
    strided, not nested, not meta, not empty, holding data: not an efficient zero tensor) and their facts."""
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or t.layout != torch.strided \
            or t.is_nested or t.device.type == "meta" or t.numel() == 0 or t._is_zerotensor():
        return None
    ident = None if t.is_inference() else (id(t), t._version, t.data_ptr())
    return (str(t.dtype).removeprefix("torch."), t.numel(), ident,
            t.device.type == "cpu" and t.dtype != torch.float64)


@pytest.mark.parametrize("name", list(_zoo()))
def test_both_forms_of_the_tensor_facts_equal_pytorchs_own_reads(fused, name):
    t = _zoo()[name]
    want = _oracle(t)
    assert stats.tensor_facts(t) == want
    passed = []

    def fallback(x):
        passed.append(x)
        return stats.tensor_facts(x)

    assert fused.tensor_facts(t, fallback) == want
    # only tensors whose attribute reads could differ go to the Python form
    assert passed == ([t] if t.__class__ not in (torch.Tensor, torch.nn.Parameter) else [])


def test_the_facts_tell_a_tensor_written_in_place_from_the_same_tensor_unchanged(fused):
    t = torch.randn(4)
    before = fused.tensor_facts(t, stats.tensor_facts)
    assert fused.tensor_facts(t, stats.tensor_facts) == before
    t.mul_(2)
    after = fused.tensor_facts(t, stats.tensor_facts)
    assert after[2][0] == before[2][0] and after[2][1] == before[2][1] + 1
    t.data = torch.randn(4)  # a new storage under the same object: the data pointer changes
    assert fused.tensor_facts(t, stats.tensor_facts)[2][2] == t.data_ptr() != before[2][2]


def test_a_tensor_without_storage_raises_in_both_forms(fused):
    """vmap's batched tensors (what a batched backward hands the gradient hooks) have no storage:
    both forms raise RuntimeError, which the gradient hook turns into a not-measured note."""
    seen = {}

    def f(x):
        seen["python"] = pytest.raises(RuntimeError, stats.tensor_facts, x)
        seen["kernel"] = pytest.raises(RuntimeError, fused.tensor_facts, x, stats.tensor_facts)
        return x * 2

    torch.func.vmap(f)(torch.randn(3, 4))
    assert set(seen) == {"python", "kernel"}
