"""The packed record (fedact_app.wire): what it holds, computed here with NumPy and Flower's own
``Array``; what Flower makes of it; and every malformed record refused with its reason."""

import io
import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedact_app.wire import packed_entries, packed_record, unpacked


def mixed():
    g = torch.Generator().manual_seed(0)
    return {"matrix": torch.randn(3, 4, generator=g), "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 5), "count": torch.arange(5), "mask": torch.tensor([True, False]),
            "half": torch.randn(3, generator=g).half(), "double": torch.randn(2, 3, dtype=torch.float64),
            "transposed": torch.randn(4, 6, generator=g).T, "sliced": torch.randn(4, 6, generator=g)[:, ::2],
            "bias": torch.randn(7, generator=g, requires_grad=True)}


def test_a_packed_record_is_one_npy_array_per_dtype_and_a_json_layout():
    tensors = mixed()
    record = packed_record(tensors)
    assert list(record) == ["layout", "float32", "int64", "bool", "float16", "float64"]
    layout = [[name, str(t.detach().numpy().dtype), list(t.shape)] for name, t in tensors.items()]
    assert json.loads(np.load(io.BytesIO(record["layout"].data)).tobytes()) == layout
    for dtype in list(record)[1:]:
        names = [name for name, t in tensors.items() if str(t.detach().numpy().dtype) == dtype]
        values = np.concatenate([tensors[name].detach().numpy().reshape(-1) for name in names])
        assert record[dtype].data == Array(values).data  # the bytes Flower's own Array writes
        assert (record[dtype].dtype, record[dtype].shape) == (dtype, (values.size,))


def test_unpacked_gives_the_tensors_back_in_order_writable_and_apart_from_the_bytes():
    tensors = mixed()
    record = packed_record(tensors)
    received = unpacked(record)
    assert list(received) == list(tensors)
    for name, t in tensors.items():
        assert received[name].dtype == t.dtype and received[name].shape == t.shape
        assert torch.equal(received[name], t.detach())
    before = bytes(record["float32"].data)
    received["matrix"] += 1.0  # the caller owns its copy
    assert record["float32"].data == before
    assert unpacked(packed_record({})) == {}


def test_flower_moves_a_packed_record_as_a_few_objects_whatever_the_number_of_tensors():
    g = torch.Generator().manual_seed(1)
    tensors = {f"block{i}.weight": torch.randn(8, 8, generator=g) for i in range(80)}
    packed = len(get_all_nested_objects(packed_record(tensors)))
    per_tensor = len(get_all_nested_objects(ArrayRecord(tensors)))
    assert packed <= 5 and per_tensor > 80, (packed, per_tensor)


def with_layout(record, layout):
    record = ArrayRecord(dict(record))  # a copy: a record's entries are shared objects
    record["layout"] = Array(np.frombuffer(json.dumps(layout).encode(), np.uint8).copy())
    return record


GOOD = packed_record({"w": torch.ones(2, 3), "n": torch.tensor([4, 5])})


@pytest.mark.parametrize("record, reason", [
    (ArrayRecord({"w": torch.ones(2, 3)}), r"no 'layout' entry .*not a packed record"),
    (with_layout(GOOD, {"w": [2, 3]}), "a dict, not a list"),
    (ArrayRecord({**GOOD, "layout": Array(np.frombuffer(b"[[", np.uint8).copy())}), "not JSON"),
    (ArrayRecord({**GOOD, "layout": Array(np.ones(3, np.float32))}), "not UTF-8 bytes"),
    (with_layout(GOOD, [["w", "float32", [2, 3]], ["n", "int64"]]), r"\['n', 'int64'\] is not \[name, dtype, shape\]"),
    (with_layout(GOOD, [["w", "float32", [2, -3]], ["n", "int64", [2]]]), "is not \\[name, dtype, shape\\]"),
    (with_layout(GOOD, [["w", "float32", [2, 3]], ["w", "int64", [2]]]), "names 'w' twice"),
    (with_layout(GOOD, [["w", "float16", [2, 3]], ["n", "int64", [2]]]), "'w' is 'float16', of which the record "
                                                                         "holds no array"),
    (with_layout(GOOD, [["w", "layout", [2, 3]], ["n", "int64", [2]]]), "of which the record holds no array"),
    (with_layout(GOOD, [["w", "float32", [3, 3]], ["n", "int64", [2]]]), r"'float32' is \(6,\) <f4, the "
                                                                         r"layout's tensors are \(9,\) <f4"),
    (with_layout(GOOD, [["w", "float32", [2, 3]]]), "array 'int64' holds no tensor of the layout"),
    (ArrayRecord({**GOOD, "int64": Array(np.array([4, 5], np.int32))}), r"'int64' is \(2,\) <i4"),
    (ArrayRecord({**GOOD, "int64": Array(np.array([4, 5], ">i8"))}), r"'int64' is \(2,\) >i8, the layout's "
                                                                    r"tensors are \(2,\) <i8"),
    (ArrayRecord({**GOOD, "float32": Array(dtype="float32", shape=(6,), stype="numpy.ndarray",
                                           data=b"\x93NUMPY garbage")}), "no .npy array"),
])
def test_a_malformed_packed_record_is_refused_naming_what_is_wrong(record, reason):
    with pytest.raises(ValueError, match=reason):
        packed_entries(record)
    with pytest.raises(ValueError, match=reason):
        unpacked(record)


def test_the_record_the_malformed_ones_are_made_from_is_good():
    assert unpacked(GOOD)["n"].tolist() == [4, 5] and torch.equal(unpacked(GOOD)["w"], torch.ones(2, 3))
