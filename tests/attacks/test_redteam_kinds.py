"""Red-team attacks on the tensor kinds (docs/FORMAT.md §6.12), the standard containers (§6.10),
numpy strings (§6.11) and the key kinds of §6.3, written from the documentation alone.

Every hostile file is built from a valid one: the parts of a tensor are saved as a dict at the
tensor's path, then the manifest's tree (and, where the attack needs it, its table order) is
rewritten and the file digest re-sealed (tests/fuzz/hostile_lib.py), so only the rule under
attack is broken. Each file is then read in a separate worker process (tests/attacks/kinds_probe.py)
whose address space is capped at 2 GiB above what it holds at start, and which is restarted when
it dies: torch builds sparse and nested tensors from whatever parts it is given, and a hostile part
can kill the interpreter rather than raise.

What the documentation promises, checked for every file (docs/SECURITY.md "What loading a file
guarantees", FORMAT.md §6.12 "Verifying"):

- every failure is a tensorcanon exception naming what failed and where (the path in the object),
  on every read path (bytes, stream, path, ``mmap=True``, ``tensorcanon.open``);
- no crash, no hang, no allocation of what the file merely claims;
- ``verify`` passing implies ``load`` succeeding; the command line's ``verify`` exits 0 or 2 (1 for
  damage) and never prints a traceback.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import select
import subprocess
import sys
import warnings

import msgpack
import numpy as np
import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import tensorcanon
from tensorcanon.format import tree

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fuzz"))

import hostile_lib as h

warnings.filterwarnings("ignore", message=".*(Sparse|sparse|nested|prototype).*")

P = h.P  # every multiple of 2^61 - 1 hashes to 0
MARK = "@@answer "
TIMEOUT_S = 120  # per file, on a shared 2-core machine; a hang never answers


# ------------------------------------------------------------------ the worker


class Worker:
    """One kinds_probe.py process; restarted after a crash or a hang."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, str(HERE / "kinds_probe.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def ask(self, request: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT_S)
            if not ready:
                proc.kill()
                proc.wait()
                self.proc = None
                return {"died": f"no answer within {TIMEOUT_S} s (a hang)"}
            line = proc.stdout.readline()
            if not line:
                code = proc.wait()
                self.proc = None
                return {"died": f"the reader died with status {code} (a negative status is a signal: "
                                f"-11 SIGSEGV, -9 SIGKILL, -6 SIGABRT)"}
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def read(worker: Worker, data: bytes, tmp_path) -> dict:
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(data)
    answer = worker.ask({"op": "read", "path": str(path)})
    assert "died" not in answer, answer["died"]
    return answer


def assert_refused(answer: dict, where: str, words: str = "", cls: str = "FormatError") -> None:
    """The documented refusal: on load and verify alike, the library's ``cls`` naming ``where``
    (a path in the object) and ``words``; every read path agrees; the CLI exits 2 without a
    traceback."""
    for what in ("load", "verify", "contract"):
        got = answer[what]
        assert not got.get("foreign"), f"{what} raised a foreign {got['cls']}: {got['msg']}\n{got.get('tb', '')}"
    for what in ("load", "verify"):
        got = answer[what]
        assert not got["ok"], f"{what} accepted a file the format forbids"
        assert got["cls"] == cls, f"{what}: {got['cls']}: {got['msg']}"
        assert where in got["msg"] and words in got["msg"], f"{what}: {got['msg']}"
    cli = answer["cli_verify"]
    assert cli["code"] in (1, 2) and "Traceback" not in cli["stderr"], cli


def assert_loads(answer: dict) -> None:
    """A file the format allows: every path accepts it, verify included."""
    for what in ("load", "verify", "contract"):
        assert answer[what]["ok"], f"{what}: {answer[what]}"
    assert answer["cli_verify"]["code"] == 0, answer["cli_verify"]


# ------------------------------------------------------------------ forging files


def forge(parts: list[tuple[tuple, torch.Tensor]], root, extra: dict | None = None) -> bytes:
    """A file whose table holds ``parts`` (each saved at its path, named as §3 names that path), in
    the order given (so ``["tensor", i]`` is the i-th part), and whose tree is ``root``, with every
    digest valid."""
    obj: dict = dict(extra or {})
    for path, t in parts:
        d = obj
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = t
    data = tensorcanon.dumps(obj)
    m, _, _ = h.manifest_of(data)
    by_name = {r["name"]: r for r in m["tensors"]}
    table = [by_name[".".join(str(k) for k in path)] for path, _ in parts]
    assert len(table) == len(m["tensors"])

    def edit(m):
        m["tensors"] = table
        m["root"] = root

    return h.with_manifest(data, edit)


def T(i: int) -> list:
    return ["tensor", i]


def S(*dims: int) -> list:
    return ["size", *dims]


def sparse(layout: str, size: list, *parts, kind: str = "tensor", grad: bool = False) -> list:
    return ["sparse", layout, size, kind, grad, *parts]


def at(name: str, node) -> list:
    return ["dict", name, node]


def rooted(node) -> bytes:
    """A file without tensors whose tree is ``{"x": node}``."""
    return h.rerooted(tensorcanon.dumps({"x": 0}), at("x", node))


i64 = torch.int64
i32 = torch.int32


def coo_file(indices, values, size, **kw) -> bytes:
    return forge([(("s", "indices"), indices), (("s", "values"), values)],
                 at("s", sparse("coo", S(*size), T(0), T(1), **kw)))


def compressed_file(layout: str, compressed, plain, values, size, **kw) -> bytes:
    names = ("crow_indices", "col_indices") if layout in ("csr", "bsr") else ("ccol_indices", "row_indices")
    return forge([(("s", names[0]), compressed), (("s", names[1]), plain), (("s", "values"), values)],
                 at("s", sparse(layout, S(*size), T(0), T(1), T(2), **kw)))


def jagged_file(values, offsets, dtype: str = "float32", grad: bool = False) -> bytes:
    return forge([(("n", "values"), values), (("n", "offsets"), offsets)],
                 at("n", ["nested", "jagged", dtype, grad, T(0), T(1)]))


def strided_file(elements: list, dtype: str = "float32", grad: bool = False) -> bytes:
    parts = [(("n", i), e) for i, e in enumerate(elements)]
    return forge(parts, at("n", ["nested", "strided", dtype, grad, *[T(i) for i in range(len(elements))]]))


def big(n: int) -> msgpack.ExtType:
    return msgpack.ExtType(tree.EXT_BIGINT, tree.bigint_bytes(n))


# ------------------------------------------------------------------ sparse tensors (§6.12.1)

ONE = torch.tensor([1.0])
IDX = torch.tensor([[0], [1]])

SPARSE_ATTACKS = {
    # COO
    "coo_index_past_size": (lambda: coo_file(torch.tensor([[0], [3]]), ONE, [2, 3]), '$["s"]'),
    "coo_negative_index": (lambda: coo_file(torch.tensor([[0], [-1]]), ONE, [2, 3]), '$["s"]'),
    "coo_int32_indices": (lambda: coo_file(IDX.to(i32), ONE, [2, 3]), '$["s"]'),
    "coo_float_indices": (lambda: coo_file(IDX.double(), ONE, [2, 3]), '$["s"]'),
    "coo_1d_indices": (lambda: coo_file(torch.tensor([0, 1]), torch.ones(2), [2, 3]), '$["s"]'),
    "coo_3d_indices": (lambda: coo_file(IDX.reshape(2, 1, 1), ONE, [2, 3]), '$["s"]'),
    "coo_more_sparse_dims_than_size": (lambda: coo_file(torch.zeros(3, 1, dtype=i64), ONE, [2, 3]), '$["s"]'),
    "coo_values_nnz_lies": (lambda: coo_file(IDX, torch.ones(5), [2, 3]), '$["s"]'),
    "coo_values_dense_dims_lie": (lambda: coo_file(torch.tensor([[0]]), torch.ones(1, 4), [2, 3]), '$["s"]'),
    "coo_repeated_column": (lambda: coo_file(torch.tensor([[0, 0], [1, 1]]), torch.ones(2), [2, 3]), '$["s"]'),
    "coo_zero_sparse_dims_two_values": (lambda: coo_file(torch.zeros(0, 2, dtype=i64), torch.ones(2, 2, 3), [2, 3]),
                                        '$["s"]'),
    "coo_bool_indices": (lambda: coo_file(IDX.bool(), ONE, [2, 3]), '$["s"]'),
    "coo_huge_size_dims": (lambda: coo_file(IDX, ONE, [2**62, 2**62]), '$["s"]'),
    "coo_negative_size": (lambda: coo_file(IDX, ONE, [2, -3]), '$["s"]'),
    "coo_many_size_dims": (lambda: coo_file(torch.zeros(1, 1, dtype=i64), ONE, [1] * 100), '$["s"]'),
    "coo_grad_on_int_values": (lambda: coo_file(IDX, torch.tensor([1]), [2, 3], grad=True), '$["s"]'),
    "coo_kind_unknown": (lambda: coo_file(IDX, ONE, [2, 3], kind="ndarray"), '$["s"]'),
    "coo_values_is_ndarray_part": (
        lambda: h.with_manifest(coo_file(IDX, ONE, [2, 3]),
                                lambda m: m["tensors"][1].__setitem__("kind", "parameter")), '$["s"]'),
    # CSR / CSC
    "csr_crow_not_starting_at_zero": (
        lambda: compressed_file("csr", torch.tensor([1, 1, 1]), torch.tensor([0]), ONE, [2, 3]), '$["s"]'),
    "csr_crow_decreasing": (
        lambda: compressed_file("csr", torch.tensor([0, 2, 1]), torch.tensor([0]), ONE, [2, 3]), '$["s"]'),
    "csr_crow_end_not_nnz": (
        lambda: compressed_file("csr", torch.tensor([0, 1, 5]), torch.tensor([0]), ONE, [2, 3]), '$["s"]'),
    "csr_crow_too_short": (
        lambda: compressed_file("csr", torch.tensor([0, 1]), torch.tensor([0]), ONE, [2, 3]), '$["s"]'),
    "csr_crow_too_long": (
        lambda: compressed_file("csr", torch.tensor([0, 0, 0, 0, 1]), torch.tensor([0]), ONE, [2, 3]), '$["s"]'),
    "csr_col_out_of_range": (
        lambda: compressed_file("csr", torch.tensor([0, 1, 1]), torch.tensor([7]), ONE, [2, 3]), '$["s"]'),
    "csr_col_negative": (
        lambda: compressed_file("csr", torch.tensor([0, 1, 1]), torch.tensor([-1]), ONE, [2, 3]), '$["s"]'),
    "csr_col_repeated_in_row": (
        lambda: compressed_file("csr", torch.tensor([0, 2, 2]), torch.tensor([1, 1]), torch.ones(2), [2, 3]),
        '$["s"]'),
    "csr_mixed_index_dtypes": (
        lambda: compressed_file("csr", torch.tensor([0, 1, 1], dtype=i32), torch.tensor([0]), ONE, [2, 3]),
        '$["s"]'),
    "csr_float_indices": (
        lambda: compressed_file("csr", torch.tensor([0.0, 1, 1]), torch.tensor([0.0]), ONE, [2, 3]), '$["s"]'),
    "csr_values_nnz_lies": (
        lambda: compressed_file("csr", torch.tensor([0, 1, 1]), torch.tensor([0]), torch.ones(3), [2, 3]),
        '$["s"]'),
    "csr_int32_with_dimension_past_2_31": (
        lambda: compressed_file("csr", torch.tensor([0, 0, 0], dtype=i32), torch.zeros(0, dtype=i32),
                                torch.zeros(0), [2, 2**31]), '$["s"]'),
    "csr_1x0_with_an_entry": (
        lambda: compressed_file("csr", torch.tensor([0, 1]), torch.tensor([0]), ONE, [1, 0]), '$["s"]'),
    "csr_2d_compressed_for_2d_size": (
        lambda: compressed_file("csr", torch.tensor([[0, 1, 1]]), torch.tensor([[0]]), torch.ones(1, 1), [2, 3]),
        '$["s"]'),
    "csr_one_dimensional_size": (
        lambda: compressed_file("csr", torch.tensor([0, 1]), torch.tensor([0]), ONE, [3]), '$["s"]'),
    "csc_row_out_of_range": (
        lambda: compressed_file("csc", torch.tensor([0, 1, 1, 1]), torch.tensor([5]), ONE, [2, 3]), '$["s"]'),
    # BSR / BSC
    "bsr_zero_block": (
        lambda: compressed_file("bsr", torch.tensor([0, 0, 0]), torch.zeros(0, dtype=i64), torch.zeros(0, 0, 2),
                                [4, 4]), '$["s"]'),
    "bsr_zero_block_with_blocks": (
        lambda: compressed_file("bsr", torch.tensor([0, 1]), torch.tensor([0]), torch.zeros(1, 0, 2),
                                [4, 4]), '$["s"]'),
    "bsr_block_not_dividing_size": (
        lambda: compressed_file("bsr", torch.tensor([0, 1, 1]), torch.tensor([0]), torch.ones(1, 3, 3), [4, 4]),
        '$["s"]'),
    "bsr_2d_values": (
        lambda: compressed_file("bsr", torch.tensor([0, 1, 1]), torch.tensor([0]), torch.ones(1, 2), [4, 4]),
        '$["s"]'),
    "bsr_col_past_block_columns": (
        lambda: compressed_file("bsr", torch.tensor([0, 1, 1]), torch.tensor([2]), torch.ones(1, 2, 2), [4, 4]),
        '$["s"]'),
    "bsc_row_past_block_rows": (
        lambda: compressed_file("bsc", torch.tensor([0, 1, 1]), torch.tensor([2]), torch.ones(1, 2, 2), [4, 4]),
        '$["s"]'),
    # structure
    "sparse_unknown_layout": (lambda: forge([(("s", "indices"), IDX), (("s", "values"), ONE)],
                                            at("s", sparse("dense", S(2, 3), T(0), T(1)))), '$["s"]'),
    "sparse_coo_with_three_parts": (
        lambda: compressed_file("coo", torch.tensor([0, 1, 1]), torch.tensor([0]), ONE, [2, 3]), '$["s"]'),
    "sparse_size_is_a_list": (lambda: forge([(("s", "indices"), IDX), (("s", "values"), ONE)],
                                            at("s", ["sparse", "coo", ["list", 2, 3], "tensor", False, T(0), T(1)])),
                              '$["s"]'),
    "sparse_part_is_an_int": (lambda: forge([(("s", "indices"), IDX), (("x",), ONE)],
                                            at("s", sparse("coo", S(2, 3), T(0), 5)) + ["x", T(1)]), '$["s"]'),
    "sparse_part_is_nested_sparse": (
        lambda: forge([(("s", "indices"), IDX), (("s", "values"), ONE)],
                      at("s", sparse("coo", S(2, 3), T(0), sparse("coo", S(1), T(0), T(1))))), '$["s"]'),
    "sparse_grad_is_an_int": (lambda: coo_file(IDX, ONE, [2, 3], grad=1), '$["s"]'),
}


@pytest.mark.parametrize("name", list(SPARSE_ATTACKS))
def test_hostile_sparse_parts_are_refused_naming_the_tensor(worker, tmp_path, name):
    build, where = SPARSE_ATTACKS[name]
    assert_refused(read(worker, build(), tmp_path), where)


# ------------------------------------------------------------------ nested tensors (§6.12.2)

ROWS = torch.ones(4, 3)

NESTED_ATTACKS = {
    "jagged_offsets_not_from_zero": (lambda: jagged_file(ROWS, torch.tensor([1, 4])), '$["n"]'),
    "jagged_offsets_decreasing": (lambda: jagged_file(ROWS, torch.tensor([0, 3, 1, 4])), '$["n"]'),
    "jagged_offsets_past_rows": (lambda: jagged_file(ROWS, torch.tensor([0, 2, 9])), '$["n"]'),
    "jagged_offsets_short_of_rows": (lambda: jagged_file(ROWS, torch.tensor([0, 2, 3])), '$["n"]'),
    "jagged_offsets_one_entry": (lambda: jagged_file(torch.ones(0, 3), torch.tensor([0])), '$["n"]'),
    "jagged_offsets_int32": (lambda: jagged_file(ROWS, torch.tensor([0, 4], dtype=i32)), '$["n"]'),
    "jagged_offsets_2d": (lambda: jagged_file(ROWS, torch.tensor([[0, 4]])), '$["n"]'),
    "jagged_offsets_float": (lambda: jagged_file(ROWS, torch.tensor([0.0, 4.0])), '$["n"]'),
    "jagged_values_0d": (lambda: jagged_file(torch.tensor(1.0), torch.tensor([0, 1])), '$["n"]'),
    "jagged_values_dtype_lies": (lambda: jagged_file(ROWS.double(), torch.tensor([0, 4])), '$["n"]'),
    "jagged_grad_on_ints": (lambda: jagged_file(ROWS.long(), torch.tensor([0, 4]), dtype="int64", grad=True),
                            '$["n"]'),
    "jagged_three_parts": (lambda: forge([(("n", "values"), ROWS), (("n", "offsets"), torch.tensor([0, 4])),
                                          (("n", "lengths"), torch.tensor([4]))],
                                         at("n", ["nested", "jagged", "float32", False, T(0), T(1), T(2)])), '$["n"]'),
    "jagged_unknown_dtype": (lambda: jagged_file(ROWS, torch.tensor([0, 4]), dtype="float128"), '$["n"]'),
    "strided_ndim_differs": (lambda: strided_file([torch.ones(2, 3), torch.ones(3)]), '$["n"]'),
    "strided_dtype_lies": (lambda: strided_file([torch.ones(2, 3), torch.ones(2, 3)], dtype="float64"), '$["n"]'),
    "strided_parts_of_two_dtypes": (lambda: strided_file([torch.ones(2), torch.ones(2, dtype=torch.float64)]),
                                    '$["n"]'),
    "strided_grad_on_ints": (lambda: strided_file([torch.ones(2, dtype=i64)], dtype="int64", grad=True), '$["n"]'),
    "nested_unknown_layout": (lambda: forge([(("n", 0), ROWS)], at("n", ["nested", "sparse", "float32", False, T(0)])),
                              '$["n"]'),
    "nested_part_is_a_list": (lambda: rooted(["nested", "strided", "float32", False, ["list"]]), '$["x"]'),
    "nested_grad_is_none": (lambda: strided_file([torch.ones(2)], grad=None), '$["n"]'),
}


@pytest.mark.parametrize("name", list(NESTED_ATTACKS))
def test_hostile_nested_parts_are_refused_naming_the_tensor(worker, tmp_path, name):
    build, where = NESTED_ATTACKS[name]
    assert_refused(read(worker, build(), tmp_path), where)


# Nested tensors the rules of §6.12.2 allow: each must load (a file that verifies loads), whatever
# torch makes of it; a refusal must at least be the library's own.
NESTED_EDGES = {
    "strided_no_elements": lambda: rooted(["nested", "strided", "float32", False]),
    "strided_0d_elements": lambda: strided_file([torch.tensor(1.0), torch.tensor(2.0)]),
    "strided_bool": lambda: strided_file([torch.tensor([True])], dtype="bool"),
    "strided_float8": lambda: strided_file([torch.zeros(2, dtype=torch.float8_e5m2)], dtype="float8_e5m2"),
    "strided_uint16": lambda: strided_file([torch.zeros(2, dtype=torch.uint16)], dtype="uint16"),
    "strided_complex": lambda: strided_file([torch.zeros(2, dtype=torch.complex64)], dtype="complex64"),
    "jagged_all_empty_elements": lambda: jagged_file(torch.ones(0, 3), torch.tensor([0, 0, 0])),
    "jagged_1d_values": lambda: jagged_file(torch.ones(4), torch.tensor([0, 1, 4])),
    "jagged_bool": lambda: jagged_file(torch.ones(2, 2, dtype=torch.bool), torch.tensor([0, 2]), dtype="bool"),
    "jagged_float8": lambda: jagged_file(torch.zeros(2, 2, dtype=torch.float8_e4m3fn), torch.tensor([0, 2]),
                                         dtype="float8_e4m3fn"),
    "jagged_uint32": lambda: jagged_file(torch.zeros(2, 2, dtype=torch.uint32), torch.tensor([0, 2]), dtype="uint32"),
}


@pytest.mark.parametrize("name", list(NESTED_EDGES))
def test_nested_tensors_the_rules_allow_load_where_they_verify(worker, tmp_path, name):
    answer = read(worker, NESTED_EDGES[name](), tmp_path)
    for what in ("load", "verify", "contract"):
        got = answer[what]
        assert not got.get("foreign"), f"{what} raised a foreign {got['cls']}: {got['msg']}\n{got.get('tb', '')}"
    if answer["verify"]["ok"]:
        assert answer["load"]["ok"], f"verify passed, then load raised {answer['load']}"
    else:
        assert '$["' in answer["verify"]["msg"], answer["verify"]


# ------------------------------------------------------------------ meta tensors (§6.12.3)

META_ATTACKS = {
    "meta_2_63_bytes": (lambda: rooted(["meta", "float32", S(2**61), "tensor", False]), '$["x"]'),
    "meta_zero_times_huge": (lambda: rooted(["meta", "float32", S(0, 2**62), "tensor", False]), '$["x"]'),
    "meta_product_wraps_64_bits": (lambda: rooted(["meta", "int8", S(2**32, 2**32, 0)]), '$["x"]'),
    "meta_negative_dim": (lambda: rooted(["meta", "float32", S(-1), "tensor", False]), '$["x"]'),
    "meta_bigint_dim": (lambda: rooted(["meta", "float32", ["size", big(2**70)], "tensor", False]), '$["x"]'),
    "meta_100000_dims_of_2": (lambda: rooted(["meta", "int8", S(*[2] * 100_000), "tensor", False]), '$["x"]'),
    "meta_quantized_dtype": (lambda: rooted(["meta", "qint8", S(2), "tensor", False]), '$["x"]'),
    "meta_grad_on_int": (lambda: rooted(["meta", "int64", S(2), "tensor", True]), '$["x"]'),
    "meta_kind_ndarray": (lambda: rooted(["meta", "float32", S(2), "ndarray", False]), '$["x"]'),
    "meta_size_is_list": (lambda: rooted(["meta", "float32", ["list", 2], "tensor", False]), '$["x"]'),
    "meta_as_dict_key": (lambda: rooted(["dict", ["meta", "float32", S(2), "tensor", False], 1]), '$["x"]'),
}


@pytest.mark.parametrize("name", list(META_ATTACKS))
def test_hostile_meta_tensors_are_refused_naming_the_tensor(worker, tmp_path, name):
    build, where = META_ATTACKS[name]
    assert_refused(read(worker, build(), tmp_path), where)


@pytest.mark.parametrize("node", [["meta", "float32", S(*[1] * 1000), "tensor", False],
                                  ["meta", "int8", S(*[1] * 100_000), "tensor", False]], ids=["1000", "100000"])
def test_a_meta_tensor_of_many_dimensions_loads_as_it_verifies(worker, tmp_path, node):
    """max_ndim bounds the length of a header shape (FORMAT.md §9.4), and a meta tensor has none: a
    meta tensor of 1,000 or 100,000 dimensions of 1 holds no bytes and loads, in time linear in its
    node, on every path, as verify says. (SECURITY.md's table words max_ndim as "dimensions of one
    tensor"; the normative text is §9.4.)"""
    assert_loads(read(worker, rooted(node), tmp_path))


def test_a_meta_tensor_of_a_petabyte_loads_without_memory(worker, tmp_path):
    """2^50 float32 elements on ``meta`` are allowed (below 2^63 bytes) and cost nothing."""
    assert_loads(read(worker, rooted(["meta", "float32", S(2**25, 2**25), "parameter", True]), tmp_path))


# ------------------------------------------------------------------ attributes (§6.12.4)

def attrs_file(attrs, extra: list | None = None) -> bytes:
    return forge([(("t",), torch.ones(2))], ["dict", "t", ["tensor.attrs", T(0), attrs], *(extra or [])])


ATTRS_ATTACKS = {
    "attrs_empty_dict": (lambda: attrs_file(["dict"]), '$["t"]'),
    "attrs_int_key": (lambda: attrs_file(["dict", 1, 2]), '$["t"]'),
    "attrs_not_a_dict": (lambda: attrs_file(["list", 1]), '$["t"]'),
    "attrs_odict": (lambda: attrs_file(["odict", None, "a", 1]), '$["t"]'),
    "attrs_of_a_later_use": (lambda: forge([(("a",), torch.ones(2))],
                                           ["dict", "a", T(0), "b", ["tensor.attrs", T(0), ["dict", "x", 1]]]),
                             '$["b"]'),
    "attrs_holding_attrs_of_itself": (lambda: attrs_file(["dict", "x", ["tensor.attrs", T(0), ["dict", "y", 1]]]),
                                      '$["t"]'),
    "attrs_around_attrs": (lambda: forge([(("t",), torch.ones(2))],
                                         at("t", ["tensor.attrs", ["tensor.attrs", T(0), ["dict", "a", 1]],
                                                  ["dict", "b", 2]])), '$["t"]'),
    "attrs_around_an_int": (lambda: rooted(["tensor.attrs", 5, ["dict", "a", 1]]), '$["x"]'),
    "attrs_around_an_obj": (lambda: rooted(["tensor.attrs", ["obj", "io.BytesIO", b"x"], ["dict", "a", 1]]), '$["x"]'),
    "attrs_three_args": (lambda: forge([(("t",), torch.ones(2))],
                                       at("t", ["tensor.attrs", T(0), ["dict", "a", 1], ["dict", "b", 1]])), '$["t"]'),
}


@pytest.mark.parametrize("name", list(ATTRS_ATTACKS))
def test_hostile_tensor_attributes_are_refused_naming_the_tensor(worker, tmp_path, name):
    build, where = ATTRS_ATTACKS[name]
    assert_refused(read(worker, build(), tmp_path), where)


ATTR_NAMES_CODE = """
import sys
sys.path.insert(0, {fuzz!r})
import hostile_lib as h
data = open({path!r}, "rb").read()
t = tensorcanon.loads(data)["t"]
result = (type(t).__name__, t.dtype == torch.float32, t.tolist(), t.requires_grad, t.grad is None,
          sorted(t.__dict__), t.__dict__.get("data"), t.__dict__.get("__class__"))
"""


def test_attribute_names_that_are_tensor_properties_never_change_the_tensor(worker, tmp_path):
    """§6.12.4: a reader sets each attribute in the tensor's ``__dict__``. Names that are torch's own
    properties or Python's (``data``, ``requires_grad``, ``grad``, ``__class__``, ``dtype``) must
    not reach ``setattr``, which would replace the tensor's data, class or grad."""
    attrs = ["dict", "__class__", "x", "data", 7, "dtype", "int", "grad", 1.5, "requires_grad", True, "shape", 0]
    path = tmp_path / "names.safetensors"
    path.write_bytes(attrs_file(attrs))
    answer = worker.ask({"op": "call", "code": ATTR_NAMES_CODE.format(fuzz=str(HERE.parent / "fuzz"),
                                                                      path=str(path))})
    assert "died" not in answer and not answer.get("foreign"), answer
    if answer["ok"]:
        assert answer["result"] == repr(("Tensor", True, [1.0, 1.0], False, True,
                                         ["__class__", "data", "dtype", "grad", "requires_grad", "shape"], 7, "x"))
    else:  # a refusal is allowed only as the library's own, naming the attribute
        assert answer["cls"] == "FormatError" and '$["t"]' in answer["msg"], answer
    read_answer = read(worker, path.read_bytes(), tmp_path)
    assert read_answer["verify"]["ok"] == read_answer["load"]["ok"], read_answer


def test_attributes_may_hold_tensors_and_the_tensor_itself(worker, tmp_path):
    """A tensor attribute and a cycle through the tensor's own ``__dict__`` are values the format
    holds (§6.12.4: the values encoded as any node)."""
    t = torch.ones(2)
    t.me, t.other = t, torch.zeros(3)
    data = tensorcanon.dumps({"t": t})
    assert h.manifest_of(data)[0]["root"] == at("t", ["tensor.attrs", T(0), ["dict", "me", T(0), "other", T(1)]])
    assert_loads(read(worker, data, tmp_path))


# ------------------------------------------------------------------ registered subclasses (§6.12.5)

TWO = "torch.testing._internal.two_tensor.TwoTensor"  # registered in the worker


class _Registered:
    """TwoTensor registered in this process for the time of a save (the worker registers its own)."""

    def __enter__(self):
        tensorcanon.register(TwoTensor)

    def __exit__(self, *exc):
        tensorcanon.unregister(TwoTensor)


def two_file(state) -> bytes:
    return forge([(("x", "inner", "a"), torch.ones(2)), (("x", "inner", "b"), torch.arange(2.0))],
                 at("x", ["obj", TWO, state]))


def two_state(**change) -> list:
    fields = {"ctx": None, "inner": ["dict", "a", T(0), "b", T(1)], "requires_grad": False, "size": S(2),
              "stride": ["list", 1]}
    fields.update(change)
    out: list = ["dict"]
    for k in sorted(fields):
        if fields[k] is not KeyError:
            out += [k, fields[k]]
    return out


SUBCLASS_ATTACKS = {
    "subclass_inner_missing": (lambda: two_file(two_state(inner=["dict", "a", T(0), "c", T(1)])), '$["x"]'),
    "subclass_inner_not_tensors": (lambda: rooted(["obj", TWO, two_state(inner=["dict", "a", 1, "b", 2])]), '$["x"]'),
    "subclass_size_is_huge": (lambda: two_file(two_state(size=S(2**62, 2**62), stride=["list", 1, 1])), '$["x"]'),
    "subclass_negative_stride": (lambda: two_file(two_state(stride=["list", -1])), '$["x"]'),
    "subclass_stride_rank_lies": (lambda: two_file(two_state(stride=["list", 1, 1, 1])), '$["x"]'),
    "subclass_stride_not_ints": (lambda: two_file(two_state(stride=["list", "a"])), '$["x"]'),
    "subclass_grad_is_str": (lambda: two_file(two_state(requires_grad="yes")), '$["x"]'),
    "subclass_fields_missing": (lambda: two_file(two_state(stride=KeyError)), '$["x"]'),
    "subclass_state_is_a_list": (lambda: rooted(["obj", TWO, ["list", 1, 2]]), '$["x"]'),
    "subclass_grad_on_int_inner": (
        lambda: forge([(("x", "inner", "a"), torch.ones(2, dtype=i64)),
                       (("x", "inner", "b"), torch.ones(2, dtype=i64))],
                      at("x", ["obj", TWO, two_state(requires_grad=True)])), '$["x"]'),
}


@pytest.mark.parametrize("name", list(SUBCLASS_ATTACKS))
def test_hostile_subclass_states_are_refused_naming_the_value(worker, tmp_path, name):
    """The state's structure (§6.12.5) is the library's to check before it calls the class's
    ``__tensor_unflatten__``: a refusal is the library's FormatError naming the path, never an
    exception from the class's own code (an AssertionError of TwoTensor's constructor)."""
    build, where = SUBCLASS_ATTACKS[name]
    assert_subclass_refused(read(worker, build(), tmp_path), where)


def assert_subclass_refused(answer: dict, where: str) -> None:
    """A registered type's state is checked by the loading reader, which knows the registration;
    ``verify`` builds nothing and does not know that the name is a tensor subclass (FORMAT.md §6.6:
    it MAY only check the state's structure), so it may pass where load refuses: only the load's
    refusal is asserted, and that no path raises a foreign exception (hostile_lib's contract, which
    asserts that verify passing implies load, does not apply)."""
    got = answer["load"]
    assert not got.get("foreign"), f"load raised a foreign {got['cls']}: {got['msg']}\n{got.get('tb', '')}"
    assert not got["ok"], "load accepted a state §6.12.5 does not allow"
    assert got["cls"] == "FormatError" and where in got["msg"], got
    assert not answer["verify"].get("foreign"), answer["verify"]
    assert "Traceback" not in answer["cli_verify"]["stderr"], answer["cli_verify"]


def test_a_subclass_name_registered_as_a_dataclass_refuses_a_tensor_state(worker, tmp_path):
    """A file names a registered *dataclass* with the state of a tensor subclass (and the other way
    round): the registration decides, and the mismatch is the library's own error."""
    assert_loads(read(worker, two_file(two_state()), tmp_path))  # the untouched file loads, on every path
    swapped = h.with_manifest(two_file(two_state()),
                              lambda m: m["root"][2].__setitem__(1, "tensorcanon.DeterminismSettings"))
    assert_refused(read(worker, swapped, tmp_path), '$["x"]')  # a specified state: verify checks it too
    wrong = rooted(["obj", TWO, ["dict", "deterministic_algorithms", True]])
    assert_subclass_refused(read(worker, wrong, tmp_path), '$["x"]')


def test_a_registered_subclass_loads_alike_eagerly_and_memory_mapped(worker, tmp_path):
    """Found by the contract of every read path: ``load(path, mmap=True)`` refused a valid TwoTensor
    file that ``load`` reads (its inner tensors viewed the map at two offsets, and TwoTensor asserts
    one); every path must decide alike (SECURITY.md, "Memory-mapped reading")."""
    with _Registered():
        data = tensorcanon.dumps({"x": TwoTensor(torch.ones(2), torch.arange(2.0)), "y": torch.zeros(3)})
    assert_loads(read(worker, data, tmp_path))


def test_an_unregistered_subclass_name_is_refused_without_import(worker, tmp_path):
    data = h.with_manifest(two_file(two_state()), lambda m: m["root"][2].__setitem__(1, "os.system"))
    answer = read(worker, data, tmp_path)
    assert answer["load"]["cls"] == "UnsupportedTypeError" and '$["x"]' in answer["load"]["msg"], answer


# ------------------------------------------------------------------ standard containers (§6.10)

STD_ATTACKS = {
    "counter_odd_arity": (lambda: rooted(["counter", "a"]), '$["x"]'),
    "counter_keys_unsorted": (lambda: rooted(["counter", "b", 1, "a", 1]), '$["x"]'),
    "counter_key_repeated": (lambda: rooted(["counter", "a", 1, "a", 2]), '$["x"]'),
    "counter_true_and_one": (lambda: rooted(["counter", True, 1, 1, 2]), '$["x"]'),
    "counter_list_key": (lambda: rooted(["counter", ["list", 1], 1]), '$["x"]'),
    "counter_hash_flood": (lambda: rooted(["counter", *[x for k in range(9, 9 + 70) for x in (big(k * P), 1)]]),
                           '$["x"]'),
    "defaultdict_no_factory_slot": (lambda: rooted(["defaultdict"]), '$["x"]'),
    "defaultdict_factory_os_system": (lambda: rooted(["defaultdict", "os.system"]), '$["x"]'),
    "defaultdict_factory_builtins_int": (lambda: rooted(["defaultdict", "builtins.int"]), '$["x"]'),
    "defaultdict_factory_type": (lambda: rooted(["defaultdict", "type"]), '$["x"]'),
    "defaultdict_factory_eval": (lambda: rooted(["defaultdict", "eval"]), '$["x"]'),
    "defaultdict_factory_int_spaced": (lambda: rooted(["defaultdict", "int "]), '$["x"]'),
    "defaultdict_factory_a_number": (lambda: rooted(["defaultdict", 3]), '$["x"]'),
    "defaultdict_factory_a_list_node": (lambda: rooted(["defaultdict", ["list", "int"]]), '$["x"]'),
    "defaultdict_factory_bytes_name": (lambda: rooted(["defaultdict", b"int"]), '$["x"]'),
    "defaultdict_keys_unsorted": (lambda: rooted(["defaultdict", "int", "b", 1, "a", 2]), '$["x"]'),
    "defaultdict_even_arity": (lambda: rooted(["defaultdict", "int", "a"]), '$["x"]'),
    "defaultdict_hash_flood": (
        lambda: rooted(["defaultdict", None, *[x for k in range(9, 9 + 70) for x in (big(k * P), 1)]]), '$["x"]'),
    "deque_no_maxlen_slot": (lambda: rooted(["deque"]), '$["x"]'),
    "deque_more_items_than_maxlen": (lambda: rooted(["deque", 1, "a", "b"]), '$["x"]'),
    "deque_maxlen_zero_with_items": (lambda: rooted(["deque", 0, "a"]), '$["x"]'),
    "deque_maxlen_negative": (lambda: rooted(["deque", -1]), '$["x"]'),
    "deque_maxlen_bool": (lambda: rooted(["deque", True, 1]), '$["x"]'),
    "deque_maxlen_float": (lambda: rooted(["deque", 3.0, 1]), '$["x"]'),
    "deque_maxlen_2_63": (lambda: rooted(["deque", 2**63]), '$["x"]'),
    "deque_maxlen_bigint": (lambda: rooted(["deque", big(2**70)]), '$["x"]'),
    "deque_maxlen_str": (lambda: rooted(["deque", "3"]), '$["x"]'),
    "counter_as_dict_key": (lambda: rooted(["dict", ["counter"], 1]), '$["x"]'),
    "deque_as_set_member": (lambda: rooted(["set", ["deque", None]]), '$["x"]'),
}


@pytest.mark.parametrize("name", list(STD_ATTACKS))
def test_hostile_standard_containers_are_refused_naming_them(worker, tmp_path, name):
    build, where = STD_ATTACKS[name]
    assert_refused(read(worker, build(), tmp_path), where)


def test_counter_values_may_be_any_value(worker, tmp_path):
    """§6.10.1: a Counter's values are any node, "a count is usually an integer": a str, a tensor,
    a nested Counter and a float all load, and equal what was saved."""
    value = {"c": collections.Counter({"a": "text", "b": torch.ones(2), "c": collections.Counter(x=1), "d": 0.5})}
    assert_loads(read(worker, tensorcanon.dumps(value), tmp_path))


def test_a_deque_of_maxlen_2_63_minus_1_loads(worker, tmp_path):
    assert_loads(read(worker, rooted(["deque", 2**63 - 1, 1, 2]), tmp_path))


# ------------------------------------------------------------------ numpy strings (§6.11)

def strings(kind, width, shape, *elements) -> list:
    return ["np.strings", kind, width, len(shape), *shape, *elements]


NPSTR_ATTACKS = {
    "np_str_bytes_text": (lambda: rooted(["np.str", b"abc"]), '$["x"]'),
    "np_bytes_str_data": (lambda: rooted(["np.bytes", "abc"]), '$["x"]'),
    "np_str_two_args": (lambda: rooted(["np.str", "a", "b"]), '$["x"]'),
    "strings_kind_O": (lambda: rooted(strings("O", 1, [1], "a")), '$["x"]'),
    "strings_kind_V": (lambda: rooted(strings("V", 1, [1], b"a")), '$["x"]'),
    "strings_width_zero": (lambda: rooted(strings("U", 0, [0])), '$["x"]'),
    "strings_width_negative": (lambda: rooted(strings("S", -1, [0])), '$["x"]'),
    "strings_width_2_29_U": (lambda: rooted(strings("U", 2**29, [0])), '$["x"]'),
    "strings_width_2_31_S": (lambda: rooted(strings("S", 2**31, [0])), '$["x"]'),
    "strings_width_bigint": (lambda: rooted(strings("S", big(2**70), [0])), '$["x"]'),
    "strings_width_bool": (lambda: rooted(strings("S", True, [1], b"a")), '$["x"]'),
    "strings_element_wider_than_width": (lambda: rooted(strings("U", 1, [1], "ab")), '$["x"]'),
    "strings_element_trailing_nul": (lambda: rooted(strings("S", 2, [1], b"a\x00")), '$["x"]'),
    "strings_element_of_other_kind": (lambda: rooted(strings("U", 2, [1], b"a")), '$["x"]'),
    "strings_more_elements_than_shape": (lambda: rooted(strings("U", 1, [1], "a", "b")), '$["x"]'),
    "strings_fewer_elements_than_shape": (lambda: rooted(strings("U", 1, [3], "a")), '$["x"]'),
    "strings_shape_huge_no_elements": (lambda: rooted(strings("U", 1, [2**40])), '$["x"]'),
    "strings_shape_product_wraps": (lambda: rooted(strings("S", 1, [2**32, 2**32, 0])), '$["x"]'),
    "strings_negative_dim": (lambda: rooted(strings("S", 1, [-1])), '$["x"]'),
    "strings_ndim_33": (lambda: rooted(strings("S", 1, [1] * 33, b"a")), '$["x"]'),
    "strings_ndim_lies": (lambda: rooted(["np.strings", "S", 1, 5, 1, b"a"]), '$["x"]'),
    "strings_ndim_negative": (lambda: rooted(["np.strings", "S", 1, -1]), '$["x"]'),
    "strings_as_dict_key": (lambda: rooted(["dict", strings("S", 1, [1], b"a"), 1]), '$["x"]'),
}


@pytest.mark.parametrize("name", list(NPSTR_ATTACKS))
def test_hostile_numpy_strings_are_refused_naming_them(worker, tmp_path, name):
    build, where = NPSTR_ATTACKS[name]
    assert_refused(read(worker, build(), tmp_path), where)


def test_a_string_array_claiming_gigabytes_from_a_few_bytes_is_refused_before_allocating(worker, tmp_path):
    """``width`` is a claim, like a shape: 64 one-character elements of a ``U`` dtype 2^28 wide
    (1 GiB each, 64 GiB in all) are some 200 bytes of manifest. The docs promise memory that grows
    with the bytes present, never with bytes claimed (SECURITY.md, "Bounded time and memory"): the
    reader must refuse it as the library's own error, not allocate it (the worker's address space is
    capped at 2 GiB above its start) nor die."""
    data = rooted(strings("U", 2**28, [64], *["a"] * 64))
    answer = read(worker, data, tmp_path)
    for what in ("load", "verify"):
        assert not answer[what].get("foreign"), answer[what]
    assert not answer["load"]["ok"] and answer["load"]["cls"] in ("FormatError", "LimitError"), answer["load"]
    assert '$["x"]' in answer["load"]["msg"], answer["load"]
    assert answer["verify"]["ok"] == answer["load"]["ok"], answer


def test_numpy_string_values_the_rules_allow_load(worker, tmp_path):
    value = {"s": np.str_("a\x00"), "b": np.bytes_(b"\x00"), "u": np.array([["", "é"]]), "e": np.array([], dtype="S3"),
             "z": np.array("x")}
    assert_loads(read(worker, tensorcanon.dumps(value), tmp_path))
    assert_loads(read(worker, rooted(strings("U", 2**29 - 1, [0])), tmp_path))


# ------------------------------------------------------------------ key kinds (§6.3)

def np_int(name: str, value: int) -> list:
    return ["np.scalar", name, np.array(value, dtype=name).tobytes()]


KEY_ATTACKS = {
    "key_np_float": (lambda: rooted(["dict", ["np.scalar", "float32", b"\0\0\0\0"], 1]), '$["x"]'),
    "key_np_int_ties_python_int": (lambda: rooted(["dict", 1, "a", np_int("int64", 1), "b"]), '$["x"]'),
    "key_np_int_sorted_wrong": (lambda: rooted(["dict", np_int("int8", 5), 1, np_int("uint8", 3), 2]), '$["x"]'),
    "key_np_str_ties_str": (lambda: rooted(["dict", "a", 1, ["np.str", "a"], 2]), '$["x"]'),
    "key_np_bytes_ties_bytes": (lambda: rooted(["set", b"a", ["np.bytes", b"a"]]), '$["x"]'),
    "key_np_bool_ties_true": (lambda: rooted(["set", True, ["np.scalar", "bool", b"\x01"]]), '$["x"]'),
    "key_np_bool_byte_2": (lambda: rooted(["set", ["np.scalar", "bool", b"\x02"]]), '$["x"]'),
    "key_dtype_unknown": (lambda: rooted(["dict", ["dtype", "float128"], 1]), '$["x"]'),
    "key_dtypes_unsorted": (lambda: rooted(["dict", ["dtype", "int8"], 1, ["dtype", "float32"], 2]), '$["x"]'),
    "key_dtype_repeated": (lambda: rooted(["set", ["dtype", "int8"], ["dtype", "int8"]]), '$["x"]'),
    "key_device": (lambda: rooted(["dict", ["device", "cpu"], 1]), '$["x"]'),
    "key_enum_state_a_list": (lambda: rooted(["dict", ["obj", "some.Enum", ["list", 1]], 1]), '$["x"]'),
    "key_obj_state_a_dict": (lambda: rooted(["set", ["obj", "some.Enum", ["dict", "a", 1]]]), '$["x"]'),
    "key_enums_unsorted_by_name": (
        lambda: rooted(["set", ["obj", "b.E", 1], ["obj", "a.E", 1]]), '$["x"]'),
    "key_enums_unsorted_by_value": (
        lambda: rooted(["set", ["obj", "a.E", 2], ["obj", "a.E", 1]]), '$["x"]'),
    "key_np_int_hash_flood": (
        lambda: rooted(["set", *[np_int("uint64", k * P) for k in range(1, 9)],
                        *[big(k * P) for k in range(9, 9 + 70)]]), '$["x"]'),
    "key_np_int_flood_alone_in_tuples": (
        lambda: rooted(["set", *[["tuple", np_int("int64", k * P)] for k in range(1, 5)],
                        *[["tuple", big(k * P)] for k in range(9, 9 + 70)]]), '$["x"]'),
}


def _random_node() -> list:
    """The node of a ``random.Random`` state, as a writer writes it (rng.random, docs/RNG.md)."""
    import random

    return h.manifest_of(tensorcanon.dumps({"r": random.Random(0)}))[0]["root"][2]


KEY_ATTACKS["key_random_state"] = (lambda: rooted(["set", _random_node()]), '$["x"]')
KEY_ATTACKS["key_sparse"] = (lambda: forge([(("s", "indices"), IDX), (("s", "values"), ONE)],
                                           ["dict", ["sparse", "coo", S(2, 3), "tensor", False, T(0), T(1)], 1]),
                             "$")


@pytest.mark.parametrize("name", list(KEY_ATTACKS))
def test_hostile_keys_of_the_new_kinds_are_refused(worker, tmp_path, name):
    build, where = KEY_ATTACKS[name]
    answer = read(worker, build(), tmp_path)
    for what in ("load", "verify", "contract"):
        got = answer[what]
        assert not got.get("foreign"), f"{what} raised a foreign {got['cls']}: {got['msg']}\n{got.get('tb', '')}"
    assert not answer["verify"]["ok"] and answer["verify"]["cls"] == "FormatError", answer["verify"]
    assert where in answer["verify"]["msg"], answer["verify"]
    assert not answer["load"]["ok"] and answer["load"]["cls"] in ("FormatError", "UnsupportedTypeError"), answer


def test_an_enum_key_whose_value_names_no_member_is_refused_naming_it(worker, tmp_path):
    code = """
import enum
class E(enum.Enum):
    A = 1
tensorcanon.register(E, name="red.E")
data = tensorcanon.dumps({E.A: 1})
m, header, body = h.manifest_of(data)
m["root"] = ["dict", ["obj", "red.E", 2], 1]
bad = h.rebuild(data, h.repack(m), header, body)
try:
    tensorcanon.loads(bad)
    result = "loaded"
except tensorcanon.TensorCanonError as e:
    result = (type(e).__name__, str(e))
"""
    answer = worker.ask({"op": "call", "code": code})
    assert "died" not in answer and answer["ok"], answer
    assert answer["result"].startswith("('FormatError'") and "red.E" in answer["result"], answer["result"]
    assert " at $" in answer["result"], answer["result"]  # the key's container: the root


# ------------------------------------------------------------------ diff (docs/CLI.md "diff")

def diff(worker: Worker, a: bytes, b: bytes, tmp_path) -> dict:
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    pa.write_bytes(a)
    pb.write_bytes(b)
    answer = worker.ask({"op": "diff", "a": str(pa), "b": str(pb)})
    assert "died" not in answer, answer["died"]
    return answer


def huge_coo(value: float) -> bytes:
    """A valid COO matrix of 2^31 x 2^31 (2^62 elements: no dense copy of it can exist) with one entry."""
    return tensorcanon.dumps({"s": torch.sparse_coo_tensor(torch.tensor([[5], [7]]), torch.tensor([value]),
                                                           (2**31, 2**31))})


DIFF_PAIRS = {
    # sparse tensors far too large to densify: compared by their parts, never by a dense copy
    "huge_coo_values_differ": (lambda: huge_coo(1.0), lambda: huge_coo(2.0), True),
    "huge_coo_vs_huge_csr": (lambda: huge_coo(1.0),
                             lambda: tensorcanon.dumps({"s": torch.sparse_csr_tensor(
                                 torch.zeros(3, dtype=i64), torch.zeros(0, dtype=i64),
                                 torch.zeros(0), (2, 2**31))}), True),
    "meta_huge_vs_meta_huge_dtype": (lambda: rooted(["meta", "float32", S(2**30, 2**30), "tensor", False]),
                                     lambda: rooted(["meta", "float16", S(2**30, 2**30), "tensor", False]), True),
    "meta_vs_dense": (lambda: rooted(["meta", "float32", S(2), "tensor", False]),
                      lambda: tensorcanon.dumps({"x": torch.ones(2)}), True),
    "meta_equal": (lambda: rooted(["meta", "float32", S(2**40), "tensor", False]),
                   lambda: rooted(["meta", "float32", S(2**40), "tensor", False]), False),
    "jagged_vs_strided": (lambda: tensorcanon.dumps({"n": torch.nested.nested_tensor([torch.ones(2, 3)],
                                                                                     layout=torch.jagged)}),
                          lambda: tensorcanon.dumps({"n": torch.nested.nested_tensor([torch.ones(2, 3)])}), True),
    "nested_vs_dense": (lambda: tensorcanon.dumps({"n": torch.nested.nested_tensor([torch.ones(2)])}),
                        lambda: tensorcanon.dumps({"n": torch.ones(1, 2)}), True),
    "sparse_vs_dense": (lambda: tensorcanon.dumps({"s": torch.eye(2).to_sparse()}),
                        lambda: tensorcanon.dumps({"s": torch.eye(2)}), True),
    "nested_different_counts": (lambda: tensorcanon.dumps({"n": torch.nested.nested_tensor([torch.ones(2)])}),
                                lambda: tensorcanon.dumps({"n": torch.nested.nested_tensor([torch.ones(2)] * 3)}),
                                True),
    "counter_vs_dict": (lambda: tensorcanon.dumps({"c": collections.Counter(a=1)}),
                        lambda: tensorcanon.dumps({"c": {"a": 1}}), True),
    "deque_maxlen_differs": (lambda: tensorcanon.dumps({"d": collections.deque([1], maxlen=2)}),
                             lambda: tensorcanon.dumps({"d": collections.deque([1], maxlen=3)}), True),
    "defaultdict_factory_differs": (lambda: tensorcanon.dumps({"d": collections.defaultdict(int)}),
                                    lambda: tensorcanon.dumps({"d": collections.defaultdict(list)}), True),
    "string_widths_differ": (lambda: tensorcanon.dumps({"s": np.array(["a"], dtype="U1")}),
                             lambda: tensorcanon.dumps({"s": np.array(["a"], dtype="U9")}), True),
    "strings_vs_bytes": (lambda: tensorcanon.dumps({"s": np.array(["a"])}),
                         lambda: tensorcanon.dumps({"s": np.array([b"a"])}), True),
}


def _attrs_tensor(note):
    t = torch.ones(2)
    t.note = note
    return {"t": t}


DIFF_PAIRS["attr_tensor_vs_int"] = (lambda: tensorcanon.dumps(_attrs_tensor(torch.zeros(2**10))),
                                    lambda: tensorcanon.dumps(_attrs_tensor(3)), True)


@pytest.mark.parametrize("name", list(DIFF_PAIRS))
def test_diff_of_the_kinds_is_bounded_and_reports_in_the_library_s_terms(worker, tmp_path, name):
    """``tensorcanon.diff`` and ``tensorcanon diff`` compare every kind without a dense copy, a
    crash or a foreign exception, and say whether they differ (exit 1 / 0)."""
    a, b, differ = DIFF_PAIRS[name]
    answer = diff(worker, a(), b(), tmp_path)
    got = answer["diff"]
    assert got["ok"], f"diff raised {got['cls']}: {got['msg']}\n{got.get('tb', '')}"
    cli = answer["cli_diff"]
    assert cli["code"] == (1 if differ else 0) and "Traceback" not in cli["stderr"], cli


def test_diff_of_a_hostile_sparse_file_is_the_library_s_error(worker, tmp_path):
    bad = SPARSE_ATTACKS["csr_col_out_of_range"][0]()
    good = tensorcanon.dumps({"s": torch.eye(2, 3).to_sparse_csr()})
    answer = diff(worker, bad, good, tmp_path)
    assert not answer["diff"]["ok"] and answer["diff"]["cls"] == "FormatError", answer["diff"]
    assert '$["s"]' in answer["diff"]["msg"], answer["diff"]
    assert answer["cli_diff"]["code"] == 2 and "Traceback" not in answer["cli_diff"]["stderr"], answer["cli_diff"]


# ------------------------------------------------------------------ lock and check (docs/CLI.md)

LOCKED = ["coo_index_past_size", "csr_col_repeated_in_row", "jagged_offsets_decreasing"]


@pytest.mark.parametrize("name", LOCKED)
def test_lock_refuses_and_check_reports_a_hostile_file_of_the_kinds(worker, tmp_path, name):
    """``lock`` of a file load refuses is an error (2); ``check`` of a lockfile that pins the hostile
    file by its own recorded digest and size (what an attacker who writes both would put there)
    reports it failed, exit 1, naming the file, never ``ok`` and never a traceback."""
    table = {**SPARSE_ATTACKS, **NESTED_ATTACKS}
    data = table[name][0]()
    path = tmp_path / "w.safetensors"
    path.write_bytes(data)
    lock = worker.ask({"op": "cli", "argv": ["lock", str(path), "-o", str(tmp_path / "t.lock")]})
    assert lock["code"] == 2 and "Traceback" not in lock["stderr"], lock
    recorded = h.split(data)[0]["__metadata__"]["tensorcanon.digest"]
    (tmp_path / "t.lock").write_text(f"tensorcanon-lock 2\n{recorded} {len(data)} w.safetensors\n")
    check = worker.ask({"op": "cli", "argv": ["check", str(tmp_path / "t.lock")]})
    assert check["code"] == 1 and "Traceback" not in check["stderr"] + check["stdout"], check
    line = next(x for x in check["stdout"].splitlines() if "w.safetensors" in x)
    assert not line.startswith("ok"), check
