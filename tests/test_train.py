"""fedact_app.train.evaluate against a plain per-batch loop."""

import torch
import torch.nn.functional as F

from fedact_app.train import evaluate


def test_evaluate_sums_on_the_device_equal_a_per_batch_loop():
    """Loss and accuracy summed on the device (float64 / int64) and read once equal the sums of
    per-batch Python floats and ints, bit for bit; batches of unequal size count by example."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    batches = [(torch.randn(n, 5), torch.randint(0, 3, (n,))) for n in (7, 7, 4)]
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for images, labels in batches:
            logits = model(images)
            loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(dim=1) == labels).sum())
    stats = evaluate(model, batches)
    assert stats.num_examples == 18
    assert stats.loss == loss_sum / 18
    assert stats.accuracy == correct / 18
    assert not model.training
