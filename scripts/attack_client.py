"""The project's ClientApp, except that the client of partition 0 forges its model update in every
round it trains; the rest of its reply (v, the metrics) stays honest. scripts/attack.py copies
this file into an app folder with ``ATTACK`` set to one of ``ATTACKS``:

    scale   Delta x 1e4
    flip    -10 x Delta (a sign flip that also grows)
    push    a step toward a fixed target model, as long as its honest Delta:
            ||Delta|| (target - x^r) / ||target - x^r||; no larger than an honest update, so no
            norm bound can tell it apart, it pulls the same way every round
"""

import torch
from flwr.clientapp import ClientApp

from fedact_app import client_app, client_work
from fedact_app.wire import from_wire, packed_record, to_wire, unpacked

ATTACKS = ("scale", "flip", "push")
ATTACK = "scale"  # scripts/attack.py sets the run's attack here
ATTACKER = 0  # the partition-id of the forging client
TARGET_SEED = 1234  # the target model: N(0, 0.1^2) weights from this seed

app = ClientApp()
app.query()(client_app.identify)


def target_model(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fixed model of x's floating entries, the same in every round and process."""
    gen = torch.Generator().manual_seed(TARGET_SEED)
    return {name: 0.1 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
            for name, t in sorted(x.items()) if t.is_floating_point()}


def forge(attack: str, delta: dict[str, torch.Tensor], x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forged update of ``attack`` from the honest ``delta`` and the global model ``x``;
    integer entries (``num_batches_tracked``) stay honest."""
    floating = [name for name, t in delta.items() if t.is_floating_point()]
    if attack == "scale":
        return {**delta, **{name: delta[name] * 1e4 for name in floating}}
    if attack == "flip":
        return {**delta, **{name: delta[name] * -10.0 for name in floating}}
    if attack == "push":
        target = target_model(x)
        toward = {name: target[name] - x[name] for name in floating}
        norm = torch.sqrt(sum((delta[name].double() ** 2).sum() for name in floating))
        distance = torch.sqrt(sum((toward[name].double() ** 2).sum() for name in floating))
        return {**delta, **{name: (toward[name] * (norm / distance)).to(delta[name].dtype) for name in floating}}
    raise ValueError(f"unknown attack {attack!r}: allowed {', '.join(ATTACKS)}")


@app.train()
def train(msg, context):
    reply = client_app.train(msg, context)
    if reply.has_error() or int(context.node_config["partition-id"]) != ATTACKER:
        return reply
    reply_dtype = client_work.run_config(context).reply_dtype  # the run's wire format
    delta = from_wire(unpacked(reply.content["delta"]), reply_dtype)
    x = unpacked(msg.content["model"])
    reply.content["delta"] = packed_record(to_wire(forge(ATTACK, delta, x), reply_dtype))
    return reply
