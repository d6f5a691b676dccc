"""The writer refuses exactly what its readers reject, at every limit of docs/FORMAT.md §9
(issue 37, item 6; FORMAT.md §8 "A writer refuses what readers reject").

For each limit and each kind of value it bounds, values are generated at the limit and one past
it. For each: ``save`` succeeds exactly when a reader accepts the file the writer would write
(``save refuses <=> the reader would refuse``), and a value that saves loads, with the same limits,
to a value that is the same and saves to the same bytes (``save succeeds => load succeeds and
round-trips``). The file a refusing writer would have written is made by the same writer with the
limit raised (a :class:`tensorcanon.Limits` field) or, for a rule no caller can raise, with the
writer's check of that rule switched off for that one save; the reader keeps its own check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import tensorcanon as tc
from tensorcanon import Limits, TensorCanonError
from tensorcanon.format import container, tensorkinds, tree

from compare import assert_same

warnings.filterwarnings("ignore", message=".*(Sparse|sparse|nested|prototype).*")


@dataclasses.dataclass(frozen=True)
class Case:
    limit: str            # the rule: a Limits field, or a rule of the format no caller raises
    kind: str             # the kind of value it bounds
    at: bool              # True: at the limit (must save), False: one past it (must be refused)
    value: Callable[[], Any]
    limits: Limits = Limits()
    metadata: dict | None = None


@contextlib.contextmanager
def _writer_unchecked(limit: str) -> Iterator[None]:
    """The writer's check of a rule no caller can raise, switched off (the reader's stays on once the
    block ends): the file made inside is the one the writer would write without the check."""
    with pytest.MonkeyPatch.context() as mp:
        if limit == "size_product":
            mp.setattr(container, "size_problem", lambda shape, itemsize: None)
            mp.setattr(tensorkinds, "size_problem", lambda size, itemsize=1: None)
        elif limit == "string_ndim":
            mp.setattr(tree, "string_array_problem", lambda kind, width, ndim, shape: None)
        else:
            raise AssertionError(limit)
        yield


def _raised(limits: Limits, limit: str) -> Limits:
    return dataclasses.replace(limits, **{limit: getattr(limits, limit) + 10**6})


def _unwritten(case: Case) -> bytes:
    """The file the writer would write for ``case`` if it did not apply the limit under test."""
    if hasattr(case.limits, case.limit):
        return tc.dumps(case.value(), metadata=case.metadata, limits=_raised(case.limits, case.limit))
    with _writer_unchecked(case.limit):
        return tc.dumps(case.value(), metadata=case.metadata, limits=case.limits)


def _reader_refuses(data: bytes, limits: Limits) -> bool:
    refused = []
    for read in (lambda: tc.loads(data, limits=limits), lambda: tc.verify(data, limits=limits)):
        try:
            read()
            refused.append(False)
        except TensorCanonError:
            refused.append(True)
    assert refused[0] == refused[1], "load and verify disagree"
    return refused[0]


# ------------------------------------------------------------------ values at a limit, by kind


def _nest(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


def _coo(n: int = 1) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0, 2, 0][:n]]), torch.ones(min(n, 3)), (3,))


def _jagged() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.ones(1, 2), torch.ones(2, 2)], layout=torch.jagged)


def _tagged() -> torch.Tensor:
    t = torch.ones(2)
    t.note = "x"
    return t


# Each kind as a value with n dimensions in its largest header shape (max_ndim; §9.1 item 7)
NDIM: dict[str, Callable[[int], Any]] = {
    "tensor": lambda n: torch.zeros((1,) * n),
    "tensor stored as bytes": lambda n: torch.zeros((1,) * (n - 1), dtype=torch.complex128),  # (+1: [16])
    "parameter": lambda n: torch.nn.Parameter(torch.zeros((1,) * n)),
    "ndarray": lambda n: np.zeros((1,) * min(n, 64), dtype=np.float32) if n <= 64
    else np.zeros((1,) * (n - 1), dtype=np.complex128),  # (numpy holds 64 dimensions at most)
    "sparse coo": lambda n: torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones((1,) * n),
                                                    (1,) * n),  # values: nnz x n-1 dense dimensions
    "sparse csr": lambda n: torch.ones((1,) * (n + 1)).to_sparse_csr(dense_dim=n - 1),  # values: nnz x n-1
    "nested jagged": lambda n: torch.nested.nested_tensor_from_jagged(torch.ones((2,) + (1,) * (n - 1)),
                                                                      torch.tensor([0, 2])),
    "attributes": lambda n: (lambda t: (setattr(t, "note", 1), t)[1])(torch.zeros((1,) * n)),
}

# Each kind as a value of n table rows (max_tensors)
TENSORS: dict[str, Callable[[int], Any]] = {
    "tensor": lambda n: [torch.full((1,), float(i)) for i in range(n)],
    "ndarray": lambda n: [np.full(1, i, dtype=np.int64) for i in range(n)],
    "sparse coo": lambda n: [_coo() * (i + 1) for i in range(n // 2)] + [torch.ones(1)] * (n % 2),
    "nested strided": lambda n: torch.nested.nested_tensor([torch.full((1,), float(i)) for i in range(n)]),
    "nested jagged": lambda n: [torch.nested.nested_tensor_from_jagged(torch.ones(2, 1) * i, torch.tensor([0, 2]))
                                for i in range(n // 2)] + [torch.ones(1)] * (n % 2),
    "attributes": lambda n: [_tagged() for _ in range(n)],
}

# Each kind, and how many levels of tagged arrays it takes itself (max_depth, §9.4)
DEPTH: dict[str, tuple[Callable[[], Any], int]] = {
    "tensor": (lambda: torch.ones(1), 1),
    "ndarray": (lambda: np.ones(1), 1),
    "sparse coo": (_coo, 2),  # the sparse node, then its size and parts
    "nested jagged": (_jagged, 2),
    "meta": (lambda: torch.empty(2, device="meta"), 2),
    "attributes": (_tagged, 2),
    "np.strings": (lambda: np.array(["ab"]), 1),
    "dict": (lambda: {"a": 1}, 1),
    "tuple key": (lambda: {(1,): 1}, 2),
}

# Each kind as a value with no elements whose non-zero dimensions times its element size are
# 2^63 - x (x > 0: at the limit) or 2^63 (one past; FORMAT.md §5.3, §9.1 item 7)
SIZE: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {
    "tensor": (lambda: torch.empty(0, 2**61 - 1), lambda: torch.empty(0, 2**61)),
    "tensor stored as bytes": (lambda: torch.empty(0, 2**59 - 1, dtype=torch.complex128),
                               lambda: torch.empty(0, 2**59, dtype=torch.complex128)),
    "parameter": (lambda: torch.nn.Parameter(torch.empty(0, 2**61 - 1)),
                  lambda: torch.nn.Parameter(torch.empty(0, 2**61))),
    "meta": (lambda: torch.empty(0, 2**61 - 1, device="meta"), lambda: torch.empty(0, 2**61, device="meta")),
    "meta bfloat16": (lambda: torch.empty(0, 2**62 - 1, dtype=torch.bfloat16, device="meta"),
                      lambda: torch.empty(0, 2**62, dtype=torch.bfloat16, device="meta")),
    "attributes": (lambda: (lambda t: (setattr(t, "a", 1), t)[1])(torch.empty(0, 2**61 - 1)),
                   lambda: (lambda t: (setattr(t, "a", 1), t)[1])(torch.empty(0, 2**61))),
    # torch and numpy make none past the limit: at it only
    "sparse coo": (lambda: torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0), (2**63 - 1,)),
                   None),
    "ndarray": (lambda: np.empty((0, 2**61 - 1), dtype=np.float32), None),
    "np.strings S": (lambda: np.empty((0, 2**63 - 1), dtype="S1"), None),
    "np.strings U": (lambda: np.empty((0, 2**61 - 1), dtype="U1"), None),
}

# Each kind of value, for the header's size (max_header_bytes)
HEADER: dict[str, Callable[[], Any]] = {
    "tensor": lambda: {"w": torch.ones(3)},
    "ndarray": lambda: {"a": np.ones(3)},
    "sparse coo": lambda: {"s": _coo(3)},
    "nested jagged": lambda: {"j": _jagged()},
    "meta": lambda: {"m": torch.empty(3, device="meta")},
    "np.strings": lambda: {"s": np.array(["a", "bc"])},
    "leaves": lambda: {"text": "x" * 100, "n": list(range(20))},
}


def _cases() -> list[Case]:
    cases = []
    for at in (True, False):
        for kind, make in NDIM.items():
            cases.append(Case("max_ndim", kind, at, lambda make=make, at=at: make(4 if at else 5),
                              Limits(max_ndim=4)))
        cases.append(Case("max_ndim", "ndarray at the default", at,
                          lambda at=at: np.zeros((1,) * 64, np.float32) if at else np.zeros((1,) * 64, np.complex128)))
        for kind, make in TENSORS.items():
            cases.append(Case("max_tensors", kind, at, lambda make=make, at=at: make(4 if at else 5),
                              Limits(max_tensors=4)))
        for kind, (make, own) in DEPTH.items():
            cases.append(Case("max_depth", kind, at,
                              lambda make=make, own=own, at=at: _nest(make(), 6 - own + (not at)), Limits(max_depth=6)))
            cases.append(Case("max_depth", f"{kind} in metadata", at,
                              lambda: {}, Limits(max_depth=6),
                              metadata={"m": _nest(make(), 6 - 1 - own + (not at))} if kind not in (
                                  "tensor", "ndarray", "sparse coo", "nested jagged", "attributes") else None))
        for kind, pair in SIZE.items():
            make = pair[0] if at else pair[1]
            if make is not None:
                cases.append(Case("size_product", kind, at, make))
        for kind, make in HEADER.items():
            size = len(tc.dumps(make())) - 8 - sum(t.nbytes for t in _host_tensors(make()))
            cases.append(Case("max_header_bytes", kind, at, make, Limits(max_header_bytes=size - (not at))))
        for k, arr in (("U", np.array(["abc", "d"])), ("S", np.array([b"ab", b"c"]))):
            cases.append(Case("max_string_array_bytes", f"np.strings {k}", at, lambda arr=arr: {"a": arr, "b": [arr]},
                              Limits(max_string_array_bytes=2 * arr.nbytes - (not at))))
            cases.append(Case("max_string_array_bytes", f"np.strings {k} in metadata", at, lambda: {},
                              Limits(max_string_array_bytes=arr.nbytes - (not at)), metadata={"a": arr}))
        for dims in (32, 33):
            if (dims == 32) == at:
                cases.append(Case("string_ndim", "np.strings U", at,
                                  lambda dims=dims: np.array(["x"]).reshape((1,) * dims)))
                cases.append(Case("string_ndim", "np.strings S", at,
                                  lambda dims=dims: np.zeros((1,) * dims, dtype="S2")))
    return [c for c in cases if c.metadata is not None or not c.kind.endswith("in metadata")]


def _host_tensors(value: Any) -> list:
    """The tensors' bytes a value's file holds (for the header's size: the file less the data)."""
    data = tc.dumps(value)
    n = int.from_bytes(data[:8], "little")
    return [memoryview(data[8 + n:])]


CASES = _cases()


def _numpy_cannot_make(case: Case) -> bool:
    """numpy before 2.0 holds at most 32 dimensions: an array past that (the default max_ndim's 64,
    a string array of 33) cannot be made there, so there is no such value to save or refuse."""
    try:
        case.value()
    except ValueError as e:
        assert "maximum supported dimension" in str(e) and int(np.__version__.split(".")[0]) < 2, e
        return True
    return False


@pytest.mark.parametrize("case", CASES, ids=[f"{c.limit}-{c.kind}-{'at' if c.at else 'past'}" for c in CASES])
def test_save_refuses_exactly_what_the_reader_rejects(case: Case) -> None:
    if _numpy_cannot_make(case):
        return
    unwritten = _unwritten(case)
    reader_refuses = _reader_refuses(unwritten, case.limits)
    try:
        data = tc.dumps(case.value(), metadata=case.metadata, limits=case.limits)
    except TensorCanonError as e:
        assert reader_refuses, f"the writer refuses what the reader accepts: {e}"
        assert getattr(e, "path", None), f"the refusal names no path: {e}"
        assert not case.at, f"refused at the limit: {e}"
        return
    assert data == unwritten
    assert not reader_refuses, "the writer wrote a file its own reader rejects"
    assert case.at, "accepted one past the limit"
    back = tc.loads(data, limits=case.limits)
    assert tc.dumps(back, metadata=case.metadata, limits=case.limits) == data
    assert_same(case.metadata, tc.read_metadata(data, limits=case.limits))
    assert_same(case.value(), back)


def test_every_limit_is_generated_at_and_past_for_several_kinds() -> None:
    """The generated cases cover each rule of §9 (and §6.11's dimensions), at the limit and one past."""
    seen: dict[str, set] = {}
    for c in CASES:
        seen.setdefault(c.limit, set()).add(c.at)
    assert set(seen) == {"max_ndim", "max_tensors", "max_depth", "size_product", "max_header_bytes",
                         "max_string_array_bytes", "string_ndim"}
    assert all(v == {True, False} for v in seen.values())
    assert {f.name for f in dataclasses.fields(Limits)} <= set(seen)


def test_the_two_cases_of_issue_37_are_refused_naming_the_path_and_the_limit() -> None:
    if int(np.__version__.split(".")[0]) >= 2:  # (numpy 1.x makes no array of 33 dimensions)
        with pytest.raises(TensorCanonError, match=r"33 dimensions.*at most 32") as info:
            tc.dumps({"s": np.array(["x"]).reshape((1,) * 33)})
        assert info.value.path == '$["s"]'
    with pytest.raises(TensorCanonError, match=r"2\^63") as info:
        tc.dumps({"m": torch.empty(0, 2**61, device="meta")})
    assert info.value.path == '$["m"]'
