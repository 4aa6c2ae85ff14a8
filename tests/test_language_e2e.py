"""End to end: the language tasks through the real app (`flwr run` on a local simulation SuperLink).

Tiny offline settings: a random llama_tiny (bytes tokenizer), 2 SuperNodes, 2 rounds, local data
written here. A module fixture runs them on the session's engine as a sweep runs its jobs (conftest.py
``on_flower_engine``, as tests/test_e2e.py) inside the first test's setup.
"""

import json
import math
import sysconfig
from pathlib import Path

import pytest
from safetensors import safe_open


pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
APP_DIR = Path(__file__).resolve().parents[1]
SHORT = ("partition=iid num_rounds=2 num_clients=2 fraction_train=1.0 min_train_nodes=2 batch_size=4 local_steps=5 "
         "language.eval_batches=4")
LORA = "model=lora_causal_lm model.base=llama_tiny model.lora.rank=4 model.lora.alpha=8"


def write_data(root: Path) -> dict[str, Path]:
    """A few KB of stdlib source as text; made-up Alpaca and HH-RLHF rows."""
    text = root / "text"
    text.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "colorsys.py", "bisect.py", "heapq.py"):
        (text / f"{name}.txt").write_text((stdlib / name).read_text()[:6000])
    alpaca = root / "alpaca.jsonl"
    with alpaca.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"instruction": f"Add {i} and one.", "input": "" if i % 2 else f"The number {i}.",
                                "output": f"The sum is {i + 1}."}) + "\n")
    hh = root / "hh.jsonl"
    with hh.open("w") as f:
        for i in range(40):
            prompt = f"\n\nHuman: Hello!\n\nAssistant: Hi.\n\nHuman: What is {i} plus one?"
            f.write(json.dumps({"chosen": f"{prompt}\n\nAssistant: It is {i + 1}.",
                                "rejected": f"{prompt}\n\nAssistant: Go away."}) + "\n")
    return {"text": text, "alpaca": alpaca, "hh": hh}


def jobs(data: dict[str, Path]) -> dict[str, str]:
    pretrain = f"task=lm_pretrain model=llama_tiny dataset=text dataset.path={data['text']} language.seq_len=64"
    return {
        "pretrain-fedact": f"{pretrain} algorithm=fedact algorithm.lr=3e-3 {SHORT}",
        "pretrain-fedavg": f"{pretrain} algorithm=fedavg algorithm.lr=0.5 {SHORT}",
        "sft-fedact": (f"task=sft {LORA} dataset=alpaca_gpt4 dataset.path={data['alpaca']} "
                       f"dataset.validation_fraction=0.2 language.max_length=256 algorithm.lr=1e-3 {SHORT}"),
        "dpo-fedact": (f"task=dpo {LORA} dataset=hh_rlhf dataset.path={data['hh']} dataset.validation_fraction=0.2 "
                       f"language.max_length=320 language.max_prompt_length=256 algorithm.lr=1e-3 {SHORT}"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, flower_engine, on_flower_engine) -> dict:
    """name -> (run folder, RunResult or exception)."""
    base = tmp_path_factory.mktemp("lm_runs")
    specs = jobs(write_data(base))

    def run(name):
        output = base / name
        try:
            result = flower_engine.run(APP_DIR, overrides=f"{specs[name]} output_dir={output}", num_supernodes=2,
                                       timeout=600)  # offline: conftest.py sets HF_*_OFFLINE
        except Exception as err:  # reported by the tests of this job only
            result = err
        return name, output, result

    return {name: (output, result) for name, output, result in on_flower_engine(run, sorted(specs))}


def finished(runs, name) -> tuple[Path, list[dict], dict]:
    output, result = runs[name]
    if isinstance(result, Exception):
        raise result
    assert result.completed, f"{result.status} {result.details}\n{result.tail(80)}"
    (folder,) = list(output.iterdir())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["clients"] == 2 and r["rejected"] == 0 for r in rows[1:])
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["test_loss"]) for r in rows[1:])
    print(f"{name}: {result.seconds:.0f} s")
    return folder, rows, json.loads((folder / "summary.json").read_text())


def saved_keys(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("name", ["pretrain-fedact", "pretrain-fedavg"])
def test_pretraining_lowers_validation_perplexity(name, runs):
    folder, rows, summary = finished(runs, name)
    assert rows[-1]["test_perplexity"] < rows[0]["test_perplexity"]
    assert summary["final_test_perplexity"] == rows[-1]["test_perplexity"]
    assert summary["best_test_perplexity"] == min(r["test_perplexity"] for r in rows)
    assert math.isnan(summary["final_test_accuracy"])
    assert "lm_head.weight" in saved_keys(folder)


def test_sft_sends_only_the_lora_adapters(runs):
    folder, rows, summary = finished(runs, "sft-fedact")
    keys = saved_keys(folder)
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)
    adapter_bytes = 4 * 2 * 2 * (4 * 64 + 64 * 4)  # float32 x layers x (q, v) x (A, B)
    base_bytes = 4 * 133_824  # llama_tiny's parameters
    # round 1: the global adapters to each of the 2 nodes (plus record overhead), far from the base
    assert 2 * adapter_bytes <= rows[1]["bytes_sent"] < 2 * adapter_bytes + 64 * 1024 < base_bytes
    assert all(math.isfinite(r[k]) for r in rows
               for k in ("test_perplexity", "test_token_accuracy", "test_response_nll"))
    assert summary["final_test_perplexity"] == rows[-1]["test_perplexity"]


def test_dpo_reports_preference_metrics(runs):
    folder, rows, summary = finished(runs, "dpo-fedact")
    assert all("lora_A" in k or "lora_B" in k for k in saved_keys(folder))
    assert rows[0]["test_loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at the start
    assert all(math.isfinite(r[k]) for r in rows
               for k in ("test_preference_accuracy", "test_reward_margin", "test_policy_gap"))
    assert summary["final_test_preference_accuracy"] == rows[-1]["test_preference_accuracy"]
