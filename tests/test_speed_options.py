"""The speed options: bf16/fp16 wire format, bf16 autocast, channels_last, compile key.

Each is checked against what it must equal, computed independently: a plain dtype cast for the
wire format, a hand-cast bf16 matmul for autocast, the contiguous-format result for channels_last.
"""

import pytest
import torch
import torch.nn.functional as F

from fedact_app.algorithms import ALGORITHMS
from fedact_app.config import ConfigError, compose
from fedact_app.tasks.vision.tensors import ImageTensors
from fedact_app.tasks.vision.models import build_model
from fedact_app.train import autocast, evaluate, train_steps
from fedact_app.wire import from_wire, packed_record, to_wire, unpacked


def _arrays():
    g = torch.Generator().manual_seed(0)
    # second-moment-like magnitudes (1e-10 .. 1) and signed correction-like values
    return {"w": torch.rand(7, 5, generator=g) ** 8, "b": torch.randn(5, generator=g)}


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16", "float16"])
def test_wire_format_through_a_flower_record_is_a_plain_cast(wire_dtype):
    arrays = _arrays()
    sent = packed_record(to_wire(arrays, wire_dtype))
    received = from_wire(unpacked(sent), wire_dtype)
    for name, t in arrays.items():
        expected = t.to(getattr(torch, wire_dtype)).float()
        assert received[name].dtype == torch.float32
        assert torch.equal(received[name], expected)
    bytes_per_value = 4 if wire_dtype == "float32" else 2
    raw = sum(t.numel() for t in arrays.values()) * bytes_per_value
    assert raw <= sent.count_bytes() < raw + 512


def test_bfloat16_keeps_small_second_moments_that_float16_flushes():
    v = torch.tensor([1e-12, 1e-9, 3e-6])
    assert (from_wire(to_wire({"v": v}, "bfloat16"), "bfloat16")["v"] > 0).all()
    assert from_wire(to_wire({"v": v}, "float16"), "float16")["v"][0] == 0


def test_integer_entries_travel_unchanged():
    arrays = {"n": torch.tensor([3, 4])}
    assert torch.equal(from_wire(to_wire(arrays, "bfloat16"), "bfloat16")["n"], arrays["n"])


def test_bf16_autocast_runs_the_forward_in_bf16_and_keeps_fp32_weights():
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 3)
    x = torch.randn(4, 6)
    with autocast(torch.device("cpu"), "bf16"):
        out = layer(x)
    manual = F.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, manual)
    with autocast(torch.device("cpu"), "fp32"):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


class _Batches:
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def next_batch(self):
        return self.images, self.labels


def _cnn_and_data():
    cfg = compose("")
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.dataset)
    images = torch.randn(8, cfg.dataset.channels, cfg.dataset.image_size, cfg.dataset.image_size)
    labels = torch.randint(0, cfg.dataset.num_classes, (8,))
    return model, images, labels


def test_bf16_training_keeps_fp32_state_and_stays_close_to_fp32():
    model, images, labels = _cnn_and_data()
    twin = build_model(compose("").model, compose("").dataset)
    twin.load_state_dict(model.state_dict())
    stats = {}
    for precision, net in (("fp32", model), ("bf16", twin)):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        stats[precision] = train_steps(net, opt, _Batches(images, labels), 3, precision=precision)
        assert all(p.dtype == torch.float32 for p in net.parameters())
        assert all(s["exp_avg_sq"].dtype == torch.float32 for s in opt.state.values())
    assert stats["bf16"].loss != stats["fp32"].loss  # it did run in bf16
    assert stats["bf16"].loss == pytest.approx(stats["fp32"].loss, rel=0.05)


def test_channels_last_gives_the_contiguous_result():
    model, images, labels = _cnn_and_data()
    twin = build_model(compose("").model, compose("").dataset)
    twin.load_state_dict(model.state_dict())
    twin = twin.to(memory_format=torch.channels_last)
    for net, channels_last in ((model, False), (twin, True)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        train_steps(net, opt, _Batches(images, labels), 2, channels_last=channels_last)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    data = ImageTensors(images, labels)
    assert evaluate(model, [(data.images, data.labels)]).loss == pytest.approx(
        evaluate(twin, [(data.images, data.labels)], channels_last=True).loss, rel=1e-4)


def test_compile_key_reaches_the_fedact_optimizer_and_is_refused_elsewhere():
    cfg = compose(["algorithm=fedact", "algorithm.compile=true"])
    model = torch.nn.Linear(3, 2)
    named = list(model.named_parameters())
    optimizer = ALGORITHMS["fedact"].local(cfg.algorithm).make_optimizer(named)
    assert all(group["compile"] for group in optimizer.param_groups)
    with pytest.raises(ConfigError, match="algorithm.compile"):
        compose(["algorithm=fedavg", "algorithm.compile=true"])


def test_scaffold_keeps_float32_replies():
    """SCAFFOLD's server c must stay the mean of the clients' unrounded c_i."""
    with pytest.raises(ConfigError, match=r"reply_dtype='bfloat16': allowed float32 for algorithm=scaffold"):
        compose(["algorithm=scaffold", "reply_dtype=bfloat16"])
    assert compose(["algorithm=fedavg", "reply_dtype=bfloat16"]).reply_dtype == "bfloat16"


@pytest.mark.parametrize("override, key", [("precision=fp16", "precision"), ("wire_dtype=int8", "wire_dtype"),
                                           ("reply_dtype=float16", "reply_dtype")])
def test_bad_speed_option_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"{key}=.*allowed one of"):
        compose([override])
